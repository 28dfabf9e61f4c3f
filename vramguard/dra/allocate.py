"""A small model of the scheduler's DRA allocator, for ``vramguard plan`` (offline, pure).

It places claims the way the structured allocator counts them: a device that is not shareable is
held whole by one allocation; a shareable device takes allocations while the memory they consume
(rounded up by its request policy) fits in its capacity, whatever the engines really use (that is
admission's business). Each request takes ``count`` distinct devices of one node that its class and
selectors match, trying ``firstAvailable`` alternatives in order; devices are tried in slice order,
so the first device with room is chosen, as the allocator does. ``allocationMode: All`` and
constraints (``matchAttribute``/``distinctAttribute``) are not modelled: such a request takes one
device per ``count``. Requests of classes that select no GPU (a NIC), or whose selectors vramguard
cannot read, are taken as satisfied: the plan models GPUs only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from vramguard.dra.claims import ClaimRequest, DeviceUsage
from vramguard.dra.classes import DeviceClassInfo
from vramguard.dra.devices import DraDevice
from vramguard.dra.fields import memory_text


@dataclass
class DeviceBook:
    """What one device holds: memory consumed, and who."""

    device: DraDevice
    consumed: int = 0
    holders: list[str] = field(default_factory=list)

    def room_for(self, amount: int) -> bool:
        """Whether another allocation consuming ``amount`` fits."""
        if not self.device.shareable:
            return not self.holders
        return self.consumed + amount <= self.device.memory_bytes

    @property
    def free(self) -> int:
        """Memory no allocation consumes."""
        return self.device.memory_bytes - self.consumed


@dataclass(frozen=True, slots=True)
class Allocation:
    """Where one claim's requests went: request name -> device names, on one node."""

    node: str
    devices: Mapping[str, tuple[str, ...]]


class DraBook:
    """Every DRA device and what is allocated on it, starting from the claims already allocated."""

    def __init__(self, devices: Sequence[DraDevice], usage: Mapping[str, DeviceUsage] | None = None) -> None:
        self.books = {d.uuid: DeviceBook(d) for d in devices}
        for uuid, used in (usage or {}).items():
            book = self.books.get(uuid)
            if book is not None:
                book.consumed = used.consumed_bytes
                book.holders = [p for share in used.shares for p in (share.pods or (share.claim,))]

    def nodes(self) -> list[str]:
        """Nodes with DRA devices, sorted."""
        return sorted({b.device.node for b in self.books.values()})

    def rows(self) -> Iterable[DeviceBook]:
        """Every device's book, by node then slice order."""
        return sorted(self.books.values(), key=lambda b: b.device.node)

    def allocate(
        self,
        holder: str,
        requests: Sequence[ClaimRequest],
        classes: Mapping[str, DeviceClassInfo],
        node: str,
    ) -> tuple[Allocation | None, str]:
        """Allocate every request on ``node`` (all or nothing); ``(None, why)`` when they do not fit."""
        tentative: dict[str, int] = {}
        taken: dict[str, set[str]] = {}
        chosen: dict[str, tuple[str, ...]] = {}
        on_node = [b for b in self.books.values() if b.device.node == node]
        for request in requests:
            reason = ""
            for alternative in request.alternatives:
                device_class = classes.get(alternative.device_class)
                if device_class is None:
                    reason = f"DeviceClass {alternative.device_class} is not known"
                    continue
                if not device_class.selects_gpus():
                    chosen[request.name] = ()  # not a GPU (or not readable): the plan does not model it
                    reason = ""
                    break
                picked: list[DeviceBook] = []
                for book in on_node:
                    if len(picked) == alternative.count:
                        break
                    if book.device.uuid in taken.get(request.name, set()):
                        continue
                    if not device_class.could_match([book.device], alternative.selector):
                        continue
                    amount = alternative.consumes_on(book.device)
                    extra = tentative.get(book.device.uuid, 0)
                    exclusive_taken = not book.device.shareable and book.device.uuid in tentative
                    if amount is None or exclusive_taken:
                        continue
                    if not book.room_for(amount + extra):
                        continue
                    picked.append(book)
                if len(picked) < alternative.count:
                    asked = memory_text(alternative.memory) if alternative.memory is not None else "its default"
                    best = memory_text(max(max((b.free for b in on_node), default=0), 0))
                    reason = (
                        f"request {alternative.name}: {alternative.count} device(s) of class "
                        f"{alternative.device_class} with room for {asked} not free (most free: {best})"
                    )
                    continue
                for book in picked:
                    amount = alternative.consumes_on(book.device) or 0
                    tentative[book.device.uuid] = tentative.get(book.device.uuid, 0) + amount
                    taken.setdefault(request.name, set()).add(book.device.uuid)
                chosen[request.name] = tuple(b.device.name for b in picked)
                reason = ""
                break
            if reason or request.name not in chosen:
                return None, reason or f"request {request.name}: nothing matches"
        for uuid, amount in tentative.items():
            self.books[uuid].consumed += amount
            self.books[uuid].holders.append(holder)
        return Allocation(node, chosen), ""
