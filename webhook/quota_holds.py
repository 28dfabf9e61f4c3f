"""The namespace quota's pending admissions, shared by the webhook's replicas through the API server.

A GPU pod admitted a moment ago is not in any replica's pod watch yet: without care, two pods
reviewed by two replicas at once would each see the quota's old sum and both be admitted. So the
replica that admits a pod in a namespace with a quota records the admission, before it answers, in
one ConfigMap per such namespace, ``vramguard-quota-<namespace>`` in the webhook's own namespace,
written with the ``resourceVersion`` it read: of two replicas deciding at once, the API server lets
one write, the other gets a conflict, reads the record again with the first's admission in it, and
decides again (:func:`decide_with_shared_holds`). Every replica counts the record's admissions
until its pod watch shows their pods or they expire; a record is pruned at each write.

When the record cannot be read or written (the API server down), the review cannot know what the
other replicas admitted: a pod that needs a hold is refused where the namespace enforces the
policy, and admitted with a warning elsewhere.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vramguard.cluster import ClusterState, SharedHold
from vramguard.io.config_record import ConfigRecord
from vramguard.io.kube import ApiError, KubeClient

logger = logging.getLogger(__name__)

DEFAULT_QUOTA_NAMESPACE = "vramguard-system"
PREFIX = "vramguard-quota-"
DATA_KEY = "holds"
ATTEMPTS = 4
"""Decisions tried against a record that changed meanwhile (a conflict each), before giving up."""
MAX_HOLDS = 2048
"""Holds one record keeps (the newest): far more admissions than a namespace makes in 30 s."""


@dataclass(frozen=True, slots=True)
class Record:
    """One namespace's shared holds as read, and the version to write over (``None``: no record yet)."""

    holds: tuple[SharedHold, ...]
    version: str | None


class QuotaHolds:
    """Reads and writes the shared records in the webhook's namespace."""

    def __init__(self, client: KubeClient, namespace: str, clock: Callable[[], float] = time.time) -> None:
        self.client = client
        self.namespace = namespace
        self.clock = clock
        self._records = ConfigRecord(client, namespace, DATA_KEY,
                                     {"app.kubernetes.io/name": "vramguard", "app.kubernetes.io/component": "webhook"})

    async def read(self, quota_namespace: str) -> Record:
        """The namespace's record; an empty one when there is none. :class:`ApiError` when unreadable."""
        stored = await self._records.read(PREFIX + quota_namespace)
        return Record(_decode(stored.text), stored.version)

    async def write(self, quota_namespace: str, record: Record, holds: Sequence[SharedHold]) -> bool:
        """Replace the record read as ``record`` with ``holds``; ``False`` when another replica wrote
        it first (a conflict: read again). :class:`ApiError` for any other failure."""
        written = await self._records.write(PREFIX + quota_namespace, record.version, _encode(holds[-MAX_HOLDS:]),
                                            {"vramguard.io/quota-namespace": quota_namespace})
        return written is not None


def _encode(holds: Sequence[SharedHold]) -> str:
    return json.dumps([[h.uid, h.name, h.bytes, round(h.expires, 3)] for h in holds], separators=(",", ":"))


def _decode(text: Any) -> tuple[SharedHold, ...]:
    """The holds of a record; anything unreadable in it is skipped (the record is only ever written by
    the webhook, but a ConfigMap can be edited by whoever may)."""
    try:
        rows = json.loads(text) if isinstance(text, str) else []
    except ValueError:
        return ()
    holds = []
    for row in rows if isinstance(rows, list) else []:
        if (isinstance(row, list) and len(row) == 4 and isinstance(row[0], str) and isinstance(row[1], str)
                and isinstance(row[2], int) and isinstance(row[3], int | float)):
            holds.append(SharedHold(row[0], row[1], row[2], float(row[3])))
    return tuple(holds[-MAX_HOLDS:])


Decide = Callable[[], Awaitable[tuple[bool, str | None]]]
"""Decide once, on the cluster as it now stands: ``(admitted with a hold to share, its pod's UID)``."""


async def decide_with_shared_holds(
    store: QuotaHolds, state: ClusterState, quota_namespace: str, decide: Decide
) -> str | None:
    """Decide with the other replicas' holds counted, and share this replica's new hold; retry on a
    conflict. Returns ``None`` when done (the decision stands), or why the holds could not be shared
    (the caller refuses or warns: the decision may count too little). ``decide`` runs at least once."""
    for _ in range(ATTEMPTS):
        try:
            record = await store.read(quota_namespace)
        except ApiError as exc:
            await decide()  # on what this replica knows alone (the caller drops its hold if it refuses)
            return f"cannot read the quota's pending admissions ({exc.message or exc})"
        now = store.clock()
        state.adopt_holds(quota_namespace, record.holds, now)
        held, uid = await decide()
        if not held or uid is None:
            return None
        mine = state.shared_hold(uid, now)
        if mine is None:
            return None
        kept = [h for h in record.holds if h.expires > now and h.uid != uid and not state.is_settled(h.uid)]
        try:
            if await store.write(quota_namespace, record, [*kept, mine]):
                return None
        except ApiError as exc:
            return f"cannot record the admission for the quota ({exc.message or exc})"
        state.drop_hold(uid)  # another replica wrote first: decide again with its holds
    return f"the quota's pending admissions changed {ATTEMPTS} times while this pod was reviewed"
