"""Who holds how many bytes on every GPU device of the cluster: the counters the rule reads.

The rule itself (budgets, claims, unknown placement, measured use) is stated in
:mod:`vramguard.ledger_rule`; the caches that make it cheap for the extender's cluster state (5,000
nodes, 50,000 pods) are all in :mod:`vramguard.ledger_fast`, with their invalidation. This module
keeps per device the known bytes and slots, per resource of a node the claims whose device is
unknown, and checks pods against the rule: :func:`_check_group` is the general check, and the fast
verdict must equal it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from enum import StrEnum
from fractions import Fraction

from vramguard.inventory import Gpu, NodeInventory, Sharing
from vramguard.ledger_fast import BoundIndex, FastPath, GroupCache, Query, largest_first, too_few_replicas
from vramguard.ledger_fast import Check as _Check
from vramguard.ledger_fast import Placed as _Placed
from vramguard.ledger_rule import (
    FITS,
    MEASURED_TOLERANCE_BYTES,
    BudgetRule,
    Claim,
    Fit,
    PodRef,
    Shortfall,
    budget_of,
    over_budget_cause,
    over_use,
    whole_share,
    worst_case,
)
from vramguard.quantity import format_bytes

__all__ = [
    "MEASURED_TOLERANCE_BYTES",
    "BoundSplit",
    "Claim",
    "DeviceUsage",
    "Fit",
    "Invariant",
    "InvariantViolation",
    "Ledger",
    "PodRef",
    "ResourceOffer",
    "Shortfall",
    "over_use",
]


_NO_PODS: AbstractSet[str] = frozenset()


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

    @property
    def over_budget(self) -> bool:
        """Whether it may hold more than its budget; never for a device whose memory nobody knows
        (pods placed there, where the namespace does not enforce, are unguarded, not overcommitted)."""
        return self.device.memory_bytes > 0 and self.worst_bytes > self.budget


class _Device:
    __slots__ = ("budget", "expected_bytes", "expected_slots", "gpu", "known_bytes", "known_slots", "whole")

    def __init__(self, gpu: Gpu, margin: Fraction) -> None:
        self.gpu = gpu
        self.budget = budget_of(gpu, margin)
        self.whole = whole_share(gpu, self.budget)
        self.known_bytes = gpu.foreign_bytes
        self.known_slots = 0
        self.expected_bytes = gpu.foreign_bytes
        self.expected_slots = 0

    def claim_bytes(self, claim: Claim) -> int:
        return claim.bytes_on(self.gpu.memory_bytes, self.whole, self.gpu.product)

    @property
    def size(self) -> tuple[int, int, str]:
        return self.gpu.memory_bytes, self.whole, self.gpu.product


class _Group:
    """The devices behind one resource on one node, and the claims whose device is unknown."""

    __slots__ = ("cache", "devices", "resource", "shape", "sharing", "sizes", "slots", "unknown")

    def __init__(self, resource: str, devices: list[_Device], shape: int) -> None:
        self.resource = resource
        self.devices = devices
        self.shape = shape
        """Identifies the devices and budgets: the empty-node check depends on nothing else."""
        self.sizes = tuple(dict.fromkeys(d.size for d in devices))
        self.slots = sum(d.gpu.replicas for d in devices)
        self.sharing = frozenset(d.gpu.sharing for d in devices)
        self.unknown: list[tuple[str, Claim]] = []
        self.cache = GroupCache()

    def unknown_prefix(self, device: _Device) -> list[int]:
        """Prefix sums of the unknown claims' bytes on ``device``, largest first."""
        return self.cache.prefix(device, self.unknown)

    def worst_case(self, device: _Device) -> int:
        """What ``device`` may hold whatever the device plugin picks (the rule's left-hand side)."""
        return worst_case(device.known_bytes, device.gpu.replicas - device.known_slots, self.unknown_prefix(device))


@dataclass(frozen=True, slots=True)
class ResourceOffer:
    """What one node, or the whole cluster, offers under one GPU resource: device sizes, sharing, and
    which nodes; for the checks that do not depend on holdings."""

    smallest_bytes: int
    """Memory of the smallest device of known size (0: no size known)."""
    largest_bytes: int
    largest_whole_bytes: int
    """The most a claim of unknown VRAM holds on one device: the device, or one MPS replica's share."""
    sharing: frozenset[Sharing] = frozenset()
    node_labels: tuple[Mapping[str, str], ...] = ()
    """Labels of each node offering the resource (for a DaemonSet's ``nodeSelector``)."""
    sizeless: Gpu | None = None
    """A device whose memory size is unknown, if any."""

    @classmethod
    def of(cls, gpus: Iterable[Gpu], node_labels: tuple[Mapping[str, str], ...] = ()) -> ResourceOffer:
        """The offer of ``gpus`` (one resource's devices, of one node or many)."""
        gpus = tuple(gpus)
        sized = [g for g in gpus if g.memory_bytes > 0]
        return cls(
            smallest_bytes=min((g.memory_bytes for g in sized), default=0),
            largest_bytes=max((g.memory_bytes for g in sized), default=0),
            largest_whole_bytes=max((whole_share(g, g.memory_bytes) for g in sized), default=0),
            sharing=frozenset(g.sharing for g in gpus),
            node_labels=node_labels,
            sizeless=next((g for g in gpus if g.memory_bytes == 0), None),
        )

    @property
    def sized(self) -> bool:
        """Whether any device offering the resource has a known memory size."""
        return self.largest_bytes > 0


@dataclass(frozen=True, slots=True)
class QuickRefusal:
    """Why a pod fails a node, from the node's bound (:meth:`Ledger.quick_refusal`)."""

    device: Gpu
    """The device with the least room for one more claim."""
    budget: int
    room: int
    """What is left of its budget for one more claim, in the worst case."""
    need: int
    """The pod's largest claim on such a device."""
    unknown_pods: int
    """Pods counted whose claims' device is not known yet."""
    distrust: str | None
    """Why the node's agent report was set aside, if it was."""


@dataclass(slots=True)
class BoundSplit:
    """The nodes of one kind, split by their bound for a pod (:meth:`Ledger.split_by_bound`)."""

    resource: str
    kind: tuple[int, ...]
    example: str
    """One of the nodes (what depends on the kind alone is asked of it)."""
    device: Gpu
    """A device of the kind (they share product, size and budget)."""
    budget: int
    need: int
    """The pod's largest claim on such a device."""
    slots: int
    """Replicas of the resource on a node of the kind."""
    passing: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    """Refused by the bound: a device the device plugin may pick has less room than ``need``."""
    refused_counting: list[str] = field(default_factory=list)
    """Refused likewise, counting claims of other pods whose device is not known yet."""
    unresolvable: list[str] = field(default_factory=list)
    """The pod fails the kind even empty: every node of it shares one verdict."""
    short: dict[int, list[str]] = field(default_factory=dict)
    """Fewer replicas left than the pod has claims (failing, resolvably), per replicas left."""
    stacked: list[str] = field(default_factory=list)
    """Room for each claim, but not for some of them given the same device (``Summary.least``):
    failing, resolvably, in every case the device plugin may pick."""
    stacked_counting: list[str] = field(default_factory=list)
    """Failing likewise, counting claims of other pods whose device is not known yet."""
    undecided: list[str] = field(default_factory=list)
    """Above the bound but not passed by the summary alone: judged one by one."""


@dataclass(slots=True)
class _Node:
    inventory: NodeInventory
    groups: dict[str, _Group]
    devices: dict[str, _Device]
    generation: int
    offers: dict[str, ResourceOffer] = field(default_factory=dict)
    kind: tuple[int, ...] = ()
    """The shapes of its groups, in order: nodes of one kind make the same offers."""


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

    def __init__(self, rule: BudgetRule | Mapping[Sharing, Fraction]) -> None:
        """``rule``: the margin each device keeps free (margins by sharing strategy apply to all devices)."""
        self._rule = BudgetRule.of(rule)
        self._nodes: dict[str, _Node] = {}
        self._records: dict[str, _Record] = {}
        self._pods_on: dict[str, set[str]] = {}  # node name -> UIDs of pods recorded there
        # Every cache, and the generation clock (see vramguard.ledger_fast).
        self._fast = FastPath(lambda group, new: _check_group(group, new, None, empty=True))
        self._index = BoundIndex()

    # -- nodes ---------------------------------------------------------------------------------

    def set_budget_rule(self, rule: BudgetRule | Mapping[Sharing, Fraction]) -> None:
        """Change the margins (a policy reload) and recompute every budget."""
        rule = BudgetRule.of(rule)
        if rule == self._rule:
            return
        self._rule = rule
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
            self._fast.touch(name)
            self._fast.forget(name)
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

    def offer_kind(self, name: str) -> tuple[int, ...] | None:
        """A key equal for nodes whose :meth:`offers` are equal (their devices and budgets match)."""
        node = self._nodes.get(name)
        return node.kind if node is not None else None

    def budget(self, node: str, device_id: str) -> int | None:
        """The budget of one device in bytes, or ``None`` when unknown."""
        state = self._nodes.get(node)
        device = state.devices.get(device_id) if state is not None else None
        return device.budget if device is not None else None

    def _rebuild(self, inventory: NodeInventory) -> None:
        devices: dict[str, _Device] = {}
        by_resource: dict[str, list[_Device]] = {}
        for gpu in inventory.devices:
            device = _Device(gpu, self._rule.margin(gpu))
            devices[gpu.id] = device
            by_resource.setdefault(gpu.resource, []).append(device)
        groups = {resource: _Group(resource, group, self._shape(group)) for resource, group in by_resource.items()}
        offers = {r: ResourceOffer.of(d.gpu for d in g.devices) for r, g in groups.items()}
        node = _Node(inventory, groups, devices, 0, offers, tuple(g.shape for g in groups.values()))
        self._touch(node)
        self._nodes[inventory.node] = node
        for uid in self._pods_on.get(inventory.node, ()):
            record = self._records[uid]
            record.held.clear()
            record.over.clear()
            self._account(node, record)

    def _shape(self, devices: list[_Device]) -> int:
        return self._fast.shape(tuple((d.gpu, d.budget) for d in devices))

    def _touch(self, node: _Node) -> None:
        """A new generation for a node whose devices or holdings change."""
        node.generation = self._fast.touch(node.inventory.node)

    @property
    def clock(self) -> int:
        """The latest generation given to any node: :meth:`changed_since` takes it."""
        return self._fast.clock

    def changed_since(self, clock: int) -> set[str] | None:
        """Nodes whose generation changed (or that left) after ``clock``; ``None`` when that is too
        long ago to tell."""
        return self._fast.changed_since(clock)

    # -- pods ----------------------------------------------------------------------------------

    def holding(self, uid: str) -> tuple[PodRef, str, tuple[Claim, ...]] | None:
        """The pod's reference, node and claims, or ``None`` when it holds nothing."""
        record = self._records.get(uid)
        return (record.pod, record.node, record.claims) if record is not None else None

    def pods_on(self, node: str) -> tuple[str, ...]:
        """UIDs of the pods holding reservations on ``node`` (sorted)."""
        return tuple(sorted(self._pods_on.get(node, ())))

    def holds_on(self, node: str) -> AbstractSet[str]:
        """UIDs of the pods holding reservations on ``node``, unsorted (read only: the ledger's own
        set; for checks run on every failing node of a filter)."""
        return self._pods_on.get(node, _NO_PODS)

    def holds(self, uid: str) -> bool:
        """Whether pod ``uid`` holds a reservation."""
        return uid in self._records

    def pod_count(self) -> int:
        """How many pods hold reservations."""
        return len(self._records)

    def fits(self, node: str, claims: Iterable[Claim], uid: str | None = None) -> Fit:
        """Whether ``claims`` fit ``node``, ignoring what pod ``uid`` already holds there.

        A node the ledger does not know fails (resolvably: its inventory may arrive).
        """
        verdict = self._judge(node, claims if isinstance(claims, tuple) else tuple(claims), uid, quick=False)
        assert isinstance(verdict, Fit)  # without ``quick`` the full check always answers
        return verdict

    def judge(self, node: str, claims: tuple[Claim, ...], uid: str | None = None) -> Fit | QuickRefusal:
        """:meth:`fits`, or a :class:`QuickRefusal` where the node's bound already refuses the claims
        (one comparison instead of the full check; the same verdict, property-tested)."""
        return self._judge(node, claims, uid, quick=True)

    def quick_refusal(self, node: str, claims: tuple[Claim, ...], uid: str | None = None) -> QuickRefusal | None:
        """A resolvable failure decided from the node's bound alone: one of the pod's claims is
        bigger than the room some device the device plugin may pick has left. ``None``: ask
        :meth:`fits` (the node may fit, or fails in a way the full check words). Never a refusal
        :meth:`fits` would not give."""
        state = self._nodes.get(node)
        record = self._records.get(uid) if uid is not None else None
        if state is None or (record is not None and record.node == node):
            return None  # unknown, or its own holding is left out: the full check
        return self._refusal(state, self._fast.prepare(claims, uid))

    def _refusal(self, state: _Node, query: Query) -> QuickRefusal | None:
        hit = self._fast.refusal(state, query)
        if hit is None:
            return None
        device, room, need, unknown_pods = hit
        return QuickRefusal(device.gpu, device.budget, room, need, unknown_pods, state.inventory.distrust)

    def _judge(self, node: str, claims: tuple[Claim, ...], uid: str | None, *, quick: bool) -> Fit | QuickRefusal:
        state = self._nodes.get(node)
        if state is None:
            return Fit(False, problems=(f"node {node} is not known to vramguard yet",))
        exclude = self._records.get(uid) if uid is not None else None
        if exclude is not None and exclude.node != node:
            exclude = None
        fit = None
        if exclude is None:
            query = self._fast.prepare(claims, uid)
            refusal = self._refusal(state, query) if quick else None
            if refusal is not None:
                return refusal
            fit = self._fast.fit(state, query)
        if fit is None:
            fit = self._fit(state, claims, uid, exclude)
        if not fit.ok and state.inventory.distrust is not None:
            # The node's agent report was set aside: say so, it is why the rule is so strict here.
            return Fit(False, fit.unresolvable, fit.shortfalls, (*fit.problems, state.inventory.distrust))
        return fit

    def warm(self) -> None:
        """Compute every node's summaries and bounds, and sort the nodes by them, now (after a
        sync), so the first filter finds them ready instead of building 5,000 of them."""
        self._index.refresh(self._fast, self._nodes)

    def split_by_bound(
        self, nodes: Iterable[str], claims: tuple[Claim, ...], uid: str | None = None
    ) -> tuple[list[BoundSplit], list[str]] | None:
        """``nodes`` split by the bound index: per kind of node, those that :meth:`judge` would
        refuse on their bound, those it would pass, those whose kind the pod fails even empty, and
        those it must judge one by one; then the nodes outside the index (also judged one by one).
        ``None``: the index does not serve these claims (more than one resource, or claims naming
        their device).

        The same verdicts as :meth:`judge` (property-tested), found with one bisection per kind.
        """
        query = self._fast.prepare(claims, uid)
        if query.pinned or len(query.by_resource) != 1:
            return None
        self._index.refresh(self._fast, self._nodes)
        ((resource, mine),) = query.by_resource.items()
        asked = set(nodes)
        record = self._records.get(uid) if uid is not None else None
        own = record.node if record is not None and record.node in asked else None
        if own is not None:
            asked.discard(own)  # its own holding is left out there: judged one by one
        splits: list[BoundSplit] = []
        decided: set[str] = set()
        count = len(mine)
        for bucket, entries in self._index.select(resource, asked):
            node, kind, details = bucket.node, bucket.kind, bucket.details
            device = node.groups[resource].devices[0]
            ours = query.prefix(resource, device)
            need = ours[1]
            cut = bisect_left(entries, (need, ""))
            refused = [name for _, name in entries[:cut]]
            fitting = [name for _, name in entries[cut:]]
            decided.update(refused)
            decided.update(fitting)
            unresolvable = query.unresolvable.get(kind)
            if unresolvable is None:
                unresolvable = query.unresolvable[kind] = self._fast.unresolvable(node, query)
            slots = node.groups[resource].slots
            split = BoundSplit(resource, kind, entries[0][1], device.gpu, device.budget, need, slots)
            splits.append(split)
            if unresolvable:
                split.unresolvable.extend(refused)
                split.unresolvable.extend(fitting)
                continue
            split.refused = [name for name in refused if not details[name][3]]
            split.refused_counting = [name for name in refused if details[name][3]]
            if count == 1 and (device.gpu.sharing != "mps" or need <= device.whole):
                # One claim within the room the bound leaves: the summary's verdict needs only a
                # free replica and no device over its budget.
                split.passing = [name for name in fitting if (detail := details[name])[0] and detail[1] >= 1]
                split.undecided = [name for name in fitting if not details[name][0] and details[name][1] >= 1]
                fitting = [name for name in fitting if details[name][1] < 1]
            mps_ok = device.gpu.sharing != "mps" or need <= device.whole
            for name in fitting:
                clean, free, least, _ = details[name]
                if free < count:
                    # Fewer replicas left than claims: the summary's verdict whatever the bytes.
                    split.short.setdefault(max(free, 0), []).append(name)
                elif clean and mps_ok:
                    # The summary's verdict: each j of the pod's claims fit the least room for j, or
                    # some j do not, on a device the device plugin may give them all (it fails there).
                    if all(ours[j] <= least[j] for j in range(2, min(count, len(least) - 1) + 1)):
                        split.passing.append(name)
                    else:
                        (split.stacked_counting if details[name][3] else split.stacked).append(name)
                else:
                    split.undecided.append(name)
        left = asked.difference(decided)
        if own is not None:
            left.add(own)
        return splits, [name for name in nodes if name in left] if left else []

    def reserve(self, node: str, pod: PodRef, claims: Iterable[Claim], *, force: bool = False) -> Fit:
        """Hold ``claims`` for ``pod`` on ``node`` if they fit; idempotent for the same pod.

        A pod that already holds the same claims on the same node is left as it is; different
        claims or another node replace its holding. ``force`` records the pod even when it does not
        fit (or the node is unknown): a pod already bound by someone else is real and must count.
        """
        claims = tuple(claims)
        current = self._records.get(pod.uid)
        if current is not None and current.node == node and current.claims == claims:
            return FITS
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
                group.cache.changed()
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
            group.cache.changed()
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
            never = self._fast.never_fits(group, new)
            if never[0] or never[1]:
                unresolvable = True
                now = never
            else:
                now = _check_group(group, new, exclude, empty=False)
            problems.extend(now[0])
            shortfalls.extend(now[1])
        ok = not problems and not shortfalls
        return Fit(ok, unresolvable and not ok, tuple(shortfalls), tuple(problems))

    # -- reading -------------------------------------------------------------------------------

    def usage(self, node: str, *, pods: bool = True) -> tuple[DeviceUsage, ...]:
        """Every device of ``node`` with its budget, known, worst-case and expected bytes.

        ``pods=False`` leaves the pod names out, which scoring does not need.
        """
        state = self._nodes.get(node)
        if state is None:
            return ()
        cached = self._fast.usage(node, state.generation) if not pods else None
        if cached is not None:
            return cached
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
                rows.append(DeviceUsage(
                    node, device.gpu, device.budget, device.known_bytes, group.worst_case(device),
                    device.expected_bytes, device.expected_slots, tuple(sorted(names[device.gpu.id])),
                ))
        if not pods:
            self._fast.keep_usage(node, state.generation, tuple(rows))
        return tuple(rows)

    def namespace_bytes(self, nodes: Iterable[str] | None = None) -> dict[str, int]:
        """Bytes each namespace's pods hold (chargeback): a claim of unknown placement counts at its
        size on the largest device it could be on. ``nodes`` limits the count to pods on those nodes
        (to add it up a slice of nodes at a time)."""
        totals: dict[str, int] = {}
        records = (self._records.values() if nodes is None
                   else (self._records[uid] for name in nodes for uid in self._pods_on.get(name, ())))
        for record in records:
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
    worst = group.worst_case(device)
    if worst > device.budget and device.gpu.memory_bytes > 0:  # a device of unknown memory has no budget to pass
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
        problems.append(too_few_replicas(len(new), group.resource, group.slots, used_slots))
        return tuple(problems), ()

    ours_by_size: dict[tuple[int, int, str], list[int]] = {}
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
            theirs = largest_first([device.claim_bytes(c) for _, c in others])
        else:
            theirs = group.unknown_prefix(device)
        ours = ours_by_size.get(device.size)
        if ours is None:
            amounts = sorted((device.claim_bytes(c) for c in new_unknown), reverse=True)
            ours = ours_by_size[device.size] = largest_first(amounts)
        # The worst case puts j of the pod's unknown claims and the largest (slots - j) of the others'
        # on this device; the top `slots` of the union is the largest of these sums.
        for j in range(min(slots, len(new_unknown)) + 1):
            if worst_case(known_bytes + mine_bytes + ours[j], slots - j, theirs) <= device.budget:
                continue
            rest = worst_case(0, slots - j, theirs)
            if j == 0 and not mine:
                # Over budget before this pod: only pods bound without vramguard can do that.
                worst = known_bytes + rest
                problems.append(
                    f"{gpu.label}: already over its VRAM budget ({format_bytes(worst)} of "
                    f"{format_bytes(device.budget)}, {over_budget_cause(gpu)})"
                )
                break
            shortfalls.append(Shortfall(
                gpu, device.budget, device.budget - known_bytes - rest, mine_bytes + ours[j],
                len(mine) + j, len({uid for uid, _ in others}),
            ))
            break
    return tuple(problems), tuple(shortfalls)
