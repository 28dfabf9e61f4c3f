"""ResourceClaims and ResourceClaimTemplates (resource.k8s.io/v1): what they ask for, and what an
allocated claim consumes on each device.

**Requests.** A claim's ``spec.devices.requests[]`` each hold ``exactly`` (one device request) or
``firstAvailable`` (alternatives tried in order; allocation results then name ``<request>/<sub>``).
A device request names a DeviceClass, CEL selectors, ``allocationMode`` (``ExactCount`` with
``count``, default 1, or ``All``) and ``capacity.requests``, applied per allocated device. Of the
capacity requests only ``memory`` matters here.

**Consumption.** On a shareable device a request consumes its ``capacity.requests.memory`` rounded up
by the device's request policy, else the policy's default, else the whole device; on a device that
is not shareable, the whole device (:meth:`vramguard.dra.devices.DraDevice.consumes`). Once
allocated, the scheduler records it in ``status.allocation.devices.results[].consumedCapacity``
with a ``shareID`` per share; :func:`device_usage` adds those up per device, counting each
``(driver, pool, device, shareID)`` once (two claims cannot hold the same share; a re-listed claim
must not count twice) and a result on a device that is not shareable as the whole device.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from vramguard.dra.classes import ANY_DEVICE, Selector, read_selectors
from vramguard.dra.devices import DraDevice, DraInventory
from vramguard.dra.fields import integer, items, mapping, object_name, quantity_bytes, text
from vramguard.dra.pods import POD_CLAIM_NAME_ANNOTATION
from vramguard.dra.sharing import MpsDefaults, read_mps_configs

MAX_REQUESTS = 32
"""The API's limit on requests per claim; more are not read (a note says so)."""
MAX_ALTERNATIVES = 8
MAX_RESULTS = 1024
MAX_RESERVED_FOR = 256
EXTENDED_RESOURCE_CLAIM_ANNOTATION = "resource.kubernetes.io/extended-resource-claim"
"""Set (``"true"``) on the claim the scheduler creates for a pod on the DRA extended-resource path."""


@dataclass(frozen=True, slots=True)
class DeviceRequest:
    """One way to satisfy a request: a class, selectors, how many devices and how much memory each."""

    name: str
    """The request's name; ``<request>/<alternative>`` for a ``firstAvailable`` alternative."""
    device_class: str
    selector: Selector = ANY_DEVICE
    count: int = 1
    """Devices asked for (``allocationMode: ExactCount``)."""
    all_devices: bool = False
    """``allocationMode: All``: every matching device."""
    memory: int | None = None
    """``capacity.requests.memory`` in bytes, per device; ``None`` when not set."""
    admin_access: bool = False
    """Admin access: the device is reachable without being consumed (monitoring tools)."""

    def consumes_on(self, device: DraDevice) -> int | None:
        """The memory this request consumes on ``device`` (``None``: the device cannot serve it)."""
        return 0 if self.admin_access else device.consumes(self.memory)


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    """A request of a claim: one device request (``exactly``) or alternatives (``firstAvailable``)."""

    name: str
    alternatives: tuple[DeviceRequest, ...]
    mps: MpsDefaults | None = None
    """The MPS limits the claim's configuration sets for the processes using it (NVIDIA's driver)."""


@dataclass(frozen=True, slots=True)
class ClaimSpec:
    """The requests of a ResourceClaim or a ResourceClaimTemplate's claim."""

    namespace: str = ""
    name: str = ""
    requests: tuple[ClaimRequest, ...] = ()
    notes: tuple[str, ...] = ()

    def request(self, name: str) -> ClaimRequest | None:
        """The request called ``name`` (the part before ``/`` of a sub-request name)."""
        main = name.split("/", 1)[0]
        return next((r for r in self.requests if r.name == main), None)


def read_claim(obj: Any) -> ClaimSpec:
    """The requests of a decoded ResourceClaim (``spec.devices.requests``). Never raises."""
    namespace, name = object_name(mapping(obj))
    return read_claim_spec(mapping(mapping(obj).get("spec")), namespace, name)


def read_claim_template(obj: Any) -> ClaimSpec:
    """The requests of the claim a decoded ResourceClaimTemplate makes (``spec.spec``). Never raises."""
    namespace, name = object_name(mapping(obj))
    return read_claim_spec(mapping(mapping(mapping(obj).get("spec")).get("spec")), namespace, name)


def read_claim_spec(spec: Mapping[str, Any], namespace: str = "", name: str = "") -> ClaimSpec:
    """The requests of a ResourceClaimSpec."""
    notes: list[str] = []
    where = f"ResourceClaim {namespace}/{name}" if name else "claim"
    raw = items(mapping(spec.get("devices")).get("requests"))
    if len(raw) > MAX_REQUESTS:
        notes.append(f"{where}: {len(raw)} requests, only the first {MAX_REQUESTS} read")
    requests: list[ClaimRequest] = []
    for raw_entry in raw[:MAX_REQUESTS]:
        entry = mapping(raw_entry)
        request_name = text(entry.get("name"))
        if not request_name:
            notes.append(f"{where}: a request without a name; ignored")
            continue
        if isinstance(entry.get("exactly"), Mapping):
            exact = _device_request(request_name, mapping(entry["exactly"]), f"{where} request {request_name}", notes)
            if exact is not None:
                requests.append(ClaimRequest(request_name, (exact,)))
            continue
        alternatives: list[DeviceRequest] = []
        for raw_sub in items(entry.get("firstAvailable"))[:MAX_ALTERNATIVES]:
            sub = mapping(raw_sub)
            sub_name = text(sub.get("name")) or ""
            full = f"{request_name}/{sub_name}"
            alternative = _device_request(full, sub, f"{where} request {full}", notes)
            if alternative is not None:
                alternatives.append(alternative)
        if alternatives:
            requests.append(ClaimRequest(request_name, tuple(alternatives)))
        else:
            notes.append(f"{where} request {request_name}: neither exactly nor firstAvailable; ignored")
    configs = read_mps_configs(spec, where, notes)
    if configs:
        requests = [replace(r, mps=configs.get(r.name, configs.get(None))) for r in requests]
    return ClaimSpec(namespace, name, tuple(requests), tuple(notes))


def _device_request(name: str, raw: Mapping[str, Any], where: str, notes: list[str]) -> DeviceRequest | None:
    device_class = text(raw.get("deviceClassName"))
    if not device_class:
        notes.append(f"{where}: no deviceClassName; ignored")
        return None
    mode = raw.get("allocationMode", "ExactCount")
    count = integer(raw.get("count"))
    if count is None or count < 1:
        if "count" in raw:
            notes.append(f"{where}: count {raw.get('count')!r} is not a positive integer; 1 assumed")
        count = 1
    memory = None
    requests = mapping(mapping(raw.get("capacity")).get("requests"))
    for key in ("memory", *(k for k in requests if isinstance(k, str) and k.endswith("/memory"))):
        if key in requests:
            memory = quantity_bytes(requests[key], f"{where} capacity.requests.{key}", notes)
            break
    return DeviceRequest(
        name=name,
        device_class=device_class,
        selector=read_selectors(raw.get("selectors"), notes),
        count=min(count, MAX_RESULTS),
        all_devices=mode == "All",
        memory=memory,
        admin_access=raw.get("adminAccess") is True,
    )


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    """One result of a claim's allocation: a device (or a share of it) given to one request."""

    request: str
    driver: str
    pool: str
    device: str
    share_id: str | None = None
    consumed_memory: int | None = None
    """``consumedCapacity.memory`` in bytes; ``None`` when the result names none."""
    admin_access: bool = False

    @property
    def key(self) -> tuple[str, str, str]:
        """``(driver, pool, device)``, as :attr:`DraDevice.key`."""
        return self.driver, self.pool, self.device


@dataclass(frozen=True, slots=True)
class ClaimAllocation:
    """An allocated ResourceClaim: its results and the pods it is reserved for."""

    namespace: str
    name: str
    uid: str
    results: tuple[AllocatedDevice, ...]
    reserved_for: tuple[tuple[str, str], ...] = ()
    """``(pod name, pod uid)`` of ``status.reservedFor`` entries naming pods."""
    extended_resource: bool = False
    """Created by the scheduler for the DRA extended-resource path."""
    pod_claim_name: str | None = None
    """For a claim made from a template, the pod's name for it (``resource.kubernetes.io/pod-claim-name``)."""
    notes: tuple[str, ...] = ()


def read_allocation(obj: Any) -> ClaimAllocation | None:
    """The allocation of a decoded ResourceClaim, ``None`` when it is not allocated. Never raises."""
    claim = mapping(obj)
    status = mapping(claim.get("status"))
    if not isinstance(status.get("allocation"), Mapping):
        return None
    namespace, name = object_name(claim)
    metadata = mapping(claim.get("metadata"))
    notes: list[str] = []
    where = f"ResourceClaim {namespace}/{name}"
    raw = items(mapping(mapping(status["allocation"]).get("devices")).get("results"))
    if len(raw) > MAX_RESULTS:
        notes.append(f"{where}: {len(raw)} allocation results, only the first {MAX_RESULTS} read")
    results: list[AllocatedDevice] = []
    for raw_entry in raw[:MAX_RESULTS]:
        entry = mapping(raw_entry)
        driver, pool, device = text(entry.get("driver")), text(entry.get("pool")), text(entry.get("device"))
        if not (driver and pool and device):
            notes.append(f"{where}: an allocation result without driver, pool or device; ignored")
            continue
        consumed_capacity = mapping(entry.get("consumedCapacity"))
        consumed_value = consumed_capacity.get("memory", consumed_capacity.get(f"{driver}/memory"))
        consumed = (
            quantity_bytes(consumed_value, f"{where} consumedCapacity.memory", notes)
            if consumed_value is not None
            else None
        )
        results.append(
            AllocatedDevice(
                request=text(entry.get("request")) or "",
                driver=driver,
                pool=pool,
                device=device,
                share_id=text(entry.get("shareID")) or None,
                consumed_memory=consumed,
                admin_access=entry.get("adminAccess") is True,
            )
        )
    reserved = tuple(
        (text(r.get("name")) or "", text(r.get("uid")) or "")
        for r in (mapping(r) for r in items(status.get("reservedFor"))[:MAX_RESERVED_FOR])
        if r.get("resource") == "pods"
    )
    annotations = mapping(metadata.get("annotations"))
    return ClaimAllocation(
        namespace=namespace,
        name=name,
        uid=text(metadata.get("uid")) or "",
        results=tuple(results),
        reserved_for=reserved,
        extended_resource=annotations.get(EXTENDED_RESOURCE_CLAIM_ANNOTATION) == "true",
        pod_claim_name=text(annotations.get(POD_CLAIM_NAME_ANNOTATION)) or None,
        notes=tuple(notes),
    )


@dataclass(frozen=True, slots=True)
class Share:
    """What one allocation result holds on a device."""

    claim: str
    """``<namespace>/<name>`` of the claim."""
    request: str
    share_id: str | None
    memory_bytes: int
    pods: tuple[str, ...] = ()
    """Names of the pods the claim is reserved for (``status.reservedFor``)."""


@dataclass(frozen=True, slots=True)
class DeviceUsage:
    """The memory allocated claims consume on one device."""

    device: DraDevice
    shares: tuple[Share, ...] = ()

    @property
    def consumed_bytes(self) -> int:
        """The memory of all shares (capped at nothing: an overfull device shows as such)."""
        return sum(s.memory_bytes for s in self.shares)

    @property
    def free_bytes(self) -> int:
        """Memory no claim consumes; negative when the claims say more than the device has."""
        return self.device.memory_bytes - self.consumed_bytes


def result_memory(result: AllocatedDevice, device: DraDevice, notes: list[str] | None = None) -> int:
    """The memory one allocation result consumes: a device that is not shareable is consumed whole;
    on a shareable one, its ``consumedCapacity.memory`` (a result without it, which the API does not
    write, is counted as the whole device: the conservative reading). Admin access consumes nothing."""
    if result.admin_access:
        return 0
    if not device.shareable:
        return device.memory_bytes
    if result.consumed_memory is None:
        if notes is not None:
            notes.append(f"{device.label}: an allocation result without consumedCapacity.memory; counted whole")
        return device.memory_bytes
    return result.consumed_memory


def device_usage(
    inventory: DraInventory, allocations: Iterable[ClaimAllocation], notes: list[str] | None = None
) -> dict[str, DeviceUsage]:
    """Per device uuid, the shares allocated claims hold on the inventory's devices (every device,
    shared or not, appears; results on devices not in the inventory are left out, with a note)."""
    by_key = inventory.by_key()
    shares: dict[str, dict[tuple[str, str, str, str | None], Share]] = {d.uuid: {} for d in inventory.devices}
    for allocation in allocations:
        for result in allocation.results:
            device = by_key.get(result.key)
            if device is None:
                if notes is not None:
                    notes.append(
                        f"ResourceClaim {allocation.namespace}/{allocation.name}: device "
                        f"{result.pool}/{result.device} is in no complete pool; not counted"
                    )
                continue
            share_key = (*result.key, result.share_id if device.shareable else None)
            shares[device.uuid][share_key] = Share(
                f"{allocation.namespace}/{allocation.name}",
                result.request,
                result.share_id,
                result_memory(result, device, notes),
                tuple(name for name, _ in allocation.reserved_for if name),
            )
    return {d.uuid: DeviceUsage(d, tuple(shares[d.uuid].values())) for d in inventory.devices}
