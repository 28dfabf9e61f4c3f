"""The supervisor: a dead background task stops the server and the process exits with an error."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
import socket
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp.test_utils import TestServer

from extender.main import ExtenderSettings
from extender.main import run as run_extender
from tests.fake_api import FakeApi
from vramguard.cli import extender as extender_cli
from vramguard.cli import webhook as webhook_cli
from vramguard.cli.watch_limit import parse_event_limit
from vramguard.io import certs
from vramguard.io.kube import Connection, Informer
from vramguard.io.server import ServerSettings
from vramguard.io.supervise import TaskDied, supervise
from vramguard.io.tls import load_server_tls
from vramguard.policy import default_policy
from webhook.app import PolicySource
from webhook.main import WebhookSettings, run_webhook


class Server:
    """Stands in for ``run_https``: serves until ``stop``, records whether it was cancelled."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.cancelled = False

    async def run(self) -> None:
        try:
            await self.stop.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


async def forever() -> None:
    await asyncio.Event().wait()


async def fails() -> None:
    await asyncio.sleep(0.01)
    raise RuntimeError("bug in the watch")


async def returns() -> None:
    await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    ("task", "may_finish", "how"),
    [
        pytest.param(fails, (), "failed: RuntimeError: bug in the watch", id="a task that raises"),
        pytest.param(returns, (), "returned", id="a task that returns"),
        pytest.param(fails, ("task",), "failed: RuntimeError: bug in the watch", id="may finish, not fail"),
    ],
)
async def test_a_dead_task_cancels_the_server_and_raises(
    caplog: pytest.LogCaptureFixture, task: Callable[[], Coroutine[Any, Any, None]], may_finish: tuple[str, ...],
    how: str,
) -> None:
    server = Server()
    with pytest.raises(TaskDied) as raised:
        await asyncio.wait_for(
            supervise(server.run(), {"other": forever(), "task": task()}, may_finish=may_finish), 5
        )
    assert raised.value.name == "task" and raised.value.how == how
    assert server.cancelled
    assert any(r.levelno == logging.ERROR and "'task'" in r.getMessage() for r in caplog.records)


async def test_a_task_that_may_finish_leaves_the_server_running_until_it_stops() -> None:
    server = Server()
    sibling = asyncio.Event()

    async def watches() -> None:
        try:
            await forever()
        finally:
            sibling.set()

    supervisor = asyncio.create_task(
        supervise(server.run(), {"synced": returns(), "watch": watches()}, may_finish={"synced"})
    )
    await asyncio.sleep(0.1)
    assert not supervisor.done()
    server.stop.set()
    await asyncio.wait_for(supervisor, 5)
    assert sibling.is_set(), "background tasks are cancelled when the server returns"
    assert not server.cancelled


async def test_the_servers_own_error_is_raised_and_the_tasks_cancelled() -> None:
    async def broken_server() -> None:
        raise OSError("address in use")

    with pytest.raises(OSError, match="address in use"):
        await supervise(broken_server(), {"watch": forever()})


# ------------------------------------------------------------------------------ the processes


def kubeconfig(path: Path) -> Path:
    """A kubeconfig for an API server nobody listens on: the watches are broken before they connect."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))
    return path


def service_args(service: str, tmp_path: Path) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    extender_cli.register(subparsers)
    webhook_cli.register(subparsers)
    argv = [service, "--listen", "127.0.0.1:0", "--kubeconfig", str(kubeconfig(tmp_path / "kubeconfig"))]
    if service == "extender":
        argv.append("--insecure-http")
    else:
        leaf = certs.issue_serving_certificate(certs.create_ca(), dns_names=["localhost"], ip_addresses=["127.0.0.1"])
        certs.write_serving_files(tmp_path, leaf)
        argv += ["--tls-cert", str(tmp_path / certs.TLS_CERT_FILE), "--tls-key", str(tmp_path / certs.TLS_KEY_FILE)]
    return parser.parse_args(argv)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("service", ["extender", "webhook"])
def test_the_service_exits_with_an_error_when_a_watch_dies(
    service: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def broken(self: Informer) -> None:
        if self.resource == "pods":
            raise RuntimeError("bug in the watch")
        await forever()

    monkeypatch.setattr(Informer, "run", broken)
    args = service_args(service, tmp_path)
    assert args.handler(args) == 1
    error = capsys.readouterr().err
    # Either of the extender's two pod watches (all pods, and those with claims) may fail first.
    assert re.search(r"background task 'watch /api/v1/pods[^']*' failed: RuntimeError: bug in the watch", error)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        pytest.param("16Mi", 16 << 20, id="binary suffix"),
        pytest.param("262144", 256 << 10, id="plain bytes"),
        pytest.param("64Ki", 64 << 10, id="the smallest"),
        pytest.param("1Gi", 1 << 30, id="the largest"),
    ],
)
def test_max_watch_event_bytes_accepts_quantities(text: str, value: int) -> None:
    assert parse_event_limit(text) == value


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("1k", "outside 64Ki..1Gi", id="too small for any pod"),
        pytest.param("2Gi", "outside 64Ki..1Gi", id="too large"),
        pytest.param("lots", "not a Kubernetes quantity", id="not a quantity"),
        pytest.param("-1Mi", "negative", id="negative"),
    ],
)
def test_max_watch_event_bytes_rejects_nonsense(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse_event_limit(text)


# ------------------------------------------------------------------------- readiness of the services


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


LEASES = "/apis/coordination.k8s.io/v1/namespaces/vramguard-system/leases"
PDBS = "/apis/policy/v1/poddisruptionbudgets"


def start_service(service: str, url: str, port: int, tmp_path: Path) -> Coroutine[Any, Any, None]:
    connection = Connection(url, False, lambda: None)
    if service == "extender":
        # The extender answers probes on its operational port (``port``); its verbs on another.
        settings = ExtenderSettings("127.0.0.1", free_port(), None, ("127.0.0.1", port), connection, None,
                                    ServerSettings(), agent_namespace="vramguard-system")
        return run_extender(settings)
    leaf = certs.issue_serving_certificate(certs.create_ca(), dns_names=["localhost"], ip_addresses=["127.0.0.1"])
    certs.write_serving_files(tmp_path, leaf)
    tls = load_server_tls(tmp_path / certs.TLS_CERT_FILE, tmp_path / certs.TLS_KEY_FILE)
    settings = WebhookSettings("127.0.0.1", port, tls, connection, PolicySource(default_policy()), ServerSettings())
    return run_webhook(settings, handle_signals=False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("service", ["extender", "webhook"])
async def test_readiness_fails_while_a_watch_stays_unhealthy(
    service: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Well above the quiet watches' 0.2 s cycle, so a loaded machine's pause never makes a healthy
    # watch look stale; the failing one still turns /readyz 503 within seconds.
    monkeypatch.setattr(Informer, "STALE_AFTER", 3.0)
    api = FakeApi({"namespaces": [[{"metadata": {"name": "default"}}]], "nodes": [[]], "pods": [[]], LEASES: [[]],
                   PDBS: [[]]})
    fake = TestServer(api.app())
    await fake.start_server()
    port = free_port()
    scheme = "http" if service == "extender" else "https"
    task = asyncio.create_task(start_service(service, str(fake.make_url("")).rstrip("/"), port, tmp_path))

    async def time_out_watches(resource: str) -> None:
        # As the API server ends every watch at its timeout: a quiet but working watch stays healthy.
        while True:
            watch = await api[resource].watches.get()
            await asyncio.sleep(0.2)
            watch.put_nowait(None)

    quiet = [asyncio.create_task(time_out_watches(name)) for name in ("namespaces", "nodes", LEASES, PDBS)]

    async def ready() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as session:
            try:
                async with session.get(f"{scheme}://127.0.0.1:{port}/readyz", ssl=False) as response:
                    return response.status, await response.json()
            except aiohttp.ClientConnectionError:
                return 0, None

    async def until(status: int) -> Any:
        deadline = asyncio.get_running_loop().time() + 20
        while (answer := await ready())[0] != status:
            assert asyncio.get_running_loop().time() < deadline, f"/readyz never answered {status}: {answer}"
            await asyncio.sleep(0.05)
        return answer[1]

    try:
        await until(200)
        api["pods"].fail_status = 500
        (await api["pods"].watches.get()).put_nowait(None)
        body = await until(503)
        # The services watch pods twice (all of them, and those with claims): both ride the failing stream.
        assert body["failing"] and all(name.startswith("watch-pods") for name in body["failing"])
        api["pods"].fail_status = None
        quiet.append(asyncio.create_task(time_out_watches("pods")))
        await until(200)
        assert not task.done()
    finally:
        for running in (task, *quiet):
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
        for resource in api.resources.values():
            while not resource.watches.empty():
                resource.watches.get_nowait().put_nowait(None)
        await fake.close()
