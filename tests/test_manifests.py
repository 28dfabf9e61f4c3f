"""The shipped manifests: kustomize base and overlays, the Helm chart, the Grafana dashboard.

Rendering uses ``kustomize`` (or ``kubectl kustomize``) and ``helm`` when they are installed
(``$KUSTOMIZE`` and ``$HELM`` may name them); without them a small renderer reads what it can of a
kustomization (its resources, ConfigMap generators and ``$patch: delete`` patches), so the
structure is checked on every machine. The e2e suite applies the same objects to a real API server.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from vramguard.policy import Policy

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "manifests"
BASE = MANIFESTS / "base"
DEFAULT_SCHEDULER = MANIFESTS / "overlays" / "default-scheduler"
CHART = ROOT / "charts" / "vramguard"
NAMESPACE = "vramguard-system"
WORKLOAD_KINDS = ("Deployment", "DaemonSet", "StatefulSet")
JSON = dict[str, Any]

# -------------------------------------------------------------------------------- rendering


def kustomize_command() -> list[str] | None:
    """``kustomize build`` or ``kubectl kustomize``, whichever is installed."""
    explicit = os.environ.get("KUSTOMIZE") or shutil.which("kustomize")
    if explicit:
        return [explicit, "build"]
    kubectl = shutil.which("kubectl")
    return [kubectl, "kustomize"] if kubectl else None


def helm_command() -> str | None:
    """The ``helm`` binary, if installed."""
    return os.environ.get("HELM") or shutil.which("helm")


def render_kustomization(directory: Path) -> list[JSON]:
    """The objects a kustomization renders (with kustomize when installed)."""
    command = kustomize_command()
    if command is not None:
        output = subprocess.run([*command, str(directory)], capture_output=True, text=True, check=True).stdout
        return [d for d in yaml.safe_load_all(output) if d]
    return _render_fallback(directory)


def _render_fallback(directory: Path) -> list[JSON]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects: list[JSON] = []
    for resource in kustomization.get("resources") or []:
        path = (directory / resource).resolve()
        if path.is_dir():
            objects.extend(_render_fallback(path))
        else:
            objects.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    for generator in kustomization.get("configMapGenerator") or []:
        data = {}
        for entry in generator.get("files") or []:
            key, _, source = entry.partition("=")
            data[key if source else Path(key).name] = (directory / (source or key)).read_text()
        metadata = {"name": generator["name"]}
        if generator.get("namespace"):
            metadata["namespace"] = generator["namespace"]
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
    for patch in kustomization.get("patches") or []:
        body = yaml.safe_load(patch.get("patch", "")) if isinstance(patch.get("patch"), str) else None
        if isinstance(body, dict) and body.get("$patch") == "delete":
            objects = [o for o in objects if not _same(o, body)]
    return objects


def _same(obj: Mapping[str, Any], ref: Mapping[str, Any]) -> bool:
    return obj.get("kind") == ref.get("kind") and obj["metadata"]["name"] == ref["metadata"]["name"]


CLUSTER_VERSION = "v1.36.3"
"""The Kubernetes version ``helm template`` renders for (what ``helm install`` reads from the cluster)."""


def render_chart(*values: str, kube_version: str = CLUSTER_VERSION) -> list[JSON]:
    """``helm template`` of the chart with ``--set`` values (skips without helm)."""
    helm = helm_command()
    if helm is None:
        pytest.skip("helm is not installed")
    args = [helm, "template", "vramguard", str(CHART), "--namespace", NAMESPACE, "--kube-version", kube_version]
    for value in values:
        args += ["--set", value]
    output = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(output) if d]


def in_cluster_scheduler_config(source: Mapping[str, Any]) -> JSON:
    """``manifests/scheduler/second-scheduler.yaml`` as the in-cluster second scheduler reads it.

    The differences are explained at the top of ``manifests/base/scheduler-config.yaml``.
    """
    config = copy.deepcopy(dict(source))
    connection = config.get("clientConnection") or {}
    connection.pop("kubeconfig", None)
    if connection:
        config["clientConnection"] = connection
    else:
        config.pop("clientConnection", None)
    config.setdefault("leaderElection", {})["resourceNamespace"] = NAMESPACE
    for extender in config.get("extenders") or []:
        extender["urlPrefix"] = "https://127.0.0.1:8443"
        tls = extender.setdefault("tlsConfig", {})
        tls["caFile"] = "/etc/vramguard/extender-tls/ca.crt"
        tls["certFile"] = "/etc/vramguard/scheduler-client/tls.crt"
        tls["keyFile"] = "/etc/vramguard/scheduler-client/tls.key"
    return config


def load(path: Path) -> Any:
    """One YAML document."""
    return yaml.safe_load(path.read_text())


def pod_specs(objects: list[JSON]) -> Iterator[tuple[str, JSON]]:
    """(workload name, pod spec) of every workload."""
    for obj in objects:
        if obj.get("kind") in WORKLOAD_KINDS:
            yield obj["metadata"]["name"], obj["spec"]["template"]["spec"]


RENDERINGS: dict[str, Callable[[], list[JSON]]] = {
    "base": lambda: render_kustomization(BASE),
    "default-scheduler": lambda: render_kustomization(DEFAULT_SCHEDULER),
    "helm": render_chart,
    "helm-default-scheduler": lambda: render_chart("mode=default-scheduler", "certManager.enabled=true"),
}


@pytest.fixture(scope="module", params=sorted(RENDERINGS))
def rendered(request: pytest.FixtureRequest) -> list[JSON]:
    """Each rendering of the manifests in turn."""
    return RENDERINGS[request.param]()


# -------------------------------------------------------------------------------- sources


def test_scheduler_config_is_the_shipped_second_scheduler_config() -> None:
    source = load(MANIFESTS / "scheduler" / "second-scheduler.yaml")
    assert load(BASE / "scheduler-config.yaml") == in_cluster_scheduler_config(source), (
        "manifests/base/scheduler-config.yaml drifted from manifests/scheduler/second-scheduler.yaml; "
        "regenerate it with tests/test_manifests.py:in_cluster_scheduler_config"
    )


@pytest.mark.parametrize(
    ("copy_path", "original"),
    [
        (BASE / "policy.yaml", ROOT / "vramguard" / "default_policy.yaml"),
        (CHART / "files" / "policy.yaml", ROOT / "vramguard" / "default_policy.yaml"),
        (CHART / "files" / "scheduler-config.yaml", BASE / "scheduler-config.yaml"),
        (CHART / "files" / "validating-webhook.yaml", MANIFESTS / "webhook" / "validating-webhook.yaml"),
        (CHART / "files" / "mutating-webhook.yaml", MANIFESTS / "webhook" / "mutating-webhook.yaml"),
        (CHART / "files" / "admission-policies.yaml", MANIFESTS / "webhook" / "admission-policies.yaml"),
        (CHART / "files" / "agent-node-scope.yaml", BASE / "agent-node-scope.yaml"),
        (CHART / "files" / "routing-policy.yaml", BASE / "routing-policy.yaml"),
        (CHART / "files" / "alerts.yaml", MANIFESTS / "monitoring" / "vramguard-alerts.yaml"),
    ],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_copies_match_their_original(copy_path: Path, original: Path) -> None:
    # kustomize and Helm cannot read files outside their directories, so these are copies.
    fix = f"cp {original.relative_to(ROOT)} {copy_path.relative_to(ROOT)}"
    assert copy_path.read_text() == original.read_text(), fix


def policies_rendered(objects: list[JSON]) -> Policy:
    config_map = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "vramguard-policy")
    return Policy.from_yaml(config_map["data"]["policy.yaml"])


def test_each_layout_names_its_scheduler_in_the_policy() -> None:
    # The extender binds only the pods of the schedulers the policy names: the wrong name there
    # leaves every GPU pod Pending (or lets pods of an unwired scheduler past the webhook).
    assert policies_rendered(render_kustomization(BASE)).schedulers == ("vramguard",)
    assert policies_rendered(render_kustomization(DEFAULT_SCHEDULER)).schedulers == ("default-scheduler",)
    overlay = (DEFAULT_SCHEDULER / "policy.yaml").read_text()
    default = (ROOT / "vramguard" / "default_policy.yaml").read_text()
    assert overlay == default.replace("\nschedulers: [vramguard]\n", "\nschedulers: [default-scheduler]\n") != default


def test_helm_policy_names_the_scheduler_of_its_mode() -> None:
    assert policies_rendered(render_chart()).schedulers == ("vramguard",)
    assert policies_rendered(render_chart("mode=default-scheduler")).schedulers == ("default-scheduler",)


def test_every_yaml_file_under_manifests_holds_whole_objects() -> None:
    # Patches live inline in kustomization.yaml: tools that read the directory file by file (the
    # e2e harness applies every RBAC object it finds) must never meet a partial object.
    for path in sorted(MANIFESTS.rglob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if not isinstance(document, dict) or "kind" not in document:
                continue  # a data file (the policy), not an object
            if document["kind"] in ("Kustomization", "Component"):
                continue
            assert document.get("apiVersion"), path
            named = (document.get("metadata") or {}).get("name")
            assert named or document["kind"] == "KubeSchedulerConfiguration", path


def test_kustomization_resources_exist() -> None:
    for directory in (BASE, DEFAULT_SCHEDULER, MANIFESTS / "overlays" / "cert-manager"):
        kustomization = load(directory / "kustomization.yaml")
        for resource in kustomization.get("resources") or []:
            assert (directory / resource).exists(), f"{directory.name}: {resource}"


# -------------------------------------------------------------------------------- structure


def test_base_has_the_components(rendered: list[JSON]) -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in rendered}
    assert ("ValidatingWebhookConfiguration", "vramguard") in kinds
    assert ("DaemonSet", "vramguard-agent") in kinds
    assert ("Deployment", "vramguard-webhook") in kinds
    assert ("PodDisruptionBudget", "vramguard-webhook") in kinds
    assert ("ConfigMap", "vramguard-policy") in kinds
    assert ("Service", "vramguard-extender") in kinds
    assert ("Deployment", "vramguard-scheduler") in kinds or ("Deployment", "vramguard-extender") in kinds


def test_every_container_is_hardened_and_sized(rendered: list[JSON]) -> None:
    for workload, spec in pod_specs(rendered):
        pod_context = spec.get("securityContext") or {}
        assert pod_context.get("seccompProfile", {}).get("type") == "RuntimeDefault", workload
        for container in spec["containers"]:
            where = f"{workload}/{container['name']}"
            context = container.get("securityContext") or {}
            assert context.get("allowPrivilegeEscalation") is False, where
            assert context.get("readOnlyRootFilesystem") is True, where
            assert context.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not context.get("capabilities", {}).get("add"), where
            assert not context.get("privileged"), where
            if workload != "vramguard-agent":
                # The agent is uid 0 without capabilities, for the kubelet's root-owned socket.
                assert (context.get("runAsNonRoot") or pod_context.get("runAsNonRoot")) is True, where
                assert (context.get("runAsUser") or pod_context.get("runAsUser") or 0) != 0, where
            resources = container.get("resources") or {}
            assert resources.get("requests", {}).get("cpu") and resources["requests"].get("memory"), where
            assert resources.get("limits", {}).get("memory"), where
            assert container.get("readinessProbe") and container.get("livenessProbe"), where
            image = container["image"]
            assert ":" in image and not image.endswith(":latest"), where


def test_writable_paths_are_volumes(rendered: list[JSON]) -> None:
    for workload, spec in pod_specs(rendered):
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        for container in spec["containers"]:
            for mount in container.get("volumeMounts") or []:
                assert mount["name"] in volumes, f"{workload}: {mount['name']}"
                volume = volumes[mount["name"]]
                if "hostPath" in volume:
                    assert mount.get("readOnly") is True, f"{workload}: hostPath mounted writable"


KEPT_SECRETS = ["vramguard-ca", "vramguard-webhook-tls", "vramguard-extender-tls", "vramguard-scheduler-client-tls"]


def test_nobody_reads_secrets_and_no_wildcards(rendered: list[JSON]) -> None:
    """Only the certificate keeper touches Secrets: it creates them (a verb RBAC cannot limit by
    name), and reads and replaces only the four it keeps, in its own namespace. It lists nothing."""
    for role in (o for o in rendered if o["kind"] in ("ClusterRole", "Role")):
        for rule in role.get("rules") or []:
            name = role["metadata"]["name"]
            if "secrets" in rule.get("resources", []):
                assert (role["kind"], name) == ("Role", "vramguard-certificates"), name
                assert rule["resources"] == ["secrets"], name
                assert rule["verbs"] == ["create"] or (
                    rule["verbs"] == ["get", "update"] and rule.get("resourceNames") == KEPT_SECRETS
                ), rule
            assert "*" not in rule.get("resources", []) and "*" not in rule.get("verbs", []), name
            assert "*" not in rule.get("apiGroups", []), name


def test_bindings_name_existing_service_accounts(rendered: list[JSON]) -> None:
    accounts = {
        (o["metadata"].get("namespace"), o["metadata"]["name"]) for o in rendered if o["kind"] == "ServiceAccount"
    }
    for binding in (o for o in rendered if o["kind"] in ("ClusterRoleBinding", "RoleBinding")):
        for subject in binding["subjects"]:
            assert (subject["namespace"], subject["name"]) in accounts, binding["metadata"]["name"]
    used = {(w["metadata"]["namespace"], w["spec"]["template"]["spec"]["serviceAccountName"])
            for w in rendered if w["kind"] in WORKLOAD_KINDS}
    assert used <= accounts


def test_workloads_mount_existing_configmaps(rendered: list[JSON]) -> None:
    configmaps = {o["metadata"]["name"] for o in rendered if o["kind"] == "ConfigMap"}
    for workload, spec in pod_specs(rendered):
        for volume in spec.get("volumes") or []:
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps, workload


def test_second_scheduler_calls_its_sidecar_over_tls() -> None:
    objects = render_kustomization(BASE)
    config_map = next(o for o in objects if o["metadata"]["name"].startswith("vramguard-scheduler-config"))
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    extender = config["extenders"][0]
    assert extender["urlPrefix"] == "https://127.0.0.1:8443"
    assert extender["tlsConfig"]["serverName"] == "vramguard-extender.vramguard-system.svc"
    assert config["profiles"] == [{"schedulerName": "vramguard"}]
    assert "kubeconfig" not in (config.get("clientConnection") or {})
    deployment = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "vramguard-scheduler"
    )
    containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
    assert containers["kube-scheduler"]["image"].startswith("registry.k8s.io/kube-scheduler:v1.")
    # The verbs listen on loopback, behind mutual TLS; probes and metrics on their own port.
    args = containers["extender"]["args"]
    assert "--listen=127.0.0.1:8443" in args
    assert "--client-ca=/etc/vramguard/tls/ca.crt" in args
    assert "--ops-listen=0.0.0.0:8080" in args
    # kube-scheduler's own leader election picks the one sidecar that is called, and the one whose
    # background work runs: it follows the scheduler's Lease, as the scheduler configuration names it.
    assert "--leader-elect=false" in args
    election = config["leaderElection"]
    assert f"--scheduler-lease={election['resourceNamespace']}/{election['resourceName']}" in args
    assert extender["tlsConfig"]["certFile"] == "/etc/vramguard/scheduler-client/tls.crt"


def test_default_scheduler_overlay_drops_the_second_scheduler() -> None:
    objects = render_kustomization(DEFAULT_SCHEDULER)
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert not any("vramguard-scheduler" in name for _, name in names)
    assert ("Deployment", "vramguard-extender") in names
    deployment = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "vramguard-extender"
    )
    # Two replicas elect a leader; a rollout replaces both at once (a standby is never ready).
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": "100%", "maxUnavailable": "100%"}
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--leader-elect=true" in args and "--leader-elect-resource-name=vramguard-extender" in args
    role = next(o for o in objects if o["kind"] == "Role" and o["metadata"]["name"] == "vramguard-extender-leader")
    assert {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["vramguard-extender"],
            "verbs": ["get", "update"]} in role["rules"]
    assert deployment["spec"]["template"]["spec"]["priorityClassName"] == "vramguard-critical"
    assert ("PriorityClass", "vramguard-critical") in names


def test_webhook_reads_the_policy_configmap() -> None:
    command = kustomize_command()
    if command is None:
        pytest.skip("the JSON patches need kustomize")
    objects = render_kustomization(BASE)
    webhook = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "vramguard-webhook")
    container = webhook["spec"]["template"]["spec"]["containers"][0]
    assert "--policy=/etc/vramguard/policy/policy.yaml" in container["args"]


def test_helm_values_reach_the_objects() -> None:
    objects = render_chart("webhook.timeoutSeconds=7", "webhook.replicas=3", "image.repository=registry.example/vg")
    webhook = next(o for o in objects if o["kind"] == "ValidatingWebhookConfiguration")
    assert {w["timeoutSeconds"] for w in webhook["webhooks"]} == {7}
    deployment = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "vramguard-webhook")
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/vg:0.2.0"


def test_helm_matches_kustomize_for_rbac() -> None:
    def rules(objects: list[JSON]) -> dict[tuple[str, str], Any]:
        return {(o["kind"], o["metadata"]["name"]): o.get("rules") or o.get("roleRef")
                for o in objects if o["kind"] in ("ClusterRole", "Role", "ClusterRoleBinding", "RoleBinding")}

    assert rules(render_chart()) == rules(render_kustomization(BASE))
    assert rules(render_chart("mode=default-scheduler")) == rules(render_kustomization(DEFAULT_SCHEDULER))


def flow_schemas(objects: list[JSON]) -> dict[str, Any]:
    return {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "FlowSchema"}


def test_helm_matches_kustomize_for_flow_schemas() -> None:
    assert flow_schemas(render_chart()) == flow_schemas(render_kustomization(BASE))
    assert flow_schemas(render_chart("mode=default-scheduler")) == flow_schemas(render_kustomization(DEFAULT_SCHEDULER))
    assert flow_schemas(render_chart("flowSchemas.enabled=false")) == {}


@pytest.mark.parametrize("layout", [BASE, DEFAULT_SCHEDULER], ids=lambda p: p.name)
def test_the_control_plane_components_requests_get_the_schedulers_priority_levels(layout: Path) -> None:
    """Each vramguard workload that binds pods or holds a leader Lease is classified as kube-scheduler
    is: its Lease requests at leader-election, everything else at workload-high, ahead of the
    built-in service-accounts FlowSchema (workload-low, precedence 9000)."""
    rendered = render_kustomization(layout)
    schemas = sorted((o for o in rendered if o["kind"] == "FlowSchema"), key=lambda o: o["spec"]["matchingPrecedence"])
    accounts = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in rendered if o["kind"] == "ServiceAccount"}

    def level(account: tuple[str, str], request: dict[str, str]) -> str | None:
        for schema in schemas:
            for rule in schema["spec"]["rules"]:
                subjects = {(s["serviceAccount"]["namespace"], s["serviceAccount"]["name"]) for s in rule["subjects"]}
                if account not in subjects:
                    continue
                for r in rule.get("resourceRules") or []:
                    if (
                        {"*", request["group"]} & set(r["apiGroups"])
                        and {"*", request["resource"]} & set(r["resources"])
                        and {"*", request["verb"]} & set(r["verbs"])
                        and {"*", request["namespace"]} & set(r.get("namespaces") or [])
                    ):
                        assert schema["spec"]["matchingPrecedence"] < 9000
                        return str(schema["spec"]["priorityLevelConfiguration"]["name"])
        return None

    components = [w for w in rendered if w["kind"] == "Deployment" and w["metadata"]["name"] in
                  ("vramguard-extender", "vramguard-scheduler")]
    assert components
    for workload in components:
        account = (workload["metadata"]["namespace"], workload["spec"]["template"]["spec"]["serviceAccountName"])
        assert account in accounts
        lease = {"group": "coordination.k8s.io", "resource": "leases", "verb": "update",
                 "namespace": "vramguard-system"}
        binding = {"group": "", "resource": "pods/binding", "verb": "create", "namespace": "team-a"}
        assert level(account, lease) == "leader-election", workload["metadata"]["name"]
        assert level(account, binding) == "workload-high", workload["metadata"]["name"]
    for schema in (o for o in rendered if o["kind"] == "FlowSchema"):
        for rule in schema["spec"]["rules"]:
            for subject in rule["subjects"]:
                assert (subject["serviceAccount"]["namespace"], subject["serviceAccount"]["name"]) in accounts


# -------------------------------------------------------------------------------- alerts


def test_alert_rules_are_complete_and_use_exported_metrics() -> None:
    from prometheus_client import CollectorRegistry, generate_latest  # noqa: PLC0415

    from extender import metrics  # noqa: PLC0415 - the metric names come from the code
    from vramguard.io.cert_keeper import KeeperStatus  # noqa: PLC0415
    from vramguard.io.tls import CERTIFICATE_EXPIRY_METRIC  # noqa: PLC0415

    rules = [rule for group in load(MANIFESTS / "monitoring" / "vramguard-alerts.yaml")["groups"]
             for rule in group["rules"]]
    exprs = {rule["alert"]: rule["expr"] for rule in rules}
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
    assert CERTIFICATE_EXPIRY_METRIC in exprs["VramguardCertificateExpiringSoon"]
    assert "14 * 86400" in exprs["VramguardCertificateExpiringSoon"]
    keeper = exprs["VramguardCertificateKeeperFailing"]
    assert "vramguard_certificates_last_success_timestamp_seconds" in keeper
    collector = KeeperStatus(registry := CollectorRegistry())
    assert "vramguard_certificates_last_success_timestamp_seconds" in generate_latest(registry).decode(), collector
    assert exprs["VramguardWatchDead"] == "vramguard_watch_healthy == 0"
    assert "vramguard_watch_oversized_events_total" in exprs["VramguardWatchOversizedEvents"]
    assert exprs["VramguardExtenderNoLeader"] == "sum(vramguard_extender_leader) == 0"
    assert exprs["VramguardExtenderTwoLeaders"] == "sum(vramguard_extender_leader) > 1"
    assert "vramguard_extender_in_flight_oldest_seconds" in exprs["VramguardExtenderReservationsUnconfirmed"]
    exposed = {name for name, _ in (*metrics.NODE_FAMILIES, metrics.NODE_PODS, metrics.NODE_AGENT)}
    over = exprs["VramguardGpuOverReserved"]
    assert over.split()[0] in exposed, over
    assert exprs["VramguardAgentReportStale"].split("{")[0] in exposed
    assert 'vramguard_extender_unschedulable_pods{reason="vram"}' in exprs["VramguardGpuPodsPendingOnVram"]
    # absent() of a series each service always exports, whatever happened since it started.
    assert exprs["VramguardExtenderAbsent"] == "absent(vramguard_ledger_rendered_timestamp_seconds)"
    assert exprs["VramguardWebhookAbsent"] == "absent(vramguard_webhook_gpu_pods)"
    assert "apiserver_admission_webhook_rejection_count" in exprs["VramguardWebhookFailing"]
    for rule in rules:
        if rule["alert"] in ("VramguardGpuPodsPendingOnVram", "VramguardExtenderAbsent", "VramguardWebhookAbsent",
                             "VramguardAgentReportStale", "VramguardWebhookFailing"):
            assert rule["annotations"]["runbook_url"].startswith("docs/troubleshooting.md#"), rule["alert"]


def test_helm_renders_the_alerts_and_the_network_policy() -> None:
    objects = render_chart("metrics.prometheusRule.enabled=true", "metrics.serviceMonitor.enabled=true")
    rule = next(o for o in objects if o["kind"] == "PrometheusRule")
    assert rule["spec"] == load(MANIFESTS / "monitoring" / "vramguard-alerts.yaml")
    policy = next(o for o in objects if o["kind"] == "NetworkPolicy")
    assert [p["port"] for r in policy["spec"]["ingress"] for p in r["ports"]] == [8080, 10259]
    monitor = next(
        o for o in objects if o["kind"] == "ServiceMonitor" and o["metadata"]["name"] == "vramguard-extender"
    )
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"


@pytest.mark.parametrize("rendering", ["base", "default-scheduler", "helm", "helm-default-scheduler"])
def test_extender_verbs_need_client_certificates_and_probes_do_not(rendering: str) -> None:
    if not rendering.startswith("helm") and kustomize_command() is None:
        pytest.skip("the overlay's JSON patches need kustomize")
    objects = RENDERINGS[rendering]()
    for workload, spec in pod_specs(objects):
        for container in spec["containers"]:
            if container["name"] != "extender":
                continue
            assert "--client-ca=/etc/vramguard/tls/ca.crt" in container["args"], workload
            assert not any(arg.startswith("--insecure") for arg in container["args"]), workload
            for probe in ("readinessProbe", "livenessProbe"):
                assert container[probe]["httpGet"]["port"] == "ops", workload
                assert container[probe]["httpGet"].get("scheme", "HTTP") == "HTTP", workload
            listen = next(arg for arg in container["args"] if arg.startswith("--listen="))
            second_scheduler = workload == "vramguard-scheduler"
            assert listen.startswith("--listen=127.0.0.1:" if second_scheduler else "--listen=0.0.0.0:"), workload
    service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "vramguard-extender")
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert ports["metrics"] == 8080
    assert ("https" in ports) == rendering.endswith("default-scheduler")
    policies = [o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "vramguard-extender"]
    assert len(policies) == 1
    allowed = {p["port"] for r in policies[0]["spec"]["ingress"] for p in r["ports"]}
    assert (8443 in allowed) == rendering.endswith("default-scheduler")


# -------------------------------------------------------------------------------- dashboard


def test_dashboard_queries_known_metrics() -> None:
    dashboard = json.loads((MANIFESTS / "grafana" / "vramguard-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    for metric in (
        "vramguard_node_budget_bytes", "vramguard_node_reserved_bytes", "vramguard_node_free_bytes",
        "vramguard_node_pods",
        "vramguard_node_overcommitted_gpus",
        "vramguard_extender_decisions_total", "vramguard_http_request_duration_seconds_bucket",
        "vramguard_webhook_reviews_total", "vramguard_extender_leader", "vramguard_extender_lease_transitions_total",
        "vramguard_extender_not_leader_refusals_total", "vramguard_extender_in_flight_reservations",
        "vramguard_extender_in_flight_oldest_seconds",
    ):
        assert metric in exprs, metric
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


@pytest.mark.parametrize(
    "path",
    [
        MANIFESTS / "scheduler" / "second-scheduler.yaml",
        MANIFESTS / "scheduler" / "extender-default.yaml",
        MANIFESTS / "base" / "scheduler-config.yaml",
        CHART / "files" / "scheduler-config.yaml",
    ],
    ids=lambda path: str(path.relative_to(ROOT)),
)
def test_every_shipped_scheduler_configuration_sets_its_api_rate_limit(path: Path) -> None:
    # kube-scheduler's defaults (qps 50, burst 100) throttle a wave of GPU pods on the client side,
    # and a stock scheduler compared with vramguard must get the same settings (docs/install.md).
    configs = [d for d in yaml.safe_load_all(path.read_text()) if (d or {}).get("kind") == "KubeSchedulerConfiguration"]
    assert configs, f"no KubeSchedulerConfiguration in {path}"
    for config in configs:
        connection = config.get("clientConnection") or {}
        assert connection.get("qps", 0) >= 500
        assert connection.get("burst", 0) >= connection.get("qps", 0)


@pytest.mark.parametrize(("values", "kube_version", "tag"), [
    ((), "v1.36.3", "v1.36.3"),
    ((), "v1.35.2-eks-1552ad0", "v1.35.2"),
    (("scheduler.image.tag=v1.36.1",), "v1.35.2-gke.1000", "v1.36.1"),
])
def test_the_second_scheduler_follows_the_clusters_version(values: tuple[str, ...], kube_version: str,
                                                            tag: str) -> None:
    rendered = render_chart(*values, kube_version=kube_version)
    images = [c["image"] for _, spec in pod_specs(rendered) for c in spec["containers"]
              if c["name"] == "kube-scheduler"]
    assert images == [f"registry.k8s.io/kube-scheduler:{tag}"]


def test_the_chart_refuses_a_cluster_without_the_apis_it_watches() -> None:
    with pytest.raises(subprocess.CalledProcessError) as refused:
        render_chart(kube_version="v1.33.5")
    assert "kubeVersion" in refused.value.stderr


def test_chart_image_and_package_versions_move_in_lockstep() -> None:
    """One version names the package, the image (scripts/image.sh reads pyproject.toml), the chart
    and the image the chart and the kustomize base deploy."""
    version = re.search(r'(?m)^version = "(.+)"$', (ROOT / "pyproject.toml").read_text())
    assert version is not None
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == version[1]
    [image] = yaml.safe_load((BASE / "kustomization.yaml").read_text())["images"]
    assert image["newTag"] == version[1]
    assert yaml.safe_load((CHART / "values.yaml").read_text())["image"]["tag"] == ""  # appVersion


def test_the_agent_runs_on_every_node_with_nvidia_gpus_however_labelled() -> None:
    # The affinity in the kustomize base and the chart's values is the generator's (gpu_platforms.yaml grows).
    spec = importlib.util.spec_from_file_location("agent_affinity", ROOT / "scripts" / "agent_affinity.py")
    assert spec is not None and spec.loader is not None
    agent_affinity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent_affinity)
    assert agent_affinity.stale_files() == [], "run python scripts/agent_affinity.py"


def test_the_charts_notes_name_the_unreadable_nodes_signals() -> None:
    # Installing on a cluster whose GPU nodes vramguard cannot read must be loud from the first screen.
    from extender.growth import UNREADABLE_REASON  # noqa: PLC0415

    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert f"reason={UNREADABLE_REASON}" in notes and "vramguard_unreadable_gpu_nodes" in notes
    assert "vramguard audit" in notes


# ----------------------------------------------------------------------------- install paths

INSTALL_PATHS = {
    "second-scheduler": ("manifests/base", []),
    "second-scheduler+cert-manager": ("manifests/base", ["manifests/overlays/cert-manager"]),
    "second-scheduler+own-pki": ("manifests/base", ["manifests/overlays/own-pki"]),
    "default-scheduler": ("manifests/overlays/default-scheduler", []),
    "default-scheduler+cert-manager": ("manifests/overlays/default-scheduler", ["manifests/overlays/cert-manager"]),
    "default-scheduler+own-pki": ("manifests/overlays/default-scheduler", ["manifests/overlays/own-pki"]),
    "second-scheduler+scale-up": ("manifests/base", ["manifests/overlays/scale-up"]),
    "default-scheduler+scale-up-karpenter": (
        "manifests/overlays/default-scheduler", ["manifests/overlays/scale-up-karpenter"]
    ),
}


def documented_kustomization() -> JSON:
    """The kustomization docs/install.md tells users to write (its YAML block ``# kustomization.yaml``)."""
    text = (ROOT / "docs" / "install.md").read_text()
    [block] = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if b.startswith("# kustomization.yaml")]
    loaded: JSON = yaml.safe_load(block)
    return loaded


@pytest.mark.parametrize(("resource", "components"), INSTALL_PATHS.values(), ids=INSTALL_PATHS.keys())
def test_every_documented_kustomize_path_renders_with_the_images_set(
    tmp_path: Path, resource: str, components: list[str]
) -> None:
    # The user's kustomization beside manifests/, as the docs write it, with each base and component
    # they name: every container runs the image it sets (the overlay's extender too), the second
    # scheduler the cluster's version, and each path has its objects and no other.
    command = kustomize_command()
    if command is None:
        pytest.skip("the components need kustomize")
    kustomization = documented_kustomization()
    assert kustomization["resources"] == ["manifests/base"]
    assert kustomization["components"] == ["manifests/overlays/cert-manager"]
    shutil.copytree(MANIFESTS, tmp_path / "manifests")
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump({**kustomization, "resources": [resource], "components": components})
    )
    objects = yaml.safe_load_all(
        subprocess.run([*command, str(tmp_path)], capture_output=True, text=True, check=True).stdout
    )
    by_kind: dict[str, dict[str, JSON]] = {}
    for obj in filter(None, objects):
        by_kind.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj
    images = {entry["name"]: entry for entry in kustomization["images"]}
    ours = f"{images['vramguard']['newName']}:{images['vramguard']['newTag']}"
    scheduler = f"registry.k8s.io/kube-scheduler:{images['registry.k8s.io/kube-scheduler']['newTag']}"
    accounts = set(by_kind.get("ServiceAccount", {}))
    for kind in ("Deployment", "DaemonSet"):
        for name, workload in by_kind.get(kind, {}).items():
            pod = workload["spec"]["template"]["spec"]
            for container in [*pod.get("initContainers", []), *pod["containers"]]:
                assert container["image"] in (ours, scheduler), (kind, name, container["name"], container["image"])
            assert pod.get("serviceAccountName", "default") in accounts | {"default"}, (kind, name)
    deployments = set(by_kind["Deployment"])
    second = resource == "manifests/base"
    assert ("vramguard-scheduler" in deployments) is second
    assert ("vramguard-extender" in deployments) is not second
    pki = [c for c in components if c.endswith(("cert-manager", "own-pki"))]
    assert ("vramguard-certificates" in deployments) is (not pki)
    assert ("Certificate" in by_kind) is (components == ["manifests/overlays/cert-manager"])
    roles = set(by_kind["ClusterRole"])
    scale_up = [c for c in components if "scale-up" in c]
    assert ("vramguard-extender-scale-up" in roles) is bool(scale_up)
    assert ("vramguard-extender-node-labels" in roles) is (scale_up == ["manifests/overlays/scale-up-karpenter"])
    webhooks = by_kind["ValidatingWebhookConfiguration"]["vramguard"]
    injected = webhooks["metadata"].get("annotations", {}).get("cert-manager.io/inject-ca-from")
    assert (injected is not None) is (components == ["manifests/overlays/cert-manager"])


def test_the_chart_keeps_your_own_pki_without_the_keeper() -> None:
    objects = render_chart("certificates.keeper=false", "webhook.caBundle=Q0E=")
    assert not [o for o in objects if o["metadata"]["name"] == "vramguard-certificates"]
    for kind in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"):
        [configuration] = [o for o in objects if o["kind"] == kind]
        assert {w["clientConfig"].get("caBundle") for w in configuration["webhooks"]} == {"Q0E="}
    # Without the CA bundle the webhooks could not be called: rendering refuses, saying so.
    helm = helm_command()
    assert helm is not None
    failed = subprocess.run(
        [helm, "template", "vramguard", str(CHART), "--namespace", NAMESPACE, "--kube-version", CLUSTER_VERSION,
         "--set", "certificates.keeper=false"], capture_output=True, text=True, check=False,
    )
    assert failed.returncode != 0 and "set webhook.caBundle" in failed.stderr


@pytest.mark.parametrize("autoscaler", ["none", "cluster-autoscaler", "karpenter"])
def test_the_chart_turns_scale_up_on_with_its_rights(autoscaler: str) -> None:
    # The gate keeper patches pods only when scale-up is on, and labels nodes only for Karpenter.
    if helm_command() is None:
        pytest.skip("needs helm")
    objects = render_chart(f"scaleUp.autoscaler={autoscaler}")
    [config] = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "vramguard-policy"]
    policy = Policy.from_yaml(config["data"]["policy.yaml"])
    assert policy.scale_up.autoscaler == autoscaler
    [role] = [o for o in objects if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "vramguard-extender"]
    writes = {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}
    assert (("pods", "patch") in writes) is (autoscaler != "none")
    assert (("nodes", "patch") in writes) is (autoscaler == "karpenter")
