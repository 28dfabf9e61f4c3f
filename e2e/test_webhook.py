"""The admission webhook through the real API server: what a user sees from kubectl or a client.

The session cluster registers the shipped ``manifests/webhook/validating-webhook.yaml`` (pointed at
the local ``vramguard webhook``) with the built-in policy; each test labels its own namespace with
the enforcement mode it needs. The quota test starts a second webhook with a policy that gives its
namespace a quota, registered (from the same shipped file) for that namespace only.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import json
import re
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e import gpu_nodes, kube, services
from e2e.procs import ManagedProcess, free_port, http_status, wait_until
from e2e.scenario import private_node
from e2e.service_proxy import Backend, ServiceProxy
from vramguard.policy import Policy
from vramguard.webhook_config import ROUTING_POLICY_NAME, webhook_configuration

WAIT = 30.0
VALIDATE_COUNT = re.compile(
    r'^vramguard_webhook_http_request_duration_seconds_count\{(?=[^}]*route="/validate")[^}]*\} (\S+)$', re.M
)
BAD_UTILIZATION = "container vllm: --gpu-memory-utilization 1.5 is outside (0, 1]"


def vllm_container(utilization: str) -> dict[str, Any]:
    return {
        "name": "vllm",
        "image": "vllm/vllm-openai:v0.21.0",
        "args": ["--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu-memory-utilization", utilization],
        "resources": {"limits": {"nvidia.com/gpu": "1"}},
    }


def pod_spec(*containers: dict[str, Any]) -> dict[str, Any]:
    # A node selector no node has: the pods stay Pending and never reach the scheduler's extender.
    # The default scheduler: the one the harness wires to the extender and names in the policy (the
    # webhook refuses GPU pods of any other scheduler where it enforces).
    return {"containers": list(containers), "nodeSelector": {"e2e.vramguard.io/nowhere": "true"},
            "terminationGracePeriodSeconds": 0}


def pod(name: str, *containers: dict[str, Any], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "annotations": annotations or {}},
            "spec": pod_spec(*containers)}


def deployment(name: str, *containers: dict[str, Any], replicas: int = 1,
               annotations: dict[str, str] | None = None) -> dict[str, Any]:
    labels = {"app": name}
    template = {"metadata": {"labels": labels, "annotations": annotations or {}}, "spec": pod_spec(*containers)}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {"replicas": replicas, "selector": {"matchLabels": labels}, "template": template},
    }


def cronjob(name: str, *containers: dict[str, Any]) -> dict[str, Any]:
    spec = {**pod_spec(*containers), "restartPolicy": "Never"}
    return {"apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": name},
            "spec": {"schedule": "0 0 * * *", "jobTemplate": {"spec": {"template": {"spec": spec}}}}}


def denial(error: Any) -> str:
    """The message of a refused request, as the client receives it."""
    assert getattr(error, "status", None) == 403, error
    message: str = json.loads(error.body)["message"]
    return message


def warnings_of(response: Any) -> list[str]:
    """The ``Warning`` headers of a raw response (``299 - "text"``), as their texts."""
    values = response.headers.getlist("Warning") if hasattr(response.headers, "getlist") else []
    texts: list[str] = []
    for value in values:
        texts.extend(json.loads(quoted) for quoted in re.findall(r'299 - ("(?:[^"\\]|\\.)*")', value))
    return texts


def poll(what: str, probe: Callable[[], Any], timeout: float = WAIT) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = probe()
        if result:
            return result
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


def session_webhook_url(cluster: Any) -> str:
    state = getattr(cluster, "state", None)
    url = (state.vramguard if state is not None else {}).get("webhook")
    if not url:
        pytest.skip("the session cluster runs no vramguard webhook (started with --e2e-no-vramguard or --kubeconfig)")
    return str(url)


def validate_count(url: str, context: ssl.SSLContext) -> float:
    """Requests the webhook has answered on /validate, from its own metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10, context=context) as response:
        text = response.read().decode()
    return sum(float(value) for value in VALIDATE_COUNT.findall(text))


class Namespace:
    """A namespace for one test, and the clients that create objects in it."""

    def __init__(self, cluster: Any, name: str, labels: dict[str, str]) -> None:
        self.name = name
        self.client = kube.kubernetes_module().client
        api = cluster.api_client()
        self.core = self.client.CoreV1Api(api)
        self.apps = self.client.AppsV1Api(api)
        self.batch = self.client.BatchV1Api(api)
        self.core.create_namespace({"apiVersion": "v1", "kind": "Namespace",
                                    "metadata": {"name": name, "labels": labels}})
        self.pods: list[str] = []

    def create_pod(self, body: dict[str, Any], **options: Any) -> Any:
        response = self.core.create_namespaced_pod(self.name, body, _preload_content=False, **options)
        if not options.get("dry_run"):
            self.pods.append(body["metadata"]["name"])
        return response

    def delete_pod(self, name: str) -> None:
        self.core.delete_namespaced_pod(name, self.name, grace_period_seconds=0)
        self.pods.remove(name)

    def cleanup(self) -> None:
        # No controller-manager runs: a deleted namespace never finishes terminating, so its pods
        # are deleted one by one first (they hold nothing, but keep the session's lists short).
        for name in list(self.pods):
            try:
                self.delete_pod(name)
            except kube.api_exception():
                pass
        try:
            self.core.delete_namespace(self.name)
        except kube.api_exception():
            pass


@pytest.fixture
def namespace(cluster: Any, unique: str) -> Iterator[Callable[[str], Namespace]]:
    """Make a namespace with the given ``vramguard.io/enforce`` mode; removed afterwards."""
    session_webhook_url(cluster)
    made: list[Namespace] = []

    def make(mode: str) -> Namespace:
        created = Namespace(cluster, f"webhook-{mode}-{unique}", {"vramguard.io/enforce": mode})
        made.append(created)
        return created

    yield make
    for created in made:
        created.cleanup()


# --------------------------------------------------------------------------- refusals


def test_invalid_pod_is_refused_with_the_message(namespace: Callable[[str], Namespace]) -> None:
    ns = namespace("enforce")
    with pytest.raises(kube.api_exception()) as refused:
        ns.create_pod(pod("bad", vllm_container("1.5")))
    assert denial(refused.value) == f'admission webhook "pods.vramguard.io" denied the request: {BAD_UTILIZATION}'


def test_invalid_deployment_is_refused_at_apply_time(namespace: Callable[[str], Namespace]) -> None:
    ns = namespace("enforce")
    with pytest.raises(kube.api_exception()) as refused:
        ns.apps.create_namespaced_deployment(ns.name, deployment("bad", vllm_container("1.5")))
    assert denial(refused.value) == (
        f'admission webhook "workloads.vramguard.io" denied the request: {BAD_UTILIZATION}'
    )


def test_invalid_cronjob_is_refused(namespace: Callable[[str], Namespace]) -> None:
    ns = namespace("enforce")
    with pytest.raises(kube.api_exception()) as refused:
        ns.batch.create_namespaced_cron_job(ns.name, cronjob("bad", vllm_container("1.5")))
    assert denial(refused.value) == f'admission webhook "cronjobs.vramguard.io" denied the request: {BAD_UTILIZATION}'


def test_valid_pod_and_deployment_are_admitted(namespace: Callable[[str], Namespace]) -> None:
    ns = namespace("enforce")
    ns.create_pod(pod("good", vllm_container("0.3")))
    ns.apps.create_namespaced_deployment(ns.name, deployment("good", vllm_container("0.3")))


def test_init_container_asking_for_a_gpu_is_validated(namespace: Callable[[str], Namespace]) -> None:
    ns = namespace("enforce")
    body = pod("init", {"name": "main", "image": "registry.k8s.io/pause:3.10"})
    body["spec"]["initContainers"] = [vllm_container("1.5")]
    with pytest.raises(kube.api_exception()) as refused:
        ns.create_pod(body)
    assert BAD_UTILIZATION in denial(refused.value)


# --------------------------------------------------------------------------- warn and audit


def test_warn_namespace_admits_with_warnings_the_client_receives(namespace: Callable[[str], Namespace]) -> None:
    ns = namespace("warn")
    response = ns.create_pod(pod("warned", vllm_container("1.5")))
    assert response.status == 201
    assert f"would deny: {BAD_UTILIZATION}" in warnings_of(response)


def test_implicit_defaults_are_warned_about_even_where_enforced(namespace: Callable[[str], Namespace]) -> None:
    ns = namespace("enforce")
    container = vllm_container("0.3")
    container["args"] = ["--model", "m"]
    response = ns.create_pod(pod("implicit", container))
    assert response.status == 201
    assert (
        "container vllm relies on vLLM's default --gpu-memory-utilization (0.92 of the GPU); set it explicitly"
        in warnings_of(response)
    )


def test_audit_namespace_admits_and_says_what_would_be_denied(namespace: Callable[[str], Namespace]) -> None:
    ns = namespace("audit")
    response = ns.create_pod(pod("audited", vllm_container("1.5")))
    assert response.status == 201
    # Admitted, recorded in the audit annotation, and said: never less visible than a note.
    assert f"audit: would deny: {BAD_UTILIZATION}" in warnings_of(response)
    assert not any(w.startswith("would deny") for w in warnings_of(response))


# --------------------------------------------------------------------------- only GPU objects are sent


def test_objects_asking_for_no_gpu_never_reach_the_webhook(cluster: Any, namespace: Callable[[str], Namespace]) -> None:
    url = session_webhook_url(cluster)
    context = cluster.ssl_context()
    ns = namespace("warn")
    before = validate_count(url, context)
    # Positive control: a GPU pod (asking through requests only) is sent.
    control = pod("control", {"name": "c", "image": "registry.k8s.io/pause:3.10",
                              "resources": {"requests": {"nvidia.com/mig-1g.10gb": "1"},
                                            "limits": {"nvidia.com/mig-1g.10gb": "1"}}})
    ns.create_pod(control, dry_run="All")
    poll("the webhook to count the GPU pod", lambda: validate_count(url, context) >= before + 1)
    before = validate_count(url, context)
    plain = {"name": "web", "image": "registry.k8s.io/pause:3.10",
             "resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}
    ns.create_pod(pod("plain", plain))
    ns.apps.create_namespaced_deployment(ns.name, deployment("plain", plain))
    ns.batch.create_namespaced_cron_job(ns.name, cronjob("plain", plain))
    time.sleep(1.0)
    assert validate_count(url, context) == before


def test_a_cuda_serving_image_asking_for_no_gpu_is_sent_and_noted(namespace: Callable[[str], Namespace]) -> None:
    # Its image sets NVIDIA_VISIBLE_DEVICES=all: the matchConditions (CEL, compiled by the API server)
    # send it, and the review notes it without refusing it, even where the namespace enforces.
    ns = namespace("enforce")
    server = {"name": "vllm", "image": "docker.io/vllm/vllm-openai:v0.11.0",
              "args": ["--model", "m", "--gpu-memory-utilization", "0.9"]}
    response = ns.create_pod(pod("no-gpu", server), dry_run="All")
    assert response.status == 201
    assert any("asks for no GPU, and its image sets NVIDIA_VISIBLE_DEVICES=all" in w for w in warnings_of(response))
    cleared = {**server, "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]}
    response = ns.create_pod(pod("cleared", cleared), dry_run="All")
    assert response.status == 201 and warnings_of(response) == []


# --------------------------------------------------------------------------- quota


@contextlib.contextmanager
def quota_webhooks(
    cluster: Any, unique: str, tmp_path: Path, replicas: int = 1
) -> Iterator[tuple[Namespace, str, list[str]]]:
    """A namespace with a 100Gi VRAM quota, guarded by ``replicas`` webhooks that have that policy (behind
    a Service-like proxy that spreads connections over them, when more than one)."""
    if not hasattr(cluster, "ca"):
        pytest.skip("starts a webhook of its own, signed by the local control plane's CA")
    command = services.vramguard_command()
    assert command is not None
    name = f"webhook-quota-{unique}"
    policy = yaml.safe_load((Path(services.REPO_ROOT) / "vramguard" / "default_policy.yaml").read_text())
    policy.update(enforcement="enforce", quotas={name: "100Gi"}, schedulers=["default-scheduler"])
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(policy))
    cluster.ca.issue_localhost_server("vramguard-webhook-quota").write(tmp_path / "tls.crt", tmp_path / "tls.key")
    processes: list[ManagedProcess] = []
    ports = [free_port() for _ in range(replicas)]
    for index, port in enumerate(ports):
        argv = services.service_argv(command, "webhook", port=port, tls_cert=tmp_path / "tls.crt",
                                     tls_key=tmp_path / "tls.key", kubeconfig=cluster.kubeconfig,
                                     policy=tmp_path / "policy.yaml")
        processes.append(ManagedProcess.start(
            f"webhook-quota-{index}", [*argv, f"--quota-namespace={name}"], log_path=tmp_path / f"webhook-{index}.log",
            pid_dir=tmp_path / str(index), cwd=tmp_path, die_with_parent=True))
    proxy = None
    if replicas > 1:
        proxy = ServiceProxy(free_port(), [Backend(port, f"https://127.0.0.1:{port}/readyz", cluster.ssl_context())
                                           for port in ports], spread=True)
    url = f"https://127.0.0.1:{proxy.port if proxy is not None else ports[0]}"
    configuration_name = f"vramguard-quota-{unique}"
    ns: Namespace | None = None
    try:
        for port, process in zip(ports, processes, strict=True):
            wait_until("the quota webhook /readyz", lambda port=port: http_status(  # type: ignore[misc]
                f"https://127.0.0.1:{port}/readyz", context=cluster.ssl_context()) == 200, timeout=60, process=process)
        if proxy is not None:
            proxy.start()
        # Its pods stay on default-scheduler, the scheduler this webhook's policy names.
        ns = Namespace(cluster, name, {"vramguard.io/routing": "disabled"})
        # The configuration `vramguard webhook-config` prints for this policy (default enforce).
        configuration = services.localize_webhook_configuration(
            webhook_configuration(Policy.model_validate(policy)), webhook_url=url, ca_b64=cluster.ca.cert_b64
        )
        configuration["metadata"]["name"] = configuration_name
        for webhook in configuration["webhooks"]:
            webhook["namespaceSelector"]["matchLabels"] = {"kubernetes.io/metadata.name": name}
        cluster.create(configuration)
        # The API server picks up a new webhook configuration within a moment; a dry run shows when.
        probe = pod("probe", {"name": "c", "image": "registry.k8s.io/pause:3.10",
                              "resources": {"limits": {"nvidia.com/gpu": "1"}}},
                    annotations={"vramguard.io/vram": "1Gi"})

        def registered() -> bool:
            assert ns is not None
            ns.create_pod(probe, dry_run="All")
            return validate_count(url, cluster.ssl_context()) > 0

        poll("the quota webhook to be called", registered)
        yield ns, url, [f"https://127.0.0.1:{port}" for port in ports]
    finally:
        if ns is not None:
            ns.cleanup()
        with contextlib.suppress(Exception):  # it may never have been created
            cluster.request("DELETE", f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/"
                                      f"{configuration_name}")
        if proxy is not None:
            proxy.stop()
        for process in processes:
            process.stop()


@pytest.fixture
def quota_webhook(cluster: Any, unique: str, tmp_path: Path) -> Iterator[tuple[Namespace, str]]:
    """A namespace with a 100Gi VRAM quota, guarded by a webhook that has that policy."""
    with quota_webhooks(cluster, unique, tmp_path) as (ns, url, _):
        yield ns, url


def test_quota_holds_across_several_pods(quota_webhook: tuple[Namespace, str]) -> None:
    ns, _ = quota_webhook
    declared = {"vramguard.io/vram": "40Gi"}
    worker = {"name": "train", "image": "registry.k8s.io/pause:3.10", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
    ns.create_pod(pod("a", worker, annotations=declared))
    ns.create_pod(pod("b", worker, annotations=declared))
    with pytest.raises(kube.api_exception()) as refused:
        ns.create_pod(pod("c", worker, annotations=declared))
    assert denial(refused.value).endswith(
        f"namespace {ns.name} would hold 120Gi of its 100Gi VRAM quota (this pod 40Gi, 2 other pod(s) 80Gi)"
    )
    # A Deployment of three such pods would not fit either, and says so at apply time.
    with pytest.raises(kube.api_exception()) as refused:
        ns.apps.create_namespaced_deployment(ns.name, deployment("three", worker, replicas=3, annotations=declared))
    assert denial(refused.value).endswith(
        f"namespace {ns.name} would hold 200Gi of its 100Gi VRAM quota (3 pod(s) x 40Gi, 2 other pod(s) 80Gi)"
    )
    # Deleting a pod frees its share: the watch shows the deletion and the next pod fits.
    ns.delete_pod("a")

    def admitted() -> bool:
        try:
            ns.create_pod(pod("c", worker, annotations=declared), dry_run="All")
        except kube.api_exception():
            return False
        return True

    poll("the freed quota to admit the pod", admitted)
    ns.create_pod(pod("c", worker, annotations=declared))


PODS_AT_ONCE = 12


def test_quota_holds_across_webhook_replicas_creating_at_once(cluster: Any, unique: str, tmp_path: Path) -> None:
    # Two replicas behind a Service (each connection to the other in turn), twelve 40Gi pods created at
    # once against a 100Gi quota: each replica reviews some before any pod is stored, so neither pod
    # watch can count the others' admissions; the replicas share them through the API server
    # (ConfigMap vramguard-quota-<namespace>), and two pods get in, whichever replica reviewed them.
    with quota_webhooks(cluster, unique, tmp_path, replicas=2) as (ns, _, urls):
        answered = [validate_count(url, cluster.ssl_context()) for url in urls]
        declared = {"vramguard.io/vram": "40Gi"}
        worker = {"name": "train", "image": "registry.k8s.io/pause:3.10",
                  "resources": {"limits": {"nvidia.com/gpu": "1"}}}

        start = threading.Barrier(PODS_AT_ONCE)

        def create(index: int) -> bool:
            start.wait(timeout=30)  # all at once: the API server opens a connection per review in flight
            try:
                ns.create_pod(pod(f"p{index}", worker, annotations=declared))
            except kube.api_exception():
                return False
            return True

        with concurrent.futures.ThreadPoolExecutor(max_workers=PODS_AT_ONCE) as pool:
            created = list(pool.map(create, range(PODS_AT_ONCE)))
        assert created.count(True) == 2, created
        # Both replicas reviewed some of them, and the record of their admissions is the API server's.
        assert all(validate_count(url, cluster.ssl_context()) > before for url, before in zip(urls, answered,
                                                                                                  strict=True))
        status, record = raw(cluster, "GET", f"/api/v1/namespaces/{ns.name}/configmaps/vramguard-quota-{ns.name}")
        assert status == 200 and record["data"]["holds"].startswith("[["), record


def test_a_review_forged_by_any_caller_does_not_refuse_real_pods(cluster: Any, quota_webhook: tuple[Namespace, str],
                                                               unique: str) -> None:
    """/validate takes no client certificate (the API server calls it): anyone who reaches it can POST
    a review. A forged review of a pod filling the quota is admitted, but the API server never stores
    that pod, so it must not keep the next real pod out."""
    ns, url = quota_webhook
    worker = {"name": "train", "image": "registry.k8s.io/pause:3.10", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
    forged_pod = pod("forged", worker, annotations={"vramguard.io/vram": "100Gi"})
    forged_pod["metadata"].update(namespace=ns.name, uid=f"forged-{unique}")
    forged = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": f"forged-request-{unique}", "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"}, "name": "forged", "namespace": ns.name,
        "operation": "CREATE", "userInfo": {"username": "system:serviceaccount:default:intruder"},
        "object": forged_pod}}
    request = urllib.request.Request(url + "/validate", data=json.dumps(forged).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10, context=cluster.ssl_context()) as response:
        assert json.loads(response.read())["response"]["allowed"] is True
    declared = {"vramguard.io/vram": "40Gi"}
    ns.create_pod(pod("real", worker, annotations=declared))
    # The quota still counts the real pod: 40Gi + 70Gi is over it.
    with pytest.raises(kube.api_exception()) as refused:
        ns.create_pod(pod("more", worker, annotations={"vramguard.io/vram": "70Gi"}))
    assert denial(refused.value).endswith(
        f"namespace {ns.name} would hold 110Gi of its 100Gi VRAM quota (this pod 70Gi, 1 other pod(s) 40Gi)"
    )


# --------------------------------------------------------------------------- padded reviews


def padded(name: str, container: dict[str, Any]) -> dict[str, Any]:
    """A pod with a 1.1 MB environment variable: its review is larger than aiohttp's default 1 MiB body limit."""
    return pod(name, {**container, "env": [{"name": "PADDING", "value": "x" * 1_100_000}]})


def test_padded_pod_is_judged_not_waved_through(namespace: Callable[[str], Namespace]) -> None:
    enforced = namespace("enforce")
    with pytest.raises(kube.api_exception()) as refused:
        enforced.create_pod(padded("padded", vllm_container("1.5")))
    assert denial(refused.value) == f'admission webhook "pods.vramguard.io" denied the request: {BAD_UTILIZATION}'
    warned = namespace("warn")
    response = warned.create_pod(padded("padded", vllm_container("1.5")))
    assert response.status == 201
    assert f"would deny: {BAD_UTILIZATION}" in warnings_of(response)


def test_a_pod_near_the_stored_limit_escaped_sixfold_is_judged(namespace: Callable[[str], Namespace]) -> None:
    # The API server writes '<', '>' and '&' as six-byte \u003c escapes in the review's JSON: a 1.45 MB
    # pod of them is an 8.7 MB review (past the webhook's old 8 MiB limit, a 413 that the failure
    # policy turned into an unreviewed admission where the namespace does not enforce).
    body = pod("escaped", {**vllm_container("1.5"), "env": [{"name": "PADDING", "value": "<" * 1_450_000}]})
    with pytest.raises(kube.api_exception()) as refused:
        namespace("enforce").create_pod(body)
    assert denial(refused.value) == f'admission webhook "pods.vramguard.io" denied the request: {BAD_UTILIZATION}'
    response = namespace("audit").create_pod(body)
    assert response.status == 201
    assert f"audit: would deny: {BAD_UTILIZATION}" in warnings_of(response)


def test_unreachable_webhook_refuses_only_where_enforced(cluster: Any, namespace: Callable[[str], Namespace],
                                                        unique: str) -> None:
    """The shipped split of failure policies, on the real API server, with a webhook that never answers."""
    if not hasattr(cluster, "ca"):
        pytest.skip("registers a webhook configuration of its own on the local control plane")
    enforced, warned = namespace("enforce"), namespace("warn")
    dead = f"https://127.0.0.1:{free_port()}"  # nothing listens there
    configuration = services.localize_webhook_configuration(
        services.webhook_configuration(), webhook_url=dead, ca_b64=cluster.ca.cert_b64
    )
    configuration["metadata"]["name"] = f"vramguard-dead-{unique}"
    for webhook in configuration["webhooks"]:
        webhook["namespaceSelector"]["matchExpressions"].append(
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [enforced.name, warned.name]})
    cluster.create(configuration)
    try:
        good = pod("good", vllm_container("0.3"))

        def refused() -> str | None:
            try:
                enforced.create_pod(good, dry_run="All")
            except kube.api_exception() as error:
                return str(json.loads(getattr(error, "body", "") or "{}").get("message", ""))
            return None

        message = poll("the unreachable webhook to be called", refused)
        assert message.startswith('Internal error occurred: failed calling webhook "pods.vramguard.io"'), message
        # Ignore where the namespace warns: admitted (unchecked by the dead webhook).
        assert warned.create_pod(good).status == 201
    finally:
        cluster.request("DELETE", "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/"
                                  f"vramguard-dead-{unique}")


# --------------------------------------------------------------------------- direct placement


def test_pods_created_on_a_node_must_fit_its_ledger(
    cluster: Any, core_v1: Any, namespace: Callable[[str], Namespace], unique: str
) -> None:
    spec = private_node(gpu_nodes.time_sliced("direct", "H100-80GB", gpus=1, replicas=4), unique)
    gpu_nodes.create_gpu_node(core_v1, spec)
    try:
        enforced = namespace("enforce")
        warned = namespace("warn")

        def direct(name: str) -> dict[str, Any]:
            body = pod(name, vllm_container("0.6"))
            body["spec"] = {**body["spec"], "nodeName": spec.name}
            del body["spec"]["nodeSelector"]
            return body

        # The webhook's ledger learns the node from its watch; the first pod fits once it does.
        def first_admitted() -> bool:
            try:
                enforced.create_pod(direct("first"))
            except kube.api_exception():
                return False
            return True

        poll("the webhook to see the GPU node", first_admitted)

        def second_refused() -> str | None:
            try:
                enforced.create_pod(direct("second"), dry_run="All")
            except kube.api_exception() as error:
                return denial(error)
            return None

        # 0.6 + 0.6 of one GPU is more than its budget (90%): refused once the watch shows "first".
        message = poll("the second direct pod to be refused", second_refused)
        assert message.startswith(
            f'admission webhook "pods.vramguard.io" denied the request: spec.nodeName {spec.name} places the pod '
            "past the scheduler and it does not fit there: GPU 0 (NVIDIA H100 80GB HBM3): "
        ), message
        assert re.search(r"[\d.]+ GiB of [\d.]+ GiB VRAM budget free, pod needs [\d.]+ GiB per GPU$", message)
        # The ledger is the node's, whatever the namespace: a warn namespace is told, not refused.
        response = warned.create_pod(direct("second"))
        assert response.status == 201
        assert any(w.startswith(f"would deny: spec.nodeName {spec.name} places the pod") for w in warnings_of(response))
    finally:
        gpu_nodes.delete_nodes(core_v1, [spec.name])


# --------------------------------------------------------------------------- admission policies


def raw(cluster: Any, method: str, path: str, body: Any = None, *, user: str | None = None,
        group: str | None = None, content_type: str = "application/json") -> tuple[int, dict[str, Any]]:
    """A request as the admin, or as ``user`` (in ``group``) through impersonation; (status, body)."""
    state = cluster.state
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(state.server + path, data=data, method=method)
    request.add_header("Authorization", f"Bearer {state.admin_token}")
    request.add_header("Content-Type", content_type)
    if user is not None:
        request.add_header("Impersonate-User", user)
    if group is not None:
        request.add_header("Impersonate-Group", group)
    try:
        with urllib.request.urlopen(request, timeout=30, context=cluster.ssl_context()) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


@pytest.fixture
def tenant(cluster: Any, unique: str) -> Iterator[str]:
    """A user allowed by RBAC to create and update namespaces (not a namespace admin of vramguard)."""
    if not hasattr(cluster, "state"):
        pytest.skip("impersonates users as the local control plane's admin")
    user = f"tenant-{unique}"
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": user},
            "rules": [{"apiGroups": [""], "resources": ["namespaces"],
                       "verbs": ["get", "create", "update", "patch", "delete"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": user},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": user},
               "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}
    assert raw(cluster, "POST", f"{rbac}/clusterroles", role)[0] == 201
    assert raw(cluster, "POST", f"{rbac}/clusterrolebindings", binding)[0] == 201
    yield user
    raw(cluster, "DELETE", f"{rbac}/clusterrolebindings/{user}")
    raw(cluster, "DELETE", f"{rbac}/clusterroles/{user}")


MERGE = "application/merge-patch+json"


def test_only_namespace_admins_set_vramguard_namespace_labels(cluster: Any, tenant: str, unique: str) -> None:
    name = f"vap-ns-{unique}"
    labelled = {"apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": name, "labels": {"vramguard.io/qos-class": "guaranteed"}}}

    def create_refused() -> dict[str, Any] | None:
        status, body = raw(cluster, "POST", "/api/v1/namespaces?dryRun=All", labelled, user=tenant)
        # Until the tenant's RBAC grant reaches the authorizer, the 403 is RBAC's, not the policy's.
        return body if status == 403 and "vramguard.io/" in str(body.get("message", "")) else None

    # The API server compiles a new policy within moments; the session registered it at start-up.
    refused = poll("the namespace label policy to refuse the tenant", create_refused)
    assert "only namespace admins (group vramguard:namespace-admins) may set or change the vramguard.io/ labels" \
        in refused["message"], refused
    plain = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": {"team": "a"}}}
    assert raw(cluster, "POST", "/api/v1/namespaces", plain, user=tenant)[0] == 201
    try:
        path = f"/api/v1/namespaces/{name}"
        status, body = raw(cluster, "PATCH", path, {"metadata": {"labels": {"vramguard.io/enforce": "audit"}}},
                           user=tenant, content_type=MERGE)
        assert status == 403, body
        status, _ = raw(cluster, "PATCH", path, {"metadata": {"labels": {"team": "b"}}}, user=tenant,
                        content_type=MERGE)
        assert status == 200
        status, body = raw(cluster, "PATCH", path, {"metadata": {"labels": {"vramguard.io/enforce": "enforce"}}},
                           user=tenant, group="vramguard:namespace-admins", content_type=MERGE)
        assert status == 200, body
        # Removing the label is a change too.
        status, _ = raw(cluster, "PATCH", path, {"metadata": {"labels": {"vramguard.io/enforce": None}}},
                        user=tenant, content_type=MERGE)
        assert status == 403
    finally:
        raw(cluster, "DELETE", f"/api/v1/namespaces/{name}")


def test_vramguard_annotations_of_a_bound_pod_are_frozen(cluster: Any, namespace: Callable[[str], Namespace],
                                                         unique: str) -> None:
    ns = namespace("warn")
    body = pod("frozen", vllm_container("0.3"), annotations={"vramguard.io/vram": "30Gi"})
    body["spec"]["schedulerName"] = f"nobody-{unique}"  # bound below, by hand, as the extender binds
    ns.create_pod(body)
    path = f"/api/v1/namespaces/{ns.name}/pods/frozen"
    # Before binding, the declaration may still change (the webhook re-checks it).
    status, _ = raw(cluster, "PATCH", path, {"metadata": {"annotations": {"vramguard.io/vram": "20Gi"}}},
                    content_type=MERGE)
    assert status == 200
    placement = json.dumps({"node": f"nowhere-{unique}", "containers": {"vllm": ["GPU-0"]}})
    binding = {"apiVersion": "v1", "kind": "Binding",
               "metadata": {"name": "frozen", "annotations": {"vramguard.io/placement": placement}},
               "target": {"apiVersion": "v1", "kind": "Node", "name": f"nowhere-{unique}"}}
    status, answer = raw(cluster, "POST", path + "/binding", binding)
    assert status == 201, answer
    # The Binding's annotation reaches the pod: the policy does not match pods/binding.
    status, bound = raw(cluster, "GET", path)
    assert bound["spec"]["nodeName"] == f"nowhere-{unique}"
    assert bound["metadata"]["annotations"]["vramguard.io/placement"] == placement

    changes = {
        "shrink-the-declaration": {"vramguard.io/vram": "1Gi"},
        "drop-the-declaration": {"vramguard.io/vram": None},
        "rewrite-the-placement": {"vramguard.io/placement": "{}"},
        "add-a-declaration": {"vramguard.io/vram.vllm": "1Gi"},
    }
    for case, change in changes.items():
        status, answer = raw(cluster, "PATCH", path, {"metadata": {"annotations": change}}, content_type=MERGE)
        assert status == 403, (case, answer)
        assert "its vramguard.io/ annotations can no longer change" in answer["message"], case
    status, _ = raw(cluster, "PATCH", path, {"metadata": {"annotations": {"team": "b"}}}, content_type=MERGE)
    assert status == 200


# --------------------------------------------------------------------------- a bound pod that changes


def test_a_bound_pods_changes_are_judged_against_the_gpu_it_holds(
    cluster: Any, core_v1: Any, namespace: Callable[[str], Namespace], unique: str
) -> None:
    # vLLM's default utilization is 0.9 before v0.20.0 (vllm/config/cache.py); an image whose tag names
    # no vLLM version may be v0.34.0 or later, whose extensible KV cache takes the whole device.
    spec = private_node(gpu_nodes.time_sliced("changes", "H100-80GB", gpus=1, replicas=4), unique)
    gpu_nodes.create_gpu_node(core_v1, spec)
    try:
        enforced = namespace("enforce")

        def placed(ns: Namespace, name: str, container: dict[str, Any]) -> dict[str, Any]:
            body = pod(name, container)
            body["spec"] = {**body["spec"], "nodeName": spec.name}
            del body["spec"]["nodeSelector"]
            return body

        default_share = {**vllm_container("0.9"), "image": "vllm/vllm-openai:v0.11.0", "args": ["--model", "m"]}

        def admitted(ns: Namespace, name: str, container: dict[str, Any]) -> Callable[[], bool]:
            def create() -> bool:
                try:
                    ns.create_pod(placed(ns, name, container))
                except kube.api_exception():
                    return False
                return True
            return create

        # The webhook's ledger learns the node from its watch; a small neighbour, then the 0.9 pod.
        poll("the webhook to see the GPU node", admitted(enforced, "neighbour", vllm_container("0.02")))
        poll("the 0.9 pod to be admitted beside it", admitted(enforced, "served", default_share))
        path = f"/api/v1/namespaces/{enforced.name}/pods/served"
        tenant_image = {"spec": {"containers": [{"name": "vllm", "image": "registry.example/tenant/vllm:mine"}]}}
        strategic = "application/strategic-merge-patch+json"

        def image_change_refused() -> dict[str, Any] | None:
            status, answer = raw(cluster, "PATCH", path + "?dryRun=All", tenant_image, content_type=strategic)
            return answer if status == 403 else None

        # The webhook's model sees both pods bound once its watch delivers them.
        answer = poll("the image change to be refused", image_change_refused)
        assert answer["message"].startswith(
            'admission webhook "pod-changes.vramguard.io" denied the request: pod is bound to '
            f"{spec.name} and this change alters what it holds there, which no longer fits: GPU 0 (NVIDIA H100 "
            "80GB HBM3)"), answer["message"]
        # A tag of the same rules changes nothing that is checked.
        same_rules = {"spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.1"}]}}
        status, answer = raw(cluster, "PATCH", path, same_rules, content_type=strategic)
        assert status == 200, answer
        # kubectl debug adds an ephemeral container; one naming every GPU of the node is refused.
        debugger = {"spec": {"ephemeralContainers": [{
            "name": "debugger", "image": "busybox", "targetContainerName": "vllm",
            "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]}}
        status, answer = raw(cluster, "PATCH", path + "/ephemeralcontainers", debugger, content_type=strategic)
        assert status == 403, answer
        assert "ephemeral container debugger sets NVIDIA_VISIBLE_DEVICES=all" in answer["message"]
        # The class a bound pod was placed under cannot change (ValidatingAdmissionPolicy).
        status, answer = raw(cluster, "PATCH", path, {"metadata": {"labels": {"vramguard.io/qos-class": "x"}}},
                             content_type=MERGE)
        assert status == 403 and "its vramguard.io/ labels can no longer change" in answer["message"], answer
        # Other updates of a bound pod go through (labels, annotations): never judged as changes.
        status, _ = raw(cluster, "PATCH", path, {"metadata": {"labels": {"team": "b"}}}, content_type=MERGE)
        assert status == 200
    finally:
        gpu_nodes.delete_nodes(core_v1, [spec.name])


# --------------------------------------------------------------------------- a GPU pod left unrouted


def test_a_gpu_pod_the_routing_webhook_left_unrouted_is_refused_by_the_api_server(cluster: Any, unique: str) -> None:
    # The second-scheduler layout's ValidatingAdmissionPolicy (manifests/base/routing-policy.yaml), bound
    # here to one namespace: in every mode, a GPU pod still on default-scheduler after the mutating
    # webhooks (the routing webhook did not answer) is refused, not placed by a scheduler that counts
    # no VRAM. The namespace opts out of routing, so that the routing webhook leaves its pods as it
    # would when down; the session's own copy of the policy spares such namespaces, this one does not.
    ns = Namespace(cluster, f"unrouted-{unique}", {"vramguard.io/enforce": "audit", "vramguard.io/routing": "disabled"})
    policy, binding = (copy.deepcopy(obj) for obj in services.admission_policies(routing=True)
                       if obj["metadata"]["name"] == ROUTING_POLICY_NAME)
    name = f"{ROUTING_POLICY_NAME}-{unique}"
    policy["metadata"]["name"] = binding["metadata"]["name"] = binding["spec"]["policyName"] = name
    binding["spec"]["matchResources"] = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns.name}}}
    api = "/apis/admissionregistration.k8s.io/v1"
    cluster.create(policy)
    cluster.create(binding)
    try:
        unrouted = pod("unrouted", vllm_container("0.3"))

        def refused() -> str | None:
            try:
                ns.create_pod(unrouted, dry_run="All")
            except kube.api_exception() as error:
                return denial(error)
            return None

        message = poll("the policy to refuse an unrouted GPU pod", refused)
        assert "GPU pod unrouted was not routed to the vramguard scheduler (the vramguard webhook did not answer)" \
            in message, message
        routed = pod("routed", vllm_container("0.3"))
        routed["spec"]["schedulerName"] = "vramguard"
        assert ns.create_pod(routed, dry_run="All").status == 201
        none = pod("no-gpu", {**vllm_container("0.3"), "resources": {"limits": {"nvidia.com/gpu": "0"}}})
        assert ns.create_pod(none, dry_run="All").status == 201
    finally:
        cluster.request("DELETE", f"{api}/validatingadmissionpolicybindings/{name}")
        cluster.request("DELETE", f"{api}/validatingadmissionpolicies/{name}")
        ns.cleanup()
