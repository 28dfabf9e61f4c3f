"""How the e2e harness wires vramguard in: scheduler configs, webhook config, RBAC, certs, processes."""

from __future__ import annotations

import base64
import ipaddress
import re
import sys
import time
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from e2e import gpu_nodes, services
from e2e.certs import CertificateAuthority
from e2e.cluster import kubeconfig_document, token_auth_line
from e2e.procs import ManagedProcess, free_ports, group_members

SHIPPED = [services.DEFAULT_SCHEDULER_CONFIG, services.SECOND_SCHEDULER_CONFIG]
# k8s.io/apimachinery IsQualifiedName: optional DNS-subdomain prefix, then a 63-char name.
_QUALIFIED_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)


# kube-scheduler's defaults when clientConnection leaves them out: they throttle a wave of GPU pods.
DEFAULT_QPS, DEFAULT_BURST = 50, 100


IN_CLUSTER = [Path("manifests/base/scheduler-config.yaml"), Path("charts/vramguard/files/scheduler-config.yaml")]


@pytest.mark.parametrize("path", [*SHIPPED, *IN_CLUSTER], ids=str)
def test_shipped_scheduler_configs_set_the_api_rate_limit(path: Path) -> None:
    root = Path(__file__).resolve().parent.parent
    connection = services.load_yaml(path if path.is_absolute() else root / path)["clientConnection"]
    reference = services.load_yaml(services.SECOND_SCHEDULER_CONFIG)["clientConnection"]
    assert connection["qps"] > DEFAULT_QPS and connection["burst"] > DEFAULT_BURST
    assert (connection["qps"], connection["burst"]) == (reference["qps"], reference["burst"]), "one setting everywhere"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: path.name)
def test_the_stock_scheduler_compared_with_gets_the_same_rate_limit(path: Path, tmp_path: Path) -> None:
    shipped = services.load_yaml(path)
    stock = services.localize_scheduler_config(services.plain_scheduler_config(shipped), kubeconfig=tmp_path / "k",
                                               extender_url=None, ca_b64=None)
    local = services.localize_scheduler_config(shipped, kubeconfig=tmp_path / "k", extender_url="https://x:1",
                                               ca_b64="Y2E=")
    for key in ("qps", "burst"):
        assert stock["clientConnection"][key] == local["clientConnection"][key] == shipped["clientConnection"][key]
    assert "extenders" not in stock


def test_a_subset_of_verbs_leaves_the_others_out_and_as_shipped_keeps_them_all(tmp_path: Path) -> None:
    shipped = services.load_yaml(services.SECOND_SCHEDULER_CONFIG)
    args = {"kubeconfig": tmp_path / "k", "extender_url": "https://x:1", "ca_b64": "Y2E="}
    (whole,) = services.localize_scheduler_config(shipped, **args)["extenders"]
    assert {key: whole[key] for key in services.EXTENDER_VERB_KEYS} == {
        "filterVerb": "filter", "prioritizeVerb": "prioritize", "bindVerb": "bind", "preemptVerb": "preempt"}
    (some,) = services.localize_scheduler_config(shipped, verbs=["filter", "bind"], **args)["extenders"]
    assert [key for key in services.EXTENDER_VERB_KEYS if key in some] == ["filterVerb", "bindVerb"]
    assert some.get("managedResources") == whole.get("managedResources") and some["weight"] == whole["weight"]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: path.name)
def test_shipped_scheduler_configs_declare_the_extender(path: Path) -> None:
    config = services.load_yaml(path)
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["kind"] == "KubeSchedulerConfiguration"
    (extender,) = config["extenders"]
    assert (extender["filterVerb"], extender["prioritizeVerb"], extender["bindVerb"], extender["preemptVerb"]) == (
        "filter",
        "prioritize",
        "bind",
        "preempt",
    )
    assert extender["enableHTTPS"] is True
    assert extender["nodeCacheCapable"] is True
    assert extender["weight"] > 0
    assert re.fullmatch(r"\d+(ms|s)", extender["httpTimeout"])
    if path == services.SECOND_SCHEDULER_CONFIG:
        assert "managedResources" not in extender, "its own pods all reach the extender, claim pods included"
        return
    names = [resource["name"] for resource in extender["managedResources"]]
    assert len(names) == len(set(names)), "kube-scheduler rejects duplicate managed resources"
    assert {"nvidia.com/gpu", "nvidia.com/gpu.shared"} <= set(names)
    for resource in extender["managedResources"]:
        assert _QUALIFIED_NAME.match(resource["name"]), resource["name"]
        assert resource["ignoredByScheduler"] is False


def test_every_modelled_mig_profile_is_managed() -> None:
    config = services.load_yaml(services.DEFAULT_SCHEDULER_CONFIG)
    managed = {resource["name"] for resource in config["extenders"][0]["managedResources"]}
    profiles = {profile.resource for model in gpu_nodes.GPU_MODELS.values() for profile in model.mig_profiles}
    assert profiles <= managed


def test_the_two_scheduler_configs_share_the_extender() -> None:
    default, second = (services.load_yaml(path) for path in SHIPPED)
    (default_extender,), (second_extender,) = default["extenders"], second["extenders"]
    assert {key: value for key, value in default_extender.items() if key != "managedResources"} == second_extender
    assert [p["schedulerName"] for p in default["profiles"]] == ["default-scheduler"]
    assert [p["schedulerName"] for p in second["profiles"]] == [services.SECOND_SCHEDULER_NAME]
    assert second["leaderElection"]["resourceName"] != "kube-scheduler"


def test_localized_scheduler_config_points_at_the_local_extender(tmp_path: Path) -> None:
    shipped = services.load_yaml(services.DEFAULT_SCHEDULER_CONFIG)
    shipped["extenders"][0]["urlPrefix"] = "https://vramguard.example:8443/scheduler/"
    local = services.localize_scheduler_config(
        shipped, kubeconfig=tmp_path / "k", extender_url="https://127.0.0.1:4443", ca_b64="Q0E="
    )
    extender = local["extenders"][0]
    assert extender["urlPrefix"] == "https://127.0.0.1:4443/scheduler"
    assert extender["tlsConfig"] == {"insecure": False, "caData": "Q0E="}
    assert extender["managedResources"] == shipped["extenders"][0]["managedResources"]
    assert local["clientConnection"]["kubeconfig"] == str(tmp_path / "k")
    assert local["leaderElection"] == {"leaderElect": False}
    assert shipped["extenders"][0]["urlPrefix"].startswith("https://vramguard.example"), "input untouched"


def test_localized_scheduler_presents_its_client_certificate(tmp_path: Path) -> None:
    # The extender requires mutual TLS: without certFile/keyFile every scheduler call is refused.
    shipped = services.load_yaml(services.SECOND_SCHEDULER_CONFIG)
    cert, key = tmp_path / "scheduler.crt", tmp_path / "scheduler.key"
    local = services.localize_scheduler_config(
        shipped,
        kubeconfig=tmp_path / "k",
        extender_url="https://127.0.0.1:4443",
        ca_b64="Q0E=",
        client_cert=(cert, key),
    )
    assert local["extenders"][0]["tlsConfig"] == {
        "insecure": False,
        "caData": "Q0E=",
        "certFile": str(cert),
        "keyFile": str(key),
    }


def test_extender_command_line_requires_client_certificates(tmp_path: Path) -> None:
    argv = services.service_argv(
        ["vramguard"],
        "extender",
        port=4443,
        tls_cert=tmp_path / "c",
        tls_key=tmp_path / "k",
        kubeconfig=tmp_path / "kc",
        policy=None,
        client_ca=tmp_path / "ca.crt",
        ops_port=4080,
    )
    assert argv[argv.index("--client-ca") + 1] == str(tmp_path / "ca.crt")
    assert argv[argv.index("--ops-listen") + 1] == "127.0.0.1:4080"
    assert argv[argv.index("--listen") + 1] == "127.0.0.1:4443"


def test_without_extender_the_profile_runs_plain(tmp_path: Path) -> None:
    shipped = services.load_yaml(services.SECOND_SCHEDULER_CONFIG)
    local = services.localize_scheduler_config(shipped, kubeconfig=tmp_path / "k", extender_url=None, ca_b64=None)
    assert "extenders" not in local
    assert local["profiles"] == shipped["profiles"]


def test_webhook_configuration_keeps_paths_and_gets_ca_bundle() -> None:
    config = services.default_webhook_configuration()
    local = services.localize_webhook_configuration(config, webhook_url="https://127.0.0.1:9443", ca_b64="Q0E=")
    (webhook,) = local["webhooks"]
    assert webhook["clientConfig"] == {"url": "https://127.0.0.1:9443/validate", "caBundle": "Q0E="}
    assert config["webhooks"][0]["clientConfig"]["service"]["path"] == "/validate", "input untouched"


def test_manifest_objects_are_used_when_present(tmp_path: Path) -> None:
    (tmp_path / "rbac.yaml").write_text(
        yaml.safe_dump_all(
            [
                {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "vg-extender", "namespace": "vg"}},
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "ClusterRoleBinding",
                    "metadata": {"name": "vg-extender"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "vg"},
                    "subjects": [{"kind": "ServiceAccount", "name": "vg-extender", "namespace": "vg"}],
                },
            ]
        )
    )
    (tmp_path / "chart" / "templates").mkdir(parents=True)
    (tmp_path / "chart" / "templates" / "sa.yaml").write_text("kind: ServiceAccount\nmetadata: {name: {{ x }}}\n")
    extender = services.service_identity("extender", tmp_path)
    webhook = services.service_identity("webhook", tmp_path)
    assert extender == services.ServiceIdentity("vg", "vg-extender")
    assert webhook == services.ServiceIdentity(services.DEFAULT_NAMESPACE, "vramguard-webhook")
    objects = services.rbac_objects([extender, webhook], tmp_path)
    kinds = [obj["kind"] for obj in objects]
    assert kinds == ["Namespace", "Namespace", "ServiceAccount", "ClusterRoleBinding", "ClusterRoleBinding"]
    fallback = objects[-1]
    assert fallback["roleRef"]["name"] == "cluster-admin"
    assert fallback["subjects"][0]["name"] == "vramguard-webhook"
    for obj in objects:
        assert services.object_path(obj).startswith(("/api/", "/apis/"))


def test_the_harness_creates_the_shipped_flow_schemas() -> None:
    """The cluster the e2e tests and benchmarks run gets the API priority levels an install gets."""
    identities = [services.service_identity("extender"), services.service_identity("webhook")]
    objects = services.rbac_objects(identities)
    schemas = {obj["metadata"]["name"] for obj in objects if obj["kind"] == "FlowSchema"}
    assert {"vramguard-extender", "vramguard-extender-leader-election"} <= schemas
    for obj in objects:
        assert services.object_path(obj).startswith(("/api/", "/apis/"))


def test_serving_certificate_has_ip_san_and_chains_to_the_ca(tmp_path: Path) -> None:
    ca = CertificateAuthority.create("test-ca")
    pair = ca.issue_localhost_server("vramguard-extender")
    cert = x509.load_pem_x509_certificate(pair.cert_pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)
    cert.verify_directly_issued_by(ca.cert)
    pair.write(tmp_path / "tls.crt", tmp_path / "tls.key")
    assert (tmp_path / "tls.key").stat().st_mode & 0o077 == 0
    assert base64.b64decode(ca.cert_b64) == ca.cert_pem
    ca.write(tmp_path / "ca.crt", tmp_path / "ca.key")
    assert CertificateAuthority.load(tmp_path / "ca.crt", tmp_path / "ca.key").cert == ca.cert


def test_token_file_and_kubeconfig_formats() -> None:
    assert token_auth_line("t", "admin", "1", ["system:masters", "x"]) == 't,admin,1,"system:masters,x"'
    assert token_auth_line("t", "system:kube-scheduler", "2") == "t,system:kube-scheduler,2"
    doc = kubeconfig_document(server="https://127.0.0.1:1", ca_b64="Q0E=", user="u", token="t", name="c")
    assert doc["current-context"] == "c"
    assert doc["users"][0]["user"] == {"token": "t"}


def test_free_ports_are_distinct() -> None:
    ports = free_ports(7)
    assert len(set(ports)) == 7


def test_stopping_a_process_stops_its_whole_group(tmp_path: Path) -> None:
    script = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    proc = ManagedProcess.start(
        "sleeper",
        [sys.executable, "-c", script],
        log_path=tmp_path / "logs" / "sleeper.log",
        pid_dir=tmp_path / "pids",
        cwd=tmp_path,
    )
    pgid = proc.record.pid
    assert (tmp_path / "pids" / "sleeper.pid").read_text().strip() == str(pgid)
    deadline = 50
    while len(group_members([pgid])) < 2 and deadline:
        deadline -= 1
        time.sleep(0.1)
    assert len(group_members([pgid])) == 2, "the child runs in the component's process group"
    proc.stop(timeout=5)
    assert group_members([pgid]) == []
    assert proc.exited() is not None


def test_the_scale_up_rights_come_only_with_the_policy_that_uses_them() -> None:
    # The harness creates the manifests' RBAC as an installation would: the optional scale-up
    # components only where the cluster's policy turns scale-up on, so least-privilege checks hold.
    identities = [services.service_identity("extender")]

    def roles(autoscaler: str) -> set[str]:
        return {o["metadata"]["name"] for o in services.rbac_objects(identities, autoscaler=autoscaler)
                if o["kind"] == "ClusterRole"}

    assert not roles("none") & {"vramguard-extender-scale-up", "vramguard-extender-node-labels"}
    assert roles("cluster-autoscaler") - roles("none") == {"vramguard-extender-scale-up"}
    assert roles("karpenter") - roles("none") == {"vramguard-extender-scale-up", "vramguard-extender-node-labels"}
