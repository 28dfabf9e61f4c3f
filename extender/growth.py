"""Bound pods whose claims grew while they ran (an image changed past the webhook): reported, never
silent. The ledger counts what a running pod now claims, whatever it was placed with; where that
takes a device past its budget, the pod gets a Warning Event and the counter rises, as for a
measured over-use (the agent's ``VRAMOverUse``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

from extender.events import post_node_event, post_pod_event
from vramguard.cluster import ClusterState
from vramguard.inventory import UNREADABLE
from vramguard.io.kube import KubeClient

logger = logging.getLogger(__name__)

EVENT_REASON = "VRAMOvercommitted"
UNREADABLE_REASON = "GPUsUnreadable"
REPORT_SECONDS = 5.0
"""How often the growths the watch delivered are reported."""


class GrowthReporter:
    """Drains :meth:`ClusterState.take_growths`: one Event per growth (serving replica only) and a counter;
    and one Warning Event on each node that starts advertising GPUs vramguard cannot read."""

    def __init__(
        self, state: ClusterState, client: KubeClient, registry: CollectorRegistry, serving: Callable[[], bool]
    ) -> None:
        self.state = state
        self.client = client
        self.serving = serving
        self.unreadable: set[str] = set()
        """Nodes already told about (forgotten once readable, so a relapse is told again)."""
        self.counter = Counter(
            "vramguard_extender_bound_pod_growths",
            "Bound pods whose claims grew while they ran (a new image), taking a GPU past its VRAM budget.",
            registry=registry,
        )

    async def report(self) -> int:
        """Report the growths noted since the last call; returns how many."""
        growths = self.state.take_growths()
        for growth in growths:
            self.counter.inc()
            logger.warning("%s", growth.message)
            if self.serving():
                await post_pod_event(self.client, growth.pod, EVENT_REASON, growth.message, "Warning")
        now = set(self.state.unreadable_nodes())
        if self.serving():
            for node in sorted(now - self.unreadable):
                logger.warning("node %s: %s", node, UNREADABLE)
                await post_node_event(self.client, node, UNREADABLE_REASON, UNREADABLE, "Warning")
            self.unreadable = now
        return len(growths)

    async def run(self) -> None:
        """Report every :data:`REPORT_SECONDS` until cancelled."""
        while True:
            await asyncio.sleep(REPORT_SECONDS)
            try:
                await self.report()
            except Exception:  # an Event is a courtesy: the loop goes on (the counter has risen)
                logger.exception("reporting bound pods' growth failed")
