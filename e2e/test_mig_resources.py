"""MIG resources on the real control plane: kube-scheduler sends the extender every GPU resource the
ledger reads (its managedResources are generated from that list), so a time-sliced MIG instance is
filled by VRAM, not by its replica count.
"""

from __future__ import annotations

from typing import Any

import pytest

from e2e import gpu_nodes
from e2e.scenario import TEST_LABEL, require_extender
from e2e.test_extender import create_all, scheduling_message, settle, vllm_pod

pytestmark = pytest.mark.timeout(240)

B200_1G_23GB_MIB = 20992
"""NVML's size of a B200 1g.23gb instance (vramguard/inventory.py MIG_INSTANCE_MIB, mig-parted#166)."""
RENAMED = "nvidia.com/mig-1g.23gb.shared"


def time_sliced_b200_instance(name: str, unique: str, replicas: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A B200 node with one 1g.23gb instance time-sliced under ``renameByDefault``, as GPU Feature
    Discovery labels it (the labels keep the plain name: k8s-device-plugin v0.20.0
    internal/lm/resource_test.go, "mig mixed rename does not append"); only this test's pods may use it."""
    plain = RENAMED.removesuffix(".shared")
    labels = {
        "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", TEST_LABEL: unique,
        "nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": "1", "nvidia.com/gpu.replicas": "0",
        "nvidia.com/gpu.product": "NVIDIA-B200", "nvidia.com/mig.capable": "true", "nvidia.com/mig.strategy": "mixed",
        f"{plain}.count": "1", f"{plain}.replicas": str(replicas), f"{plain}.sharing-strategy": "time-slicing",
        f"{plain}.memory": str(B200_1G_23GB_MIB), f"{plain}.product": "NVIDIA-B200-MIG-1g.23gb",
    }
    manifest = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
                "spec": {"taints": [{"key": TEST_LABEL, "value": unique, "effect": "NoSchedule"}]}}
    status = gpu_nodes.cpu_node_status(name)
    for section in ("capacity", "allocatable"):
        status[section][RENAMED] = str(replicas)
    return manifest, status


def test_a_renamed_time_sliced_b200_instance_takes_what_fits_its_memory_not_its_replicas(
    cluster: Any, core_v1: Any, namespace: str, unique: str
) -> None:
    require_extender(cluster)
    node = f"b200-{unique}"
    manifest, status = time_sliced_b200_instance(node, unique, replicas=4)
    core_v1.create_node(body=manifest)
    try:
        core_v1.patch_node_status(name=node, body={"status": status}, _content_type="application/merge-patch+json")
        # Each vLLM at 0.4 holds 0.4 x 20992 MiB and its 512 MiB CUDA context: two fit the instance's
        # budget (97% of it), a third does not, though four replicas are free.
        create_all(core_v1, namespace, [vllm_pod(f"chat-{i}", "0.4", unique, resource=RENAMED) for i in range(4)])
        placed = settle(core_v1, namespace, 2)
        assert sorted(n for n in placed.values() if n) == [node] * 2, placed
        for pending in (name for name, n in placed.items() if n is None):
            assert "VRAM" in scheduling_message(core_v1.read_namespaced_pod(pending, namespace))
    finally:
        core_v1.delete_node(name=node)
