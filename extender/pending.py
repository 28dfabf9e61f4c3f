"""GPU pods the filter found no node for, by why: the series behind "GPU pods Pending on VRAM".

kube-scheduler retries an unschedulable pod at least every five minutes (its
``podMaxInUnschedulablePodsDuration``), calling the filter each time; a pod is counted from a
filter that passed no node until one passes a node, it is bound, or it has not been filtered for
:data:`FORGET_SECONDS` (deleted, or scheduled elsewhere). ``vram``: some node refused it for the
VRAM budget or unknown VRAM (changing the workload's memory or the cluster's capacity helps);
``other``: every refusal was something else (no such GPU resource, a class rule, an unknown node).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

from cachetools import TTLCache
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from vramguard.placement import is_vram_refusal

__all__ = ["FORGET_SECONDS", "PendingPods"]

FORGET_SECONDS = 900.0
"""Three of the scheduler's retries of an unschedulable pod: long enough never to drop a pod still
waiting, short enough to forget one that went away."""
MAX_PODS = 100_000


class PendingPods(Collector):
    """Pods whose latest filter passed no node, by reason; exported as ``vramguard_extender_unschedulable_pods``."""

    def __init__(self, timer: Callable[[], float] = time.monotonic) -> None:
        self._pods: TTLCache[str, str] = TTLCache(MAX_PODS, FORGET_SECONDS, timer=timer)

    def filtered(self, uid: str, passing: list[str], *refusals: Mapping[str, str]) -> None:
        """Record a filter's outcome for the pod ``uid`` (``refusals``: node -> reason, the failed
        and the unresolvable; read only when no node passed)."""
        if not uid:
            return
        if passing:
            self._pods.pop(uid, None)
        else:
            # Nodes refused alike share one reason: each distinct one is read once (5,000 nodes: 0.04 ms).
            vram = any(is_vram_refusal(m) for found in refusals for m in set(found.values()))
            self._pods[uid] = "vram" if vram else "other"

    def bound(self, uid: str) -> None:
        """The pod was bound: no longer pending."""
        self._pods.pop(uid, None)

    def counts(self) -> dict[str, int]:
        """Pending pods by reason."""
        self._pods.expire()
        found = {"vram": 0, "other": 0}
        for reason in self._pods.values():
            found[reason] += 1
        return found

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "vramguard_extender_unschedulable_pods",
            "GPU pods whose latest filter passed no node, by reason (vram: some node refused the pod's VRAM; "
            "other: no node offers its GPU resource, a class rule, an unknown node).",
            labels=("reason",),
        )
        for reason, count in self.counts().items():
            family.add_metric((reason,), count)
        yield family
