"""DRA devices in the views people read: ``kubectl vram nodes`` rows and the metrics' aggregates.

A DRA device's *budget* is its whole memory: the scheduler fills a shareable device's memory
capacity up to 100% and vramguard cannot hold any of it back there (the shared devices' margin
applies where vramguard places pods itself); *reserved* is what allocated claims consume, as the
scheduler's allocator counts it, which is what the devices are shared by.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vramguard.dra.claims import DeviceUsage
from vramguard.report import GpuRow


def dra_rows(usages: Iterable[DeviceUsage]) -> list[GpuRow]:
    """One ``kubectl vram nodes`` row per DRA device: budget = memory, reserved = consumed by claims."""
    rows = []
    for usage in usages:
        device = usage.device
        pods = tuple(dict.fromkeys(p for share in usage.shares for p in (share.pods or (share.claim,))))
        rows.append(
            GpuRow(
                node=device.node,
                gpu=device.name,
                product=device.product if device.profile is None else f"{device.product} MIG {device.profile}",
                sharing=f"dra-{device.sharing}",
                replicas=len(usage.shares),
                resource=device.driver,
                memory_bytes=device.memory_bytes,
                budget_bytes=device.memory_bytes,
                reserved_bytes=usage.consumed_bytes,
                known_bytes=usage.consumed_bytes,
                pods=pods,
            )
        )
    return sorted(rows, key=lambda r: (r.node, r.resource, r.gpu))


@dataclass(frozen=True, slots=True)
class NodeProductUsage:
    """DRA devices of one product on one node, added up (what the metrics export)."""

    node: str
    product: str
    devices: int = 0
    memory_bytes: int = 0
    consumed_bytes: int = 0
    shares: int = 0
    overcommitted: int = 0
    """Devices whose claims consume more than they have (only claims written past the allocator)."""


def per_node_product(usages: Iterable[DeviceUsage]) -> list[NodeProductUsage]:
    """DRA device usage aggregated per node and product, sorted. Devices that share a counter set
    (a GPU and the MIG devices it could be cut into) are one piece of hardware: only the largest of
    them counts as a device and for memory; what claims consume on any of them counts."""
    usages = list(usages)
    largest: dict[tuple[str, str], DeviceUsage] = {}
    for usage in usages:
        for counter_set in usage.device.counter_sets:
            key = (usage.device.node, counter_set)
            if key not in largest or usage.device.memory_bytes > largest[key].device.memory_bytes:
                largest[key] = usage
    totals: dict[tuple[str, str], NodeProductUsage] = {}
    for usage in usages:
        sets = usage.device.counter_sets
        counted = not sets or any(largest[(usage.device.node, s)] is usage for s in sets)
        key = (usage.device.node, usage.device.product)
        old = totals.get(key, NodeProductUsage(*key))
        totals[key] = NodeProductUsage(
            old.node,
            old.product,
            old.devices + counted,
            old.memory_bytes + (usage.device.memory_bytes if counted else 0),
            old.consumed_bytes + usage.consumed_bytes,
            old.shares + len(usage.shares),
            old.overcommitted + (1 if usage.free_bytes < 0 else 0),
        )
    return [totals[key] for key in sorted(totals)]
