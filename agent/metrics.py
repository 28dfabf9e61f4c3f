"""The agent's Prometheus metrics, drawn from the latest cycle's :class:`agent.report.AgentView`.

A collector rather than gauges set one by one: devices and pods come and go, and a gauge set
once would keep reporting a pod that has left. Everything here describes the last cycle only.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from agent.nvml import Snapshot
from agent.report import AgentView

__all__ = ["AgentMetrics"]

PREFIX = "vramguard_agent"


class AgentMetrics(Collector):
    """Registers itself and the report-write counters in ``registry``; call :meth:`update` each cycle."""

    def __init__(self, registry: CollectorRegistry) -> None:
        """Register with ``registry`` (the one the HTTP app serves on ``/metrics``)."""
        self._view: AgentView | None = None
        self._snapshot: Snapshot | None = None
        self._nvml_up = False
        self._pods_listed = False
        self._updated: float | None = None
        self.writes = Counter(
            f"{PREFIX}_report_writes", "Node annotation writes (merge PATCH) that succeeded.", registry=registry
        )
        self.write_failures = Counter(
            f"{PREFIX}_report_write_failures", "Node annotation writes that failed (retried next cycle).",
            registry=registry,
        )
        self.lease_renewals = Counter(
            f"{PREFIX}_lease_renewals", "Renewals of the node's Lease that succeeded.", registry=registry
        )
        self.lease_failures = Counter(
            f"{PREFIX}_lease_renewal_failures", "Renewals of the node's Lease that failed (retried next cycle).",
            registry=registry,
        )
        self.overuse_events = Counter(
            f"{PREFIX}_overuse_events", "Over-use Events by result: created, existed (made before), failed.",
            ["result"], registry=registry,
        )
        registry.register(self)

    def update(self, view: AgentView, snapshot: Snapshot | None, *, pods_listed: bool) -> None:
        """Publish one cycle's readings."""
        self._view = view
        self._snapshot = snapshot
        self._nvml_up = snapshot is not None
        self._pods_listed = pods_listed
        self._updated = time.time()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """The gauges of the last cycle (nothing per device before the first one)."""
        up = GaugeMetricFamily(f"{PREFIX}_source_up", "Whether a source answered in the last cycle.",
                               labels=["source"])
        view = self._view
        up.add_metric(["nvml"], 1.0 if self._nvml_up else 0.0)
        up.add_metric(["podresources"], 1.0 if view is not None and view.placements_known else 0.0)
        up.add_metric(["apiserver-pods"], 1.0 if self._pods_listed else 0.0)
        yield up
        if self._updated is not None:
            last = GaugeMetricFamily(f"{PREFIX}_last_cycle_timestamp_seconds", "When the last cycle ended.")
            last.add_metric([], self._updated)
            yield last
        if self._snapshot is not None:
            problems = GaugeMetricFamily(f"{PREFIX}_nvml_problems", "NVML calls that failed in the last cycle.",
                                         labels=["call"])
            counts: dict[str, int] = {}
            for problem in self._snapshot.problems:
                counts[problem.call] = counts.get(problem.call, 0) + 1
            for call, count in sorted(counts.items()):
                problems.add_metric([call], count)
            yield problems
        if view is None:
            return
        yield from self._device_metrics(view)
        yield from self._pod_metrics(view)

    def _device_metrics(self, view: AgentView) -> Iterator[GaugeMetricFamily]:
        labels = ["device", "gpu_index", "uuid", "product"]
        total = GaugeMetricFamily(f"{PREFIX}_gpu_memory_total_bytes", "Total memory of the device (NVML).",
                                  labels=labels)
        used = GaugeMetricFamily(f"{PREFIX}_gpu_memory_used_bytes", "Memory in use on the device (NVML).",
                                 labels=["device"])
        reserved = GaugeMetricFamily(f"{PREFIX}_gpu_memory_reserved_bytes",
                                     "Memory the driver reserves on the device (NVML v2 query).", labels=["device"])
        foreign = GaugeMetricFamily(
            f"{PREFIX}_gpu_foreign_bytes",
            "Memory in use on the device that no GPU pod accounts for; absent when not measurable.",
            labels=["device"],
        )
        lost = GaugeMetricFamily(f"{PREFIX}_gpu_lost", "1 when NVML says the GPU is lost or needs a reset.",
                                 labels=["device"])
        for device in view.devices:
            lost.add_metric([device.id], 1.0 if device.lost else 0.0)
            if device.memory is None:
                continue
            total.add_metric(
                [device.id, str(device.gpu_index), device.uuid or "", device.product or ""], device.memory.total
            )
            used.add_metric([device.id], device.memory.used)
            if device.memory.reserved is not None:
                reserved.add_metric([device.id], device.memory.reserved)
            amount = view.foreign.get(device.id)
            if amount is not None:
                foreign.add_metric([device.id], amount)
        yield from (total, used, reserved, foreign, lost)

    def _pod_metrics(self, view: AgentView) -> Iterator[GaugeMetricFamily]:
        labels = ["namespace", "pod", "container", "device"]
        declared = GaugeMetricFamily(
            f"{PREFIX}_pod_vram_declared_bytes",
            "VRAM a container's spec reserves on a device it holds (vramguard's demand model).", labels=labels,
        )
        used = GaugeMetricFamily(
            f"{PREFIX}_pod_vram_used_bytes",
            "VRAM a container's processes use on a device (needs --host-pid).", labels=labels,
        )
        for row in view.usage:
            key = [row.namespace, row.pod, row.container, row.device]
            if row.declared_bytes is not None:
                declared.add_metric(key, row.declared_bytes)
            if row.used_bytes is not None:
                used.add_metric(key, row.used_bytes)
        yield declared
        yield used
        # Only pods over their declaration appear, at most one series per pod and device of the node.
        over = GaugeMetricFamily(
            "vramguard_pod_vram_overuse_bytes",
            "VRAM a pod uses on a device beyond what it declares there (counted by the ledger).",
            labels=["namespace", "pod", "device"],
        )
        for excess in view.overuse:
            over.add_metric([excess.namespace, excess.pod, excess.device], excess.excess_bytes)
        yield over
