"""Prometheus metrics of the extender: the ledger as gauges and the extender's decisions.

The ledger's series are rendered by :class:`LedgerExposition` off the request path, in slices of
at most 2 ms with pauses between them in which the event loop serves the verbs, and ``/metrics`` sends the cached
text: a scrape never holds a filter up. They are aggregated per node and product by default (five
numbers a node); ``per_gpu`` adds the four series per GPU (labels node, gpu, product, sharing), which
at thousands of nodes is megabytes a scrape.

The same rendering adds the demand model's error in the field (:mod:`vramguard.accuracy`): per
engine and engine version (labels ``engine``, ``version`` only, so a handful of series whatever the
number of pods), the bytes predicted for and measured on the pods the agents measure, how many
pod-devices that is, and how many pods use more than predicted. The pods themselves are listed by
``vramguard audit``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import NoReturn

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from vramguard.accuracy import ModelAccuracy
from vramguard.cluster import ClusterState
from vramguard.io.kube import trim_c_heap

logger = logging.getLogger(__name__)

RENDER_INTERVAL_SECONDS = 10.0
"""How often the ledger's series are rendered; a scrape sees numbers at most this old."""
NODES_PER_STEP = 25
"""Nodes read, or ten times as many rows formatted, between two points where rendering may pause."""
RENDER_BUDGET_SECONDS = 0.002
"""Rendering runs at most this long at a time on the event loop..."""
RENDER_PAUSE_SECONDS = 0.008
"""...then sleeps this long, so that the verbs get the loop to themselves for most of the time (a
filter arriving meanwhile waits at most one budget, and runs its own slices back to back)."""

# (name, help) of the per-node and per-GPU families, in exposition order.
NODE_FAMILIES = (
    ("vramguard_node_budget_bytes", "VRAM budget of a node's GPUs of one product (memory less its margin)."),
    ("vramguard_node_reserved_bytes", "VRAM a node's GPUs of one product may hold in the worst case."),
    ("vramguard_node_free_bytes", "Budget left on a node's GPUs of one product in the worst case (sum over GPUs)."),
    ("vramguard_node_largest_free_bytes", "Largest budget left on any one of a node's GPUs of one product."),
    ("vramguard_node_gpus", "GPUs of one product on a node."),
    ("vramguard_node_overcommitted_gpus",
     "GPUs of one product on a node whose worst-case reservations exceed their budget."),
    ("vramguard_node_known_bytes",
     "VRAM held on a node's GPUs of one product by pods whose GPU is known (sum over GPUs)."),
    ("vramguard_node_unplaced_bytes",
     "VRAM the conservative rule holds on a node's GPUs of one product for pods whose GPU is not known "
     "yet (worst case less known, sum over GPUs): large without an agent report, though the GPUs may be idle."),
)
NODE_AGENT = ("vramguard_node_agent_report",
              "1 for the state of a GPU node's agent report: fresh (used), stale (its Lease expired: set "
              "aside) or none (no agent report: pods' GPUs are not known, the conservative rule holds them).")
NODE_PODS = ("vramguard_node_pods", "Pods known or intended on a node's GPUs.")
GPU_FAMILIES = (
    ("vramguard_gpu_budget_bytes", "VRAM budget of a GPU (memory less its margin)."),
    ("vramguard_gpu_reserved_bytes", "VRAM a GPU may hold in the worst case, whatever replica the plugin picked."),
    ("vramguard_gpu_free_bytes", "Budget left on a GPU in the worst case."),
    ("vramguard_gpu_pods", "Pods known or intended on a GPU."),
)
NAMESPACE_RESERVED = ("vramguard_namespace_reserved_bytes",
                      "VRAM held by a namespace's bound GPU pods (for chargeback).")
MODEL_FAMILIES = (
    ("vramguard_model_predicted_bytes",
     "VRAM the demand model predicts (reservation, allowances included) for the pods the agents measure, "
     "summed per engine and engine version (declared: a vramguard.io/vram declaration or MPS limit)."),
    ("vramguard_model_measured_bytes",
     "VRAM the agents measure those pods using, summed per engine and engine version."),
    ("vramguard_model_measured_pod_devices", "Pods times devices measured, per engine and engine version."),
    ("vramguard_model_pods_over_prediction",
     "Pods measured using more than predicted on a device (beyond the ledger's tolerance), per engine "
     "and engine version; vramguard audit lists them."),
)


@dataclass(frozen=True, slots=True)
class _Row:
    labels: str
    values: tuple[int, ...]


def _label(value: str) -> str:
    # The exposition format's escapes: product names come from nodes' labels or agents' reports.
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _node_rows(state: ClusterState, node: str) -> list[_Row]:
    by_product: dict[str, list[int]] = {}
    for usage in state.ledger.usage(node, pods=False):
        free = max(0, usage.budget - usage.worst_bytes)
        totals = by_product.setdefault(usage.device.product, [0, 0, 0, 0, 0, 0, 0, 0])
        totals[0] += usage.budget
        totals[1] += usage.worst_bytes
        totals[2] += free
        totals[3] = max(totals[3], free)
        totals[4] += 1
        totals[5] += usage.over_budget
        totals[6] += usage.known_bytes
        totals[7] += max(0, usage.worst_bytes - usage.known_bytes)
    return [_Row(f'node="{_label(node)}",product="{_label(product)}"', tuple(totals))
            for product, totals in sorted(by_product.items())]


def _gpu_rows(state: ClusterState, node: str) -> list[_Row]:
    return [
        _Row(f'gpu="{_label(u.device.id)}",node="{_label(node)}",product="{_label(u.device.product)}",'
             f'sharing="{_label(u.device.sharing)}"',
             (u.budget, u.worst_bytes, max(0, u.budget - u.worst_bytes), len(u.pods)))
        for u in state.ledger.usage(node, pods=True)
    ]


def render_ledger(state: ClusterState, *, per_gpu: bool = False,
                  step: int = NODES_PER_STEP) -> Generator[None, None, list[bytes]]:
    """The ledger's series in the Prometheus text format, built a step at a time, as pieces (one
    per slice) that are sent one after the other: never joined into one copy of the whole text.

    Each ``yield`` is a point where the caller may let other work run; the ledger may change
    between steps, so a node's numbers are consistent with themselves, not with every other
    node's (as with any scrape of a live system).
    """
    nodes = sorted(state.node_names())
    rows: list[_Row] = []
    pods: list[_Row] = []
    agents: list[_Row] = []
    gpus: list[_Row] = []
    by_namespace: dict[str, int] = {}
    accuracy = ModelAccuracy()
    for start in range(0, len(nodes), step):
        chunk = nodes[start:start + step]
        for node in chunk:
            rows.extend(_node_rows(state, node))
            accuracy.add_node(state, node)
            pods.append(_Row(f'node="{_label(node)}"', (len(state.ledger.pods_on(node)),)))
            inventory = state.ledger.inventory(node)
            if inventory is not None and inventory.devices:
                agents.append(_Row(f'node="{_label(node)}",state="{inventory.agent}"', (1,)))
            if per_gpu:
                gpus.extend(_gpu_rows(state, node))
        for namespace, count in state.ledger.namespace_bytes(chunk).items():
            by_namespace[namespace] = by_namespace.get(namespace, 0) + count
        yield
    namespaces = [_Row(f'namespace="{_label(namespace)}"', (count,))
                  for namespace, count in sorted(by_namespace.items())]
    tables = [(family, rows, column) for column, family in enumerate(NODE_FAMILIES)]
    tables.append((NODE_PODS, pods, 0))
    tables.append((NODE_AGENT, agents, 0))
    tables.extend((family, gpus, column) for column, family in enumerate(GPU_FAMILIES) if per_gpu)
    tables.append((NAMESPACE_RESERVED, namespaces, 0))
    model = [
        _Row(f'engine="{_label(engine)}",version="{_label(version)}"',
             (totals.predicted_bytes, totals.measured_bytes, totals.pod_devices, totals.pods_over))
        for (engine, version), totals in sorted(accuracy.engines.items())
    ]
    tables.extend((family, model, column) for column, family in enumerate(MODEL_FAMILIES))
    pieces: list[bytes] = []
    lines = step * 10
    for (name, help_text), table, column in tables:
        pieces.append(f"# HELP {name} {help_text}\n# TYPE {name} gauge\n".encode())
        for start in range(0, len(table), lines):
            pieces.append("".join(f"{name}{{{row.labels}}} {row.values[column]}\n"
                                  for row in table[start:start + lines]).encode())
            yield
    return pieces


def render_ledger_now(state: ClusterState, *, per_gpu: bool = False) -> bytes:
    """:func:`render_ledger` in one go, joined (tests, the benchmark)."""
    steps = render_ledger(state, per_gpu=per_gpu)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return b"".join(done.value)


TRIM_AFTER_BYTES = 1 << 20
"""A rendering at least this large is followed by handing the C heap's free pages back to the
system: its pieces come and go every interval, and the allocator would otherwise keep the space
that the previous rendering's pieces freed resident."""


class LedgerExposition:
    """The ledger's series, re-rendered every ``interval`` seconds in slices on the event loop and
    served from the cache: reading them costs a scrape nothing but sending the bytes."""

    def __init__(self, state: ClusterState, registry: CollectorRegistry, *, per_gpu: bool = False,
                 interval: float = RENDER_INTERVAL_SECONDS) -> None:
        self.state = state
        self.per_gpu = per_gpu
        self.interval = interval
        self.pieces: tuple[bytes, ...] = ()
        self.render_seconds = Gauge("vramguard_ledger_render_seconds",
                                    "Wall time of the last rendering of the ledger's series, slices and "
                                    "the requests served between them included.", registry=registry)
        self.size = Gauge("vramguard_ledger_exposition_bytes", "Size of the cached ledger series.",
                          registry=registry)
        self.rendered = Gauge("vramguard_ledger_rendered_timestamp_seconds",
                              "When the cached ledger series were last rendered (Unix time).", registry=registry)

    def cached(self) -> tuple[bytes, ...]:
        """The last rendering, in pieces to send one after the other (none before the first)."""
        return self.pieces

    async def render(self) -> None:
        """Render now, yielding to the event loop between slices, and replace the cache."""
        started = time.perf_counter()
        steps = render_ledger(self.state, per_gpu=self.per_gpu)
        slice_started = started
        while True:
            try:
                next(steps)
            except StopIteration as done:
                self.pieces = tuple(done.value)
                break
            if time.perf_counter() - slice_started >= RENDER_BUDGET_SECONDS:
                await asyncio.sleep(RENDER_PAUSE_SECONDS)
                slice_started = time.perf_counter()
        size = sum(map(len, self.pieces))
        if size >= TRIM_AFTER_BYTES:
            trim_c_heap()
        self.render_seconds.set(time.perf_counter() - started)
        self.size.set(size)
        self.rendered.set_to_current_time()

    async def refresh(self) -> None:
        """Render now; a failure is logged and the previous rendering kept (metrics never stop the verbs)."""
        try:
            await self.render()
        except Exception:
            logger.exception("rendering the ledger's metrics failed; serving the previous rendering")

    async def refresh_forever(self) -> NoReturn:
        """:meth:`refresh` every ``interval`` seconds (the first rendering is the caller's)."""
        while True:
            await asyncio.sleep(self.interval)
            await self.refresh()


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
        unreadable = GaugeMetricFamily(
            "vramguard_unreadable_gpu_nodes",
            "Nodes advertising GPUs whose memory vramguard cannot read (no GPU Feature Discovery, platform or "
            "instance-type labels, no agent report): refused where a namespace enforces, unguarded elsewhere.")
        unreadable.add_metric([], len(self.state.unreadable_nodes()))
        yield unreadable


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
    """Counters of the extender's decisions and the cached ledger series."""

    def __init__(
        self,
        registry: CollectorRegistry,
        state: ClusterState,
        oldest_in_flight: Callable[[], float] = lambda: 0.0,
        *,
        per_gpu: bool = False,
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
        self.node_cache_refused = Counter(
            "vramguard_extender_node_cache_refused",
            "Requests carrying full Node objects (the scheduler's nodeCacheCapable: false), answered "
            "with an error: only nodeCacheCapable: true is supported.",
            labelnames=("verb",),
            registry=registry,
        )
        self.ledger = LedgerExposition(state, registry, per_gpu=per_gpu)
        registry.register(HeldBackCollector(state))
