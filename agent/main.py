"""Run the node agent: read NVML and the kubelet every few seconds, publish the report, serve metrics.

One cycle: an NVML snapshot, the kubelet's PodResources ``List``, the node's pods from an informer
(``spec.nodeName=<node>``, for pod UIDs, container IDs and declared VRAM), and with ``--host-pid``
the cgroup of every GPU process. Each source may fail on its own; the cycle then reports what the
others tell (see :mod:`agent.report`). The report is written to the Node's ``vramguard.io/gpus``
annotation with a JSON merge patch, only when it changed, and at most once per
``min_write_interval``: a change in between is written when the interval has passed. Liveness is
the node's Lease, renewed every quarter of its duration (:mod:`agent.liveness`), not the annotation. A pod using more
than it declares gets one Warning Event (:mod:`agent.events`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

from prometheus_client import CollectorRegistry

from agent.events import OveruseEvents
from agent.liveness import LeaseRenewer
from agent.metrics import AgentMetrics
from agent.nvml import Nvml, NvmlUnavailable, Snapshot, take_snapshot
from agent.podresources import PodDevices, PodResourcesSource, PodResourcesUnavailable
from agent.processes import owner_of
from agent.report import (
    NVML_UNAVAILABLE,
    PODRESOURCES_UNAVAILABLE,
    AgentView,
    PodInfo,
    build_view,
    owners_for,
    snapshot_pids,
)
from vramguard.codecs import AGENT_REPORT_ANNOTATION
from vramguard.lease import DEFAULT_AGENT_NAMESPACE

__all__ = ["AgentLoop", "AgentSettings", "NodePods", "NodeWriter", "ReportPublisher", "run"]

logger = logging.getLogger("vramguard.agent")

JSON = dict[str, Any]


class NodeWriter(Protocol):
    """Reads and writes the report annotation of one Node."""

    async def read(self) -> str | None:
        """The annotation's current value (``None``: absent)."""

    async def write(self, text: str) -> None:
        """Set the annotation to ``text``; raise on failure."""


class KubeNodeWriter:
    """:class:`NodeWriter` through the API server (``get`` and ``patch`` on ``nodes``)."""

    def __init__(self, client: Any, node: str) -> None:
        """``client``: a :class:`vramguard.io.kube.KubeClient`."""
        self._client = client
        self._path = f"/api/v1/nodes/{quote(node, safe='')}"

    async def read(self) -> str | None:
        """The annotation as the API server has it now."""
        node: JSON = await self._client.get(self._path)
        value = ((node.get("metadata") or {}).get("annotations") or {}).get(AGENT_REPORT_ANNOTATION)
        return value if isinstance(value, str) else None

    async def write(self, text: str) -> None:
        """A JSON merge patch touching this one annotation, so other writers' keys stay as they are."""
        await self._client.patch(self._path, {"metadata": {"annotations": {AGENT_REPORT_ANNOTATION: text}}})


class ReportPublisher:
    """Writes the report when it changed, at most once per ``min_interval`` seconds."""

    def __init__(
        self, writer: NodeWriter, min_interval: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """``clock``: seconds, monotonic (tests pass their own)."""
        self._writer = writer
        self._min_interval = min_interval
        self._clock = clock
        self._current: str | None = None
        self._known = False
        self._last_write: float | None = None

    @property
    def current(self) -> str | None:
        """What the annotation holds, as far as this publisher knows."""
        return self._current

    async def publish(self, text: str) -> bool:
        """Write ``text`` if it differs from the annotation and the interval allows; True when written.

        Raises what the writer raises; the caller retries on its next cycle.
        """
        if not self._known:
            # After a restart the annotation usually holds this very report: do not rewrite it.
            self._current = await self._writer.read()
            self._known = True
        if text == self._current:
            return False
        now = self._clock()
        if self._last_write is not None and now - self._last_write < self._min_interval:
            return False
        await self._writer.write(text)
        self._current = text
        self._last_write = now
        return True


class NodePods:
    """The node's pods by (namespace, name), fed by an informer (a :class:`vramguard.io.kube.Store`)."""

    def __init__(self) -> None:
        """Empty until the informer's first list."""
        self._pods: dict[tuple[str, str], PodInfo] = {}
        self.listed = False

    def replace(self, objects: list[JSON]) -> None:
        """The full state after a (re-)list."""
        pods: dict[tuple[str, str], PodInfo] = {}
        for obj in objects:
            info = PodInfo.from_pod(obj)
            if info is not None:
                pods[(info.namespace, info.name)] = info
        self._pods = pods
        self.listed = True

    def upsert(self, obj: JSON) -> None:
        """A pod was added or changed."""
        info = PodInfo.from_pod(obj)
        if info is not None:
            self._pods[(info.namespace, info.name)] = info

    def delete(self, obj: JSON) -> None:
        """A pod was deleted."""
        metadata = obj.get("metadata") or {}
        key = (str(metadata.get("namespace", "")), str(metadata.get("name", "")))
        current = self._pods.get(key)
        if current is not None and current.uid == metadata.get("uid", current.uid):
            del self._pods[key]

    def snapshot(self) -> dict[tuple[str, str], PodInfo] | None:
        """A copy of the pods, or ``None`` before the first list."""
        return dict(self._pods) if self.listed else None


@dataclass
class AgentLoop:
    """One agent's sources and sinks; :meth:`cycle` runs one round, :meth:`run` repeats it."""

    nvml: Nvml
    podresources: PodResourcesSource
    pods: NodePods
    publisher: ReportPublisher | None
    metrics: AgentMetrics
    proc_root: Path | None = None
    """The host's ``/proc`` when processes can be attributed (``--host-pid``), else ``None``."""
    interval: float = 5.0
    in_thread: Callable[..., Awaitable[Any]] = asyncio.to_thread
    lease: LeaseRenewer | None = None
    events: OveruseEvents | None = None
    cycles: int = 0
    last_view: AgentView | None = None
    _nvml_ready: bool = field(default=False, init=False)
    _last_problems: frozenset[str] = field(default=frozenset(), init=False)

    async def cycle(self) -> AgentView:
        """Read every source once, update the metrics, publish the report; never raises for a source."""
        snapshot = await self._snapshot()
        pod_devices = await self._pod_devices()
        pods = self.pods.snapshot()
        owners = None
        if self.proc_root is not None:
            owners = owners_for(snapshot_pids(snapshot), partial(owner_of, proc_root=self.proc_root))
        view = build_view(snapshot, pod_devices, pods, owners)
        self.metrics.update(view, snapshot, pods_listed=pods is not None)
        self._log_changes(view, snapshot)
        published = True
        if self.publisher is not None:
            try:
                if await self.publisher.publish(view.report.encode()):
                    self.metrics.writes.inc()
                    logger.info("report written: %d devices, %d pods", len(view.report.gpus),
                                len(view.report.placements))
            except Exception as exc:
                # Any failure (API server down, RBAC, timeout): keep measuring, retry next cycle.
                published = False
                self.metrics.write_failures.inc()
                logger.warning("writing the report failed: %s", exc)
        await self._renew_lease(published)
        if self.events is not None and pods is not None:
            results = await self.events.report(view.overuse, (p.uid for p in pods.values()))
            for result, count in results.items():
                if count:
                    self.metrics.overuse_events.labels(result).inc(count)
        self.cycles += 1
        self.last_view = view
        return view

    async def _renew_lease(self, published: bool) -> None:
        """Renew the Lease when the annotation holds this cycle's view (or needed no write): an agent
        that cannot publish lets its Lease lapse, and readers stop trusting the stale report."""
        if self.lease is None or not published:
            return
        try:
            if await self.lease.renew():
                self.metrics.lease_renewals.inc()
        except Exception as exc:
            self.metrics.lease_failures.inc()
            logger.warning("renewing the lease %s failed: %s", self.lease.name, exc)

    async def run(self, stop: asyncio.Event) -> None:
        """Cycle every ``interval`` seconds until ``stop`` is set."""
        try:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    await self.cycle()
                except Exception:
                    # A bug in one cycle must not end the DaemonSet's only job.
                    logger.exception("agent cycle failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(0.0, self.interval - (time.monotonic() - started)))
        finally:
            if self._nvml_ready:
                self.nvml.shutdown()
                self._nvml_ready = False

    async def _snapshot(self) -> Snapshot | None:
        if not self._nvml_ready:
            try:
                await self.in_thread(self.nvml.init)
            except NvmlUnavailable as exc:
                if self.cycles == 0 or "nvml" not in self._last_problems:
                    logger.warning("NVML unavailable (retrying each cycle): %s", exc)
                return None
            self._nvml_ready = True
        result: Snapshot = await self.in_thread(take_snapshot, self.nvml)
        if not result.complete:
            # The GPU count itself failed (driver unloaded or upgraded under us): start NVML afresh.
            await self.in_thread(self.nvml.shutdown)
            self._nvml_ready = False
        return result

    async def _pod_devices(self) -> list[PodDevices] | None:
        try:
            found = await self.in_thread(self.podresources.list)
        except PodResourcesUnavailable as exc:
            if "podresources" not in self._last_problems:
                logger.warning("kubelet PodResources unavailable (placements unknown): %s", exc)
            return None
        return list(found)

    def _log_changes(self, view: AgentView, snapshot: Snapshot | None) -> None:
        """Log each problem when it appears and when it clears, not every cycle."""
        # The sources' own failures were logged with their reasons when they were read.
        problems = set(view.notes) - {NVML_UNAVAILABLE, PODRESOURCES_UNAVAILABLE}
        if snapshot is None:
            problems.add("nvml")
        if not view.placements_known:
            problems.add("podresources")
        if snapshot is not None:
            problems.update(f"NVML {p.where}: {p.call} failed: {p.error}" for p in snapshot.problems)
        for note in sorted(problems - self._last_problems):
            if note not in ("nvml", "podresources"):
                logger.warning("%s", note)
        for note in sorted(self._last_problems - problems):
            logger.info("resolved: %s", note)
        self._last_problems = frozenset(problems)


@dataclass(frozen=True)
class AgentSettings:
    """Validated once at start-up and passed explicitly."""

    node: str
    host: str
    port: int
    nvml: Nvml
    podresources: PodResourcesSource
    connection: Any
    """A :class:`vramguard.io.kube.Connection`; ``None`` runs without the API server (no report written)."""
    proc_root: Path | None = None
    interval: float = 5.0
    min_write_interval: float = 10.0
    lease_namespace: str = DEFAULT_AGENT_NAMESPACE
    holder: str = ""
    """The agent pod's name (the Lease's holderIdentity); the node's name when empty."""
    lease_duration: int = 40


async def run(settings: AgentSettings, stop: asyncio.Event | None = None) -> None:
    """Serve metrics and probes, and cycle until SIGTERM (or ``stop``)."""
    from vramguard.io.http import Readiness, create_app  # noqa: PLC0415 - vramguard.io loads aiohttp; --once needs none
    from vramguard.io.kube import Informer, KubeClient  # noqa: PLC0415
    from vramguard.io.server import run_https  # noqa: PLC0415

    stop = stop or asyncio.Event()
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry)
    pods = NodePods()
    client = KubeClient(settings.connection) if settings.connection is not None else None
    publisher = ReportPublisher(KubeNodeWriter(client, settings.node), settings.min_write_interval) if client else None
    lease = events = None
    if client is not None:
        lease = LeaseRenewer(
            client, settings.lease_namespace, settings.node, settings.holder or settings.node, settings.lease_duration
        )
        events = OveruseEvents(client, settings.node)
    loop = AgentLoop(
        settings.nvml, settings.podresources, pods, publisher, metrics, settings.proc_root, settings.interval,
        lease=lease, events=events,
    )
    # Ready once a cycle has run: from then on the metrics say what is known, failures included.
    readiness = Readiness({"first-cycle": lambda: loop.cycles > 0})
    app = create_app(registry=registry, readiness=readiness, metrics_prefix=PREFIX_HTTP)
    tasks: list[asyncio.Task[None]] = []
    if client is not None:
        selector = {"fieldSelector": f"spec.nodeName={settings.node}"}
        tasks.append(asyncio.create_task(Informer(client, "/api/v1/pods", pods, selector).run()))
    loop_stop = asyncio.Event()
    tasks.append(asyncio.create_task(loop.run(loop_stop)))
    try:
        await run_https(app, settings.host, settings.port, None, stop=stop)
    finally:
        loop_stop.set()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if client is not None:
            await client.close()


PREFIX_HTTP = "vramguard_agent"
