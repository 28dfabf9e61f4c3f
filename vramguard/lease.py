"""The node agent's liveness: one ``coordination.k8s.io/v1`` Lease per node.

The agent renews its node's Lease (namespace of the agent, name :func:`vramguard.codecs.agent_lease_name`) every
quarter of its duration and patches the Node's ``vramguard.io/gpus`` annotation only when the report
changes, so a quiet node costs one small Lease write every 10 s instead of a Node update that every Node
watcher (the scheduler included) would receive.

A report is trusted only while its Lease is fresh: ``renewTime + leaseDurationSeconds`` is still
ahead. A report whose agent stopped (crashed, node partitioned, DaemonSet removed) may describe
pods that have moved and usage that has changed, so the reader falls back to the labels and the
ledger's conservative rule, and says why (:func:`distrust_reason`).

``renewTime`` comes from the agent's clock and is compared with the reader's, so clocks are assumed
synchronised (as for certificates): a skew smaller than the Lease's duration is harmless, a larger one
makes the report untrusted (an agent behind: stale; ahead: "renewed in the future"), never trusted
for longer than it should be.

Pure: times are seconds since the epoch, passed in by the caller (no clock is read here).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from vramguard.codecs import agent_lease_name

__all__ = [
    "DEFAULT_AGENT_NAMESPACE",
    "AgentLease",
    "AgentLeases",
    "distrust_reason",
    "format_micro_time",
    "lease_body",
    "parse_lease",
    "parse_micro_time",
]

@dataclass(frozen=True, slots=True)
class AgentLease:
    """What a reader needs of a Lease: who renewed it, when, and for how long."""

    name: str
    holder: str | None
    renew_time: float | None
    """Seconds since the epoch; ``None`` when absent or not a time."""
    duration: int | None
    """``leaseDurationSeconds``; ``None`` when absent or not a positive integer."""


def format_micro_time(when: float) -> str:
    """A Kubernetes ``MicroTime``: RFC 3339 in UTC with microseconds (``2026-12-01T04:13:16.000000Z``)."""
    return datetime.fromtimestamp(when, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_micro_time(value: Any) -> float | None:
    """Seconds since the epoch of an RFC 3339 time (``MicroTime`` or ``Time``); ``None`` for junk."""
    if not isinstance(value, str) or not value or len(value) > 64:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        return None
    return parsed.timestamp()


def parse_lease(obj: Mapping[str, Any]) -> AgentLease | None:
    """Read a Lease object (JSON-decoded); ``None`` without a name. Never raises."""
    metadata = obj.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    if not isinstance(name, str) or not name:
        return None
    spec = obj.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    holder = spec.get("holderIdentity")
    duration = spec.get("leaseDurationSeconds")
    if not isinstance(duration, int) or isinstance(duration, bool) or duration <= 0:
        duration = None
    return AgentLease(
        name, holder if isinstance(holder, str) else None, parse_micro_time(spec.get("renewTime")), duration
    )


def distrust_reason(lease: AgentLease | None, where: str, now: float) -> str | None:
    """Why a report guarded by ``lease`` cannot be trusted at ``now``; ``None`` when it can.

    ``where`` names the Lease in messages (``vramguard-system/vramguard-agent-node-1``). A renewal
    time more than one duration in the future is not trusted either: it would keep a report alive
    long after its agent stopped.
    """
    if lease is None:
        return f"agent report not trusted: no agent lease {where}"
    if lease.renew_time is None or lease.duration is None:
        return f"agent report not trusted: lease {where} has no renewTime or leaseDurationSeconds"
    expires = lease.renew_time + lease.duration
    if now >= expires:
        return f"agent report stale: lease {where} expired at {format_micro_time(expires)[:19]}Z"
    if lease.renew_time > now + lease.duration:
        return f"agent report not trusted: lease {where} renewed in the future ({format_micro_time(lease.renew_time)})"
    return None


def lease_body(namespace: str, node: str, holder: str, duration: int, now: float) -> dict[str, Any]:
    """The Lease the agent of ``node`` writes at ``now`` (``holder``: the agent pod's name)."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": agent_lease_name(node),
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "vramguard", "app.kubernetes.io/component": "agent"},
        },
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": duration,
            "renewTime": format_micro_time(now),
        },
    }


DEFAULT_AGENT_NAMESPACE = "vramguard-system"


class AgentLeases:
    """The agents' Leases of one namespace, by name, and whether each node's report is trusted now.

    Fed by a Lease informer (``replace`` / ``upsert`` / ``delete`` with Lease objects); ``clock``
    gives the current time in seconds since the epoch (``time.time`` at the edge, a fake in tests).
    """

    def __init__(self, namespace: str, clock: Callable[[], float]) -> None:
        """Leases are read from ``namespace`` only: whoever may write there is the agent."""
        self.namespace = namespace
        self.clock = clock
        self._leases: dict[str, AgentLease] = {}

    def replace(self, objects: Sequence[Mapping[str, Any]]) -> None:
        """The full set after a (re-)list."""
        self._leases = {}
        for obj in objects:
            self.upsert(obj)

    def upsert(self, obj: Mapping[str, Any]) -> str | None:
        """A Lease was added or renewed; returns its name (``None``: not one of this namespace's)."""
        lease = parse_lease(obj)
        metadata = obj.get("metadata")
        namespace = metadata.get("namespace") if isinstance(metadata, Mapping) else None
        if lease is None or namespace not in (None, self.namespace):
            return None
        self._leases[lease.name] = lease
        return lease.name

    def delete(self, obj: Mapping[str, Any]) -> str | None:
        """A Lease was deleted; returns its name."""
        metadata = obj.get("metadata")
        name = metadata.get("name") if isinstance(metadata, Mapping) else None
        if not isinstance(name, str):
            return None
        self._leases.pop(name, None)
        return name

    def distrust(self, node: str) -> str | None:
        """Why ``node``'s agent report cannot be trusted now, or ``None``."""
        name = agent_lease_name(node)
        return distrust_reason(self._leases.get(name), f"{self.namespace}/{name}", self.clock())
