"""A Service in front of several extender replicas: what kube-proxy does for a ClusterIP Service.

Each new TCP connection goes to a backend whose readiness probe answers 200 now (as an endpoint
is in the EndpointSlice only while its pod is ready); bytes are passed through untouched, so TLS
(and the client certificate) stays end to end between kube-scheduler and the extender. A
connection that finds no ready backend is closed, as a Service without endpoints refuses it.
Established connections are not moved when readiness changes, as with kube-proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Backend:
    """One replica: where its verbs are and where its readiness probe is."""

    port: int
    ready_url: str
    context: ssl.SSLContext | None = None
    """How to trust the probe's certificate, where it is served over HTTPS (the webhook's)."""


def _ready(backend: Backend) -> bool:
    try:
        with urllib.request.urlopen(backend.ready_url, timeout=1, context=backend.context) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


class ServiceProxy:
    """Listen on 127.0.0.1:``port`` in a background thread; route to a ready backend."""

    def __init__(self, port: int, backends: Sequence[Backend], *, spread: bool = False) -> None:
        """``spread``: each connection to the next ready backend in turn (kube-proxy's random choice,
        made predictable), instead of the first ready one."""
        self.port = port
        self.backends = list(backends)
        self.spread = spread
        self._turn = 0
        self.connections: dict[int, int] = {}
        """Backend port -> connections routed to it (for the tests' own checks)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="service-proxy", daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> None:
        """Start listening; returns once the port is bound."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=10)

    def stop(self) -> None:
        """Stop listening, end every connection, and end the thread."""
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ready = [b for b in self.backends if await asyncio.to_thread(_ready, b)]
        if not ready:
            writer.close()
            return
        backend = ready[self._turn % len(ready)] if self.spread else ready[0]
        self._turn += 1
        self.connections[backend.port] = self.connections.get(backend.port, 0) + 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", backend.port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, OSError):
            writer.close()
