"""The API connection: the bearer token read from the official client's loader and reused for seconds,
and requests in flight at once."""

from __future__ import annotations

import asyncio
import base64
import ssl
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from vramguard.io import certs, kube
from vramguard.io.kube import MAX_CONNECTIONS, TOKEN_REUSE_SECONDS, Connection, KubeClient, load_connection, reused_for


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("elapsed", "reads"),
    [(0.0, 1), (9.9, 1), (10.0, 2), (60.0, 2)],
    ids=["same-instant", "within-the-period", "period-over", "long-after"],
)
def test_reused_for_reads_once_per_period(elapsed: float, reads: int) -> None:
    clock = Clock()
    tokens = iter(["Bearer a", "Bearer b"])
    calls: list[int] = []

    def read() -> str | None:
        calls.append(1)
        return next(tokens)

    token = reused_for(10.0, read, clock)
    assert token() == "Bearer a"
    clock.now += elapsed
    assert token() == ("Bearer a" if reads == 1 else "Bearer b")
    assert len(calls) == reads


class FakeLoader:
    """The official loader's in-cluster path: a refresh hook that re-applies the configuration on
    every token read (as the real one does, reading the environment's proxies each time)."""

    ConfigException = Exception

    def __init__(self) -> None:
        self.refreshes = 0

    def load_incluster_config(self, client_configuration: Any) -> None:
        client_configuration.host = "https://10.0.0.1:443"
        client_configuration.api_key["BearerToken"] = "Bearer t"

        def refresh(configuration: Any) -> None:
            self.refreshes += 1

        client_configuration.refresh_api_key_hook = refresh


def test_load_connection_does_not_refresh_the_token_on_every_request(monkeypatch: pytest.MonkeyPatch) -> None:
    loader = FakeLoader()
    monkeypatch.setattr(kube, "_official_loader", lambda: loader)
    monkeypatch.setenv("KUBECONFIG", "/nonexistent/kubeconfig")
    connection = load_connection()
    assert [connection.authorization() for _ in range(50)] == ["Bearer t"] * 50
    assert loader.refreshes == 1
    assert TOKEN_REUSE_SECONDS <= 60, "tokens are renewed minutes before expiry; reuse must stay far shorter"


async def test_requests_in_flight_are_not_queued_behind_a_small_pool() -> None:
    # Bindings wait on etcd commits; the client must not hold them back behind a few connections.
    # The API answers only once this many requests are in flight at the same time.
    in_flight = 100
    arrived = 0
    all_there = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        nonlocal arrived
        arrived += 1
        if arrived >= in_flight:
            all_there.set()
        await all_there.wait()
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/api/v1/namespaces/ns/pods/{name}/binding", handler)
    server = TestServer(app)
    await server.start_server()
    try:
        async with KubeClient(Connection(str(server.make_url("")).rstrip("/"), False, lambda: None)) as client:
            calls = [client.create(f"/api/v1/namespaces/ns/pods/p{i}/binding", {}) for i in range(in_flight)]
            await asyncio.wait_for(asyncio.gather(*calls), 10)
    finally:
        await server.close()
    assert in_flight <= MAX_CONNECTIONS


# -- credentials read without the official client --------------------------------------------------


@pytest.fixture(scope="module")
def pki() -> tuple[certs.CertificateAuthority, certs.ServingCertificate, certs.ServingCertificate]:
    ca = certs.create_ca("test CA")
    server = certs.issue_serving_certificate(ca, dns_names=["localhost"], ip_addresses=["127.0.0.1"])
    client = certs.issue_client_certificate(ca, "admin", organizations=["system:masters"])
    return ca, server, client


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def kubeconfig(path: Path, cluster: dict[str, Any], user: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": cluster}, {"name": "other", "cluster": {"server": "https://x:1"}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}},
                     {"name": "d", "context": {"cluster": "other", "user": "u"}}],
    }))
    return path


async def whoami(connection: Connection, pki: Any) -> dict[str, Any]:
    """GET through ``connection`` from an HTTPS server that requires a client certificate of the CA
    (when the connection has one): the token and the certificate's name it saw."""
    ca, server_cert, _ = pki

    async def handler(request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peercert") if request.transport else None  # type: ignore[union-attr]
        subject = dict(x[0] for x in peer["subject"]) if peer else {}
        return web.json_response({"authorization": request.headers.get("Authorization"),
                                  "user": subject.get("commonName")})

    app = web.Application()
    app.router.add_get("/whoami", handler)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    with tempfile.TemporaryDirectory() as scratch:
        cert, key, ca_file = (Path(scratch) / n for n in ("cert", "key", "ca"))
        cert.write_bytes(server_cert.cert_pem())
        key.write_bytes(server_cert.key_pem())
        ca_file.write_bytes(ca.cert_pem())
        context.load_cert_chain(cert, key)
        context.load_verify_locations(cafile=str(ca_file))
    context.verify_mode = ssl.CERT_OPTIONAL
    server = TestServer(app, host="127.0.0.1")
    await server.start_server(ssl=context)
    try:
        port = server.port
        target = Connection(connection.server.replace("PORT", str(port)), connection.ssl_context,
                            connection.authorization)
        async with KubeClient(target) as client:
            return await client.get("/whoami")
    finally:
        await server.close()


async def test_a_kubeconfig_with_inline_certificates_and_a_token_is_read_without_the_official_client(
    tmp_path: Path, pki: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kube, "_official_loader", lambda: pytest.fail("the official loader was used"))
    ca, _, client = pki
    cluster = {"server": "https://127.0.0.1:PORT/", "certificate-authority-data": b64(ca.cert_pem())}
    path = kubeconfig(tmp_path / "config", cluster,
                      {"client-certificate-data": b64(client.cert_pem()), "client-key-data": b64(client.key_pem()),
                       "token": "secret"})
    connection = load_connection(str(path))
    assert connection.server == "https://127.0.0.1:PORT"
    assert await whoami(connection, pki) == {"authorization": "Bearer secret", "user": "admin"}
    assert list(tmp_path.iterdir()) == [path], "no key left on disk"


async def test_a_kubeconfig_with_certificate_files_and_a_token_file_relative_to_it(
    tmp_path: Path, pki: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kube, "_official_loader", lambda: pytest.fail("the official loader was used"))
    ca, _, client = pki
    (tmp_path / "pki").mkdir()
    for name, data in (("ca.crt", ca.cert_pem()), ("admin.crt", client.cert_pem()), ("admin.key", client.key_pem())):
        (tmp_path / "pki" / name).write_bytes(data)
    (tmp_path / "token").write_text("from-file\n")
    path = kubeconfig(tmp_path / "config", {"server": "https://127.0.0.1:PORT", "certificate-authority": "pki/ca.crt"},
                      {"client-certificate": "pki/admin.crt", "client-key": "pki/admin.key", "tokenFile": "token"})
    monkeypatch.setenv("KUBECONFIG", str(path))
    assert await whoami(load_connection(), pki) == {"authorization": "Bearer from-file", "user": "admin"}
    assert load_connection(str(path), "d").server == "https://x:1", "the context asked for"


def test_the_service_account_is_read_without_the_official_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pki: Any
) -> None:
    monkeypatch.setattr(kube, "_official_loader", lambda: pytest.fail("the official loader was used"))
    (tmp_path / "token").write_text("sa-token")
    (tmp_path / "ca.crt").write_bytes(pki[0].cert_pem())
    monkeypatch.setattr(kube, "SERVICE_ACCOUNT", tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    connection = load_connection()
    assert connection.server == "https://[fd00::1]:443"
    assert connection.authorization() == "Bearer sa-token"
    assert isinstance(connection.ssl_context, ssl.SSLContext)


@pytest.mark.parametrize(
    "user",
    [
        pytest.param({"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "gke-auth"}}, id="exec"),
        pytest.param({"auth-provider": {"name": "oidc"}}, id="auth provider"),
        pytest.param({"username": "a", "password": "b"}, id="basic auth"),
    ],
)
def test_other_credentials_go_to_the_official_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, user: dict[str, Any]
) -> None:
    loader = FakeLoader()
    calls: list[Any] = []

    def load_kube_config(**kwargs: Any) -> None:
        calls.append(kwargs["config_file"])
        loader.load_incluster_config(kwargs["client_configuration"])

    loader.load_kube_config = load_kube_config  # type: ignore[attr-defined]
    monkeypatch.setattr(kube, "_official_loader", lambda: loader)
    path = kubeconfig(tmp_path / "config", {"server": "https://10.0.0.1:443"}, user)
    assert load_connection(str(path)).server == "https://10.0.0.1:443"
    assert calls == [str(path)]


def test_the_services_do_not_import_the_official_client(tmp_path: Path) -> None:
    # Its generated models cost about 8 MiB resident for the life of the process.
    path = kubeconfig(tmp_path / "config", {"server": "https://10.0.0.1:443", "insecure-skip-tls-verify": True},
                      {"token": "t"})
    code = ("import sys, extender.main, webhook.main, agent.main\n"
            "from vramguard.io.kube import load_connection\n"
            f"load_connection({str(path)!r})\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'kubernetes'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
