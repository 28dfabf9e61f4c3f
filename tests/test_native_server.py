"""The native server of the extender's verbs over real TLS on loopback: mutual TLS at the handshake,
HTTP/2 offered, rotation, body limits, graceful and bounded shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from tests.test_io_tls import MutualPki, Pki, mutual, pki  # noqa: F401 (fixtures)
from vramguard.io import certs
from vramguard.io.http import LATENCY_BUCKETS, RequestError, parse_json
from vramguard.io.listener import RunningServer, ServerSettings
from vramguard.io.native_server import RESPAWN_OVERLAP_SECONDS, serve_native
from vramguard.io.rsgi import Reply, RsgiApp, json_reply
from vramguard.io.tls import ReloadingTLSContext, load_server_tls

HOST = "127.0.0.1"
LIMIT = 4096


class Handlers:
    """``/echo`` answers the JSON object's size; ``/slow`` waits until released; ``/boom`` is a bug."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = asyncio.Event()

    async def echo(self, body: bytes) -> Reply:
        return json_reply({"keys": len(parse_json(body))})

    async def slow(self, _: bytes) -> Reply:
        self.entered.set()
        await self.release.wait()
        return json_reply({"slow": True})

    async def boom(self, _: bytes) -> Reply:
        raise KeyError("internal detail")

    async def refuse(self, _: bytes) -> Reply:
        raise RequestError(409, "no")


def make_app(handlers: Handlers, registry: CollectorRegistry) -> RsgiApp:
    latency = Histogram("t_seconds", "t", ["route", "code"], buckets=LATENCY_BUCKETS, registry=registry)
    connections = Counter("t_connections", "t", ["route"], registry=registry)
    return RsgiApp({"/echo": handlers.echo, "/slow": handlers.slow, "/boom": handlers.boom, "/refuse": handlers.refuse},
                   latency=latency, connections=connections, body_limit=LIMIT, body_timeout=0.5,
                   body_limit_hint="send less")


@contextlib.asynccontextmanager
async def running(tls: ReloadingTLSContext | None, handlers: Handlers | None = None,
                  registry: CollectorRegistry | None = None, **settings: float) -> AsyncIterator[RunningServer]:
    app = make_app(handlers or Handlers(), registry or CollectorRegistry())
    async with serve_native(app, HOST, 0, tls, settings=ServerSettings(**settings)) as server:  # type: ignore[arg-type]
        yield server


async def post(server: RunningServer, context: ssl.SSLContext | None, path: str, body: bytes,
               headers: dict[str, str] | None = None) -> tuple[int, object]:
    async with aiohttp.ClientSession() as session, session.post(
        f"{server.url}{path}", data=body, ssl=context if context is not None else False, headers=headers
    ) as response:
        return response.status, await response.json()


async def handshake(server: RunningServer, context: ssl.SSLContext) -> str:
    """The ALPN protocol negotiated, or "refused" when the server refuses the client at TLS."""
    context.set_alpn_protocols(["h2", "http/1.1"])
    try:
        reader, writer = await asyncio.open_connection(HOST, server.port, ssl=context, server_hostname="localhost")
    except (ssl.SSLError, ConnectionError):
        return "refused"
    try:
        ssl_object = writer.get_extra_info("ssl_object")
        protocol = ssl_object.selected_alpn_protocol()
        # TLS 1.3: the server checks the client's certificate after the client's side finished;
        # its refusal arrives on the first read.
        writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" if protocol == "h2" else b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        data = await asyncio.wait_for(reader.read(1), 5)
        return protocol if data else "refused"
    except (ssl.SSLError, ConnectionError):
        return "refused"
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


@pytest.mark.parametrize(
    ("presenting", "expected"),
    [
        pytest.param("trusted-ca", "h2", id="client-cert-from-the-client-ca"),
        pytest.param("none", "refused", id="no-client-cert"),
        pytest.param("other-ca", "refused", id="client-cert-from-another-ca"),
        pytest.param("serving-cert-of-trusted-ca", "refused", id="right-ca-but-not-a-client-cert"),
    ],
)
async def test_only_a_client_certificate_from_the_client_ca_gets_past_the_handshake(
    mutual: MutualPki, tmp_path: Path, presenting: str, expected: str  # noqa: F811
) -> None:
    tls = load_server_tls(mutual.server.cert_file, mutual.server.key_file, mutual.client_ca_file)
    async with running(tls) as server:
        assert await handshake(server, mutual.client(tmp_path / "c", presenting)) == expected


async def test_http2_and_http11_are_both_served_with_mutual_tls(mutual: MutualPki, tmp_path: Path) -> None:  # noqa: F811
    tls = load_server_tls(mutual.server.cert_file, mutual.server.key_file, mutual.client_ca_file)
    async with running(tls) as server:
        assert await handshake(server, mutual.client(tmp_path / "a", "trusted-ca")) == "h2"
        status, body = await post(server, mutual.client(tmp_path / "b", "trusted-ca"), "/echo", b'{"a": 1, "b": 2}')
        assert (status, body) == (200, {"keys": 2})


async def test_without_a_client_ca_any_client_is_served(pki: Pki) -> None:  # noqa: F811
    pki.issue()
    tls = load_server_tls(pki.cert_file, pki.key_file)
    async with running(tls) as server:
        assert await post(server, pki.client_context(), "/echo", b"{}") == (200, {"keys": 0})


async def test_a_rotated_pair_is_served_and_a_broken_one_never(mutual: MutualPki, tmp_path: Path) -> None:  # noqa: F811
    tls = load_server_tls(mutual.server.cert_file, mutual.server.key_file, mutual.client_ca_file)
    client = mutual.client(tmp_path / "c", "trusted-ca")

    async def served_serial() -> int:
        _, writer = await asyncio.open_connection(HOST, server.port, ssl=client, server_hostname="localhost")
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
        from cryptography import x509  # noqa: PLC0415

        return x509.load_der_x509_certificate(der).serial_number

    async with running(tls, reload_interval=0.05) as server:
        first = await served_serial()
        leaf = certs.issue_serving_certificate(mutual.server.ca, dns_names=["localhost"], ip_addresses=[HOST])
        certs.write_serving_files(mutual.server.directory, leaf)
        async with asyncio.timeout(10):
            while await served_serial() != leaf.certificate.serial_number:
                await asyncio.sleep(0.05)
        # The new worker listens beside the old one until the old one has stopped: a handshake in
        # that window may still get the old certificate; none after it.
        await asyncio.sleep(RESPAWN_OVERLAP_SECONDS + 0.5)
        assert [await served_serial() for _ in range(8)] == [leaf.certificate.serial_number] * 8
        assert first != leaf.certificate.serial_number
        # A half-written pair (the key of another certificate): the served one stays, the server too.
        other = certs.issue_serving_certificate(mutual.server.ca, dns_names=["localhost"])
        mutual.server.key_file.write_bytes(other.key_pem())
        await asyncio.sleep(0.5)
        assert [await served_serial() for _ in range(5)] == [leaf.certificate.serial_number] * 5
        assert await post(server, client, "/echo", b"{}") == (200, {"keys": 0})


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "says"),
    [
        pytest.param("/echo", b"x" * (LIMIT + 1), None, 413, "exceeds the limit of 4096 bytes; send less",
                     id="declared"),
        pytest.param("/echo", b"not json", None, 400, "invalid JSON", id="junk"),
        pytest.param("/echo", b"[1]", None, 400, "expected a JSON object", id="not-an-object"),
        pytest.param("/echo", b"{}", {"Content-Encoding": "gzip"}, 415, "uncompressed", id="compressed"),
        pytest.param("/nowhere", b"{}", None, 404, "no endpoint", id="unknown-path"),
        pytest.param("/boom", b"{}", None, 500, "internal error", id="a-bug"),
        pytest.param("/refuse", b"{}", None, 409, "no", id="request-error"),
    ],
)
async def test_bad_requests_get_a_clear_json_error_and_the_server_goes_on(
    path: str, body: bytes, headers: dict[str, str] | None, status: int, says: str
) -> None:
    registry = CollectorRegistry()
    async with running(None, registry=registry) as server:
        answered, payload = await post(server, None, path, body, headers)
        assert answered == status
        assert isinstance(payload, dict) and says in payload["error"]
        assert "internal detail" not in str(payload)
        assert await post(server, None, "/echo", b"{}") == (200, {"keys": 0})
    route = path if path != "/nowhere" else "unmatched"
    assert registry.get_sample_value("t_seconds_count", {"route": route, "code": str(status)}) == 1


async def raw(server: RunningServer, request: bytes, trickle: bytes = b"", pause: float = 0.0) -> bytes:
    """Send ``request`` over plain HTTP/1.1, then ``trickle`` one byte per ``pause`` seconds; the answer."""
    reader, writer = await asyncio.open_connection(HOST, server.port)
    answer = asyncio.create_task(reader.read(65536))  # read as it comes: the server may answer before the end
    try:
        writer.write(request)
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            for byte in trickle:
                if answer.done():
                    break
                await asyncio.sleep(pause)
                writer.write(bytes([byte]))
                await writer.drain()
        return await asyncio.wait_for(answer, 10)
    finally:
        writer.close()


async def test_a_chunked_body_past_the_limit_is_refused_while_it_streams() -> None:
    async with running(None) as server:
        chunk = b"x" * 1000
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(6)) + b"0\r\n\r\n"
        answer = await raw(server, b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks)
        assert answer.startswith(b"HTTP/1.1 413")
        assert b"exceeds the limit" in answer


async def test_a_body_trickled_slower_than_the_time_limit_is_a_408() -> None:
    async with running(None) as server:
        started = time.monotonic()
        answer = await raw(server, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n{",
                           trickle=b"       ", pause=0.2)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert time.monotonic() - started < 5


async def test_requests_in_flight_finish_when_the_server_stops() -> None:
    handlers = Handlers()
    async with running(None, handlers) as server:
        in_flight = asyncio.create_task(post(server, None, "/slow", b"{}"))
        await asyncio.wait_for(handlers.entered.wait(), 5)
        asyncio.get_running_loop().call_later(0.3, handlers.release.set)
    assert await in_flight == (200, {"slow": True})


async def test_a_request_that_never_ends_does_not_hold_shutdown_past_its_timeout() -> None:
    handlers = Handlers()
    server_cm = running(None, handlers, shutdown_timeout=0.5)
    server = await server_cm.__aenter__()
    stuck = asyncio.create_task(post(server, None, "/slow", b"{}"))
    await asyncio.wait_for(handlers.entered.wait(), 5)
    started = time.monotonic()
    await server_cm.__aexit__(None, None, None)
    assert time.monotonic() - started < 5
    stuck.cancel()
    with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
        await stuck


async def test_serving_needs_the_tls_files_loaded(pki: Pki) -> None:  # noqa: F811
    pki.issue()
    with pytest.raises(ValueError, match="loaded before serving"):
        async with running(ReloadingTLSContext(pki.cert_file, pki.key_file)):
            pass


async def test_a_listener_that_stops_by_itself_ends_the_service_with_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker of granian's server ends without being told (a crash): nothing would serve the
    # verbs while the probes, on their own listener, still answered. run_https must raise, so that
    # the runtime ends the process.
    from granian.server.embed import Server  # noqa: PLC0415

    from vramguard.io import native_server  # noqa: PLC0415
    from vramguard.io.http import create_app  # noqa: PLC0415
    from vramguard.io.server import run_https  # noqa: PLC0415

    class Dying(Server):  # type: ignore[misc]
        async def serve(self, *args: object, **kwargs: object) -> None:
            asyncio.get_running_loop().call_later(0.5, self.stop)
            await super().serve(*args, **kwargs)

    monkeypatch.setattr(native_server, "Server", Dying)
    registry = CollectorRegistry()
    operational = create_app(registry=registry)
    app = make_app(Handlers(), CollectorRegistry())
    with pytest.raises(RuntimeError, match="stopped by itself"):
        async with asyncio.timeout(10):
            await run_https(operational, HOST, 0, None, operational=(HOST, 0), native=app, handle_signals=False)


async def test_connections_that_never_handshake_do_not_keep_kube_scheduler_out(
    mutual: MutualPki, tmp_path: Path  # noqa: F811
) -> None:
    tls = load_server_tls(mutual.server.cert_file, mutual.server.key_file, mutual.client_ca_file)
    async with running(tls) as server:
        silent = [await asyncio.open_connection(HOST, server.port) for _ in range(300)]
        try:
            started = time.monotonic()
            status, body = await post(server, mutual.client(tmp_path / "c", "trusted-ca"), "/echo", b"{}")
            assert (status, body) == (200, {"keys": 0})
            assert time.monotonic() - started < 5
        finally:
            for _, writer in silent:
                writer.close()


async def test_headers_past_the_limit_are_a_431_and_the_server_goes_on() -> None:
    async with running(None) as server:
        answer = await raw(server, b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000
                           + b"\r\nContent-Length: 2\r\n\r\n{}")
        assert answer.startswith(b"HTTP/1.1 431")
        assert await post(server, None, "/echo", b"{}") == (200, {"keys": 0})
