"""The webhook's HTTP entry on custom workloads: the policy's kinds are read, in the versions it names."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_webhook import admission_review, client_for, make_state, post
from vramguard.policy import default_policy

__all__ = ["client_for"]  # the fixture, shared with the webhook tests

CORPUS = Path(__file__).parent / "data" / "workloads"


def lws(version: str = "v1", size: int = 2) -> dict[str, Any]:
    obj: dict[str, Any] = copy.deepcopy(yaml.safe_load((CORPUS / "lws-vllm-nnodes.yaml").read_text()))
    obj["apiVersion"] = f"leaderworkerset.x-k8s.io/{version}"
    obj["metadata"]["namespace"] = "default"
    obj["spec"]["leaderWorkerTemplate"]["size"] = size
    for template in ("leaderTemplate", "workerTemplate"):
        obj["spec"]["leaderWorkerTemplate"][template]["spec"]["schedulerName"] = "vramguard"
    return obj


def review(obj: dict[str, Any], version: str) -> dict[str, Any]:
    body = admission_review(obj, kind="LeaderWorkerSet", operation="CREATE")
    for key in ("kind", "requestKind"):
        body["request"][key] = {"group": "leaderworkerset.x-k8s.io", "version": version, "kind": "LeaderWorkerSet"}
    return body


@pytest.mark.parametrize(
    ("size", "allowed"), [pytest.param(2, True, id="group-adds-up"), pytest.param(4, False, id="group-of-4")]
)
async def test_leaderworkerset_is_reviewed(client_for: Any, size: int, allowed: bool) -> None:
    client = await client_for(make_state(default_policy().model_copy(update={"enforcement": "enforce"})))
    status, body = await post(client, review(lws(size=size), "v1"))
    assert status == 200
    assert body["response"]["allowed"] is allowed, body
    if not allowed:
        assert "LeaderWorkerSet leader: container vllm:" in body["response"]["status"]["message"]


async def test_a_version_the_policy_does_not_name_is_a_400(client_for: Any) -> None:
    client = await client_for(make_state(default_policy()))
    status, body = await post(client, review(lws("v2"), "v2"))
    assert status == 400
    assert "vramguard does not validate leaderworkerset.x-k8s.io/v2 LeaderWorkerSet" in body["error"]


def operator_review(obj: dict[str, Any], group: str, version: str, kind: str) -> dict[str, Any]:
    body = admission_review(obj, kind=kind, operation="CREATE")
    for key in ("kind", "requestKind"):
        body["request"][key] = {"group": group, "version": version, "kind": kind}
    return body


@pytest.mark.parametrize(("utilization", "allowed"), [("0.9", True), ("1.5", False)])
async def test_a_serving_operators_object_is_reviewed_over_http(
    client_for: Any, utilization: str, allowed: bool
) -> None:
    model: dict[str, Any] = copy.deepcopy(
        yaml.safe_load((CORPUS / "kubeai-model-llama-3.1-8b-instruct-fp8-l4.yaml").read_text()))
    model["metadata"]["namespace"] = "default"
    model["spec"]["args"] = [a.replace("=0.9", f"={utilization}") for a in model["spec"]["args"]]
    client = await client_for(make_state(default_policy().model_copy(update={"enforcement": "enforce"})))
    status, body = await post(client, operator_review(model, "kubeai.org", "v1", "Model"))
    assert status == 200
    assert body["response"]["allowed"] is allowed, body
    # A version the reader does not know is not read.
    status, body = await post(client, operator_review(model, "kubeai.org", "v2", "Model"))
    assert status == 400 and "vramguard does not validate kubeai.org/v2 Model" in body["error"]
