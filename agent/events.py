"""One Warning Event per pod that uses more VRAM than it declared (over-use), not one per cycle.

The agent creates it: it is the one component that measures use, it runs where the pod runs, and
its work grows with the node's pods, not the cluster's. The Event's name is derived from the pod's
UID (``<pod>.vramguard-overuse-<uid prefix>``), so a restarted agent, or a second cycle that races
the first, meets ``409 AlreadyExists`` instead of creating a duplicate: the API server dedupes.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from urllib.parse import quote

from agent.report import OverUse
from vramguard.codecs import VRAM_ANNOTATION
from vramguard.lease import format_micro_time
from vramguard.quantity import format_bytes

__all__ = ["OveruseEvents", "event_body", "event_name"]

logger = logging.getLogger("vramguard.agent")

REASON = "VRAMOverUse"
COMPONENT = "vramguard-agent"


def event_name(pod: str, uid: str) -> str:
    """A name unique to the pod (a DNS subdomain of at most 253 characters)."""
    digest = hashlib.sha256(uid.encode()).hexdigest()[:16]
    return f"{pod[:200]}.vramguard-overuse-{digest}"


def event_body(rows: Sequence[OverUse], node: str, now: float) -> dict[str, Any]:
    """The ``v1`` Event for one pod's over-use rows (one per device it over-uses)."""
    first = rows[0]
    parts = [
        f"{format_bytes(r.used_bytes)} on GPU {r.device} where it declares {format_bytes(r.declared_bytes)}"
        for r in rows
    ]
    message = (
        f"pod uses more VRAM than it declares on node {node}: {'; '.join(parts)}. vramguard now counts what "
        f"it uses; declare it ({VRAM_ANNOTATION} or the engine's flag) so that scheduling stays exact"
    )
    stamp = format_micro_time(now)[:19] + "Z"
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": event_name(first.pod, first.uid), "namespace": first.namespace},
        "involvedObject": {
            "apiVersion": "v1", "kind": "Pod", "namespace": first.namespace, "name": first.pod, "uid": first.uid,
        },
        "reason": REASON,
        "message": message[:1024],
        "type": "Warning",
        "source": {"component": COMPONENT, "host": node},
        "reportingComponent": COMPONENT,
        "reportingInstance": node,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


class OveruseEvents:
    """Creates the Event of each over-using pod once; remembers which pods have one."""

    def __init__(self, client: Any, node: str, clock: Callable[[], float] = time.time) -> None:
        """``client``: a :class:`vramguard.io.kube.KubeClient`."""
        self._client = client
        self._node = node
        self._clock = clock
        self._done: set[str] = set()

    async def report(self, overuse: Iterable[OverUse], live: Iterable[str]) -> dict[str, int]:
        """Create the missing Events; ``live``: UIDs of the node's pods (the memory is pruned to them).

        Returns how many were ``created``, already ``existed`` and ``failed`` (retried next cycle).
        """
        from vramguard.io.kube import ApiError  # noqa: PLC0415 - vramguard.io loads aiohttp; --once needs none

        self._done &= set(live)
        by_pod: dict[str, list[OverUse]] = {}
        for row in overuse:
            if row.uid not in self._done:
                by_pod.setdefault(row.uid, []).append(row)
        results = {"created": 0, "existed": 0, "failed": 0}
        for uid, rows in by_pod.items():
            body = event_body(rows, self._node, self._clock())
            path = f"/api/v1/namespaces/{quote(rows[0].namespace, safe='')}/events"
            try:
                await self._client.create(path, body)
                results["created"] += 1
                logger.warning("pod %s/%s: %s", rows[0].namespace, rows[0].pod, body["message"])
            except ApiError as exc:
                if exc.status != 409:
                    results["failed"] += 1
                    logger.warning("over-use Event for pod %s/%s not created: %s", rows[0].namespace, rows[0].pod, exc)
                    continue
                results["existed"] += 1
            except Exception as exc:  # network, timeout: retried next cycle
                results["failed"] += 1
                logger.warning("over-use Event for pod %s/%s not created: %s", rows[0].namespace, rows[0].pod, exc)
                continue
            self._done.add(uid)
        return results
