"""Run the extender: informers for Nodes, Namespaces and bound Pods, the policy watcher, HTTPS."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from extender.app import build_app
from extender.verbs import IN_FLIGHT_TIMEOUT_SECONDS, Verbs
from service.http import Readiness
from service.kube import Connection, Informer, KubeClient
from service.server import ServerSettings, run_https
from service.tls import ReloadingTLSContext
from vramguard.cluster import ClusterState, slim_node, slim_pod
from vramguard.policy import PolicyFile, default_policy

logger = logging.getLogger(__name__)

# Bound, non-terminal pods only: a pod leaving this set arrives as a DELETED event.
BOUND_PODS = {"fieldSelector": "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"}
POLICY_RELOAD_SECONDS = 10.0


@dataclass(frozen=True)
class ExtenderSettings:
    """Validated once at start-up (files loaded, addresses parsed) and passed explicitly."""

    host: str
    port: int
    tls: ReloadingTLSContext | None
    connection: Connection
    policy_file: PolicyFile | None
    server: ServerSettings


async def run(settings: ExtenderSettings) -> None:
    """Serve until SIGTERM; readiness waits for the caches and the TLS files."""
    policy_file = settings.policy_file
    policy = policy_file.policy if policy_file is not None else default_policy()
    state = ClusterState(policy)
    client = KubeClient(settings.connection)
    informers = [
        Informer(client, "/api/v1/nodes", state.nodes, slim=slim_node),
        Informer(client, "/api/v1/namespaces", state.namespaces),
        Informer(client, "/api/v1/pods", state.pods, BOUND_PODS, slim=slim_pod),
    ]
    synced = asyncio.Event()
    registry = CollectorRegistry()
    readiness = Readiness()
    verbs = Verbs(state, client)
    app = build_app(verbs, synced, readiness, registry)

    async def wait_synced() -> None:
        # Nodes and namespaces first, so that the pods' claims see their classes and devices.
        for informer in informers:
            await informer.synced.wait()
        synced.set()
        # The synced state is long-lived: moved out of the collector's reach, a full collection no
        # longer walks 50,000 pods' objects (a 300 ms stall of every request on the loop).
        gc.freeze()
        logger.info("caches synced: %d nodes, %d GPU pods", len(list(state.node_names())), state.ledger.pod_count())

    async def watch_policy() -> None:
        assert policy_file is not None
        while True:
            await asyncio.sleep(POLICY_RELOAD_SECONDS)
            new, error = policy_file.reload()
            if error:
                logger.error("policy %s not reloaded: %s", policy_file.path, error)
            elif new is not state.policy:
                state.set_policy(new)
                logger.info("policy %s reloaded", policy_file.path)

    async def confirm_in_flight() -> None:
        # Reservations whose watch event never came (a lost Binding, a pod deleted meanwhile) are
        # checked against the API, so a GPU is not held forever by a pod that is not there.
        while True:
            await asyncio.sleep(IN_FLIGHT_TIMEOUT_SECONDS / 2)
            try:
                await verbs.confirm_in_flight()
            except Exception:
                logger.exception("checking the reservations in flight failed; retrying later")

    tasks = [asyncio.create_task(informer.run()) for informer in informers]
    tasks.append(asyncio.create_task(wait_synced()))
    tasks.append(asyncio.create_task(confirm_in_flight()))
    if policy_file is not None:
        tasks.append(asyncio.create_task(watch_policy()))
    try:
        await run_https(app, settings.host, settings.port, settings.tls, settings=settings.server)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await client.close()
