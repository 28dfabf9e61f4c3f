"""vramguard.io.http and vramguard.io.server: probes, metrics, body limits, JSON errors, serving, shutdown."""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import os
import signal
import ssl
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from vramguard.io import certs
from vramguard.io.http import (
    DEFAULT_CLIENT_MAX_SIZE,
    Readiness,
    RequestError,
    create_app,
    read_body,
    read_json,
    read_model,
    readiness_of,
)
from vramguard.io.server import RunningServer, ServerSettings, run_https, serve
from vramguard.io.tls import load_server_tls

HOST = "127.0.0.1"
MiB = 1024 * 1024

ClientFactory = Callable[[web.Application], Awaitable[TestClient[web.Request, web.Application]]]


class Pod(BaseModel):
    name: str
    gpus: int


async def _echo_json(request: web.Request) -> web.Response:
    data = await read_json(request)
    return web.json_response({"keys": sorted(data)})


async def _echo_size(request: web.Request) -> web.Response:
    return web.json_response({"size": len(await read_body(request))})


async def _slow_body(request: web.Request) -> web.Response:
    return web.json_response({"size": len(await read_body(request, timeout=0.2))})


async def _model(request: web.Request) -> web.Response:
    pod = await read_model(request, Pod)
    return web.json_response({"name": pod.name})


async def _boom(_: web.Request) -> web.Response:
    raise RuntimeError("internal detail that must not leak")


async def _teapot(_: web.Request) -> web.Response:
    raise RequestError(409, "already bound")


def _app(
    *, registry: CollectorRegistry | None = None, readiness: Readiness | None = None, **kwargs: Any
) -> web.Application:
    app = create_app(registry=registry or CollectorRegistry(), readiness=readiness, **kwargs)
    app.router.add_post("/json", _echo_json)
    app.router.add_post("/size", _echo_size)
    app.router.add_post("/slow-body", _slow_body)
    app.router.add_post("/model", _model)
    app.router.add_get("/boom", _boom)
    app.router.add_get("/conflict", _teapot)
    return app


# --- probes ---------------------------------------------------------------------------------


async def test_healthz(aiohttp_client: ClientFactory) -> None:
    client = await aiohttp_client(_app())
    response = await client.get("/healthz")
    assert response.status == 200
    assert await response.json() == {"status": "ok"}


async def _slow_check() -> bool:
    await asyncio.sleep(10)
    return True


async def _async_true() -> bool:
    return True


def _raises() -> bool:
    raise RuntimeError("check crashed")


@pytest.mark.parametrize(
    ("checks", "status", "failing"),
    [
        pytest.param({}, 200, [], id="no-checks"),
        pytest.param({"tls": lambda: True, "caches": _async_true}, 200, [], id="all-pass"),
        pytest.param({"tls": lambda: True, "caches": lambda: False}, 503, ["caches"], id="one-fails"),
        pytest.param({"tls": lambda: False, "caches": lambda: False}, 503, ["tls", "caches"], id="both-fail"),
        pytest.param({"crash": _raises}, 503, ["crash"], id="check-raises"),
        pytest.param({"slow": _slow_check}, 503, ["slow"], id="check-times-out"),
    ],
)
async def test_readyz_reflects_checks(
    aiohttp_client: ClientFactory, checks: dict[str, Any], status: int, failing: list[str]
) -> None:
    client = await aiohttp_client(_app(readiness=Readiness(checks, check_timeout=0.1)))
    response = await client.get("/readyz")
    body = await response.json()
    assert response.status == status
    assert body.get("failing", []) == failing


async def test_readyz_follows_state_changes_and_shutdown(aiohttp_client: ClientFactory) -> None:
    synced = False
    app = _app()
    readiness_of(app).add("caches-synced", lambda: synced)
    client = await aiohttp_client(app)
    assert (await client.get("/readyz")).status == 503
    synced = True
    assert (await client.get("/readyz")).status == 200
    readiness_of(app).begin_shutdown()
    response = await client.get("/readyz")
    assert response.status == 503
    assert (await response.json())["failing"] == ["shutting-down"]
    # Liveness is independent of readiness.
    assert (await client.get("/healthz")).status == 200


def test_readiness_names_are_unique() -> None:
    readiness = Readiness({"tls": lambda: True})
    with pytest.raises(ValueError, match="already registered"):
        readiness.add("tls", lambda: True)


# --- metrics --------------------------------------------------------------------------------


async def test_metrics_expose_the_latency_histogram(aiohttp_client: ClientFactory) -> None:
    registry = CollectorRegistry()
    client = await aiohttp_client(_app(registry=registry))
    await client.get("/healthz")
    await client.get("/no/such/path")
    await client.post("/json", data=b"{")
    await client.get("/boom")
    response = await client.get("/metrics")
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/plain; version=")
    text = await response.text()
    assert "# TYPE vramguard_http_request_duration_seconds histogram" in text
    for route, code in [("/healthz", "200"), ("unmatched", "404"), ("/json", "400"), ("/boom", "500")]:
        assert f'vramguard_http_request_duration_seconds_count{{code="{code}",route="{route}"}} 1.0' in text
    assert 'vramguard_http_request_duration_seconds_bucket{code="200",le="0.005",route="/healthz"}' in text


async def test_each_app_has_its_own_registry(aiohttp_client: ClientFactory) -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    client_one = await aiohttp_client(_app(registry=first))
    client_two = await aiohttp_client(_app(registry=second, metrics_prefix="other"))
    await client_one.get("/healthz")
    text_two = await (await client_two.get("/metrics")).text()
    assert "other_http_request_duration_seconds" in text_two
    assert 'route="/healthz"' not in text_two


# --- bodies ---------------------------------------------------------------------------------


async def _chunks(total: int, size: int = 64 * 1024) -> AsyncIterator[bytes]:
    sent = 0
    while sent < total:
        chunk = b" " * min(size, total - sent)
        sent += len(chunk)
        yield chunk


def _payload(body: Any) -> Any:
    # Large bytes go through BytesIO: still sent with a Content-Length, without aiohttp's warning
    # about writing a big bytes object in one go.
    return io.BytesIO(body) if isinstance(body, bytes) else body


def _json_of_size(size: int) -> bytes:
    body = b'{"pad": ""}'
    return body[:-2] + b"x" * (size - len(body)) + b'"}'


@pytest.mark.parametrize(
    ("path", "make_body", "headers", "status"),
    [
        pytest.param("/size", lambda: b"x" * (MiB + 1), {}, 413, id="content-length-over"),
        pytest.param("/size", lambda: _chunks(MiB + 1), {}, 413, id="chunked-over"),
        pytest.param("/size", lambda: _chunks(8 * MiB), {}, 413, id="chunked-far-over"),
        pytest.param(
            "/size",
            lambda: gzip.compress(b" " * (MiB + 1)),
            {"Content-Encoding": "gzip"},
            413,
            id="gzip-inflates-over",
        ),
        pytest.param("/size", lambda: b"x" * MiB, {}, 200, id="content-length-at-limit"),
        pytest.param("/size", lambda: _chunks(MiB), {}, 200, id="chunked-at-limit"),
        pytest.param("/json", lambda: _json_of_size(MiB), {}, 200, id="json-at-limit"),
        pytest.param("/json", lambda: _json_of_size(MiB + 1), {}, 413, id="json-over"),
    ],
)
async def test_default_body_limit(
    aiohttp_client: ClientFactory,
    path: str,
    make_body: Callable[[], Any],
    headers: dict[str, str],
    status: int,
) -> None:
    client = await aiohttp_client(_app())
    response = await client.post(path, data=_payload(make_body()), headers=headers)
    assert response.status == status
    body = await response.json()
    if status == 413:
        assert f"{DEFAULT_CLIENT_MAX_SIZE} bytes" in body["error"]


async def _native_read(request: web.Request) -> web.Response:
    return web.json_response({"size": len(await request.read())})


@pytest.mark.parametrize(
    "make_body",
    [
        pytest.param(lambda: b"x" * (MiB + 1), id="content-length"),
        pytest.param(lambda: _chunks(MiB + 1), id="chunked"),
    ],
)
async def test_aiohttp_itself_answers_413_when_the_body_is_read(
    aiohttp_client: ClientFactory, make_body: Callable[[], Any]
) -> None:
    # The guarantee read_body builds on: aiohttp's own read() enforces client_max_size for both
    # framings (a handler that never reads the body is not protected; hence the helpers).
    app = create_app(registry=CollectorRegistry())
    app.router.add_post("/native", _native_read)
    client = await aiohttp_client(app)
    response = await client.post("/native", data=_payload(make_body()))
    assert response.status == 413


async def test_body_limit_is_configurable(aiohttp_client: ClientFactory) -> None:
    client = await aiohttp_client(_app(client_max_size=100))
    assert (await client.post("/size", data=b"x" * 100)).status == 200
    assert (await client.post("/size", data=b"x" * 101)).status == 413


@pytest.mark.parametrize(
    ("body", "headers", "message"),
    [
        pytest.param(b"", {}, "empty", id="empty"),
        pytest.param(b"  \n", {}, "empty", id="whitespace"),
        pytest.param(b"{", {}, "invalid JSON", id="truncated"),
        pytest.param(b"{'a': 1}", {}, "invalid JSON", id="single-quotes"),
        pytest.param(b"[1, 2]", {}, "expected a JSON object, got an array", id="array"),
        pytest.param(b"null", {}, "got null", id="null"),
        pytest.param(b'"text"', {}, "got a string", id="string"),
        pytest.param(b"42", {}, "got a number", id="number"),
        pytest.param(b"\xff\xfe{}", {}, "not UTF-8", id="not-utf8"),
        pytest.param(b"\xef\xbb\xbf{}", {}, "invalid JSON", id="utf8-bom"),
        pytest.param(b'{"a": NaN}', {}, "NaN is not valid JSON", id="nan"),
        pytest.param(b'{"a": -Infinity}', {}, "-Infinity is not valid JSON", id="infinity"),
        pytest.param(b"[" * 200_000, {}, "nested too deeply", id="deep-nesting"),
        pytest.param(b'{"a": ' + b"9" * 5000 + b"}", {}, "invalid JSON", id="huge-integer"),
        pytest.param(b"\x00\x01\x02", {}, "invalid JSON", id="binary"),
        # Read by the standard library, refused by the strict decoder the services use.
        pytest.param(b'{"a": "\\ud800"}', {}, "not strict RFC 8259", id="unpaired-surrogate"),
        pytest.param(b'{"a": 1e400}', {}, "not strict RFC 8259", id="beyond-a-double"),
        pytest.param(b"garbage", {"Content-Encoding": "gzip"}, "unreadable request body", id="bad-gzip"),
        pytest.param(b"garbage", {"Content-Encoding": "deflate"}, "unreadable request body", id="bad-deflate"),
    ],
)
async def test_junk_json_is_a_clear_400(
    aiohttp_client: ClientFactory, body: bytes, headers: dict[str, str], message: str
) -> None:
    client = await aiohttp_client(_app())
    response = await client.post("/json", data=body, headers={"Content-Type": "application/json", **headers})
    assert response.status == 400
    assert response.content_type == "application/json"
    error = (await response.json())["error"]
    assert message in error
    assert "\n" not in error


async def test_declared_charset_is_ignored(aiohttp_client: ClientFactory) -> None:
    # A bogus charset must not become a LookupError, i.e. a 500.
    client = await aiohttp_client(_app())
    response = await client.post("/json", data=b'{"a": 1}', headers={"Content-Type": "application/json; charset=nope"})
    assert response.status == 200
    assert await response.json() == {"keys": ["a"]}


async def test_compressed_json_is_accepted(aiohttp_client: ClientFactory) -> None:
    client = await aiohttp_client(_app())
    for encoding, data in [("gzip", gzip.compress(b'{"a": 1}')), ("deflate", zlib.compress(b'{"b": 2}'))]:
        response = await client.post("/json", data=data, headers={"Content-Encoding": encoding})
        assert response.status == 200, encoding


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        pytest.param({"name": "p", "gpus": 1}, 200, None, id="valid"),
        pytest.param({"name": "p"}, 400, "invalid Pod: gpus: Field required", id="missing-field"),
        pytest.param({"name": "p", "gpus": "many"}, 400, "gpus: Input should be a valid integer", id="bad-type"),
    ],
)
async def test_read_model(
    aiohttp_client: ClientFactory, body: dict[str, Any], status: int, message: str | None
) -> None:
    client = await aiohttp_client(_app())
    response = await client.post("/model", json=body)
    assert response.status == status
    if message is not None:
        assert message in (await response.json())["error"]


async def test_unhandled_errors_are_a_json_500_without_details(aiohttp_client: ClientFactory) -> None:
    client = await aiohttp_client(_app())
    response = await client.get("/boom")
    assert response.status == 500
    assert await response.json() == {"error": "internal error"}


async def test_request_error_sets_the_status(aiohttp_client: ClientFactory) -> None:
    client = await aiohttp_client(_app())
    response = await client.get("/conflict")
    assert response.status == 409
    assert await response.json() == {"error": "already bound"}


def test_request_error_is_for_errors_only() -> None:
    with pytest.raises(ValueError, match="4xx or 5xx"):
        RequestError(200, "fine")


# --- slow clients ---------------------------------------------------------------------------


async def _raw(server: RunningServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(server.host, server.port)


async def test_a_body_that_never_arrives_is_a_408() -> None:
    # A short lingering time: after the 408 the server stops waiting for the rest of the body soon.
    async with serve(_app(), HOST, 0, None, settings=ServerSettings(lingering_time=0.1)) as server:
        reader, writer = await _raw(server)
        writer.write(b"POST /slow-body HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        response = await asyncio.wait_for(reader.read(4096), 5)
        writer.close()
    assert response.startswith(b"HTTP/1.1 408")
    assert b"request body not received within 0.2 s" in response


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param(b"", id="nothing"),
        pytest.param(b"GET /healthz HTTP/1.1\r\nHost: x\r\n", id="headers-trickled"),
    ],
)
async def test_idle_and_slow_header_connections_are_closed(sent: bytes) -> None:
    async with serve(_app(), HOST, 0, None, settings=ServerSettings(keepalive_timeout=0.3)) as server:
        reader, writer = await _raw(server)
        writer.write(sent)
        # The server closes the connection: read returns EOF instead of hanging.
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()


# --- serving over HTTPS ---------------------------------------------------------------------


@pytest.fixture
def tls_files(tmp_path: Path) -> certs.ServingFiles:
    ca = certs.create_ca()
    leaf = certs.issue_service_certificate(ca, "vramguard-extender", "gpu-system", ip_addresses=[HOST])
    return certs.write_serving_files(tmp_path / "tls", leaf)


def _client_session(files: certs.ServingFiles) -> aiohttp.ClientSession:
    context = ssl.create_default_context(cafile=str(files.ca_cert))
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context))


async def _start(
    app: web.Application, files: certs.ServingFiles, settings: ServerSettings, *, handle_signals: bool = False
) -> tuple[asyncio.Task[None], RunningServer, asyncio.Event]:
    started: asyncio.Future[RunningServer] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    tls = load_server_tls(files.tls_cert, files.tls_key)
    task = asyncio.create_task(
        run_https(
            app,
            HOST,
            0,
            tls,
            settings=settings,
            stop=stop,
            on_started=started.set_result,
            handle_signals=handle_signals,
        )
    )
    server = await asyncio.wait_for(started, 5)
    return task, server, stop


async def test_run_https_serves_until_stopped_and_drains(tls_files: certs.ServingFiles) -> None:
    gate = asyncio.Event()
    entered = asyncio.Event()

    async def slow(_: web.Request) -> web.Response:
        entered.set()
        await gate.wait()
        return web.json_response({"finished": True})

    app = _app()
    app.router.add_get("/slow", slow)
    settings = ServerSettings(drain_delay=0.3, shutdown_timeout=5)
    task, server, stop = await _start(app, tls_files, settings)
    assert server.url.startswith("https://127.0.0.1:")
    async with _client_session(tls_files) as session:
        async with session.get(f"{server.url}/readyz") as response:
            assert response.status == 200  # the "tls" check was added and passes
            assert (await response.json()) == {"status": "ready"}
        in_flight = asyncio.create_task(session.get(f"{server.url}/slow"))
        await asyncio.wait_for(entered.wait(), 5)

        stop.set()
        await asyncio.sleep(0.1)
        # Draining: still serving, but no longer ready.
        async with session.get(f"{server.url}/readyz") as response:
            assert response.status == 503
            assert (await response.json())["failing"] == ["shutting-down"]

        gate.set()
        response = await asyncio.wait_for(in_flight, 5)
        assert response.status == 200
        assert await response.json() == {"finished": True}
        response.release()
    await asyncio.wait_for(task, 10)
    with pytest.raises(aiohttp.ClientConnectionError):
        async with _client_session(tls_files) as session:
            await session.get(f"{server.url}/healthz")


async def test_run_https_stops_on_sigterm(tls_files: certs.ServingFiles) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    task, server, _ = await _start(_app(), tls_files, ServerSettings(), handle_signals=True)
    async with _client_session(tls_files) as session, session.get(f"{server.url}/healthz") as response:
        assert response.status == 200
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(task, 10)
    # The handler is gone again: the process's own SIGTERM handling is back.
    assert signal.getsignal(signal.SIGTERM) == previous


async def test_a_plain_client_cannot_talk_to_the_https_port(tls_files: certs.ServingFiles) -> None:
    task, server, stop = await _start(_app(), tls_files, ServerSettings())
    reader, writer = await asyncio.open_connection(HOST, server.port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    data = await asyncio.wait_for(reader.read(), 5)
    assert b"HTTP/1.1 200" not in data
    writer.close()
    stop.set()
    await asyncio.wait_for(task, 10)


async def test_metrics_json_round_trip_over_https(tls_files: certs.ServingFiles) -> None:
    task, server, stop = await _start(_app(), tls_files, ServerSettings())
    async with _client_session(tls_files) as session:
        async with session.post(f"{server.url}/json", data=json.dumps({"x": 1})) as response:
            assert await response.json() == {"keys": ["x"]}
        async with session.get(f"{server.url}/metrics") as response:
            assert 'route="/json"' in await response.text()
    stop.set()
    await asyncio.wait_for(task, 10)


# --- probes and metrics on a listener of their own ------------------------------------------


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with session.get(url) as response:
        return response.status, await response.text()


@pytest.mark.parametrize(
    ("listener", "path", "expected"),
    [
        pytest.param("operational", "/healthz", 200, id="ops-healthz"),
        pytest.param("operational", "/readyz", 200, id="ops-readyz"),
        pytest.param("operational", "/metrics", 200, id="ops-metrics"),
        pytest.param("operational", "/boom", 404, id="ops-has-no-service-routes"),
        pytest.param("main", "/healthz", 404, id="main-has-no-healthz"),
        pytest.param("main", "/readyz", 404, id="main-has-no-readyz"),
        pytest.param("main", "/metrics", 404, id="main-has-no-metrics"),
        pytest.param("main", "/conflict", 409, id="main-serves-its-routes"),
    ],
)
async def test_operational_routes_live_on_their_own_plain_http_listener(
    tls_files: certs.ServingFiles, listener: str, path: str, expected: int
) -> None:
    app = _app(operational_routes=False)
    tls = load_server_tls(tls_files.tls_cert, tls_files.tls_key)
    async with serve(app, HOST, 0, tls, operational=(HOST, 0)) as server, _client_session(tls_files) as session:
        assert server.operational is not None
        assert server.operational.scheme == "http"
        base = server.operational.url if listener == "operational" else server.url
        assert (await _get(session, base + path))[0] == expected


async def test_operational_metrics_count_the_main_listeners_requests(tls_files: certs.ServingFiles) -> None:
    registry = CollectorRegistry()
    app = _app(registry=registry, operational_routes=False)
    tls = load_server_tls(tls_files.tls_cert, tls_files.tls_key)
    async with serve(app, HOST, 0, tls, operational=(HOST, 0)) as server, _client_session(tls_files) as session:
        assert server.operational is not None
        await _get(session, server.url + "/conflict")
        status, text = await _get(session, server.operational.url + "/metrics")
    assert status == 200
    assert 'vramguard_http_request_duration_seconds_count{code="409",route="/conflict"} 1.0' in text
    assert 'vramguard_certificate_expiry_timestamp_seconds{role="serving"}' in text


async def test_operational_readyz_turns_503_on_shutdown() -> None:
    readiness = Readiness()
    app = _app(readiness=readiness, operational_routes=False)
    async with serve(app, HOST, 0, None, operational=(HOST, 0)) as server, aiohttp.ClientSession() as session:
        assert server.operational is not None
        assert (await _get(session, server.operational.url + "/readyz"))[0] == 200
        readiness.begin_shutdown()
        status, text = await _get(session, server.operational.url + "/readyz")
    assert status == 503
    assert "shutting-down" in text
