"""Running the webhook: load the policy and TLS, watch the cluster, serve HTTPS until SIGTERM.

Start-up fails fast, with one line saying why, when the policy, the TLS pair or the kubeconfig
cannot be loaded. Readiness (``GET /readyz``) stays 503 until the TLS pair is served and the
namespace, node and pod watches have listed once, so the API server is never routed to a webhook
that would judge quotas on an empty cache.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from vramguard.cluster import LIVE_PODS_SELECTOR, slim_node, slim_pod
from vramguard.io.dra import RESOURCE_API, DraMetrics, dra_watches
from vramguard.io.kube import MAX_EVENT_BYTES, ApiError, Connection, KubeClient, object_path
from vramguard.io.runtime import ServiceRuntime, Watch, reload_every
from vramguard.io.server import RunningServer, ServerSettings, run_https
from vramguard.io.tls import ReloadingTLSContext
from webhook.app import PolicySource, WebhookState, create_webhook_app
from webhook.quota_holds import DEFAULT_QUOTA_NAMESPACE, QuotaHolds

__all__ = ["POD_FIELD_SELECTOR", "WebhookSettings", "run_webhook"]

logger = logging.getLogger(__name__)

# Finished pods hold no GPU; the watch then reports a pod that finishes as DELETED.
POD_FIELD_SELECTOR = LIVE_PODS_SELECTOR
POLICY_REFRESH_INTERVAL = 10.0


@dataclass(frozen=True)
class WebhookSettings:
    """Everything the webhook needs to run, validated by the command line."""

    host: str
    port: int
    tls: ReloadingTLSContext
    connection: Connection
    policy: PolicySource
    server: ServerSettings
    policy_refresh_interval: float = POLICY_REFRESH_INTERVAL
    max_event_bytes: int = MAX_EVENT_BYTES
    quota_namespace: str = DEFAULT_QUOTA_NAMESPACE
    """Where the replicas share the quota's pending admissions (:mod:`webhook.quota_holds`)."""


async def run_webhook(
    settings: WebhookSettings,
    *,
    stop: asyncio.Event | None = None,
    on_started: Callable[[RunningServer], None] | None = None,
    handle_signals: bool = True,
) -> None:
    """Watch the cluster and serve ``/validate`` until SIGTERM (or ``stop``), then shut down gracefully.

    Readiness fails while a watch is unhealthy; a background task that dies ends the server and
    raises :class:`vramguard.io.supervise.TaskDied`.
    """
    async with KubeClient(settings.connection, max_event_bytes=settings.max_event_bytes) as client:

        async def get_or_none(path: str) -> Mapping[str, Any] | None:
            try:
                return await client.get(path)
            except ApiError as exc:
                if exc.status == 404:
                    return None
                raise

        async def lookup(namespace: str) -> Mapping[str, Any] | None:
            return await get_or_none(f"/api/v1/namespaces/{quote(namespace, safe='')}")

        async def claim_lookup(collection: str, namespace: str, name: str) -> Mapping[str, Any] | None:
            return await get_or_none(object_path(f"{RESOURCE_API}/{collection}", namespace, name))

        async def pod_lookup(namespace: str, name: str) -> Mapping[str, Any] | None:
            return await get_or_none(object_path("/api/v1/pods", namespace, name))

        state = WebhookState(
            settings.policy, namespace_lookup=lookup, claim_lookup=claim_lookup, pod_lookup=pod_lookup,
            quota_holds=QuotaHolds(client, settings.quota_namespace),
        )
        # One cluster model, fed every live pod: the quota counts them all, the ledger (for pods
        # created with spec.nodeName) the bound ones among them.
        cluster = state.cluster
        runtime = ServiceRuntime(client, [
            Watch("/api/v1/namespaces", cluster.namespaces),
            Watch("/api/v1/nodes", cluster.nodes, slim=slim_node),
            Watch("/api/v1/pods", cluster.pods, {"fieldSelector": POD_FIELD_SELECTOR}, slim=slim_pod),
            *dra_watches(cluster.dra),
        ])
        runtime.registry.register(DraMetrics(cluster.dra))
        runtime.readiness.add("informers-synced", runtime.synced)
        app = create_webhook_app(state, registry=runtime.registry, readiness=runtime.readiness)
        runtime.tasks["policy-refresh"] = reload_every(settings.policy_refresh_interval, state.refresh_policy)
        await runtime.serve(
            run_https(
                app,
                settings.host,
                settings.port,
                settings.tls,
                settings=settings.server,
                stop=stop,
                on_started=on_started,
                handle_signals=handle_signals,
            ),
        )


def describe_start(settings: WebhookSettings, policy_path: Path | None) -> str:
    """One log line saying what the webhook serves with."""
    source = str(policy_path) if policy_path is not None else "the built-in default policy"
    return (
        f"vramguard webhook on {settings.host}:{settings.port}, API server {settings.connection.server}, "
        f"policy {source} (default enforcement {settings.policy.policy.enforcement})"
    )
