"""The Helm chart installed as users install it, on real nodes: ``helm install`` with the chart's
defaults, every vramguard pod from the image (the one ``make image`` builds, loaded into the nodes'
containerd; the second scheduler's from the kube-scheduler the harness built), certificates from the
certificate keeper, both webhooks reached through their Services, a vLLM Deployment written as vLLM's
docs write it routed and placed, ``helm upgrade`` with the guard never down, ``helm uninstall``.

The control plane runs with a pod network (``Cluster(pod_network=True)``): pods reach the API server
and Services through kube-proxy, ServiceAccount tokens are mounted. No vramguard process of the
harness runs: the chart's pods are the only vramguard there is.

Skipped without real nodes, helm or the image (``make image`` then ``env $(scripts/image.sh env)``);
in CI a skip is a failure.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from e2e import build, containers, gpu_nodes, images, real_nodes
from e2e.cluster import Cluster
from e2e.kube import api_exception, kubernetes_module
from e2e.scenario import wait_for
from vramguard.codecs import ENFORCE_LABEL, PLACEMENT_ANNOTATION

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "vramguard"
NAMESPACE = "vramguard-system"
RELEASE = "vramguard"
SCHEDULER = "vramguard"
TLS_SECRETS = ("vramguard-extender-tls", "vramguard-webhook-tls", "vramguard-scheduler-client-tls")


def _ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _helm() -> str | None:
    local = ROOT / ".tools" / "bin" / "helm"
    return str(local) if local.is_file() else shutil.which("helm")


@dataclass
class Installed:
    cluster: Cluster
    nodes: real_nodes.RealNodes
    helm: str
    log: list[str] = field(default_factory=list)

    @property
    def core_v1(self) -> Any:
        return self.cluster.core_v1()

    def helm_run(self, *args: str, timeout: float = 420) -> str:
        env = {**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig)}
        done = subprocess.run([self.helm, *args], env=env, capture_output=True, text=True, timeout=timeout,
                              check=False, cwd=ROOT)
        assert done.returncode == 0, f"helm {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done.stdout


def chart_image_name() -> str:
    """The image the chart's defaults name (``vramguard:<appVersion>``), as containerd spells it."""
    version = next(line.split(":", 1)[1].strip().strip('"') for line in (CHART / "Chart.yaml").read_text().splitlines()
                   if line.startswith("appVersion:"))
    return f"docker.io/library/vramguard:{version}"


@pytest.fixture(scope="module")
def installed(local_control_plane: build.Binaries, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    reasons = real_nodes.missing()
    helm = _helm()
    image = containers.image_from_environment()
    if helm is None:
        reasons.append("no helm (make tools)")
    if image is None or not containers.image_present(image):
        reasons.append(f"no image ${containers.IMAGE_ENV} in {containers.engine()} "
                       "(make image; env $(scripts/image.sh env))")
    if reasons:
        message = f"the chart cannot be installed on real nodes here: {'; '.join(reasons)}"
        if _ci():
            pytest.fail(message)
        pytest.skip(message)
    assert helm is not None and image is not None
    directory = tmp_path_factory.mktemp("chart")
    archive = directory / "vramguard.tar"
    subprocess.run([containers.engine(), "save", "--format", "oci-archive", "-o", str(archive), image],
                   check=True, capture_output=True, timeout=300)
    cluster = Cluster.up(directory / "cluster", kube_version=local_control_plane.version, vramguard="off",
                         pod_network=True)
    nodes = real_nodes.RealNodes(cluster)
    try:
        _, scheduler_archive = images.kube_scheduler_image(local_control_plane)
        # Two GPU nodes: the webhook's two replicas and the DaemonSet's two agents run on real kubelets.
        for spec in (gpu_nodes.time_sliced("gpu-a", "H100-80GB", gpus=1, replicas=4),
                     gpu_nodes.time_sliced("gpu-b", "H100-80GB", gpus=1, replicas=4)):
            node = nodes.start(spec)
            nodes.load_image(node, scheduler_archive)
            nodes.load_image(node, archive, chart_image_name())
        state = Installed(cluster, nodes, helm)
        state.helm_run("install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace", "--wait",
                       "--timeout", "300s")
        yield state
    finally:
        try:
            nodes.stop()
        finally:
            cluster.down()


def vramguard_pods(core_v1: Any) -> list[Any]:
    return list(core_v1.list_namespaced_pod(NAMESPACE).items)


def vllm_deployment(name: str) -> dict[str, Any]:
    """A Deployment as vLLM's Kubernetes guide writes it (docs/deployment/k8s.md: the image's
    entrypoint, the model and flags in ``args``, ``nvidia.com/gpu: 1``), with a time-sliced GPU's
    share: nothing vramguard-specific in it."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.21.0",
                    "args": ["--model", "Qwen/Qwen2.5-1.5B-Instruct", "--gpu-memory-utilization", "0.30"],
                    "ports": [{"containerPort": 8000}],
                    "resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "1", "memory": "1Gi"}},
                }]},
            },
        },
    }


def mismatched_pod(name: str) -> dict[str, Any]:
    """A pod no GPU can run as written: two GPUs of tensor parallelism on one GPU."""
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"containers": [{
            "name": "vllm", "image": "vllm/vllm-openai:v0.21.0",
            "args": ["--model", "m", "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.30"],
            "resources": {"limits": {"nvidia.com/gpu": "1"}},
        }]},
    }


def plain_gpu_pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"containers": [{
            "name": "vllm", "image": "vllm/vllm-openai:v0.21.0",
            "args": ["--model", "m", "--gpu-memory-utilization", "0.30"],
            "resources": {"limits": {"nvidia.com/gpu": "1"}},
        }]},
    }


@pytest.fixture
def enforced(installed: Installed, unique: str) -> Iterator[str]:
    name = f"chart-{unique}"
    installed.core_v1.create_namespace({"metadata": {"name": name, "labels": {ENFORCE_LABEL: "enforce"}}})
    yield name
    installed.core_v1.delete_namespace(name)


def guard_answers(core_v1: Any, namespace: str) -> str | None:
    """``None`` when both webhooks answered as they should: the mismatched pod refused by the
    validating webhook, a plain GPU pod routed to vramguard's scheduler by the mutating one (both
    server-side dry runs); else what went wrong."""
    try:
        core_v1.create_namespaced_pod(namespace, mismatched_pod("probe-bad"), dry_run="All")
        return "the validating webhook admitted a pod it must refuse"
    except api_exception() as error:
        body = str(getattr(error, "body", error))
        if "tensor-parallel-size 2" not in body:
            return f"not vramguard's refusal: {body[:300]}"
    routed = core_v1.create_namespaced_pod(namespace, plain_gpu_pod("probe-good"), dry_run="All")
    if routed.spec.scheduler_name != SCHEDULER:
        return f"the mutating webhook did not route the pod (schedulerName {routed.spec.scheduler_name})"
    return None


# --------------------------------------------------------------------------- tests


def all_ready(core_v1: Any) -> list[Any] | None:
    pods = vramguard_pods(core_v1)
    ready = pods and all(pod.status.phase == "Running" and pod.status.container_statuses
                         and all(status.ready for status in pod.status.container_statuses) for pod in pods)
    return pods if ready else None


def test_every_vramguard_pod_runs_from_the_image_ready_read_only_and_as_shipped(installed: Installed) -> None:
    # helm --wait may return before the DaemonSet has counted its second node.
    pods = wait_for("every vramguard pod Running and Ready", lambda: all_ready(installed.core_v1), timeout=120)
    components = sorted({pod.metadata.labels.get("app.kubernetes.io/component") for pod in pods})
    assert components == ["agent", "certificates", "scheduler", "webhook"], components
    for pod in pods:
        assert pod.status.phase == "Running", pod.metadata.name
        for status in pod.status.container_statuses:
            assert status.ready, f"{pod.metadata.name}/{status.name} is not ready"
            assert status.restart_count == 0, f"{pod.metadata.name}/{status.name} restarted"
        node = installed.nodes.nodes[pod.spec.node_name]
        for container in pod.spec.containers:
            status = next(s for s in pod.status.container_statuses if s.name == container.name)
            cid = status.container_id.rpartition("://")[2]
            pids = [pid for pid in node.container_pids(pod.metadata.uid) if cid in real_nodes._cgroup_text(pid)]
            assert pids, f"no process of {pod.metadata.name}/{container.name}"
            process = Path(f"/proc/{min(pids)}")
            uid = int(next(line.split()[1] for line in (process / "status").read_text().splitlines()
                           if line.startswith("Uid:")))
            root_mount = next(line for line in (process / "mountinfo").read_text().splitlines()
                              if line.split()[4] == "/")
            assert root_mount.split()[5].split(",")[0] == "ro", f"{pod.metadata.name}/{container.name}: {root_mount}"
            if container.name == "agent":  # reads the host's /proc of other users' processes (hostPID)
                assert uid == 0
            else:
                assert uid != 0, f"{pod.metadata.name}/{container.name} runs as root"
            image = status.image
            if container.name == "kube-scheduler":
                assert image.startswith("registry.k8s.io/kube-scheduler:v1.")
            else:
                assert image == chart_image_name(), image


def test_the_certificate_keeper_made_the_secrets_and_the_webhooks_trust_them(installed: Installed) -> None:
    core = installed.core_v1
    secrets = {name: core.read_namespaced_secret(name, NAMESPACE).data for name in TLS_SECRETS}
    ca = base64.b64decode(secrets["vramguard-webhook-tls"]["ca.crt"])
    admission = kubernetes_module().client.AdmissionregistrationV1Api(installed.cluster.api_client())
    validating = admission.read_validating_webhook_configuration("vramguard")
    mutating = admission.read_mutating_webhook_configuration("vramguard")
    for webhook in [*validating.webhooks, *mutating.webhooks]:
        assert webhook.client_config.service.name == "vramguard-webhook"
        assert base64.b64decode(webhook.client_config.ca_bundle) == ca


def test_a_vllm_deployment_is_routed_checked_and_placed_through_the_services(
    installed: Installed, enforced: str
) -> None:
    core = installed.core_v1
    assert guard_answers(core, enforced) is None
    apps = kubernetes_module().client.AppsV1Api(installed.cluster.api_client())
    apps.create_namespaced_deployment(enforced, vllm_deployment("chat"))

    def running() -> Any:
        pods = core.list_namespaced_pod(enforced, label_selector="app=chat").items
        return pods[0] if pods and pods[0].status.phase == "Running" else None

    pod = wait_for("the vLLM pod Running", running, timeout=120)
    assert pod.spec.scheduler_name == SCHEDULER
    assert pod.spec.node_name in installed.nodes.nodes
    assert PLACEMENT_ANNOTATION in (pod.metadata.annotations or {}), "not bound by vramguard's extender"
    # The node's agent, from the DaemonSet, writes its report to its own Node (RBAC and the node-scope
    # admission policy as deployed); with no NVML in the container it reports no GPU, and says so.
    wait_for("the agent's report", lambda: "vramguard.io/gpus" in (
        core.read_node(pod.spec.node_name).metadata.annotations or {}), timeout=120)


def test_helm_upgrade_keeps_the_guard_answering(installed: Installed, enforced: str) -> None:
    """Both webhooks answer every request while the upgrade rolls the webhook's and the scheduler's
    Deployments and the agents' DaemonSet (changed pod templates)."""
    core = installed.core_v1
    problems: list[str] = []
    answered = 0
    stop = threading.Event()

    def probe() -> None:
        nonlocal answered
        while not stop.is_set():
            problem = guard_answers(core, enforced)
            if problem:
                problems.append(problem)
            else:
                answered += 1
            time.sleep(0.2)

    before = {pod.metadata.name for pod in vramguard_pods(core)}
    old_webhooks = {name for name in before if "webhook" in name}
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    try:
        installed.helm_run("upgrade", RELEASE, str(CHART), "-n", NAMESPACE, "--reuse-values", "--wait",
                           "--timeout", "300s", "--set", "webhook.resources.requests.cpu=110m",
                           "--set", "scheduler.resources.requests.cpu=110m",
                           "--set", "agent.resources.requests.cpu=60m")
        # The old replicas drain (their grace period) while the probes go on.
        wait_for("the old webhook pods to go", lambda: not (old_webhooks & {
            pod.metadata.name for pod in vramguard_pods(core)}), timeout=120)
    finally:
        stop.set()
        thread.join(30)
    assert problems == [], problems[:5]
    after = wait_for("every vramguard pod Ready again", lambda: all_ready(core), timeout=120)
    assert len([pod for pod in after if "webhook" in pod.metadata.name]) == 2
    assert not ({pod.metadata.name for pod in after} & before - {n for n in before if "certificates" in n})
    assert problems == [], problems[:5]
    assert answered >= 10


def test_helm_uninstall_leaves_nothing(installed: Installed) -> None:
    """Runs last: every object of the release goes; what the pods made at run time (the keeper's
    Secrets, Leases) goes with the namespace, as docs/operations.md says."""
    installed.helm_run("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "300s")
    client = kubernetes_module().client
    api = installed.cluster.api_client()
    admission = client.AdmissionregistrationV1Api(api)
    rbac = client.RbacAuthorizationV1Api(api)
    scheduling = client.SchedulingV1Api(api)

    def named(items: Any) -> list[str]:
        return [item.metadata.name for item in items if "vramguard" in item.metadata.name]

    left = {
        "validating webhooks": named(admission.list_validating_webhook_configuration().items),
        "mutating webhooks": named(admission.list_mutating_webhook_configuration().items),
        "admission policies": named(admission.list_validating_admission_policy().items),
        "admission policy bindings": named(admission.list_validating_admission_policy_binding().items),
        "cluster roles": named(rbac.list_cluster_role().items),
        "cluster role bindings": named(rbac.list_cluster_role_binding().items),
        "priority classes": named(scheduling.list_priority_class().items),
    }
    assert not any(left.values()), left
    wait_for("the release's pods to go", lambda: not vramguard_pods(installed.core_v1), timeout=180)
    installed.core_v1.delete_namespace(NAMESPACE)
    wait_for("the namespace to go", lambda: NAMESPACE not in {
        ns.metadata.name for ns in installed.core_v1.list_namespace().items}, timeout=180)
