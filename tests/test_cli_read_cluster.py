"""``kubectl vram`` and ``vramguard audit`` read the cluster through the services' API client: one
kubeconfig loader (exec plugins, contexts), one pager. The API server is faked over real HTTP."""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from vramguard.cli.kubectl_vram import read_cluster
from vramguard.cluster import LIVE_PODS_SELECTOR

TOKEN = "from-the-exec-plugin"


class FakeApi:
    """Answers the lists the CLI makes, two items per page, and records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, dict[str, str], str | None]] = []
        self.app = web.Application()
        self.app.router.add_get("/{tail:.*}", self.answer)

    async def answer(self, request: web.Request) -> web.Response:
        self.asked.append((request.path, dict(request.query), request.headers.get("Authorization")))
        if request.path.endswith("/leases"):
            return web.json_response({"kind": "Status", "reason": "Forbidden", "message": "no"}, status=403)
        if request.path.endswith("/configmaps/vramguard-policy"):
            return web.json_response({"data": {"policy.yaml": "enforcement: warn\n"}})
        names = {"/api/v1/nodes": 5, "/api/v1/pods": 3}.get(request.path, 1)
        start = int(request.query.get("continue", "0"))
        limit = int(request.query["limit"])
        items = [{"metadata": {"name": f"{request.path}-{i}"}} for i in range(start, min(names, start + 2))]
        following = str(start + 2) if start + 2 < names else ""
        assert limit >= 2
        return web.json_response({"items": items, "metadata": {"continue": following, "resourceVersion": "7"}})


def kubeconfig(path: Path, port: int) -> Path:
    """Two contexts: the current one points nowhere; ``fake`` reaches the server with an exec plugin."""
    plugin = path.parent / "credential-plugin"
    plugin.write_text(
        "#!/bin/sh\n"
        f"echo '{{\"apiVersion\": \"client.authentication.k8s.io/v1\", \"kind\": \"ExecCredential\", "
        f"\"status\": {{\"token\": \"{TOKEN}\"}}}}'\n"
    )
    plugin.chmod(plugin.stat().st_mode | stat.S_IXUSR)
    exec_user: dict[str, Any] = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": str(plugin),
                                          "interactiveMode": "Never"}}
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{port}"}},
                     {"name": "nowhere", "cluster": {"server": "http://127.0.0.1:9"}}],
        "users": [{"name": "exec", "user": exec_user}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "exec"}},
                     {"name": "nowhere", "context": {"cluster": "nowhere", "user": "exec"}}],
        "current-context": "nowhere",
    }))
    return path


async def test_one_listing_through_the_services_client(tmp_path: Path) -> None:
    fake = FakeApi()
    async with TestServer(fake.app, host="127.0.0.1") as server:
        config = kubeconfig(tmp_path / "kubeconfig", server.port or 0)
        # read_cluster runs its own event loop, as the CLI does.
        snapshot, policy_text = await asyncio.to_thread(read_cluster, str(config), "fake", workloads=True)
    assert [n["metadata"]["name"] for n in snapshot.nodes] == [f"/api/v1/nodes-{i}" for i in range(5)]  # 3 pages
    assert {(n["kind"], n["apiVersion"]) for n in snapshot.nodes} == {("Node", "v1")}
    assert len(snapshot.pods) == 3
    assert {w["kind"] for w in snapshot.workloads} == {
        "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob"}
    assert snapshot.leases == []  # forbidden: reports count as untrusted
    assert policy_text == "enforcement: warn\n"
    assert {auth for _, _, auth in fake.asked} == {f"Bearer {TOKEN}"}
    pod_queries = [query for path, query, _ in fake.asked if path == "/api/v1/pods"]
    assert pod_queries and all(q["fieldSelector"] == LIVE_PODS_SELECTOR for q in pod_queries)


async def test_workloads_are_listed_only_for_the_audit(tmp_path: Path) -> None:
    fake = FakeApi()
    async with TestServer(fake.app, host="127.0.0.1") as server:
        config = kubeconfig(tmp_path / "kubeconfig", server.port or 0)
        snapshot, _ = await asyncio.to_thread(read_cluster, str(config), "fake")
    assert snapshot.workloads == []
    assert not any(path.startswith(("/apis/apps", "/apis/batch")) for path, _, _ in fake.asked)


async def test_custom_workloads_are_read_at_the_first_served_version(tmp_path: Path) -> None:
    from vramguard.cli.kubectl_vram import read_custom_workloads  # noqa: PLC0415
    from vramguard.workloads import WorkloadKind  # noqa: PLC0415

    asked: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        asked.append(request.path)
        if request.path == "/apis/leaderworkerset.x-k8s.io/v1/leaderworkersets":
            return web.json_response({"items": [{"metadata": {"name": "lws"}}], "metadata": {}})
        if request.path.startswith("/apis/ray.io/"):
            return web.json_response({"reason": "Forbidden", "message": "no"}, status=403)
        return web.json_response({"reason": "NotFound", "message": "no"}, status=404)

    app = web.Application()
    app.router.add_get("/{tail:.*}", answer)
    template = {"name": "main", "path": "spec.template", "form": "template"}
    kinds = [
        WorkloadKind(group="leaderworkerset.x-k8s.io", kind="LeaderWorkerSet", resource="leaderworkersets",
                     versions=("v2", "v1"), templates=(template,)),  # type: ignore[arg-type]
        WorkloadKind(group="ray.io", kind="RayCluster", resource="rayclusters", versions=("v1",),
                     templates=(template,)),  # type: ignore[arg-type]
        WorkloadKind(group="example.com", kind="Absent", resource="absents", versions=("v1",),
                     templates=(template,)),  # type: ignore[arg-type]
    ]
    async with TestServer(app, host="127.0.0.1") as server:
        config = kubeconfig(tmp_path / "kubeconfig", server.port or 0)
        objects, notes = await asyncio.to_thread(read_custom_workloads, str(config), "fake", kinds)
    assert [(o["kind"], o["apiVersion"], o["metadata"]["name"]) for o in objects] == [
        ("LeaderWorkerSet", "leaderworkerset.x-k8s.io/v1", "lws")]
    assert notes == ["RayCluster (ray.io) not read: no"]  # not installed: nothing to say
    assert "/apis/leaderworkerset.x-k8s.io/v2/leaderworkersets" in asked
