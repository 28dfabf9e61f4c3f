"""Preemption by VRAM: which lower-priority pods to evict so that a pod fits a node's GPU budgets.

kube-scheduler picks victims with its own plugins, which count ``nvidia.com/gpu`` replicas, not
bytes: it may evict a pod that frees no memory on the GPU the preemptor needs and leave the pod
that does. The extender's ``preempt`` verb gets the scheduler's candidate nodes and victims and
answers with the victims vramguard requires, computed here.

The choice mirrors the scheduler's own: first evict every pod of lower priority and check that the
preemptor then fits (else no set of victims on the node helps); then give pods back, the most
important first and, among equals, those holding the least VRAM on the node first, keeping each
one that still leaves room. What cannot be given back is the victim set: few pods, and those that
free the memory.

Pure: a scratch ledger per node, built from the node's inventory and its holders.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from vramguard.inventory import NodeInventory, Sharing
from vramguard.ledger import Claim, Ledger, PodRef
from vramguard.ledger_rule import BudgetRule
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
) -> tuple[PodRef, ...] | None:
    """The pods to evict so ``pod`` fits ``inventory``'s budgets: ``()`` when it fits already,
    ``None`` when evicting every evictable holder is still not enough."""
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
        return ()
    for holder in evictable:
        scratch.release(holder.pod.uid)
    # Reprieve the most important first; among equals the smallest, so the large holders go.
    order = sorted(evictable, key=lambda h: (-h.priority, held_bytes(inventory, h.claims), h.pod.uid))
    victims: list[PodRef] = []
    for holder in order:
        scratch.hold(node, holder.pod, holder.claims)
        if not scratch.fits(node, pod.claims).ok:
            scratch.release(holder.pod.uid)
            victims.append(holder.pod)
    return tuple(victims)
