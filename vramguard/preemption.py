"""Preemption by VRAM: which lower-priority pods to evict so that a pod fits a node's GPU budgets.

kube-scheduler picks victims with its own plugins, which count ``nvidia.com/gpu`` replicas, not
bytes: it may evict a pod that frees no memory on the GPU the preemptor needs and leave the pod
that does. The extender's ``preempt`` verb gets the scheduler's candidate nodes and victims and
answers with the victims vramguard requires, computed here.

The choice mirrors the scheduler's own (``SelectVictimsOnNode`` of kube-scheduler's
DefaultPreemption): first evict every pod of lower priority and check that the preemptor then fits
(else no set of victims on the node helps); then give pods back, keeping each one that still leaves
room. PodDisruptionBudgets come first, as there: the candidates, the most important first and,
among equals, those holding the least VRAM on the node first, are split into those whose eviction
would take a matching budget below its ``status.disruptionsAllowed`` and the others; the former
are given back first, so a protected pod is evicted only where no unprotected one frees the room,
and each one evicted all the same counts as a PDB violation. What cannot be given back is the
victim set: few pods, those that free the memory, unprotected ones where possible.

Pure: a scratch ledger per node, built from the node's inventory and its holders.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from vramguard.inventory import NodeInventory, Sharing
from vramguard.ledger import Claim, Ledger, PodRef
from vramguard.ledger_rule import BudgetRule
from vramguard.node_selection import label_requirement_holds
from vramguard.placement import PodClaims


@dataclass(frozen=True, slots=True)
class Holder:
    """A pod holding GPUs on the node."""

    pod: PodRef
    claims: tuple[Claim, ...]
    priority: int
    evictable: bool = True
    """Whether the scheduler may evict it: bound as the API server says (not a bind in flight) and
    of lower priority than the preemptor."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """The pod's labels, which PodDisruptionBudgets select."""


@dataclass(frozen=True, slots=True)
class Victims:
    """The pods to evict on one node, and how many of them a PodDisruptionBudget protects."""

    pods: tuple[PodRef, ...]
    pdb_violations: int = 0


@dataclass(frozen=True, slots=True)
class DisruptionBudget:
    """A PodDisruptionBudget (``policy/v1``) as preemption reads it."""

    namespace: str
    selector: Mapping[str, Any] | None
    """``spec.selector``; ``None`` or empty selects no pod (as kube-scheduler's preemption reads it)."""
    allowed: int
    """``status.disruptionsAllowed``, kept current by the disruption controller."""
    disrupted: frozenset[str] = frozenset()
    """``status.disruptedPods``: pods whose eviction the API server has already counted."""


_SELECTOR_OPERATORS = frozenset({"In", "NotIn", "Exists", "DoesNotExist"})


def read_budget(obj: Mapping[str, Any]) -> DisruptionBudget:
    """A PodDisruptionBudget object as :class:`DisruptionBudget`; malformed fields select nothing
    and allow nothing."""
    metadata, spec, status = (_mapping(obj.get(key)) for key in ("metadata", "spec", "status"))
    allowed = status.get("disruptionsAllowed")
    selector = spec.get("selector")
    return DisruptionBudget(
        str(metadata.get("namespace", "")),
        selector if isinstance(selector, Mapping) else None,
        allowed if isinstance(allowed, int) and not isinstance(allowed, bool) else 0,
        frozenset(k for k in _mapping(status.get("disruptedPods")) if isinstance(k, str)),
    )


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Whether a PodDisruptionBudget's label selector selects a pod with ``labels``: metav1's
    ``LabelSelectorAsSelector``, where a nil or empty selector, and an invalid one, select nothing
    (``filterPodsWithPDBViolation``, kube-scheduler v1.36)."""
    if selector is None:
        return False
    match_labels = selector.get("matchLabels") or {}
    expressions = selector.get("matchExpressions") or []
    if not isinstance(match_labels, Mapping) or not isinstance(expressions, list):
        return False
    if not match_labels and not expressions:
        return False
    if not all(isinstance(value, str) and labels.get(key) == value for key, value in match_labels.items()):
        return False
    return all(_requirement_holds(requirement, labels) for requirement in expressions)


def _requirement_holds(requirement: Any, labels: Mapping[str, str]) -> bool:
    """One ``matchExpressions`` entry. A LabelSelector allows only four of a node selector's
    operators, with the same meaning; any other makes the selector invalid, which selects nothing."""
    return (
        isinstance(requirement, Mapping)
        and requirement.get("operator") in _SELECTOR_OPERATORS
        and label_requirement_holds(requirement, labels)
    )


def split_by_budgets(
    holders: Sequence[Holder], budgets: Sequence[DisruptionBudget]
) -> tuple[list[Holder], list[Holder]]:
    """kube-scheduler's ``filterPodsWithPDBViolation`` (v1.36): walking ``holders`` in order (the
    most important first), each one selected by a budget takes one of its allowed disruptions (not
    when the budget already counts it as disrupted); a pod that takes one the budget does not have
    is *violating*. Returns (violating, not violating), each in the given order."""
    allowed = [budget.allowed for budget in budgets]
    violating: list[Holder] = []
    other: list[Holder] = []
    for holder in holders:
        violated = False
        if holder.labels:  # a pod without labels matches no budget
            for index, budget in enumerate(budgets):
                if budget.namespace != holder.pod.namespace or not selects(budget.selector, holder.labels):
                    continue
                if holder.pod.name in budget.disrupted:
                    continue
                allowed[index] -= 1
                if allowed[index] < 0:
                    violated = True
        (violating if violated else other).append(holder)
    return violating, other


class DisruptionBudgets:
    """The cluster's PodDisruptionBudgets by namespace, fed by a watch (an informer's store)."""

    def __init__(self) -> None:
        self._by_namespace: dict[str, dict[str, DisruptionBudget]] = {}

    def replace(self, objects: Sequence[Mapping[str, Any]]) -> None:
        """The full list."""
        self._by_namespace.clear()
        for obj in objects:
            self.upsert(obj)

    def upsert(self, obj: Mapping[str, Any]) -> None:
        """A budget added or changed (its status follows the pods it selects)."""
        budget = read_budget(obj)
        self._by_namespace.setdefault(budget.namespace, {})[_name(obj)] = budget

    def delete(self, obj: Mapping[str, Any]) -> None:
        """A budget deleted."""
        namespace = str(_mapping(obj.get("metadata")).get("namespace", ""))
        budgets = self._by_namespace.get(namespace)
        if budgets is not None:
            budgets.pop(_name(obj), None)
            if not budgets:
                del self._by_namespace[namespace]

    def in_namespaces(self, namespaces: Iterable[str]) -> tuple[DisruptionBudget, ...]:
        """The budgets of these namespaces (the only ones that can select their pods)."""
        return tuple(
            budget for namespace in dict.fromkeys(namespaces)
            for budget in self._by_namespace.get(namespace, {}).values()
        )


def held_bytes(inventory: NodeInventory, claims: Sequence[Claim]) -> int:
    """What ``claims`` hold on the node: each at its size on the largest device of its resource."""
    total = 0
    for claim in claims:
        devices = inventory.devices_for(claim.resource)
        sizes = [claim.bytes_on(d.memory_bytes, d.memory_bytes, d.product) for d in devices]
        total += max(sizes, default=0)
    return total


def choose_victims(
    inventory: NodeInventory,
    rule: BudgetRule | Mapping[Sharing, Fraction],
    holders: Sequence[Holder],
    pod: PodClaims,
    budgets: Sequence[DisruptionBudget] = (),
) -> Victims | None:
    """The pods to evict so ``pod`` fits ``inventory``'s budgets: no pods when it fits already,
    ``None`` when evicting every evictable holder is still not enough. ``budgets``: the
    PodDisruptionBudgets that may select the holders (see the module docstring)."""
    node = inventory.node
    scratch = Ledger(rule)
    scratch.upsert_node(inventory)
    for holder in holders:
        if not holder.evictable:
            scratch.hold(node, holder.pod, holder.claims)
    if not scratch.fits(node, pod.claims).ok:
        return None
    evictable = [h for h in holders if h.evictable]
    for holder in evictable:
        scratch.hold(node, holder.pod, holder.claims)
    if scratch.fits(node, pod.claims).ok:
        return Victims(())
    for holder in evictable:
        scratch.release(holder.pod.uid)
    # The most important first; among equals the smallest, so the large holders go.
    order = sorted(evictable, key=lambda h: (-h.priority, held_bytes(inventory, h.claims), h.pod.uid))
    violating, other = split_by_budgets(order, budgets)

    def reprieved(holder: Holder) -> bool:
        scratch.hold(node, holder.pod, holder.claims)
        if scratch.fits(node, pod.claims).ok:
            return True
        scratch.release(holder.pod.uid)
        return False

    # Protected pods are given back first: they go only where the others cannot make the room.
    evicted_violating = [h for h in violating if not reprieved(h)]
    evicted = [*evicted_violating, *(h for h in other if not reprieved(h))]
    rank = {h.pod.uid: index for index, h in enumerate(order)}
    evicted.sort(key=lambda h: rank[h.pod.uid])
    return Victims(tuple(h.pod for h in evicted), len(evicted_violating))


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _name(obj: Mapping[str, Any]) -> str:
    return str(_mapping(obj.get("metadata")).get("name", ""))
