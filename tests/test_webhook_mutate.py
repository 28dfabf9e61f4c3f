"""The mutating webhook over HTTP (``POST /mutate``): the JSON Patch on the wire, what is skipped,
bad input, metrics."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from tests.test_webhook import BAD_REQUESTS, admission_review, client_for, make_state, vllm_pod
from vramguard.mutation import LIMIT_ENV, ROUTING_LABEL
from vramguard.policy import Policy
from webhook.app import BODY_LIMIT

__all__ = ["client_for"]  # the fixture, imported for these tests

ROUTING_POLICY = Policy.from_yaml("""
default_class: shared
enforcement: audit
classes:
  shared: {sharing: [time-slicing], enforce_memory_limits: true}
schedulers: [vramguard]
""")


async def mutate(client: Any, body: Any) -> tuple[int, dict[str, Any]]:
    response = await client.post("/mutate", json=body)
    return response.status, await response.json()


def patch_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    response = body["response"]
    if "patch" not in response:
        return []
    assert response["patchType"] == "JSONPatch"
    return list(json.loads(base64.b64decode(response["patch"])))


async def test_an_unedited_gpu_pod_gets_a_json_patch_routing_it(client_for: Any) -> None:
    client = await client_for(make_state(ROUTING_POLICY, namespaces={"default": {}}))
    status, body = await mutate(client, admission_review(vllm_pod("0.5")))
    assert status == 200
    assert body["apiVersion"] == "admission.k8s.io/v1" and body["kind"] == "AdmissionReview"
    assert body["response"]["uid"] == "7f3c-req" and body["response"]["allowed"] is True
    patch = patch_of(body)
    assert {"op": "add", "path": "/spec/schedulerName", "value": "vramguard"} in patch
    # The class enforces limits: vLLM v0.21.0's 0.5 of the A100's 80 GiB and its CUDA context.
    assert {"op": "add", "path": "/spec/containers/0/env",
            "value": [{"name": "NVIDIA_GPU_MEMORY_REQUEST", "value": str(40 * 1024 + 512)},
                      {"name": LIMIT_ENV, "value": str(40 * 1024 + 512)}]} in patch
    metrics = await (await client.get("/metrics")).text()
    assert 'vramguard_webhook_mutations_total{result="routed"} 1.0' in metrics
    assert 'vramguard_webhook_mutations_total{result="limited"} 1.0' in metrics


async def test_an_opted_out_namespace_gets_no_patch(client_for: Any) -> None:
    client = await client_for(make_state(ROUTING_POLICY, namespaces={"default": {ROUTING_LABEL: "disabled"}}))
    status, body = await mutate(client, admission_review(vllm_pod("0.5")))
    assert status == 200 and patch_of(body) == []


@pytest.mark.parametrize(
    "review",
    [
        admission_review(vllm_pod(), operation="UPDATE", old=vllm_pod()),
        admission_review(vllm_pod(), operation="DELETE"),
        admission_review({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {}, "spec": {}},
                         kind="Deployment"),
        admission_review(vllm_pod(), sub_resource="status"),
    ],
    ids=["update", "delete", "deployment", "subresource"],
)
async def test_anything_but_a_pod_create_is_allowed_unchanged(client_for: Any, review: dict[str, Any]) -> None:
    client = await client_for(make_state(ROUTING_POLICY, namespaces={"default": {}}))
    status, body = await mutate(client, review)
    assert status == 200 and body["response"]["allowed"] is True and patch_of(body) == []
    assert 'vramguard_webhook_mutations_total{result="skipped"} 1.0' in await (await client.get("/metrics")).text()


async def test_junk_inside_the_pod_is_never_a_server_error(client_for: Any) -> None:
    junk = {"kind": "Pod", "metadata": {"name": 5, "labels": [1], "annotations": {"vramguard.io/vram": 7}},
            "spec": {"containers": [None, 3, {"name": ["x"], "resources": {"limits": {"nvidia.com/gpu": {}}},
                                             "args": [None, 1.5], "env": "oops"}], "schedulerName": 4}}
    client = await client_for(make_state(ROUTING_POLICY, namespaces={"default": {}}))
    status, body = await mutate(client, admission_review(junk))
    assert status == 200 and body["response"]["allowed"] is True


@pytest.mark.parametrize(("body", "fragment"), BAD_REQUESTS)
async def test_malformed_requests_are_a_clear_400(client_for: Any, body: bytes, fragment: str) -> None:
    client = await client_for(make_state(ROUTING_POLICY))
    response = await client.post("/mutate", data=body, headers={"Content-Type": "application/json"})
    if "does not validate" in fragment:  # a kind /mutate does not patch is allowed unchanged
        assert response.status == 200
        return
    assert response.status == 400
    assert fragment in (await response.json())["error"]


async def test_a_body_over_the_limit_is_413_not_a_patch(client_for: Any) -> None:
    obj = vllm_pod()
    obj["metadata"]["annotations"] = {"filler": "x" * BODY_LIMIT}
    client = await client_for(make_state(ROUTING_POLICY))
    response = await client.post("/mutate", data=json.dumps(admission_review(obj)).encode(),
                                 headers={"Content-Type": "application/json"})
    assert response.status == 413
    assert f"exceeds the limit of {BODY_LIMIT} bytes" in (await response.json())["error"]
