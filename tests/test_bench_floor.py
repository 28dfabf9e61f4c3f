"""The floor extender (``bench/floor``, Go) speaks the extender wire the throughput benchmark
measures it on: mutual TLS, the four verbs' JSON, Bindings created on the API server with the
kubeconfig's token, and the request counters the benchmark reads."""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from bench.extender import build_floor, verb_figures
from e2e.procs import free_ports
from vramguard.io.certs import (
    CertificateAuthority,
    create_ca,
    issue_client_certificate,
    issue_serving_certificate,
    write_serving_files,
)

pytestmark = pytest.mark.skipif(shutil.which("go") is None, reason="the floor extender is built with go")

TOKEN = "floor-test-token"


@pytest.fixture(scope="module")
def floor_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_floor(tmp_path_factory.mktemp("floor"))


@pytest.fixture
def ca() -> CertificateAuthority:
    return create_ca("floor test CA")


class FakeApi:
    """An API server that accepts Bindings (201), or refuses those of pod ``refused`` (409)."""

    def __init__(self) -> None:
        self.bindings: list[tuple[str, str | None, dict[str, Any]]] = []
        self.refused = "taken"

    async def binding(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bindings.append((request.path, request.headers.get("Authorization"), body))
        if request.match_info["name"] == self.refused:
            return web.json_response({"kind": "Status", "message": "pod taken is already assigned"}, status=409)
        return web.json_response({"kind": "Status", "status": "Success"}, status=201)


@pytest.fixture
async def api(tmp_path: Path, ca: CertificateAuthority) -> AsyncIterator[tuple[FakeApi, Path]]:
    """A fake API server over TLS, and a kubeconfig (YAML, as the e2e harness writes) for it."""
    fake = FakeApi()
    app = web.Application()
    app.router.add_post("/api/v1/namespaces/{namespace}/pods/{name}/binding", fake.binding)
    files = write_serving_files(tmp_path / "api", issue_serving_certificate(ca, dns_names=["localhost"],
                                                                            ip_addresses=["127.0.0.1"]))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(files.tls_cert, files.tls_key)
    runner = web.AppRunner(app)
    await runner.setup()
    (port,) = free_ports(1)
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=context).start()
    kubeconfig = tmp_path / "kubeconfig"
    authority = base64.b64encode(ca.cert_pem()).decode()
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{port}",
                                               "certificate-authority-data": authority}}],
        "users": [{"name": "u", "user": {"token": TOKEN}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c",
    }))
    yield fake, kubeconfig
    await runner.cleanup()


@contextlib.contextmanager
def running_floor(binary: Path, directory: Path, ca: CertificateAuthority, kubeconfig: Path, *,
                  http2: bool = False) -> Iterator[tuple[str, str, ssl.SSLContext]]:
    """The floor running: its verbs' URL, its ops URL, and a client context with the scheduler's certificate."""
    files = write_serving_files(directory / "floor", issue_serving_certificate(ca, dns_names=["localhost"]))
    client = issue_client_certificate(ca, "kube-scheduler")
    (directory / "client.crt").write_bytes(client.cert_pem())
    (directory / "client.key").write_bytes(client.key_pem())
    port, ops_port = free_ports(2)
    process = subprocess.Popen([
        str(binary), *(["--http2"] if http2 else []), "extender", "--listen", f"127.0.0.1:{port}",
        "--tls-cert", str(files.tls_cert), "--tls-key", str(files.tls_key), "--client-ca", str(files.ca_cert),
        "--kubeconfig", str(kubeconfig), "--ops-listen", f"127.0.0.1:{ops_port}", "--policy", "ignored.yaml",
    ])
    ops = f"http://127.0.0.1:{ops_port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{ops}/readyz", timeout=1) as response:
                    assert response.status == 200
                    break
            except (urllib.error.URLError, ConnectionError):
                assert process.poll() is None, "the floor extender exited"
                assert time.monotonic() < deadline, "the floor extender never became ready"
                time.sleep(0.1)
        context = ssl.create_default_context(cafile=str(files.ca_cert))
        context.load_cert_chain(directory / "client.crt", directory / "client.key")
        yield f"https://localhost:{port}", ops, context
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def floor(floor_binary: Path, tmp_path: Path, ca: CertificateAuthority,
          api: tuple[FakeApi, Path]) -> Iterator[tuple[str, str, ssl.SSLContext]]:
    with running_floor(floor_binary, tmp_path, ca, api[1]) as running:
        yield running


async def test_the_verbs_answer_as_an_extender_that_checks_nothing(
    floor: tuple[str, str, ssl.SSLContext], api: tuple[FakeApi, Path]
) -> None:
    url, ops, context = floor
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1"}, "spec": {"containers": [{"name": "c"}]}}
    names = ["node-a", "node-b", "node-c"]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as session:
        async with session.post(f"{url}/filter", json={"Pod": pod, "Nodes": None, "NodeNames": names}) as response:
            assert response.status == 200
            assert await response.json() == {"NodeNames": names, "FailedNodes": {}, "Error": ""}
        async with session.post(f"{url}/prioritize", json={"Pod": pod, "Nodes": None, "NodeNames": names}) as response:
            assert await response.json() == [{"Host": name, "Score": 0} for name in names]
        bind = {"PodName": "p", "PodNamespace": "ns", "PodUID": "u-1", "Node": "node-b"}
        async with session.post(f"{url}/bind", json=bind) as response:
            assert await response.json() == {"Error": ""}
        async with session.post(f"{url}/bind", json={**bind, "PodName": "taken"}) as response:
            error = (await response.json())["Error"]
            assert "409" in error and "already assigned" in error
        victims = {"node-a": {"Pods": [{"UID": "v-1"}], "NumPDBViolations": 0}}
        async with session.post(f"{url}/preempt", json={"Pod": pod, "NodeNameToMetaVictims": victims}) as response:
            assert await response.json() == {"NodeNameToMetaVictims": victims}
        async with session.post(f"{url}/filter", data=b"not json") as response:
            assert response.status == 400
    path, authorization, binding = api[0].bindings[0]
    assert path == "/api/v1/namespaces/ns/pods/p/binding"
    assert authorization == f"Bearer {TOKEN}"
    assert binding == {"apiVersion": "v1", "kind": "Binding",
                       "metadata": {"name": "p", "namespace": "ns", "uid": "u-1"},
                       "target": {"apiVersion": "v1", "kind": "Node", "name": "node-b"}}
    with urllib.request.urlopen(f"{ops}/metrics", timeout=5) as response:
        figures = verb_figures(response.read().decode())
    assert figures["requests"] == {"filter": 2, "prioritize": 1, "bind": 2}
    assert figures["tls_connections"] == {"filter": 1}  # one kept-alive connection for every request
    assert set(figures["mean_ms"]) == {"filter", "prioritize", "bind"}
    assert figures["nodes_per_filter"] is None  # the floor judges no node


async def test_a_client_without_the_schedulers_certificate_is_refused(
    floor: tuple[str, str, ssl.SSLContext], tmp_path: Path
) -> None:
    url = floor[0]
    anonymous = ssl.create_default_context(cafile=str(tmp_path / "floor" / "ca.crt"))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=anonymous)) as session:
        with pytest.raises(aiohttp.ClientError):
            async with session.post(f"{url}/filter", data=json.dumps({"Pod": {}, "NodeNames": []})) as response:
                await response.read()


@pytest.mark.parametrize(("http2", "protocol"), [(False, "http/1.1"), (True, "h2")])
def test_http2_is_offered_only_with_the_flag(floor_binary: Path, tmp_path: Path, ca: CertificateAuthority,
                                             api: tuple[FakeApi, Path], http2: bool, protocol: str) -> None:
    with running_floor(floor_binary, tmp_path, ca, api[1], http2=http2) as (url, _, context):
        context.set_alpn_protocols(["h2", "http/1.1"])  # what kube-scheduler's extender client offers
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as raw, context.wrap_socket(
            raw, server_hostname="localhost"
        ) as connection:
            assert connection.selected_alpn_protocol() == protocol
