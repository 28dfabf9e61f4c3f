"""Placement of pods with ResourceClaims: what the engines on a DRA device reserve there, and
whether a pod's claims fit the device they get (pure).

The scheduler's allocator shares a device by what claims say they consume; the engines take what
their flags say (vLLM at 0.90 takes 0.90 of the device whatever its claim asks). So at placement
each claim allocated on a device counts the larger of the two: what it consumes there, and what
the engines of the pods it is reserved for reserve there (a claim's :class:`Tenant`). Two rules:

- **the device's memory**: the claims' tenants on a device, this pod's added, fit in its memory
  (the allocator fills a DRA device's capacity to 100%, and the engines may too). In every mode,
  as the ledger's budget is for device-plugin GPUs;
- **the claim's sizing** (where the namespace enforces the policy): on the device it gets, a claim
  consumes at least what the engines of its pods reserve there, the admission rule checked again on
  a device that may have joined since (0.90 of an H200's 141Gi is not the 72Gi of an H100's).

Before the scheduler allocates a claim, the extender's filter cannot know which device it will get:
a node passes only if **every** device the claim's class and selectors could still get there passes
(free capacity for what it consumes). Once allocated (the scheduler writes the allocation before it
calls bind), the devices are known and checked as they are.

**Who counts.** Binds come faster than watch events, and the scheduler reserves several pods'
claims before it calls bind for any: a pod counts by its engines once a bind has checked it (it
then *holds* what it takes on each device, :meth:`vramguard.dra.state.DraState.hold`) or the pods'
watch shows it bound; a pod whose claim is reserved but that no bind has checked yet counts by what
its claim consumes, but only against the pods after it in creation order (:func:`pod_rank`): a
bind is checked against the unchecked claims of the pods before it, never those after it, so of a
wave that cannot all fit exactly the first to reach bind that fits wins (counting each other's claims
both ways, two pods at 0.90 prebound together refused each other's binds on every retry); a
claim left allocated but reserved for no pod counts for the allocator's room only (kube-scheduler
v1.36's Unreserve, after a refused bind, takes the pod out of ``status.reservedFor`` and keeps the
allocation; the pod keeps it when it is retried).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vramguard.dra.claims import ClaimAllocation, ClaimRequest, DeviceRequest, result_memory
from vramguard.dra.devices import DraDevice
from vramguard.dra.fields import mapping, memory_text, text
from vramguard.dra.pods import container_claim_uses, pod_claim_sources
from vramguard.dra.review import CLAIM_USES_REFUSAL, allocated_needs, claim_uses_over_bound, pod_request_needs
from vramguard.dra.sizing import Need, Shortfall, reserved_on
from vramguard.dra.state import DraState


@dataclass(frozen=True, slots=True)
class Tenant:
    """One claim allocated on a device, or a pod being bound there (``claim`` is then ``""``)."""

    claim: str
    """``<namespace>/<name>`` of the claim."""
    consumed: int
    reserved: int = 0
    """What the engines of its bound pods reserve on the device."""
    in_use: bool = True
    """Reserved for a pod. A claim left allocated but reserved for none (the scheduler's Unreserve
    after a refused bind takes the pod out of ``status.reservedFor`` and keeps the allocation) runs
    no engine: it counts for the allocator's room, not for the engines'."""

    @property
    def held(self) -> int:
        """What it takes on the device: the more of what it consumes and what its engines reserve."""
        return max(self.consumed, self.reserved) if self.in_use else 0


def pod_rank(pod: Mapping[str, Any]) -> tuple[str, str]:
    """The order pods racing to bind are checked in: creation time (RFC 3339 in UTC sorts as text),
    then UID. A total order, so of two unchecked pods exactly one counts the other's claim."""
    metadata = mapping(pod.get("metadata"))
    return text(metadata.get("creationTimestamp")) or "", text(metadata.get("uid")) or ""


def device_tenants(
    state: DraState, skip_pod: str = "", rank: tuple[str, str] | None = None
) -> dict[str, list[Tenant]]:
    """Per device uuid, the claims allocated there with what the engines of their pods reserve, and
    the holds no claim shows yet. A pod counts by its engines once bind has checked it (it holds) or
    the pods' watch shows it bound; a pod the scheduler has reserved a claim for but that no bind
    has checked counts by what its claim consumes. Pod ``skip_pod`` (the pod being placed) is left
    out; with its ``rank`` (:func:`pod_rank`), so is a claim reserved only for unchecked pods ranked
    after it: they are checked against this pod when their bind comes, not this pod against them."""
    devices = state.inventory().by_key()
    holds = state.live_holds()
    tenants: dict[str, list[Tenant]] = {}
    shown: dict[str, set[str]] = {}
    for allocation in state.allocations():
        if rank is not None and _racing_after(state, allocation, skip_pod, holds, rank):
            continue
        pods = {
            uid: pod
            for _, uid in allocation.reserved_for
            if uid and uid != skip_pod and (pod := state.pod(uid)) is not None and (_bound(pod) or uid in holds)
        }
        amounts: dict[str, tuple[int, int]] = {}
        for result in allocation.results:
            device = devices.get(result.key)
            if device is None:
                continue
            request = result.request.split("/", 1)[0]
            reserved = sum(reserved_on(allocated_needs(pod, allocation, request), device) for pod in pods.values())
            consumed, before = amounts.get(device.uuid, (0, 0))
            amounts[device.uuid] = (consumed + result_memory(result, device), before + reserved)
        for uuid, (consumed, reserved) in amounts.items():
            key = f"{allocation.namespace}/{allocation.name}"
            tenants.setdefault(uuid, []).append(Tenant(key, consumed, reserved, bool(allocation.reserved_for)))
            shown.setdefault(uuid, set()).update(pods)
    for uid, taken in holds.items():
        for uuid, amount in taken:
            if uid != skip_pod and uid not in shown.get(uuid, ()):
                tenants.setdefault(uuid, []).append(Tenant("", amount))
    return tenants


def _bound(pod: Mapping[str, Any]) -> bool:
    return bool(mapping(pod.get("spec")).get("nodeName"))


def _racing_after(
    state: DraState, allocation: ClaimAllocation, skip_pod: str, holds: Mapping[str, Any], rank: tuple[str, str]
) -> bool:
    """Whether the claim is reserved for pods no bind has checked yet, all ranked after ``rank``."""
    uids = [uid for _, uid in allocation.reserved_for if uid]
    if not uids or skip_pod in uids:
        return False
    for uid in uids:
        pod = state.pod(uid)
        if pod is None or _bound(pod) or uid in holds or pod_rank(pod) <= rank:
            return False
    return True


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a pod's claims do not fit a device of a node."""

    message: str
    resolvable: bool
    """Whether pods leaving could make room (the device's memory), or only a new claim (its sizing)."""


@dataclass(slots=True)
class ClaimPlacement:
    """What :func:`place_claims` found for one pod on one node."""

    refusals: list[Refusal] = field(default_factory=list)
    taken: dict[str, int] = field(default_factory=dict)
    """Per device uuid, what the pod's claims take there with it (its hold once bound)."""
    unplaced: list[str] = field(default_factory=list)
    """Claims that are not allocated on the node, reserved for the pod (at bind: the scheduler's PreBind
    did not write them; the pod is retried)."""
    omitted: int = 0
    """Refusals past :data:`MAX_REFUSALS`, counted, their messages never written."""
    omitted_unresolvable: bool = False

    def room(self, *, resolvable: bool) -> bool:
        """Whether another refusal is written; past :data:`MAX_REFUSALS` it is only counted (its message
        is not even built: a pod of many claims on a node of many devices is refused thousands of
        times over)."""
        if len(self.refusals) < MAX_REFUSALS:
            return True
        self.omitted += 1
        self.omitted_unresolvable |= not resolvable
        return False


MAX_REFUSALS = 8
"""Refusals written per node; the filter's reason for a node says the first few and how many more."""


def used_claims(pod: Mapping[str, Any]) -> list[tuple[str, str | None]]:
    """The pod's claims its containers use, as ``(pod's name for it, ResourceClaim name)``: a named
    claim, or the one made from a template once the pod's status names it (``None`` before)."""
    used = {u.claim for u in container_claim_uses(pod)}
    return [(source.name, source.allocated_claim) for source in pod_claim_sources(pod) if source.name in used]


def place_claims(
    state: DraState,
    pod: Mapping[str, Any],
    node: str,
    *,
    sizing: bool,
    allocated: bool = False,
    tenants: Mapping[str, list[Tenant]] | None = None,
) -> ClaimPlacement:
    """Whether the claims of ``pod`` fit on ``node`` (see the module docstring); ``sizing``: check
    each claim's memory against its engines on the device (the namespace enforces the policy);
    ``allocated``: every claim must be allocated and reserved for the pod there (bind);
    ``tenants``: :func:`device_tenants` without the pod, when the caller places it on many nodes."""
    metadata = mapping(pod.get("metadata"))
    namespace, uid = text(metadata.get("namespace")) or "", text(metadata.get("uid")) or ""
    if tenants is None:
        tenants = device_tenants(state, uid, pod_rank(pod))
    placement = ClaimPlacement()
    claim_names = dict(used_claims(pod))
    if claim_uses_over_bound(pod, lambda claim: _requests(state, namespace, claim_names.get(claim))):
        placement.refusals.append(Refusal(f"{node}: {CLAIM_USES_REFUSAL}", False))
        return placement
    on_node = state.devices(node)
    takes: dict[str, int] = {}
    mine: dict[str, set[str]] = {}
    checked: list[tuple[DraDevice, str, list[Need]]] = []
    could_get: dict[tuple[DeviceRequest, ...], list[tuple[DraDevice, DeviceRequest]]] = {}
    for pod_claim, name in used_claims(pod):
        if name is None:
            if allocated:
                placement.unplaced.append(f"claim {pod_claim} has not been made from its template")
            continue
        spec = state.claim(namespace, name)
        allocation = state.allocation(namespace, name)
        key = f"{namespace}/{name}"
        if allocated and (allocation is None or uid not in {u for _, u in allocation.reserved_for}):
            placement.unplaced.append(f"ResourceClaim {key} is not allocated and reserved for the pod")
            continue
        if allocated and allocation is not None and not {r.key for r in allocation.results} & {d.key for d in on_node}:
            placement.unplaced.append(f"ResourceClaim {key} is allocated on no device of {node}")
            continue
        if spec is None:
            continue  # the claims' watch has not shown it: bind reads it from the API server
        for request in spec.requests:
            own = pod_request_needs(pod, name, allocation, request)
            if not own:
                continue
            # What the engines reserve depends on a device's memory only: once per size, not per device.
            sized: dict[int, int] = {}
            if allocation is None:  # the devices it could get depend on its alternatives only
                devices = could_get.get(request.alternatives)
                if devices is None:
                    devices = could_get[request.alternatives] = _devices(state, None, request, on_node, tenants)
            else:
                devices = _devices(state, allocation, request, on_node, tenants)
            for device, alternative in devices:
                current = next((t for t in tenants.get(device.uuid, ()) if t.claim == key), None)
                consumed = current.consumed if current else alternative.consumes_on(device) or 0
                others = current.reserved if current else 0
                needs = sized.get(device.memory_bytes)
                if needs is None:
                    needs = sized[device.memory_bytes] = reserved_on(own, device)
                after = Tenant(key, consumed, others + needs)
                takes[device.uuid] = takes.get(device.uuid, 0) + after.held
                mine.setdefault(device.uuid, set()).add(key)
                checked.append((device, key, own))
                if sizing and consumed < after.reserved and placement.room(resolvable=False):
                    shortfall = Shortfall(
                        pod_claim, alternative, device, consumed, tuple(own), device.consumes(after.reserved)
                        or after.reserved
                    )
                    placement.refusals.append(Refusal(f"{node}: on {device.label}, {shortfall.message()}", False))
    for device, key, own in checked:
        others = sum(t.held for t in tenants.get(device.uuid, ()) if t.claim not in mine[device.uuid])
        if others + takes[device.uuid] > device.memory_bytes and placement.room(resolvable=True):
            placement.refusals.append(Refusal(
                f"{node}: {device.label} has {memory_text(max(device.memory_bytes - others, 0))} of "
                f"{memory_text(device.memory_bytes)} left beside the engines of the claims there, and claim "
                f"{key} of this pod takes {memory_text(takes[device.uuid])} ({_who(own, device)})",
                True,
            ))
    placement.refusals = list({r.message: r for r in placement.refusals}.values())
    if placement.omitted:
        kind = " (some only a new claim could fix)" if placement.omitted_unresolvable else ""
        placement.refusals.append(Refusal(
            f"{node}: and {placement.omitted} more{kind}", not placement.omitted_unresolvable))
    placement.taken = takes
    return placement


def _requests(state: DraState, namespace: str, claim: str | None) -> int:
    spec = state.claim(namespace, claim) if claim is not None else None
    return len(spec.requests) if spec is not None else 0


def _devices(
    state: DraState,
    allocation: ClaimAllocation | None,
    request: ClaimRequest,
    on_node: Iterable[DraDevice],
    tenants: Mapping[str, list[Tenant]],
) -> list[tuple[DraDevice, DeviceRequest]]:
    """The devices of the node ``request`` has (allocated), or could get: those its class and
    selectors match with room for what it consumes there, as the allocator counts room."""
    devices = list(on_node)
    if allocation is not None:
        by_key = {d.key: d for d in devices}
        alternatives = {a.name: a for a in request.alternatives}
        found = []
        for result in allocation.results:
            if result.request.split("/", 1)[0] != request.name or result.key not in by_key:
                continue
            alternative = alternatives.get(result.request, request.alternatives[0])
            found.append((by_key[result.key], alternative))
        return found
    classes = state.device_classes()
    candidates = []
    for alternative in request.alternatives:
        device_class = classes.get(alternative.device_class)
        if device_class is None or not device_class.selects_gpus():
            continue
        for device in device_class.could_match(devices, alternative.selector):
            amount = alternative.consumes_on(device)
            there = tenants.get(device.uuid, ())
            taken = sum(t.consumed for t in there if t.claim)  # the allocator's room: every allocation
            free = not there if not device.shareable else device.memory_bytes - taken >= (amount or 0)
            if amount is not None and free:
                candidates.append((device, alternative))
    return candidates


def _who(needs: Iterable[Need], device: DraDevice) -> str:
    return " and ".join(f"{n.who} will reserve {n.arithmetic(device)}" for n in needs)
