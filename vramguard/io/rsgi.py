"""POST endpoints served through RSGI, the interface of the native server (``vramguard.io.native_server``).

An endpoint takes the request body (bytes) and returns a status and a JSON body; what every
request needs around it is done here, once: routing by path (404, 405), the body's size limit
(413, refused from ``Content-Length`` before a byte is read, and while it streams), a time limit
for slow senders (408), a compressed body refused (415: the endpoints read JSON as sent), JSON
errors for :class:`~vramguard.io.http.RequestError`, a 500 without internals for a bug, and the
latency histogram and connection counter the aiohttp services export under the same names.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from cachetools import LRUCache
from prometheus_client import Counter, Histogram

from vramguard.io import jsoncodec
from vramguard.io.http import (
    CLIENT_CLOSED,
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_CLIENT_MAX_SIZE,
    UNMATCHED_ROUTE,
    RequestError,
)

__all__ = ["Endpoint", "Reply", "RsgiApp", "json_reply"]

logger = logging.getLogger(__name__)

Reply = tuple[int, bytes]
"""An endpoint's answer: the HTTP status and a JSON body."""
Endpoint = Callable[[bytes], Awaitable[Reply]]
"""An endpoint: the request body in, the answer out."""

_JSON_HEADERS = [("content-type", "application/json")]
CONNECTIONS_REMEMBERED = 4096
"""Client addresses (``ip:port``, one per connection) remembered to count each connection once:
a connection carries many requests (HTTP/1.1 keep-alive) or streams (HTTP/2)."""


class Scope(Protocol):
    """What an RSGI HTTP scope offers that is read here."""

    proto: str
    method: str
    path: str
    client: str

    @property
    def headers(self) -> Any: ...


class HTTPProtocol(Protocol):
    """What an RSGI HTTP protocol offers that is used here."""

    async def __call__(self) -> bytes: ...

    def __aiter__(self) -> Any: ...

    def response_bytes(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None: ...


def json_reply(value: Any, status: int = 200) -> Reply:
    """``value`` encoded as the JSON body of a ``status`` answer."""
    return status, jsoncodec.dumps(value)


class RsgiApp:
    """An RSGI application serving ``endpoints`` (path -> :data:`Endpoint`) to ``POST`` requests."""

    def __init__(
        self,
        endpoints: Mapping[str, Endpoint],
        *,
        latency: Histogram,
        connections: Counter,
        body_limit: int = DEFAULT_CLIENT_MAX_SIZE,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
        body_limit_hint: str = "",
    ) -> None:
        """``latency`` (labels ``route``, ``code``) and ``connections`` (label ``route``) are the
        metrics :func:`vramguard.io.http.create_app` makes; ``body_limit_hint`` is appended to a
        413's message (what to do about it)."""
        if body_limit < 1:
            raise ValueError(f"body_limit must be positive, got {body_limit}")
        self._endpoints = dict(endpoints)
        self._latency = latency
        self._connections = connections
        self._body_limit = body_limit
        self._body_timeout = body_timeout
        self._hint = f"; {body_limit_hint}" if body_limit_hint else ""
        self._children: dict[tuple[str, int], Any] = {}
        self._clients: LRUCache[str, None] = LRUCache(CONNECTIONS_REMEMBERED)

    async def __rsgi__(self, scope: Scope, protocol: HTTPProtocol) -> None:
        """Answer one request (the RSGI entry point)."""
        if scope.proto != "http":
            return  # websockets are switched off in the server; nothing else arrives
        started = time.perf_counter()
        endpoint = self._endpoints.get(scope.path)
        route = scope.path if endpoint is not None else UNMATCHED_ROUTE
        if scope.client not in self._clients:
            self._clients[scope.client] = None
            self._connections.labels(route=route).inc()
        code, body = 500, b""
        try:
            code, body = await self._answer(scope, protocol, endpoint)
            protocol.response_bytes(code, _JSON_HEADERS, body)
        except (asyncio.CancelledError, RuntimeError) as exc:
            # The client went away: the server cancels the request, or the protocol is closed
            # (granian raises RuntimeError subclasses for that).
            code = CLIENT_CLOSED
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            child = self._children.get((route, code))
            if child is None:
                child = self._children[route, code] = self._latency.labels(route=route, code=str(code))
            child.observe(time.perf_counter() - started)

    async def _answer(self, scope: Scope, protocol: HTTPProtocol, endpoint: Endpoint | None) -> Reply:
        try:
            if endpoint is None:
                raise RequestError(404, f"no endpoint at {scope.path[:200]}")
            if scope.method != "POST":
                raise RequestError(405, f"{scope.method[:16]} is not allowed here; use POST")
            return await endpoint(await self._read(scope, protocol))
        except RequestError as exc:
            return json_reply({"error": exc.message}, exc.status)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            # Logged here with the traceback, answered without it: internals are not the caller's business.
            logger.exception("unhandled error in %s %s", scope.method, scope.path)
            return json_reply({"error": "internal error"}, 500)

    async def _read(self, scope: Scope, protocol: HTTPProtocol) -> bytes:
        headers = scope.headers
        encoding = headers.get("content-encoding")
        if encoding is not None and encoding.strip().lower() not in ("", "identity"):
            raise RequestError(415, f"Content-Encoding {encoding[:32]!r} is not accepted; send the body uncompressed")
        limit = self._body_limit
        declared = headers.get("content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                raise RequestError(400, "Content-Length is not a number") from None
            if length > limit:
                # Refused before a byte of it is read.
                raise RequestError(
                    413, f"request body of {length} bytes exceeds the limit of {limit} bytes{self._hint}")
        try:
            async with asyncio.timeout(self._body_timeout):
                if declared is not None:
                    # Within the limit: read in one go (the server holds the sender to its length).
                    return await protocol()
                chunks: list[bytes] = []
                size = 0
                async for chunk in protocol:
                    size += len(chunk)
                    if size > limit:
                        raise RequestError(413, f"request body exceeds the limit of {limit} bytes{self._hint}")
                    chunks.append(chunk)
        except TimeoutError:
            raise RequestError(408, f"request body not received within {self._body_timeout:g} s") from None
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
