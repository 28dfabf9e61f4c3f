"""A node's GPU devices, read from GPU Feature Discovery labels and, when present, the agent's report.

The unit vramguard accounts is a *device*: something the device plugin hands to a container and
that has its own memory. That is a physical GPU, or a MIG instance (a hardware partition with its
own memory; fractions inside it are fractions of the instance). Each device has ``replicas`` slots:
time-slicing and MPS advertise one device as R replicas; a whole GPU or a MIG instance has one.

Where the facts come from (labels written by GPU Feature Discovery, see NVIDIA/k8s-device-plugin
``internal/lm``):

- full GPUs: ``nvidia.com/gpu.count``, ``.product``, ``.memory`` (MiB), ``.replicas``,
  ``.sharing-strategy`` (``none|time-slicing|mps``). With time-slicing the product gains a
  ``-SHARED`` suffix unless the resource is renamed (``nvidia.com/gpu.shared``).
- ``nvidia.com/mig.strategy=single``: the ``nvidia.com/gpu.*`` labels describe the MIG devices
  instead (``gpu.product`` = ``A100-SXM4-40GB-MIG-1g.5gb``, ``gpu.count`` = MIG devices,
  ``gpu.memory`` = memory of one MIG device), served as ``nvidia.com/gpu``.
- ``nvidia.com/mig.strategy=mixed``: one resource per profile, ``nvidia.com/mig-<profile>``, with
  labels ``nvidia.com/mig-<profile>.count``, ``.memory``, ``.product``, ``.replicas``,
  ``.sharing-strategy``. When ``.memory`` is missing the size comes from :data:`MIG_INSTANCE_MIB`,
  the instance sizes NVML reports per profile (the smallest among products sharing a profile name),
  else from the name read as decimal gigabytes less a tenth: a name is not a size (an H200's
  ``1g.18gb`` has 16 GiB, under 18 GB; an H100's ``1g.10gb`` 9.75 GiB, over 10 GB).

The node's ``status.allocatable`` (else ``capacity``) says what the device plugin advertises right
now; when it lists a resource, the device count follows it (``allocatable / replicas``), because
under the mixed strategy ``gpu.count`` also counts the MIG-enabled GPUs that serve no
``nvidia.com/gpu``, and an unhealthy GPU drops out of allocatable but not out of the labels.

The agent's report (annotation ``vramguard.io/gpus``, JSON, versioned) overrides memory sizes, adds
memory used on each device by processes of no known pod, says which device each container of each
pod really got and how much memory each pod uses on each device. It is parsed defensively: junk is
ignored with a reason, never raised. A report is only as fresh as the agent's Lease
(:mod:`vramguard.lease`): the caller that knows the Lease is stale passes ``distrust`` and the
labels alone decide, which is the conservative reading.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from vramguard import vendors
from vramguard.codecs import AGENT_REPORT_ANNOTATION, AgentReport
from vramguard.platforms import platform_gpus
from vramguard.quantity import MiB, QuantityError, parse_quantity

Sharing = Literal["none", "time-slicing", "mps", "mig"]
SHARING_STRATEGIES: tuple[Sharing, ...] = ("none", "time-slicing", "mps", "mig")

LABEL_PREFIX = "nvidia.com/"
MIG_STRATEGY_LABEL = "nvidia.com/mig.strategy"

SHARED_SUFFIX = ".shared"
"""What the device plugin appends to a replicated resource's name under ``renameByDefault``
(NVIDIA/k8s-device-plugin v0.20.0 api/config/v1/consts.go ``DefaultSharedResourceNameSuffix``)."""
_FULL_GPU_LABELS = "nvidia.com/gpu"
DEFAULT_GPU_RESOURCES = vendors.DEFAULT_GPU_RESOURCES
DEFAULT_MIG_PREFIXES = vendors.DEFAULT_PARTITION_PREFIXES
_DOMAINS = (LABEL_PREFIX, *(v.domain for v in vendors.VENDORS))
"""The domains of the extended resources read from a node's status."""
_MIG_PROFILE = re.compile(r"^(?P<slices>\d+)g\.(?P<gb>\d+)gb(?:[-+.].*)?$")
_GB = 10**9
MAX_NODE_DEVICES = 1024
"""The most devices of one resource a node's labels or allocatable may describe (a node has 8 or 16
GPUs, 7 MIG instances each at most): a node that says more is cut to this, with a note, so a lying
label or allocatable (``1e30``) costs no more than a large real node."""


@dataclass(frozen=True, slots=True)
class Gpu:
    """One device the device plugin hands out: a physical GPU or a MIG instance."""

    id: str
    """Unique on the node: the GPU index (``"0"``) or ``"<profile>#<n>"`` for a MIG instance."""
    index: int
    """GPU index, or the instance's ordinal among the node's instances of its profile."""
    product: str
    """Human product name, e.g. ``NVIDIA H100 80GB HBM3``."""
    memory_bytes: int
    """Total memory of the device (a MIG instance: the instance's memory); 0 when unknown."""
    sharing: Sharing
    replicas: int
    """How many containers' devices the plugin may put on it (1 for an unshared device)."""
    resource: str
    """The extended resource that hands it out."""
    mig_profile: str | None = None
    foreign_bytes: int = 0
    """Memory the agent saw used by processes of no known pod (on a DRA device: what claims of
    pods with ResourceClaims consume there)."""
    dra_sharing: str | None = None
    """How a DRA driver shares the device (``exclusive``, ``memory``, ``unlimited``, ``shares``),
    when it is published in a ResourceSlice rather than by a device plugin."""

    @property
    def label(self) -> str:
        """How messages name it: ``GPU 0 (NVIDIA H100 80GB HBM3)``."""
        if self.mig_profile is not None:
            return f"MIG {self.mig_profile} #{self.index} ({self.product})"
        return f"GPU {self.index} ({self.product})"


@dataclass(frozen=True, slots=True)
class NodeInventory:
    """The devices of one node and what the agent knows about them."""

    node: str
    devices: tuple[Gpu, ...] = ()
    placements: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)
    """Per pod UID, per container: the device ids it really holds (from the agent)."""
    notes: tuple[str, ...] = ()
    """What was ignored and why (malformed labels, junk in the agent report)."""
    measured: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    """Per pod UID, per device id: bytes the agent measured its processes using there."""
    distrust: str | None = None
    """Why the node's agent report was not used (a stale or missing Lease), or ``None``."""
    reported: bool = False
    """An agent report was applied: the devices' sizes and the pods' placements are the agent's."""

    @property
    def agent(self) -> str:
        """``fresh`` (its report is used), ``stale`` (set aside: see :attr:`distrust`) or ``none``."""
        return "fresh" if self.reported else "stale" if self.distrust is not None else "none"

    def resources(self) -> tuple[str, ...]:
        """The GPU resources the node hands out, in device order."""
        return tuple(dict.fromkeys(d.resource for d in self.devices))

    def devices_for(self, resource: str) -> tuple[Gpu, ...]:
        """The devices behind ``resource`` (empty when the node does not offer it)."""
        return tuple(d for d in self.devices if d.resource == resource)


def human_product(label: str) -> str:
    """``NVIDIA-H100-80GB-HBM3-SHARED`` -> ``NVIDIA H100 80GB HBM3`` (GFD replaced spaces by dashes)."""
    name = label.removesuffix("-SHARED")
    name = re.sub(r"-MIG-.*$", "", name)
    return name.replace("-", " ").strip() or "unknown GPU"


MIG_INSTANCE_MIB: Mapping[str, int] = {
    # A100 40GB (NVIDIA go-nvml's A100 device data)
    "1g.5gb": 4864, "2g.10gb": 9856, "3g.20gb": 19968, "4g.20gb": 19968, "7g.40gb": 40192,
    # A100 80GB (nvidia-smi -lgip: 9.50 / 19.50 / 39.25 GiB) and H100 80GB (9.75 / 19.62 / 39.50 / 79.25 GiB)
    "1g.10gb": 9728, "1g.20gb": 20096, "2g.20gb": 19968, "3g.40gb": 40192, "4g.40gb": 40192, "7g.80gb": 80384,
    # H100 NVL (10.75 / 21.62 / 46.38 GiB, NVIDIA/gpu-operator#900, mig-parted#101)
    "1g.12gb": 11008, "1g.24gb": 22144, "3g.47gb": 47488,
    # H200 141GB (16.00 / 32.25 / 69.50 / 139.75 GiB, mig-parted#120) and GH200 144GB (17.50 / 35.25 GiB)
    "1g.18gb": 16384, "1g.35gb": 33024, "2g.35gb": 33024, "3g.71gb": 71168, "4g.71gb": 71168, "7g.141gb": 143104,
    "1g.36gb": 36096, "2g.36gb": 36096,
    # B200 (20.50 / 44.25 GiB, mig-parted#166 and #187)
    "1g.23gb": 20992, "1g.45gb": 45312, "2g.45gb": 45312,
}
"""MiB of a MIG instance per profile, where NVML's figures were published; the smallest when
products share a name. Variants (``+me``, a ``.me`` or ``.shared`` resource suffix) have the size of
their profile."""
MIG_PROFILES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # NVIDIA MIG User Guide, "Supported MIG Profiles" (A30, A100)
    ("A30 24GB", ("1g.6gb", "2g.12gb", "4g.24gb")),
    ("A100 40GB", ("1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb")),
    ("A100 80GB, H100 80GB", ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")),
    # NVIDIA/mig-parted v0.15.0 deployments/systemd/config-default.yaml (the GPU Operator's default)
    ("H100 NVL 94GB", ("1g.12gb", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb")),
    ("H100 96GB, GH200 96GB", ("1g.12gb", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb")),
    ("H200 141GB, H200 NVL", ("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb")),
    ("GH200 144GB", ("1g.18gb", "1g.36gb", "2g.36gb", "3g.72gb", "4g.72gb", "7g.144gb")),
    ("B200", ("1g.23gb", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb")),
    # GB200: the production boards' profiles, then those of the earlier boards the file still lists
    ("GB200", ("1g.23gb", "1g.47gb", "2g.47gb", "3g.93gb", "4g.93gb", "7g.186gb", "3g.95gb", "4g.95gb", "7g.189gb")),
    ("B300", ("1g.34gb", "1g.67gb", "2g.67gb", "3g.135gb", "4g.135gb", "7g.269gb")),
    ("GB300", ("1g.35gb", "1g.70gb", "2g.70gb", "3g.139gb", "4g.139gb", "7g.278gb")),
    ("RTX PRO 6000 Blackwell", ("1g.24gb", "2g.48gb", "4g.96gb")),
)
"""The MIG GPU-instance profiles of each product (compute instances spanning the whole GPU instance,
the only ones the device plugin serves), without attributes; :data:`MIG_ATTRIBUTES` adds those."""
MIG_ATTRIBUTES: Mapping[int, tuple[str, ...]] = {
    1: ("+me", "+me.all", "+gfx", "-me"),
    2: ("+me", "+me.all", "+gfx", "-me"),
    4: ("+gfx",),
}
"""The attributes NVML may give a GPU-instance profile of so many slices, as the device plugin names
them (NVIDIA/go-nvlib pkg/nvlib/device/mig_profile.go ``NewMigProfile`` and ``String``, vendored by
k8s-device-plugin v0.20.0): media extensions ``+me`` (``*_REV1``), all of them ``+me.all``
(``*_ALL_ME``), graphics ``+gfx`` (``*_GFX``), none ``-me`` (``*_NO_ME``)."""


def mig_resource_names() -> tuple[str, ...]:
    """What follows a MIG prefix (``nvidia.com/mig-``) in each resource the device plugin may advertise
    under the mixed strategy: every profile of :data:`MIG_PROFILES` plain and with each attribute its
    slices allow, ``+`` written ``.`` (k8s-device-plugin v0.20.0 internal/rm/rm.go:
    ``strings.ReplaceAll("mig-"+p.String(), "+", ".")``), and each of those with :data:`SHARED_SUFFIX`
    (a time-sliced instance under ``renameByDefault``). A variant some product lacks names a resource
    nobody asks for, which costs nothing where names are matched; a missing one would be served unseen."""
    profiles = sorted({p for _, listed in MIG_PROFILES for p in listed}, key=_profile_order)
    names = [
        f"{profile}{attribute}".replace("+", ".")
        for profile in profiles
        for attribute in ("", *MIG_ATTRIBUTES.get(_profile_order(profile)[0], ()))
    ]
    return (*names, *(name + SHARED_SUFFIX for name in names))


def _profile_order(profile: str) -> tuple[int, int]:
    """(slices, GB) of a profile listed in :data:`MIG_PROFILES`."""
    match = _MIG_PROFILE.match(profile)
    assert match is not None, profile
    return int(match["slices"]), int(match["gb"])


_UNLISTED_PROFILE_SHARE = (9, 10)
"""An unlisted profile counts this share of its name's decimal gigabytes (the worst listed ratio of
real size to name is 0.95: H200 ``1g.18gb``)."""


def mig_profile_bytes(profile: str) -> int | None:
    """The memory of a MIG instance of ``profile``: NVML's size where known
    (:data:`MIG_INSTANCE_MIB`), else nine tenths of the name's decimal GB; ``None`` for no profile."""
    match = _MIG_PROFILE.match(profile)
    if match is None:
        return None
    base = f"{match['slices']}g.{match['gb']}gb"
    listed = MIG_INSTANCE_MIB.get(base)
    if listed is not None:
        return listed * MiB
    numerator, denominator = _UNLISTED_PROFILE_SHARE
    return int(match["gb"]) * _GB * numerator // denominator


def read_inventory(
    node: Mapping[str, Any],
    report: AgentReport | None = None,
    *,
    gpu_resources: tuple[str, ...] = DEFAULT_GPU_RESOURCES,
    mig_prefixes: tuple[str, ...] = DEFAULT_MIG_PREFIXES,
    distrust: str | None = None,
) -> NodeInventory:
    """The devices of a Node (a JSON-decoded object), refined by the agent's report when given.

    Pass ``report=None`` to read the report from the node's ``vramguard.io/gpus`` annotation; pass
    an explicit report to override it. ``distrust`` (why the agent cannot be trusted now, e.g. its
    Lease expired) leaves the annotation out: sizes come from the labels and every placement is
    unknown, so the ledger applies its conservative rule; the reason becomes a note. Never raises on
    malformed input.
    """
    metadata = node.get("metadata") if isinstance(node.get("metadata"), Mapping) else {}
    assert isinstance(metadata, Mapping)
    name = metadata.get("name") if isinstance(metadata.get("name"), str) else ""
    assert isinstance(name, str)
    labels = _string_map(metadata.get("labels"))
    notes: list[str] = []
    advertised = _advertised(node, notes)

    # NVIDIA's devices from its labels; another vendor's (vramguard.vendors) from its own.
    nvidia = tuple(r for r in gpu_resources if vendors.vendor_of(r) is None)
    devices: list[Gpu] = []
    devices.extend(_full_gpus(labels, advertised, nvidia, notes))
    devices.extend(_mig_instances(labels, advertised, tuple(p for p in mig_prefixes if p.startswith(LABEL_PREFIX)),
                                  notes))
    devices.extend(_vendor_gpus(labels, advertised, gpu_resources, mig_prefixes, notes))

    distrusted: str | None = None
    if report is None:
        annotation = _string_map(metadata.get("annotations")).get(AGENT_REPORT_ANNOTATION)
        if annotation is not None and distrust is not None:
            distrusted = distrust
            notes.append(distrust)
        elif annotation is not None:
            report, problems = AgentReport.decode(annotation)
            notes.extend(problems)
    placements: Mapping[str, Mapping[str, tuple[str, ...]]] = {}
    measured: Mapping[str, Mapping[str, int]] = {}
    if report is not None:
        devices, placements, measured = _apply_report(devices, report, notes)
    return NodeInventory(name, tuple(devices), placements, tuple(notes), measured, distrusted, report is not None)


UNREADABLE = (
    "vramguard cannot read this node's GPUs: no GPU Feature Discovery, GKE, Karpenter or known instance-type "
    "labels, and no agent report; run the vramguard agent or GPU Feature Discovery on it"
)
"""The note of a node that advertises a GPU resource whose devices nothing describes."""


def _full_gpus(
    labels: Mapping[str, str],
    advertised: Mapping[str, int] | None,
    gpu_resources: tuple[str, ...],
    notes: list[str],
) -> list[Gpu]:
    count = _int_label(labels, f"{_FULL_GPU_LABELS}.count", notes)
    if count is None:
        return _platform_gpus(labels, advertised, gpu_resources, notes)
    if labels.get(MIG_STRATEGY_LABEL) == "mixed" and labels.get(f"{_FULL_GPU_LABELS}.replicas") == "0":
        # GFD labels MIG-enabled GPUs with replicas 0 ("sharing disabled"); they serve no full GPU.
        return []
    product_label = labels.get(f"{_FULL_GPU_LABELS}.product", "")
    replicas = max(1, _int_label(labels, f"{_FULL_GPU_LABELS}.replicas", notes) or 1)
    memory_mib = _int_label(labels, f"{_FULL_GPU_LABELS}.memory", notes)
    mig_profile: str | None = None
    if labels.get(MIG_STRATEGY_LABEL) == "single" and "-MIG-" in product_label:
        # The nvidia.com/gpu.* labels describe MIG devices, served under the full-GPU resource name.
        mig_profile = product_label.split("-MIG-", 1)[1]
    sharing = _sharing(labels.get(f"{_FULL_GPU_LABELS}.sharing-strategy"), replicas, mig_profile, notes)

    resource = gpu_resources[0] if gpu_resources else _FULL_GPU_LABELS
    if advertised is not None:
        offered = [r for r in gpu_resources if advertised.get(r, 0) > 0]
        if not offered:
            return []  # e.g. mixed MIG strategy: the labelled GPUs are all MIG-enabled
        resource = offered[0]
        # An unhealthy GPU leaves allocatable (all its replicas) before it leaves the labels.
        count = min(count, -(-advertised[resource] // replicas))
    count = _bounded(count, resource, notes)
    memory = _device_memory(memory_mib, mig_profile, f"{_FULL_GPU_LABELS}.memory", notes)
    product = human_product(product_label) if product_label else "unknown GPU"
    return [
        Gpu(
            id=f"{mig_profile}#{i}" if mig_profile else str(i),
            index=i,
            product=product,
            memory_bytes=memory,
            sharing=sharing,
            replicas=replicas,
            resource=resource,
            mig_profile=mig_profile,
        )
        for i in range(count)
    ]


def _vendor_gpus(
    labels: Mapping[str, str],
    advertised: Mapping[str, int] | None,
    gpu_resources: tuple[str, ...],
    prefixes: tuple[str, ...],
    notes: list[str],
) -> list[Gpu]:
    """Another vendor's devices (:data:`vramguard.vendors.VENDORS`): each advertised unit of a GPU or
    partition resource the policy reads is a device of its own, its memory and name from the vendor's
    labels. The agent reads NVML only: their placements and use are not measured."""
    devices: list[Gpu] = []
    for resource, units in sorted((advertised or {}).items()):
        vendor = vendors.vendor_of(resource)
        if vendor is None or units <= 0 or not (resource in gpu_resources or resource.startswith(prefixes)):
            continue
        memory = vendor.memory_bytes(labels)
        if memory is None:
            notes.append(
                f"label {vendor.memory_label} is missing, unreadable or not one size for all devices: the memory "
                f"of {resource} is unknown"
            )
        product = vendor.product(labels)
        if resource not in vendor.resources:
            product = f"{product} {resource.split('/', 1)[1]} partition"
        devices.extend(
            Gpu(f"{resource}#{i}", i, product, memory or 0, "none", 1, resource)
            for i in range(_bounded(units, resource, notes))
        )
        notes.append(
            f"{resource}: each device is counted from the pods' declarations alone: the node agent reads NVIDIA's "
            "NVML only, so what runs on these devices is not measured"
        )
    return devices


def _platform_gpus(
    labels: Mapping[str, str],
    advertised: Mapping[str, int] | None,
    gpu_resources: tuple[str, ...],
    notes: list[str],
) -> list[Gpu]:
    """The GPUs of a node without GPU Feature Discovery's labels: as its platform labels them
    (:mod:`vramguard.platforms`), or, where nothing does and the node advertises a GPU resource, devices
    of unknown memory (:data:`UNREADABLE`), each advertised unit one device."""
    offered = [r for r in gpu_resources if advertised is not None and advertised.get(r, 0) > 0]
    resource = offered[0] if offered else (gpu_resources[0] if gpu_resources else _FULL_GPU_LABELS)
    units = advertised[resource] if offered and advertised is not None else None
    if advertised is not None and units is None:
        return []  # the node's status advertises no GPU resource: nothing to place there
    platform = platform_gpus(labels)
    if platform is None:
        if units is None:
            return []
        notes.append(UNREADABLE)
        return [Gpu(str(i), i, "unknown GPU", 0, "none", 1, resource) for i in range(_bounded(units, resource, notes))]
    replicas, sharing = platform.replicas, platform.sharing
    if platform.gpus is not None and units is not None and replicas == 1 and units > platform.gpus:
        # More units than GPUs: the device plugin time-slices them (its configuration, not labelled).
        replicas, sharing = -(-units // platform.gpus), "time-slicing"
    if units is None:
        count = platform.gpus or 0
    else:
        count = -(-units // replicas)
        if platform.gpus is not None and platform.mig_profile is None:
            count = min(count, platform.gpus)
    count = _bounded(count, resource, notes)
    memory = platform.memory_mib * MiB if platform.memory_mib else 0
    if platform.mig_profile is not None:
        memory = mig_profile_bytes(platform.mig_profile) or 0
    if not memory:
        notes.append(f"{platform.source}: the devices' memory is unknown")
    notes.append(f"GPUs read from the {platform.source} (no GPU Feature Discovery labels)")
    profile = platform.mig_profile
    return [
        Gpu(f"{profile}#{i}" if profile else str(i), i, platform.product, memory, sharing, replicas, resource, profile)
        for i in range(count)
    ]


def _mig_instances(
    labels: Mapping[str, str],
    advertised: Mapping[str, int] | None,
    mig_prefixes: tuple[str, ...],
    notes: list[str],
) -> list[Gpu]:
    if labels.get(MIG_STRATEGY_LABEL) != "mixed":
        return []
    resources: set[str] = set()
    for key in labels:
        if key.endswith(".count") and key.startswith(mig_prefixes):
            resources.add(key.removesuffix(".count"))
    if advertised is not None:
        # What the plugin advertises wins: a profile can be labelled yet not (yet) served.
        resources = {r for r in resources if advertised.get(r, 0) > 0}
        resources |= {r for r, n in advertised.items() if n > 0 and r.startswith(mig_prefixes)}
    parent_product = human_product(labels.get(f"{_FULL_GPU_LABELS}.product", ""))
    devices: list[Gpu] = []
    for resource in sorted(resources):
        prefix = next(p for p in mig_prefixes if resource.startswith(p))
        profile = resource.removeprefix(prefix)
        # A time-sliced resource renamed under renameByDefault keeps its labels under the plain name
        # (k8s-device-plugin v0.20.0 internal/lm/resource_test.go, "mig mixed rename does not append").
        keys = resource.removesuffix(SHARED_SUFFIX)
        replicas = max(1, _int_label(labels, f"{keys}.replicas", notes) or 1)
        if advertised is not None:
            count = -(-advertised.get(resource, 0) // replicas)
        else:
            count = _int_label(labels, f"{keys}.count", notes) or 0
        count = _bounded(count, resource, notes)
        memory = _device_memory(_int_label(labels, f"{keys}.memory", notes), profile, f"{keys}.memory", notes)
        product_label = labels.get(f"{keys}.product")
        product = human_product(product_label) if product_label else parent_product
        sharing = _sharing(labels.get(f"{keys}.sharing-strategy"), replicas, profile, notes)
        devices.extend(
            Gpu(f"{profile}#{i}", i, product, memory, sharing, replicas, resource, profile)
            for i in range(count)
        )
    return devices


def _sharing(value: str | None, replicas: int, mig_profile: str | None, notes: list[str]) -> Sharing:
    """The device's sharing strategy; a shared MIG instance counts as shared, not as isolated."""
    if replicas > 1:
        if value in ("time-slicing", "mps"):
            return value  # type: ignore[return-value]
        if value not in (None, "none"):
            notes.append(f"unknown sharing strategy {value!r}; treated as time-slicing")
        # Older GFD versions label replicas but no strategy; time-slicing is the plugin's default.
        return "time-slicing"
    return "mig" if mig_profile is not None else "none"


def _device_memory(mib: int | None, profile: str | None, label: str, notes: list[str]) -> int:
    if mib is not None and mib > 0:
        return mib * MiB
    if profile is not None:
        from_name = mig_profile_bytes(profile)
        if from_name is not None:
            return from_name
    notes.append(f"label {label} is missing; the device's memory is unknown")
    return 0


def _advertised(node: Mapping[str, Any], notes: list[str]) -> dict[str, int] | None:
    """Extended resources the device plugin advertises (allocatable, else capacity); None if neither.

    A node with a status but no GPU resource in it advertises nothing: its device plugin is not
    (yet) registered, so the scheduler cannot place GPU pods there whatever the labels say.
    """
    status = node.get("status")
    if not isinstance(status, Mapping):
        return None
    result: dict[str, int] | None = None
    for section in ("allocatable", "capacity"):
        values = status.get(section)
        if not isinstance(values, Mapping):
            continue
        result = {}
        for key, raw in values.items():
            if not isinstance(key, str) or not key.startswith(_DOMAINS):
                continue
            try:
                result[key] = int(parse_quantity(str(raw)))
            except QuantityError:
                notes.append(f"status.{section}[{key}]={raw!r} is not a quantity; ignored")
        if result:
            return result
    return result


def _bounded(count: int, resource: str, notes: list[str]) -> int:
    if count <= MAX_NODE_DEVICES:
        return count
    notes.append(f"{resource}: {count} devices is more than any node has; {MAX_NODE_DEVICES} counted")
    return MAX_NODE_DEVICES


def _int_label(labels: Mapping[str, str], key: str, notes: list[str]) -> int | None:
    value = labels.get(key)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        notes.append(f"label {key}={value!r} is not an integer; ignored")
        return None
    if number < 0:
        notes.append(f"label {key}={value!r} is negative; ignored")
        return None
    return number


def _string_map(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}


def _apply_report(
    devices: list[Gpu], report: AgentReport, notes: list[str]
) -> tuple[list[Gpu], Mapping[str, Mapping[str, tuple[str, ...]]], Mapping[str, Mapping[str, int]]]:
    by_id = {d.id: d for d in devices}
    for reported in report.gpus:
        device = by_id.get(reported.id)
        if device is None:
            notes.append(f"agent report: device {reported.id!r} is not among the node's devices; ignored")
            continue
        memory = device.memory_bytes if reported.memory_bytes in (None, 0) else reported.memory_bytes
        assert memory is not None
        by_id[reported.id] = Gpu(
            device.id, device.index, device.product, memory, device.sharing, device.replicas,
            device.resource, device.mig_profile, reported.foreign_bytes,
        )
    placements: dict[str, dict[str, tuple[str, ...]]] = {}
    for uid, containers in report.placements.items():
        for container, ids in containers.items():
            known = tuple(i for i in ids if i in by_id)
            if len(known) != len(ids):
                notes.append(f"agent report: pod {uid} container {container} names unknown devices; ignored")
                continue
            placements.setdefault(uid, {})[container] = known
    measured: dict[str, dict[str, int]] = {}
    for uid, per_device in report.used.items():
        for device_id, amount in per_device.items():
            gpu = by_id.get(device_id)
            if gpu is None:
                notes.append(f"agent report: pod {uid} uses unknown device {device_id!r}; ignored")
                continue
            # No process uses more than its device has: a larger number is a broken reading, and
            # capping it keeps one bad report from counting more than the whole device.
            measured.setdefault(uid, {})[device_id] = min(amount, gpu.memory_bytes) if gpu.memory_bytes else amount
    return [by_id[d.id] for d in devices], placements, measured

