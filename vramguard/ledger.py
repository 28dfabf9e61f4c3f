"""Who holds how many bytes on every GPU device of the cluster, in exact integer bytes.

**Budget.** Each device (a physical GPU, or a MIG instance) has a budget of
``floor(memory * (1 - headroom))`` bytes. The headroom is a property of the device, not of the pod
asking: it is the policy's headroom for the device's sharing strategy, the largest among the classes
allowed on such devices (:meth:`vramguard.policy.Policy.headroom_for`). So the budget of a GPU is
fixed whatever the order pods arrive in, and the most careful class that may use it is honoured.

**Claims.** A pod holds one :class:`Claim` per device replica it gets: a container asking for
``nvidia.com/gpu: 2`` makes two claims, each worth its per-GPU reservation. A claim may have
several candidate amounts (an init container and an app container sharing a replica); it holds the
largest on the device it lands on. A claim without an amount (``None``) holds a whole device:
its budget, or on an MPS device the share the device plugin gives one replica (``budget // R``).

**Unknown placement.** With the stock device plugin the physical GPU behind a time-sliced replica is
the plugin's choice, blind to VRAM. Until the agent reports the real device, a claim on a node with
several devices of its resource could be on any of them. Each device ``g`` has ``R`` replica
slots, so the plugin can put at most ``R - (slots taken by known claims on g)`` unknown claims on it.
The rule is that no device can be overcommitted whatever the plugin picks::

    for every device g:  known(g) + (sum of the largest R - known_slots(g) unknown claims) <= budget(g)

where the unknown claims are those of the node's pods for g's resource. It is exact: the adversary
can put exactly those claims on ``g`` (the kubelet admits only as many replicas as exist, so the
rest fit elsewhere). A device that is alone behind its resource, or that the agent reports, is
known. Exclusive devices (``R = 1``) fall out of the same rule: one claim each, at most the budget.
Under MPS the rule also holds, and each claim must fit one replica's share (the plugin caps it).

**Measured use.** The agent reports what each pod's processes use on each device. A pod holds, on
every device it is measured on, the larger of its claims there and what it uses (use within
:data:`MEASURED_TOLERANCE_BYTES` of the claims is the CUDA context and allocator slack the headroom
is for, and is not counted): the part above its claims is *over-use*, counted on that device as known
bytes. A declaration is a floor, not a ceiling: ``vramguard.io/vram: 1Mi`` on a pod using 20 GiB
holds 20 GiB once the agent has measured it. A pod measured on a device where none of its claims is
known to be (no placement reported) holds its use there on top of its claims, wherever the device
plugin put them: the safe reading.

The ledger is cheap enough for the extender's cluster state (5,000 nodes, 50,000 pods): counters per
device are kept incrementally, the sorted unknown claims of a resource are cached as prefix sums
until they change, and the check against an empty node is cached per kind of node and claims.
A filter asks one pod's claims of thousands of nodes: the claims are prepared once per pod
(:class:`_Query`), and each resource of a node keeps a summary per generation (:class:`_Summary`):
the least room left for ``j`` more claims on any device that can take them, so the common verdict
is a handful of integer comparisons, and a failure's numbers come from the same rows.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from fractions import Fraction
from itertools import accumulate

from vramguard.demand.model import Vram
from vramguard.inventory import Gpu, NodeInventory, Sharing
from vramguard.quantity import format_bytes

_CACHE_LIMIT = 1 << 16
MEASURED_TOLERANCE_BYTES = 512 * 1024 * 1024
"""Use above a pod's claims on a device that is still not over-use: one CUDA context and allocator
slack, which the budget's headroom covers."""


def over_use(claimed: int, used: int) -> int:
    """The bytes a pod uses beyond what it claims on a device, or 0 within the tolerance."""
    excess = used - claimed
    return excess if excess > MEASURED_TOLERANCE_BYTES else 0



class Invariant(StrEnum):
    """Which part of the rule (or of the ledger's own bookkeeping) an :class:`InvariantViolation` breaks."""

    REPLICAS_HELD = "replicas-held"
    """A resource's claims hold more replicas than its devices have."""
    KNOWN_CLAIMS = "known-claims"
    """A device has more claims placed on it than replicas."""
    OVER_BUDGET = "over-budget"
    """A device may hold more than its budget (the worst case over unknown placements)."""
    MPS_SHARE = "mps-share"
    """Claims of unknown placement above one MPS replica's share."""
    RESOURCE_MISSING = "resource-missing"
    """A bound pod asks for a resource its node does not offer."""
    COUNTERS = "counters"
    """Bookkeeping: a device's running counters disagree with a recount of its pods."""
    UNKNOWN_LIST = "unknown-list"
    """Bookkeeping: a resource's list of unplaced claims disagrees with a recount."""


@dataclass(frozen=True, slots=True)
class InvariantViolation:
    """One violation found by :meth:`Ledger.invariant_violations`: what, where, and the numbers."""

    invariant: Invariant
    node: str
    subject: str
    """The resource, the device's label, or the pod (``namespace/name (uid)``)."""
    numbers: Mapping[str, int] = field(default_factory=dict)

    @property
    def message(self) -> str:
        """The violation for people: ``n GPU 0 (H100): may hold 90 GiB (...), budget 80 GiB (...)``."""
        n = self.numbers
        where = f"{self.node} {self.subject}"
        match self.invariant:
            case Invariant.REPLICAS_HELD:
                return f"{where}: {n['held']} replicas held, {n['replicas']} exist"
            case Invariant.KNOWN_CLAIMS:
                return f"{where}: {n['claims']} known claims, {n['replicas']} replicas"
            case Invariant.OVER_BUDGET:
                return (f"{where}: may hold {format_bytes(n['worst'])} ({n['worst']} B), "
                        f"budget {format_bytes(n['budget'])} ({n['budget']} B)")
            case Invariant.MPS_SHARE:
                return f"{where}: {n['claims']} claims above one MPS replica's share"
            case Invariant.RESOURCE_MISSING:
                return f"pod {self.subject} asks for resources node {self.node} lacks"
            case Invariant.COUNTERS:
                return (f"{where}: counters say {n['bytes']} B in {n['replicas']} replicas, "
                        f"recount {n['recount_bytes']} B in {n['recount_replicas']}")
            case Invariant.UNKNOWN_LIST:
                return f"{where}: {n['listed']} unknown claims listed, recount {n['recount']}"

@dataclass(frozen=True, slots=True)
class Claim:
    """One device replica a pod holds: which resource, for which container, how many bytes."""

    resource: str
    container: str
    vram: tuple[Vram | None, ...] = (None,)
    """Candidate amounts per device; the largest on the device is held. ``None``: a whole device."""
    gpu: str | None = None
    """The device id the claim is really on, when known."""
    intended: str | None = None
    """The device vramguard chose at bind; used for scoring, never to relax the accounting."""
    _last: list[int] = field(default_factory=list, init=False, repr=False, compare=False)
    # The last (memory, whole, bytes) computed: fractions of large integers are slow, and a claim
    # almost always meets one size of device (a filter asks the same claim of every node).

    def bytes_on(self, memory_bytes: int, whole: int) -> int:
        """Bytes this claim holds on a device of ``memory_bytes`` whose whole share is ``whole``."""
        last = self._last
        if last and last[0] == memory_bytes and last[1] == whole:
            return last[2]
        amount = max(whole if v is None else v.on_device(memory_bytes) for v in self.vram)
        last[:] = (memory_bytes, whole, amount)
        return amount


@dataclass(frozen=True, slots=True)
class PodRef:
    """The pod behind a holding: its UID is the key, namespace and name are for messages."""

    uid: str
    namespace: str = ""
    name: str = ""

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace else self.name or self.uid


@dataclass(frozen=True, slots=True)
class Shortfall:
    """A device the pod's claims would overcommit, with the numbers for the message."""

    device: Gpu
    budget: int
    free: int
    """Budget left for the pod on this device in the worst case, after everyone else."""
    need: int
    """What the pod adds to the device in that worst case."""
    devices: int
    """How many of the pod's devices that worst case puts on this device."""
    unknown_pods: int
    """Other pods whose device is not known yet, counted where they hurt most."""


@dataclass(frozen=True, slots=True)
class Fit:
    """Whether a pod fits a node; when not, why, and whether it never could."""

    ok: bool
    unresolvable: bool = False
    shortfalls: tuple[Shortfall, ...] = ()
    problems: tuple[str, ...] = ()
    """Reasons that are not about VRAM on one device: missing resource, no replica left, ..."""


@dataclass(frozen=True, slots=True)
class DeviceUsage:
    """One device's state, for tables and scoring."""

    node: str
    device: Gpu
    budget: int
    known_bytes: int
    """Bytes of claims known to be on this device, measured over-use and foreign usage."""
    worst_bytes: int
    """What the device may hold whatever the device plugin picked for unknown claims."""
    expected_bytes: int
    """Known claims plus those vramguard intended for this device."""
    slots_used: int
    """Known or intended replicas on this device."""
    pods: tuple[str, ...]
    """Pods known or intended on this device (``namespace/name``)."""


_Check = tuple[tuple[str, ...], tuple[Shortfall, ...]]
"""Problems and shortfalls of adding claims to one resource of a node."""
_Placed = tuple[Claim, str | None]
"""A claim and the device it is known to be on (``None``: the device plugin's choice, unknown)."""


class _Device:
    __slots__ = ("budget", "expected_bytes", "expected_slots", "gpu", "known_bytes", "known_slots", "whole")

    def __init__(self, gpu: Gpu, headroom: Fraction) -> None:
        self.gpu = gpu
        keep = 1 - headroom
        self.budget = gpu.memory_bytes * keep.numerator // keep.denominator
        # What a claim of unknown size holds: the device, or one MPS replica's share of it.
        self.whole = self.budget // gpu.replicas if gpu.sharing == "mps" else self.budget
        self.known_bytes = gpu.foreign_bytes
        self.known_slots = 0
        self.expected_bytes = gpu.foreign_bytes
        self.expected_slots = 0

    def claim_bytes(self, claim: Claim) -> int:
        return claim.bytes_on(self.gpu.memory_bytes, self.whole)

    @property
    def size(self) -> tuple[int, int]:
        return self.gpu.memory_bytes, self.whole


class _Group:
    """The devices behind one resource on one node, and the claims whose device is unknown."""

    __slots__ = (
        "_prefix", "_summary", "devices", "resource", "shape", "sharing", "sizeless", "sizes", "slots", "unknown"
    )

    def __init__(self, resource: str, devices: list[_Device], shape: int) -> None:
        self.resource = resource
        self.devices = devices
        self.shape = shape
        """Identifies the devices and budgets: the empty-node check depends on nothing else."""
        self.sizes = tuple(dict.fromkeys(d.size for d in devices))
        self.slots = sum(d.gpu.replicas for d in devices)
        self.sharing = frozenset(d.gpu.sharing for d in devices)
        self.sizeless = next((d.gpu for d in devices if d.gpu.memory_bytes == 0), None)
        self.unknown: list[tuple[str, Claim]] = []
        self._prefix: dict[tuple[int, int], list[int]] = {}
        self._summary: tuple[int, _Summary | None] | None = None

    def unknown_prefix(self, device: _Device) -> list[int]:
        """Prefix sums of the unknown claims' bytes on ``device``, largest first (cached)."""
        cached = self._prefix.get(device.size)
        if cached is None:
            amounts = sorted((device.claim_bytes(c) for _, c in self.unknown), reverse=True)
            cached = self._prefix[device.size] = [0, *accumulate(amounts)]
        return cached

    def changed(self) -> None:
        self._prefix.clear()

    def summary(self, generation: int) -> _Summary | None:
        """The group's rows and least room per number of new claims, at the node's ``generation``.

        ``None`` when the group's devices differ in size or sharing (the general check applies).
        """
        cached = self._summary
        if cached is not None and cached[0] == generation:
            return cached[1]
        summary = _Summary.of(self) if len(self.sizes) == 1 and len(self.sharing) == 1 else None
        self._summary = (generation, summary)
        return summary


class _Summary:
    """One resource of one node, as the fast check needs it (devices of one size and sharing).

    ``rows``: per device, its free replica slots ``s`` (replicas minus known claims) and its budget
    left after known claims. ``least[j]``: the least room any device that can take ``j`` more claims
    (``s >= max(j, 1)``) has for them in the worst case, after the largest ``s - j`` unknown claims
    of other pods: ``budget - known - theirs[s - j]``. A pod whose ``j`` largest claims fit
    ``least[j]`` for every ``j`` fits every device whatever the device plugin picks.
    """

    __slots__ = ("least", "overfull", "rows", "theirs", "unknown_pods", "used", "whole")

    def __init__(
        self, rows: list[tuple[_Device, int, int]], theirs: list[int], used: int, unknown_pods: int, whole: int
    ) -> None:
        self.rows = rows
        self.theirs = theirs
        self.used = used
        self.unknown_pods = unknown_pods
        self.whole = whole
        self.overfull = any(s < 0 for _, s, _ in rows)
        """More known claims than replicas on some device (pods bound without vramguard)."""
        last = len(theirs) - 1
        most = max((s for _, s, _ in rows), default=0)
        self.least = [
            min(room - theirs[min(s - j, last)] for _, s, room in rows if s >= max(j, 1)) for j in range(most + 1)
        ] if most >= 1 else []

    @classmethod
    def of(cls, group: _Group) -> _Summary:
        first = group.devices[0]
        rows = [(d, d.gpu.replicas - d.known_slots, d.budget - d.known_bytes) for d in group.devices]
        used = len(group.unknown) + sum(d.known_slots for d in group.devices)
        unknown_pods = len({uid for uid, _ in group.unknown})
        return cls(rows, group.unknown_prefix(first), used, unknown_pods, first.whole)


class _Query:
    """One pod's claims, prepared once for the many nodes a filter asks about."""

    __slots__ = ("by_resource", "claims", "never", "ours", "pinned", "uid")

    def __init__(self, claims: tuple[Claim, ...], uid: str | None) -> None:
        self.claims = claims
        self.uid = uid
        by_resource: dict[str, list[Claim]] = {}
        for claim in claims:
            by_resource.setdefault(claim.resource, []).append(claim)
        self.by_resource = {r: tuple(c) for r, c in by_resource.items()}
        self.pinned = any(c.gpu is not None for c in claims)
        """Some claim names its device: the general check resolves it per node."""
        self.ours: dict[tuple[str, tuple[int, int]], list[int]] = {}
        self.never: dict[tuple[int, str], _Check] = {}

    def prefix(self, resource: str, device: _Device) -> list[int]:
        """Prefix sums of this pod's claims on ``resource`` on a device like ``device``, largest first."""
        key = (resource, device.size)
        cached = self.ours.get(key)
        if cached is None:
            amounts = sorted((device.claim_bytes(c) for c in self.by_resource[resource]), reverse=True)
            cached = self.ours[key] = [0, *accumulate(amounts)]
        return cached


@dataclass(frozen=True, slots=True)
class ResourceOffer:
    """What a node offers under one GPU resource, for the checks that do not depend on holdings."""

    sharing: frozenset[Sharing]
    sizeless: Gpu | None
    """A device whose memory size is unknown, if any."""


@dataclass(slots=True)
class _Node:
    inventory: NodeInventory
    groups: dict[str, _Group]
    devices: dict[str, _Device]
    generation: int
    offers: dict[str, ResourceOffer] = field(default_factory=dict)
    usage: tuple[int, tuple[DeviceUsage, ...]] | None = None
    """``usage(pods=False)`` at a generation."""


@dataclass(slots=True)
class _Record:
    pod: PodRef
    node: str
    claims: tuple[Claim, ...]
    # What was accounted: (resource, device id or None for unknown placement, claim).
    held: list[tuple[str, str | None, Claim]] = field(default_factory=list)
    # Measured over-use accounted: (device id, bytes beyond the pod's claims there).
    over: list[tuple[str, int]] = field(default_factory=list)


class Ledger:
    """Reservations per device across the cluster; see the module docstring for the rules."""

    def __init__(self, headrooms: Mapping[Sharing, Fraction]) -> None:
        """``headrooms``: the fraction kept free on devices of each sharing strategy."""
        self._headrooms = dict(headrooms)
        self._nodes: dict[str, _Node] = {}
        self._records: dict[str, _Record] = {}
        self._pods_on: dict[str, set[str]] = {}  # node name -> UIDs of pods recorded there
        self._shapes: dict[tuple[tuple[Gpu, int], ...], int] = {}
        # Numbers never reused, so a cached result cannot be read for the wrong node or state.
        self._clock = 0
        # The empty-node check per (kind of node, claims): thousands of nodes share a few kinds.
        self._never: dict[tuple[object, ...], _Check] = {}
        self._query: _Query | None = None
        # (generation, node) of every change, oldest first, so a cache can ask what changed since.
        self._changes: list[tuple[int, str]] = []
        self._changes_from = 0

    # -- nodes ---------------------------------------------------------------------------------

    def set_headrooms(self, headrooms: Mapping[Sharing, Fraction]) -> None:
        """Change the headrooms (a policy reload) and recompute every budget."""
        if dict(headrooms) == self._headrooms:
            return
        self._headrooms = dict(headrooms)
        for node in list(self._nodes.values()):
            self._rebuild(node.inventory)

    def upsert_node(self, inventory: NodeInventory) -> None:
        """Add or update a node; its pods are re-accounted when its devices or reports changed."""
        current = self._nodes.get(inventory.node)
        if current is not None and current.inventory == inventory:
            return
        self._rebuild(inventory)

    def remove_node(self, name: str) -> None:
        """Forget a node; its pods stay recorded and are accounted again if the node returns."""
        if self._nodes.pop(name, None) is not None:
            self._touch(name)
            for uid in self._pods_on.get(name, ()):
                self._records[uid].held.clear()
                self._records[uid].over.clear()

    def inventory(self, name: str) -> NodeInventory | None:
        """The node's inventory, or ``None`` when the ledger does not know the node."""
        node = self._nodes.get(name)
        return node.inventory if node is not None else None

    def generation(self, name: str) -> int | None:
        """A number that changes whenever the node's devices or holdings change (for caching verdicts).

        ``None`` when the node is unknown. Numbers are never reused, even for a node removed and added
        again, so a filter verdict for the same claims stays valid while the generation is the same.
        """
        node = self._nodes.get(name)
        return node.generation if node is not None else None

    def node_names(self) -> list[str]:
        """Every node the ledger knows."""
        return list(self._nodes)

    def offers(self, name: str) -> dict[str, ResourceOffer] | None:
        """Per GPU resource the node offers (in device order): its sharing strategies and a device of
        unknown memory size if any; ``None`` when the node is unknown."""
        node = self._nodes.get(name)
        return node.offers if node is not None else None

    def budget(self, node: str, device_id: str) -> int | None:
        """The budget of one device in bytes, or ``None`` when unknown."""
        state = self._nodes.get(node)
        device = state.devices.get(device_id) if state is not None else None
        return device.budget if device is not None else None

    def _rebuild(self, inventory: NodeInventory) -> None:
        devices: dict[str, _Device] = {}
        by_resource: dict[str, list[_Device]] = {}
        for gpu in inventory.devices:
            device = _Device(gpu, self._headrooms.get(gpu.sharing, Fraction(0)))
            devices[gpu.id] = device
            by_resource.setdefault(gpu.resource, []).append(device)
        groups = {resource: _Group(resource, group, self._shape(group)) for resource, group in by_resource.items()}
        offers = {r: ResourceOffer(g.sharing, g.sizeless) for r, g in groups.items()}
        node = _Node(inventory, groups, devices, 0, offers)
        self._touch(node)
        self._nodes[inventory.node] = node
        for uid in self._pods_on.get(inventory.node, ()):
            record = self._records[uid]
            record.held.clear()
            record.over.clear()
            self._account(node, record)

    def _shape(self, devices: list[_Device]) -> int:
        key = tuple((d.gpu, d.budget) for d in devices)
        shape = self._shapes.get(key)
        if shape is None:
            if len(self._shapes) > _CACHE_LIMIT:
                self._shapes.clear()
                self._never.clear()
            shape = self._shapes[key] = self._tick()
        return shape

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _touch(self, node: _Node | str) -> int:
        """A new generation for a node (a name: the node left), logged for :meth:`changed_since`."""
        tick = self._tick()
        if isinstance(node, _Node):
            node.generation = tick
            name = node.inventory.node
        else:
            name = node
        self._changes.append((tick, name))
        if len(self._changes) > _CACHE_LIMIT:
            drop = len(self._changes) // 2
            self._changes_from = self._changes[drop - 1][0]
            del self._changes[:drop]
        return tick

    @property
    def clock(self) -> int:
        """The latest generation given to any node: :meth:`changed_since` takes it."""
        return self._clock

    def changed_since(self, clock: int) -> set[str] | None:
        """Nodes whose generation changed (or that left) after ``clock``; ``None`` when that is too
        long ago to tell."""
        if clock < self._changes_from:
            return None
        changes = self._changes
        start = bisect_right(changes, (clock, "\uffff"))
        return {name for _, name in changes[start:]}

    # -- pods ----------------------------------------------------------------------------------

    def holding(self, uid: str) -> tuple[PodRef, str, tuple[Claim, ...]] | None:
        """The pod's reference, node and claims, or ``None`` when it holds nothing."""
        record = self._records.get(uid)
        return (record.pod, record.node, record.claims) if record is not None else None

    def pods_on(self, node: str) -> tuple[str, ...]:
        """UIDs of the pods holding reservations on ``node`` (sorted)."""
        return tuple(sorted(self._pods_on.get(node, ())))

    def pod_count(self) -> int:
        """How many pods hold reservations."""
        return len(self._records)

    def fits(self, node: str, claims: Iterable[Claim], uid: str | None = None) -> Fit:
        """Whether ``claims`` fit ``node``, ignoring what pod ``uid`` already holds there.

        A node the ledger does not know fails (resolvably: its inventory may arrive).
        """
        state = self._nodes.get(node)
        if state is None:
            return Fit(False, problems=(f"node {node} is not known to vramguard yet",))
        exclude = self._records.get(uid) if uid is not None else None
        if exclude is not None and exclude.node != node:
            exclude = None
        claims = claims if isinstance(claims, tuple) else tuple(claims)
        fit = self._fast_fit(state, self._prepare(claims, uid)) if exclude is None else None
        if fit is None:
            fit = self._fit(state, claims, uid, exclude)
        if not fit.ok and state.inventory.distrust is not None:
            # The node's agent report was set aside: say so, it is why the rule is so strict here.
            return Fit(False, fit.unresolvable, fit.shortfalls, (*fit.problems, state.inventory.distrust))
        return fit

    def _prepare(self, claims: tuple[Claim, ...], uid: str | None) -> _Query:
        """The query for these claims: the last one when a filter asks the same claims again."""
        query = self._query
        if query is None or query.claims is not claims or query.uid != uid:
            query = self._query = _Query(claims, uid)
        return query

    def reserve(self, node: str, pod: PodRef, claims: Iterable[Claim], *, force: bool = False) -> Fit:
        """Hold ``claims`` for ``pod`` on ``node`` if they fit; idempotent for the same pod.

        A pod that already holds the same claims on the same node is left as it is; different
        claims or another node replace its holding. ``force`` records the pod even when it does not
        fit (or the node is unknown): a pod already bound by someone else is real and must count.
        """
        claims = tuple(claims)
        current = self._records.get(pod.uid)
        if current is not None and current.node == node and current.claims == claims:
            return Fit(True)
        fit = self.fits(node, claims, pod.uid)
        if not fit.ok and not force:
            return fit
        self._hold(node, pod, claims)
        return fit

    def hold(self, node: str, pod: PodRef, claims: Iterable[Claim]) -> None:
        """Record ``claims`` for ``pod`` on ``node`` without checking them: a pod already bound (by
        vramguard or anyone else) is real and must count. Same as ``reserve(force=True)``, minus the
        verdict nobody reads (a re-list of 50,000 pods would compute 50,000 of them)."""
        claims = tuple(claims)
        current = self._records.get(pod.uid)
        if current is not None and current.node == node and current.claims == claims:
            return
        self._hold(node, pod, claims)

    def _hold(self, node: str, pod: PodRef, claims: tuple[Claim, ...]) -> None:
        self.release(pod.uid)
        record = _Record(pod, node, claims)
        self._records[pod.uid] = record
        self._pods_on.setdefault(node, set()).add(pod.uid)
        state = self._nodes.get(node)
        if state is not None:
            self._account(state, record)

    def release(self, uid: str) -> bool:
        """Release everything pod ``uid`` holds; ``False`` when it held nothing."""
        record = self._records.pop(uid, None)
        if record is None:
            return False
        on_node = self._pods_on[record.node]
        on_node.discard(uid)
        if not on_node:
            del self._pods_on[record.node]
        state = self._nodes.get(record.node)
        if state is not None:
            self._unaccount(state, record)
        return True

    def _account(self, node: _Node, record: _Record) -> None:
        uid = record.pod.uid
        self._touch(node)
        for claim, device_id in _resolve(node, uid, record.claims):
            group = node.groups.get(claim.resource)
            if group is None:
                continue  # the node no longer offers it; reported by check_invariants
            if device_id is not None:
                device = node.devices[device_id]
                amount = device.claim_bytes(claim)
                device.known_bytes += amount
                device.known_slots += 1
                device.expected_bytes += amount
                device.expected_slots += 1
            else:
                group.unknown.append((uid, claim))
                group.changed()
                intended = node.devices.get(claim.intended) if claim.intended is not None else None
                if intended is not None and intended.gpu.resource == claim.resource:
                    intended.expected_bytes += intended.claim_bytes(claim)
                    intended.expected_slots += 1
            record.held.append((claim.resource, device_id, claim))
        self._account_use(node, record)

    def _account_use(self, node: _Node, record: _Record) -> None:
        """Count what the agent measured the pod using beyond its claims, device by device."""
        measured = node.inventory.measured.get(record.pod.uid)
        if not measured:
            return
        for device_id, used in measured.items():
            device = node.devices.get(device_id)
            if device is None:
                continue
            claimed = sum(device.claim_bytes(c) for _, d, c in record.held if d == device_id)
            excess = over_use(claimed, used)
            if excess:
                device.known_bytes += excess
                device.expected_bytes += excess
                record.over.append((device_id, excess))

    def _unaccount(self, node: _Node, record: _Record) -> None:
        uid = record.pod.uid
        self._touch(node)
        for over_on, excess in record.over:
            node.devices[over_on].known_bytes -= excess
            node.devices[over_on].expected_bytes -= excess
        record.over.clear()
        for resource, device_id, claim in record.held:
            group = node.groups[resource]
            if device_id is not None:
                device = node.devices[device_id]
                amount = device.claim_bytes(claim)
                device.known_bytes -= amount
                device.known_slots -= 1
                device.expected_bytes -= amount
                device.expected_slots -= 1
                continue
            group.unknown.remove((uid, claim))
            group.changed()
            intended = node.devices.get(claim.intended) if claim.intended is not None else None
            if intended is not None and intended.gpu.resource == resource:
                intended.expected_bytes -= intended.claim_bytes(claim)
                intended.expected_slots -= 1
        record.held.clear()

    # -- the rule ------------------------------------------------------------------------------

    def _fit(self, node: _Node, claims: tuple[Claim, ...], uid: str | None, exclude: _Record | None) -> Fit:
        by_resource: dict[str, list[_Placed]] = {}
        for placed in _resolve(node, uid, claims):
            by_resource.setdefault(placed[0].resource, []).append(placed)
        problems: list[str] = []
        shortfalls: list[Shortfall] = []
        unresolvable = False
        for resource, new in by_resource.items():
            group = node.groups.get(resource)
            if group is None:
                offered = ", ".join(node.groups) or "no GPU resource"
                problems.append(f"node offers no {resource} (it has {offered})")
                unresolvable = True
                continue
            never = self._never_fits(group, new)
            if never[0] or never[1]:
                unresolvable = True
                now = never
            else:
                now = _check_group(group, new, exclude, empty=False)
            problems.extend(now[0])
            shortfalls.extend(now[1])
        ok = not problems and not shortfalls
        return Fit(ok, unresolvable and not ok, tuple(shortfalls), tuple(problems))

    def _fast_fit(self, node: _Node, query: _Query) -> Fit | None:
        """The verdict from the groups' summaries, exactly as :meth:`_fit` gives it, when every claim's
        device is unknown on a multi-device group or is the single device of its group, and each
        group's devices share one size and sharing; ``None`` otherwise (the general check applies)."""
        if query.pinned or (query.uid is not None and query.uid in node.inventory.placements):
            return None
        problems: list[str] = []
        shortfalls: list[Shortfall] = []
        unresolvable = False
        for resource, new in query.by_resource.items():
            group = node.groups.get(resource)
            if group is None:
                offered = ", ".join(node.groups) or "no GPU resource"
                problems.append(f"node offers no {resource} (it has {offered})")
                unresolvable = True
                continue
            summary = group.summary(node.generation)
            single = len(group.devices) == 1
            if summary is None or (single and group.unknown):
                return None
            key = (group.shape, resource)
            never = query.never.get(key)
            if never is None:
                only = group.devices[0].gpu.id if single else None
                never = query.never[key] = self._never_fits(group, [(c, only) for c in new])
            if never[0] or never[1]:
                unresolvable = True
                problems.extend(never[0])
                shortfalls.extend(never[1])
                continue
            ours = query.prefix(resource, group.devices[0])
            count = len(new)
            least = summary.least
            if (
                summary.used + count <= group.slots
                and not summary.overfull
                and (not least or least[0] >= 0)
                and all(ours[j] <= least[j] for j in range(1, min(count, len(least) - 1) + 1))
                and (group.devices[0].gpu.sharing != "mps" or ours[1] <= summary.whole)
            ):
                continue
            now = _check_summary(group, summary, ours, count, single=single)
            problems.extend(now[0])
            shortfalls.extend(now[1])
        if not problems and not shortfalls:
            return _FITS
        return Fit(False, unresolvable, tuple(shortfalls), tuple(problems))

    def _never_fits(self, group: _Group, new: list[_Placed]) -> _Check:
        """The check against the empty node, cached: it depends on the kind of node and the claims."""
        key = (group.shape, *((d, *(c.bytes_on(*size) for size in group.sizes)) for c, d in new))
        cached = self._never.get(key)
        if cached is None:
            if len(self._never) > _CACHE_LIMIT:
                self._never.clear()
            cached = self._never[key] = _check_group(group, new, None, empty=True)
        return cached

    # -- reading -------------------------------------------------------------------------------

    def usage(self, node: str, *, pods: bool = True) -> tuple[DeviceUsage, ...]:
        """Every device of ``node`` with its budget, known, worst-case and expected bytes.

        ``pods=False`` leaves the pod names out, which scoring does not need.
        """
        state = self._nodes.get(node)
        if state is None:
            return ()
        if not pods and state.usage is not None and state.usage[0] == state.generation:
            return state.usage[1]
        names: dict[str, list[str]] = {d: [] for d in state.devices}
        for uid in self._pods_on.get(node, ()) if pods else ():
            record = self._records[uid]
            for _, device_id, claim in record.held:
                where = device_id if device_id is not None else claim.intended
                if where in names and str(record.pod) not in names[where]:
                    names[where].append(str(record.pod))
        rows = []
        for group in state.groups.values():
            for device in group.devices:
                free_slots = max(0, device.gpu.replicas - device.known_slots)
                prefix = group.unknown_prefix(device)
                worst = device.known_bytes + prefix[min(free_slots, len(prefix) - 1)]
                rows.append(DeviceUsage(
                    node, device.gpu, device.budget, device.known_bytes, worst,
                    device.expected_bytes, device.expected_slots, tuple(sorted(names[device.gpu.id])),
                ))
        if not pods:
            state.usage = (state.generation, tuple(rows))
        return tuple(rows)

    def namespace_bytes(self) -> dict[str, int]:
        """Bytes each namespace's pods hold (chargeback): a claim of unknown placement counts at its
        size on the largest device it could be on."""
        totals: dict[str, int] = {}
        for record in self._records.values():
            node = self._nodes.get(record.node)
            if node is None:
                continue
            for resource, device_id, claim in record.held:
                devices = [node.devices[device_id]] if device_id is not None else node.groups[resource].devices
                held = max((d.claim_bytes(claim) for d in devices), default=0)
                totals[record.pod.namespace] = totals.get(record.pod.namespace, 0) + held
        return totals

    def check_invariants(self) -> list[str]:
        """:meth:`invariant_violations`, as messages (for tests and ``plan``)."""
        return [violation.message for violation in self.invariant_violations()]

    def invariant_violations(self) -> list[InvariantViolation]:
        """Every violation of the rule, and every counter that disagrees with a recount."""
        violations: list[InvariantViolation] = []
        for name, node in self._nodes.items():
            for group in node.groups.values():
                used = len(group.unknown) + sum(d.known_slots for d in group.devices)
                if used > group.slots:
                    violations.append(InvariantViolation(
                        Invariant.REPLICAS_HELD, name, group.resource, {"held": used, "replicas": group.slots}
                    ))
                for device in group.devices:
                    violations.extend(_device_violations(name, group, device))
            violations.extend(self._recount(name, node))
        for uid, record in self._records.items():
            state = self._nodes.get(record.node)
            if state is not None and len(record.held) != len(record.claims):
                violations.append(InvariantViolation(Invariant.RESOURCE_MISSING, record.node, f"{record.pod} ({uid})"))
        return violations

    def _recount(self, name: str, node: _Node) -> list[InvariantViolation]:
        known = {d: device.gpu.foreign_bytes for d, device in node.devices.items()}
        slots = dict.fromkeys(node.devices, 0)
        unknown = dict.fromkeys(node.groups, 0)
        for uid in self._pods_on.get(name, ()):
            for over_on, excess in self._records[uid].over:
                known[over_on] += excess
            for resource, device_id, claim in self._records[uid].held:
                if device_id is None:
                    unknown[resource] += 1
                else:
                    known[device_id] += node.devices[device_id].claim_bytes(claim)
                    slots[device_id] += 1
        wrong = [
            InvariantViolation(Invariant.COUNTERS, name, d, {
                "bytes": device.known_bytes, "replicas": device.known_slots,
                "recount_bytes": known[d], "recount_replicas": slots[d],
            })
            for d, device in node.devices.items()
            if (device.known_bytes, device.known_slots) != (known[d], slots[d])
        ]
        wrong += [
            InvariantViolation(Invariant.UNKNOWN_LIST, name, r, {"listed": len(g.unknown), "recount": unknown[r]})
            for r, g in node.groups.items()
            if len(g.unknown) != unknown[r]
        ]
        return wrong


_FITS = Fit(True)


def _check_summary(group: _Group, summary: _Summary, ours: list[int], count: int, *, single: bool) -> _Check:
    """:func:`_check_group` for a pod without holdings on the node, from the group's summary.

    ``single``: the group has one device and the pod's ``count`` claims are known to be on it;
    otherwise none of the pod's claims has a known device. ``ours``: the prefix sums of the pod's
    claims on a device of the group, largest first.
    """
    problems: list[str] = []
    shortfalls: list[Shortfall] = []
    used = summary.used
    if used + count > group.slots:
        free = max(group.slots - used, 0)
        problems.append(f"pod needs {count} {group.resource}, node has {group.slots} ({free} free)")
        return tuple(problems), ()
    theirs = summary.theirs
    last = len(theirs) - 1
    for device, free_slots, room in summary.rows:
        gpu = device.gpu
        slots = free_slots - count if single else free_slots
        if slots < 0:
            problems.append(f"{gpu.label}: all {gpu.replicas} replicas are taken")
            continue
        if not single and not slots:
            continue  # none of the pod's devices can land here
        if gpu.sharing == "mps":
            biggest = ours[1] - ours[0] if count else 0
            if biggest > device.whole:
                problems.append(
                    f"{gpu.label}: pod needs {format_bytes(biggest)} per GPU, more than the "
                    f"{format_bytes(device.whole)} one of its {gpu.replicas} MPS replicas may use"
                )
                continue
        if single:
            rest = theirs[min(slots, last)]
            if ours[count] + rest > room:
                shortfalls.append(
                    Shortfall(gpu, device.budget, room - rest, ours[count], count, summary.unknown_pods)
                )
            continue
        for j in range(min(slots, count) + 1):
            rest = theirs[min(slots - j, last)]
            if ours[j] + rest <= room:
                continue
            if j == 0:
                worst = device.budget - room + rest
                problems.append(
                    f"{gpu.label}: already over its VRAM budget ({format_bytes(worst)} of "
                    f"{format_bytes(device.budget)}, pods bound without vramguard)"
                )
                break
            shortfalls.append(Shortfall(gpu, device.budget, room - rest, ours[j], j, summary.unknown_pods))
            break
    return tuple(problems), tuple(shortfalls)


def _resolve(node: _Node, uid: str | None, claims: Iterable[Claim]) -> list[_Placed]:
    """Each claim with the device it is known to be on, or ``None``.

    Known means: given on the claim, reported by the agent for the container, or the only device
    behind the resource on this node.
    """
    reported = node.inventory.placements.get(uid, {}) if uid is not None else {}
    taken: dict[str, int] = {}
    placed: list[_Placed] = []
    for claim in claims:
        device_id = claim.gpu if claim.gpu in node.devices else None
        ids = reported.get(claim.container) if reported else None
        if device_id is None and ids:
            position = taken.get(claim.container, 0)
            taken[claim.container] = position + 1
            if position < len(ids):
                device_id = ids[position]
        group = node.groups.get(claim.resource)
        if device_id is None and group is not None and len(group.devices) == 1:
            device_id = group.devices[0].gpu.id
        if device_id is not None and node.devices[device_id].gpu.resource != claim.resource:
            device_id = None
        placed.append((claim, device_id))
    return placed


def _device_violations(node: str, group: _Group, device: _Device) -> list[InvariantViolation]:
    found = []
    free_slots = device.gpu.replicas - device.known_slots
    if free_slots < 0:
        numbers = {"claims": device.known_slots, "replicas": device.gpu.replicas}
        found.append(InvariantViolation(Invariant.KNOWN_CLAIMS, node, device.gpu.label, numbers))
    prefix = group.unknown_prefix(device)
    worst = device.known_bytes + prefix[max(0, min(free_slots, len(prefix) - 1))]
    if worst > device.budget:
        found.append(InvariantViolation(
            Invariant.OVER_BUDGET, node, device.gpu.label, {"worst": worst, "budget": device.budget}
        ))
    if device.gpu.sharing == "mps":
        over = [c for _, c in group.unknown if device.claim_bytes(c) > device.whole]
        if over:
            found.append(InvariantViolation(Invariant.MPS_SHARE, node, device.gpu.label, {"claims": len(over)}))
    return found


def _check_group(group: _Group, new: list[_Placed], exclude: _Record | None, *, empty: bool) -> _Check:
    """Problems and shortfalls of adding ``new`` to ``group`` (``empty``: as if nobody held anything).

    ``exclude``'s holdings are left out, so a pod being re-checked does not compete with itself.
    """
    problems: list[str] = []
    shortfalls: list[Shortfall] = []
    new_known: dict[str, list[Claim]] = {}
    new_unknown: list[Claim] = []
    for claim, device_id in new:
        if device_id is not None:
            new_known.setdefault(device_id, []).append(claim)
        else:
            new_unknown.append(claim)

    # Holdings of the pod being re-checked, to subtract from the counters.
    own_known: dict[str, tuple[int, int]] = {}
    if exclude is not None and not empty:
        devices = {d.gpu.id: d for d in group.devices}
        for resource, device_id, claim in exclude.held:
            if resource == group.resource and device_id is not None:
                before = own_known.get(device_id, (0, 0))
                own_known[device_id] = (before[0] + devices[device_id].claim_bytes(claim), before[1] + 1)
        for device_id, excess in exclude.over:
            if device_id in devices:
                before = own_known.get(device_id, (0, 0))
                own_known[device_id] = (before[0] + excess, before[1])
    if empty:
        others: list[tuple[str, Claim]] = []
        used_slots = 0
    else:
        others = group.unknown if exclude is None else [e for e in group.unknown if e[0] != exclude.pod.uid]
        used_slots = len(others) + sum(d.known_slots for d in group.devices) - sum(
            slots for _, slots in own_known.values()
        )
    if used_slots + len(new) > group.slots:
        free = max(group.slots - used_slots, 0)
        problems.append(f"pod needs {len(new)} {group.resource}, node has {group.slots} ({free} free)")
        return tuple(problems), ()

    ours_by_size: dict[tuple[int, int], list[int]] = {}
    for device in group.devices:
        gpu = device.gpu
        own_bytes, own_slots = own_known.get(gpu.id, (0, 0))
        known_bytes = gpu.foreign_bytes if empty else device.known_bytes - own_bytes
        known_slots = 0 if empty else device.known_slots - own_slots
        mine = new_known.get(gpu.id, ())
        mine_bytes = sum(device.claim_bytes(c) for c in mine)
        slots = gpu.replicas - known_slots - len(mine)
        if slots < 0:
            problems.append(f"{gpu.label}: all {gpu.replicas} replicas are taken")
            continue
        if not mine and not (slots and new_unknown):
            continue  # none of the pod's devices can land here
        if gpu.sharing == "mps":
            biggest = max(device.claim_bytes(c) for c in [*mine, *new_unknown])
            if biggest > device.whole:
                problems.append(
                    f"{gpu.label}: pod needs {format_bytes(biggest)} per GPU, more than the "
                    f"{format_bytes(device.whole)} one of its {gpu.replicas} MPS replicas may use"
                )
                continue
        if empty or exclude is not None:
            theirs = [0, *accumulate(sorted((device.claim_bytes(c) for _, c in others), reverse=True))]
        else:
            theirs = group.unknown_prefix(device)
        ours = ours_by_size.get(device.size)
        if ours is None:
            amounts = sorted((device.claim_bytes(c) for c in new_unknown), reverse=True)
            ours = ours_by_size[device.size] = [0, *accumulate(amounts)]
        # The worst case puts j of the pod's unknown claims and the largest (slots - j) of the others'
        # on this device; the top `slots` of the union is the largest of these sums.
        for j in range(min(slots, len(new_unknown)) + 1):
            rest = theirs[min(slots - j, len(theirs) - 1)]
            if known_bytes + mine_bytes + ours[j] + rest <= device.budget:
                continue
            if j == 0 and not mine:
                # Over budget before this pod: only pods bound without vramguard can do that.
                worst = known_bytes + rest
                problems.append(
                    f"{gpu.label}: already over its VRAM budget ({format_bytes(worst)} of "
                    f"{format_bytes(device.budget)}, pods bound without vramguard)"
                )
                break
            shortfalls.append(Shortfall(
                gpu, device.budget, device.budget - known_bytes - rest, mine_bytes + ours[j],
                len(mine) + j, len({uid for uid, _ in others}),
            ))
            break
    return tuple(problems), tuple(shortfalls)
