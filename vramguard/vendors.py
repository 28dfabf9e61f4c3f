"""Accelerator vendors: which extended resources are whose GPUs, and how their nodes describe them.

NVIDIA's GPUs are read from GPU Feature Discovery's labels and the node agent (:mod:`vramguard.inventory`).
Every other vendor is an entry of :data:`VENDORS`: the resource names its device plugin advertises, the
labels its node labeller writes, and what is known of how engines size their share there. A vendor's
devices are read from those labels, each advertised unit one device of its own (no time-slicing); the
node agent reads NVML only, so their measured use is not known. A new vendor is a new entry.

**AMD** (ROCm/k8s-device-plugin v1.31.0.10, ``cmd/k8s-device-plugin/main.go``,
``cmd/k8s-node-labeller/main.go``):

- ``amd.com/gpu``, one unit a GPU, or with partitioning and ``-resource_naming_strategy=mixed`` one
  resource per partition type, ``amd.com/<compute>_<memory>`` (``amd.com/cpx_nps4``): each partition is a
  device of its own (its ``/dev/dri`` nodes), a share of the GPU's memory (MI300X CPX: 24 GB of 192);
- the labeller's ``amd.com/gpu.vram`` is each device's memory (a partition's, since labeller PR #108) in
  whole GiB with a ``G`` suffix, rounded (``192G`` for an MI300X whose HIP total is 191.98 GiB), and
  ``amd.com/gpu.product-name`` its name with ``_`` for spaces (``AMD_Instinct_MI300X_OAM``); on a node
  with devices of several sizes the plain label is absent and the memory is unknown;
- vLLM on ROCm sizes its share of ``torch.cuda.mem_get_info`` (HIP) total with the same worker as on CUDA
  (``platforms/rocm.py`` ``worker_cls``, v0.11.0 and v0.20.0): a fraction means the same there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from vramguard.quantity import GiB

__all__ = [
    "DEFAULT_GPU_RESOURCES", "DEFAULT_PARTITION_PREFIXES", "NVIDIA_GPU_RESOURCES", "NVIDIA_MIG_PREFIXES",
    "OTHER_ACCELERATORS", "VENDORS", "Vendor", "partition_names", "vendor_of",
]


@dataclass(frozen=True, slots=True)
class Vendor:
    """One vendor's GPUs as its device plugin and node labeller publish them."""

    name: str
    domain: str
    """The resources' and labels' domain, with its slash (``amd.com/``)."""
    resources: tuple[str, ...]
    """Whole-device resources."""
    partition_prefixes: tuple[str, ...]
    """Prefixes of the partition resources (each unit a device of its own)."""
    partition_suffixes: tuple[str, ...]
    """What may follow a partition prefix, for lists of exact names (kube-scheduler's ``managedResources``)."""
    memory_label: str
    """The label giving each device's memory (:meth:`memory_bytes` reads its value)."""
    product_label: str
    source: str

    def is_resource(self, name: str) -> bool:
        """Whether ``name`` is one of this vendor's GPU or partition resources."""
        return name in self.resources or name.startswith(self.partition_prefixes)

    def memory_bytes(self, labels: Mapping[str, str]) -> int | None:
        """Each device's memory from the labels, or ``None`` (absent, several sizes, or junk)."""
        value = labels.get(self.memory_label, "").strip()
        found = re.fullmatch(r"(\d{1,5})G", value)
        return int(found.group(1)) * GiB if found and int(found.group(1)) > 0 else None

    def product(self, labels: Mapping[str, str]) -> str:
        """The devices' product name, or ``<vendor> GPU``."""
        name = labels.get(self.product_label, "").strip()[:128]
        return name.replace("_", " ") if name else f"{self.name} GPU"


AMD = Vendor(
    name="AMD",
    domain="amd.com/",
    resources=("amd.com/gpu",),
    partition_prefixes=tuple(f"amd.com/{mode}_" for mode in ("spx", "dpx", "tpx", "qpx", "cpx")),
    # The memory partition modes the driver reports (NPS1, NPS2, NPS4, NPS8), lower-cased.
    partition_suffixes=("nps1", "nps2", "nps4", "nps8"),
    memory_label="amd.com/gpu.vram",
    product_label="amd.com/gpu.product-name",
    source="ROCm/k8s-device-plugin v1.31.0.10 (device plugin and node labeller)",
)
VENDORS: tuple[Vendor, ...] = (AMD,)

NVIDIA_GPU_RESOURCES: tuple[str, ...] = ("nvidia.com/gpu", "nvidia.com/gpu.shared")
"""A whole GPU or a replica, and the name a replicated GPU takes under the device plugin's
``renameByDefault`` (NVIDIA/k8s-device-plugin v0.20.0 ``DefaultSharedResourceNameSuffix``)."""
NVIDIA_MIG_PREFIXES: tuple[str, ...] = ("nvidia.com/mig-",)
DEFAULT_GPU_RESOURCES: tuple[str, ...] = (*NVIDIA_GPU_RESOURCES, *(r for v in VENDORS for r in v.resources))
DEFAULT_PARTITION_PREFIXES: tuple[str, ...] = (
    *NVIDIA_MIG_PREFIXES, *(p for v in VENDORS for p in v.partition_prefixes)
)
"""What a policy that names no GPU resources reads: every vendor's."""

OTHER_ACCELERATORS: Mapping[str, str] = {
    "gpu.intel.com/": "Intel GPU", "habana.ai/": "Intel Gaudi", "aws.amazon.com/neuron": "AWS Neuron",
    "google.com/tpu": "Google TPU", "cloud-tpus.google.com/": "Google TPU", "xilinx.com/": "AMD Xilinx FPGA",
}
"""Resource prefixes of accelerators vramguard does not read: a container asking for one is named
in a warning, never passed over."""


def partition_names(prefix: str) -> tuple[str, ...] | None:
    """What may follow ``prefix`` when it is a vendor's partition prefix; ``None`` otherwise."""
    for vendor in VENDORS:
        if prefix in vendor.partition_prefixes:
            return vendor.partition_suffixes
    return None


def vendor_of(resource: str) -> Vendor | None:
    """The vendor whose GPU (or partition) resource ``resource`` is, or ``None``."""
    for vendor in VENDORS:
        if resource.startswith(vendor.domain) and vendor.is_resource(resource):
            return vendor
    return None
