"""filter, prioritize and bind: the extender's decisions over the cluster state.

filter and prioritize are advisory: the scheduler may call them for many pods before any binds.
Their work is cut into slices with a yield to the event loop in between, so a filter over 5,000
nodes does not stall the other requests, the probes or the watches.

bind is where a reservation becomes real, and anyone who reaches the extender can call it, so it
trusts only the API server: it reads the pod, refuses what is not its business (another
scheduler's pod, a pod without GPUs, one already bound, a node the pod does not tolerate or does
not select) and derives the claims from that object, never from a filter request. Then it checks
and reserves in one step (no ``await`` in between, so no other request interleaves on the event
loop), and creates the Binding, which records the decision on the pod; it releases the
reservation if that call fails.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from cachetools import LRUCache

from extender import claims as claims_module
from extender.findings import FindingsReporter, findings_annotations
from extender.wire import pod_problem
from vramguard.cluster import ClusterState, PodKey, pod_key, pod_template_key, slim_pod
from vramguard.codecs import PLACEMENT_ANNOTATION
from vramguard.demand import MAX_DEVICES
from vramguard.dra.claims import read_allocation
from vramguard.dra.extended import allocated_devices, container_names, place_claims, requested_resources
from vramguard.dra.pods import extended_resource_claim, uses_claims
from vramguard.io.dra import RESOURCE_CLAIMS
from vramguard.io.kube import ApiError, KubeClient, object_path
from vramguard.node_selection import placement_refusal
from vramguard.placement import (
    FilterMemo,
    Groups,
    NodeVerdict,
    PodClaims,
    Verdict,
    choose_gpus,
    describe_fit,
    filter_grouped,
    filter_node,
    filter_nodes,
    score_node,
)
from vramguard.policy import ClassChoice

logger = logging.getLogger(__name__)

CACHED_POD_SHAPES = 256
"""Pod shapes whose verdicts, scores and last outcome are kept, least recently used dropped first."""
SLICE_NODES = 16
"""Nodes decided between two looks at the clock."""
SLICE_SECONDS = 0.001
"""The longest stretch of filter or prioritize work (CPU time of the event loop's thread) before the
event loop gets a turn."""
IN_FLIGHT_TIMEOUT_SECONDS = 60.0
"""A reservation the watch has not confirmed this long after its Binding is checked with a GET."""
CACHED_READ = {"resourceVersion": "0"}
"""A GET answered from the API server's watch cache."""
DEFAULT_SCHEDULER = "default-scheduler"
NOT_LEADER = "vramguard: this extender is not the leader; retrying"
"""A verb refused by a replica that does not hold the leader Lease: the scheduler retries the pod
(readiness routes the Service to the leader)."""
"""What the API server puts in ``spec.schedulerName`` when the pod names none."""


_CachedVerdict = tuple[int | None, str, str]
"""A node's verdict for a pod shape: (node generation, verdict, message). Plain strings rather than
a :class:`NodeVerdict`, so the tuple holds no object the garbage collector must track: a full
collection then skips the hundreds of thousands of cached verdicts (a stall of the event loop)."""


def _cached(generation: int | None, verdict: NodeVerdict) -> _CachedVerdict:
    return (generation, verdict.verdict.value, verdict.message)


def _uncached(entry: _CachedVerdict) -> NodeVerdict:
    return _PASSED if entry[1] == Verdict.PASS.value else NodeVerdict(Verdict(entry[1]), entry[2])


_PASSED = NodeVerdict(Verdict.PASS)


class Slicer:
    """Yields to the event loop once ``budget`` seconds of work have run; ``None`` never yields.

    Work is the thread's CPU time, not the wall clock: on a busy machine the process is taken off
    the CPU in the middle of a request, and yielding for that time would only put the request
    behind whatever queued meanwhile (watch events, binds' API answers), adding milliseconds to the
    scheduler's serial cycle without sparing anyone a wait."""

    def __init__(self, budget: float | None, clock: Callable[[], float] = time.thread_time) -> None:
        self.budget = budget
        self._clock = clock
        self._since = clock()

    async def pause(self) -> None:
        """Let other tasks run if this request has worked for its slice."""
        if self.budget is not None and self._clock() - self._since >= self.budget:
            await asyncio.sleep(0)
            self._since = self._clock()


@dataclass(frozen=True, slots=True)
class FilterOutcome:
    """The filter's answer, before encoding."""

    passing: list[str]
    failed: dict[str, str]
    unresolvable: dict[str, str]


@dataclass(slots=True)
class _Scores:
    """One pod shape's scores per node, valid for every node unchanged since ``clock``."""

    clock: int
    scores: dict[str, int]


@dataclass(slots=True)
class _Snapshot:
    """One pod shape's last filter outcome, valid for every node unchanged since ``clock``.

    Kept in containers of strings only (a tuple, dicts), which the garbage collector stops tracking:
    hundreds of shapes' 5,000-node lists and sets would otherwise be walked by every full
    collection, a pause of hundreds of milliseconds for the request it lands in."""

    clock: int
    nodes: tuple[str, ...]
    passing: dict[str, None]
    failed: dict[str, str]
    unresolvable: dict[str, str]
    members: dict[str, None] | None = None

    async def update(
        self,
        nodes: list[str],
        changed: set[str],
        clock: int,
        verdicts: Callable[[list[str]], Awaitable[tuple[Groups, dict[str, NodeVerdict]]]],
    ) -> FilterOutcome:
        """The outcome for ``nodes``: this one, with the changed, added and removed nodes redone.

        The caller owns the snapshot while this runs (it awaits between slices of work)."""
        members = self.members if self.members is not None else dict.fromkeys(self.nodes)
        asked = tuple(nodes)
        if asked == self.nodes:
            requested, added, removed = members, set(), set()
        else:
            requested = dict.fromkeys(asked)
            added, removed = requested.keys() - members.keys(), members.keys() - requested.keys()
        redo = sorted({node for node in changed if node in requested} | added)
        groups, fresh = await verdicts(redo)
        for group, names in groups:
            fresh.update(dict.fromkeys(names, group))
        for node in removed:
            self.passing.pop(node, None)
            self.failed.pop(node, None)
            self.unresolvable.pop(node, None)
        for node in redo:
            verdict = fresh[node]
            if verdict.verdict is Verdict.PASS:
                self.failed.pop(node, None)
                self.unresolvable.pop(node, None)
                self.passing[node] = None
            else:
                self.passing.pop(node, None)
                target, other = (
                    (self.unresolvable, self.failed) if verdict.verdict is Verdict.UNRESOLVABLE
                    else (self.failed, self.unresolvable)
                )
                other.pop(node, None)
                target[node] = verdict.message
        self.clock, self.nodes, self.members = clock, asked, requested
        return FilterOutcome(list(self.passing), dict(self.failed), dict(self.unresolvable))


class Verbs:
    """The extender's three verbs over a :class:`ClusterState`.

    ``slice_seconds`` bounds how long filter and prioritize work before yielding to the event loop
    (``None``: never yield, as the benchmark's baseline).
    """

    def __init__(
        self, state: ClusterState, client: KubeClient | None, *, slice_seconds: float | None = SLICE_SECONDS
    ) -> None:
        self.state = state
        self.client = client
        self.slice_seconds = slice_seconds
        # Verdicts per pod shape (claims + class) and node, valid while the node's generation holds:
        # replicas of one Deployment share a shape, so a scheduling wave reuses almost every verdict.
        self._verdicts: LRUCache[Hashable, dict[str, _CachedVerdict]] = LRUCache(CACHED_POD_SHAPES)
        self._scores: LRUCache[Hashable, _Scores] = LRUCache(CACHED_POD_SHAPES)
        # The last outcome per pod shape: the next filter of that shape only revisits the nodes that
        # changed since (a scheduling wave changes a few nodes per pod), not all 5,000.
        self._snapshots: LRUCache[Hashable, _Snapshot] = LRUCache(CACHED_POD_SHAPES)
        self.findings: FindingsReporter | None = None
        """Reports class rules let through at bind (set by the app, which owns the metrics)."""
        # When each reservation still in flight had its Binding created (monotonic seconds), and the
        # binds still waiting for the API server: housekeeping leaves those alone.
        self._bound_at: dict[str, float] = {}
        self._binding: set[str] = set()
        self.serving: Callable[[], bool] = lambda: True
        """Whether this replica may bind now (the leader election's verdict); checked again right
        before the reservation, since leadership may lapse while the pod is read."""

    def oldest_in_flight_seconds(self, now: float | None = None) -> float:
        """Age of the oldest reservation whose Binding was sent but not yet seen by the watch (0: none)."""
        now = time.monotonic() if now is None else now
        ages = [now - since for uid, since in self._bound_at.items() if uid in self.state.in_flight]
        return max(ages, default=0.0)

    def _prepare(self, pod: Mapping[str, Any]) -> tuple[PodKey, PodClaims, ClassChoice]:
        """The pod's key, class and claims. A pod asking for more devices than any node has (or than
        admission's cap) gets a refusal instead, before a claim is built: one claim per device, and
        a pod of 200 containers x 1,000 GPUs would otherwise build 200,000 and test each node."""
        self.state.sync_dra()  # DRA devices and claims, as the watches last said, into the ledger
        key = pod_key(pod)
        choice = self.state.choose_class(pod)
        template = pod_template_key(pod)
        devices = self.state.devices_asked(pod, template)
        largest = min(self.state.largest_node_devices(), MAX_DEVICES)
        if devices > largest:
            return key, PodClaims(key.uid, refusal=(
                f"the pod asks for {devices} GPU devices at once; no node offers more than {largest}"
            )), choice
        return key, self.state.claims_for(pod, choice, template), choice

    def _shape(self, claims: PodClaims, choice: ClassChoice) -> Hashable:
        # The policy's version too: a reload may change what a class of the same name allows.
        return (claims.claims, claims.init, claims.refusal, choice.name, choice.enforcement, self.state.policy_version)

    @staticmethod
    def _cache(store: LRUCache[Hashable, Any], shape: Hashable) -> Any:
        entry = store.get(shape)  # a hit makes the shape the most recently used
        if entry is None:
            entry = store[shape] = {}
        return entry

    async def filter(self, pod: Mapping[str, Any], nodes: list[str]) -> FilterOutcome:
        """Which nodes can take the pod without overcommitting a GPU, and why the others cannot."""
        outcome = self._hold_back_suspects(await self._filter(pod, nodes))
        failed, unresolvable = claims_module.refused_nodes(self.state, pod, outcome.passing)
        if not failed and not unresolvable:
            return outcome
        passing = [node for node in outcome.passing if node not in failed and node not in unresolvable]
        return FilterOutcome(passing, {**outcome.failed, **failed}, {**outcome.unresolvable, **unresolvable})

    def _hold_back_suspects(self, outcome: FilterOutcome) -> FilterOutcome:
        """Fail (resolvably: the scheduler retries) the passing nodes whose pods are being re-read,
        whatever the pod asks for: conservative, and only for the moments a re-list takes.

        Applied to the outcome, not cached with the verdicts: the mark comes and goes without the
        ledger changing, so cached verdicts and snapshots stay valid underneath it.
        """
        if not self.state.suspects:
            return outcome
        held = {node: message for node in outcome.passing if (message := self.state.suspect_message(node))}
        if not held:
            return outcome
        passing = [node for node in outcome.passing if node not in held]
        return FilterOutcome(passing, {**outcome.failed, **held}, outcome.unresolvable)

    async def _filter(self, pod: Mapping[str, Any], nodes: list[str]) -> FilterOutcome:
        key, claims, choice = self._prepare(pod)
        shape = self._shape(claims, choice)
        cache: dict[str, _CachedVerdict] = self._cache(self._verdicts, shape)
        ledger = self.state.ledger
        clock = ledger.clock
        # A verdict depends on the pod only where the ledger holds it (being bound, or bound): there
        # its own holding is left out, so that verdict is neither read from nor stored in the cache.
        held = ledger.holding(key.uid)
        own = held[1] if held is not None else None
        slicer = Slicer(self.slice_seconds)
        # Taken out while in use: a concurrent filter of the same shape must not update it meanwhile.
        snapshot = self._snapshots.pop(shape, None) if own is None else None
        if snapshot is not None:
            changed = ledger.changed_since(snapshot.clock)
            if changed is not None and len(changed) <= len(nodes) // 4:
                outcome = await snapshot.update(
                    nodes, changed, clock, lambda redo: self._verdicts_for(cache, redo, claims, choice, own, slicer)
                )
                self._keep_snapshot(shape, snapshot)
                return outcome
        groups, singles = await self._verdicts_for(cache, nodes, claims, choice, own, slicer)
        # A group at a time (thousands of nodes of a cold filter share a few verdicts), then the
        # nodes judged or found in the cache one by one; the passing nodes in the order asked.
        passed: set[str] = set()
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        for verdict, names in groups:
            if verdict.verdict is Verdict.PASS:
                passed.update(names)
            else:
                (unresolvable if verdict.verdict is Verdict.UNRESOLVABLE else failed).update(
                    dict.fromkeys(names, verdict.message)
                )
        for node, verdict in singles.items():
            if verdict.verdict is Verdict.PASS:
                passed.add(node)
            elif verdict.verdict is Verdict.UNRESOLVABLE:
                unresolvable[node] = verdict.message
            else:
                failed[node] = verdict.message
        passing = [node for node in nodes if node in passed]
        if own is None:
            # The clock read before the first slice: nodes changed while this ran are redone next time.
            self._keep_snapshot(shape, _Snapshot(
                clock, tuple(nodes), dict.fromkeys(passing), dict(failed), dict(unresolvable)
            ))
        return FilterOutcome(passing, failed, unresolvable)

    def _keep_snapshot(self, shape: Hashable, snapshot: _Snapshot) -> None:
        self._snapshots[shape] = snapshot

    async def _verdicts_for(
        self,
        cache: dict[str, _CachedVerdict],
        nodes: list[str],
        claims: PodClaims,
        choice: ClassChoice,
        own: str | None,
        slicer: Slicer,
    ) -> tuple[Groups, dict[str, NodeVerdict]]:
        """The nodes' verdicts: those the bound index decides, in groups of nodes sharing one; the
        others per node, from the cache while the node's generation holds, else computed.

        Computed a slice of nodes at a time; each slice reads the generations it stores with, so a
        bind between slices leaves no verdict cached under a generation it was not computed for."""
        generation = self.state.ledger.generation
        hits: dict[str, NodeVerdict] = {}
        missing = nodes
        if cache:
            missing = []
            for node in nodes:
                hit = cache.get(node)
                if hit is not None and node != own and hit[0] == generation(node):
                    hits[node] = _uncached(hit)
                else:
                    missing.append(node)
        memo = FilterMemo()  # one pod and class: shared device checks and reasons across the slices
        # The nodes the bound index decides, in one step (a bisection per kind of node): not cached,
        # deciding them again costs about what a lookup in the cache does. The rest one by one, in slices.
        groups, rest = filter_grouped(self.state.ledger, missing, claims, choice, memo) if missing else ([], [])
        fresh = hits
        for start in range(0, len(rest), SLICE_NODES):
            await slicer.pause()
            part = rest[start:start + SLICE_NODES]
            for node, verdict in zip(part, filter_nodes(self.state.ledger, part, claims, choice, memo), strict=True):
                fresh[node] = verdict
                if node != own:
                    cache[node] = _cached(generation(node), verdict)
        return groups, fresh

    async def prioritize(self, pod: Mapping[str, Any], nodes: list[str]) -> dict[str, int]:
        """0..10 per node from the pod's class strategy (binpack or spread).

        The scheduler calls prioritize right after filter, for the same pod, with the nodes that
        passed: the scores of the pod's shape are kept per node and corrected from the ledger's
        changes since the last call (a bind changes one node), so a wave of replicas is answered
        with a lookup per node."""
        _, claims, choice = self._prepare(pod)
        shape = self._shape(claims, choice)
        ledger = self.state.ledger
        clock = ledger.clock
        snapshot = self._scores.get(shape)
        if snapshot is None:
            snapshot = self._scores[shape] = _Scores(clock, {})
        elif snapshot.clock != clock:
            changed = ledger.changed_since(snapshot.clock)
            if changed is None:
                snapshot.scores.clear()
            else:
                for node in changed:
                    snapshot.scores.pop(node, None)
            # The clock read before any score is computed: a node that changes while this runs is
            # dropped again by the next call.
            snapshot.clock = clock
        known = snapshot.scores
        scores: dict[str, int] = {}
        slicer = Slicer(self.slice_seconds)
        for start in range(0, len(nodes), SLICE_NODES):
            await slicer.pause()
            for node in nodes[start:start + SLICE_NODES]:
                score = known.get(node)
                if score is None:
                    # The scheduler sends prioritize only the nodes that passed filter.
                    score = known[node] = score_node(ledger, node, claims, choice, checked=True)
                scores[node] = score
        return scores

    def refusal(self, pod: Mapping[str, Any], uid: str, node: str) -> str | None:
        """Why bind must not place this pod (as the API server returned it) on ``node``, or ``None``.

        The scheduler checked the rest (resources, ports, pod affinity...); these are the checks
        without which a direct call to bind could place a pod the scheduler never would."""
        problem = pod_problem(pod)
        if problem is not None:
            return f"the pod read from the API is malformed: {problem}"
        key = pod_key(pod)
        where = f"pod {key.namespace}/{key.name}"
        if not key.uid or key.uid != uid:
            return f"{where} was replaced (its UID is not {uid})"
        spec = pod.get("spec")
        if not isinstance(spec, dict):
            return f"{where} has no spec"
        scheduler = spec.get("schedulerName") or DEFAULT_SCHEDULER
        if scheduler not in self.state.policy.schedulers:
            return (
                f"{where} belongs to scheduler {scheduler!r}, not to {', '.join(self.state.policy.schedulers)}; "
                "vramguard binds only the pods of the schedulers it serves"
            )
        if spec.get("nodeName"):
            return f"{where} is already bound to {spec['nodeName']}"
        selection = self.state.node_selection(node)
        if selection is None:
            return f"node {node} is not known to vramguard"
        return placement_refusal(spec, node, selection.labels, selection.taints)

    async def bind(self, name: str, namespace: str, uid: str, node: str, *, fresh: bool = False) -> str:
        """Check, reserve, record and bind; returns an error message, or ``""`` when the pod is bound.

        The pod is read from the watch cache unless ``fresh``; a Binding refused because the pod
        changed since that read (a conflict on its ``resourceVersion``) is tried once more from etcd."""
        if not uid:
            return f"refused: no PodUID for pod {namespace}/{name}; bind needs the UID to know which pod it binds"
        bound = self.state.is_bound(uid)
        if bound == node:
            return ""  # already bound there: binding is idempotent
        if bound is not None:
            # A retry after the scheduler gave up on a bind that went through: moving the pod's
            # holding would leave its real node under-counted.
            return f"pod {namespace}/{name} is already bound to {bound}"
        if uid in self.state.in_flight:
            return f"pod {namespace}/{name} is already being bound"
        try:
            pod = await self._read_pod(namespace, name, uid, cached=not fresh)
        except ApiError as exc:
            return f"cannot read pod {namespace}/{name}: {exc.message or exc}"
        allocated: Mapping[str, tuple[str, ...]] | None = None
        self.state.sync_dra()
        if self.state.dra_resources(node) & requested_resources(pod):
            if extended_resource_claim(pod) is None:
                # The scheduler writes the claim's status right before bind: a cached copy may lag it.
                pod = await self._read_pod(namespace, name, uid, cached=False)
            allocated, problem = await self._dra_allocation(pod, uid, node)
            if problem:
                return problem
        if uses_claims(pod):
            problem = await claims_module.read_claims(self._client(), self.state, pod)
            if problem:
                return problem
        # From here to the reservation nothing awaits: the checks and the hold are one step.
        if not self.serving():
            return NOT_LEADER
        if uid in self.state.in_flight or self.state.is_bound(uid) is not None:
            return f"pod {namespace}/{name} is already being bound"  # by a bind that ran during the GET
        refusal = self.refusal(pod, uid, node)
        if refusal is not None:
            return f"refused: {refusal}"
        key, claims, choice = self._prepare(pod)
        claim_placement = None
        if uses_claims(pod):
            claim_placement, problem = claims_module.place(self.state, pod, node, choice)
            if problem:
                return problem
        if allocated is not None:
            # The scheduler allocated the devices before calling bind: the claims are known to be there.
            claims = PodClaims(claims.uid, place_claims(claims.claims, allocated), claims.init, claims.refusal)
        held_back = self.state.suspect_message(node)
        if held_back:
            return held_back
        verdict = filter_node(self.state.ledger, node, claims, choice)
        if not verdict.ok:
            return f"{node}: {verdict.message}"
        assignment = choose_gpus(self.state.ledger, node, claims, choice)
        if assignment is None:
            return f"node {node} is not known to vramguard"
        chosen = PodClaims(claims.uid, assignment.claims, claims.init, claims.refusal)
        # A node whose GPUs nobody can size passed outside enforce: recorded, not checked (see filter).
        unguarded = any(finding.unreadable for finding in verdict.findings)
        fit = self.state.ledger.reserve(node, key, chosen.claims, force=unguarded)
        if not fit.ok and not unguarded:
            return f"{node}: {describe_fit(fit, chosen.claims)}"
        self.state.begin_bind(node, key, chosen)
        if claim_placement is not None and claim_placement.taken:
            self.state.dra.hold(uid, dict(pod), tuple(claim_placement.taken.items()))
        self._binding.add(uid)
        try:
            # One call: the API server copies the Binding's annotations onto the pod as it binds it,
            # so the decision is recorded exactly when (and only if) the pod is bound.
            await self._client().create(
                object_path("/api/v1/pods", namespace, name) + "/binding",
                {
                    "apiVersion": "v1",
                    "kind": "Binding",
                    "metadata": {
                        "name": name,
                        "namespace": namespace,
                        "uid": uid,
                        # A precondition: the pod bound is the pod judged. Its images can change
                        # (``kubectl set image``), and with them its claims; the API server refuses the
                        # Binding with a conflict if the pod changed after it was read.
                        **({"resourceVersion": version} if (version := _resource_version(pod)) else {}),
                        "annotations": {
                            PLACEMENT_ANNOTATION: assignment.annotation(), **findings_annotations(verdict.findings)
                        },
                    },
                    "target": {"apiVersion": "v1", "kind": "Node", "name": node},
                },
            )
        except ApiError as exc:
            self.state.abort_bind(uid)
            self.state.dra.release(uid)
            if exc.status == 409 and not fresh and _resource_version(pod) is not None:
                self._binding.discard(uid)
                return await self.bind(name, namespace, uid, node, fresh=True)  # the pod changed: judge it again
            return f"binding {namespace}/{name} to {node} failed: {exc.message or exc}"
        except asyncio.CancelledError:
            # The scheduler hung up; whether the Binding was created, the watch (or housekeeping) will tell.
            self._bound_at[uid] = time.monotonic()
            raise
        except Exception as exc:
            self.state.abort_bind(uid)
            self.state.dra.release(uid)
            logger.exception("binding %s/%s to %s failed", namespace, name, node)
            return f"binding {namespace}/{name} to {node} failed: {exc}"
        finally:
            self._binding.discard(uid)
        self._bound_at[uid] = time.monotonic()
        if verdict.findings and self.findings is not None:
            await self.findings.report(key, node, choice.enforcement, verdict.findings)
        return ""

    async def _read_pod(self, namespace: str, name: str, uid: str, *, cached: bool = True) -> Mapping[str, Any]:
        """The pod from the API server's watch cache (``resourceVersion=0``: no etcd read, the API
        server's cheapest answer), or from etcd when that copy is not the pod being bound (not there
        yet, or another UID: the cache lags a re-creation), or when ``cached`` is False.

        A cached copy of the right UID decides as well as a fresh one: the Binding carries the
        copy's ``resourceVersion`` as a precondition, so a pod changed since (a new image, hence new
        claims), bound or deleted makes the Binding fail with a conflict, and the scheduler tries again."""
        path = object_path("/api/v1/pods", namespace, name)
        if cached:
            try:
                copy = await self._client().get(path, CACHED_READ)
            except ApiError as exc:
                if exc.status != 404:
                    raise
            else:
                metadata = copy.get("metadata")
                if isinstance(metadata, dict) and metadata.get("uid") == uid:
                    return copy
        return await self._client().get(path)

    async def _dra_allocation(
        self, pod: Mapping[str, Any], uid: str, node: str
    ) -> tuple[Mapping[str, tuple[str, ...]] | None, str]:
        """Per container, the DRA devices the scheduler allocated to the pod's extended-resource
        claim (it writes the allocation before it calls bind), read from the API server; or why
        not. The claim read is fed to the DRA state, so the ledger sees it before its watch event."""
        key = pod_key(pod)
        where = f"pod {key.namespace}/{key.name}"
        status = extended_resource_claim(pod)
        if status is None:
            return None, (
                f"{where}: DRA serves its GPU resource on {node}, but the pod names no allocated claim "
                "(status.extendedResourceClaimStatus); retrying"
            )
        try:
            claim = await self._client().get(object_path(RESOURCE_CLAIMS, key.namespace, status.claim_name))
        except ApiError as exc:
            return None, f"cannot read ResourceClaim {key.namespace}/{status.claim_name}: {exc.message or exc}"
        allocation = read_allocation(claim)
        if allocation is None or not allocation.extended_resource or uid not in {u for _, u in allocation.reserved_for}:
            return None, (
                f"refused: ResourceClaim {key.namespace}/{status.claim_name} is not an allocated "
                f"extended-resource claim reserved for {where}"
            )
        devices = self.state.dra.devices(node)
        chosen = allocated_devices(allocation, devices, container_names(pod))
        if not chosen:
            return None, f"ResourceClaim {key.namespace}/{status.claim_name}: none of its devices is on {node}"
        self.state.dra.claims.upsert(dict(claim))
        return chosen, ""

    async def confirm_in_flight(self, older_than: float = IN_FLIGHT_TIMEOUT_SECONDS) -> int:
        """Check with a GET each reservation the watch has not confirmed for ``older_than`` seconds.

        A pod the API shows bound is fed to the state as its watch event would be; one that is gone,
        replaced or still unbound has its reservation dropped. Never on the timer alone: a watch
        that lags must not free a GPU that a bound pod holds. Returns how many were dropped."""
        for uid in [u for u in self._bound_at if u not in self.state.in_flight]:
            del self._bound_at[uid]  # confirmed by the watch, or aborted
        for uid in self.state.in_flight:
            if uid not in self._bound_at and uid not in self._binding:
                self._bound_at[uid] = time.monotonic()  # reserved by another path: start its clock now
        deadline = time.monotonic() - older_than
        dropped = 0
        for uid, since in list(self._bound_at.items()):
            entry = self.state.in_flight.get(uid)
            if since > deadline or entry is None or uid in self._binding:
                continue
            ref = entry[1]
            try:
                pod: Mapping[str, Any] | None = await self._client().get(
                    object_path("/api/v1/pods", ref.namespace, ref.name)
                )
            except ApiError as exc:
                if exc.status != 404:
                    logger.warning("in-flight pod %s not checked: %s", ref, exc.message or exc)
                    continue
                pod = None
            if uid not in self.state.in_flight:
                continue  # the watch confirmed it during the GET
            if pod is not None and pod_key(pod).uid == uid and (pod.get("spec") or {}).get("nodeName"):
                self.state.pods.upsert(slim_pod(pod))  # bound: what the watch would have said
            else:
                logger.info("dropping the reservation of %s: the pod is %s", ref, "unbound" if pod else "gone")
                self.state.abort_bind(uid)
                dropped += 1
            self._bound_at.pop(uid, None)
        return dropped

    def _client(self) -> KubeClient:
        if self.client is None:
            raise ApiError(503, "NoClient", "the extender has no API client")
        return self.client


def _resource_version(pod: Mapping[str, Any]) -> str | None:
    """The pod's ``metadata.resourceVersion`` as read, or ``None``."""
    metadata = pod.get("metadata")
    version = metadata.get("resourceVersion") if isinstance(metadata, Mapping) else None
    return version if isinstance(version, str) and version else None
