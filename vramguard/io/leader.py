"""Leader election over one ``coordination.k8s.io/v1`` Lease: the acquire/renew/release loop.

The decisions are :mod:`vramguard.election`'s; this module reads and writes the Lease. Every write
is conditional on the ``resourceVersion`` read (a PUT with it, or a create that fails if the Lease
exists), so of two candidates only one wins; the loser's 409 is the ordinary outcome of a race.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from vramguard.election import Action, ElectionTimings, LeaderRecord, decide, parse_record, serve_after, still_leading
from vramguard.io.kube import JSON, LEASES, ApiError, KubeClient, object_path
from vramguard.lease import format_micro_time

__all__ = ["LEASES", "LeaderElector", "LeaseFollower", "default_identity"]

logger = logging.getLogger(__name__)



def default_identity(hostname: str) -> str:
    """``<hostname>_<random>``: a restarted process is a new candidate, never the old holder (whose
    Bindings may still be on their way)."""
    return f"{hostname}_{uuid.uuid4().hex[:12]}"


class LeaderElector:
    """Hold the Lease ``namespace/name`` while alive; :meth:`serving` says whether to answer verbs now."""

    def __init__(
        self,
        client: KubeClient,
        namespace: str,
        name: str,
        identity: str,
        timings: ElectionTimings,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.timings = timings
        self._clock = clock
        self._wall = wall
        self._path = object_path(LEASES, namespace, name)
        self._observed: tuple[str, str] | None = None
        """(resourceVersion, holder) of the record last read, and when it was first seen."""
        self._observed_at = 0.0
        self._last_renewed: float | None = None
        self._serve_after = 0.0
        self._was_leading = False
        self._leader = Gauge("vramguard_extender_leader",
                             "1 while this extender holds the leader Lease and serves verbs.",
                             registry=registry)
        self._leader.set_function(lambda: 1.0 if self.serving() else 0.0)
        self.transitions = Counter("vramguard_extender_lease_transitions",
                                   "Times this extender became or stopped being the leader.",
                                   labelnames=("direction",), registry=registry)

    def leading(self) -> bool:
        """Whether this replica holds the Lease now (renewed within the renew deadline)."""
        return still_leading(self._last_renewed, self._clock(), self.timings)

    def serving(self) -> bool:
        """Leading, and past the takeover grace: verbs may be answered."""
        return self.leading() and self._clock() >= self._serve_after

    async def run(self) -> None:
        """Try to acquire or renew every retry period, forever (until cancelled)."""
        while True:
            try:
                await self.try_acquire_or_renew()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # A failed write is no renewal: leadership lapses by itself at the renew deadline.
                logger.warning("leader lease %s/%s: %s", self.namespace, self.name, exc)
            self._note_transition()
            await asyncio.sleep(self.timings.retry_period)

    async def try_acquire_or_renew(self) -> bool:
        """One round: read the Lease, then create, renew, take or wait. Returns whether it is held."""
        started = self._clock()
        try:
            obj = await self.client.get(self._path)
        except ApiError as exc:
            if exc.status != 404:
                raise
            return await self._create(started)
        record = parse_record(obj)
        if self._observed != (record.resource_version, record.holder):
            self._observed = (record.resource_version, record.holder)
            self._observed_at = started
        action = decide(record, self.identity, self._observed_at, started, self.timings)
        if action is Action.WAIT:
            return False
        try:
            await self.client.replace(self._path, self._body(obj, record, action))
        except ApiError as exc:
            if exc.status == 409:  # another candidate wrote first: its write wins
                return False
            raise
        self._acquired(action, started)
        return True

    async def release(self) -> None:
        """Give the Lease up (holder empty, 1 s): a successor takes it at once, without a grace."""
        if not self.leading():
            return
        self._last_renewed = None
        try:
            obj = await self.client.get(self._path)
            if parse_record(obj).holder != self.identity:
                return
            spec = dict(obj.get("spec") or {})
            spec.update({"holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": format_micro_time(self._wall())})
            await self.client.replace(self._path, {**obj, "spec": spec})
            logger.info("leader lease %s/%s released", self.namespace, self.name)
        except (ApiError, OSError, TimeoutError) as exc:
            logger.warning("leader lease %s/%s not released (%s); it expires by itself", self.namespace, self.name, exc)
        finally:
            self._note_transition()

    async def _create(self, started: float) -> bool:
        now = format_micro_time(self._wall())
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace,
                         "labels": {"app.kubernetes.io/name": "vramguard", "app.kubernetes.io/component": "extender"}},
            "spec": {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.timings.lease_duration),
                     "acquireTime": now, "renewTime": now, "leaseTransitions": 0},
        }
        try:
            await self.client.create(object_path(LEASES, self.namespace, "").rstrip("/"), body)
        except ApiError as exc:
            if exc.status == 409:
                return False
            raise
        self._acquired(Action.TAKE, started)
        return True

    def _body(self, obj: JSON, record: LeaderRecord, action: Action) -> JSON:
        now = format_micro_time(self._wall())
        spec: dict[str, Any] = dict(obj.get("spec") or {})
        spec.update({"holderIdentity": self.identity, "leaseDurationSeconds": int(self.timings.lease_duration),
                     "renewTime": now})
        if action is not Action.RENEW:
            spec["acquireTime"] = now
            spec["leaseTransitions"] = record.transitions + 1
        # obj keeps metadata.resourceVersion: the PUT fails with 409 if anyone wrote in between.
        return {**obj, "spec": spec}

    def _acquired(self, action: Action, started: float) -> None:
        if action is Action.RENEW:
            self._serve_after = max(self._serve_after, started)  # a grace still running is kept
        else:
            self._serve_after = serve_after(action, started, self.timings)
            logger.info("leader lease %s/%s acquired by %s (%s)%s", self.namespace, self.name, self.identity,
                        action.value, f"; serving after a {self.timings.grace:.0f}s grace"
                        if action is Action.TAKE_OVER else "")
        self._last_renewed = started
        self._observed = None

    def _note_transition(self) -> None:
        leading = self.leading()
        if leading != self._was_leading:
            self.transitions.labels("acquired" if leading else "lost").inc()
            if not leading:
                logger.warning("leader lease %s/%s lost by %s: not serving verbs", self.namespace, self.name,
                               self.identity)
            self._was_leading = leading


class LeaseFollower:
    """Whether this pod's kube-scheduler leads, read from its leader Lease: for an extender sidecar
    (``--leader-elect=false``), which must not elect a leader of its own (it could pick another
    replica's sidecar than the leading scheduler's), yet has work only one replica may do in the
    background (preemption, learning, Events).

    kube-scheduler's identity in its Lease is ``<hostname>_<uuid>`` (``cmd/kube-scheduler/app/options/
    options.go`` v1.36.3: ``id := hostname + "_" + string(uuid.NewUUID())``), and the containers of a
    pod share its hostname, so this pod leads while the holder starts with ``<hostname>_``.
    :meth:`serving` is true only while the Lease, so held, has been seen renewed within its duration
    on this process's own clock: a scheduler that stopped renewing (crashed, cut off) is not followed
    past the time a successor may take over, so two sidecars never both serve beyond one read's delay.
    The Lease is read every ``period`` seconds (a GET; the scheduler's ServiceAccount may read its own
    Lease).
    """

    def __init__(
        self,
        client: KubeClient,
        namespace: str,
        name: str,
        hostname: str,
        *,
        period: float = 2.0,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.name = name
        self.prefix = f"{hostname}_"
        self.period = period
        self._clock = clock
        self._path = object_path(LEASES, namespace, name)
        self._version: str | None = None
        self._renewed_at: float | None = None
        self._duration = 0.0
        self._was_serving = False
        self._missing = False
        leader = Gauge("vramguard_extender_leader",
                       "1 while this extender's scheduler holds its leader Lease (its background work runs).",
                       registry=registry)
        leader.set_function(lambda: 1.0 if self.serving() else 0.0)

    def serving(self) -> bool:
        """This pod's scheduler holds the Lease, seen renewed within the Lease's duration."""
        return self._renewed_at is not None and self._clock() - self._renewed_at < self._duration

    async def run(self) -> None:
        """Read the Lease every period, forever (until cancelled); an error is no renewal."""
        while True:
            try:
                await self.observe()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("scheduler lease %s/%s: %s", self.namespace, self.name, exc)
            serving = self.serving()
            if serving != self._was_serving:
                logger.info("this pod's scheduler %s the lease %s/%s: background work %s",
                            "holds" if serving else "does not hold", self.namespace, self.name,
                            "runs" if serving else "stops")
                self._was_serving = serving
            await asyncio.sleep(self.period)

    async def observe(self) -> None:
        """One read: a renewal seen when the Lease, held by this pod, changed since the last read."""
        now = self._clock()
        try:
            obj = await self.client.get(self._path)
        except ApiError as exc:
            if exc.status != 404:
                raise
            if not self._missing:
                logger.warning("scheduler lease %s/%s not found: is --scheduler-lease the scheduler's "
                               "leaderElection resourceNamespace/resourceName? Background work waits for it",
                               self.namespace, self.name)
            self._missing = True
            self._version, self._renewed_at = None, None
            return
        self._missing = False
        record = parse_record(obj)
        ours = record.holder.startswith(self.prefix) and len(record.holder) > len(self.prefix)
        if not ours or record.duration is None:
            self._renewed_at = None
        elif record.resource_version != self._version:
            self._renewed_at = now
            self._duration = float(record.duration)
        self._version = record.resource_version
