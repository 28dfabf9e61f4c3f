"""A node's GPUs from what its platform puts on it, where GPU Feature Discovery does not label it.

GKE's GPU nodes carry GKE's own labels and no GPU Feature Discovery; EKS and AKS nodes with only the
NVIDIA device plugin (its chart leaves GFD off by default) carry none of either. What each says, in
the order read (the first that names the GPU wins; GFD's labels, read by :mod:`vramguard.inventory`,
and the agent's NVML report come before all of them):

- **GKE** (``cloud.google.com/gke-accelerator``): the accelerator names the product, whose memory is in
  the table; ``cloud.google.com/gke-gpu-sharing-strategy`` (``time-sharing``, ``mps``)
  with ``cloud.google.com/gke-max-shared-clients-per-gpu`` says how many containers share a GPU; and
  ``cloud.google.com/gke-gpu-partition-size`` names the MIG instances the GPUs are cut into, served
  as ``nvidia.com/gpu``.
- **Karpenter** (``karpenter.k8s.aws/instance-gpu-name``, ``-count``, ``-memory``): the instance's GPUs
  as EC2 describes them. EC2's memory is not NVML's (81,920 MiB for an H100 whose NVML total is
  81,559; 16,384 for a T4 of 15,360): a product of the table counts NVML's total, the one nearest
  EC2's figure where a name covers several (``a100``: 40 and 80 GB); another counts the smaller of
  EC2's figure and nothing else.
- **The instance type** (``node.kubernetes.io/instance-type``) of the GPU instance families of AWS, GCP
  and Azure (looked up without case: AKS keeps Azure's, Karpenter for Azure lowers it).

Sharing the platform does not label (time-slicing configured in the device plugin, on a node only
the instance type describes) shows in the node's capacity: more ``nvidia.com/gpu`` than GPUs. Each
GPU then counts that many replicas, time-sliced (the plugin's default).

The tables are data, each entry with its source (``gpu_platforms.yaml``).
"""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import yaml

__all__ = [
    "GKE_ACCELERATOR",
    "GKE_PARTITION",
    "GKE_SHARING",
    "INSTANCE_TYPE",
    "PlatformGpus",
    "gpu_node_selector_terms",
    "platform_gpus",
]

GKE_ACCELERATOR = "cloud.google.com/gke-accelerator"
GKE_SHARING = "cloud.google.com/gke-gpu-sharing-strategy"
GKE_CLIENTS = "cloud.google.com/gke-max-shared-clients-per-gpu"
GKE_PARTITION = "cloud.google.com/gke-gpu-partition-size"
INSTANCE_TYPE = "node.kubernetes.io/instance-type"
LEGACY_INSTANCE_TYPE = "beta.kubernetes.io/instance-type"
KARPENTER_NAME = "karpenter.k8s.aws/instance-gpu-name"
KARPENTER_COUNT = "karpenter.k8s.aws/instance-gpu-count"
KARPENTER_MEMORY = "karpenter.k8s.aws/instance-gpu-memory"
KARPENTER_MANUFACTURER = "karpenter.k8s.aws/instance-gpu-manufacturer"
GKE_SHARING_STRATEGIES: Mapping[str, Literal["time-slicing", "mps"]] = {"time-sharing": "time-slicing", "mps": "mps"}
"""GKE's sharing strategies (its docs write ``time-sharing``, auto-provisioned nodes ``TIME_SHARING``)."""
MAX_CLIENTS = 48
"""GKE allows at most 48 clients per GPU (time-sharing and MPS alike); a label saying more is read as 48."""
DATA = "gpu_platforms.yaml"


@dataclass(frozen=True, slots=True)
class PlatformGpus:
    """What a platform's labels say of a node's GPUs."""

    source: str
    """Where it was read, for notes and tables (``GKE accelerator nvidia-h100-80gb``)."""
    product: str
    memory_mib: int | None
    """Memory of one GPU as NVML reports it; ``None`` for MIG instances (:attr:`mig_profile` sizes them)."""
    gpus: int | None = None
    """Physical GPUs on the node, where the platform says (else the advertised count decides)."""
    replicas: int = 1
    sharing: Literal["none", "time-slicing", "mps", "mig"] = "none"
    mig_profile: str | None = None


@dataclass(frozen=True, slots=True)
class _Gpu:
    product: str
    memory_mib: int


@dataclass(frozen=True, slots=True)
class _Tables:
    gke: Mapping[str, _Gpu]
    instances: Mapping[str, tuple[_Gpu, int]]
    """By the instance type in lower case."""
    karpenter: Mapping[str, tuple[_Gpu, ...]]


@functools.lru_cache(maxsize=1)
def _data() -> Any:
    return yaml.safe_load(importlib.resources.files("vramguard").joinpath(DATA).read_text("utf-8"))


@functools.lru_cache(maxsize=1)
def _tables() -> _Tables:
    data = _data()
    gpus = {name: _Gpu(entry["product"], int(entry["memory_mib"])) for name, entry in data["gpus"].items()}
    gke = {name: gpus[gpu] for name, gpu in data["gke_accelerators"].items()}
    instances = {
        name.lower(): (gpus[entry["gpu"]], int(entry["gpus"]))
        for cloud in data["instance_types"].values()
        for name, entry in cloud.items()
    }
    karpenter = {name: tuple(gpus[gpu] for gpu in names) for name, names in data["karpenter_gpu_names"].items()}
    return _Tables(gke, instances, karpenter)


def platform_gpus(labels: Mapping[str, str]) -> PlatformGpus | None:
    """The node's GPUs as its platform labels them, or ``None`` when no label names them."""
    tables = _tables()
    accelerator = labels.get(GKE_ACCELERATOR)
    if accelerator is not None and accelerator in tables.gke:
        return _gke(accelerator, tables.gke[accelerator], labels)
    instance = labels.get(INSTANCE_TYPE) or labels.get(LEGACY_INSTANCE_TYPE)
    if instance is not None and instance.lower() in tables.instances:
        gpu, count = tables.instances[instance.lower()]
        return PlatformGpus(f"instance type {instance}", gpu.product, gpu.memory_mib, count)
    return _karpenter(labels, tables)


def _gke(accelerator: str, gpu: _Gpu, labels: Mapping[str, str]) -> PlatformGpus:
    source = f"GKE accelerator {accelerator}"
    strategy = GKE_SHARING_STRATEGIES.get(labels.get(GKE_SHARING, "").strip().lower().replace("_", "-"))
    clients = _positive(labels.get(GKE_CLIENTS))
    shared = strategy is not None and clients is not None and clients > 1
    clients = min(clients, MAX_CLIENTS) if shared and clients is not None else 1
    partition = labels.get(GKE_PARTITION)
    if partition:
        # Each partition is served as nvidia.com/gpu, and shared by the clients where a strategy says.
        return PlatformGpus(f"{source}, MIG partitions {partition}" + (f", {labels[GKE_SHARING]} x{clients}"
                            if shared else ""), gpu.product, None, replicas=clients, sharing="mig",
                            mig_profile=partition)
    if shared:
        assert strategy is not None
        return PlatformGpus(f"{source}, {labels[GKE_SHARING]} x{clients}", gpu.product, gpu.memory_mib,
                            replicas=clients, sharing=strategy)
    return PlatformGpus(source, gpu.product, gpu.memory_mib)


def _karpenter(labels: Mapping[str, str], tables: _Tables) -> PlatformGpus | None:
    """Karpenter's labels: a product of the table counts NVML's total (the one nearest EC2's figure
    where the name covers several; the smallest without a figure); another, EC2's figure."""
    name = labels.get(KARPENTER_NAME)
    count = _positive(labels.get(KARPENTER_COUNT))
    memory = _positive(labels.get(KARPENTER_MEMORY))
    if name is None or count is None or labels.get(KARPENTER_MANUFACTURER, "nvidia") != "nvidia":
        return None
    source = f"Karpenter instance-gpu-name {name}"
    candidates = tables.karpenter.get(name, ())
    if candidates:
        known = min(candidates, key=lambda gpu: (abs(gpu.memory_mib - memory) if memory else 0, gpu.memory_mib))
        return PlatformGpus(source, known.product, known.memory_mib, count)
    if memory is None:
        return None
    return PlatformGpus(source, f"NVIDIA {name.upper()}", memory, count)


def _instance_type_names() -> list[str]:
    """The table's instance types as the clouds write them, and in lower case (Karpenter for Azure)."""
    names = {name for cloud in _data()["instance_types"].values() for name in cloud}
    return sorted(names | {name.lower() for name in names})


def _positive(value: str | None) -> int | None:
    if value is None or not value.strip().isdigit() or len(value.strip()) > 9:
        return None
    number = int(value)
    return number if number > 0 else None


def gpu_node_selector_terms() -> list[dict[str, Any]]:
    """nodeSelectorTerms (ORed) matching a node with NVIDIA GPUs however it is labelled: GFD, GKE, AKS,
    Karpenter, Node Feature Discovery's PCI vendor 10de, or an instance type of the table."""
    return [
        {"matchExpressions": [{"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}]},
        {"matchExpressions": [{"key": GKE_ACCELERATOR, "operator": "Exists"}]},
        {"matchExpressions": [{"key": "kubernetes.azure.com/accelerator", "operator": "In", "values": ["nvidia"]}]},
        {"matchExpressions": [{"key": KARPENTER_MANUFACTURER, "operator": "In", "values": ["nvidia"]}]},
        {"matchExpressions": [{"key": "feature.node.kubernetes.io/pci-10de.present", "operator": "In",
                               "values": ["true"]}]},
        {"matchExpressions": [{"key": INSTANCE_TYPE, "operator": "In", "values": _instance_type_names()}]},
    ]
