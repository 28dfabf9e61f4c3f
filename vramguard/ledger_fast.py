"""The ledger's fast path: every cache the ledger keeps, what each is keyed by, and what clears it.

The rule (:mod:`vramguard.ledger_rule`) is checked by :meth:`vramguard.ledger.Ledger.fits`; with
5,000 nodes and 50,000 pods a filter asks one pod's claims of thousands of nodes, so the answers
below are remembered. None of them changes a verdict: the differential tests compare the fast
verdict with the general check, problem for problem and byte for byte.

The caches, and their invalidation:

=========================  ==============================  ==========================================
Cache                      Keyed by                        Invalid when
=========================  ==============================  ==========================================
``GroupCache.prefix``      device size (memory, whole,     the group's unknown claims change
                           product: allowances differ)     (:meth:`GroupCache.changed`, from the
                                                           ledger's accounting)
``GroupCache.summary``     the node's generation           the generation moves (every change to the
                                                           node's devices or holdings gives a new one)
``FastPath.usage``         node name, at a generation      the generation moves; dropped with the node
``FastPath.never``         kind of node (shape) + claims   never (a shape is a node kind and its
                           bytes                           budgets); cleared with ``shapes``
``FastPath.shapes``        devices and budgets             never; both bounded by :data:`CACHE_LIMIT`
``FastPath.query``         the claims tuple (identity)     other claims or another pod asks
                           and pod UID
``Query.ours``/``never``   resource and device size /      lives as long as its query
                           shape
``Claim._last``            device size                     the last size only (a filter asks one
                                                           claim of one size of device, mostly)
``FastPath.bounds``        node name, at a generation      the generation moves; dropped with the node
=========================  ==============================  ==========================================

**Generations and the change clock.** Every change to a node's devices or holdings gives the node
a new generation from one clock (:meth:`FastPath.touch`): numbers are never reused, even for a node
removed and added again, so a verdict cached under a generation (here, or in the extender) stays
valid exactly while the generation holds. The clock's log answers "which nodes changed since
``clock``" (:meth:`FastPath.changed_since`) for callers that keep whole filter outcomes.

**The summary.** A resource of a node whose devices share one size and sharing strategy is summed
up per generation (:class:`Summary`): the least room left for ``j`` more claims on any device that
can take them, so the common verdict is a handful of integer comparisons, and a failure's numbers
come from the same rows (:func:`check_summary`). Anything else (claims naming their device, a pod
re-checked against its own holding, reported placements, mixed devices) takes the general check.

**The bound.** From the summary, per resource: the least room any device that can take one more
claim has for it (``least[1]``), and which device that is (:meth:`FastPath.bound`). A pod whose
largest claim is bigger cannot fit whatever the device plugin picks, so a filter refuses the node
on that one comparison (:meth:`FastPath.refusal`) instead of the whole check and its message; the
property tests compare that refusal with the full verdict.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Hashable
from itertools import accumulate
from typing import TYPE_CHECKING

from vramguard.ledger_rule import FITS, Claim, Fit, Shortfall, over_budget_cause
from vramguard.quantity import format_bytes

if TYPE_CHECKING:
    from vramguard.ledger import DeviceUsage, _Device, _Group, _Node

CACHE_LIMIT = 1 << 16
"""The most entries a cache without natural bound (shapes, empty-node checks, change log) keeps."""

Check = tuple[tuple[str, ...], tuple[Shortfall, ...]]
"""Problems and shortfalls of adding claims to one resource of a node."""
Placed = tuple[Claim, str | None]
"""A claim and the device it is known to be on (``None``: the device plugin's choice, unknown)."""
Bound = tuple[tuple[str, "_Device", int, int], ...]
"""Per resource the summary decides: (resource, the device with least room for one more claim,
that room, pods whose claims there are of unknown device)."""


def largest_first(amounts: list[int]) -> list[int]:
    """Prefix sums of ``amounts``, largest first: ``[0, a1, a1 + a2, ...]``."""
    return [0, *accumulate(sorted(amounts, reverse=True))]


class GroupCache:
    """The caches of one resource of one node: the unknown claims' prefix sums and the summary."""

    __slots__ = ("_prefix", "_summary")

    def __init__(self) -> None:
        self._prefix: dict[tuple[int, int, str], list[int]] = {}
        self._summary: tuple[int, Summary | None] | None = None

    def prefix(self, device: _Device, unknown: list[tuple[str, Claim]]) -> list[int]:
        """Prefix sums of the unknown claims' bytes on ``device``, largest first."""
        cached = self._prefix.get(device.size)
        if cached is None:
            cached = self._prefix[device.size] = largest_first([device.claim_bytes(c) for _, c in unknown])
        return cached

    def changed(self) -> None:
        """The group's unknown claims changed: the prefix sums are stale (the summary follows the
        node's generation, which the same change moves)."""
        self._prefix.clear()

    def summary(self, group: _Group, generation: int) -> Summary | None:
        """The group's summary at the node's ``generation``; ``None`` when its devices differ in size
        or sharing (the general check applies)."""
        cached = self._summary
        if cached is not None and cached[0] == generation:
            return cached[1]
        summary = Summary.of(group) if len(group.sizes) == 1 and len(group.sharing) == 1 else None
        self._summary = (generation, summary)
        return summary


class Summary:
    """One resource of one node, as the fast check needs it (devices of one size and sharing).

    ``rows``: per device, its free replica slots ``s`` (replicas minus known claims) and its budget
    left after known claims. ``least[j]``: the least room any device that can take ``j`` more claims
    (``s >= max(j, 1)``) has for them in the worst case, after the largest ``s - j`` unknown claims
    of other pods: ``budget - worst_case(known, s - j, theirs)``. A pod whose ``j`` largest claims fit
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
        # worst_case(0, s - j, theirs), inlined: this is built once per node change, for every row and j.
        last = len(theirs) - 1
        most = max((s for _, s, _ in rows), default=0)
        self.least = [
            min(room - theirs[min(s - j, last)] for _, s, room in rows if s >= max(j, 1)) for j in range(most + 1)
        ] if most >= 1 else []

    @classmethod
    def of(cls, group: _Group) -> Summary:
        """The summary of ``group`` as its counters are now."""
        first = group.devices[0]
        rows = [(d, d.gpu.replicas - d.known_slots, d.budget - d.known_bytes) for d in group.devices]
        used = len(group.unknown) + sum(d.known_slots for d in group.devices)
        unknown_pods = len({uid for uid, _ in group.unknown})
        return cls(rows, group.unknown_prefix(first), used, unknown_pods, first.whole)


class Query:
    """One pod's claims, prepared once for the many nodes a filter asks about."""

    __slots__ = ("by_resource", "claims", "empty_fits", "never", "ours", "pinned", "uid", "unresolvable")

    def __init__(self, claims: tuple[Claim, ...], uid: str | None) -> None:
        self.claims = claims
        self.uid = uid
        by_resource: dict[str, list[Claim]] = {}
        for claim in claims:
            by_resource.setdefault(claim.resource, []).append(claim)
        self.by_resource = {r: tuple(c) for r, c in by_resource.items()}
        self.pinned = any(c.gpu is not None for c in claims)
        """Some claim names its device: the general check resolves it per node."""
        self.ours: dict[tuple[str, tuple[int, int, str]], list[int]] = {}
        self.never: dict[tuple[int, str], Check] = {}
        self.unresolvable: dict[tuple[int, ...], bool] = {}
        """Per kind of node (its groups' shapes): whether the pod fails it empty."""
        self.empty_fits: dict[tuple[int, ...], Fit] = {}
        """Per kind of node, the verdict when every resource fails empty (or is missing): it
        depends on nothing else, so nodes of that kind share one verdict and one message."""

    def prefix(self, resource: str, device: _Device) -> list[int]:
        """Prefix sums of this pod's claims on ``resource`` on a device like ``device``, largest first."""
        key = (resource, device.size)
        cached = self.ours.get(key)
        if cached is None:
            cached = self.ours[key] = largest_first([device.claim_bytes(c) for c in self.by_resource[resource]])
        return cached


class FastPath:
    """The ledger-wide caches: the generation clock and its log, node kinds, empty-node checks, the
    last query and the usage rows per node. ``empty_check`` is the general check against an empty
    node, whose answers :meth:`never_fits` remembers."""

    def __init__(self, empty_check: Callable[[_Group, list[Placed]], Check]) -> None:
        self._empty_check = empty_check
        self.clock = 0
        """The latest number handed out; generations and shapes come from it, so none is reused."""
        # (generation, node) of every change, oldest first, so a cache can ask what changed since.
        self._changes: list[tuple[int, str]] = []
        self._changes_from = 0
        self._shapes: dict[Hashable, int] = {}
        # The empty-node check per (kind of node, claims): thousands of nodes share a few kinds.
        self._never: dict[tuple[object, ...], Check] = {}
        self._query: Query | None = None
        self._usage: dict[str, tuple[int, tuple[DeviceUsage, ...]]] = {}
        self._bounds: dict[str, tuple[int, Bound]] = {}

    # -- the clock ------------------------------------------------------------------------------

    def tick(self) -> int:
        """A number never handed out before."""
        self.clock += 1
        return self.clock

    def touch(self, name: str) -> int:
        """A new generation for node ``name`` (changed, added or removed), logged for
        :meth:`changed_since`."""
        tick = self.tick()
        self._changes.append((tick, name))
        if len(self._changes) > CACHE_LIMIT:
            drop = len(self._changes) // 2
            self._changes_from = self._changes[drop - 1][0]
            del self._changes[:drop]
        return tick

    def changed_since(self, clock: int) -> set[str] | None:
        """Nodes whose generation changed (or that left) after ``clock``; ``None`` when that is too
        long ago to tell."""
        if clock < self._changes_from:
            return None
        start = bisect_right(self._changes, (clock, "\uffff"))
        return {name for _, name in self._changes[start:]}

    # -- node kinds and the empty-node check ----------------------------------------------------

    def shape(self, key: Hashable) -> int:
        """The number of a kind of node (``key``: its devices and budgets)."""
        shape = self._shapes.get(key)
        if shape is None:
            if len(self._shapes) > CACHE_LIMIT:
                self._shapes.clear()
                self._never.clear()
            shape = self._shapes[key] = self.tick()
        return shape

    def never_fits(self, group: _Group, new: list[Placed]) -> Check:
        """The check against the empty node: it depends on the kind of node and the claims only."""
        key = (group.shape, *((d, *(c.bytes_on(*size) for size in group.sizes)) for c, d in new))
        cached = self._never.get(key)
        if cached is None:
            if len(self._never) > CACHE_LIMIT:
                self._never.clear()
            cached = self._never[key] = self._empty_check(group, new)
        return cached

    # -- queries and usage ----------------------------------------------------------------------

    def prepare(self, claims: tuple[Claim, ...], uid: str | None) -> Query:
        """The query for these claims: the last one when a filter asks the same claims again."""
        query = self._query
        if query is None or query.claims is not claims or query.uid != uid:
            query = self._query = Query(claims, uid)
        return query

    def usage(self, name: str, generation: int) -> tuple[DeviceUsage, ...] | None:
        """The usage rows (without pod names) of node ``name`` stored at ``generation``, if any."""
        cached = self._usage.get(name)
        return cached[1] if cached is not None and cached[0] == generation else None

    def keep_usage(self, name: str, generation: int, rows: tuple[DeviceUsage, ...]) -> None:
        """Remember ``rows`` for node ``name`` at ``generation``."""
        self._usage[name] = (generation, rows)

    def forget(self, name: str) -> None:
        """Node ``name`` left: drop what is kept per node."""
        self._usage.pop(name, None)
        self._bounds.pop(name, None)

    # -- the bound: a refusal on one comparison ---------------------------------------------------

    def bound(self, node: _Node) -> Bound:
        """Per resource whose summary decides (devices of one size and sharing; a single device only
        without claims of unknown device), the device with the least room for one more claim
        (``Summary.least[1]``) and that room; kept per generation."""
        name = node.inventory.node
        cached = self._bounds.get(name)
        if cached is not None and cached[0] == node.generation:
            return cached[1]
        entries = []
        for resource, group in node.groups.items():
            summary = group.cache.summary(group, node.generation)
            if summary is None or len(summary.least) < 2 or (len(group.devices) == 1 and group.unknown):
                continue
            theirs = summary.theirs
            last = len(theirs) - 1
            room, position = min(
                (room - theirs[min(slots - 1, last)], i)
                for i, (_, slots, room) in enumerate(summary.rows) if slots >= 1
            )
            entries.append((resource, summary.rows[position][0], room, summary.unknown_pods))
        bound = tuple(entries)
        self._bounds[name] = (node.generation, bound)
        return bound

    def refusal(self, node: _Node, query: Query) -> tuple[_Device, int, int, int] | None:
        """(device, its room for one more claim, the pod's largest claim there, pods of unknown
        device counted) when that claim is bigger than the room: the pod fits no choice of the
        device plugin, and the node fails (resolvably). ``None``: the full check decides (the node
        may fit, the claims name devices, the pod holds a reported placement here, or the node is
        unresolvable for the pod, whose message the full check words)."""
        if query.pinned or (query.uid is not None and query.uid in node.inventory.placements):
            return None
        for resource, device, room, unknown_pods in self.bound(node):
            if resource in query.by_resource:
                need = query.prefix(resource, device)[1]
                if need > room:
                    unresolvable = query.unresolvable.get(node.kind)
                    if unresolvable is None:
                        unresolvable = query.unresolvable[node.kind] = self.unresolvable(node, query)
                    return None if unresolvable else (device, room, need, unknown_pods)
        return None

    def unresolvable(self, node: _Node, query: Query) -> bool:
        """Whether the pod fails the empty node (or a resource is missing): the full check's
        ``Fit.unresolvable`` for a pod that does not fit."""
        for resource, new in query.by_resource.items():
            group = node.groups.get(resource)
            if group is None:
                return True
            never = self._never_for(group, query, resource, new)
            if never[0] or never[1]:
                return True
        return False

    def _never_for(self, group: _Group, query: Query, resource: str, new: tuple[Claim, ...]) -> Check:
        """The empty-node check of the pod's claims on ``resource``, kept on the query per kind of node."""
        key = (group.shape, resource)
        never = query.never.get(key)
        if never is None:
            only = group.devices[0].gpu.id if len(group.devices) == 1 else None
            never = query.never[key] = self.never_fits(group, [(c, only) for c in new])
        return never

    # -- the fast verdict -----------------------------------------------------------------------

    def fit(self, node: _Node, query: Query) -> Fit | None:
        """The verdict from the groups' summaries, exactly as the general check gives it, when every
        claim's device is unknown on a multi-device group or is the single device of its group, and
        each group's devices share one size and sharing; ``None`` otherwise (the general check
        applies)."""
        if query.pinned or (query.uid is not None and query.uid in node.inventory.placements):
            return None
        problems: list[str] = []
        shortfalls: list[Shortfall] = []
        unresolvable = False
        settled = True  # every resource so far missing or failing empty: the node's kind decides
        for resource, new in query.by_resource.items():
            group = node.groups.get(resource)
            if group is None:
                offered = ", ".join(node.groups) or "no GPU resource"
                problems.append(f"node offers no {resource} (it has {offered})")
                unresolvable = True
                continue
            summary = group.cache.summary(group, node.generation)
            single = len(group.devices) == 1
            if summary is None or (single and group.unknown):
                return None
            never = self._never_for(group, query, resource, new)
            if never[0] or never[1]:
                unresolvable = True
                problems.extend(never[0])
                shortfalls.extend(never[1])
                continue
            settled = False
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
            now = check_summary(group, summary, ours, count, single=single)
            problems.extend(now[0])
            shortfalls.extend(now[1])
        if not problems and not shortfalls:
            return FITS
        if settled:
            empty = query.empty_fits.get(node.kind)
            if empty is None:
                empty = query.empty_fits[node.kind] = Fit(False, unresolvable, tuple(shortfalls), tuple(problems))
            return empty
        return Fit(False, unresolvable, tuple(shortfalls), tuple(problems))


def too_few_replicas(count: int, resource: str, slots: int, used: int) -> str:
    """The problem of a pod of ``count`` claims on a resource of ``slots`` replicas, ``used`` held."""
    return f"pod needs {count} {resource}, node has {slots} ({max(slots - used, 0)} free)"


def check_summary(group: _Group, summary: Summary, ours: list[int], count: int, *, single: bool) -> Check:
    """The general check for a pod without holdings on the node, from the group's summary.

    ``single``: the group has one device and the pod's ``count`` claims are known to be on it;
    otherwise none of the pod's claims has a known device. ``ours``: the prefix sums of the pod's
    claims on a device of the group, largest first.
    """
    problems: list[str] = []
    shortfalls: list[Shortfall] = []
    used = summary.used
    if used + count > group.slots:
        problems.append(too_few_replicas(count, group.resource, group.slots, used))
        return tuple(problems), ()
    theirs = summary.theirs
    last = len(theirs) - 1  # theirs[min(k, last)] below is worst_case(0, k, theirs), inlined
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
                    f"{format_bytes(device.budget)}, {over_budget_cause(gpu)})"
                )
                break
            shortfalls.append(Shortfall(gpu, device.budget, room - rest, ours[j], j, summary.unknown_pods))
            break
    return tuple(problems), tuple(shortfalls)


REBUILD_CHANGES = 64
"""Changed nodes past which :class:`BoundIndex` sorts every node again (and past an eighth of them)."""
Entry = tuple[int, str]
"""A node in a :class:`BoundIndex` bucket: (its room for one more claim, its name)."""


class Bucket:
    """The nodes of one kind that offer one resource, sorted by their room for one more claim
    (``Summary.least[1]``, the bound): a pod whose largest claim there is ``need`` is refused by
    every node before ``bisect_left(entries, (need, ""))`` and may fit the others."""

    __slots__ = ("details", "entries", "kind", "node", "resource")

    def __init__(self, resource: str, kind: tuple[int, ...], node: _Node) -> None:
        self.resource = resource
        self.kind = kind
        self.node = node
        """A node of the kind (the last one added): what depends on the kind alone is asked of it."""
        self.entries: list[Entry] = []
        self.details: dict[str, Detail] = {}


Detail = tuple[bool, int, tuple[int, ...], int]
"""Per node and resource: (the summary decides a fit alone: no device over its budget or holding
more claims than replicas; replicas left; ``Summary.least``; pods counted whose device is unknown)."""


class BoundIndex:
    """Every node whose bound decides (see :meth:`FastPath.bound`), per resource and kind of node,
    sorted by that bound; brought up to date from the change log (:meth:`FastPath.changed_since`)
    before each use, so a filter splits thousands of nodes with one bisection per kind instead of a
    check per node. Nodes with agent placements or a report set aside are left out (their verdict
    depends on the pod's UID or words their node): the general path decides them."""

    def __init__(self) -> None:
        self.clock = -1
        """The ledger's clock the index reflects (-1: never built)."""
        self.buckets: dict[tuple[str, tuple[int, ...]], Bucket] = {}
        self._keys: dict[str, tuple[tuple[tuple[str, tuple[int, ...]], int], ...]] = {}

    def refresh(self, fast: FastPath, nodes: dict[str, _Node]) -> None:
        """Re-sort the nodes changed since the last refresh (all of them when that is too long ago)."""
        if self.clock == fast.clock:
            return
        changed = fast.changed_since(self.clock) if self.clock >= 0 else None
        # Many changes (a re-list): sorting all at once beats inserting one by one.
        if changed is None or len(changed) > max(REBUILD_CHANGES, len(nodes) // 8):
            self.buckets.clear()
            self._keys.clear()
            for node in nodes.values():
                self._add(fast, node)
            for bucket in self.buckets.values():
                bucket.entries.sort()
        else:
            for name in changed:
                self._remove(name)
                now = nodes.get(name)
                if now is not None:
                    self._add(fast, now, keep_sorted=True)
        self.clock = fast.clock

    def _remove(self, name: str) -> None:
        for key, room in self._keys.pop(name, ()):
            bucket = self.buckets[key]
            entries = bucket.entries
            at = bisect_left(entries, (room, name))
            del entries[at]
            del bucket.details[name]
            if not entries:
                del self.buckets[key]

    def _add(self, fast: FastPath, node: _Node, *, keep_sorted: bool = False) -> None:
        inventory = node.inventory
        if inventory.placements or inventory.distrust is not None:
            return
        name = inventory.node
        keys = []
        for resource, _, room, unknown_pods in fast.bound(node):
            group = node.groups[resource]
            summary = group.cache.summary(group, node.generation)
            assert summary is not None  # the bound decides only where the summary does
            key = (resource, node.kind)
            bucket = self.buckets.get(key)
            if bucket is None:
                bucket = self.buckets[key] = Bucket(resource, node.kind, node)
            bucket.node = node
            if keep_sorted:
                insort(bucket.entries, (room, name))
            else:
                bucket.entries.append((room, name))
            clean = not summary.overfull and summary.least[0] >= 0
            bucket.details[name] = (clean, group.slots - summary.used, tuple(summary.least), unknown_pods)
            keys.append((key, room))
        if keys:
            self._keys[name] = tuple(keys)

    def select(self, resource: str, asked: set[str]) -> list[tuple[Bucket, list[Entry]]]:
        """Per bucket of ``resource``, the entries of the ``asked`` nodes, sorted by room: read off
        the buckets when many nodes are asked (a cold filter), looked up node by node when few
        are (a filter redoing the nodes changed since its last answer)."""
        if len(asked) * 4 >= len(self._keys):
            buckets = [b for b in self.buckets.values() if b.resource == resource]
            if asked.issuperset(self._keys):
                # Every indexed node asked (a cold filter of the whole cluster): the buckets as they
                # are, not copied entry by entry (the caller only reads them).
                return [(b, b.entries) for b in buckets]
            found = [(b, [e for e in b.entries if e[1] in asked]) for b in buckets]
            return [(b, entries) for b, entries in found if entries]
        chosen: dict[tuple[str, tuple[int, ...]], list[Entry]] = {}
        for name in asked:
            for key, room in self._keys.get(name, ()):
                if key[0] == resource:
                    chosen.setdefault(key, []).append((room, name))
        return [(self.buckets[key], sorted(entries)) for key, entries in chosen.items()]
