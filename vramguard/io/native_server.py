"""Serving an :class:`~vramguard.io.rsgi.RsgiApp` from native code: HTTP/2 and HTTP/1.1, TLS and
client-certificate checks in granian's embedded server (Rust: hyper and rustls), on this process's
event loop.

Why not aiohttp for the extender's verbs: kube-scheduler's extender client speaks HTTP/2 when the
server offers it, and then opens one TLS connection for a whole scheduling wave instead of a
handshake for most filters; aiohttp has no HTTP/2, and framing it in Python costs what it saves.

- **Mutual TLS.** With a client CA, rustls refuses at the handshake a client without a certificate
  chaining to it; no HTTP is read. The CA is always passed with the requirement (granian silently
  drops the requirement when the CA is missing).
- **Certificate rotation.** granian reads its certificate files by path, when a worker starts. It
  is given a private copy (a 0700 directory) of what :class:`~vramguard.io.tls.ReloadingTLSContext`
  last loaded and validated, never the mounted files: a Secret volume's files resolve to a
  timestamped directory the kubelet deletes at the next rotation, and a half-rotated pair must not
  reach a worker (one that cannot load its certificate ends the server). On a validated change the
  copy is rewritten and the worker respawned: the new worker listens beside the old one
  (``SO_REUSEPORT``) before the old one stops, and established connections finish on the old one.
- **The client's certificate** cannot be observed: RSGI exposes no peer certificate, so the
  ``client`` role of ``vramguard_certificate_expiry_timestamp_seconds`` is not exported by this
  server (the client CA's expiry is; ``vramguard keep-certs`` exports that of the client
  certificate it issues).
- **Shutdown.** Readiness turns 503, the drain delay passes (``run_https``), the listener closes and
  requests in flight get ``shutdown_timeout`` seconds to finish.
- **Bounds.** Headers: ``max_field_size`` per HTTP/1.1 buffer and HTTP/2 header list; a connection
  that sends no complete header block within ``keepalive_timeout`` seconds is closed, and one that
  never finishes its TLS handshake within about 10 s (granian's own limit; 1,000 of them left a
  request from kube-scheduler's certificate answered in 4 ms); at most ``backlog`` requests in
  flight per worker, then connections wait; bodies are bounded by the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from granian.constants import HTTPModes, Interfaces, SSLProtocols
from granian.http import HTTP1Settings, HTTP2Settings
from granian.server.embed import Server

from vramguard.io.certs import write_atomic
from vramguard.io.listener import RunningServer, ServerSettings
from vramguard.io.rsgi import RsgiApp
from vramguard.io.tls import PemFiles, ReloadingTLSContext

__all__ = ["serve_native"]

logger = logging.getLogger(__name__)

LISTEN_TIMEOUT_SECONDS = 10.0
"""How long start-up waits for the worker to accept connections."""
RESPAWN_OVERLAP_SECONDS = 0.5
"""After a certificate rotation, how long the old worker keeps listening beside the new one
(granian's default is 3.5 s): long enough for the new one to accept, short enough that new
handshakes soon all get the new certificate."""
HTTP2_MAX_STREAMS = 250
"""Concurrent streams per HTTP/2 connection (Go's default for its own servers); kube-scheduler's
filters and binds for a wave share one connection."""


class _TLSCopy:
    """The private copy of the validated TLS files that granian reads."""

    def __init__(self, directory: Path) -> None:
        self.cert = directory / "tls.crt"
        self.key = directory / "tls.key"
        self.ca = directory / "ca.crt"

    def write(self, pem: PemFiles) -> None:
        for path, content in ((self.cert, pem.certificate), (self.key, pem.key), (self.ca, pem.client_ca)):
            if content is not None:
                write_atomic(path, content, 0o600)


@contextlib.asynccontextmanager
async def serve_native(
    app: RsgiApp,
    host: str,
    port: int,
    tls: ReloadingTLSContext | None,
    *,
    settings: ServerSettings | None = None,
) -> AsyncIterator[RunningServer]:
    """Serve ``app`` on ``host:port`` while the ``async with`` body runs; stop gracefully on exit.

    ``tls`` must be loaded (``load_server_tls``); with a client CA, clients need a certificate it
    signed. ``tls`` None serves plain HTTP (``--insecure-http`` on loopback, tests). ``port`` 0
    picks a free port. Rotation of ``tls``'s files is followed every ``reload_interval`` seconds.
    """
    settings = settings or ServerSettings()
    port = port or _free_port(host)
    with tempfile.TemporaryDirectory(prefix="vramguard-tls-") as directory:
        copy = _TLSCopy(Path(directory))
        tls_arguments: dict[str, object] = {}
        if tls is not None:
            pem = tls.pem
            if pem is None:
                raise ValueError("the TLS files must be loaded before serving (load_server_tls)")
            copy.write(pem)
            tls_arguments = {"ssl_cert": copy.cert, "ssl_key": copy.key, "ssl_protocol_min": SSLProtocols.tls12}
            if pem.client_ca is not None:
                tls_arguments |= {"ssl_ca": copy.ca, "ssl_client_verify": True}
        server = Server(
            app,
            address=host,
            port=port,
            interface=Interfaces.RSGI,
            http=HTTPModes.auto,
            websockets=False,
            backlog=settings.backlog,
            backpressure=settings.backlog,
            http1_settings=HTTP1Settings(
                header_read_timeout=int(settings.keepalive_timeout * 1000),
                max_buffer_size=settings.max_field_size + settings.max_line_size,
            ),
            http2_settings=HTTP2Settings(
                max_concurrent_streams=HTTP2_MAX_STREAMS,
                max_headers_size=settings.max_field_size,
                keep_alive_timeout=int(settings.keepalive_timeout),
            ),
            log_enabled=False,
            **tls_arguments,  # type: ignore[arg-type]
        )
        server.respawn_interval = RESPAWN_OVERLAP_SECONDS  # not a parameter of the embedded server's
        serving = asyncio.create_task(server.serve(), name="native-server")
        watcher: asyncio.Task[None] | None = None
        try:
            await _until_listening(host, port, serving)
            if tls is not None:
                def respawn() -> None:
                    # The copy first: the new worker reads it as it starts.
                    assert tls.pem is not None
                    copy.write(tls.pem)
                    server.reload()  # type: ignore[no-untyped-call]

                watcher = asyncio.create_task(tls.watch(settings.reload_interval, respawn), name="tls-reload")
            running = RunningServer(host=host, port=port, scheme="https" if tls is not None else "http", ended=serving)
            logger.info("serving on %s (HTTP/2 and HTTP/1.1)", running.url)
            yield running
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            await _stop(server, serving, settings.shutdown_timeout)


async def _until_listening(host: str, port: int, serving: asyncio.Task[None]) -> None:
    """Return once ``host:port`` accepts a connection; raise if the server ended or never listens."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LISTEN_TIMEOUT_SECONDS
    while True:
        if serving.done():
            serving.result()  # the server's error, if it raised one
            raise RuntimeError(f"the server on {host}:{port} stopped during start-up")
        try:
            _, writer = await asyncio.open_connection(_connectable(host), port)
        except OSError:
            if loop.time() > deadline:
                raise RuntimeError(
                    f"the server on {host}:{port} did not listen within {LISTEN_TIMEOUT_SECONDS:g} s") from None
            await asyncio.sleep(0.02)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return


async def _stop(server: Server, serving: asyncio.Task[None], timeout: float) -> None:
    """Stop accepting, give requests in flight ``timeout`` seconds, then cancel what is left."""
    if serving.done():
        if not serving.cancelled() and serving.exception() is not None:
            logger.error("the server had stopped: %s", serving.exception())
        return
    server.stop()  # type: ignore[no-untyped-call]
    try:
        await asyncio.wait_for(asyncio.shield(serving), timeout)
    except TimeoutError:
        logger.warning("requests still in flight after %g s; closing", timeout)
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await serving
    logger.info("server stopped")


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def _connectable(host: str) -> str:
    """Where to connect to reach a server listening on ``host`` (the wildcard addresses are not)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
