"""GPU nodes without GPU Feature Discovery: their GPUs as GKE, Karpenter and the instance type say.

Expected values: GKE's labels as its docs name them (cloud.google.com/kubernetes-engine/docs/how-to/
timesharing-gpus, nvidia-mps-gpus, gpus-multi), NVML's totals (GFD's nvidia.com/gpu.memory of the same
products), the instance types' GPUs per the clouds' specification pages (gpu_platforms.yaml cites each)."""

from __future__ import annotations

from typing import Any

import pytest

from vramguard.inventory import UNREADABLE, read_inventory
from vramguard.platforms import gpu_node_selector_terms, platform_gpus
from vramguard.quantity import MiB


def node(labels: dict[str, str], gpus: str | None) -> dict[str, Any]:
    obj: dict[str, Any] = {"metadata": {"name": "n", "labels": labels}}
    if gpus is not None:
        obj["status"] = {"allocatable": {"cpu": "16", "nvidia.com/gpu": gpus}}
    return obj


def summary(obj: dict[str, Any]) -> list[tuple[str, str, int, str, int]]:
    inventory = read_inventory(obj)
    return [(d.id, d.product, d.memory_bytes // MiB, d.sharing, d.replicas) for d in inventory.devices]


GKE_H100 = {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}

CASES = {
    # GKE: the accelerator names the product; the node advertises one nvidia.com/gpu per GPU.
    "gke-whole-gpus": (node(GKE_H100, "8"), [(str(i), "NVIDIA H100 80GB HBM3", 81559, "none", 1) for i in range(8)]),
    # GKE time-sharing: "the number of shared GPUs is the number of physical GPUs x max shared clients".
    "gke-time-sharing": (
        node({**GKE_H100, "cloud.google.com/gke-gpu-sharing-strategy": "time-sharing",
              "cloud.google.com/gke-max-shared-clients-per-gpu": "4"}, "4"),
        [("0", "NVIDIA H100 80GB HBM3", 81559, "time-slicing", 4)],
    ),
    "gke-mps": (
        node({**GKE_H100, "cloud.google.com/gke-gpu-sharing-strategy": "mps",
              "cloud.google.com/gke-max-shared-clients-per-gpu": "2"}, "4"),
        [(str(i), "NVIDIA H100 80GB HBM3", 81559, "mps", 2) for i in range(2)],
    ),
    # GKE MIG: partitions of a size, each served as nvidia.com/gpu; NVML's size of an H100's 1g.10gb.
    "gke-mig-partitions": (
        node({**GKE_H100, "cloud.google.com/gke-gpu-partition-size": "1g.10gb"}, "7"),
        [(f"1g.10gb#{i}", "NVIDIA H100 80GB HBM3", 9728, "mig", 1) for i in range(7)],
    ),
    # EKS with the device plugin only: the instance type; time-slicing shows as more units than GPUs.
    "eks-instance-type": (
        node({"node.kubernetes.io/instance-type": "p5.48xlarge"}, "8"),
        [(str(i), "NVIDIA H100 80GB HBM3", 81559, "none", 1) for i in range(8)],
    ),
    "eks-time-sliced-by-the-plugin": (
        node({"node.kubernetes.io/instance-type": "p5.48xlarge"}, "32"),
        [(str(i), "NVIDIA H100 80GB HBM3", 81559, "time-slicing", 4) for i in range(8)],
    ),
    "eks-an-unhealthy-gpu-leaves-allocatable": (
        node({"node.kubernetes.io/instance-type": "p5.48xlarge"}, "7"),
        [(str(i), "NVIDIA H100 80GB HBM3", 81559, "none", 1) for i in range(7)],
    ),
    # Karpenter's labels: EC2 says 81920 MiB for an H100, NVML 81559: the smaller counts.
    "karpenter-labels": (
        node({"karpenter.k8s.aws/instance-gpu-name": "h100", "karpenter.k8s.aws/instance-gpu-count": "8",
              "karpenter.k8s.aws/instance-gpu-memory": "81920",
              "karpenter.k8s.aws/instance-gpu-manufacturer": "nvidia"}, "8"),
        [(str(i), "NVIDIA H100 80GB HBM3", 81559, "none", 1) for i in range(8)],
    ),
    # Nothing describes it: the advertised units are devices of unknown memory (never dropped unseen).
    "unreadable": (node({"kubernetes.io/hostname": "n"}, "2"),
                   [(str(i), "unknown GPU", 0, "none", 1) for i in range(2)]),
    "no-gpu-advertised": (node(GKE_H100, None) | {"status": {"allocatable": {"cpu": "4"}}}, []),
}


@pytest.mark.parametrize(("obj", "expected"), CASES.values(), ids=CASES.keys())
def test_gpus_from_the_platforms_labels(obj: dict[str, Any], expected: list[tuple[str, str, int, str, int]]) -> None:
    assert summary(obj) == expected


def test_an_unreadable_node_says_so_and_gfd_labels_win() -> None:
    assert UNREADABLE in read_inventory(node({}, "2")).notes
    gfd = {"nvidia.com/gpu.count": "8", "nvidia.com/gpu.product": "NVIDIA-H200", "nvidia.com/gpu.memory": "143771",
           "node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert {d.product for d in read_inventory(node(gfd, "8")).devices} == {"NVIDIA H200"}


def test_lying_labels_cost_nothing() -> None:
    for clients in ("1000000", "-3", "x", ""):
        obj = node({**GKE_H100, "cloud.google.com/gke-gpu-sharing-strategy": "time-sharing",
                    "cloud.google.com/gke-max-shared-clients-per-gpu": clients}, "8")
        assert len(read_inventory(obj).devices) <= 8
    assert platform_gpus({"cloud.google.com/gke-accelerator": "nvidia-made-up"}) is None


def test_the_agent_runs_on_every_node_with_nvidia_gpus_however_labelled() -> None:
    keys = {term["matchExpressions"][0]["key"] for term in gpu_node_selector_terms()}
    assert {"nvidia.com/gpu.present", "cloud.google.com/gke-accelerator", "node.kubernetes.io/instance-type",
            "karpenter.k8s.aws/instance-gpu-manufacturer"} <= keys
