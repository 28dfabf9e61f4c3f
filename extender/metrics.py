"""Prometheus metrics of the extender: the ledger as gauges (read at scrape time) and decisions."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from vramguard.cluster import ClusterState


class LedgerCollector(Collector):
    """Per GPU budget, reserved (worst case) and free bytes, and pods per GPU; per namespace bytes."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Read the ledger now; nothing is cached between scrapes."""
        labels = ["node", "gpu", "product", "sharing"]
        budget = GaugeMetricFamily("vramguard_gpu_budget_bytes", "VRAM budget of a GPU (memory less headroom).",
                                   labels=labels)
        reserved = GaugeMetricFamily("vramguard_gpu_reserved_bytes",
                                     "VRAM a GPU may hold in the worst case, whatever replica the plugin picked.",
                                     labels=labels)
        free = GaugeMetricFamily("vramguard_gpu_free_bytes", "Budget left on a GPU in the worst case.",
                                 labels=labels)
        pods = GaugeMetricFamily("vramguard_gpu_pods", "Pods known or intended on a GPU.", labels=labels)
        for node in sorted(self.state.node_names()):
            for row in self.state.ledger.usage(node):
                values = [node, row.device.id, row.device.product, row.device.sharing]
                budget.add_metric(values, row.budget)
                reserved.add_metric(values, row.worst_bytes)
                free.add_metric(values, max(0, row.budget - row.worst_bytes))
                pods.add_metric(values, len(row.pods))
        namespaces = GaugeMetricFamily("vramguard_namespace_reserved_bytes",
                                       "VRAM held by a namespace's bound GPU pods (for chargeback).",
                                       labels=["namespace"])
        for namespace, count in sorted(self.state.ledger.namespace_bytes().items()):
            namespaces.add_metric([namespace], count)
        yield from (budget, reserved, free, pods, namespaces)


class HeldBackCollector(Collector):
    """``vramguard_nodes_held_back``: nodes placed on by no one while their pods are re-read."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Read the state now; non-zero for longer than a re-list takes means re-lists are failing."""
        held = GaugeMetricFamily("vramguard_nodes_held_back",
                                 "Nodes that fail filter while their pods are re-read after an oversized watch event.")
        held.add_metric([], len(self.state.suspects))
        yield held


class InFlightCollector(Collector):
    """Reservations whose Binding was sent but not yet seen by the pod watch, and the oldest's age."""

    def __init__(self, state: ClusterState, oldest_seconds: Callable[[], float]) -> None:
        self.state = state
        self.oldest_seconds = oldest_seconds

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Read now; an age that keeps growing means the watch (or housekeeping) is not confirming binds."""
        count = GaugeMetricFamily("vramguard_extender_in_flight_reservations",
                                  "GPU reservations held for binds the pod watch has not confirmed yet.")
        count.add_metric([], len(self.state.in_flight))
        oldest = GaugeMetricFamily("vramguard_extender_in_flight_oldest_seconds",
                                   "Age of the oldest unconfirmed reservation (0 when none).")
        oldest.add_metric([], self.oldest_seconds())
        yield from (count, oldest)


class ExtenderMetrics:
    """Counters of the extender's decisions."""

    def __init__(
        self, registry: CollectorRegistry, state: ClusterState, oldest_in_flight: Callable[[], float] = lambda: 0.0
    ) -> None:
        self.decisions = Counter(
            "vramguard_extender_decisions",
            "Filter verdicts per node and bind outcomes.",
            labelnames=("verb", "result"),
            registry=registry,
        )
        self.not_leader = Counter(
            "vramguard_extender_not_leader_refusals",
            "Verbs answered with an error because this replica does not hold the leader Lease.",
            labelnames=("verb",),
            registry=registry,
        )
        registry.register(InFlightCollector(state, oldest_in_flight))
        registry.register(LedgerCollector(state))
        registry.register(HeldBackCollector(state))
