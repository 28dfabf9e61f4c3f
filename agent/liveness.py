"""The agent's liveness: its node's Lease (``coordination.k8s.io/v1``), renewed every quarter of its
duration (as the kubelet renews its node Lease), so 5,000 agents write about 500 Leases a second at
the default 40 s, not one per agent cycle.

Readers trust the Node's report only while this Lease is fresh (:mod:`vramguard.lease`), so the
report annotation itself is written only when its content changes. The Lease is renewed only after
a cycle whose report reached the annotation (or needed no write): a fresh Lease says "the
annotation is this agent's current view". An agent that cannot write its report stops renewing,
and after ``leaseDurationSeconds`` the extender falls back to the conservative rule.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vramguard.codecs import agent_lease_name
from vramguard.lease import format_micro_time, lease_body

__all__ = ["LeaseRenewer"]

JSON = dict[str, Any]


class LeaseRenewer:
    """Creates the node's Lease, then renews it with an update (``get``, ``create``, ``update`` only)."""

    def __init__(
        self,
        client: Any,
        namespace: str,
        node: str,
        holder: str,
        duration: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``client``: a :class:`vramguard.io.kube.KubeClient`; ``holder``: this agent pod's name;
        ``duration``: ``leaseDurationSeconds``; ``clock``: seconds since the epoch."""
        self._client = client
        self._namespace = namespace
        self._node = node
        self._holder = holder
        self._duration = duration
        self._clock = clock
        from vramguard.io.kube import LEASES, collection_path, object_path  # noqa: PLC0415 - loads aiohttp

        self._collection = collection_path(LEASES, namespace)
        self._path = object_path(LEASES, namespace, agent_lease_name(node))
        self._current: JSON | None = None
        self._renewed_at: float | None = None
        self.renew_every = duration / 4
        """Seconds between two renewals; a cycle sooner than that writes nothing."""

    @property
    def name(self) -> str:
        """The Lease's name."""
        return agent_lease_name(self._node)

    async def renew(self) -> bool:
        """Set ``renewTime`` to now unless it was set less than :attr:`renew_every` ago; True when
        written. Raise what the API raises (the caller retries next cycle).

        The update carries the last ``resourceVersion`` seen: a conflict (someone else wrote it)
        makes the next renewal read it afresh.
        """
        from vramguard.io.kube import ApiError  # noqa: PLC0415 - vramguard.io loads aiohttp; --once needs none

        now = self._clock()
        if self._renewed_at is not None and 0 <= now - self._renewed_at < self.renew_every:
            return False
        try:
            if self._current is None:
                try:
                    self._current = await self._client.get(self._path)
                except ApiError as exc:
                    if exc.status != 404:
                        raise
                    body = lease_body(self._namespace, self._node, self._holder, self._duration, now)
                    self._current = await self._client.create(self._collection, body)
                    self._renewed_at = now
                    return True
            lease = dict(self._current)
            spec = dict(lease.get("spec") or {})
            if spec.get("holderIdentity") != self._holder:
                spec["acquireTime"] = format_micro_time(now)
                spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
            spec.update(holderIdentity=self._holder, leaseDurationSeconds=self._duration,
                        renewTime=format_micro_time(now))
            lease["spec"] = spec
            self._current = await self._client.request("PUT", self._path, lease)
        except Exception:
            self._current = None
            raise
        self._renewed_at = now
        return True
