"""aiohttp plumbing shared by the extender and the webhook.

:func:`create_app` returns an application with the operational endpoints every service needs:

- ``GET /healthz``: liveness; 200 while the process serves HTTP at all.
- ``GET /readyz``: 200 only when every registered readiness check passes, 503 naming the failing
  checks otherwise (and from the moment a graceful shutdown starts).
- ``GET /metrics``: Prometheus exposition of the registry passed in; no global registry is used,
  so tests can build several applications in one process.

plus a request-latency histogram and JSON errors. A service whose main listener requires client
certificates serves those three on a listener of their own instead (:func:`create_operational_app`,
started by ``vramguard.io.server.serve``), so kubelets and Prometheus need no client certificate.

Handlers read request bodies only through :func:`read_body`, :func:`read_json` or
:func:`read_model`: those enforce the body size limit (413), a time limit for slow senders (408),
and turn junk into a 400 with a JSON message.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, ValidationError

from vramguard.io import jsoncodec

__all__ = [
    "BODY_LIMIT_KEY",
    "CACHED_EXPOSITION_KEY",
    "CLIENT_CLOSED",
    "CONNECTIONS_KEY",
    "DEFAULT_BODY_TIMEOUT",
    "DEFAULT_CLIENT_MAX_SIZE",
    "LATENCY_BUCKETS",
    "LATENCY_KEY",
    "READINESS_KEY",
    "REGISTRY_KEY",
    "UNMATCHED_ROUTE",
    "Readiness",
    "ReadinessCheck",
    "RequestError",
    "create_app",
    "create_operational_app",
    "error_response",
    "parse_json",
    "parse_model",
    "read_body",
    "read_json",
    "read_model",
    "readiness_of",
]

logger = logging.getLogger(__name__)

DEFAULT_CLIENT_MAX_SIZE = 1024 * 1024
DEFAULT_BODY_TIMEOUT = 10.0

# Scheduler extender calls time out after 5 s by default and webhook calls after 10 s; the
# buckets resolve the range where those budgets are spent.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Label for requests that matched no route, so probing random paths cannot grow the label set.
UNMATCHED_ROUTE = "unmatched"
# Status recorded for a request whose client went away before an answer (nginx's convention).
CLIENT_CLOSED = 499

ReadinessCheck = Callable[[], bool | Awaitable[bool]]

M = TypeVar("M", bound=BaseModel)


class RequestError(Exception):
    """Raise from a handler to answer ``status`` with ``{"error": message}``.

    For malformed requests (400), oversized (413) or slow (408) bodies, and the like; a denial
    or a scheduling failure is a 200 in both wire protocols and is not raised this way.
    """

    def __init__(self, status: int, message: str) -> None:
        """Record the HTTP status (400..599) and the message a person can act on."""
        if not 400 <= status <= 599:
            raise ValueError(f"RequestError status must be 4xx or 5xx, got {status}")
        super().__init__(message)
        self.status = status
        self.message = message


class Readiness:
    """Named readiness checks, and whether the service is shutting down.

    A check returns True when ready; it may be a plain function or a coroutine function. A check
    that raises, or takes longer than ``check_timeout`` seconds, counts as failing.
    """

    def __init__(self, checks: Mapping[str, ReadinessCheck] | None = None, *, check_timeout: float = 2.0) -> None:
        """Start with ``checks`` (name -> check); more can be added with :meth:`add`."""
        self._checks: dict[str, ReadinessCheck] = {}
        self._check_timeout = check_timeout
        self._shutting_down = False
        for name, check in (checks or {}).items():
            self.add(name, check)

    def add(self, name: str, check: ReadinessCheck) -> None:
        """Register ``check`` under ``name`` (e.g. ``"tls"``, ``"caches-synced"``); names are unique."""
        if name in self._checks:
            raise ValueError(f"readiness check {name!r} is already registered")
        self._checks[name] = check

    def __contains__(self, name: object) -> bool:
        """Return whether a check of that name is registered."""
        return name in self._checks

    @property
    def names(self) -> list[str]:
        """The registered check names, in registration order."""
        return list(self._checks)

    def begin_shutdown(self) -> None:
        """Report not ready from now on, so endpoints drop this pod before it stops serving."""
        self._shutting_down = True

    @property
    def shutting_down(self) -> bool:
        """Whether :meth:`begin_shutdown` was called."""
        return self._shutting_down

    async def failing(self) -> list[str]:
        """Run every check and return the names of those that fail (empty when ready)."""
        failing = ["shutting-down"] if self._shutting_down else []
        results = await asyncio.gather(*(self._run(name, check) for name, check in self._checks.items()))
        failing += [name for name, ok in zip(self._checks, results, strict=True) if not ok]
        return failing

    async def _run(self, name: str, check: ReadinessCheck) -> bool:
        try:
            async with asyncio.timeout(self._check_timeout):
                result = check()
                if inspect.isawaitable(result):
                    result = await result
        except Exception:
            # TimeoutError included: a probe must answer, whatever a check does.
            logger.warning("readiness check %r failed with an error", name, exc_info=True)
            return False
        return bool(result)


READINESS_KEY = web.AppKey("vramguard_readiness", Readiness)
REGISTRY_KEY = web.AppKey("vramguard_metrics_registry", CollectorRegistry)
BODY_LIMIT_KEY = web.AppKey("vramguard_body_limit", int)
LATENCY_KEY = web.AppKey("vramguard_latency_histogram", Histogram)
CONNECTIONS_KEY = web.AppKey("vramguard_connections_counter", Counter)
# Returns text in the exposition format that ``/metrics`` appends to the registry's, in pieces sent one
# after the other: series too many to render on the request path, rendered elsewhere and cached (the
# extender's ledger).
CachedExposition = Callable[[], Sequence[bytes]]
CACHED_EXPOSITION_KEY = web.AppKey[CachedExposition]("vramguard_cached_exposition")


def create_app(
    *,
    registry: CollectorRegistry,
    readiness: Readiness | None = None,
    client_max_size: int = DEFAULT_CLIENT_MAX_SIZE,
    middlewares: Iterable[Middleware] = (),
    metrics_prefix: str = "vramguard",
    operational_routes: bool = True,
) -> web.Application:
    """Return an application with ``/healthz``, ``/readyz``, ``/metrics`` and the shared middlewares.

    With ``operational_routes`` False those three are left out, to be served on a separate
    listener by :func:`create_operational_app`.

    ``registry`` receives the ``<metrics_prefix>_http_request_duration_seconds`` histogram
    (labels ``route``, ``code``) and is what ``/metrics`` exposes; give each application its own.
    ``client_max_size`` caps request bodies read through :func:`read_body` and friends (413 above
    it). ``middlewares`` run inside the timing and error handling ones. Add the service's routes
    to the returned application.
    """
    if client_max_size < 1:
        raise ValueError(f"client_max_size must be positive, got {client_max_size}")
    readiness = readiness if readiness is not None else Readiness()
    latency = Histogram(
        f"{metrics_prefix}_http_request_duration_seconds",
        "Time to answer an HTTP request, by route template and status code.",
        labelnames=("route", "code"),
        buckets=LATENCY_BUCKETS,
        registry=registry,
    )
    connections = Counter(
        f"{metrics_prefix}_http_connections",
        "TLS connections accepted, by the route of their first request: against the requests, how "
        "well clients keep connections alive (each new one costs a TLS handshake).",
        labelnames=("route",),
        registry=registry,
    )
    app = web.Application(
        client_max_size=client_max_size,
        middlewares=[_serving_middleware(latency, connections), *middlewares],
    )
    app[READINESS_KEY] = readiness
    app[REGISTRY_KEY] = registry
    app[BODY_LIMIT_KEY] = client_max_size
    app[LATENCY_KEY] = latency
    app[CONNECTIONS_KEY] = connections
    if operational_routes:
        _add_operational_routes(app)
    return app


def create_operational_app(app: web.Application) -> web.Application:
    """Return an application serving ``app``'s ``/healthz``, ``/readyz`` and ``/metrics``.

    It shares ``app``'s readiness checks, metrics registry and latency histogram, and has no
    other route: nothing that changes state is reachable through it.
    """
    operational = web.Application(
        client_max_size=1024, middlewares=[_serving_middleware(app[LATENCY_KEY], app[CONNECTIONS_KEY])]
    )
    operational[READINESS_KEY] = app[READINESS_KEY]
    operational[REGISTRY_KEY] = app[REGISTRY_KEY]
    if CACHED_EXPOSITION_KEY in app:
        operational[CACHED_EXPOSITION_KEY] = app[CACHED_EXPOSITION_KEY]
    _add_operational_routes(operational)
    return operational


def _add_operational_routes(app: web.Application) -> None:
    app.router.add_get("/healthz", _healthz, allow_head=True)
    app.router.add_get("/readyz", _readyz, allow_head=True)
    app.router.add_get("/metrics", _metrics)


def readiness_of(app: web.Application) -> Readiness:
    """Return the :class:`Readiness` of an application made by :func:`create_app`."""
    return app[READINESS_KEY]


def error_response(status: int, message: str) -> web.Response:
    """Return a JSON error response ``{"error": message}`` with ``status``."""
    return jsoncodec.json_response({"error": message}, status=status)


async def read_body(request: web.Request, *, timeout: float = DEFAULT_BODY_TIMEOUT) -> bytes:
    """Read the whole request body, enforcing the application's size limit and ``timeout``.

    Raises :class:`RequestError`: 413 when the body (declared or actual, after any
    ``Content-Encoding`` is undone) exceeds the limit, 408 when it has not arrived within
    ``timeout`` seconds, 400 when it cannot be decoded.
    """
    limit = request.config_dict.get(BODY_LIMIT_KEY, DEFAULT_CLIENT_MAX_SIZE)
    declared = request.content_length
    if declared is not None and declared > limit:
        # Refuse before reading a byte; aiohttp would otherwise buffer up to the limit first.
        raise RequestError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        # Raised by aiohttp for chunked or compressed bodies that grow past client_max_size.
        raise RequestError(413, f"request body exceeds the limit of {limit} bytes") from None
    except TimeoutError:
        raise RequestError(408, f"request body not received within {timeout:g} s") from None
    except (web.RequestPayloadError, HttpProcessingError) as exc:
        raise RequestError(400, f"unreadable request body: {_one_line(str(exc))}") from None


async def read_json(request: web.Request, *, timeout: float = DEFAULT_BODY_TIMEOUT) -> dict[str, Any]:
    """Read the body as a JSON object; anything else is a :class:`RequestError` 400 saying why.

    The body must be UTF-8 (RFC 8259), whatever charset the Content-Type claims: a bogus charset
    must not turn into a server error. ``NaN`` and ``Infinity`` are rejected, as Go never sends them.
    """
    return parse_json(await read_body(request, timeout=timeout))


def parse_json(body: bytes) -> dict[str, Any]:
    """``body`` as a JSON object; anything else is a :class:`RequestError` 400 saying why (see
    :func:`read_json`)."""
    if not body.strip():
        raise RequestError(400, "request body is empty; expected a JSON object")
    try:
        value = jsoncodec.loads(body)
    except jsoncodec.JSONDecodeError:
        raise RequestError(400, _why_invalid(body)) from None
    if not isinstance(value, dict):
        raise RequestError(400, f"expected a JSON object, got {_json_type(value)}")
    return value


async def read_model(request: web.Request, model: type[M], *, timeout: float = DEFAULT_BODY_TIMEOUT) -> M:
    """Read the body as JSON and validate it into ``model``; a mismatch is a 400 naming the fields."""
    return parse_model(await read_body(request, timeout=timeout), model)


def parse_model(body: bytes, model: type[M]) -> M:
    """``body`` as JSON validated into ``model``; a mismatch is a :class:`RequestError` 400 naming the fields."""
    data = parse_json(body)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestError(400, f"invalid {model.__name__}: {_summarise(exc)}") from None


def _serving_middleware(latency: Histogram, connections: Counter) -> Middleware:
    """One middleware for what every request needs (one layer: each costs a coroutine per request):
    its latency by route and status code, a JSON answer for :class:`RequestError` and for an
    unhandled error, and, on the first request of each TLS connection, the connection counted by
    route."""
    children: dict[tuple[str, int], Any] = {}
    tls_connections: weakref.WeakSet[object] = weakref.WeakSet()

    @web.middleware
    async def serving(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        route = _route_label(request)
        transport = request.transport
        tls = transport.get_extra_info("ssl_object") if transport is not None else None
        if tls is not None and tls not in tls_connections:
            tls_connections.add(tls)
            connections.labels(route=route).inc()
        code = 500
        try:
            response = await handler(request)
            code = response.status
            return response
        except RequestError as exc:
            code = exc.status
            return error_response(exc.status, exc.message)
        except web.HTTPException as exc:
            # HTTP exceptions are answers already.
            code = exc.status
            raise
        except (asyncio.CancelledError, ConnectionError):
            # A vanished client cannot be answered.
            code = CLIENT_CLOSED
            raise
        except Exception:
            # Log the traceback here, answer without it: internals are not the caller's business.
            logger.exception("unhandled error in %s %s", request.method, request.path)
            return error_response(500, "internal error")
        finally:
            child = children.get((route, code))
            if child is None:
                child = children[route, code] = latency.labels(route=route, code=str(code))
            child.observe(time.perf_counter() - started)

    return serving


async def _healthz(_: web.Request) -> web.Response:
    return jsoncodec.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    failing = await request.config_dict[READINESS_KEY].failing()
    if failing:
        return jsoncodec.json_response({"status": "not ready", "failing": failing}, status=503)
    return jsoncodec.json_response({"status": "ready"})


METRICS_WRITE_BYTES = 64 * 1024
"""A large exposition is sent in pieces this size, each awaited, so that encrypting and writing
megabytes does not hold the event loop in one go."""


async def _metrics(request: web.Request) -> web.StreamResponse:
    payload = generate_latest(request.config_dict[REGISTRY_KEY])
    cached = request.config_dict.get(CACHED_EXPOSITION_KEY)
    # The cached pieces are sent as they are: joining them would copy megabytes per scrape.
    pieces = [payload, *cached()] if cached is not None else [payload]
    # CONTENT_TYPE_LATEST carries a charset parameter, which aiohttp wants passed separately.
    headers = {"Content-Type": CONTENT_TYPE_LATEST}
    length = sum(map(len, pieces))
    if length <= METRICS_WRITE_BYTES:
        return web.Response(body=b"".join(pieces), headers=headers)
    response = web.StreamResponse(headers=headers)
    response.content_length = length
    await response.prepare(request)
    for piece in pieces:
        view = memoryview(piece)
        for start in range(0, len(piece), METRICS_WRITE_BYTES):
            await response.write(view[start:start + METRICS_WRITE_BYTES])
    await response.write_eof()
    return response


def _route_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else UNMATCHED_ROUTE


def _why_invalid(body: bytes) -> str:
    """Why ``body``, which the fast decoder refused, is not JSON, as the standard library words it
    (only on this error path: its messages name the line and column, or the offending constant)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"request body is not UTF-8 (invalid byte at offset {exc.start})"
    try:
        json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        return f"invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
    except RecursionError:
        return "invalid JSON: nested too deeply"
    except ValueError as exc:
        # Non-finite constants, integers longer than Python's digit limit.
        return f"invalid JSON: {_one_line(str(exc))}"
    # Valid to the standard library, not to RFC 8259 as the fast decoder reads it (an unpaired
    # surrogate escape, a number beyond a double, nesting deeper than 1,024 levels).
    return "invalid JSON: not strict RFC 8259 JSON (unpaired surrogate, out-of-range number or nesting too deep)"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    return "a number"


def _summarise(exc: ValidationError, limit: int = 3) -> str:
    errors = exc.errors(include_url=False, include_input=False)
    parts = [f"{'.'.join(str(part) for part in error['loc']) or '(root)'}: {error['msg']}" for error in errors[:limit]]
    if len(errors) > limit:
        parts.append(f"and {len(errors) - limit} more")
    return "; ".join(parts)


def _one_line(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
