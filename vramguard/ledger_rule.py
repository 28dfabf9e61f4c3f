"""The ledger's rule: when a GPU device is overcommitted, stated once, in exact integer bytes.

This module is the specification. :mod:`vramguard.ledger` keeps the counters the rule reads and
checks pods against it; :mod:`vramguard.ledger_fast` answers the same question faster for the common
case, and the differential tests hold it to the answers of the general check built on this module.

**Budget.** Each device (a physical GPU, or a MIG instance) has a budget of
``floor(memory * (1 - margin))`` bytes (:func:`budget_of`). The margin is a property of the
device, not of the pod asking (:class:`BudgetRule`, from the policy's ``budget``): a device that one
pod owns (one replica, not shared by DRA) keeps none by default, since a pod alone on a GPU must never
be refused for its own share; a shared device keeps its sharing strategy's margin, for what no
allowance models (fragmentation, the driver's own reservations). So the budget of a GPU is fixed
whatever the order pods arrive in.

**Claims.** A pod holds one :class:`Claim` per device replica it gets: a container asking for
``nvidia.com/gpu: 2`` makes two claims, each worth its per-GPU reservation: the engine's share *and*
its allowances (CUDA contexts, graphs, communication buffers; see
:mod:`vramguard.demand.allowances`), which may differ per GPU product. A claim may have
several candidate amounts (an init container and an app container sharing a replica); it holds the
largest on the device it lands on. A claim without an amount (``None``) holds a whole device:
its budget, or on an MPS device the share the device plugin gives one replica (:func:`whole_share`).

**Unknown placement.** With the stock device plugin the physical GPU behind a time-sliced replica is
the plugin's choice, blind to VRAM. Until the agent reports the real device, a claim on a node with
several devices of its resource could be on any of them. Each device ``g`` has ``R`` replica
slots, so the plugin can put at most ``R - (slots taken by known claims on g)`` unknown claims on it.
The rule is that no device can be overcommitted whatever the plugin picks (:func:`worst_case`)::

    for every device g:  known(g) + (sum of the largest R - known_slots(g) unknown claims) <= budget(g)

where the unknown claims are those of the node's pods for g's resource. It is exact: the adversary
can put exactly those claims on ``g`` (the kubelet admits only as many replicas as exist, so the
rest fit elsewhere). A device that is alone behind its resource, or that the agent reports, is
known. Exclusive devices (``R = 1``) fall out of the same rule: one claim each, at most the budget.
Under MPS the rule also holds, and each claim must fit one replica's share (the plugin caps it).
A node never holds more claims of a resource than it has replicas of it.

**Measured use.** The agent reports what each pod's processes use on each device. A pod holds, on
every device it is measured on, the larger of its claims there and what it uses (use within
:data:`MEASURED_TOLERANCE_BYTES` of the claims is allocator slack, and is not counted): the part
above its claims is *over-use* (:func:`over_use`), counted on
that device as known bytes. A declaration is a floor, not a ceiling: ``vramguard.io/vram: 1Mi`` on a
pod using 20 GiB holds 20 GiB once the agent has measured it. A pod measured on a device where none
of its claims is known to be (no placement reported) holds its use there on top of its claims,
wherever the device plugin put them: the safe reading. Memory used by processes outside any pod
(*foreign* bytes) is known bytes too.

A pod fits a node when adding its claims (known where the agent reported them or the device is
alone, unknown otherwise) keeps the rule true on every device of the node, whatever the device
plugin picks for the pod's unknown claims too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from vramguard.demand.model import Vram
from vramguard.inventory import Gpu, Sharing

MEASURED_TOLERANCE_BYTES = 512 * 1024 * 1024
"""Use above a pod's claims (their allowances included) on a device that is still not over-use:
allocator slack, which a shared device's margin covers."""


@dataclass(frozen=True, slots=True)
class BudgetRule:
    """The margin each device keeps free: by sharing strategy, and for devices one pod owns."""

    margins: Mapping[Sharing, Fraction]
    exclusive: Fraction | None = Fraction(0)
    """The margin of a device with one replica that no DRA driver shares; ``None``: its strategy's."""

    @classmethod
    def of(cls, rule: BudgetRule | Mapping[Sharing, Fraction]) -> BudgetRule:
        """``rule`` itself, or margins by strategy applied to every device alike."""
        return rule if isinstance(rule, BudgetRule) else cls(dict(rule), None)

    def margin(self, gpu: Gpu) -> Fraction:
        """The fraction of ``gpu``'s memory its budget keeps free."""
        if self.exclusive is not None and gpu.replicas == 1 and gpu.dra_sharing in (None, "exclusive"):
            return self.exclusive
        return self.margins.get(gpu.sharing, Fraction(0))

    def budget(self, gpu: Gpu) -> int:
        """:func:`budget_of` ``gpu`` under this rule."""
        return budget_of(gpu, self.margin(gpu))


def budget_of(gpu: Gpu, margin: Fraction) -> int:
    """The bytes the ledger lets pods hold on ``gpu``: its memory less the margin, rounded down."""
    keep = 1 - margin
    return gpu.memory_bytes * keep.numerator // keep.denominator


def whole_share(gpu: Gpu, budget: int) -> int:
    """What a claim without an amount holds on ``gpu``: the device, or one MPS replica's share."""
    return budget // gpu.replicas if gpu.sharing == "mps" else budget


def worst_case(known_bytes: int, free_slots: int, unknown_largest_first: list[int]) -> int:
    """What a device may hold whatever the device plugin picks: its known bytes plus the largest
    ``free_slots`` claims whose device is unknown.

    ``unknown_largest_first``: prefix sums of the unknown claims' bytes on this device, largest
    first (``[0, a1, a1 + a2, ...]``); a device with every slot known adds none.
    """
    last = len(unknown_largest_first) - 1
    return known_bytes + unknown_largest_first[max(0, min(free_slots, last))]


def over_budget_cause(gpu: Gpu) -> str:
    """Who can put a device over its budget before a pod vramguard places: pods bound without
    vramguard, and on a DRA device the claims of pods with ResourceClaims (the scheduler fills a
    device's memory to 100%, the budget keeps the margin)."""
    if gpu.dra_sharing is not None:
        return "claims of pods with ResourceClaims or pods bound without vramguard"
    return "pods bound without vramguard"


def over_use(claimed: int, used: int) -> int:
    """The bytes a pod uses beyond what it claims on a device, or 0 within the tolerance."""
    excess = used - claimed
    return excess if excess > MEASURED_TOLERANCE_BYTES else 0


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
    _last: list[Any] = field(default_factory=list, init=False, repr=False, compare=False)
    # A cache of the fast path (see vramguard.ledger_fast): the last (memory, whole, bytes, product).

    def bytes_on(self, memory_bytes: int, whole: int, product: str = "") -> int:
        """Bytes this claim holds on a device of ``memory_bytes`` whose whole share is ``whole``,
        allowances for ``product`` included."""
        last = self._last
        if last and last[0] == memory_bytes and last[1] == whole and last[3] == product:
            return last[2]  # type: ignore[no-any-return]
        amount = max(whole if v is None else v.on_device(memory_bytes, product, whole) for v in self.vram)
        last[:] = (memory_bytes, whole, amount, product)
        return amount


@dataclass(frozen=True, slots=True)
class PodRef:
    """A pod: its UID is the key, namespace and name are for messages."""

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


FITS = Fit(True)
