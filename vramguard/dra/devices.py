"""GPUs and MIG devices published in ResourceSlices (resource.k8s.io/v1), per node.

How a slice becomes devices (the NVIDIA DRA driver ``gpu.nvidia.com`` publishes one pool per node,
named after the node, each GPU as a device with attributes ``type`` (``gpu``/``mig``), ``uuid``,
``productName``, for MIG ``parentUUID`` and ``profile``, and a ``memory`` capacity):

- **Complete pools only.** Slices are grouped by ``(driver, pool.name)``; only the highest
  ``pool.generation`` counts, and only once all ``pool.resourceSliceCount`` slices of it are seen
  (the scheduler's allocator does the same). An incomplete pool contributes nothing and leaves a note.
- **Node-local devices only.** A device belongs to ``spec.nodeName``, or with
  ``spec.perDeviceNodeSelection`` to its own ``nodeName``. Devices reachable through a
  ``nodeSelector`` or ``allNodes`` are not node-local GPUs; they are left out with a note (no GPU
  driver publishes them today, and a node selector cannot be resolved without the nodes).
- **Keyed by uuid.** The ``uuid`` attribute names a device across slices and renames; a device
  without one is keyed ``<driver>/<pool>/<device>``.
- **Sharing** (``allowMultipleAllocations`` and the memory capacity's ``requestPolicy``):
  ``exclusive`` (not shareable: an allocation takes the whole device), ``memory`` (the default
  request is the whole memory: a claim that asks for nothing takes the device), ``unlimited``
  (the default is 0 and there is no ``shares`` capacity: a claim that asks for nothing takes no
  memory), ``shares`` (a ``shares`` capacity counts co-tenants; memory's default is 0), or
  ``partial`` (any other default: a claim that asks for nothing takes that much).
- Only devices of ``type`` gpu or mig are kept (VFIO and ComputeDomain devices have no memory to
  share); counter sets (``sharedCounters``) are read by nobody here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from vramguard.dra.fields import (
    attribute,
    capacity_entry,
    integer,
    items,
    mapping,
    quantity_bytes,
    text,
)

NVIDIA_GPU_DRIVER = "gpu.nvidia.com"
"""The NVIDIA DRA driver's name."""
DEFAULT_DRIVERS: tuple[str, ...] = (NVIDIA_GPU_DRIVER,)
MAX_DEVICES_PER_SLICE = 128
"""The API server's limit; more in one slice (a file given to ``vramguard plan``) is cut, with a note."""
MAX_VALID_VALUES = 10

DeviceType = Literal["gpu", "mig"]
Sharing = Literal["exclusive", "memory", "unlimited", "shares", "partial"]


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    """A capacity's ``requestPolicy``: the default request and how requests are rounded up."""

    default: int | None = None
    minimum: int | None = None
    maximum: int | None = None
    step: int | None = None
    valid_values: tuple[int, ...] = ()

    def round_up(self, amount: int) -> int | None:
        """What a request of ``amount`` consumes under this policy; ``None`` when no value fits it
        (above ``max`` or above every valid value: the device cannot serve the request)."""
        if self.valid_values:
            return next((v for v in self.valid_values if v >= amount), None)
        if self.minimum is not None:
            if amount < self.minimum:
                amount = self.minimum
            elif self.step:
                steps = -(-(amount - self.minimum) // self.step)
                amount = self.minimum + steps * self.step
            if self.maximum is not None and amount > self.maximum:
                return None
        return amount


@dataclass(frozen=True, slots=True)
class DraDevice:
    """One GPU or MIG device a DRA driver publishes for a node."""

    uuid: str
    """The ``uuid`` attribute (``<driver>/<pool>/<name>`` when the device has none)."""
    node: str
    driver: str
    pool: str
    name: str
    type: DeviceType
    product: str
    memory_bytes: int
    """``capacity.memory``; 0 when the slice gives none (a note says so)."""
    shareable: bool
    """``allowMultipleAllocations``: several claims may hold it at once."""
    sharing: Sharing
    policy: RequestPolicy | None = None
    """The memory capacity's request policy (shareable devices only)."""
    shares: int | None = None
    """The ``shares`` capacity of share-count mode."""
    parent_uuid: str | None = None
    """A MIG device's GPU."""
    profile: str | None = None
    """A MIG device's profile (``1g.10gb``)."""
    counter_sets: tuple[str, ...] = ()
    """Counter sets it consumes (``consumesCounters``): with dynamic MIG a GPU and the MIG devices it
    can be cut into all consume ``gpu-N-counter-set``, and only some of them can exist at once."""

    @property
    def key(self) -> tuple[str, str, str]:
        """``(driver, pool, device)``: how allocation results name the device."""
        return self.driver, self.pool, self.name

    @property
    def label(self) -> str:
        """How messages name it: ``gpu-0 (NVIDIA H100 80GB HBM3)``."""
        return f"{self.name} ({self.product})"

    def consumes(self, requested: int | None) -> int | None:
        """The memory one allocation with ``capacity.requests.memory`` = ``requested`` (``None``:
        not set) consumes on this device, rounded up by its policy; ``None`` when the device cannot
        serve it (more than it has, or above the policy's maximum).

        A device that is not shareable is taken whole whatever the request says; a shareable one
        consumes the request, else the policy's default, else its whole memory (the API's rule).
        """
        if requested is not None and requested > self.memory_bytes:
            return None
        if not self.shareable:
            return self.memory_bytes
        if requested is None:
            if self.policy is None or self.policy.default is None:
                return self.memory_bytes
            requested = self.policy.default
        if self.policy is None:
            return requested
        return self.policy.round_up(requested)


@dataclass(frozen=True, slots=True)
class DraInventory:
    """The DRA GPU devices of a cluster (or of the slices given), with what was left out and why."""

    devices: tuple[DraDevice, ...] = ()
    notes: tuple[str, ...] = ()

    def on_node(self, node: str) -> tuple[DraDevice, ...]:
        """The node's devices, in slice order."""
        return tuple(d for d in self.devices if d.node == node)

    def nodes(self) -> tuple[str, ...]:
        """Nodes with at least one device, in first-seen order."""
        return tuple(dict.fromkeys(d.node for d in self.devices))

    def by_key(self) -> dict[tuple[str, str, str], DraDevice]:
        """Devices by ``(driver, pool, device)``, as allocation results name them."""
        return {d.key: d for d in self.devices}


def read_resource_slices(slices: Iterable[Any], drivers: tuple[str, ...] = DEFAULT_DRIVERS) -> DraInventory:
    """The GPU and MIG devices of complete pools among ``slices`` (decoded ResourceSlice objects)
    of the given ``drivers``. Never raises; what is skipped is explained in :attr:`DraInventory.notes`."""
    notes: list[str] = []
    pools: dict[tuple[str, str], dict[int, list[tuple[str, Mapping[str, Any]]]]] = {}
    expected: dict[tuple[str, str, int], int] = {}
    for index, obj in enumerate(slices):
        spec = mapping(mapping(obj).get("spec"))
        name = text(mapping(mapping(obj).get("metadata")).get("name")) or f"#{index}"
        driver = text(spec.get("driver"))
        if driver not in drivers:
            continue
        pool = mapping(spec.get("pool"))
        pool_name = text(pool.get("name"))
        generation = integer(pool.get("generation"))
        count = integer(pool.get("resourceSliceCount"))
        if not pool_name or generation is None or count is None or count < 1:
            notes.append(f"ResourceSlice {name}: pool name, generation or resourceSliceCount missing; ignored")
            continue
        pools.setdefault((driver, pool_name), {}).setdefault(generation, []).append((name, spec))
        expected[(driver, pool_name, generation)] = count
    devices: list[DraDevice] = []
    seen: set[str] = set()
    for (driver, pool_name), generations in pools.items():
        newest = max(generations)
        members = generations[newest]
        count = expected[(driver, pool_name, newest)]
        distinct = {slice_name for slice_name, _ in members}
        if len(distinct) < count:
            notes.append(
                f"pool {pool_name} ({driver}) generation {newest}: {len(distinct)} of {count} "
                "ResourceSlices seen; its devices are not counted until all are"
            )
            continue
        for slice_name, spec in members:
            for device in _slice_devices(slice_name, driver, pool_name, spec, notes):
                if device.uuid in seen:
                    notes.append(f"ResourceSlice {slice_name}: device uuid {device.uuid} appears twice; kept once")
                    continue
                seen.add(device.uuid)
                devices.append(device)
    return DraInventory(tuple(devices), tuple(notes))


def _slice_devices(
    slice_name: str, driver: str, pool: str, spec: Mapping[str, Any], notes: list[str]
) -> list[DraDevice]:
    node = text(spec.get("nodeName"))
    per_device = spec.get("perDeviceNodeSelection") is True
    entries = items(spec.get("devices"))
    if not entries:
        return []  # a slice of counter sets, or empty
    if not node and not per_device:
        notes.append(f"ResourceSlice {slice_name}: devices not bound to one node (nodeSelector or allNodes); ignored")
        return []
    if len(entries) > MAX_DEVICES_PER_SLICE:
        notes.append(f"ResourceSlice {slice_name}: {len(entries)} devices, only the first {MAX_DEVICES_PER_SLICE} read")
        entries = entries[:MAX_DEVICES_PER_SLICE]
    devices: list[DraDevice] = []
    for entry in entries:
        device = _device(slice_name, driver, pool, node if not per_device else None, mapping(entry), notes)
        if device is not None:
            devices.append(device)
    return devices


def _device(
    slice_name: str, driver: str, pool: str, node: str | None, entry: Mapping[str, Any], notes: list[str]
) -> DraDevice | None:
    name = text(entry.get("name"))
    if not name:
        notes.append(f"ResourceSlice {slice_name}: a device without a name; ignored")
        return None
    where = f"ResourceSlice {slice_name} device {name}"
    if node is None:
        node = text(entry.get("nodeName"))
        if not node:
            notes.append(f"{where}: not bound to one node; ignored")
            return None
    attributes = mapping(entry.get("attributes"))
    kind = attribute(attributes, "type", driver)
    if kind not in ("gpu", "mig"):
        return None  # VFIO, ComputeDomain channels and the like hold no memory to share
    uuid = text(attribute(attributes, "uuid", driver)) or f"{driver}/{pool}/{name}"
    capacity = mapping(entry.get("capacity"))
    memory_entry = capacity_entry(capacity, "memory", driver)
    memory = 0
    if memory_entry is None:
        notes.append(f"{where}: no memory capacity; its memory is unknown")
    else:
        memory = quantity_bytes(memory_entry.get("value"), f"{where} capacity memory", notes) or 0
    shareable = entry.get("allowMultipleAllocations") is True
    policy = _policy(mapping(memory_entry.get("requestPolicy")) if memory_entry else {}, where, notes)
    shares_entry = capacity_entry(capacity, "shares", driver)
    shares = None
    if shares_entry is not None:
        shares_bytes = quantity_bytes(shares_entry.get("value"), f"{where} capacity shares", notes)
        shares = shares_bytes if shares_bytes is not None else None
    product = text(attribute(attributes, "productName", driver)) or "unknown GPU"
    return DraDevice(
        uuid=uuid,
        node=node,
        driver=driver,
        pool=pool,
        name=name,
        type=kind,
        product=product,
        memory_bytes=memory,
        shareable=shareable,
        sharing=_sharing(shareable, memory, policy, shares),
        policy=policy if shareable else None,
        shares=shares if shareable else None,
        parent_uuid=text(attribute(attributes, "parentUUID", driver)) if kind == "mig" else None,
        profile=text(attribute(attributes, "profile", driver)) if kind == "mig" else None,
        counter_sets=tuple(
            dict.fromkeys(
                name
                for name in (text(mapping(c).get("counterSet")) for c in items(entry.get("consumesCounters"))[:2])
                if name
            )
        ),
    )


def _sharing(shareable: bool, memory: int, policy: RequestPolicy | None, shares: int | None) -> Sharing:
    if not shareable:
        return "exclusive"
    if shares is not None:
        return "shares"
    default = memory if policy is None or policy.default is None else policy.default
    if default == 0:
        return "unlimited"
    return "memory" if default >= memory else "partial"


def _policy(raw: Mapping[str, Any], where: str, notes: list[str]) -> RequestPolicy | None:
    if not raw:
        return None
    where = f"{where} memory requestPolicy"
    default = quantity_bytes(raw["default"], f"{where} default", notes) if "default" in raw else None
    values_raw = items(raw.get("validValues"))[:MAX_VALID_VALUES]
    values = tuple(
        sorted(
            v for v in (quantity_bytes(value, f"{where} validValues", notes) for value in values_raw) if v is not None
        )
    )
    valid_range = mapping(raw.get("validRange"))
    minimum = maximum = step = None
    if valid_range:
        minimum = quantity_bytes(valid_range.get("min"), f"{where} validRange.min", notes)
        if "max" in valid_range:
            maximum = quantity_bytes(valid_range["max"], f"{where} validRange.max", notes)
        if "step" in valid_range:
            step = quantity_bytes(valid_range["step"], f"{where} validRange.step", notes)
    return RequestPolicy(default, minimum, maximum, step or None, values)
