"""Serving an aiohttp application over HTTPS until SIGTERM, then shutting down gracefully (the main
listener may serve an RSGI application from native code instead: ``native``).

With an ``operational`` address, ``/healthz``, ``/readyz`` and ``/metrics`` are served there over
plain HTTP (see ``vramguard.io.http.create_operational_app``) and the main listener keeps only the
service's own routes: probes and scrapes then need no client certificate, while every route of
the main listener is behind its TLS settings (mutual TLS for the extender). Plain HTTP is enough
there: the routes are read-only, kubelet HTTPS probes would not verify a certificate anyway, and
the NetworkPolicy shipped with the manifests limits who reaches the port.

Shutdown order on SIGTERM or SIGINT: readiness turns 503 (``shutting-down``), an optional drain
delay lets the endpoints controller take the pod out of the Service, the listener closes,
requests in flight get up to ``shutdown_timeout`` seconds to finish, idle connections close.

Slow or stuck clients are bounded: a connection that sends no complete request within
``keepalive_timeout`` seconds is closed (aiohttp arms that timer at connect time too, so it also
covers trickled headers), the TLS handshake has asyncio's 60 s limit, bodies read through
``vramguard.io.http`` have their own time limit, and after a response aiohttp discards an unread
body for at most ``lingering_time`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from vramguard.io.http import READINESS_KEY, REGISTRY_KEY, create_operational_app
from vramguard.io.listener import Address, RunningServer, ServerSettings
from vramguard.io.tls import CertificateExpiryCollector, ReloadingTLSContext

if TYPE_CHECKING:
    from vramguard.io.rsgi import RsgiApp

__all__ = ["Address", "RunningServer", "ServerSettings", "run_https", "serve"]

logger = logging.getLogger(__name__)

TLSArgument = ssl.SSLContext | ReloadingTLSContext | None

# Set once the application's registry exports the certificate expiry of its TLS context.
_EXPIRY_EXPORTED = web.AppKey("vramguard_certificate_expiry_exported", bool)


@contextlib.asynccontextmanager
async def serve(
    app: web.Application,
    host: str,
    port: int,
    tls: TLSArgument,
    *,
    settings: ServerSettings | None = None,
    operational: Address | None = None,
    native: RsgiApp | None = None,
) -> AsyncIterator[RunningServer]:
    """Serve ``app`` on ``host:port`` while the ``async with`` body runs; stop gracefully on exit.

    ``port`` 0 picks a free port (see :attr:`RunningServer.port`). With a
    :class:`~vramguard.io.tls.ReloadingTLSContext` its watcher runs alongside the server, its
    certificates' expiry is exported in the application's registry and, if the application has a
    readiness registry without a ``"tls"`` check, one is added. ``tls`` None serves plain HTTP
    (tests, or a loopback-only port). ``operational`` (host, port) serves ``app``'s probes and
    metrics there over plain HTTP; ``app`` should then be made without them
    (``create_app(operational_routes=False)``). It closes after the main listener, so probes
    keep answering (503) while requests drain.

    ``native``: the main listener serves that RSGI application instead, from native code (HTTP/2
    and HTTP/1.1, see :mod:`vramguard.io.native_server`; ``tls`` must then be a
    :class:`~vramguard.io.tls.ReloadingTLSContext` or None), and ``app``, made with its probes and
    metrics (``create_app()``), is served as it is on ``operational``, which is then required.
    """
    settings = settings or ServerSettings()
    if native is not None and (operational is None or isinstance(tls, ssl.SSLContext)):
        raise ValueError("a native server needs an operational address, and its TLS as a ReloadingTLSContext")
    ssl_context = tls.context if isinstance(tls, ReloadingTLSContext) else tls
    readiness = app.get(READINESS_KEY)
    if isinstance(tls, ReloadingTLSContext):
        if readiness is not None and "tls" not in readiness:
            readiness.add("tls", tls.is_loaded)
        registry = app.get(REGISTRY_KEY)
        if registry is not None and not app.get(_EXPIRY_EXPORTED, False):
            registry.register(CertificateExpiryCollector(tls))
            app[_EXPIRY_EXPORTED] = True

    operational_runner: web.AppRunner | None = None
    operational_server: RunningServer | None = None
    if operational is not None:
        # With a native main listener, ``app`` is only the probes and metrics: served here as it is.
        operational_runner = _runner(app if native is not None else create_operational_app(app), settings)
        await operational_runner.setup()
        try:
            operational_site = web.TCPSite(operational_runner, *operational, backlog=settings.backlog)
            await operational_site.start()
        except BaseException:
            await operational_runner.cleanup()
            raise
        operational_server = RunningServer(host=operational[0], port=operational_site.port, scheme="http")
        logger.info("serving probes and metrics on %s", operational_server.url)

    if native is not None:
        # Imported here: the services without a native listener (the webhook, the agent) do not load it.
        from vramguard.io.native_server import serve_native  # noqa: PLC0415

        try:
            assert not isinstance(tls, ssl.SSLContext)
            async with serve_native(native, host, port, tls, settings=settings) as running:
                yield RunningServer(host=host, port=running.port, scheme=running.scheme, operational=operational_server,
                                    ended=running.ended)
        finally:
            if readiness is not None:
                readiness.begin_shutdown()
            if operational_runner is not None:
                await operational_runner.cleanup()
        return

    runner = _runner(app, settings)
    await runner.setup()
    watcher: asyncio.Task[None] | None = None
    try:
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context, backlog=settings.backlog)
        await site.start()
        if isinstance(tls, ReloadingTLSContext):
            watcher = asyncio.create_task(tls.watch(settings.reload_interval), name="tls-reload")
        server = RunningServer(
            host=host, port=site.port, scheme="https" if ssl_context else "http", operational=operational_server
        )
        logger.info("serving on %s", server.url)
        yield server
    finally:
        if readiness is not None:
            readiness.begin_shutdown()
        await runner.cleanup()
        if operational_runner is not None:
            await operational_runner.cleanup()
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher


async def run_https(
    app: web.Application,
    host: str,
    port: int,
    tls: TLSArgument,
    *,
    settings: ServerSettings | None = None,
    stop: asyncio.Event | None = None,
    on_started: Callable[[RunningServer], None] | None = None,
    handle_signals: bool = True,
    operational: Address | None = None,
    native: RsgiApp | None = None,
) -> None:
    """Serve ``app`` until SIGTERM or SIGINT (or ``stop`` is set), then shut down gracefully.

    ``operational`` and ``native`` are passed on to :func:`serve`.

    Tests pass ``port=0``, learn the port from ``on_started``, and end the server by setting
    ``stop`` (``handle_signals=False`` leaves the process's signal handling alone). Signal
    handlers are installed only from the main thread and removed on return.
    """
    settings = settings or ServerSettings()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    if handle_signals:
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(signum, _request_stop, stop, signum)
            except (NotImplementedError, RuntimeError, ValueError):
                # No signal support on this loop or thread: rely on ``stop`` alone.
                continue
            installed.append(signum)
    try:
        async with serve(app, host, port, tls, settings=settings, operational=operational, native=native) as server:
            if on_started is not None:
                on_started(server)
            await _until_stopped(stop, server)
            readiness = app.get(READINESS_KEY)
            if readiness is not None:
                readiness.begin_shutdown()
            if settings.drain_delay > 0:
                logger.info("draining for %g s before closing the listener", settings.drain_delay)
                await asyncio.sleep(settings.drain_delay)
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)
    logger.info("server stopped")


async def _until_stopped(stop: asyncio.Event, server: RunningServer) -> None:
    """Wait for ``stop``; raise if the listener stops by itself first (nothing would serve, while
    the probes, on their own listener, still answered)."""
    if server.ended is None:
        await stop.wait()
        return
    waiting: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    either: set[asyncio.Future[Any]] = {waiting, server.ended}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
    if not stop.is_set():
        ended = server.ended
        error = ended.exception() if not ended.cancelled() else None
        raise RuntimeError(f"the listener on {server.url} stopped by itself" + (f": {error}" if error else ""))


def _request_stop(stop: asyncio.Event, signum: signal.Signals) -> None:
    logger.info("received %s, shutting down", signum.name)
    stop.set()


def _runner(app: web.Application, settings: ServerSettings) -> web.AppRunner:
    return web.AppRunner(
        app,
        handle_signals=False,
        access_log=logging.getLogger("aiohttp.access") if settings.access_log else None,
        keepalive_timeout=settings.keepalive_timeout,
        lingering_time=settings.lingering_time,
        shutdown_timeout=settings.shutdown_timeout,
        max_line_size=settings.max_line_size,
        max_field_size=settings.max_field_size,
    )
