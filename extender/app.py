"""The extender's endpoints: ``POST /filter``, ``/prioritize``, ``/bind``, ``/preempt`` (an RSGI
application, served from native code with mutual TLS), and the probes and metrics (an aiohttp
application, served on the operational address)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry

from extender.evictor import Evictor
from extender.findings import FindingsReporter
from extender.metrics import ExtenderMetrics, LedgerExposition
from extender.pending import PendingPods
from extender.preemption import LowestPriorities, mark_unhelpable, preempt_handler
from extender.verbs import NOT_LEADER, Verbs
from extender.wire import (
    NODE_CACHE_REQUIRED,
    ExtenderArgs,
    ExtenderBindingArgs,
    binding_result,
    filter_result,
    host_priorities,
    sends_whole_nodes,
)
from vramguard.io.http import (
    CACHED_EXPOSITION_KEY,
    CONNECTIONS_KEY,
    DEFAULT_CLIENT_MAX_SIZE,
    LATENCY_KEY,
    Readiness,
    RequestError,
    create_app,
    parse_model,
)
from vramguard.io.rsgi import Reply, RsgiApp, json_reply

logger = logging.getLogger(__name__)

NOT_SYNCED = "vramguard: cluster state not synced yet; retrying"
LEDGER_EXPOSITION_KEY = web.AppKey("vramguard_ledger_exposition", LedgerExposition)
"""The app's cached ledger series (to render them now: tests, the benchmark)."""


@dataclass(frozen=True)
class ExtenderApp:
    """The extender's two faces: ``verbs`` for kube-scheduler, ``operational`` for kubelets and Prometheus."""

    verbs: RsgiApp
    operational: web.Application
    """``/healthz``, ``/readyz``, ``/metrics``; it also holds the readiness checks and the registry."""


def build_app(
    verbs: Verbs,
    synced: asyncio.Event,
    readiness: Readiness,
    registry: CollectorRegistry,
    *,
    leader: Callable[[], bool] | None = None,
    per_gpu_metrics: bool = False,
    evictor: Evictor | None = None,
    body_limit: int = DEFAULT_CLIENT_MAX_SIZE,
) -> ExtenderApp:
    """The extender's applications; ``synced`` gates every verb.

    ``leader`` (the leader election's ``serving``) gates filter and bind too, and readiness, so the
    Service routes only to the leader; ``None``: this replica always serves (a sidecar whose
    scheduler has its own leader election, or a single replica).
    ``per_gpu_metrics`` adds the ledger's series per GPU to those per node and product.
    ``evictor`` hears of the pods filter refuses for VRAM and of those kube-scheduler preempts for.
    """
    metrics = ExtenderMetrics(registry, verbs.state, verbs.oldest_in_flight_seconds, per_gpu=per_gpu_metrics)
    pending = PendingPods()
    registry.register(pending)
    verbs.findings = FindingsReporter(verbs.client, registry)
    readiness.add("caches-synced", synced.is_set)
    if leader is not None:
        readiness.add("leader", leader)
        verbs.serving = leader

    def refused(verb: str) -> bool:
        """Whether this replica must refuse ``verb`` now because it is not the serving leader."""
        if leader is None or leader():
            return False
        metrics.not_leader.labels(verb).inc()
        return True
    app = create_app(registry=registry, readiness=readiness)
    app[CACHED_EXPOSITION_KEY] = metrics.ledger.cached
    app[LEDGER_EXPOSITION_KEY] = metrics.ledger

    async def render_ledger_metrics(_: web.Application) -> AsyncIterator[None]:
        await metrics.ledger.refresh()  # before the first request: a scrape never finds the cache empty
        task = asyncio.create_task(metrics.ledger.refresh_forever(), name="ledger-metrics")
        yield
        task.cancel()

    app.cleanup_ctx.append(render_ledger_metrics)

    def read_names(body: bytes, verb: str) -> ExtenderArgs | None:
        """The body of filter or prioritize; None when it carries whole Nodes (refused, counted)."""
        args = None if sends_whole_nodes(body) else parse_model(body, ExtenderArgs)
        if args is None or args.whole_nodes():
            metrics.node_cache_refused.labels(verb).inc()
            return None
        return args

    lowest = LowestPriorities()  # per node, for telling failures eviction may cure

    async def filter_handler(body: bytes) -> Reply:
        args = read_names(body, "filter")
        if args is None:
            return json_reply(filter_result([], {}, {}, NODE_CACHE_REQUIRED))
        if not synced.is_set():
            # An error fails this scheduling attempt; the scheduler retries the pod later.
            return json_reply(filter_result([], {}, {}, NOT_SYNCED))
        if refused("filter"):
            return json_reply(filter_result([], {}, {}, NOT_LEADER))
        outcome = mark_unhelpable(verbs.state, args.Pod, await verbs.filter(args.Pod, args.node_names()), lowest)
        if evictor is not None:
            evictor.refused(args.Pod, outcome.passing, outcome.failed)
        uid = args.Pod.get("metadata", {}).get("uid")
        pending.filtered(uid if isinstance(uid, str) else "", outcome.passing, outcome.failed, outcome.unresolvable)
        metrics.decisions.labels("filter", "pass").inc(len(outcome.passing))
        metrics.decisions.labels("filter", "fail").inc(len(outcome.failed))
        metrics.decisions.labels("filter", "unresolvable").inc(len(outcome.unresolvable))
        return json_reply(filter_result(outcome.passing, outcome.failed, outcome.unresolvable))

    async def prioritize_handler(body: bytes) -> Reply:
        args = read_names(body, "prioritize")
        if args is None:
            # HostPriorityList has no error field: a 4xx is the scheduler's only sign.
            raise RequestError(400, NODE_CACHE_REQUIRED)
        if not synced.is_set():
            return json_reply(host_priorities(dict.fromkeys(args.node_names(), 0)))
        return json_reply(host_priorities(await verbs.prioritize(args.Pod, args.node_names())))

    async def bind_handler(body: bytes) -> Reply:
        args = parse_model(body, ExtenderBindingArgs)
        if not synced.is_set():
            return json_reply(binding_result(NOT_SYNCED))
        if refused("bind"):
            return json_reply(binding_result(NOT_LEADER))
        error = await verbs.bind(args.PodName, args.PodNamespace, args.PodUID, args.Node)
        if error == NOT_LEADER:
            metrics.not_leader.labels("bind").inc()  # leadership lapsed while the pod was read
        metrics.decisions.labels("bind", "error" if error else "bound").inc()
        if not error:
            pending.bound(args.PodUID)
        if error:
            logger.info("bind %s/%s: %s", args.PodNamespace, args.PodName, error)
        return json_reply(binding_result(error))

    preempt = preempt_handler(verbs.state, synced, evictor.preempting if evictor is not None else None)

    async def preempt_if_leader(body: bytes) -> Reply:
        # Victims chosen by a standby would ignore the leader's reservations in flight.
        if refused("preempt"):
            # The result has no error field: a non-200 answer fails this preemption attempt.
            return json_reply({"Error": NOT_LEADER}, 503)
        return await preempt(body)

    endpoints = {"/filter": filter_handler, "/prioritize": prioritize_handler, "/bind": bind_handler,
                 "/preempt": preempt_if_leader}
    served = RsgiApp(endpoints, latency=app[LATENCY_KEY], connections=app[CONNECTIONS_KEY], body_limit=body_limit,
                     body_limit_hint=NODE_CACHE_REQUIRED)
    return ExtenderApp(verbs=served, operational=app)
