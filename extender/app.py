"""The extender's HTTP endpoints: ``POST /filter``, ``/prioritize``, ``/bind`` on the shared app."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry

from extender.findings import FindingsReporter
from extender.metrics import ExtenderMetrics
from extender.preemption import mark_unhelpable, preempt_handler
from extender.verbs import NOT_LEADER, Verbs
from extender.wire import ExtenderArgs, ExtenderBindingArgs, binding_result, filter_result, host_priorities
from vramguard.io.http import Readiness, create_app, read_model

logger = logging.getLogger(__name__)

NOT_SYNCED = "vramguard: cluster state not synced yet; retrying"


def build_app(
    verbs: Verbs,
    synced: asyncio.Event,
    readiness: Readiness,
    registry: CollectorRegistry,
    *,
    operational_routes: bool = True,
    leader: Callable[[], bool] | None = None,
) -> web.Application:
    """The aiohttp application of the extender; ``synced`` gates every verb.

    ``leader`` (the leader election's ``serving``) gates filter and bind too, and readiness, so the
    Service routes only to the leader; ``None``: this replica always serves (a sidecar whose
    scheduler has its own leader election, or a single replica).
    ``operational_routes`` False leaves probes and metrics to a listener of their own.
    """
    metrics = ExtenderMetrics(registry, verbs.state, verbs.oldest_in_flight_seconds)
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
    app = create_app(registry=registry, readiness=readiness, operational_routes=operational_routes)

    async def filter_handler(request: web.Request) -> web.Response:
        args = await read_model(request, ExtenderArgs)
        if not synced.is_set():
            # An error fails this scheduling attempt; the scheduler retries the pod later.
            return web.json_response(filter_result(args, [], {}, {}, NOT_SYNCED))
        if refused("filter"):
            return web.json_response(filter_result(args, [], {}, {}, NOT_LEADER))
        outcome = mark_unhelpable(verbs.state, args.Pod, await verbs.filter(args.Pod, args.node_names()))
        metrics.decisions.labels("filter", "pass").inc(len(outcome.passing))
        metrics.decisions.labels("filter", "fail").inc(len(outcome.failed))
        metrics.decisions.labels("filter", "unresolvable").inc(len(outcome.unresolvable))
        return web.json_response(filter_result(args, outcome.passing, outcome.failed, outcome.unresolvable))

    async def prioritize_handler(request: web.Request) -> web.Response:
        args = await read_model(request, ExtenderArgs)
        if not synced.is_set():
            return web.json_response(host_priorities(dict.fromkeys(args.node_names(), 0)))
        return web.json_response(host_priorities(await verbs.prioritize(args.Pod, args.node_names())))

    async def bind_handler(request: web.Request) -> web.Response:
        args = await read_model(request, ExtenderBindingArgs)
        if not synced.is_set():
            return web.json_response(binding_result(NOT_SYNCED))
        if refused("bind"):
            return web.json_response(binding_result(NOT_LEADER))
        error = await verbs.bind(args.PodName, args.PodNamespace, args.PodUID, args.Node)
        if error == NOT_LEADER:
            metrics.not_leader.labels("bind").inc()  # leadership lapsed while the pod was read
        metrics.decisions.labels("bind", "error" if error else "bound").inc()
        if error:
            logger.info("bind %s/%s: %s", args.PodNamespace, args.PodName, error)
        return web.json_response(binding_result(error))

    app.router.add_post("/filter", filter_handler)
    app.router.add_post("/prioritize", prioritize_handler)
    app.router.add_post("/bind", bind_handler)
    preempt = preempt_handler(verbs.state, synced)

    async def preempt_if_leader(request: web.Request) -> web.Response:
        # Victims chosen by a standby would ignore the leader's reservations in flight.
        if refused("preempt"):
            # The result has no error field: a non-200 answer fails this preemption attempt.
            return web.json_response({"Error": NOT_LEADER}, status=503)
        response: web.Response = await preempt(request)
        return response

    app.router.add_post("/preempt", preempt_if_leader)
    return app
