"""The quota across the webhook's replicas: pending admissions shared through the API server, with
optimistic concurrency (a write names the version it read; a conflict means decide again)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from tests.test_webhook import admission_review, make_state, vllm_pod
from vramguard.codecs import ENFORCE_LABEL
from vramguard.io.kube import ApiError
from webhook.app import STATE_KEY, WebhookState, create_webhook_app
from webhook.quota_holds import PREFIX, QuotaHolds

Client = TestClient[web.Request, web.Application]


class FakeApi:
    """ConfigMaps as the API server keeps them: a write naming an older resourceVersion is a 409."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.down = False
        self.writes = 0
        self.conflicts = 0

    def _check(self) -> None:
        if self.down:
            raise ApiError(503, "ServiceUnavailable", "the API server is down")

    async def get(self, path: str, params: Any = None) -> dict[str, Any]:
        await asyncio.sleep(0)
        self._check()
        if path not in self.objects:
            raise ApiError(404, "NotFound", "not found")
        return self.objects[path]

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0)
        self._check()
        name = f"{path}/{body['metadata']['name']}"
        if name in self.objects:
            self.conflicts += 1
            raise ApiError(409, "AlreadyExists", "already exists")
        return self._store(name, body)

    async def replace(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0)
        self._check()
        if self.objects[path]["metadata"]["resourceVersion"] != body["metadata"]["resourceVersion"]:
            self.conflicts += 1
            raise ApiError(409, "Conflict", "the object has been modified")
        return self._store(path, body)

    def _store(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        self.writes += 1
        stored = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}
        self.objects[path] = stored
        return stored


def replica(api: FakeApi, pods: dict[str, dict[str, Any]]) -> WebhookState:
    """One webhook replica: its own cluster model, the shared API server."""

    async def pod_lookup(namespace: str, name: str) -> dict[str, Any] | None:
        return pods.get(name)

    state = make_state(namespaces={"team-a": {ENFORCE_LABEL: "enforce"}})
    state._pod_lookup = pod_lookup
    state.quota_holds = QuotaHolds(api, "vramguard-system")  # type: ignore[arg-type]
    return state


@pytest.fixture
def replicas(aiohttp_client: Callable[[web.Application], Awaitable[Client]]) -> Callable[..., Awaitable[Any]]:
    async def make(api: FakeApi, pods: dict[str, dict[str, Any]], count: int = 2) -> list[Client]:
        return [await aiohttp_client(create_webhook_app(replica(api, pods), registry=CollectorRegistry()))
                for _ in range(count)]
    return make


def pod_of(i: int) -> dict[str, Any]:
    # 0.74375 of an 80 GiB GPU and vLLM's 0.5 GiB CUDA context: 60 GiB, two of them past the 100 GiB... (the
    # tests' policy gives team-a 160 GiB: three of them are 180 GiB).
    return vllm_pod("0.74375", name=f"p{i}", namespace="team-a", uid=f"uid-{i}")


async def test_pods_reviewed_by_different_replicas_at_once_never_pass_the_quota_together(
    replicas: Callable[..., Awaitable[list[Client]]],
) -> None:
    # 160 GiB of quota, pods of 60 GiB: two fit, the third does not, whichever replica reviews it and
    # however the reviews interleave. Each pod exists (the API server stores it once admitted).
    api = FakeApi()
    pods = {f"p{i}": pod_of(i) for i in range(6)}
    first, second = await replicas(api, pods)
    answers = await asyncio.gather(*(
        (first if i % 2 == 0 else second).post(
            "/validate", json=admission_review(pods[f"p{i}"], namespace="team-a", uid=f"req-{i}"))
        for i in range(6)
    ))
    allowed = [(await answer.json())["response"]["allowed"] for answer in answers]
    assert allowed.count(True) == 2, allowed
    assert api.conflicts > 0  # they did race, and the API server kept them apart
    [record] = api.objects.values()
    assert record["metadata"]["name"] == f"{PREFIX}team-a"


async def test_without_the_shared_record_each_replica_alone_admits_past_the_quota(
    replicas: Callable[..., Awaitable[list[Client]]],
) -> None:
    # The defect the record closes: two replicas, each counting only its own admissions.
    api = FakeApi()
    pods = {f"p{i}": pod_of(i) for i in range(4)}
    first, second = await replicas(api, pods)
    for client in (first, second):
        client.server.app[STATE_KEY].quota_holds = None
    allowed = []
    for i in range(4):
        answer = await (first if i % 2 == 0 else second).post(
            "/validate", json=admission_review(pods[f"p{i}"], namespace="team-a", uid=f"req-{i}"))
        allowed.append((await answer.json())["response"]["allowed"])
    assert allowed == [True, True, True, True]


async def test_an_unreachable_record_refuses_where_enforced_and_warns_elsewhere(
    replicas: Callable[..., Awaitable[list[Client]]],
) -> None:
    api = FakeApi()
    api.down = True
    [client] = await replicas(api, {"p0": pod_of(0)}, count=1)
    answer = await client.post("/validate", json=admission_review(pod_of(0), namespace="team-a"))
    response = (await answer.json())["response"]
    assert response["allowed"] is False
    assert response["status"]["message"].startswith(
        "namespace VRAM quota: cannot read the quota's pending admissions (the API server is down)")
    state: WebhookState = client.server.app[STATE_KEY]
    assert state.cluster.pending_admissions() == 0
    state.cluster.namespaces.replace([{"metadata": {"name": "team-a", "labels": {ENFORCE_LABEL: "warn"}}}])
    answer = await client.post("/validate", json=admission_review(pod_of(0), namespace="team-a"))
    response = (await answer.json())["response"]
    assert response["allowed"] is True
    assert any(w.startswith("would deny: namespace VRAM quota: cannot read") for w in response["warnings"])
    assert state.cluster.pending_admissions() == 1  # admitted: this replica counts it


async def test_a_forged_hold_in_the_record_is_dropped_and_not_adopted_again(
    replicas: Callable[..., Awaitable[list[Client]]],
) -> None:
    # Whoever can reach a replica can send it a review of a pod that never exists: its hold, shared,
    # must not refuse real pods for long on any replica (it is checked against the API server).
    api = FakeApi()
    pods = {"p1": pod_of(1), "p2": pod_of(2)}
    first, second = await replicas(api, pods)
    for i in (7, 8):  # two 60 GiB pods that will never exist
        await first.post("/validate", json=admission_review(pod_of(i), namespace="team-a"))
    answer = await second.post("/validate", json=admission_review(pods["p1"], namespace="team-a"))
    assert (await answer.json())["response"]["allowed"] is True  # after the grace, the forged holds go
    state: WebhookState = second.server.app[STATE_KEY]
    assert state.cluster.pending_admissions() == 1  # p1's own; the forged ones are not adopted again
