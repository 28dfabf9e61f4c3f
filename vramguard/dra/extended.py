"""DRA devices in the ledger, for the extended-resource path.

A pod asking for ``nvidia.com/gpu`` on a node whose device plugin does not advertise it is served by
DRA when a DeviceClass names the resource in ``extendedResourceName``: the scheduler allocates one
of the class's devices to a claim it makes for the pod, with no ``capacity`` request, so the claim
consumes the device's default (the whole GPU in the NVIDIA driver's ``memory`` mode, **0** in
``unlimited`` or share-count mode). Such pods ask for one of the extender's resources, so they reach
the extender, which keeps their engine's reservation in the ledger as on device-plugin nodes. This
module turns a node's DRA devices into ledger devices (:class:`vramguard.inventory.Gpu`):

- only the devices the serving class can pick, under the class's extended resource name;
- ``id`` is the device's ``uuid``; shareable devices count as ``time-slicing`` (every tenant sees
  the whole memory and nothing enforces the split), so the shared devices' margin and the class rules
  of time-slicing apply; exclusive GPUs as ``none``, exclusive MIG devices as ``mig``;
- ``foreign_bytes``: the memory that claims *not* made for the extended-resource path consume there
  (pods with ResourceClaims: admission holds them to their engines, and their claims count as
  written);
- ``replicas``: the extended-resource allocations already there plus the ones the allocator could
  still add (an exclusive device: 1 while free; ``memory`` mode: as many defaults as still fit;
  share-count mode: the free shares; ``unlimited``: :data:`OPEN_SLOTS`). A device the allocator
  cannot pick has no free slot, so the ledger's rule (every device where an unplaced claim could
  land must have room for it) is exactly the conservative filter: a node passes only if every
  device the class could still pick has room for the pod's reservation. Refusing at bind instead
  would loop, since the allocator would pick the same device again;
- ``placements``: per pod and container, the devices its extended-resource claim was allocated
  (``container-<i>-request-<j>``: ``i`` counts init containers, then containers), so a bound pod's
  reservation is counted on the device DRA chose.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from vramguard.dra.claims import ClaimAllocation, DeviceUsage, result_memory
from vramguard.dra.classes import DeviceClassInfo, class_for_extended_resource
from vramguard.dra.devices import DraDevice
from vramguard.inventory import Gpu, Sharing
from vramguard.ledger_rule import Claim

OPEN_SLOTS = 64
"""Free slots of a device whose claims consume no memory by default (``unlimited``): the allocator
sets no limit; this one only bounds the ledger's work, far above what a pod asks on one device."""
_REQUEST_NAME = re.compile(r"^container-(\d+)-request-\d+$")
_GPU_NAME = re.compile(r"^gpu-(\d+)")

Placements = Mapping[str, Mapping[str, tuple[str, ...]]]


@dataclass(frozen=True, slots=True)
class DraLedgerPart:
    """What DRA adds to one node's inventory in the ledger."""

    devices: tuple[Gpu, ...] = ()
    placements: Placements = field(default_factory=dict)


def serving_classes(
    classes: Mapping[str, DeviceClassInfo], advertised: frozenset[str]
) -> dict[str, DeviceClassInfo]:
    """Per extended resource, the class DRA serves it with on a node whose device plugin advertises
    ``advertised`` (DRA serves a resource only where no device plugin does)."""
    names = {c.extended_resource for c in classes.values() if c.extended_resource}
    serving = {}
    for resource in sorted(names - advertised):
        chosen = class_for_extended_resource(classes, resource)
        if chosen is not None:
            serving[resource] = chosen
    return serving


def ledger_part(
    devices: Sequence[DraDevice],
    usage: Mapping[str, DeviceUsage],
    allocations: Iterable[ClaimAllocation],
    serving: Mapping[str, DeviceClassInfo],
    containers_of: Callable[[str], Sequence[str] | None],
) -> DraLedgerPart:
    """The ledger devices and placements of one node's DRA ``devices``.

    ``usage``: what claims consume per device uuid; ``allocations``: the allocated claims (those of
    the extended-resource path are told apart); ``serving``: per extended resource its class;
    ``containers_of(pod uid)``: the pod's init containers then containers, by name (``None`` when
    the pod is not known: its placement is left out, and the ledger counts it as unplaced)."""
    by_key = {d.key: d for d in devices}
    extended_bytes: dict[str, int] = {}
    extended_count: dict[str, int] = {}
    placements: dict[str, dict[str, list[str]]] = {}
    for allocation in allocations:
        if not allocation.extended_resource:
            continue
        pods = [uid for _, uid in allocation.reserved_for if uid]
        for result in allocation.results:
            device = by_key.get(result.key)
            if device is None:
                continue
            extended_bytes[device.uuid] = extended_bytes.get(device.uuid, 0) + result_memory(result, device)
            extended_count[device.uuid] = extended_count.get(device.uuid, 0) + 1
            for uid in pods:
                container = _container(result.request, containers_of(uid))
                if container is not None:
                    placements.setdefault(uid, {}).setdefault(container, []).append(device.uuid)
    gpus: list[Gpu] = []
    for ordinal, device in enumerate(devices):
        resource = next((r for r, c in serving.items() if c.could_match([device])), None)
        if resource is None:
            continue  # no extended resource maps to it: only pods with claims use it (admission's)
        used = usage.get(device.uuid)
        ours = extended_count.get(device.uuid, 0)
        gpus.append(
            Gpu(
                id=device.uuid,
                index=_index(device, ordinal),
                product=device.product,
                memory_bytes=device.memory_bytes,
                sharing=_sharing(device),
                replicas=ours + open_slots(device, used),
                resource=resource,
                mig_profile=device.profile if device.type == "mig" else None,
                foreign_bytes=max(0, (used.consumed_bytes if used else 0) - extended_bytes.get(device.uuid, 0)),
                dra_sharing=device.sharing,
            )
        )
    return DraLedgerPart(
        tuple(gpus), {uid: {c: tuple(ids) for c, ids in per.items()} for uid, per in placements.items()}
    )


def open_slots(device: DraDevice, used: DeviceUsage | None) -> int:
    """How many more allocations without a capacity request the allocator could put on ``device``."""
    shares = used.shares if used is not None else ()
    if not device.shareable:
        return 0 if shares else 1
    default = device.consumes(None)
    if default is None:
        return 0
    free = device.memory_bytes - (used.consumed_bytes if used is not None else 0)
    slots = OPEN_SLOTS if default == 0 else max(0, free // default)
    if device.shares is not None:
        slots = min(slots, max(0, device.shares - len(shares)))
    return min(slots, OPEN_SLOTS)


def allocated_devices(
    allocation: ClaimAllocation, devices: Sequence[DraDevice], containers: Sequence[str]
) -> dict[str, tuple[str, ...]]:
    """Per container, the device uuids an extended-resource claim's allocation gives it
    (``containers``: the pod's init containers, then its containers, by name)."""
    by_key = {d.key: d for d in devices}
    chosen: dict[str, list[str]] = {}
    for result in allocation.results:
        device = by_key.get(result.key)
        container = _container(result.request, containers)
        if device is not None and container is not None:
            chosen.setdefault(container, []).append(device.uuid)
    return {name: tuple(ids) for name, ids in chosen.items()}


def _container(request: str, containers: Sequence[str] | None) -> str | None:
    match = _REQUEST_NAME.match(request)
    if match is None or containers is None:
        return None
    index = int(match[1])
    return containers[index] if index < len(containers) else None


def _sharing(device: DraDevice) -> Sharing:
    if device.shareable:
        return "time-slicing"
    return "mig" if device.type == "mig" else "none"


def _index(device: DraDevice, ordinal: int) -> int:
    match = _GPU_NAME.match(device.name)
    return int(match[1]) if match else ordinal


def place_claims(claims: Sequence[Claim], chosen: Mapping[str, Sequence[str]]) -> tuple[Claim, ...]:
    """``claims`` with the device each one is really on, from the DRA allocation: per container,
    its claims take the allocated devices in order. A claim left without one stays unplaced."""
    position: dict[str, int] = {}
    placed = []
    for claim in claims:
        devices = chosen.get(claim.container, ())
        index = position.get(claim.container, 0)
        position[claim.container] = index + 1
        placed.append(replace(claim, gpu=devices[index]) if index < len(devices) else claim)
    return tuple(placed)


def container_names(pod: Mapping[str, Any]) -> list[str]:
    """A pod's init containers, then its containers, by name: how DRA numbers the requests of an
    extended-resource claim (``container-<i>-request-<j>``)."""
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        return []
    names: list[str] = []
    for field_name in ("initContainers", "containers"):
        containers = spec.get(field_name)
        for container in containers if isinstance(containers, list) else ():
            names.append(str(container.get("name", "")) if isinstance(container, Mapping) else "")
    return names


def requested_resources(pod: Mapping[str, Any]) -> frozenset[str]:
    """Every resource name a pod's containers list in their limits or requests."""
    names: set[str] = set()
    spec = pod.get("spec")
    for field_name in ("initContainers", "containers"):
        containers = spec.get(field_name) if isinstance(spec, Mapping) else None
        for container in containers if isinstance(containers, list) else ():
            resources = container.get("resources") if isinstance(container, Mapping) else None
            for section in ("limits", "requests"):
                values = resources.get(section) if isinstance(resources, Mapping) else None
                if isinstance(values, Mapping):
                    names.update(k for k in values if isinstance(k, str))
    return frozenset(names)
