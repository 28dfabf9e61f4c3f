"""Pending admissions against forged reviews: whoever can reach ``/validate`` can POST a review, and
an admitted pod holds its namespace's quota until the pod watch shows it. A hold must not refuse
real pods before the API server has shown its pod."""

from __future__ import annotations

import copy
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from tests.test_webhook import POLICY_YAML, admission_review, gpu_node, post, vllm_pod
from vramguard.codecs import ENFORCE_LABEL
from vramguard.policy import Policy
from webhook import app as webhook_app
from webhook.app import PolicySource, WebhookState, create_webhook_app

POLICY = Policy.from_yaml(POLICY_YAML.replace("team-a: 160Gi", "team-a: 80Gi"))
"""An 80 GiB GPU's worth of VRAM for team-a: two pods of 0.6 of an 80 GiB GPU do not fit together."""
GRACE = 0.2
"""The grace the tests run with (the shipped one, a second, would only slow them down)."""

Client = TestClient[web.Request, web.Application]


class Api:
    """The pods the API server has stored, read as :class:`WebhookState` reads them (``pod_lookup``)."""

    def __init__(self, *, fails: bool = False) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.fails = fails
        self.asked: list[tuple[str, float]] = []

    async def __call__(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        self.asked.append((name, time.monotonic()))
        if self.fails:
            raise OSError("connection refused")
        return self.pods.get(name)


@pytest.fixture(autouse=True)
def short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(webhook_app, "HOLD_GRACE", GRACE)


@pytest.fixture
def client_with(
    aiohttp_client: Callable[[web.Application], Awaitable[Client]],
) -> Callable[[Api | None], Awaitable[Client]]:
    async def make(api: Api | None) -> Client:
        state = WebhookState(PolicySource(POLICY), pod_lookup=api)
        state.cluster.namespaces.replace([{"metadata": {"name": "team-a", "labels": {ENFORCE_LABEL: "enforce"}}}])
        state.cluster.nodes.replace([gpu_node("gpu-1")])
        return await aiohttp_client(create_webhook_app(state, registry=CollectorRegistry()))

    return make


def review(name: str, *, utilization: str = "0.6", operation: str = "CREATE", dry_run: bool = False) -> dict[str, Any]:
    """The review the API server sends for pod ``name`` of team-a (its UID is ``uid-<name>``)."""
    obj = vllm_pod(utilization, name=name, namespace="team-a", uid=f"uid-{name}")
    return admission_review(obj, namespace="team-a", uid=f"req-{name}", operation=operation,
                            old=copy.deepcopy(obj) if operation == "UPDATE" else None, dry_run=dry_run)


async def allowed(client: Client, body: dict[str, Any]) -> bool:
    status, answer = await post(client, body)
    assert status == 200
    return bool(answer["response"]["allowed"])


async def test_a_forged_review_does_not_refuse_the_next_real_pod(client_with: Any) -> None:
    api = Api()
    client = await client_with(api)
    assert await allowed(client, review("forged"))  # POSTed by a pod, never stored by the API server
    start = time.monotonic()
    assert await allowed(client, review("real"))
    # It was asked about once it was old enough for the API server to have stored a real one.
    assert [name for name, _ in api.asked] == ["forged"]
    assert api.asked[0][1] - start >= GRACE * 0.9
    api.pods["real"] = vllm_pod("0.6", name="real", namespace="team-a", uid="uid-real")
    assert not await allowed(client, review("third")), "the real pod holds the quota"


async def test_without_reading_the_api_server_a_hold_is_believed(client_with: Any) -> None:
    client = await client_with(None)
    assert await allowed(client, review("first"))
    assert not await allowed(client, review("second"))


async def test_a_hold_whose_pod_the_api_server_shows_keeps_refusing_and_is_asked_about_once(
    client_with: Any,
) -> None:
    api = Api()
    client = await client_with(api)
    assert await allowed(client, review("first"))
    api.pods["first"] = vllm_pod("0.6", name="first", namespace="team-a", uid="uid-first")
    assert not await allowed(client, review("second"))
    assert not await allowed(client, review("third"))
    assert [name for name, _ in api.asked] == ["first"]


async def test_a_name_now_holding_another_pod_releases_the_hold(client_with: Any) -> None:
    api = Api()
    client = await client_with(api)
    assert await allowed(client, review("first"))
    api.pods["first"] = vllm_pod("0.6", name="first", namespace="team-a", uid="uid-someone-else")
    assert await allowed(client, review("second"))


async def test_a_hold_stays_when_the_api_server_cannot_say(client_with: Any) -> None:
    client = await client_with(Api(fails=True))
    assert await allowed(client, review("first"))
    assert not await allowed(client, review("second"))


async def test_a_forged_hold_does_not_refuse_a_workload_either(client_with: Any) -> None:
    client = await client_with(Api())
    assert await allowed(client, review("forged"))
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "team-a"},
                  "spec": {"replicas": 1, "template": vllm_pod("0.6", namespace="team-a")}}
    assert await allowed(client, admission_review(deployment, kind="Deployment", namespace="team-a"))


@pytest.mark.parametrize(
    "first",
    [review("dry", dry_run=True), review("updated", operation="UPDATE")],
    ids=["dry-run", "update"],
)
async def test_only_creations_hold_quota(client_with: Any, first: dict[str, Any]) -> None:
    api = Api()
    client = await client_with(api)
    assert await allowed(client, first)
    assert await allowed(client, review("next"))
    assert api.asked == []


async def test_a_review_naming_no_pod_holds_nothing(client_with: Any) -> None:
    api = Api()
    client = await client_with(api)
    nameless = review("x")
    del nameless["request"]["object"]["metadata"]["name"]
    assert await allowed(client, nameless)
    assert await allowed(client, review("next"))
    assert api.asked == []
