"""Preemption for VRAM where kube-scheduler's own never starts.

kube-scheduler preempts only where its plugins need a victim. On a time-sliced GPU with replicas
left (its usual state when the VRAM is full) they need none: the dry run finds "no victim" for a
pod the extender refused for VRAM, so the scheduler gives up before it asks ``/preempt``. The pod
of high priority would wait behind pods of lower priority forever.

The evictor closes that gap. The filter tells it of each pod refused for VRAM on every node where
eviction may help; kube-scheduler's ``/preempt`` tells it of the pods the scheduler preempts for
itself. A pod still waiting after :data:`GRACE_SECONDS`, not preempted by the scheduler, read again
from the API server (unbound, not nominated, not deleted, allowed to preempt), gets its victims
chosen as ``/preempt`` chooses them (:func:`extender.preemption.victims_on`), on the node
kube-scheduler's ``pickOneNodeForPreemption`` would pick among those, and evicted through the
Eviction API, so a PodDisruptionBudget holds even against a race: a node whose victims a budget
protects is not used at all (stricter than kube-scheduler, which deletes such victims when nothing
else helps). Each victim gets a ``Preempted`` Event, as kube-scheduler gives its victims.

Pods the evictor evicted count as gone while they terminate: a pod refused again meanwhile finds
its room already coming and evicts nobody else. Only the serving replica (the leader) evicts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any

from cachetools import LRUCache
from prometheus_client import CollectorRegistry, Counter

from extender.events import post_pod_event
from extender.preemption import victims_on
from vramguard.cluster import ClusterState, pod_key, pod_priority
from vramguard.io.kube import ApiError, KubeClient, object_path
from vramguard.ledger_rule import PodRef
from vramguard.preemption import Holder, Victims

logger = logging.getLogger(__name__)

GRACE_SECONDS = 2.0
"""How long after a refusal the evictor waits for kube-scheduler's own preemption: the scheduler
asks ``/preempt`` in the same scheduling cycle as the refused filter (milliseconds later)."""
PERIOD_SECONDS = 1.0
"""How often the waiting pods are looked at."""
WAITING_PODS = 4096
"""The most refused pods remembered at once (the least recently refused are forgotten first: the
scheduler refuses them again, and they are remembered again, on its next attempt)."""
NODES_PER_POD = 256
"""Nodes on which one pod's victims are worked out (about 0.3 ms each)."""
LEAVING_SECONDS = 600.0
"""How long an evicted pod counts as leaving when the watch never shows it gone."""
EVENT_REASON = "Preempted"


@dataclass(frozen=True, slots=True)
class _Refusal:
    namespace: str
    name: str
    since: float
    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Choice:
    node: str
    victims: tuple[Holder, ...]


def preempts(pod: Mapping[str, Any]) -> bool:
    """Whether the pod may preempt others: ``spec.preemptionPolicy`` is not ``Never``."""
    spec = pod.get("spec")
    return not (isinstance(spec, Mapping) and spec.get("preemptionPolicy") == "Never")


def pick_node(choices: list[_Choice]) -> _Choice | None:
    """kube-scheduler's ``pickOneNodeForPreemption`` (v1.36) over nodes without PDB violations: the
    lowest highest victim priority, then the lowest sum of priorities, then the fewest victims;
    the node name last, so the choice is stable."""
    def key(choice: _Choice) -> tuple[int, int, int, str]:
        priorities = [victim.priority for victim in choice.victims]
        return max(priorities), sum(priorities), len(priorities), choice.node

    return min((c for c in choices if c.victims), key=key, default=None)


class Evictor:
    """Evicts, for pods refused for VRAM, the lower-priority pods whose VRAM they need, where
    kube-scheduler's preemption does not (see the module docstring)."""

    def __init__(
        self,
        state: ClusterState,
        client: KubeClient | None,
        registry: CollectorRegistry | None = None,
        *,
        serving: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = state
        self.client = client
        self.serving = serving
        self.clock = clock
        self._waiting: LRUCache[str, _Refusal] = LRUCache(WAITING_PODS)
        self._leaving: dict[str, float] = {}
        """UID -> when evicted, for the pods evicted and not yet seen gone."""
        self.evictions = Counter(
            "vramguard_extender_vram_evictions",
            "Pods evicted by the extender to free VRAM for a pod of higher priority, by outcome.",
            labelnames=("outcome",),
            registry=registry,
        )

    def refused(self, pod: Mapping[str, Any], passing: list[str], helpable: Mapping[str, str]) -> None:
        """A filter answered: ``helpable`` the nodes refused for reasons eviction may cure."""
        key = pod_key(pod)
        if passing or not helpable or not key.uid or not preempts(pod):
            self._waiting.pop(key.uid, None)
            return
        earlier = self._waiting.get(key.uid)
        since = earlier.since if earlier is not None else self.clock()
        self._waiting[key.uid] = _Refusal(key.namespace, key.name, since, tuple(islice(helpable, NODES_PER_POD)))

    def preempting(self, pod: Mapping[str, Any]) -> None:
        """kube-scheduler preempts for the pod itself (``/preempt`` accepted a node)."""
        self._waiting.pop(pod_key(pod).uid, None)

    def waiting(self) -> int:
        """How many refused pods are remembered."""
        return len(self._waiting)

    async def run(self) -> None:
        """Look at the waiting pods every :data:`PERIOD_SECONDS`, until cancelled."""
        while True:
            await asyncio.sleep(PERIOD_SECONDS)
            try:
                await self.run_once()
            except Exception:
                logger.exception("preemption for VRAM failed; retrying later")

    async def run_once(self) -> int:
        """Evict for each pod refused longer than :data:`GRACE_SECONDS` ago; returns how many
        pods were evicted."""
        self._forget_gone()
        if not self.serving() or self.client is None:
            return 0
        now = self.clock()
        due = [uid for uid, refusal in list(self._waiting.items()) if now - refusal.since >= GRACE_SECONDS]
        evicted = 0
        for uid in due:
            refusal = self._waiting.pop(uid, None)
            if refusal is not None:
                evicted += await self._preempt_for(uid, refusal)
        return evicted

    def _forget_gone(self) -> None:
        now = self.clock()
        for uid, since in list(self._leaving.items()):
            if self.state.ledger.holding(uid) is None or now - since > LEAVING_SECONDS:
                del self._leaving[uid]

    async def _preempt_for(self, uid: str, refusal: _Refusal) -> int:
        pod = await self._current(uid, refusal)
        if pod is None:
            return 0
        choice = self.state.choose_class(pod)
        claims = self.state.claims_for(pod, choice)
        priority = pod_priority(pod)
        choices = []
        for node in refusal.nodes:
            found = victims_on(self.state, node, claims, choice, priority, self._leaving)
            if found is None or found[1].pdb_violations:
                continue
            victims = _victim_holders(found[0], found[1])
            if not victims:
                return 0  # it fits there once the pods already leaving are gone: nothing to evict
            choices.append(_Choice(node, victims))
        chosen = pick_node(choices)
        if chosen is None:
            return 0
        key = pod_key(pod)
        logger.info("preempting for %s/%s on %s: evicting %s", key.namespace, key.name, chosen.node,
                    ", ".join(f"{v.pod.namespace}/{v.pod.name}" for v in chosen.victims))
        evicted = 0
        for victim in chosen.victims:
            if not await self._evict(victim.pod, key.namespace, key.name, chosen.node):
                break  # refused (a budget, a race): the next refusal of the pod chooses again
            evicted += 1
        return evicted

    async def _current(self, uid: str, refusal: _Refusal) -> Mapping[str, Any] | None:
        """The pod as the API server has it now, when it still waits for a node; else ``None``."""
        try:
            pod = await self._client().get(object_path("/api/v1/pods", refusal.namespace, refusal.name))
        except ApiError as exc:
            if exc.status != 404:
                logger.warning("pod %s/%s not read for preemption: %s", refusal.namespace, refusal.name,
                               exc.message or exc)
            return None
        if not isinstance(pod, Mapping) or pod_key(pod).uid != uid or not preempts(pod):
            return None
        metadata, spec, status = (pod.get(key) or {} for key in ("metadata", "spec", "status"))
        if metadata.get("deletionTimestamp") or spec.get("nodeName") or status.get("nominatedNodeName"):
            return None  # going, bound, or nominated: kube-scheduler's own preemption has it
        return pod

    async def _evict(self, victim: PodRef, namespace: str, name: str, node: str) -> bool:
        """Evict one victim (its UID as a precondition); whether the API server accepted."""
        path = object_path("/api/v1/pods", victim.namespace, victim.name) + "/eviction"
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": victim.name, "namespace": victim.namespace},
            "deleteOptions": {"preconditions": {"uid": victim.uid}},
        }
        try:
            await self._client().create(path, body)
        except ApiError as exc:
            outcome = "budget" if exc.status == 429 else "gone" if exc.status in (404, 409) else "error"
            self.evictions.labels(outcome).inc()
            logger.info("eviction of %s/%s refused: %s", victim.namespace, victim.name, exc.message or exc)
            return False
        self.evictions.labels("evicted").inc()
        self._leaving[victim.uid] = self.clock()
        await post_pod_event(self._client(), victim, EVENT_REASON,
                             f"Preempted by pod {namespace}/{name} on node {node}: its VRAM is needed", "Normal")
        return True

    def _client(self) -> KubeClient:
        if self.client is None:
            raise ApiError(503, "NoClient", "the extender has no API client")
        return self.client


def _victim_holders(holders: list[Holder], victims: Victims) -> tuple[Holder, ...]:
    by_uid = {holder.pod.uid: holder for holder in holders}
    return tuple(by_uid[v.uid] for v in victims.pods)
