"""filter, prioritize and bind: the extender's decisions over the cluster state.

filter and prioritize are advisory: the scheduler may call them for many pods before any binds.
bind is where a reservation becomes real. It re-checks and reserves in one step (no ``await`` in
between, so no other request interleaves on the event loop), records the decision on the pod, then
creates the Binding; it releases the reservation if either call fails.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from extender.findings import FindingsReporter, findings_annotations
from service.kube import ApiError, KubeClient, object_path
from vramguard.cluster import PLACEMENT_ANNOTATION, ClusterState, PodKey, pod_key
from vramguard.placement import (
    NodeVerdict,
    PodClaims,
    Verdict,
    choose_gpus,
    describe_fit,
    filter_node,
    filter_nodes,
    score_node,
)
from vramguard.policy import ClassChoice

logger = logging.getLogger(__name__)

CACHED_POD_SHAPES = 256
PENDING_PODS = 4096


@dataclass(frozen=True, slots=True)
class FilterOutcome:
    """The filter's answer, before encoding."""

    passing: list[str]
    failed: dict[str, str]
    unresolvable: dict[str, str]


@dataclass(slots=True)
class _Snapshot:
    """One pod shape's last filter outcome, valid for every node unchanged since ``clock``."""

    clock: int
    nodes: list[str]
    passing: dict[str, None]
    failed: dict[str, str]
    unresolvable: dict[str, str]
    members: set[str] | None = None

    def update(
        self, nodes: list[str], changed: set[str], clock: int, verdicts: Callable[[list[str]], list[NodeVerdict]]
    ) -> FilterOutcome:
        """The outcome for ``nodes``: this one, with the changed, added and removed nodes redone."""
        members = self.members if self.members is not None else set(self.nodes)
        if nodes == self.nodes:
            requested, added, removed = members, set(), set()
        else:
            requested = set(nodes)
            added, removed = requested - members, members - requested
        redo = sorted((changed & requested) | added)
        for node in removed:
            self.passing.pop(node, None)
            self.failed.pop(node, None)
            self.unresolvable.pop(node, None)
        for node, verdict in zip(redo, verdicts(redo), strict=True):
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
        self.clock, self.nodes, self.members = clock, list(nodes), requested
        return FilterOutcome(list(self.passing), dict(self.failed), dict(self.unresolvable))


class Verbs:
    """The extender's three verbs over a :class:`ClusterState`."""

    def __init__(self, state: ClusterState, client: KubeClient | None) -> None:
        self.state = state
        self.client = client
        # Verdicts per pod shape (claims + class) and node, valid while the node's generation holds:
        # replicas of one Deployment share a shape, so a scheduling wave reuses almost every verdict.
        self._verdicts: OrderedDict[Hashable, dict[str, tuple[int | None, NodeVerdict]]] = OrderedDict()
        self._scores: OrderedDict[Hashable, dict[str, tuple[int | None, int]]] = OrderedDict()
        # The last outcome per pod shape: the next filter of that shape only revisits the nodes that
        # changed since (a scheduling wave changes a few nodes per pod), not all 5,000.
        self._snapshots: OrderedDict[Hashable, _Snapshot] = OrderedDict()
        # Pods seen by filter, so bind does not need to fetch them (bounded, oldest dropped first).
        self._pending: OrderedDict[str, tuple[PodKey, PodClaims, ClassChoice]] = OrderedDict()
        self.findings: FindingsReporter | None = None
        """Reports class rules let through at bind (set by the app, which owns the metrics)."""

    def _prepare(self, pod: Mapping[str, Any]) -> tuple[PodKey, PodClaims, ClassChoice]:
        key = pod_key(pod)
        choice = self.state.choose_class(pod)
        claims = self.state.claims_for(pod, choice)
        self._pending[key.uid] = (key, claims, choice)
        self._pending.move_to_end(key.uid)
        while len(self._pending) > PENDING_PODS:
            self._pending.popitem(last=False)
        return key, claims, choice

    def _shape(self, claims: PodClaims, choice: ClassChoice) -> Hashable:
        # The policy's version too: a reload may change what a class of the same name allows.
        return (claims.claims, claims.init, claims.refusal, choice.name, choice.enforcement, self.state.policy_version)

    @staticmethod
    def _cache(store: OrderedDict[Hashable, Any], shape: Hashable) -> Any:
        entry = store.get(shape)
        if entry is None:
            entry = store[shape] = {}
            while len(store) > CACHED_POD_SHAPES:
                store.popitem(last=False)
        else:
            store.move_to_end(shape)
        return entry

    def filter(self, pod: Mapping[str, Any], nodes: list[str]) -> FilterOutcome:
        """Which nodes can take the pod without overcommitting a GPU, and why the others cannot."""
        return self._hold_back_suspects(self._filter(pod, nodes))

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

    def _filter(self, pod: Mapping[str, Any], nodes: list[str]) -> FilterOutcome:
        key, claims, choice = self._prepare(pod)
        shape = self._shape(claims, choice)
        cache: dict[str, tuple[int | None, NodeVerdict]] = self._cache(self._verdicts, shape)
        ledger = self.state.ledger
        clock = ledger.clock
        # A verdict depends on the pod only where the ledger holds it (being bound, or bound): there
        # its own holding is left out, so that verdict is neither read from nor stored in the cache.
        held = ledger.holding(key.uid)
        own = held[1] if held is not None else None
        snapshot = self._snapshots.get(shape) if own is None else None
        if snapshot is not None:
            changed = ledger.changed_since(snapshot.clock)
            if changed is not None and len(changed) <= len(nodes) // 4:
                self._snapshots.move_to_end(shape)
                return snapshot.update(
                    nodes, changed, clock, lambda redo: self._verdicts_for(cache, redo, claims, choice, own)
                )
        verdicts = self._verdicts_for(cache, nodes, claims, choice, own)
        passing: list[str] = []
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        for node, verdict in zip(nodes, verdicts, strict=True):
            if verdict.verdict is Verdict.PASS:
                passing.append(node)
            elif verdict.verdict is Verdict.UNRESOLVABLE:
                unresolvable[node] = verdict.message
            else:
                failed[node] = verdict.message
        if own is None:
            self._snapshots[shape] = _Snapshot(
                clock, list(nodes), dict.fromkeys(passing), dict(failed), dict(unresolvable)
            )
            while len(self._snapshots) > CACHED_POD_SHAPES:
                self._snapshots.popitem(last=False)
        return FilterOutcome(passing, failed, unresolvable)

    def _verdicts_for(
        self,
        cache: dict[str, tuple[int | None, NodeVerdict]],
        nodes: list[str],
        claims: PodClaims,
        choice: ClassChoice,
        own: str | None,
    ) -> list[NodeVerdict]:
        """Each node's verdict: from the cache while the node's generation holds, else computed."""
        generation = self.state.ledger.generation
        verdicts: list[NodeVerdict | None] = []
        missing: list[str] = []
        for node in nodes:
            hit = cache.get(node)
            if hit is not None and hit[0] == generation(node) and node != own:
                verdicts.append(hit[1])
            else:
                verdicts.append(None)
                missing.append(node)
        if not missing:
            return [v for v in verdicts if v is not None]
        fresh = dict(zip(missing, filter_nodes(self.state.ledger, missing, claims, choice), strict=True))
        for node, verdict in fresh.items():
            if node != own:
                cache[node] = (generation(node), verdict)
        return [cached if cached is not None else fresh[node] for node, cached in zip(nodes, verdicts, strict=True)]

    def prioritize(self, pod: Mapping[str, Any], nodes: list[str]) -> dict[str, int]:
        """0..10 per node from the pod's class strategy (binpack or spread)."""
        _, claims, choice = self._prepare(pod)
        cache: dict[str, tuple[int | None, int]] = self._cache(self._scores, self._shape(claims, choice))
        scores: dict[str, int] = {}
        ledger = self.state.ledger
        for node in nodes:
            generation = ledger.generation(node)
            hit = cache.get(node)
            if hit is not None and hit[0] == generation:
                scores[node] = hit[1]
            else:
                # The scheduler sends prioritize only the nodes that passed filter.
                score = score_node(ledger, node, claims, choice, checked=True)
                cache[node] = (generation, score)
                scores[node] = score
        return scores

    async def bind(self, name: str, namespace: str, uid: str, node: str) -> str:
        """Reserve, record and bind; returns an error message, or ``""`` when the pod is bound."""
        bound = self.state.is_bound(uid)
        if bound == node:
            return ""  # already bound there: binding is idempotent
        if bound is not None:
            # A retry after the scheduler gave up on a bind that went through: moving the pod's
            # holding would leave its real node under-counted.
            return f"pod {namespace}/{name} is already bound to {bound}"
        if uid in self.state.in_flight:
            return f"pod {namespace}/{name} is already being bound"
        prepared = self._pending.get(uid)
        if prepared is None:
            try:
                pod = await self._client().get(object_path("/api/v1/pods", namespace, name))
            except ApiError as exc:
                return f"cannot read pod {namespace}/{name}: {exc.message or exc}"
            if pod_key(pod).uid != uid:
                return f"pod {namespace}/{name} was replaced (uid changed)"
            prepared = self._prepare(pod)
        key, claims, choice = prepared
        # From here to the reservation nothing awaits: the check and the hold are one step.
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
        fit = self.state.ledger.reserve(node, key.ref(), chosen.claims)
        if not fit.ok:
            return f"{node}: {describe_fit(fit, chosen.claims)}"
        self.state.begin_bind(node, key, chosen)
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
                        "annotations": {
                            PLACEMENT_ANNOTATION: assignment.annotation(), **findings_annotations(verdict.findings)
                        },
                    },
                    "target": {"apiVersion": "v1", "kind": "Node", "name": node},
                },
            )
        except ApiError as exc:
            self.state.abort_bind(uid)
            return f"binding {namespace}/{name} to {node} failed: {exc.message or exc}"
        except asyncio.CancelledError:
            # The scheduler hung up; whether the Binding was created, the watch will tell.
            self.state.abort_bind(uid)
            raise
        except Exception as exc:
            self.state.abort_bind(uid)
            logger.exception("binding %s/%s to %s failed", namespace, name, node)
            return f"binding {namespace}/{name} to {node} failed: {exc}"
        self._pending.pop(uid, None)
        if verdict.findings and self.findings is not None:
            await self.findings.report(key, node, choice.enforcement, verdict.findings)
        return ""

    def _client(self) -> KubeClient:
        if self.client is None:
            raise ApiError(503, "NoClient", "the extender has no API client")
        return self.client
