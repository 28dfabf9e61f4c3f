"""Fake GPU Nodes, shaped exactly as the NVIDIA device plugin and GPU Feature Discovery show them.

No kubelet runs, so a Node is only an API object: its labels come from GPU Feature Discovery
(GFD), its extended resources from the device plugin, and its Ready condition from us. The
shapes follow the device plugin's labelers (``internal/lm``) and resource naming:

* exclusive: ``nvidia.com/gpu`` = GPUs, ``gpu.replicas=1``, ``gpu.sharing-strategy=none``;
* time-slicing / MPS with N replicas: ``nvidia.com/gpu`` = GPUs x N (``nvidia.com/gpu.shared``
  with ``renameByDefault``), ``gpu.replicas=N``, product suffixed ``-SHARED`` unless renamed;
* MIG, mixed strategy: one resource per profile, ``nvidia.com/mig-<profile>``, with per-profile
  labels (``nvidia.com/mig-1g.10gb.count`` ...); MIG-enabled GPUs do not advertise
  ``nvidia.com/gpu`` and their ``gpu.replicas`` is 0.

Memory sizes are NVML totals in MiB. The status is written through the ``status`` subresource,
as a kubelet would; with no controller-manager running nothing ever marks the Nodes NotReady.
"""

from __future__ import annotations

import datetime
import enum
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
SHARED_GPU_RESOURCE = "nvidia.com/gpu.shared"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"

DRIVER_VERSION = "580.95.05"
CUDA_RUNTIME_VERSION = (13, 0)


class Sharing(enum.StrEnum):
    """The ``nvidia.com/gpu.sharing-strategy`` label values."""

    NONE = "none"
    TIME_SLICING = "time-slicing"
    MPS = "mps"


@dataclass(frozen=True)
class MigProfile:
    """A MIG GPU-instance profile such as ``3g.40gb``."""

    name: str
    compute_slices: int
    memory_mib: int
    """Nominal size (the profile's GB x 1024); NVML reports slightly less on real hardware."""
    max_per_gpu: int

    @property
    def resource(self) -> str:
        """The device plugin resource name under the mixed strategy."""
        return MIG_RESOURCE_PREFIX + self.name


def _profiles(*specs: tuple[str, int]) -> tuple[MigProfile, ...]:
    profiles = []
    for name, max_per_gpu in specs:
        match = re.fullmatch(r"(\d+)g\.(\d+)gb", name)
        if not match:
            raise ValueError(f"bad MIG profile {name}")
        profiles.append(MigProfile(name, int(match[1]), int(match[2]) * 1024, max_per_gpu))
    return tuple(profiles)


@dataclass(frozen=True)
class GPUModel:
    """One GPU model as NVML names and sizes it."""

    key: str
    nvml_name: str
    memory_mib: int
    compute: tuple[int, int]
    mig_profiles: tuple[MigProfile, ...] = ()

    @property
    def product_label(self) -> str:
        """The GFD product label: NVML name sanitised, spaces replaced by dashes."""
        cleaned = re.sub(r"[^A-Za-z0-9\-_. ]", "", self.nvml_name)
        return "-".join(cleaned.split())

    @property
    def family(self) -> str:
        """The GFD ``gpu.family`` label for the compute capability."""
        major, minor = self.compute
        if major == 8:
            return "ampere" if minor < 9 else "ada-lovelace"
        return {7: "volta" if minor < 5 else "turing", 9: "hopper", 10: "blackwell", 12: "blackwell"}.get(
            major, "undefined"
        )

    @property
    def mig_capable(self) -> bool:
        """True if the model supports MIG."""
        return bool(self.mig_profiles)

    def mig_profile(self, name: str) -> MigProfile:
        """The named MIG profile of this model."""
        for profile in self.mig_profiles:
            if profile.name == name:
                return profile
        known = ", ".join(profile.name for profile in self.mig_profiles) or "none"
        raise ValueError(f"{self.key} has no MIG profile {name!r} (known: {known})")


_A100_40_MIG = _profiles(("1g.5gb", 7), ("1g.10gb", 4), ("2g.10gb", 3), ("3g.20gb", 2), ("4g.20gb", 1), ("7g.40gb", 1))
_80GB_MIG = _profiles(("1g.10gb", 7), ("1g.20gb", 4), ("2g.20gb", 3), ("3g.40gb", 2), ("4g.40gb", 1), ("7g.80gb", 1))

GPU_MODELS: dict[str, GPUModel] = {
    model.key: model
    for model in (
        GPUModel("A100-40GB", "NVIDIA A100-SXM4-40GB", 40960, (8, 0), _A100_40_MIG),
        GPUModel("A100-80GB", "NVIDIA A100-SXM4-80GB", 81920, (8, 0), _80GB_MIG),
        GPUModel("H100-80GB", "NVIDIA H100 80GB HBM3", 81559, (9, 0), _80GB_MIG),
        GPUModel(
            "H100-NVL",
            "NVIDIA H100 NVL",
            95830,
            (9, 0),
            _profiles(("1g.12gb", 7), ("1g.24gb", 4), ("2g.24gb", 3), ("3g.47gb", 2), ("4g.47gb", 1), ("7g.94gb", 1)),
        ),
        GPUModel(
            "H200",
            "NVIDIA H200",
            143771,
            (9, 0),
            _profiles(("1g.18gb", 7), ("1g.35gb", 4), ("2g.35gb", 3), ("3g.71gb", 2), ("4g.71gb", 1), ("7g.141gb", 1)),
        ),
        GPUModel("B200", "NVIDIA B200", 183359, (10, 0)),
        GPUModel("L40S", "NVIDIA L40S", 46068, (8, 9)),
        GPUModel("L4", "NVIDIA L4", 23034, (8, 9)),
        GPUModel("A10", "NVIDIA A10", 23028, (8, 6)),
        GPUModel("T4", "Tesla T4", 15360, (7, 5)),
        GPUModel("RTX-4090", "NVIDIA GeForce RTX 4090", 24564, (8, 9)),
        GPUModel("RTX-5090", "NVIDIA GeForce RTX 5090", 32607, (12, 0)),
    )
}
"""Known models by short key; memory in MiB as NVML reports it."""


def gpu_model(model: GPUModel | str) -> GPUModel:
    """Look a model up by key (``H100-80GB``) or pass a GPUModel through."""
    if isinstance(model, GPUModel):
        return model
    try:
        return GPU_MODELS[model]
    except KeyError:
        raise ValueError(f"unknown GPU model {model!r}; known: {', '.join(GPU_MODELS)}") from None


@dataclass(frozen=True)
class GPUNodeSpec:
    """A Node with GPUs; build it with :func:`exclusive`, :func:`time_sliced`, :func:`mps`, :func:`mig_mixed`."""

    name: str
    model: GPUModel
    gpus: int = 1
    sharing: Sharing = Sharing.NONE
    replicas: int = 1
    renamed: bool = False
    """``renameByDefault: true``: replicas are advertised as ``nvidia.com/gpu.shared``."""
    mig_layout: tuple[str, ...] = ()
    """MIG profiles on each GPU (mixed strategy); empty when MIG is off."""
    cpu: str = "64"
    memory: str = "512Gi"
    pods: int = 110
    extra_labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Mapping[str, str], ...] = ()
    platform: str = "gfd"
    """Who labels the node's GPUs: ``gfd`` (GPU Feature Discovery), ``gke`` (GKE's own labels, no GFD),
    ``instance-type`` (only the instance type, as EKS or AKS nodes with the device plugin alone),
    ``none`` (nothing: the device plugin's resource only)."""

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError("a GPU node needs at least one GPU")
        if self.sharing is Sharing.NONE and (self.replicas != 1 or self.renamed):
            raise ValueError("replicas and renaming need time-slicing or MPS")
        if self.sharing is not Sharing.NONE and self.replicas < 2:
            raise ValueError("time-slicing and MPS need at least 2 replicas")
        if self.mig_layout:
            if self.sharing is not Sharing.NONE:
                raise ValueError("this helper does not combine MIG with time-slicing or MPS")
            profiles = [self.model.mig_profile(name) for name in self.mig_layout]
            if sum(profile.compute_slices for profile in profiles) > 7:
                raise ValueError(f"MIG layout {self.mig_layout} needs more than 7 compute slices")
            for name, count in Counter(self.mig_layout).items():
                if count > self.model.mig_profile(name).max_per_gpu:
                    raise ValueError(f"at most {self.model.mig_profile(name).max_per_gpu} x {name} per GPU")

    @property
    def mig_enabled(self) -> bool:
        """True when the GPUs are partitioned with MIG."""
        return bool(self.mig_layout)


def exclusive(name: str, model: GPUModel | str, gpus: int = 1, **options: Any) -> GPUNodeSpec:
    """Whole GPUs, one per container request (no sharing)."""
    return GPUNodeSpec(name=name, model=gpu_model(model), gpus=gpus, **options)


def time_sliced(
    name: str, model: GPUModel | str, gpus: int = 1, replicas: int = 4, *, renamed: bool = False, **options: Any
) -> GPUNodeSpec:
    """CUDA time-slicing: each GPU advertised ``replicas`` times; every replica sees all VRAM."""
    return _shared(Sharing.TIME_SLICING, name, model, gpus, replicas, renamed, options)


def mps(
    name: str, model: GPUModel | str, gpus: int = 1, replicas: int = 4, *, renamed: bool = False, **options: Any
) -> GPUNodeSpec:
    """MPS: each GPU advertised ``replicas`` times, memory and SMs split equally among them."""
    return _shared(Sharing.MPS, name, model, gpus, replicas, renamed, options)


def _shared(
    sharing: Sharing, name: str, model: GPUModel | str, gpus: int, replicas: int, renamed: bool, options: Any
) -> GPUNodeSpec:
    return GPUNodeSpec(
        name=name, model=gpu_model(model), gpus=gpus, sharing=sharing, replicas=replicas, renamed=renamed, **options
    )


def mig_mixed(name: str, model: GPUModel | str, layout: Sequence[str], gpus: int = 1, **options: Any) -> GPUNodeSpec:
    """MIG with the mixed strategy: every GPU partitioned as ``layout`` (e.g. ``["3g.40gb", "4g.40gb"]``)."""
    return GPUNodeSpec(name=name, model=gpu_model(model), gpus=gpus, mig_layout=tuple(layout), **options)


# --------------------------------------------------------------------------- labels and resources


def gpu_resources(spec: GPUNodeSpec) -> dict[str, str]:
    """The extended resources the device plugin advertises (capacity == allocatable)."""
    if spec.mig_enabled:
        counts = Counter(spec.mig_layout)
        return {MIG_RESOURCE_PREFIX + name: str(count * spec.gpus) for name, count in sorted(counts.items())}
    if spec.sharing is Sharing.NONE:
        return {GPU_RESOURCE: str(spec.gpus)}
    resource = SHARED_GPU_RESOURCE if spec.renamed else GPU_RESOURCE
    return {resource: str(spec.gpus * spec.replicas)}


def gfd_labels(spec: GPUNodeSpec) -> dict[str, str]:
    """The labels GPU Feature Discovery puts on the node (plus ``gpu.present`` from the operator)."""
    model = spec.model
    shared = spec.sharing is not Sharing.NONE
    product = model.product_label + ("-SHARED" if shared and not spec.renamed else "")
    major, minor = model.compute
    driver = DRIVER_VERSION.split(".")
    labels = {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.count": str(spec.gpus),
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.memory": str(model.memory_mib),
        "nvidia.com/gpu.family": model.family,
        "nvidia.com/gpu.compute.major": str(major),
        "nvidia.com/gpu.compute.minor": str(minor),
        "nvidia.com/gpu.mode": "compute",
        # MIG-enabled GPUs are labelled without sharing information: replicas 0.
        "nvidia.com/gpu.replicas": "0" if spec.mig_enabled else str(spec.replicas),
        "nvidia.com/gpu.sharing-strategy": spec.sharing.value,
        "nvidia.com/mig.capable": str(model.mig_capable).lower(),
        # The GPU Operator's default strategy is "single"; MIG nodes here use "mixed".
        "nvidia.com/mig.strategy": "mixed" if spec.mig_enabled else "single",
        "nvidia.com/mps.capable": str(spec.sharing is Sharing.MPS).lower(),
        "nvidia.com/vgpu.present": "false",
        "nvidia.com/cuda.driver-version.full": DRIVER_VERSION,
        "nvidia.com/cuda.driver-version.major": driver[0],
        "nvidia.com/cuda.driver-version.minor": driver[1],
        "nvidia.com/cuda.driver-version.revision": driver[2],
        "nvidia.com/cuda.runtime-version.full": "{}.{}".format(*CUDA_RUNTIME_VERSION),
        "nvidia.com/cuda.runtime-version.major": str(CUDA_RUNTIME_VERSION[0]),
        "nvidia.com/cuda.runtime-version.minor": str(CUDA_RUNTIME_VERSION[1]),
    }
    for name, count in sorted(Counter(spec.mig_layout).items()):
        profile = model.mig_profile(name)
        prefix = profile.resource
        labels.update(
            {
                f"{prefix}.count": str(count * spec.gpus),
                f"{prefix}.product": f"{model.product_label}-MIG-{name}",
                f"{prefix}.memory": str(profile.memory_mib),
                f"{prefix}.replicas": "1",
                f"{prefix}.slices.gi": str(profile.compute_slices),
                f"{prefix}.slices.ci": str(profile.compute_slices),
            }
        )
    return labels


GKE_ACCELERATORS = {"H100-80GB": "nvidia-h100-80gb", "A100-80GB": "nvidia-a100-80gb", "A100-40GB": "nvidia-tesla-a100",
                    "L4": "nvidia-l4", "T4": "nvidia-tesla-t4", "H200": "nvidia-h200-141gb"}
"""``cloud.google.com/gke-accelerator`` of each model (GKE's "GPU platforms" and node label docs)."""
INSTANCE_TYPES = {("H100-80GB", 8): "p5.48xlarge", ("L40S", 1): "g6e.xlarge", ("L4", 1): "g6.xlarge",
                  ("H100-80GB", 1): "p5.4xlarge", ("A100-80GB", 8): "Standard_ND96amsr_A100_v4"}
"""An instance type of each (model, GPUs per node) the tests use (AWS's and Azure's specifications)."""


def platform_labels(spec: GPUNodeSpec) -> dict[str, str]:
    """What the node's platform says of its GPUs, where GFD does not run."""
    if spec.platform == "gke":
        labels = {"cloud.google.com/gke-accelerator": GKE_ACCELERATORS[spec.model.key],
                  "cloud.google.com/gke-gpu": "true"}
        if spec.sharing is not Sharing.NONE:
            strategy = "time-sharing" if spec.sharing is Sharing.TIME_SLICING else "mps"
            labels.update({"cloud.google.com/gke-gpu-sharing-strategy": strategy,
                           "cloud.google.com/gke-max-shared-clients-per-gpu": str(spec.replicas)})
        return labels
    if spec.platform == "instance-type":
        return {"node.kubernetes.io/instance-type": INSTANCE_TYPES[(spec.model.key, spec.gpus)]}
    return {}


def node_labels(spec: GPUNodeSpec) -> dict[str, str]:
    """All labels of the Node: well-known kubelet labels, GFD's or the platform's labels, then
    ``extra_labels``."""
    labels = {
        "kubernetes.io/hostname": spec.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "beta.kubernetes.io/os": "linux",
        "beta.kubernetes.io/arch": "amd64",
    }
    labels.update(gfd_labels(spec) if spec.platform == "gfd" else platform_labels(spec))
    labels.update(spec.extra_labels)
    return labels


def node_manifest(spec: GPUNodeSpec) -> dict[str, Any]:
    """The Node as created (metadata and spec; the status is written separately)."""
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": spec.name, "labels": node_labels(spec)},
        "spec": {},
    }
    if spec.taints:
        body["spec"]["taints"] = [dict(taint) for taint in spec.taints]
    return body


def _condition(kind: str, status: str, reason: str) -> dict[str, str]:
    # A fresh heartbeat: on clusters with a controller-manager (kind) the node stays Ready until
    # the node-monitor grace period passes; here nothing ever expires it.
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": f"e2e: {reason}",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }


def node_status(spec: GPUNodeSpec, kubelet_version: str = "v1.36.0") -> dict[str, Any]:
    """The Node status a kubelet with the device plugin would report: capacity, Ready, info."""
    capacity = {
        "cpu": spec.cpu,
        "memory": spec.memory,
        "pods": str(spec.pods),
        "ephemeral-storage": "1000Gi",
        **gpu_resources(spec),
    }
    conditions = [
        ("MemoryPressure", "False", "KubeletHasSufficientMemory"),
        ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
        ("PIDPressure", "False", "KubeletHasSufficientPID"),
        ("Ready", "True", "KubeletReady"),
    ]
    return {
        "capacity": capacity,
        "allocatable": dict(capacity),
        "conditions": [_condition(kind, status, reason) for kind, status, reason in conditions],
        "addresses": [{"type": "Hostname", "address": spec.name}],
        "nodeInfo": {
            "architecture": "amd64",
            "operatingSystem": "linux",
            "osImage": "vramguard e2e (no kubelet)",
            "kernelVersion": "",
            "containerRuntimeVersion": "",
            "kubeletVersion": kubelet_version,
            "kubeProxyVersion": "",
            "machineID": "",
            "systemUUID": "",
            "bootID": "",
        },
    }


def status_as_written(node: Mapping[str, Any], kubelet_version: str = "v1.36.0") -> dict[str, Any]:
    """The status a kubelet would report for a Node written by hand (``examples/nodes.yaml``): its
    ``allocatable`` (and ``capacity``, else the same), Ready, the kubelet's version."""
    written = node.get("status") if isinstance(node.get("status"), Mapping) else {}
    assert isinstance(written, Mapping)
    allocatable = dict(written.get("allocatable") or written.get("capacity") or {})
    allocatable.setdefault("pods", "110")
    name = str((node.get("metadata") or {}).get("name", ""))
    base = cpu_node_status(name)
    return {**base, "capacity": dict(written.get("capacity") or allocatable), "allocatable": allocatable,
            "nodeInfo": {"kubeletVersion": kubelet_version, "architecture": "amd64", "operatingSystem": "linux"}}


def cpu_node_status(name: str, cpu: str = "16", memory: str = "64Gi", pods: int = 110) -> dict[str, Any]:
    """Status for a Node without GPUs (a control sample for placement tests)."""
    capacity = {"cpu": cpu, "memory": memory, "pods": str(pods), "ephemeral-storage": "500Gi"}
    return {
        "capacity": capacity,
        "allocatable": dict(capacity),
        "conditions": [_condition("Ready", "True", "KubeletReady")],
        "addresses": [{"type": "Hostname", "address": name}],
    }


# --------------------------------------------------------------------------- API calls


def _create_with_status(core_v1: Any, manifest: Mapping[str, Any], status: Mapping[str, Any]) -> Any:
    name = manifest["metadata"]["name"]
    core_v1.create_node(body=dict(manifest))
    # Like a kubelet: the status goes through the status subresource.
    return core_v1.patch_node_status(
        name=name, body={"status": dict(status)}, _content_type="application/merge-patch+json"
    )


def create_gpu_node(core_v1: Any, spec: GPUNodeSpec, kubelet_version: str = "v1.36.0") -> Any:
    """Create the Node, then write its status; returns the Node as the API server has it."""
    return _create_with_status(core_v1, node_manifest(spec), node_status(spec, kubelet_version))


def create_cpu_node(core_v1: Any, name: str, labels: Mapping[str, str] | None = None) -> Any:
    """Create a Ready Node without GPUs."""
    manifest = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **(labels or {})},
        },
    }
    return _create_with_status(core_v1, manifest, cpu_node_status(name))


def delete_nodes(core_v1: Any, names: Sequence[str]) -> None:
    """Delete Nodes, ignoring those already gone."""
    for name in names:
        try:
            core_v1.delete_node(name=name)
        except Exception as error:  # kubernetes ApiException; 404 means already gone
            if getattr(error, "status", None) != 404:
                raise
