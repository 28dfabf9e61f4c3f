"""Fuzzing the webhook: whatever arrives, the answer is a well-formed review (200) or a clear 4xx, never a 500."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from tests.sync_app import SyncApp
from vramguard.admission import MAX_WARNINGS, SUPPORTED_KINDS, WARNING_LIMIT
from vramguard.policy import Policy
from webhook.app import PolicySource, WebhookState, create_webhook_app

POLICY = Policy.from_yaml(
    """
default_class: best-effort
classes:
  guaranteed: {sharing: [none, mig], allow_implicit_defaults: false, unknown_vram: reject, max_vram_per_gpu: 40Gi}
  burstable: {sharing: [mps], require_mps_limit: true}
  best-effort: {sharing: [time-slicing], allows_pod_classes: [guaranteed, burstable]}
quotas: {team-a: 100Gi}
schedulers: [vramguard, default-scheduler]
"""
)
NAMESPACES = ("team-a", "enforced", "warned", "audited", "unknown")
AUDIT_KEY = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Webhook(SyncApp):
    """A webhook app on its own event loop, so that synchronous hypothesis tests can call it."""

    def __init__(self) -> None:
        state = WebhookState(PolicySource(POLICY))
        state.cluster.namespaces.replace([
            {"metadata": {"name": "enforced", "labels": {"vramguard.io/enforce": "enforce"}}},
            {"metadata": {"name": "warned", "labels": {"vramguard.io/enforce": "warn"}}},
            {"metadata": {"name": "audited", "labels": {"vramguard.io/enforce": "audit",
                                                        "vramguard.io/qos-class": "guaranteed"}}},
            {"metadata": {"name": "team-a", "labels": {"vramguard.io/enforce": "bogus"}}},
        ])
        state.cluster.nodes.replace([{
            "metadata": {"name": "n", "labels": {"nvidia.com/gpu.count": "2", "nvidia.com/gpu.memory": "81920",
                                                 "nvidia.com/gpu.replicas": "4",
                                                 "nvidia.com/gpu.sharing-strategy": "time-slicing"}},
            "status": {"allocatable": {"nvidia.com/gpu": "8"}},
        }])
        super().__init__(create_webhook_app(state, registry=CollectorRegistry()))

    def validate(self, body: bytes) -> tuple[int, Any]:
        return self.post("/validate", data=body, headers={"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def webhook() -> Iterator[Webhook]:
    hook = Webhook()
    yield hook
    hook.close()


# --------------------------------------------------------------------------- strategies

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
FLAGS = ["--gpu-memory-utilization", "--gpu_memory_utilization=0.4", "-tp", "--tensor-parallel-size", "-pp",
         "--kv-cache-memory-bytes", "--config", "--mem-fraction-static", "--tp", "--cuda-memory-fraction",
         "--num-shard", "--model", "serve"]
VALUES = ["0.3", "0.9", "1.5", "0", "-1", "abc", "2", "4", "$(UTIL)", "1e-2", ".5", ""]
word = st.sampled_from(FLAGS + VALUES)
resource_names = st.sampled_from(["nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-3g.40gb",
                                  "nvidia.com/mig-1g.5gb", "cpu", "memory", "example.com/fpga"])
# Huge counts included: a pod asking for 10**21 GPUs must cost the webhook nothing.
quantities = st.one_of(st.sampled_from(["1", "2", "0", "0.5", "1k", "-1", "x", "1Gi", "1e21", "2048", "1024"]),
                       st.integers(-2, 9), json_values)
env_names = st.sampled_from(["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                             "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE", "UTIL",
                             "CUDA_MEMORY_FRACTION", "NUM_SHARD"])
env_values = st.sampled_from(["0=16G", "0=12288M,1=8G", "50", "0.4", "false", "oops", "0=0G", "1.2"])


@st.composite
def containers(draw: st.DrawFn) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": draw(st.sampled_from(["vllm", "c", "a-b", "x" * 40]))}
    entry["image"] = draw(st.sampled_from(["vllm/vllm-openai:v0.21.0", "vllm/vllm-openai:v0.8.5",
                                           "ghcr.io/huggingface/text-generation-inference:3", "python:3.12"]))
    if draw(st.booleans()):
        entry["command"] = draw(st.sampled_from([
            ["vllm", "serve", "m"], ["sh", "-c", "exec vllm serve m --tp 2"],
            ["python", "-m", "sglang.launch_server"], ["text-generation-launcher"],
        ]))
    entry["args"] = draw(st.lists(word, max_size=8))
    if draw(st.booleans()):
        env = draw(st.dictionaries(env_names, env_values, max_size=3))
        entry["env"] = [{"name": n, "value": v} for n, v in env.items()]
    sections = draw(st.sets(st.sampled_from(["limits", "requests"])))
    entry["resources"] = {s: draw(st.dictionaries(resource_names, quantities, max_size=3)) for s in sections}
    if draw(st.integers(0, 9)) == 0:
        entry[draw(st.sampled_from(["resources", "args", "env", "name"]))] = draw(json_values)
    return entry


@st.composite
def pod_templates(draw: st.DrawFn) -> dict[str, Any]:
    labels = draw(st.dictionaries(st.sampled_from(["vramguard.io/qos-class", "app"]),
                                  st.sampled_from(["guaranteed", "burstable", "best-effort", "gold", "x"]),
                                  max_size=2))
    annotations = draw(st.dictionaries(st.sampled_from(["vramguard.io/vram", "vramguard.io/vram.vllm", "other"]),
                                       st.sampled_from(["16Gi", "0.25", "1", "2", "abc", "", "0.0", "12"]),
                                       max_size=2))
    spec: dict[str, Any] = {"containers": draw(st.lists(containers(), min_size=1, max_size=3))}
    if draw(st.booleans()):
        spec["initContainers"] = draw(st.lists(containers(), max_size=2))
    if draw(st.booleans()):
        spec["nodeName"] = draw(st.sampled_from(["n", "ghost"]))
    return {"metadata": {"name": "p", "labels": labels, "annotations": annotations,
                         "uid": draw(st.sampled_from(["u1", "u2", "u3"]))}, "spec": spec}


@st.composite
def reviews(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(sorted(SUPPORTED_KINDS)))
    template = draw(pod_templates())
    obj: dict[str, Any]
    if kind == "Pod":
        obj = {"apiVersion": "v1", "kind": "Pod", **template}
    elif kind == "CronJob":
        obj = {"kind": kind, "metadata": {"name": "w"},
               "spec": {"jobTemplate": {"spec": {"template": template, "parallelism": draw(st.integers(-1, 5))}}}}
    else:
        obj = {"kind": kind, "metadata": {"name": "w"},
               "spec": {"template": template, "replicas": draw(st.integers(-1, 5))}}
    group, version = SUPPORTED_KINDS[kind]
    operation = draw(st.sampled_from(["CREATE", "UPDATE", "DELETE", "CONNECT"]))
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": draw(st.uuids()).hex,
            "kind": {"group": group, "version": version, "kind": kind},
            "operation": operation,
            "namespace": draw(st.sampled_from(NAMESPACES)),
            "object": obj,
            "oldObject": draw(st.none() | st.just(obj)) if operation == "UPDATE" else None,
            "dryRun": draw(st.booleans()),
        },
    }


def check_review_answer(status: int, body: Any, uid: str) -> None:
    assert status == 200, body
    response = body["response"]
    assert body["apiVersion"] == "admission.k8s.io/v1" and body["kind"] == "AdmissionReview"
    assert response["uid"] == uid
    assert isinstance(response["allowed"], bool)
    if not response["allowed"]:
        assert response["status"]["code"] == 403
        assert response["status"]["message"].strip()
    warnings = response.get("warnings", [])
    assert len(warnings) <= MAX_WARNINGS
    assert all(0 < len(w) <= WARNING_LIMIT and "\n" not in w for w in warnings)
    assert all(AUDIT_KEY.match(key) for key in response.get("auditAnnotations", {}))


# --------------------------------------------------------------------------- properties


@FUZZ
@given(review=reviews())
def test_any_well_formed_review_gets_a_well_formed_answer(webhook: Webhook, review: dict[str, Any]) -> None:
    status, body = webhook.validate(json.dumps(review).encode())
    check_review_answer(status, body, review["request"]["uid"])


@FUZZ
@given(review=reviews(), path=st.lists(st.sampled_from(["request", "object", "kind", "metadata", "spec", "uid",
                                                         "operation", "namespace", "apiVersion", "template"]),
                                        min_size=1, max_size=4), junk=json_values)
def test_damaged_reviews_get_a_review_or_a_400(webhook: Webhook, review: dict[str, Any], path: list[str],
                                               junk: Any) -> None:
    node: Any = review
    for key in path[:-1]:
        if isinstance(node, dict) and isinstance(node.get(key), dict):
            node = node[key]
    if isinstance(node, dict):
        node[path[-1]] = junk
    status, body = webhook.validate(json.dumps(review).encode())
    assert status in (200, 400), body
    if status == 400:
        assert isinstance(body["error"], str) and body["error"]
    else:
        check_review_answer(status, body, review["request"]["uid"])


@FUZZ
@given(body=st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode())))
def test_arbitrary_bodies_are_a_400(webhook: Webhook, body: bytes) -> None:
    status, answer = webhook.validate(body)
    assert status == 400, answer
    assert answer["error"]
