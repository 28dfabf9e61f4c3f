"""The agent's loop: sources failing and recovering, writes only on change and rate-limited, metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.main import AgentLoop, AgentSettings, KubeNodeWriter, NodePods, ReportPublisher, run
from agent.metrics import AgentMetrics
from agent.nvml import NvmlUnavailable
from agent.podresources import GrpcPodResources
from agent.recorded import RecordedNvml
from tests.agent_support import (
    H100_BYTES,
    H100_TIME_SLICED,
    H100_USABLE,
    H100_UUIDS,
    kubelet_server,
    list_response,
    pod_object,
)
from vramguard.codecs import AGENT_REPORT_ANNOTATION, AgentReport
from vramguard.io.kube import Connection, KubeClient

UID = "7d0c6a2e-5b1f-4e3a-9c8d-2f1e0a9b8c7d"


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    """The value of one sample in the registry's exposition, or ``None``."""
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for found in family.samples:
            if found.name == name and found.labels == labels:
                return float(found.value)
    return None


class MemoryWriter:
    """A node annotation kept in memory; ``fail`` makes writes raise."""

    def __init__(self, current: str | None = None) -> None:
        self.value = current
        self.writes: list[str] = []
        self.fail = False

    async def read(self) -> str | None:
        return self.value

    async def write(self, text: str) -> None:
        if self.fail:
            raise ConnectionError("API server unreachable")
        self.value = text
        self.writes.append(text)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_publisher_writes_changes_only_and_at_most_every_interval() -> None:
    writer, clock = MemoryWriter(), Clock()
    publisher = ReportPublisher(writer, 10.0, clock)
    assert await publisher.publish("a")
    assert not await publisher.publish("a")  # unchanged
    clock.now += 3
    assert not await publisher.publish("b")  # changed, but too soon
    clock.now += 7
    assert await publisher.publish("b")
    assert writer.writes == ["a", "b"]


async def test_publisher_does_not_rewrite_what_the_node_already_has() -> None:
    writer = MemoryWriter(current="same")
    assert not await ReportPublisher(writer, 10.0).publish("same")
    assert writer.writes == []


async def test_publisher_retries_after_a_failed_write() -> None:
    writer, clock = MemoryWriter(), Clock()
    publisher = ReportPublisher(writer, 10.0, clock)
    writer.fail = True
    with pytest.raises(ConnectionError):
        await publisher.publish("a")
    writer.fail = False
    assert await publisher.publish("a")  # no interval wait: nothing was written


def test_node_pods_store() -> None:
    pods = NodePods()
    assert pods.snapshot() is None
    pods.replace([pod_object("ml", "a", UID, {"server": {"nvidia.com/gpu": "1"}})])
    snapshot = pods.snapshot()
    assert snapshot is not None and snapshot[("ml", "a")].uid == UID and snapshot[("ml", "a")].wants_gpu
    pods.delete({"metadata": {"namespace": "ml", "name": "a", "uid": "another-incarnation"}})
    assert ("ml", "a") in (pods.snapshot() or {})
    pods.delete({"metadata": {"namespace": "ml", "name": "a", "uid": UID}})
    assert pods.snapshot() == {}


async def _inline(function: Callable[..., Any], *args: Any) -> Any:
    return function(*args)


def make_loop(tmp_path: Path, nvml: Any, writer: MemoryWriter | None = None) -> tuple[AgentLoop, CollectorRegistry]:
    registry = CollectorRegistry()
    pods = NodePods()
    pods.replace([pod_object("ml", "vllm", UID, {"server": {"nvidia.com/gpu": "1"}},
                             annotations={"vramguard.io/vram": "0.3"}, image="registry.example/ml/server:1.0")])
    publisher = ReportPublisher(writer, 0.0) if writer is not None else None
    loop = AgentLoop(nvml, GrpcPodResources(tmp_path / "kubelet.sock", timeout=2), pods, publisher,
                     AgentMetrics(registry), interval=0.01)
    return loop, registry


class FlakyNvml(RecordedNvml):
    """Fails to initialise ``failures`` times (no driver yet), then replays the recording."""

    def __init__(self, failures: int) -> None:
        super().__init__(H100_TIME_SLICED)
        self.failures = failures

    def init(self) -> None:
        if self.failures:
            self.failures -= 1
            raise NvmlUnavailable("libnvidia-ml.so.1: cannot open shared object file")
        super().init()


async def test_cycle_reports_what_it_knows_as_sources_come_and_go(tmp_path: Path) -> None:
    writer = MemoryWriter()
    loop, registry = make_loop(tmp_path, FlakyNvml(failures=1), writer)

    # No NVML, no kubelet: an empty but valid report, and the agent keeps going.
    view = await loop.cycle()
    assert view.report.gpus == () and not view.placements_known
    assert json.loads(writer.writes[-1]) == {"version": 1, "gpus": [], "pods": {}}

    # NVML back, kubelet still absent: sizes known, placements unknown.
    view = await loop.cycle()
    assert [g.memory_bytes for g in view.report.gpus] == [H100_USABLE, H100_USABLE]
    assert view.report.placements == {}

    with kubelet_server(tmp_path / "kubelet.sock") as kubelet:
        kubelet.response = list_response({("ml", "vllm"): {"server": {"nvidia.com/gpu": [f"{H100_UUIDS[1]}::2"]}}})
        view = await loop.cycle()
    assert view.report.placements == {UID: {"server": ("1",)}}
    report, problems = AgentReport.decode(writer.writes[-1])
    assert problems == [] and report == view.report
    assert len(writer.writes) == 3

    assert sample(registry, "vramguard_agent_source_up", source="podresources") == 1
    assert sample(registry, "vramguard_agent_gpu_memory_total_bytes", device="1", gpu_index="1",
                  uuid=H100_UUIDS[1], product="NVIDIA H100 80GB HBM3") == H100_BYTES
    declared = sample(registry, "vramguard_agent_pod_vram_declared_bytes",
                      namespace="ml", pod="vllm", container="server", device="1")
    assert declared == int(0.3 * H100_USABLE)
    # GPU 0 is held by no container: everything in use there is foreign.
    assert sample(registry, "vramguard_agent_gpu_foreign_bytes", device="0") == 2 * 24470 * 2**20
    assert sample(registry, "vramguard_agent_report_writes_total") == 3


async def test_a_failing_write_does_not_stop_the_cycle(tmp_path: Path) -> None:
    writer = MemoryWriter()
    writer.fail = True
    loop, registry = make_loop(tmp_path, RecordedNvml(H100_TIME_SLICED), writer)
    await loop.cycle()
    writer.fail = False
    await loop.cycle()
    assert len(writer.writes) == 1
    assert sample(registry, "vramguard_agent_report_write_failures_total") == 1


async def test_run_cycles_until_stopped_and_shuts_nvml_down(tmp_path: Path) -> None:
    nvml = RecordedNvml(H100_TIME_SLICED)
    loop, _ = make_loop(tmp_path, nvml)
    stop = asyncio.Event()
    task = asyncio.create_task(loop.run(stop))
    while loop.cycles < 3:
        await asyncio.sleep(0.01)
    assert nvml.initialised
    stop.set()
    await asyncio.wait_for(task, 5)
    assert not nvml.initialised


async def test_a_cycle_that_raises_is_logged_and_the_loop_goes_on(tmp_path: Path) -> None:
    loop, _ = make_loop(tmp_path, RecordedNvml(H100_TIME_SLICED))
    calls = 0
    original = loop.cycle

    async def sometimes_broken() -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("bug")
        return await original()

    loop.cycle = sometimes_broken  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(loop.run(stop))
    while loop.cycles < 1:
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert calls >= 2


# -- against an API server stand-in: the informer for the node's pods, the merge patch -------------


class FakeApiServer:
    def __init__(self) -> None:
        self.annotations: dict[str, str] = {}
        self.patches: list[tuple[str, Any]] = []
        self.pod_queries: list[str] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/v1/nodes/{name}", self.get_node)
        app.router.add_patch("/api/v1/nodes/{name}", self.patch_node)
        app.router.add_get("/api/v1/pods", self.pods)
        return app

    async def get_node(self, request: web.Request) -> web.Response:
        return web.json_response({"metadata": {"name": request.match_info["name"], "annotations": self.annotations}})

    async def patch_node(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.patches.append((request.content_type, body))
        self.annotations.update(body["metadata"]["annotations"])
        return await self.get_node(request)

    async def pods(self, request: web.Request) -> web.StreamResponse:
        self.pod_queries.append(request.query.get("fieldSelector", ""))
        if request.query.get("watch"):
            await asyncio.sleep(30)  # a watch with no events
            return web.json_response({})
        pod = pod_object("ml", "vllm", UID, {"server": {"nvidia.com/gpu": "1"}})
        return web.json_response({"metadata": {"resourceVersion": "7"}, "items": [pod]})


async def test_kube_node_writer_merge_patches_one_annotation(aiohttp_server: Any) -> None:
    api = FakeApiServer()
    server = await aiohttp_server(api.app())
    async with KubeClient(Connection(str(server.make_url("")).rstrip("/"), False, lambda: None)) as client:
        writer = KubeNodeWriter(client, "gpu-1")
        assert await writer.read() is None
        await writer.write('{"version":1}')
        assert await writer.read() == '{"version":1}'
    assert api.patches == [
        ("application/merge-patch+json", {"metadata": {"annotations": {AGENT_REPORT_ANNOTATION: '{"version":1}'}}})
    ]


async def test_run_lists_the_nodes_pods_and_writes_the_report(aiohttp_server: Any, tmp_path: Path) -> None:
    api = FakeApiServer()
    server = await aiohttp_server(api.app())
    connection = Connection(str(server.make_url("")).rstrip("/"), False, lambda: None)
    stop = asyncio.Event()
    with kubelet_server(tmp_path / "kubelet.sock") as kubelet:
        kubelet.response = list_response({("ml", "vllm"): {"server": {"nvidia.com/gpu": [f"{H100_UUIDS[0]}::0"]}}})
        settings = AgentSettings("gpu-1", "127.0.0.1", 0, RecordedNvml(H100_TIME_SLICED),
                                 GrpcPodResources(tmp_path / "kubelet.sock"), connection, interval=0.05,
                                 min_write_interval=0.0)
        task = asyncio.create_task(run(settings, stop))
        for _ in range(200):
            report = api.annotations.get(AGENT_REPORT_ANNOTATION, "")
            if UID in report:
                break
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 10)
    assert "spec.nodeName=gpu-1" in api.pod_queries
    parsed, problems = AgentReport.decode(api.annotations[AGENT_REPORT_ANNOTATION])
    assert problems == [] and parsed is not None
    assert parsed.placements == {UID: {"server": ("0",)}}


async def test_nvml_is_restarted_when_the_gpu_count_fails(tmp_path: Path) -> None:
    data = json.loads(H100_TIME_SLICED.read_text())
    data["device_count"] = {"error": "DRIVER_NOT_LOADED"}
    nvml = RecordedNvml(data)
    loop, _ = make_loop(tmp_path, nvml)
    view = await loop.cycle()
    assert view.report.gpus == () and not nvml.initialised
    del data["device_count"]
    view = await loop.cycle()
    assert len(view.report.gpus) == 2 and nvml.initialised
