"""The running webhook: watches a (fake) API server, turns ready once synced, serves HTTPS, reloads TLS."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.podspecs import container, pod
from vramguard.admission import quantity_text
from vramguard.codecs import ENFORCE_LABEL
from vramguard.io import certs
from vramguard.io.kube import Connection
from vramguard.io.server import RunningServer, ServerSettings
from vramguard.io.tls import load_server_tls
from vramguard.policy import Policy
from webhook.app import PolicySource
from webhook.main import POD_FIELD_SELECTOR, WebhookSettings, run_webhook

HOST = "127.0.0.1"
TOKEN = "Bearer s3cret"
POLICY = Policy.from_yaml(
    """
default_class: shared
enforcement: enforce
classes:
  shared: {sharing: [time-slicing]}
quotas:
  team-a: 80Gi
schedulers: [vramguard, default-scheduler]
"""
)


@dataclass
class FakeApiServer:
    """List and watch of namespaces, nodes and pods, with a gate that holds the lists back."""

    objects: dict[str, list[dict[str, Any]]]
    lists_open: asyncio.Event = field(default_factory=asyncio.Event)
    events: dict[str, asyncio.Queue[dict[str, Any]]] = field(default_factory=dict)
    seen: list[tuple[str, str, str]] = field(default_factory=list)
    configmaps: dict[str, dict[str, Any]] = field(default_factory=dict)

    def app(self) -> web.Application:
        app = web.Application()
        for resource in self.objects:
            self.events[resource] = asyncio.Queue()
            app.router.add_get(f"/api/v1/{resource}", self._collection(resource))
        app.router.add_get("/api/v1/namespaces/{name}", self._namespace)
        # The ConfigMaps in which the replicas share the quota's pending admissions.
        app.router.add_get("/api/v1/namespaces/{namespace}/configmaps/{name}", self._get_configmap)
        app.router.add_post("/api/v1/namespaces/{namespace}/configmaps", self._put_configmap)
        app.router.add_put("/api/v1/namespaces/{namespace}/configmaps/{name}", self._put_configmap)
        return app

    async def _get_configmap(self, request: web.Request) -> web.Response:
        found = self.configmaps.get(request.match_info["name"])
        if found is None:
            return web.json_response({"reason": "NotFound", "message": "not found"}, status=404)
        return web.json_response(found)

    async def _put_configmap(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = body["metadata"]["name"]
        current = self.configmaps.get(name)
        if (current or {}).get("metadata", {}).get("resourceVersion") != body["metadata"].get("resourceVersion"):
            return web.json_response({"reason": "Conflict", "message": "modified"}, status=409)
        body["metadata"]["resourceVersion"] = str(len(self.configmaps) + int(
            (current or {}).get("metadata", {}).get("resourceVersion", "0")) + 1)
        self.configmaps[name] = body
        return web.json_response(body, status=201 if current is None else 200)

    def _collection(self, resource: str) -> Any:
        async def handler(request: web.Request) -> web.StreamResponse:
            self.seen.append((resource, request.headers.get("Authorization", ""),
                              request.query.get("fieldSelector", "")))
            if request.headers.get("Authorization") != TOKEN:
                return web.json_response({"reason": "Unauthorized", "message": "no token"}, status=401)
            if request.query.get("watch") != "1":
                await self.lists_open.wait()
                return web.json_response({"metadata": {"resourceVersion": "1"}, "items": self.objects[resource]})
            response = web.StreamResponse()
            await response.prepare(request)
            queue = self.events[resource]
            while True:
                event = await queue.get()
                await response.write(json.dumps(event).encode() + b"\n")

        return handler

    async def _namespace(self, request: web.Request) -> web.Response:
        for obj in self.objects["namespaces"]:
            if obj["metadata"]["name"] == request.match_info["name"]:
                return web.json_response(obj)
        return web.json_response({"reason": "NotFound", "message": "not found"}, status=404)


def gpu_pod(uid: str, fraction: str, namespace: str = "team-a") -> dict[str, Any]:
    obj = pod(container("vllm", image="vllm/vllm-openai:v0.21.0",
                        args=["--model", "m", "--gpu-memory-utilization", fraction]))
    obj["metadata"].update(uid=uid, name=uid, namespace=namespace, resourceVersion="2")
    return obj


def review(obj: dict[str, Any], namespace: str) -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "r-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "operation": "CREATE", "namespace": namespace, "object": obj}}


@dataclass
class Running:
    api: FakeApiServer
    server: RunningServer
    tls_dir: Path
    ca: certs.CertificateAuthority
    session: aiohttp.ClientSession
    context: ssl.SSLContext

    async def get(self, path: str) -> int:
        async with self.session.get(self.server.url + path, ssl=self.context) as response:
            return response.status

    async def validate(self, body: dict[str, Any]) -> dict[str, Any]:
        async with self.session.post(self.server.url + "/validate", json=body, ssl=self.context) as response:
            assert response.status == 200
            answer: dict[str, Any] = (await response.json())["response"]
            return answer


async def eventually(probe: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await probe():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    api = FakeApiServer({
        "namespaces": [{"metadata": {"name": "team-a", "labels": {ENFORCE_LABEL: "enforce"}}}],
        "nodes": [{"metadata": {"name": "gpu", "labels": {
            "nvidia.com/gpu.count": "1", "nvidia.com/gpu.memory": "81920", "nvidia.com/gpu.replicas": "4",
            "nvidia.com/gpu.sharing-strategy": "time-slicing"}},
            "status": {"allocatable": {"nvidia.com/gpu": "4"}}}],
        "pods": [gpu_pod("one", "0.5"), gpu_pod("two", "0.25")],
    })
    # The watch handlers stream until cancelled; do not wait for them at shutdown.
    runner = web.AppRunner(api.app(), shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, HOST, 0)
    await site.start()
    ca = certs.create_ca()
    tls_dir = tmp_path / "tls"
    leaf = certs.issue_serving_certificate(ca, dns_names=["localhost"], ip_addresses=[HOST])
    certs.write_serving_files(tls_dir, leaf)
    settings = WebhookSettings(
        host=HOST,
        port=0,
        tls=load_server_tls(tls_dir / certs.TLS_CERT_FILE, tls_dir / certs.TLS_KEY_FILE),
        connection=Connection(f"http://{HOST}:{site.port}", False, lambda: TOKEN),
        policy=PolicySource(POLICY),
        server=ServerSettings(reload_interval=0.05, shutdown_timeout=2),
    )
    started: asyncio.Future[RunningServer] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(run_webhook(settings, stop=stop, on_started=started.set_result, handle_signals=False))
    server = await asyncio.wait_for(started, 10)
    context = ssl.create_default_context(cafile=str(tls_dir / certs.CA_CERT_FILE))
    async with aiohttp.ClientSession() as session:
        yield Running(api, server, tls_dir, ca, session, context)
    stop.set()
    await asyncio.wait_for(task, 10)
    with contextlib.suppress(Exception):
        await runner.cleanup()


async def test_ready_only_after_the_watches_have_listed(running: Running) -> None:
    assert await running.get("/readyz") == 503
    assert await running.get("/healthz") == 200
    running.api.lists_open.set()

    async def ready() -> bool:
        return await running.get("/readyz") == 200

    await eventually(ready)
    assert {(resource, token) for resource, token, _ in running.api.seen} == {
        ("namespaces", TOKEN), ("nodes", TOKEN), ("pods", TOKEN)}
    assert all(selector == POD_FIELD_SELECTOR for resource, _, selector in running.api.seen if resource == "pods")


async def test_quota_follows_the_pod_watch(running: Running) -> None:
    running.api.lists_open.set()
    await eventually(lambda: _is(running.get("/readyz"), 200))
    # 0.5 + 0.25 of an 80 GiB GPU are held, each pod with its CUDA context (512 MiB); another 0.5
    # would pass the 80 GiB quota.
    gib, context = 1 << 30, 512 << 20
    held, this = 40 * gib + 20 * gib + 2 * context, 40 * gib + context
    answer = await running.validate(review(gpu_pod("three", "0.5"), "team-a"))
    assert answer["status"]["message"] == (
        f"namespace team-a would hold {quantity_text(held + this)} of its 80Gi VRAM quota "
        f"(this pod {quantity_text(this)}, 2 other pod(s) {quantity_text(held)})"
    )
    await running.api.events["pods"].put({"type": "DELETED", "object": gpu_pod("one", "0.5")})

    async def admitted() -> bool:
        return bool((await running.validate(review(gpu_pod("three", "0.5"), "team-a")))["allowed"])

    await eventually(admitted)


async def test_a_namespace_created_after_the_list_is_read_from_the_api(running: Running) -> None:
    running.api.objects["namespaces"].append({"metadata": {"name": "late", "labels": {ENFORCE_LABEL: "warn"}}})
    running.api.lists_open.set()
    await eventually(lambda: _is(running.get("/readyz"), 200))
    answer = await running.validate(review(gpu_pod("x", "1.5", namespace="late"), "late"))
    assert answer["allowed"] is True
    assert answer["warnings"][0].startswith("would deny: container vllm: --gpu-memory-utilization 1.5")


async def test_rotated_certificate_is_served_without_a_restart(running: Running) -> None:
    first = await _served_serial(running)
    leaf = certs.issue_serving_certificate(running.ca, dns_names=["localhost"], ip_addresses=[HOST])
    certs.write_serving_files(running.tls_dir, leaf)

    async def rotated() -> bool:
        return await _served_serial(running) == leaf.certificate.serial_number

    await eventually(rotated)
    assert first != leaf.certificate.serial_number


async def _served_serial(running: Running) -> int:
    from cryptography import x509  # noqa: PLC0415 - only this helper needs it

    _, writer = await asyncio.open_connection(HOST, running.server.port, ssl=running.context)
    try:
        ssl_object = writer.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True)
        return x509.load_der_x509_certificate(der).serial_number
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def _is(status: Any, expected: int) -> bool:
    return bool(await status == expected)


async def test_direct_placement_reads_the_ledger_the_watches_feed(running: Running) -> None:
    # The pod watch feeds the quota and the cluster model alike: a pod bound by the watch fills the
    # GPU (0.9 of 80 GiB is its whole budget), and a pod created onto that node no longer fits.
    running.api.lists_open.set()
    await eventually(lambda: _is(running.get("/readyz"), 200))
    direct = gpu_pod("direct", "0.2", namespace="team-b")
    direct["spec"]["nodeName"] = "gpu"
    running.api.objects["namespaces"].append({"metadata": {"name": "team-b", "labels": {ENFORCE_LABEL: "enforce"}}})
    assert (await running.validate(review(direct, "team-b")))["allowed"] is True
    bound = gpu_pod("bound", "0.9", namespace="team-b")
    bound["spec"]["nodeName"] = "gpu"
    await running.api.events["pods"].put({"type": "ADDED", "object": bound})

    async def refused() -> bool:
        answer = await running.validate(review(direct, "team-b"))
        return not answer["allowed"] and answer["status"]["message"].startswith("spec.nodeName gpu places the pod")

    await eventually(refused)
