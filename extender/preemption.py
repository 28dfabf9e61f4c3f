"""The ``preempt`` verb: victims chosen by the VRAM they free on the GPUs the pod needs.

kube-scheduler proposes victims per candidate node with its own plugins (blind to VRAM) and asks
the extender which nodes and victims it accepts. The extender may drop nodes and name other pods
of the node (the scheduler resolves UIDs against its own cache of the node's pods). vramguard keeps
the scheduler's victims that hold no GPU on the node (its plugins needed them for CPU, memory,
ports...), and replaces its GPU victims by :func:`vramguard.preemption.choose_victims`. A node where
no set of lower-priority pods frees enough VRAM is dropped: evicting there would help nobody.

``NumPDBViolations`` is counted again for the victims vramguard names, against the PodDisruptionBudgets
the extender watches. The labels of pods holding no GPU are not watched: those the scheduler chose
count as violations up to the scheduler's own count (never fewer than there may be).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

from extender.verbs import FilterOutcome
from extender.wire import ExtenderPreemptionArgs, preemption_result
from vramguard.cluster import ClusterState, pod_priority
from vramguard.io.http import parse_model
from vramguard.io.rsgi import Endpoint, Reply, json_reply
from vramguard.placement import PodClaims, Rule, filter_node
from vramguard.policy import ClassChoice
from vramguard.preemption import Holder, Victims, choose_victims

logger = logging.getLogger(__name__)

MAX_NODES = 5000
"""Candidate nodes one request may name (the scheduler sends at most its node count)."""
EVICTION_CHECKS_PER_FILTER = 256
"""Nodes per filter request on which a pod of higher priority gets the full eviction check (about
0.3 ms each). Past that, failures stay resolvable: ``preempt`` still drops nodes where eviction
does not help, so the cap costs a preemption attempt, never a wrong eviction."""


KEPT_NODES = 1 << 16
"""The most nodes :class:`LowestPriorities` keeps (more than any cluster has at once)."""


def _holders(state: ClusterState, node: str, priority: int) -> list[Holder]:
    """The pods holding GPUs on ``node``; evictable: seen bound by the watch and of lower priority."""
    ledger = state.ledger
    holders = []
    for uid in ledger.pods_on(node):
        held = ledger.holding(uid)
        if held is None:
            continue
        holder_priority = state.priority(uid)
        # Only pods the watch saw bound there: the scheduler knows them and can evict them.
        evictable = state.is_bound(uid) == node and holder_priority < priority
        record = state.records.get(uid)
        labels = record.labels.values if record is not None else {}
        holders.append(Holder(held[0], held[2], holder_priority, evictable, labels))
    return holders


def _any_evictable(state: ClusterState, node: str, priority: int) -> bool:
    """Whether :func:`_holders` would find an evictable pod on ``node``, without building them."""
    # Asked of every failing node of a filter (thousands on a cold one): the record's fields are
    # read directly, the priority first (in a wave of equal pods it is never lower).
    ledger, records = state.ledger, state.records
    for uid in ledger.holds_on(node):
        record = records.get(uid)
        # The watch's record with a node is what state.priority and state.is_bound read.
        if record is not None and record.priority < priority and record.node == node and ledger.holds(uid):
            return True
    return False


class LowestPriorities:
    """Per node, the lowest priority among the pods holding GPUs there, kept while the node's
    generation holds (a filter failing thousands of nodes asks each whether anyone there is of
    lower priority than the pod: a comparison instead of a walk over the node's pods).

    A holder whose pod the watch has not shown yet counts as the lowest possible: its priority may
    arrive without a change to the node's holdings, and the exact check then decides."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[int | None, float]] = {}

    def lowest(self, state: ClusterState, node: str, generation: int | None = None) -> float:
        """The lowest priority of the pods holding GPUs on ``node`` (infinite: none hold any);
        ``generation``: the node's, when the caller has just read it."""
        if generation is None:
            generation = state.ledger.generation(node)
        kept = self._kept.get(node)
        if kept is None or kept[0] != generation:
            if len(self._kept) >= KEPT_NODES:
                self._kept.clear()  # nodes come and go (autoscaling): what left must not pile up
            records = state.records
            priorities = (
                record.priority if (record := records.get(uid)) is not None else -math.inf
                for uid in state.ledger.holds_on(node)
            )
            kept = self._kept[node] = (generation, min(priorities, default=math.inf))
        return kept[1]


def mark_unhelpable(
    state: ClusterState, pod: Mapping[str, Any], outcome: FilterOutcome, lowest: LowestPriorities | None = None
) -> FilterOutcome:
    """Move the VRAM failures no eviction can cure to the unresolvable nodes, so that kube-scheduler
    does not preempt there for nothing (its own plugins would pick victims blind to VRAM).
    ``lowest``: the priorities kept per node (the app's), else each node's pods are walked."""
    if not outcome.failed:
        return outcome
    choice = state.choose_class(pod)
    claims = state.claims_for(pod, choice)
    priority = pod_priority(pod)
    rule = state.policy.budget_rule()
    failed = dict(outcome.failed)
    unresolvable = dict(outcome.unresolvable)
    checks = EVICTION_CHECKS_PER_FILTER
    generation = state.ledger.generation
    for node, message in outcome.failed.items():
        # Asked of thousands of nodes by a cold filter: one lookup per node in a wave of equal pods.
        now = generation(node)
        if now is None:
            continue  # not known yet: may become known
        # Cheap first: with nobody of lower priority there (a wave of equal pods), nothing helps.
        if (lowest is None or lowest.lowest(state, node, now) < priority) and _any_evictable(state, node, priority):
            inventory = state.ledger.inventory(node)
            if checks <= 0 or inventory is None:
                continue
            checks -= 1
            if choose_victims(inventory, rule, _holders(state, node, priority), claims) is not None:
                continue
        # The reason unchanged (nodes failing alike keep one line of the scheduler's event); the
        # scheduler's own message says that preemption does not help on such nodes.
        del failed[node]
        unresolvable[node] = message
    return FilterOutcome(outcome.passing, failed, unresolvable)


def victims_on(
    state: ClusterState, node: str, claims: PodClaims, choice: ClassChoice, priority: int,
    leaving: Collection[str] = (),
) -> tuple[list[Holder], Victims] | None:
    """The GPU holders of ``node`` and the lower-priority ones to evict so the pod fits its VRAM
    budgets there (no victims: it fits already); ``None`` where the node refuses the pod for another
    reason than VRAM, or where evicting every lower-priority holder is not enough. ``leaving``: UIDs
    of pods already on their way out (evicted, still terminating), counted as gone."""
    inventory = state.ledger.inventory(node)
    if inventory is None or not claims.claims:
        return None
    verdict = filter_node(state.ledger, node, claims, choice)
    if not verdict.ok and verdict.rule is not Rule.VRAM_BUDGET:
        return None  # refused for a reason no eviction changes
    holders = [h for h in _holders(state, node, priority) if h.pod.uid not in leaving]
    budgets = state.disruption_budgets.in_namespaces(h.pod.namespace for h in holders)
    chosen = choose_victims(inventory, state.policy.budget_rule(), holders, claims, budgets)
    return None if chosen is None else (holders, chosen)


def preempt(
    state: ClusterState, pod: Mapping[str, Any], proposed: Mapping[str, tuple[list[str], int]]
) -> dict[str, tuple[list[str], int]]:
    """Node -> (victim UIDs, PodDisruptionBudget violations) for the nodes where eviction helps."""
    choice = state.choose_class(pod)
    claims = state.claims_for(pod, choice)
    priority = pod_priority(pod)
    accepted: dict[str, tuple[list[str], int]] = {}
    for node, (uids, proposed_violations) in proposed.items():
        found = victims_on(state, node, claims, choice, priority)
        if found is None:
            continue
        holders, chosen = found
        violations = proposed_violations
        if not chosen.pods:
            victims = list(uids)  # VRAM is not what is short: the scheduler's choice stands
        else:
            gpu_holders = {h.pod.uid for h in holders}
            kept = [u for u in uids if u not in gpu_holders]
            victims = kept + [v.uid for v in chosen.pods]
            violations = chosen.pdb_violations + min(proposed_violations, len(kept))
        if victims:
            accepted[node] = (victims, violations)
    return accepted


def preempt_handler(
    state: ClusterState, synced: Any, preempting: Callable[[Mapping[str, Any]], None] | None = None
) -> Endpoint:
    """The endpoint of ``POST /preempt`` (body in, answer out); 503 until the cluster state is synced.
    ``preempting``: told of each pod for which kube-scheduler now preempts on a node vramguard
    accepted (the evictor then leaves that pod to the scheduler)."""

    async def handler(body: bytes) -> Reply:
        args = parse_model(body, ExtenderPreemptionArgs)
        proposed = args.proposed()
        if len(proposed) > MAX_NODES:
            return json_reply({"Error": f"more than {MAX_NODES} candidate nodes"}, 400)
        if not synced.is_set():
            # The result has no error field: a non-200 answer fails this preemption attempt.
            return json_reply({"Error": "vramguard: cluster state not synced yet"}, 503)
        accepted = preempt(state, args.Pod, proposed)
        if accepted and preempting is not None:
            preempting(args.Pod)
        logger.info("preempt: %d of %d candidate nodes accepted", len(accepted), len(proposed))
        return json_reply(preemption_result(accepted))

    return handler
