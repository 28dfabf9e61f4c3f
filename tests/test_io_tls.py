"""vramguard.io.tls: the serving certificate follows its files, and mutual TLS refuses clients without a
certificate from the client CA, over real TLS on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from prometheus_client import CollectorRegistry

from vramguard.io import certs
from vramguard.io.http import create_app, readiness_of
from vramguard.io.server import RunningServer, ServerSettings, serve
from vramguard.io.tls import (
    CERTIFICATE_EXPIRY_METRIC,
    CertificateExpiryCollector,
    ReloadingTLSContext,
    TLSLoadError,
    load_server_tls,
    new_server_context,
)

HOST = "127.0.0.1"


@dataclass
class Pki:
    ca: certs.CertificateAuthority
    directory: Path

    @property
    def cert_file(self) -> Path:
        return self.directory / certs.TLS_CERT_FILE

    @property
    def key_file(self) -> Path:
        return self.directory / certs.TLS_KEY_FILE

    @property
    def ca_file(self) -> Path:
        return self.directory / certs.CA_CERT_FILE

    def issue(self) -> certs.ServingCertificate:
        """Issue a new leaf for 127.0.0.1 and write it over the served files; return it."""
        leaf = certs.issue_serving_certificate(self.ca, dns_names=["localhost"], ip_addresses=[HOST])
        certs.write_serving_files(self.directory, leaf)
        return leaf

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(ca=certs.create_ca(), directory=tmp_path / "tls")


class Gate:
    """Holds /slow requests until opened, so a request can be kept in flight."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def slow(self, _: web.Request) -> web.Response:
        self.entered.set()
        await self.release.wait()
        return web.json_response({"slow": "done"})


async def _fast(_: web.Request) -> web.Response:
    return web.json_response({"fast": "done"})


def _app(gate: Gate) -> web.Application:
    app = create_app(registry=CollectorRegistry())
    app.router.add_get("/slow", gate.slow)
    app.router.add_get("/fast", _fast)
    return app


@dataclass
class Connection:
    """One kept-alive HTTPS connection, speaking just enough HTTP/1.1 for these tests."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    @property
    def serial(self) -> int:
        ssl_object = self.writer.get_extra_info("ssl_object")
        return x509.load_der_x509_certificate(ssl_object.getpeercert(binary_form=True)).serial_number

    def send(self, path: str) -> None:
        self.writer.write(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())

    async def response(self) -> tuple[int, bytes]:
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = next(int(line.split(":")[1]) for line in lines if line.lower().startswith("content-length:"))
        return status, await self.reader.readexactly(length)

    async def get(self, path: str) -> tuple[int, bytes]:
        self.send(path)
        return await self.response()

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await self.writer.wait_closed()


async def _connect(server: RunningServer, context: ssl.SSLContext) -> Connection:
    reader, writer = await asyncio.open_connection(server.host, server.port, ssl=context)
    return Connection(reader, writer)


@pytest.fixture
async def served(pki: Pki) -> AsyncIterator[tuple[RunningServer, ReloadingTLSContext, Gate]]:
    pki.issue()
    tls = load_server_tls(pki.cert_file, pki.key_file)
    gate = Gate()
    settings = ServerSettings(reload_interval=0.05, shutdown_timeout=2)
    async with serve(_app(gate), HOST, 0, tls, settings=settings) as server:
        yield server, tls, gate
        gate.release.set()


async def _wait_for_serial(tls: ReloadingTLSContext, serial: int) -> None:
    async with asyncio.timeout(5):
        while tls.certificate is None or tls.certificate.serial_number != serial:
            await asyncio.sleep(0.02)


async def test_new_connections_get_the_new_certificate_while_old_ones_finish(
    pki: Pki, served: tuple[RunningServer, ReloadingTLSContext, Gate]
) -> None:
    server, tls, gate = served
    old_serial = tls.certificate.serial_number if tls.certificate else -1
    old = await _connect(server, pki.client_context())
    assert old.serial == old_serial
    old.send("/slow")
    await asyncio.wait_for(gate.entered.wait(), 5)

    new_leaf = pki.issue()
    await _wait_for_serial(tls, new_leaf.certificate.serial_number)  # the watcher noticed

    new = await _connect(server, pki.client_context())
    assert new.serial == new_leaf.certificate.serial_number != old_serial
    assert await new.get("/fast") == (200, b'{"fast": "done"}')

    # The request in flight on the old connection completes, and the connection stays usable.
    gate.release.set()
    assert await asyncio.wait_for(old.response(), 5) == (200, b'{"slow": "done"}')
    assert old.serial == old_serial
    assert await old.get("/fast") == (200, b'{"fast": "done"}')
    await old.close()
    await new.close()


async def test_half_written_pair_keeps_the_old_certificate(
    pki: Pki, served: tuple[RunningServer, ReloadingTLSContext, Gate], caplog: pytest.LogCaptureFixture
) -> None:
    server, tls, _ = served
    old_serial = tls.certificate.serial_number if tls.certificate else -1
    old_key = pki.key_file.read_bytes()
    new_leaf = pki.issue()
    # Only the certificate has arrived: put the old key back, as if the key were still to come.
    pki.key_file.write_bytes(old_key)
    tls.reload()
    assert tls.is_loaded()
    assert tls.last_error is not None and "cannot load" in tls.last_error
    assert "still serving the previous certificate" in caplog.text
    conn = await _connect(server, pki.client_context())
    assert conn.serial == old_serial
    assert await conn.get("/fast") == (200, b'{"fast": "done"}')
    await conn.close()

    # The key arrives: the watcher retries and switches.
    pki.key_file.write_bytes(new_leaf.key_pem())
    await _wait_for_serial(tls, new_leaf.certificate.serial_number)
    assert tls.last_error is None
    conn = await _connect(server, pki.client_context())
    assert conn.serial == new_leaf.certificate.serial_number
    await conn.close()


@pytest.mark.parametrize(
    ("cert_content", "key_content"),
    [
        pytest.param(b"", None, id="empty-cert"),
        pytest.param(b"-----BEGIN CERTIFICATE-----\ngarbage\n", None, id="truncated-cert"),
        pytest.param(None, b"", id="empty-key"),
        pytest.param(None, b"-----BEGIN PRIVATE KEY-----\nMIG", id="truncated-key"),
    ],
)
async def test_broken_files_never_replace_a_working_certificate(
    pki: Pki, cert_content: bytes | None, key_content: bytes | None
) -> None:
    leaf = pki.issue()
    tls = load_server_tls(pki.cert_file, pki.key_file)
    if cert_content is not None:
        pki.cert_file.write_bytes(cert_content)
    if key_content is not None:
        pki.key_file.write_bytes(key_content)
    assert tls.reload() is False
    assert tls.is_loaded()
    assert tls.certificate is not None and tls.certificate.serial_number == leaf.certificate.serial_number
    assert tls.last_error is not None


async def test_unchanged_files_are_not_reloaded(pki: Pki) -> None:
    pki.issue()
    tls = load_server_tls(pki.cert_file, pki.key_file)
    assert tls.reload() is False
    assert tls.last_error is None


async def test_vanished_files_keep_serving(pki: Pki) -> None:
    pki.issue()
    tls = load_server_tls(pki.cert_file, pki.key_file)
    pki.cert_file.unlink()
    assert tls.reload() is False
    assert tls.is_loaded()
    assert tls.last_error is not None and "cannot read" in tls.last_error


@pytest.mark.parametrize(
    "case",
    [
        pytest.param("missing", id="missing-files"),
        pytest.param("mismatched", id="key-of-another-certificate"),
        pytest.param("encrypted", id="encrypted-key"),
    ],
)
def test_load_server_tls_fails_fast(pki: Pki, case: str) -> None:
    if case != "missing":
        pki.issue()
    if case == "mismatched":
        other = certs.issue_serving_certificate(pki.ca, dns_names=["localhost"])
        pki.key_file.write_bytes(other.key_pem())
    if case == "encrypted":
        key = serialization.load_pem_private_key(pki.key_file.read_bytes(), password=None)
        encrypted = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pw"),
        )
        pki.key_file.write_bytes(encrypted)
    with pytest.raises(TLSLoadError):
        load_server_tls(pki.cert_file, pki.key_file)


async def test_readiness_waits_for_tls(pki: Pki) -> None:
    # The Secret is not there yet: the server runs, /readyz says why it is not ready, and it
    # becomes ready once the files appear.
    tls = ReloadingTLSContext(pki.cert_file, pki.key_file)
    app = create_app(registry=CollectorRegistry())
    settings = ServerSettings(reload_interval=0.05)
    async with serve(app, HOST, 0, tls, settings=settings):
        assert await readiness_of(app).failing() == ["tls"]
        pki.issue()
        async with asyncio.timeout(5):
            while not tls.is_loaded():
                await asyncio.sleep(0.02)
        assert await readiness_of(app).failing() == []


async def test_watcher_survives_unexpected_errors(
    pki: Pki, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pki.issue()
    tls = load_server_tls(pki.cert_file, pki.key_file)
    calls = 0

    def broken() -> bool:
        nonlocal calls
        calls += 1
        raise RuntimeError("boom")

    monkeypatch.setattr(tls, "reload", broken)
    watcher = asyncio.create_task(tls.watch(0.01))
    with caplog.at_level(logging.ERROR):
        async with asyncio.timeout(5):
            while calls < 3:
                await asyncio.sleep(0.01)
    assert not watcher.done()
    watcher.cancel()
    assert "unexpected error while reloading" in caplog.text


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1_1 is deprecated:DeprecationWarning")
@pytest.mark.parametrize(
    ("maximum", "accepted"),
    [
        pytest.param(ssl.TLSVersion.TLSv1_1, False, id="tls1.1-refused"),
        pytest.param(ssl.TLSVersion.TLSv1_2, True, id="tls1.2"),
        pytest.param(ssl.TLSVersion.TLSv1_3, True, id="tls1.3"),
    ],
)
async def test_protocol_versions(
    pki: Pki, served: tuple[RunningServer, ReloadingTLSContext, Gate], maximum: ssl.TLSVersion, accepted: bool
) -> None:
    server, _, _ = served
    context = pki.client_context()
    context.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
    context.maximum_version = maximum
    if maximum < ssl.TLSVersion.TLSv1_2:
        # Let the client offer an old version at all; the server must still refuse it.
        context.set_ciphers("DEFAULT:@SECLEVEL=0")
    if not accepted:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await _connect(server, context)
        return
    conn = await _connect(server, context)
    assert conn.writer.get_extra_info("ssl_object").version() == maximum.name.replace("_", ".")
    await conn.close()


async def test_alpn_selects_http11(pki: Pki, served: tuple[RunningServer, ReloadingTLSContext, Gate]) -> None:
    server, _, _ = served
    context = pki.client_context()
    context.set_alpn_protocols(["h2", "http/1.1"])
    conn = await _connect(server, context)
    assert conn.writer.get_extra_info("ssl_object").selected_alpn_protocol() == "http/1.1"
    await conn.close()


def test_server_context_minimum_version() -> None:
    assert new_server_context().minimum_version == ssl.TLSVersion.TLSv1_2


# ------------------------------------------------------------------------- mutual TLS


@dataclass
class MutualPki:
    """A serving pair plus a client CA file, and clients with and without acceptable certificates."""

    server: Pki
    client_ca: certs.CertificateAuthority
    client_ca_file: Path

    def write_client_ca(self, ca: certs.CertificateAuthority) -> None:
        certs.write_serving_files(  # only ca.crt matters; the leaf files are not read
            self.client_ca_file.parent, certs.issue_client_certificate(ca, "unused")
        )
        self.client_ca = ca

    def client(self, directory: Path, presenting: str) -> ssl.SSLContext:
        """A client context trusting the server CA, presenting the certificate named by ``presenting``."""
        context = self.server.client_context()
        if presenting == "none":
            return context
        ca = {"trusted-ca": self.client_ca, "other-ca": certs.create_ca("someone else's CA")}.get(presenting)
        if presenting == "serving-cert-of-trusted-ca":
            # Signed by the trusted CA, but for serverAuth only: not a client certificate.
            leaf = certs.issue_serving_certificate(self.client_ca, dns_names=["kube-scheduler"])
        else:
            assert ca is not None, presenting
            leaf = certs.issue_client_certificate(ca, "kube-scheduler")
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "client.crt").write_bytes(leaf.cert_pem())
        (directory / "client.key").write_bytes(leaf.key_pem())
        context.load_cert_chain(directory / "client.crt", directory / "client.key")
        return context


@pytest.fixture
def mutual(pki: Pki, tmp_path: Path) -> MutualPki:
    pki.issue()
    ca = certs.create_ca("vramguard client CA")
    mutual = MutualPki(pki, ca, tmp_path / "client-ca" / certs.CA_CERT_FILE)
    mutual.write_client_ca(ca)
    return mutual


async def _status_or_refusal(server: RunningServer, context: ssl.SSLContext) -> int | str:
    """GET /fast: the status, or "refused" when TLS fails before any HTTP answer."""
    try:
        connection = await _connect(server, context)
        try:
            status, _ = await connection.get("/fast")
        finally:
            await connection.close()
    except (ssl.SSLError, ConnectionError, asyncio.IncompleteReadError):
        # TLS 1.3 finishes the client's side of the handshake before the server checks the
        # client certificate; the refusal then arrives as an alert on the first read.
        return "refused"
    return status


@pytest.mark.parametrize(
    ("presenting", "expected"),
    [
        pytest.param("trusted-ca", 200, id="client-cert-from-the-client-ca"),
        pytest.param("none", "refused", id="no-client-cert"),
        pytest.param("other-ca", "refused", id="client-cert-from-another-ca"),
        pytest.param("serving-cert-of-trusted-ca", "refused", id="right-ca-but-not-a-client-cert"),
    ],
)
@pytest.mark.parametrize("maximum", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3], ids=["tls1.2", "tls1.3"])
async def test_client_certificates_are_required(
    mutual: MutualPki, tmp_path: Path, presenting: str, expected: int | str, maximum: ssl.TLSVersion
) -> None:
    tls = load_server_tls(mutual.server.cert_file, mutual.server.key_file, mutual.client_ca_file)
    assert tls.requires_client_certificate
    context = mutual.client(tmp_path / "client", presenting)
    context.maximum_version = maximum
    async with serve(_app(Gate()), HOST, 0, tls) as server:
        assert await _status_or_refusal(server, context) == expected


async def test_without_a_client_ca_any_client_is_served(mutual: MutualPki, tmp_path: Path) -> None:
    # The explicit insecure mode: the same server without --client-ca answers a client with no certificate.
    tls = load_server_tls(mutual.server.cert_file, mutual.server.key_file)
    assert not tls.requires_client_certificate
    async with serve(_app(Gate()), HOST, 0, tls) as server:
        assert await _status_or_refusal(server, mutual.client(tmp_path / "c", "none")) == 200


async def test_a_rotated_client_ca_is_trusted_and_the_old_one_no_longer(mutual: MutualPki, tmp_path: Path) -> None:
    tls = load_server_tls(mutual.server.cert_file, mutual.server.key_file, mutual.client_ca_file)
    old_client = mutual.client(tmp_path / "old", "trusted-ca")
    settings = ServerSettings(reload_interval=0.05)
    async with serve(_app(Gate()), HOST, 0, tls, settings=settings) as server:
        assert await _status_or_refusal(server, old_client) == 200
        mutual.write_client_ca(certs.create_ca("rotated client CA"))
        async with asyncio.timeout(5):
            while tls.client_cas[0].subject != "CN=rotated client CA":
                await asyncio.sleep(0.02)
        assert await _status_or_refusal(server, old_client) == "refused"
        assert await _status_or_refusal(server, mutual.client(tmp_path / "new", "trusted-ca")) == 200


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"not a certificate", id="junk"),
        pytest.param("leaf", id="a-leaf-instead-of-a-ca"),
    ],
)
def test_unusable_client_ca_fails_fast(mutual: MutualPki, content: bytes | str) -> None:
    if content == "leaf":
        content = certs.issue_client_certificate(mutual.client_ca, "x").cert_pem()
    assert isinstance(content, bytes)
    mutual.client_ca_file.write_bytes(content)
    with pytest.raises(TLSLoadError, match="client CA"):
        load_server_tls(mutual.server.cert_file, mutual.server.key_file, mutual.client_ca_file)


async def test_a_broken_client_ca_keeps_the_previous_one(mutual: MutualPki, tmp_path: Path) -> None:
    tls = load_server_tls(mutual.server.cert_file, mutual.server.key_file, mutual.client_ca_file)
    mutual.client_ca_file.write_bytes(b"half a certif")
    assert not tls.reload()
    assert tls.last_error is not None and "client CA" in tls.last_error
    async with serve(_app(Gate()), HOST, 0, tls) as server:
        assert await _status_or_refusal(server, mutual.client(tmp_path / "c", "trusted-ca")) == 200
        assert await _status_or_refusal(server, mutual.client(tmp_path / "n", "none")) == "refused"


def _expiry(registry: CollectorRegistry) -> dict[str, float]:
    family = next(f for f in registry.collect() if f.name == CERTIFICATE_EXPIRY_METRIC)
    return {sample.labels["role"]: sample.value for sample in family.samples}


async def test_certificate_expiry_is_exported_and_follows_reloads(mutual: MutualPki) -> None:
    tls = load_server_tls(mutual.server.cert_file, mutual.server.key_file, mutual.client_ca_file)
    registry = CollectorRegistry()
    app = create_app(registry=registry)
    app.router.add_get("/fast", _fast)
    async with serve(app, HOST, 0, tls, settings=ServerSettings(reload_interval=0.05)):
        assert tls.certificate is not None
        assert _expiry(registry) == {
            "serving": tls.certificate.not_after.timestamp(),
            "client-ca": mutual.client_ca.certificate.not_valid_after_utc.timestamp(),
        }
        leaf = certs.issue_serving_certificate(mutual.server.ca, dns_names=["localhost"], days=10)
        certs.write_serving_files(mutual.server.directory, leaf)
        async with asyncio.timeout(5):
            while tls.certificate.serial_number != leaf.certificate.serial_number:
                await asyncio.sleep(0.02)
        assert _expiry(registry)["serving"] == leaf.certificate.not_valid_after_utc.timestamp()


def test_no_expiry_before_the_first_load(pki: Pki) -> None:
    registry = CollectorRegistry()
    registry.register(CertificateExpiryCollector(ReloadingTLSContext(pki.cert_file, pki.key_file)))
    assert _expiry(registry) == {}


async def test_connections_are_counted_once_each(mutual: MutualPki, tmp_path: Path) -> None:
    tls = load_server_tls(mutual.server.cert_file, mutual.server.key_file, mutual.client_ca_file)
    registry = CollectorRegistry()
    app = create_app(registry=registry)
    app.router.add_get("/fast", _fast)
    context = mutual.client(tmp_path / "client", "trusted-ca")
    async with serve(app, HOST, 0, tls) as server:
        kept = await _connect(server, context)
        try:
            for _ in range(3):  # one connection kept alive
                status, _ = await kept.get("/fast")
                assert status == 200
        finally:
            await kept.close()
        assert await _status_or_refusal(server, context) == 200  # a second connection, the same certificate
    assert registry.get_sample_value("vramguard_http_connections_total", {"route": "/fast"}) == 2
    assert registry.get_sample_value(
        "vramguard_http_request_duration_seconds_count", {"route": "/fast", "code": "200"}
    ) == 4
