"""GPU nodes without GPU Feature Discovery: their GPUs as GKE, Karpenter and the instance type say.

Expected values: GKE's labels as its docs name them (cloud.google.com/kubernetes-engine/docs/how-to/
timesharing-gpus, nvidia-mps-gpus, gpus-multi), NVML's totals (GFD's nvidia.com/gpu.memory of the same
products), the instance types' GPUs per the clouds' specification pages (gpu_platforms.yaml cites each)."""

from __future__ import annotations

from typing import Any

import pytest

from e2e import gpu_nodes
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
    # Auto-provisioned GKE nodes spell the strategy TIME_SHARING.
    "gke-time-sharing-auto-provisioned": (
        node({**GKE_H100, "cloud.google.com/gke-gpu-sharing-strategy": "TIME_SHARING",
              "cloud.google.com/gke-max-shared-clients-per-gpu": "2"}, "2"),
        [("0", "NVIDIA H100 80GB HBM3", 81559, "time-slicing", 2)],
    ),
    # MIG and time-sharing: "1g.5gb ... 7 partitions ... max-shared-clients-per-gpu to 3 ... up to 21"
    # (GKE's GPU sharing docs): the capacity counts partitions x clients.
    "gke-mig-time-shared": (
        node({**GKE_H100, "cloud.google.com/gke-gpu-partition-size": "1g.10gb",
              "cloud.google.com/gke-gpu-sharing-strategy": "time-sharing",
              "cloud.google.com/gke-max-shared-clients-per-gpu": "3"}, "21"),
        [(f"1g.10gb#{i}", "NVIDIA H100 80GB HBM3", 9728, "mig", 3) for i in range(7)],
    ),
    # Karpenter names p4d's and p4de's GPUs both a100; EC2's memory tells them apart.
    "karpenter-a100-80gb": (
        node({"karpenter.k8s.aws/instance-gpu-name": "a100", "karpenter.k8s.aws/instance-gpu-count": "8",
              "karpenter.k8s.aws/instance-gpu-memory": "81920"}, "8"),
        [(str(i), "NVIDIA A100-SXM4-80GB", 81920, "none", 1) for i in range(8)],
    ),
    "karpenter-a100-40gb": (
        node({"karpenter.k8s.aws/instance-gpu-name": "a100", "karpenter.k8s.aws/instance-gpu-count": "8",
              "karpenter.k8s.aws/instance-gpu-memory": "40960"}, "8"),
        [(str(i), "NVIDIA A100-SXM4-40GB", 40960, "none", 1) for i in range(8)],
    ),
    # AKS keeps Azure's case, Karpenter for Azure lowers it.
    "aks-instance-type-in-lower-case": (
        node({"node.kubernetes.io/instance-type": "standard_nd96isr_h100_v5"}, "8"),
        [(str(i), "NVIDIA H100 80GB HBM3", 81559, "none", 1) for i in range(8)],
    ),
    # NVadsA10 v5 is an NVIDIA vGPU: the guest sees an A10-24Q of 24512 MiB, not an A10 of 23028.
    "azure-a10-vgpu": (
        node({"node.kubernetes.io/instance-type": "Standard_NV36ads_A10_v5"}, "1"),
        [("0", "NVIDIA A10-24Q", 24512, "none", 1)],
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


@pytest.mark.parametrize(
    ("labels", "key"),
    [({"cloud.google.com/gke-accelerator": value}, key) for key, value in gpu_nodes.GKE_ACCELERATORS.items()]
    + [({"node.kubernetes.io/instance-type": value}, key) for (key, _), value in gpu_nodes.INSTANCE_TYPES.items()],
    ids=str,
)
def test_the_e2e_nodes_are_labelled_as_the_table_reads_them(labels: dict[str, str], key: str) -> None:
    # The e2e clusters' GKE and EKS nodes carry these labels; their GPUs (NVML's product and total,
    # as GFD would label them) must be what the table says.
    model = gpu_nodes.gpu_model(key)
    found = platform_gpus(labels)
    assert found is not None and (found.product, found.memory_mib) == (model.nvml_name, model.memory_mib)


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
