"""The default-scheduler layout (`manifests/overlays/default-scheduler`, the chart's
`mode=default-scheduler`): the extender wired into the cluster's own kube-scheduler, for clusters
whose control plane can take a scheduler configuration. The session cluster runs the
second-scheduler layout; this module keeps the other covered with the headline scenario.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from e2e import gpu_nodes, kube
from e2e.cluster import Cluster, ClusterConfig

WAIT = 60.0


@pytest.fixture(scope="module")
def default_layout(local_control_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(ClusterConfig(
        directory=tmp_path_factory.mktemp("default-layout"),
        kube_version=local_control_plane.version,
        second_scheduler=False,
        vramguard="on",
    ))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.down()


def vllm_pod(name: str, utilization: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {"containers": [{
        "name": "vllm", "image": "vllm/vllm-openai:v0.21.0",
        "args": ["--model", "m", "--gpu-memory-utilization", utilization],
        "resources": {"limits": {"nvidia.com/gpu": "1"}},
    }]}}


def test_four_vllm_pods_at_030_on_one_h100_three_placed_the_fourth_waits(default_layout: Cluster, unique: str) -> None:
    core = kube.kubernetes_module().client.CoreV1Api(default_layout.api_client())
    spec = gpu_nodes.time_sliced(f"h100-{unique}", "H100-80GB", replicas=4)
    gpu_nodes.create_gpu_node(core, spec)
    namespace = f"default-layout-{unique}"
    core.create_namespace({"metadata": {"name": namespace}})
    try:
        for i in range(4):
            core.create_namespaced_pod(namespace, vllm_pod(f"chat-{i}", "0.30"))
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            pods = core.list_namespaced_pod(namespace).items
            waiting = [
                c.message for p in pods for c in p.status.conditions or ()
                if c.type == "PodScheduled" and c.reason == "Unschedulable"
            ]
            if sum(1 for p in pods if p.spec.node_name) == 3 and waiting:
                break
            time.sleep(0.3)
        else:
            pytest.fail(f"not settled: {[(p.metadata.name, p.spec.node_name) for p in pods]}")
        # Nothing is routed: the default scheduler itself calls the extender.
        assert {p.spec.scheduler_name for p in pods} == {"default-scheduler"}
        assert "VRAM budget" in waiting[0], waiting
    finally:
        for pod in core.list_namespaced_pod(namespace).items:
            core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
        core.delete_namespace(namespace)
        core.delete_node(spec.name)
