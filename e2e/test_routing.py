"""Routing in the second-scheduler layout (the layout of managed clusters): the mutating webhook sends
GPU pods that name no scheduler to the vramguard scheduler, so workloads are guarded unedited.

The cluster is the Helm chart rendered with its defaults: both schedulers, kube-scheduler as
shipped (no extender: it would place every pod that has a replica free) and the vramguard scheduler
with the chart's configuration calling the extender on loopback; the chart's RBAC, webhook
configurations, admission policies and policy. The services run as processes (or from the image,
as the rest of the suite).
"""

from __future__ import annotations

import time
import urllib.error
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e import gpu_nodes, kube
from e2e.cluster import Cluster, ClusterConfig
from e2e.test_webhook import warnings_of
from tests.test_manifests import render_chart

WAIT = 60.0
MUTATING = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"

# vLLM's own Kubernetes guide (docs/deployment/k8s.md, "Deployment with GPUs"): a Deployment that
# names no scheduler and starts `vllm serve` through a shell, at vLLM's default
# --gpu-memory-utilization (0.9 in v0.6.3, vllm/engine/arg_utils.py). Its Secret and PVC are left
# out: no kubelet runs here, so nothing mounts them.
VLLM_DOCS_DEPLOYMENT: dict[str, Any] = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "vllm"},
    "spec": {
        "replicas": 2,
        "selector": {"matchLabels": {"app": "vllm"}},
        "template": {
            "metadata": {"labels": {"app": "vllm"}},
            "spec": {
                "containers": [{
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.6.3",
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["/bin/sh", "-c"],
                    "args": [
                        "vllm serve mistralai/Mistral-7B-Instruct-v0.3 --trust-remote-code "
                        "--enable-chunked-prefill --max_num_batched_tokens 1024"
                    ],
                    "ports": [{"containerPort": 8000}],
                    "resources": {
                        "limits": {"cpu": "10", "memory": "16Gi", "nvidia.com/gpu": "1"},
                        "requests": {"cpu": "2", "memory": "6Gi", "nvidia.com/gpu": "1"},
                    },
                }],
            },
        },
    },
}


def chart_defaults(root: Path) -> Path:
    """The chart rendered with its defaults (``helm template``), laid out as the harness reads
    manifests: every object, the second scheduler's configuration from its ConfigMap; returns the
    policy file from the policy ConfigMap."""
    objects = render_chart()
    (root / "scheduler").mkdir(parents=True)
    (root / "chart.yaml").write_text(yaml.safe_dump_all(objects))
    configmaps = {o["metadata"]["name"]: o["data"] for o in objects if o["kind"] == "ConfigMap"}
    (root / "scheduler" / "second-scheduler.yaml").write_text(configmaps["vramguard-scheduler-config"]["config.yaml"])
    policy = root / "policy.yaml"
    policy.write_text(configmaps["vramguard-policy"]["policy.yaml"])
    return policy


@pytest.fixture(scope="module")
def layout(local_control_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The chart rendered with its defaults: the second scheduler's configuration, RBAC, both webhook
    configurations, the admission policies and the policy, with the extender and the webhook."""
    root = tmp_path_factory.mktemp("chart-defaults")
    policy = chart_defaults(root)
    cluster = Cluster(ClusterConfig(
        directory=tmp_path_factory.mktemp("routing-cluster"),
        kube_version=local_control_plane.version,
        second_scheduler=True,
        vramguard="on",
        manifests=root,
        policy=policy,
        # The chart's sidecar: kube-scheduler's own election picks the one extender it calls.
        service_args={"extender": ["--leader-elect=false"]},
    ))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.down()


class Scene:
    """One test's namespace and GPU node on :func:`layout`."""

    def __init__(self, cluster: Cluster, unique: str) -> None:
        self.cluster = cluster
        self.unique = unique
        self.core = kube.kubernetes_module().client.CoreV1Api(cluster.api_client())
        self.apps = kube.kubernetes_module().client.AppsV1Api(cluster.api_client())
        self.namespaces: list[str] = []
        self.extra_nodes: list[str] = []
        spec = gpu_nodes.time_sliced(f"h100-{unique}", "H100-80GB", replicas=4)
        self.node = spec.name
        gpu_nodes.create_gpu_node(self.core, spec)

    def namespace(self, suffix: str, labels: dict[str, str] | None = None) -> str:
        name = f"routing-{suffix}-{self.unique}"
        self.core.create_namespace({"metadata": {"name": name, "labels": labels or {}}})
        self.namespaces.append(name)
        return name

    def pods(self, namespace: str) -> list[Any]:
        return list(self.core.list_namespaced_pod(namespace).items)

    def settled(self, namespace: str, count: int) -> list[Any]:
        """Wait until ``count`` pods exist and each is bound or judged unschedulable."""
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            pods = self.pods(namespace)
            if len(pods) == count and all(p.spec.node_name or _unschedulable(p) for p in pods):
                return pods
            time.sleep(0.3)
        pytest.fail(f"pods of {namespace} did not settle: {[(p.metadata.name, p.spec.node_name) for p in pods]}")

    def cleanup(self) -> None:
        for namespace in self.namespaces:
            for pod in self.pods(namespace):
                self.core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
            self.core.delete_namespace(namespace)
        for node in [self.node, *self.extra_nodes]:
            self.core.delete_node(node)


def _unschedulable(pod: Any) -> str:
    for condition in pod.status.conditions or ():
        if condition.type == "PodScheduled" and condition.reason == "Unschedulable":
            return str(condition.message)
    return ""


@pytest.fixture
def scene(layout: Cluster, unique: str) -> Iterator[Scene]:
    made = Scene(layout, unique)
    yield made
    made.cleanup()


def gpu_pod(name: str, utilization: str, scheduler: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{
        "name": "vllm", "image": "vllm/vllm-openai:v0.21.0",
        "args": ["--model", "m", "--gpu-memory-utilization", utilization],
        "resources": {"limits": {"nvidia.com/gpu": "1"}},
    }]}
    if scheduler is not None:
        spec["schedulerName"] = scheduler
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def test_an_unedited_vllm_deployment_is_routed_and_never_overcommits_the_gpu(scene: Scene) -> None:
    """Two replicas at vLLM's default 0.9 on one H100 with four time-slicing replicas: kube-scheduler
    alone would place both. Routed, one is placed and the other waits with the arithmetic."""
    namespace = scene.namespace("deployment")
    scene.apps.create_namespaced_deployment(namespace, VLLM_DOCS_DEPLOYMENT)
    pods = scene.settled(namespace, 2)
    assert {p.spec.scheduler_name for p in pods} == {"vramguard"}
    bound = [p for p in pods if p.spec.node_name]
    assert [p.spec.node_name for p in bound] == [scene.node]
    [waiting] = [p for p in pods if not p.spec.node_name]
    assert "VRAM" in _unschedulable(waiting), _unschedulable(waiting)


def test_an_opted_out_namespace_keeps_its_pods_on_their_scheduler_and_is_told(scene: Scene) -> None:
    namespace = scene.namespace("opted-out", {"vramguard.io/routing": "disabled"})
    response = scene.core.create_namespaced_pod(namespace, gpu_pod("left", "0.9"), _preload_content=False)
    assert "not guarded: default-scheduler does not call vramguard (namespace opts out of routing); set " \
        "schedulerName: vramguard" in warnings_of(response), warnings_of(response)
    [pod] = scene.settled(namespace, 1)
    assert pod.spec.scheduler_name == "default-scheduler"


def test_a_pod_naming_another_scheduler_is_left_to_it(scene: Scene) -> None:
    namespace = scene.namespace("other")
    response = scene.core.create_namespaced_pod(namespace, gpu_pod("batch", "0.5", "volcano"), _preload_content=False)
    assert "not guarded: volcano does not call vramguard; set schedulerName: vramguard" in warnings_of(response)
    pod = scene.core.read_namespaced_pod("batch", namespace)
    assert pod.spec.scheduler_name == "volcano" and not pod.spec.node_name


def test_without_the_mutating_webhook_an_unrouted_gpu_pod_is_refused_in_every_mode(scene: Scene) -> None:
    """Routing never makes things worse: with the mutating webhook gone (down: its failurePolicy is
    Ignore), an enforcing namespace refuses the pod (the validating webhook's Fail entry), and so does an
    auditing one (the chart's ValidatingAdmissionPolicy vramguard-gpu-pods-routed, inside the API
    server): never placed by default-scheduler, which counts no VRAM. The controller retries."""
    enforcing = scene.namespace("enforce", {"vramguard.io/enforce": "enforce"})
    auditing = scene.namespace("audit")
    saved = scene.cluster.request("GET", f"{MUTATING}/vramguard")
    scene.cluster.request("DELETE", f"{MUTATING}/vramguard")
    try:
        with pytest.raises(kube.api_exception()) as refused:
            scene.core.create_namespaced_pod(enforcing, gpu_pod("refused", "0.3"))
        assert "was not routed to the vramguard scheduler" in str(getattr(refused.value, "body", ""))
        with pytest.raises(kube.api_exception()) as refused:
            scene.core.create_namespaced_pod(auditing, gpu_pod("refused", "0.3"))
        assert "was not routed to the vramguard scheduler (the vramguard webhook did not answer)" in str(
            getattr(refused.value, "body", ""))
    finally:
        for key in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
            saved["metadata"].pop(key, None)
        try:
            scene.cluster.request("POST", MUTATING, saved)
        except urllib.error.HTTPError as error:
            if error.code != 409:
                raise
    # Back: the next pod is routed.
    scene.core.create_namespaced_pod(enforcing, gpu_pod("routed", "0.3"))
    assert scene.core.read_namespaced_pod("routed", enforcing).spec.scheduler_name == "vramguard"


# --------------------------------------------------------------------------- nodes without GPU Feature Discovery


def platform_node(scene: Scene, spec: gpu_nodes.GPUNodeSpec) -> dict[str, str]:
    """Create ``spec`` (labelled for this test alone) and return the node selector that reaches it."""
    selector = {"e2e.vramguard.io/platform": scene.unique}
    gpu_nodes.create_gpu_node(scene.core, replace(spec, extra_labels={**spec.extra_labels, **selector}))
    scene.extra_nodes.append(spec.name)
    return selector


def on(pod: dict[str, Any], selector: dict[str, str]) -> dict[str, Any]:
    pod["spec"]["nodeSelector"] = selector
    return pod


def test_a_gke_time_sharing_node_is_read_from_gkes_labels(scene: Scene) -> None:
    # GKE labels a time-sharing H100 node with its accelerator and clients per GPU, and no GPU Feature
    # Discovery label; it advertises one nvidia.com/gpu per client. Four vLLM pods at 0.30 of the H100:
    # 4 x 0.30 = 1.20 of the GPU, so three run and the fourth waits (the seed scenario).
    spec = gpu_nodes.time_sliced(f"gke-{scene.unique}", "H100-80GB", replicas=4, platform="gke")
    selector = platform_node(scene, spec)
    namespace = scene.namespace("gke")
    for i in range(4):
        scene.core.create_namespaced_pod(namespace, on(gpu_pod(f"chat-{i}", "0.30"), selector))
    pods = scene.settled(namespace, 4)
    assert sorted(bool(p.spec.node_name) for p in pods) == [False, True, True, True]
    [waiting] = [p for p in pods if not p.spec.node_name]
    assert "GPU (NVIDIA H100 80GB HBM3): VRAM budget free below" in _unschedulable(waiting), _unschedulable(waiting)


def test_an_eks_node_with_the_device_plugin_alone_is_read_from_its_instance_type(scene: Scene) -> None:
    # A g6e.xlarge (one L40S, 46068 MiB) time-sliced x4 by the device plugin, no GFD: the instance type
    # and the capacity say it. Two vLLM pods at 0.45 (0.45 x 46068 MiB and a CUDA context each) fit the
    # shared GPU's budget (97 %), a third does not, though replicas are left.
    spec = gpu_nodes.time_sliced(f"eks-{scene.unique}", "L40S", replicas=4, platform="instance-type")
    selector = platform_node(scene, spec)
    namespace = scene.namespace("eks")
    for i in range(3):
        scene.core.create_namespaced_pod(namespace, on(gpu_pod(f"chat-{i}", "0.45"), selector))
    pods = scene.settled(namespace, 3)
    assert sorted(bool(p.spec.node_name) for p in pods) == [False, True, True]
    [waiting] = [p for p in pods if not p.spec.node_name]
    assert "GPU (NVIDIA L40S): VRAM budget free below" in _unschedulable(waiting), _unschedulable(waiting)


def test_a_node_nobody_describes_strands_no_pod_outside_enforce(scene: Scene) -> None:
    # Nothing says what this node's GPUs are: where the namespace audits (the default), a GPU pod goes
    # there as the stock scheduler would send it, and the node is reported; where it enforces, the pod
    # waits with the reason and the fix.
    spec = gpu_nodes.time_sliced(f"bare-{scene.unique}", "H100-80GB", replicas=4, platform="none")
    selector = platform_node(scene, spec)
    auditing = scene.namespace("bare-audit")
    scene.core.create_namespaced_pod(auditing, on(gpu_pod("placed", "0.9"), selector))
    [pod] = scene.settled(auditing, 1)
    assert pod.spec.node_name == spec.name
    enforcing = scene.namespace("bare-enforce", {"vramguard.io/enforce": "enforce"})
    scene.core.create_namespaced_pod(enforcing, on(gpu_pod("waits", "0.3"), selector))
    [pod] = scene.settled(enforcing, 1)
    assert "memory size unknown, so the pod's VRAM cannot be checked there" in _unschedulable(pod)

    def reported() -> bool:
        events = scene.core.list_namespaced_event("default").items
        return any(e.reason == "GPUsUnreadable" and e.involved_object.name == spec.name for e in events)

    deadline = time.monotonic() + WAIT
    while not reported():
        assert time.monotonic() < deadline, "no GPUsUnreadable Event on the node"
        time.sleep(0.5)

