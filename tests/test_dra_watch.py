"""The DRA watches: a cluster that does not serve resource.k8s.io/v1 keeps the services working."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from tests.dra_objects import allocated, claim, claim_template, device_class, gpu_device, resource_slice, result
from tests.fake_api import FakeApi
from vramguard.dra.state import DraState
from vramguard.io.dra import RESOURCE_SLICES, dra_watches
from vramguard.io.kube import Connection, Informer, KubeClient
from vramguard.quantity import GiB


class ListStore:
    def __init__(self) -> None:
        self.objects: list[Any] = [{"stale": True}]

    def replace(self, objects: list[Any]) -> None:
        self.objects = list(objects)

    def upsert(self, obj: Any) -> None:
        self.objects.append(obj)

    def delete(self, obj: Any) -> None:
        self.objects.remove(obj)


@contextlib.asynccontextmanager
async def fake_api(api: FakeApi) -> AsyncIterator[str]:
    server = TestServer(api.app())
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        for resource in api.resources.values():
            while not resource.watches.empty():
                resource.watches.get_nowait().put_nowait(None)
        await server.close()


async def eventually(probe: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not probe():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("may_be_absent", [True, False], ids=["absent-tolerated", "absent-is-a-failure"])
async def test_not_served_resource(
    may_be_absent: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(Informer, "MAX_BACKOFF", 0.01)
    monkeypatch.setattr(Informer, "INITIAL_BACKOFF", 0.01)
    api = FakeApi({RESOURCE_SLICES: [[resource_slice()]]})
    api[RESOURCE_SLICES].fail_status = 404
    async with fake_api(api) as url:
        store = ListStore()
        informer = Informer(
            KubeClient(Connection(url, False, lambda: None)), RESOURCE_SLICES, store, may_be_absent=may_be_absent
        )
        task = asyncio.create_task(informer.run())
        try:
            with caplog.at_level(logging.WARNING, logger="vramguard.io.kube"):
                await asyncio.sleep(0.3)  # dozens of retries at this backoff
            if not may_be_absent:
                assert not informer.synced.is_set() and not informer.healthy()
                return
            assert informer.synced.is_set() and informer.healthy() and informer.absent
            assert store.objects == []
            warnings = [r for r in caplog.records if "not served" in r.getMessage()]
            assert len(warnings) == 1  # logged once, however often it is retried
            # The API is switched on: the next list fills the store.
            api[RESOURCE_SLICES].fail_status = None
            await eventually(lambda: store.objects == [resource_slice()])
            assert not informer.absent
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await informer.client.close()


def test_dra_watches() -> None:
    state = DraState()
    watches = dra_watches(state)
    assert state.watched
    assert [w.path.rpartition("/")[2] for w in watches] == [
        "resourceslices",
        "deviceclasses",
        "resourceclaims",
        "pods",
        "resourceclaimtemplates",
    ]
    assert all(w.may_be_absent for w in watches if w.path.startswith("/apis/resource.k8s.io/"))
    assert len(dra_watches(DraState(), templates=False)) == 4


def test_the_pod_watch_keeps_only_live_pods_using_claims() -> None:
    state = DraState()
    (watch,) = [w for w in dra_watches(state) if w.path == "/api/v1/pods"]
    assert watch.slim is not None
    plain = {"metadata": {"name": "web", "namespace": "default", "uid": "u1"}, "spec": {"containers": []}}
    with_claim = {
        "metadata": {"name": "vllm", "namespace": "default", "uid": "u2", "labels": {"a": "b"}},
        "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}], "containers": [],
                 "volumes": [{"name": "big"}]},
        "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled"}]},
    }
    done = {**with_claim, "metadata": {"name": "done", "namespace": "default", "uid": "u3"},
            "status": {"phase": "Succeeded"}}
    watch.store.replace([watch.slim(p) for p in (plain, with_claim, done)])
    assert list(state.pods.records) == ["default/vllm"]
    kept = state.pods.records["default/vllm"]
    assert "volumes" not in kept["spec"] and "conditions" not in kept["status"]
    assert state.pod("u2") is kept and state.pod("u1") is None
    assert state.pods_naming("default", template="t") == [kept]


def test_state_follows_events() -> None:
    state = DraState()
    state.slices.replace([resource_slice(devices=[gpu_device(memory="80Gi")])])
    state.classes.replace([device_class()])
    state.templates.replace([claim_template(memory="4Gi")])
    first = state.generation
    a = allocated(claim("a", memory="20Gi"), [result(memory="20Gi", share="s1")])
    b = allocated(claim("b", memory="30Gi"), [result(memory="30Gi", share="s2")])
    state.claims.upsert(a)
    state.claims.upsert(b)
    assert state.generation > first
    (usage,) = state.node_usage("node-a")
    assert usage.consumed_bytes == 50 * GiB
    state.claims.delete(a)
    (usage,) = state.node_usage("node-a")
    assert usage.consumed_bytes == 30 * GiB
    assert state.allocation("default", "b") is not None and state.allocation("default", "a") is None
    assert state.claim("default", "b") is not None
    template = state.template("gpu-share-memory", "gpu-4gi")
    assert template is not None and template.requests[0].alternatives[0].memory == 4 * GiB
    assert list(state.device_classes()) == ["gpu.nvidia.com"]
    # A slice deleted: its devices and their usage go.
    state.slices.delete(resource_slice())
    assert state.devices() == () and state.node_usage("node-a") == []
    state.claims.upsert(allocated(claim("c"), [result(device="gpu-7")]))
    assert any("in no complete pool" in note for note in state.notes())


def test_state_ignores_unnamed_and_junk() -> None:
    state = DraState()
    state.claims.replace([{"metadata": {}}, {"metadata": {"name": "x", "namespace": "n"}, "spec": 5}])
    assert list(state.claims.records) == ["n/x"]
    state.classes.replace([{"metadata": {"name": 5}}])
    assert state.device_classes() == {}


def _owned(obj: dict[str, Any], pod_uid: str) -> dict[str, Any]:
    obj["metadata"]["ownerReferences"] = [{"kind": "Pod", "name": "p", "uid": pod_uid, "controller": True}]
    return obj


@pytest.mark.parametrize(
    ("claims", "exclude", "expected"),
    [
        pytest.param([], None, (0, 0), id="none"),
        pytest.param(
            [allocated(claim("a", memory="20Gi"), [result(memory="20Gi", share="s1")])],
            None,
            (20 * GiB, 1),
            id="allocated-consumed",
        ),
        pytest.param([claim("p", memory="30Gi")], None, (30 * GiB, 1), id="pending-claim-counts-its-request"),
        pytest.param([claim("p")], None, (80 * GiB, 1), id="pending-without-request-takes-the-default"),
        pytest.param([claim("p", memory="30Gi", count=2)], None, (60 * GiB, 1), id="pending-two-devices"),
        pytest.param([_owned(claim("p", memory="30Gi"), "uid-me")], "uid-me", (0, 0), id="own-template-claim-left-out"),
        pytest.param(
            [allocated(claim("a", memory="20Gi"), [result(memory="20Gi", share="s1")], pods=("me",))],
            "uid-me",
            (0, 0),
            id="claim-reserved-for-the-pod-left-out",
        ),
        pytest.param([claim("x", "elsewhere", memory="30Gi")], None, (0, 0), id="other-namespace"),
        pytest.param([claim("nic", device_class_name="nic")], None, (0, 0), id="not-a-gpu-class"),
    ],
)
def test_namespace_consumed(claims: list[dict[str, Any]], exclude: str | None, expected: tuple[int, int]) -> None:
    state = DraState()
    state.slices.replace([resource_slice(devices=[gpu_device(memory="80Gi")])])
    state.classes.replace([device_class(), device_class("nic", "device.driver == 'nic.example.com'", None)])
    state.claims.replace(claims)
    assert state.namespace_consumed("default", exclude) == expected


async def test_the_claim_pods_watch_runs_beside_the_services_own_pod_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two watches of /api/v1/pods: each is its own task and readiness check (one must not replace the other)."""
    from vramguard.io import runtime as runtime_module  # noqa: PLC0415

    started: list[str] = []

    async def supervise(server: Any, background: dict[str, Any], **_: Any) -> None:
        for coroutine in background.values():
            coroutine.close()
        server.close()
        started.extend(background)

    monkeypatch.setattr(runtime_module, "supervise", supervise)
    client = KubeClient(Connection("http://127.0.0.1:9", False, lambda: None))
    own_pods = runtime_module.Watch("/api/v1/pods", DraState().pods)
    service = runtime_module.ServiceRuntime(client, [own_pods, *dra_watches(DraState())])
    assert "watch-pods" in service.readiness.names and "watch-pods-with-claims" in service.readiness.names
    await service.serve(asyncio.sleep(0))
    assert len(started) == len(service.informers) == 6
    await client.close()
