"""The agent's Lease (renewed every quarter of its duration; the annotation written only on change)
and its over-use Event."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from agent.events import OveruseEvents, event_name
from agent.liveness import LeaseRenewer
from agent.main import AgentLoop, KubeNodeWriter, NodePods, ReportPublisher
from agent.metrics import AgentMetrics
from agent.podresources import GrpcPodResources
from agent.recorded import RecordedNvml
from tests.agent_support import H100_TIME_SLICED, H100_UUIDS, kubelet_server, list_response, pod_object
from tests.test_agent_main import sample
from vramguard.codecs import AGENT_REPORT_ANNOTATION
from vramguard.io.kube import Connection, KubeClient
from vramguard.lease import parse_lease

UID = "7d0c6a2e-5b1f-4e3a-9c8d-2f1e0a9b8c7d"
CID = "a" * 64
LEASES = "/apis/coordination.k8s.io/v1/namespaces/vramguard-system/leases"
NOW = 1_790_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


class FakeApi:
    """Nodes (annotations), Leases (get, create, update with resourceVersion) and Events (create once)."""

    def __init__(self) -> None:
        self.annotations: dict[str, str] = {}
        self.node_patches = 0
        self.leases: dict[str, dict[str, Any]] = {}
        self.lease_calls: list[str] = []
        self.events: dict[str, dict[str, Any]] = {}
        self.event_posts = 0
        self.fail_patch = False
        self.version = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/v1/nodes/{name}", self.get_node)
        app.router.add_patch("/api/v1/nodes/{name}", self.patch_node)
        app.router.add_get(LEASES + "/{name}", self.get_lease)
        app.router.add_post(LEASES, self.create_lease)
        app.router.add_put(LEASES + "/{name}", self.update_lease)
        app.router.add_post("/api/v1/namespaces/{namespace}/events", self.create_event)
        return app

    async def get_node(self, request: web.Request) -> web.Response:
        return web.json_response({"metadata": {"name": request.match_info["name"], "annotations": self.annotations}})

    async def patch_node(self, request: web.Request) -> web.Response:
        if self.fail_patch:
            return web.json_response({"reason": "Forbidden", "message": "no"}, status=403)
        self.node_patches += 1
        self.annotations.update((await request.json())["metadata"]["annotations"])
        return await self.get_node(request)

    def _stored(self, body: dict[str, Any]) -> web.Response:
        self.version += 1
        body["metadata"]["resourceVersion"] = str(self.version)
        self.leases[body["metadata"]["name"]] = body
        return web.json_response(body)

    async def get_lease(self, request: web.Request) -> web.Response:
        self.lease_calls.append("get")
        found = self.leases.get(request.match_info["name"])
        if found is None:
            return web.json_response({"reason": "NotFound", "message": "not found"}, status=404)
        return web.json_response(found)

    async def create_lease(self, request: web.Request) -> web.Response:
        self.lease_calls.append("create")
        return self._stored(await request.json())

    async def update_lease(self, request: web.Request) -> web.Response:
        self.lease_calls.append("update")
        body = await request.json()
        current = self.leases[request.match_info["name"]]
        if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            return web.json_response({"reason": "Conflict", "message": "modified"}, status=409)
        return self._stored(body)

    async def create_event(self, request: web.Request) -> web.Response:
        self.event_posts += 1
        body = await request.json()
        name = body["metadata"]["name"]
        if name in self.events:
            return web.json_response({"reason": "AlreadyExists", "message": "exists"}, status=409)
        self.events[name] = body
        return web.json_response(body, status=201)


async def client_for(aiohttp_server: Any, api: FakeApi) -> KubeClient:
    server = await aiohttp_server(api.app())
    return KubeClient(Connection(str(server.make_url("")).rstrip("/"), False, lambda: None))


async def test_lease_is_created_then_renewed_and_reread_after_a_conflict(aiohttp_server: Any) -> None:
    api, clock = FakeApi(), Clock()
    async with await client_for(aiohttp_server, api) as client:
        renewer = LeaseRenewer(client, "vramguard-system", "gpu-1", "agent-abc", 40, clock)
        assert await renewer.renew()
        clock.now += 5
        assert not await renewer.renew(), "renewed a quarter of the duration (10 s) apart, not every cycle"
        clock.now += 5
        assert await renewer.renew()
        lease = parse_lease(api.leases["vramguard-agent-gpu-1"])
        assert lease is not None and (lease.holder, lease.renew_time, lease.duration) == ("agent-abc", NOW + 10, 40)

        api.leases["vramguard-agent-gpu-1"]["metadata"]["resourceVersion"] = "999"  # someone else wrote it
        clock.now += 10
        try:
            await renewer.renew()
            raise AssertionError("a conflict must raise")
        except Exception as exc:
            assert "409" in str(exc)
        assert await renewer.renew()  # reads it afresh, then updates
    assert api.lease_calls == ["get", "create", "update", "update", "get", "update"]
    assert parse_lease(api.leases["vramguard-agent-gpu-1"]).renew_time == NOW + 20  # type: ignore[union-attr]


def node_pods(vram: str) -> NodePods:
    pods = NodePods()
    # An image that starts no engine vramguard knows: the declaration is all the ledger holds.
    pods.replace([pod_object("ml", "liar", UID, {"server": {"nvidia.com/gpu": "1"}},
                             annotations={"vramguard.io/vram": vram}, container_ids={"server": CID},
                             image="registry.example/ml/server:1.0")])
    return pods


def loop_for(client: KubeClient, tmp_path: Path, clock: Clock, *, vram: str = "0.3",
             proc_root: Path | None = None) -> tuple[AgentLoop, CollectorRegistry]:
    registry = CollectorRegistry()
    loop = AgentLoop(
        RecordedNvml(H100_TIME_SLICED), GrpcPodResources(tmp_path / "kubelet.sock", timeout=2), node_pods(vram),
        ReportPublisher(KubeNodeWriter(client, "gpu-1"), 0.0), AgentMetrics(registry), proc_root,
        lease=LeaseRenewer(client, "vramguard-system", "gpu-1", "agent-abc", 40, clock),
        events=OveruseEvents(client, "gpu-1", clock),
    )
    return loop, registry


async def test_the_lease_is_renewed_every_other_cycle_and_the_annotation_written_only_on_change(
    aiohttp_server: Any, tmp_path: Path
) -> None:
    api, clock = FakeApi(), Clock()
    async with await client_for(aiohttp_server, api) as client:
        loop, registry = loop_for(client, tmp_path, clock)
        for _ in range(5):
            await loop.cycle()
            clock.now += 5
        assert api.node_patches == 1  # the report did not change
        # Cycles every 5 s, renewals every 10 s (a quarter of the 40 s duration).
        assert api.lease_calls == ["get", "create", "update", "update"]
        assert parse_lease(api.leases["vramguard-agent-gpu-1"]).renew_time == NOW + 20  # type: ignore[union-attr]
        assert sample(registry, "vramguard_agent_lease_renewals_total") == 3

        # A report that cannot be written: the Lease is not renewed, so readers stop trusting the old one.
        with kubelet_server(tmp_path / "kubelet.sock") as kubelet:
            kubelet.response = list_response({("ml", "liar"): {"server": {"nvidia.com/gpu": [f"{H100_UUIDS[0]}::0"]}}})
            api.fail_patch = True
            clock.now += 10
            await loop.cycle()
        assert len(api.lease_calls) == 4 and api.node_patches == 1
        assert UID not in api.annotations[AGENT_REPORT_ANNOTATION]


def fake_proc(root: Path, pids: dict[int, str]) -> Path:
    for pid, uid in pids.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "cgroup").write_text(f"0::/kubepods/burstable/pod{uid}/{CID}\n")
    return root


async def test_over_use_makes_one_event_per_pod_not_one_per_cycle(aiohttp_server: Any, tmp_path: Path) -> None:
    api, clock = FakeApi(), Clock()
    # PID 48213 uses 24470 MiB on GPU 0 in the recording; the pod declares 1 MiB.
    proc = fake_proc(tmp_path / "proc", {48213: UID})
    async with await client_for(aiohttp_server, api) as client:
        with kubelet_server(tmp_path / "kubelet.sock") as kubelet:
            kubelet.response = list_response({("ml", "liar"): {"server": {"nvidia.com/gpu": [f"{H100_UUIDS[0]}::0"]}}})
            loop, registry = loop_for(client, tmp_path, clock, vram="1Mi", proc_root=proc)
            for _ in range(3):
                view = await loop.cycle()
            assert api.event_posts == 1
            # A restarted agent remembers nothing: the Event's name makes the API server dedupe it.
            restarted, _ = loop_for(client, tmp_path, clock, vram="1Mi", proc_root=proc)
            await restarted.cycle()
            await restarted.cycle()
    assert api.event_posts == 2 and len(api.events) == 1
    event = api.events[event_name("liar", UID)]
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "namespace": "ml", "name": "liar",
                                       "uid": UID}
    assert event["type"] == "Warning" and event["reason"] == "VRAMOverUse"
    assert "23.9 GiB on GPU 0 where it declares 1.0 MiB" in event["message"]
    assert [o.excess_bytes for o in view.overuse] == [24470 * 2**20 - 2**20]
    report = json.loads(api.annotations[AGENT_REPORT_ANNOTATION])
    assert report["used"] == {UID: {"0": 24512 * 2**20}}  # rounded up to 64 MiB
    assert sample(registry, "vramguard_pod_vram_overuse_bytes", namespace="ml", pod="liar", device="0") == (
        24470 * 2**20 - 2**20
    )
    assert sample(registry, "vramguard_agent_overuse_events_total", result="created") == 1


async def test_a_pod_within_its_declaration_gets_no_event_and_no_used_entry(
    aiohttp_server: Any, tmp_path: Path
) -> None:
    api, clock = FakeApi(), Clock()
    proc = fake_proc(tmp_path / "proc", {48213: UID})
    async with await client_for(aiohttp_server, api) as client:
        with kubelet_server(tmp_path / "kubelet.sock") as kubelet:
            kubelet.response = list_response({("ml", "liar"): {"server": {"nvidia.com/gpu": [f"{H100_UUIDS[0]}::0"]}}})
            loop, _ = loop_for(client, tmp_path, clock, vram="24Gi", proc_root=proc)
            view = await loop.cycle()
    assert view.overuse == () and api.event_posts == 0
    assert "used" not in json.loads(api.annotations[AGENT_REPORT_ANNOTATION])
