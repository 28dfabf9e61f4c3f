"""Events the extender posts on pods (``core/v1`` Events, as kube-scheduler records its own)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Protocol

from vramguard.io.kube import ApiError, KubeClient, object_path

logger = logging.getLogger(__name__)

COMPONENT = "vramguard-extender"


class PodIdentity(Protocol):
    @property
    def uid(self) -> str: ...
    @property
    def namespace(self) -> str: ...
    @property
    def name(self) -> str: ...


async def post_pod_event(client: KubeClient, pod: PodIdentity, reason: str, message: str, kind: str) -> None:
    """Create one Event about ``pod`` (``kind``: ``Normal`` or ``Warning``); an API failure is
    logged, not raised: an Event is a courtesy, never a condition of the decision it reports."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{pod.name}.", "namespace": pod.namespace},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": pod.name, "namespace": pod.namespace,
                           "uid": pod.uid},
        "reason": reason,
        "message": message,
        "type": kind,
        "source": {"component": COMPONENT},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        await client.create(object_path("/api/v1/events", pod.namespace, "").rstrip("/"), event)
    except ApiError as exc:
        logger.warning("event for %s/%s: %s", pod.namespace, pod.name, exc.message or exc)
