"""filter, prioritize and bind: the extender's decisions over the cluster state.

filter and prioritize are advisory: the scheduler may call them for many pods before any binds.
bind is where a reservation becomes real. It re-checks and reserves in one step (no ``await`` in
between, so no other request interleaves on the event loop), records the decision on the pod, then
creates the Binding; it releases the reservation if either call fails.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from extender.state import PLACEMENT_ANNOTATION, ClusterState, PodKey, pod_key
from service.kube import ApiError, KubeClient, object_path
from vramguard.placement import NodeVerdict, PodClaims, Verdict, choose_gpus, describe_fit, filter_node, score_node
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


class Verbs:
    """The extender's three verbs over a :class:`ClusterState`."""

    def __init__(self, state: ClusterState, client: KubeClient | None) -> None:
        self.state = state
        self.client = client
        # Verdicts per pod shape (claims + class) and node, valid while the node's generation holds:
        # replicas of one Deployment share a shape, so a scheduling wave reuses almost every verdict.
        self._verdicts: OrderedDict[Hashable, dict[str, tuple[int | None, NodeVerdict]]] = OrderedDict()
        self._scores: OrderedDict[Hashable, dict[str, tuple[int | None, int]]] = OrderedDict()
        # Pods seen by filter, so bind does not need to fetch them (bounded, oldest dropped first).
        self._pending: OrderedDict[str, tuple[PodKey, PodClaims, ClassChoice]] = OrderedDict()

    def _prepare(self, pod: Mapping[str, Any]) -> tuple[PodKey, PodClaims, ClassChoice]:
        key = pod_key(pod)
        choice = self.state.choose_class(pod)
        claims = self.state.claims_for(pod, choice)
        self._pending[key.uid] = (key, claims, choice)
        self._pending.move_to_end(key.uid)
        while len(self._pending) > PENDING_PODS:
            self._pending.popitem(last=False)
        return key, claims, choice

    @staticmethod
    def _shape(claims: PodClaims, choice: ClassChoice) -> Hashable:
        return (claims.claims, claims.init, claims.refusal, choice.name)

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
        key, claims, choice = self._prepare(pod)
        cache: dict[str, tuple[int | None, NodeVerdict]] = self._cache(self._verdicts, self._shape(claims, choice))
        ledger = self.state.ledger
        passing: list[str] = []
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        for node in nodes:
            generation = ledger.generation(node)
            hit = cache.get(node)
            if hit is not None and hit[0] == generation and key.uid not in self.state.in_flight:
                verdict = hit[1]
            else:
                verdict = filter_node(ledger, node, claims, choice)
                cache[node] = (generation, verdict)
            if verdict.verdict is Verdict.PASS:
                passing.append(node)
            elif verdict.verdict is Verdict.UNRESOLVABLE:
                unresolvable[node] = verdict.message
            else:
                failed[node] = verdict.message
        return FilterOutcome(passing, failed, unresolvable)

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
        if self.state.is_bound(uid) == node:
            return ""  # already bound there: binding is idempotent
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
            await self._client().patch(
                object_path("/api/v1/pods", namespace, name),
                {"metadata": {"annotations": {PLACEMENT_ANNOTATION: assignment.annotation()}}},
            )
            await self._client().create(
                object_path("/api/v1/pods", namespace, name) + "/binding",
                {
                    "apiVersion": "v1",
                    "kind": "Binding",
                    "metadata": {"name": name, "namespace": namespace, "uid": uid},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": node},
                },
            )
        except ApiError as exc:
            self.state.abort_bind(uid)
            return f"binding {namespace}/{name} to {node} failed: {exc.message or exc}"
        except Exception as exc:
            self.state.abort_bind(uid)
            logger.exception("binding %s/%s to %s failed", namespace, name, node)
            return f"binding {namespace}/{name} to {node} failed: {exc}"
        self._pending.pop(uid, None)
        return ""

    def _client(self) -> KubeClient:
        if self.client is None:
            raise ApiError(503, "NoClient", "the extender has no API client")
        return self.client
