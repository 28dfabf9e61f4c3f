"""``vramguard ungate`` against a fake API server over real HTTP: the pods listed unbound, each gate
lifted with the leader's tested patch (applied here as RFC 6902), and a gate list changed between
the read and the patch read again rather than another gate removed."""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.builders import vllm_pod
from tests.test_cli_read_cluster import kubeconfig
from tests.test_scale_up import apply_patch, gated
from vramguard.cli import build_parser
from vramguard.cli.ungate import UNBOUND, Outcome, ungate
from vramguard.io.kube import Connection, KubeClient
from vramguard.scale_up import GATE, RELEASED_ANNOTATION

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)


def pod(name: str, namespace: str, *, gates: tuple[str, ...] = (), node: str | None = None) -> dict[str, Any]:
    body = vllm_pod(name, "0.30", node=node)
    body["metadata"]["namespace"] = namespace
    for other in gates:
        body["spec"].setdefault("schedulingGates", []).append({"name": other})
    return body


class FakePods:
    """Pods by (namespace, name); lists honour the namespace and ``spec.nodeName=``; a PATCH applies the
    JSON Patch (a failed ``test`` answers 422, as the API server does). ``before_patch`` runs first,
    so a test can change a pod between the command's read and its patch."""

    def __init__(self, *pods: dict[str, Any]) -> None:
        self.pods = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods}
        self.patches: list[tuple[str, list[dict[str, Any]]]] = []
        self.queries: list[dict[str, str]] = []
        self.before_patch: Callable[[str, str], web.Response | None] = lambda _ns, _name: None
        self.disconnect: set[str] = set()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/v1/pods", self.listing)
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self.listing)
        app.router.add_get("/api/v1/namespaces/{namespace}/pods/{name}", self.read)
        app.router.add_patch("/api/v1/namespaces/{namespace}/pods/{name}", self.patch)
        return app

    async def listing(self, request: web.Request) -> web.Response:
        self.queries.append(dict(request.query))
        namespace = request.match_info.get("namespace")
        unbound = request.query.get("fieldSelector") == UNBOUND
        items = [copy.deepcopy(p) for (ns, _), p in self.pods.items()
                 if (namespace is None or ns == namespace) and not (unbound and p["spec"].get("nodeName"))]
        return web.json_response({"items": items, "metadata": {"resourceVersion": "9"}})

    async def read(self, request: web.Request) -> web.Response:
        key = (request.match_info["namespace"], request.match_info["name"])
        if key not in self.pods:
            return web.json_response({"reason": "NotFound", "message": "gone"}, status=404)
        return web.json_response(self.pods[key])

    async def patch(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        assert request.content_type == "application/json-patch+json"
        if name in self.disconnect:
            assert request.transport is not None
            request.transport.close()  # the connection drops mid-request
            return web.Response()
        answer = self.before_patch(namespace, name)
        if answer is not None:
            return answer
        if (namespace, name) not in self.pods:
            return web.json_response({"reason": "NotFound", "message": "gone"}, status=404)
        operations = await request.json()
        self.patches.append((f"{namespace}/{name}", operations))
        try:
            self.pods[(namespace, name)] = apply_patch(self.pods[(namespace, name)], operations)
        except ValueError as exc:
            return web.json_response({"reason": "Invalid", "message": str(exc)}, status=422)
        return web.json_response(self.pods[(namespace, name)])

    def gates(self, namespace: str, name: str) -> list[str]:
        return [g["name"] for g in self.pods[(namespace, name)]["spec"].get("schedulingGates", [])]


async def run_ungate(fake: FakePods, namespace: str | None = None, *, dry_run: bool = False) -> list[Outcome]:
    async with TestServer(fake.app(), host="127.0.0.1") as server:
        connection = Connection(f"http://127.0.0.1:{server.port}", False, lambda: None)
        async with KubeClient(connection) as client:
            return await ungate(client, namespace, dry_run=dry_run, now=NOW)


async def test_every_gated_unbound_pod_is_released_unchanged_and_other_gates_stay() -> None:
    fake = FakePods(
        gated(pod("a", "team-a")),
        gated(pod("b", "team-b", gates=("example.com/quota",))),
        pod("plain", "team-a"),
        pod("other-gate", "team-a", gates=("example.com/quota",)),
        pod("bound", "team-a", node="gpu-1"),
    )
    before = copy.deepcopy(fake.pods[("team-a", "a")])
    outcomes = await run_ungate(fake)
    assert sorted((o.namespace, o.name, o.result) for o in outcomes) == [
        ("team-a", "a", "released"), ("team-b", "b", "released")]
    assert fake.gates("team-a", "a") == []
    assert fake.gates("team-b", "b") == ["example.com/quota"]
    assert fake.gates("team-a", "other-gate") == ["example.com/quota"]
    released = fake.pods[("team-a", "a")]
    # Unchanged otherwise: no node affinity added, nothing else touched.
    assert released["metadata"].pop("annotations") == {RELEASED_ANNOTATION: "2026-12-07T12:00:00Z"}
    assert "annotations" not in before["metadata"]
    before["spec"].pop("schedulingGates")
    released["spec"].pop("schedulingGates")
    assert released == before
    assert all(q.get("fieldSelector") == UNBOUND for q in fake.queries)


async def test_a_namespace_limits_the_list_and_a_dry_run_changes_nothing() -> None:
    fake = FakePods(gated(pod("a", "team-a")), gated(pod("b", "team-b")))
    outcomes = await run_ungate(fake, "team-b", dry_run=True)
    assert [(o.namespace, o.name, o.result) for o in outcomes] == [("team-b", "b", "would release")]
    assert fake.patches == []
    assert fake.gates("team-a", "a") == fake.gates("team-b", "b") == [GATE]


async def test_a_gate_list_changed_after_the_read_is_read_again_not_patched_blindly() -> None:
    fake = FakePods(gated(pod("a", "team-a")))
    changed: list[str] = []

    def insert_a_gate_first(namespace: str, name: str) -> None:
        if not changed:  # another controller adds a gate ahead of ours between the list and the patch
            changed.append(name)
            fake.pods[(namespace, name)]["spec"]["schedulingGates"].insert(0, {"name": "example.com/quota"})
            fake.pods[(namespace, name)]["metadata"]["resourceVersion"] = "2"

    fake.before_patch = insert_a_gate_first
    outcomes = await run_ungate(fake)
    assert [o.result for o in outcomes] == ["released"]
    # The first patch tested index 0 and failed; the second, after the read, removed index 1.
    assert [next(op for op in ops if op["path"].startswith("/spec/")) for _, ops in fake.patches] == [
        {"op": "test", "path": "/spec/schedulingGates/0/name", "value": GATE},
        {"op": "test", "path": "/spec/schedulingGates/1/name", "value": GATE},
    ]
    assert fake.gates("team-a", "a") == ["example.com/quota"]


async def test_deleted_pods_are_gone_and_refused_patches_fail() -> None:
    fake = FakePods(gated(pod("deleted", "team-a")), gated(pod("forbidden", "team-a")))

    def answer(namespace: str, name: str) -> web.Response | None:
        if name == "deleted":
            del fake.pods[(namespace, name)]
            return None
        return web.json_response({"reason": "Forbidden", "message": "cannot patch pods"}, status=403)

    fake.before_patch = answer
    outcomes = {o.name: o for o in await run_ungate(fake)}
    assert outcomes["deleted"].result == "gone"
    assert outcomes["forbidden"].result == "failed" and "403" in outcomes["forbidden"].detail
    assert fake.gates("team-a", "forbidden") == [GATE]


async def test_a_connection_lost_on_one_pod_fails_that_pod_only() -> None:
    fake = FakePods(gated(pod("a", "team-a")), gated(pod("b", "team-a")))
    fake.disconnect = {"a"}
    outcomes = {o.name: o for o in await run_ungate(fake)}
    assert outcomes["a"].result == "failed" and outcomes["a"].detail
    assert outcomes["b"].result == "released" and fake.gates("team-a", "b") == []


async def test_a_gate_that_keeps_changing_is_reported_after_a_few_tries() -> None:
    fake = FakePods(gated(pod("a", "team-a")))
    fake.before_patch = lambda _ns, _name: web.json_response({"reason": "Conflict", "message": "again"}, status=409)
    outcomes = await run_ungate(fake)
    assert outcomes[0].result == "failed" and "kept changing" in outcomes[0].detail


@pytest.mark.parametrize("output", ["text", "json"])
async def test_the_command_prints_each_pod_and_exits_1_on_a_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], output: str
) -> None:
    fake = FakePods(gated(pod("a", "team-a")), gated(pod("forbidden", "team-a")))
    fake.before_patch = lambda _ns, name: (
        web.json_response({"reason": "Forbidden", "message": "no"}, status=403) if name == "forbidden" else None)
    async with TestServer(fake.app(), host="127.0.0.1") as server:
        config = kubeconfig(tmp_path / "kubeconfig", server.port or 0)
        args = build_parser().parse_args(["ungate", "--kubeconfig", str(config), "--context", "fake", "-o", output])
        assert isinstance(args, argparse.Namespace)
        code = await asyncio.to_thread(args.handler, args)
    assert code == 1
    printed = capsys.readouterr().out
    if output == "json":
        results = {p["name"]: p["result"] for p in json.loads(printed)["pods"]}
        assert results == {"a": "released", "forbidden": "failed"}
    else:
        assert "team-a/a: released" in printed
        assert "2 pod(s) gated by vramguard.io/vram: 1 released, 1 failed" in printed


def test_an_unreachable_cluster_is_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = kubeconfig(tmp_path / "kubeconfig", 9)  # the current context points nowhere
    args = build_parser().parse_args(["ungate", "--kubeconfig", str(config)])
    assert args.handler(args) == 1
    assert capsys.readouterr().err.startswith("vramguard ungate: error: cannot list the pods:")
