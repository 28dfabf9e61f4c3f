"""Run the extender: informers for Nodes, Namespaces, bound Pods, the agents' Leases and
PodDisruptionBudgets, the policy watcher, the evictor (preemption for VRAM), HTTPS.

The verbs are served on ``host:port`` over HTTP/2 and HTTP/1.1 from native code (mutual TLS in a
cluster: only kube-scheduler, holding a client certificate from the client CA, gets an HTTP
answer); probes and metrics on the plain-HTTP ``operational`` address.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from dataclasses import dataclass, field

from prometheus_client.registry import CollectorRegistry

from extender.app import build_app
from extender.evictor import Evictor
from extender.growth import GrowthReporter
from extender.learning import DEFAULT_INTERVAL_SECONDS, Learner
from extender.scale_up import UNBOUND_PODS, GateKeeper
from extender.verbs import IN_FLIGHT_TIMEOUT_SECONDS, Verbs
from vramguard.cluster import BOUND_PODS_SELECTOR, ClusterState, slim_node, slim_pod
from vramguard.election import ElectionTimings
from vramguard.io.dra import dra_watches
from vramguard.io.kube import (
    LEASES,
    MAX_EVENT_BYTES,
    PODDISRUPTIONBUDGETS,
    Connection,
    KubeClient,
    collection_path,
)
from vramguard.io.leader import LeaderElector, LeaseFollower
from vramguard.io.runtime import ServiceRuntime, Watch, reload_every
from vramguard.io.server import Address, ServerSettings, run_https
from vramguard.io.tls import ReloadingTLSContext
from vramguard.lease import DEFAULT_AGENT_NAMESPACE
from vramguard.policy import PolicyFile, default_policy

logger = logging.getLogger(__name__)

# Bound, non-terminal pods only: a pod leaving this set arrives as a DELETED event.
BOUND_PODS = {"fieldSelector": BOUND_PODS_SELECTOR}
POLICY_RELOAD_SECONDS = 10.0
RELEASE_TIMEOUT_SECONDS = 5.0
"""How long shutdown waits to release the leader Lease; unreleased, it expires by itself."""
LEASE_CHECK_SECONDS = 2.0
"""How often expired agent Leases are looked for: a Lease expires without any watch event."""
COLLECTOR_THRESHOLDS = (7_000, 10, 50)
"""The cyclic collector's thresholds once the synced state is frozen (Python's: 700, 10, 10).
Freezing empties the oldest generation, so a full collection then comes with every tenth
collection of the middle one: every few cold filters at 5,000 nodes, each walking every object
made since the sync (tens of milliseconds, hundreds on a busy machine, in whichever request it
lands). The youngest generation collected every 7,000 net allocations instead of 700 and the
oldest after 50 middle ones: a full collection every few million allocations (hundreds of cold
filters), while a request's cycles are still found by the young collections."""


def freeze_collector() -> None:
    """Move what exists now (the synced state) out of the cyclic collector's reach, and make its
    full collections rare (:data:`COLLECTOR_THRESHOLDS`)."""
    gc.freeze()
    gc.set_threshold(*COLLECTOR_THRESHOLDS)


@dataclass(frozen=True)
class ExtenderSettings:
    """Validated once at start-up (files loaded, addresses parsed) and passed explicitly."""

    host: str
    port: int
    tls: ReloadingTLSContext | None
    operational: Address
    connection: Connection
    policy_file: PolicyFile | None
    server: ServerSettings
    agent_namespace: str = DEFAULT_AGENT_NAMESPACE
    max_event_bytes: int = MAX_EVENT_BYTES
    election: LeaderElection | None = None
    """``None``: this replica always answers the verbs (a sidecar whose scheduler elects its own leader)."""
    scheduler_lease: tuple[str, str] | None = None
    """(namespace, name) of the leader Lease of the kube-scheduler this extender is a sidecar of: its
    background work (preemption, learning, Events) runs only while that scheduler leads."""
    per_gpu_metrics: bool = False
    learn_interval: float = DEFAULT_INTERVAL_SECONDS
    """Seconds between learning rounds (:mod:`extender.learning`)."""
    namespace: str = DEFAULT_AGENT_NAMESPACE
    """The extender's own namespace: where its learned allowances are kept."""


@dataclass(frozen=True)
class LeaderElection:
    """The Lease the extender replicas elect their one binder with."""

    namespace: str
    name: str
    identity: str
    timings: ElectionTimings = field(default_factory=ElectionTimings)


async def run(settings: ExtenderSettings) -> None:
    """Serve until SIGTERM; readiness waits for the caches and the TLS files, and fails while a
    watch is unhealthy. A background task that dies ends the process with an error (see
    :func:`vramguard.io.supervise.supervise`)."""
    policy_file = settings.policy_file
    policy = policy_file.policy if policy_file is not None else default_policy()
    state = ClusterState(policy, agent_namespace=settings.agent_namespace)
    client = KubeClient(settings.connection, max_event_bytes=settings.max_event_bytes)
    # Nodes and namespaces first, so that the pods' claims see their classes and devices.
    verbs = Verbs(state, client)
    synced = asyncio.Event()
    registry = CollectorRegistry()
    # Scale-up: the unbound pods vramguard gated, decided by the serving replica (set below).
    gates = GateKeeper(state, verbs, client, registry, serving=lambda: False, synced=synced)
    runtime = ServiceRuntime(client, [
        Watch("/api/v1/nodes", state.nodes, slim=slim_node),
        Watch("/api/v1/namespaces", state.namespaces),
        Watch("/api/v1/pods", state.pods, BOUND_PODS, slim=slim_pod),
        Watch("/api/v1/pods", gates, UNBOUND_PODS, name="pods-unbound"),
        Watch(collection_path(LEASES, settings.agent_namespace), state.leases),
        # PodDisruptionBudgets: preemption spares the pods they protect where it can.
        Watch(PODDISRUPTIONBUDGETS, state.disruption_budgets),
        # DRA: devices, classes and allocated claims, for pods on the extended-resource path.
        *dra_watches(state.dra, templates=False),
    ], registry=registry)
    election = settings.election
    elector = (
        LeaderElector(client, election.namespace, election.name, election.identity, election.timings,
                      registry=runtime.registry)
        if election is not None else None
    )
    follower = (
        LeaseFollower(client, *settings.scheduler_lease, socket.gethostname(), registry=runtime.registry)
        if settings.scheduler_lease is not None and elector is None else None
    )
    # Background work one replica only may do: the elected one, or the leading scheduler's sidecar.
    background = elector.serving if elector is not None else follower.serving if follower is not None else (
        lambda: True
    )
    gates.serving = background
    # Preemption for VRAM where kube-scheduler's own never starts; the serving replica only.
    evictor = Evictor(state, client, runtime.registry, serving=background)
    app = build_app(verbs, synced, runtime.readiness, runtime.registry,
                    leader=elector.serving if elector is not None else None,
                    per_gpu_metrics=settings.per_gpu_metrics, evictor=evictor)

    learner = Learner(state, client, settings.namespace, runtime.registry, serving=background,
                      interval=settings.learn_interval)

    async def wait_synced() -> None:
        await runtime.wait_synced()
        await learner.load()  # what the fleet taught before a restart, before the first verb
        state.sync_dra()  # the DRA devices into the ledger once, before the first verb
        state.ledger.warm()  # every node's summary now, not in the first filter
        synced.set()
        # The synced state is long-lived: moved out of the collector's reach, a full collection no
        # longer walks 50,000 pods' objects (a 300 ms stall of every request on the loop).
        freeze_collector()
        logger.info("caches synced: %d nodes, %d GPU pods", len(list(state.node_names())), state.ledger.pod_count())

    def reload_policy() -> None:
        assert policy_file is not None
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

    async def expire_leases() -> None:
        while True:
            await asyncio.sleep(LEASE_CHECK_SECONDS)
            for node in state.refresh_agent_reports():
                inventory = state.ledger.inventory(node)
                reason = inventory.distrust if inventory is not None else None
                logger.warning("node %s: %s", node, reason or "agent report trusted again")

    runtime.tasks["wait-synced"] = wait_synced()
    runtime.tasks["lease-expiry"] = expire_leases()
    runtime.tasks["confirm-in-flight"] = confirm_in_flight()
    runtime.tasks["vram-preemption"] = evictor.run()
    runtime.tasks["growth-reports"] = GrowthReporter(state, client, runtime.registry, serving=background).run()
    runtime.tasks["learning"] = learner.run()
    runtime.tasks["scale-up-gates"] = gates.run()
    if elector is not None:
        runtime.tasks["leader-election"] = elector.run()
    if follower is not None:
        runtime.tasks["scheduler-lease"] = follower.run()
    if policy_file is not None:
        runtime.tasks["policy-reload"] = reload_every(POLICY_RELOAD_SECONDS, reload_policy)
    try:
        await runtime.serve(
            run_https(
                app.operational,
                settings.host,
                settings.port,
                settings.tls,
                settings=settings.server,
                operational=settings.operational,
                native=app.verbs,
            ),
            may_finish={"wait-synced"},
        )
    finally:
        if elector is not None:
            # After the server drained: no bind of this replica is on its way, so the successor
            # may take the Lease at once, without the takeover grace.
            await asyncio.wait_for(elector.release(), RELEASE_TIMEOUT_SECONDS)
        await client.close()
