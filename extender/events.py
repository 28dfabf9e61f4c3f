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
    involved = {"apiVersion": "v1", "kind": "Pod", "name": pod.name, "namespace": pod.namespace, "uid": pod.uid}
    await _post(client, pod.namespace, involved, reason, message, kind)


async def post_node_event(client: KubeClient, node: str, reason: str, message: str, kind: str) -> None:
    """Create one Event about Node ``node``, in ``default`` where ``kubectl describe node`` finds it."""
    await _post(client, "default", {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node}, reason, message,
                kind)


async def post_object_event(client: KubeClient, involved: dict[str, str], reason: str, message: str, kind: str) -> None:
    """Create one Event about the namespaced object ``involved`` (``apiVersion``, ``kind``, ``name``,
    ``namespace``; ``uid`` where known), in its namespace."""
    await _post(client, involved["namespace"], {k: v for k, v in involved.items() if v}, reason, message, kind)


async def _post(
    client: KubeClient, namespace: str, involved: dict[str, str], reason: str, message: str, kind: str
) -> None:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{involved['name']}.", "namespace": namespace},
        "involvedObject": involved,
        "reason": reason,
        "message": message,
        "type": kind,
        "source": {"component": COMPONENT},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        await client.create(object_path("/api/v1/events", namespace, "").rstrip("/"), event)
    except ApiError as exc:
        logger.warning("event for %s %s: %s", involved["kind"], involved["name"], exc.message or exc)
