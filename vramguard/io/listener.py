"""Where and how a vramguard server listens: the settings every listener shares, and where a started one is."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from vramguard.io.tls import DEFAULT_RELOAD_INTERVAL

__all__ = ["Address", "RunningServer", "ServerSettings"]

Address = tuple[str, int]


@dataclass(frozen=True)
class ServerSettings:
    """Connection handling limits; the defaults suit in-cluster callers (Go HTTP clients)."""

    # Longer than the 90 s IdleConnTimeout of the Go transports in the kube-apiserver and the
    # kube-scheduler: if the server closed idle connections first, a POST racing the close would
    # fail (Go retries only idempotent requests), turning into a webhook or extender error.
    keepalive_timeout: float = 120.0
    # Time requests in flight get to finish after the listener closes.
    shutdown_timeout: float = 15.0
    # Time between readiness turning 503 and the listener closing; set a few seconds in a cluster
    # so that no new request is routed to a pod that no longer accepts it.
    drain_delay: float = 0.0
    # Time spent discarding a request body the handler did not read, before closing.
    lingering_time: float = 2.0
    # How often a ReloadingTLSContext checks its files.
    reload_interval: float = DEFAULT_RELOAD_INTERVAL
    # Access logs are off: probes and scheduler calls would flood them; metrics carry the counts.
    access_log: bool = False
    backlog: int = 128
    max_line_size: int = 8190
    max_field_size: int = 8190


@dataclass(frozen=True)
class RunningServer:
    """Where a started server listens."""

    host: str
    port: int
    scheme: str
    operational: RunningServer | None = None
    """The plain-HTTP listener of ``/healthz``, ``/readyz`` and ``/metrics``, when separate."""
    ended: asyncio.Future[None] | None = None
    """Done when the listener stopped by itself (a native server whose worker died); None when it
    cannot (aiohttp's listeners stop only when told)."""

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. ``https://127.0.0.1:8443``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"
