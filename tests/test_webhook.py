"""The webhook over HTTP (aiohttp test client): the AdmissionReview wire, modes, bad input, state, probes."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Awaitable, Callable, Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from tests import builders
from tests.podspecs import container, pod
from vramguard.admission import SUPPORTED_KINDS, quantity_text
from vramguard.codecs import ENFORCE_LABEL, QOS_CLASS_LABEL
from vramguard.io.http import Readiness
from vramguard.policy import Policy, PolicyFile, default_policy
from vramguard.quantity import format_bytes
from webhook.app import BODY_LIMIT, PolicySource, WebhookState, create_webhook_app

POLICY_YAML = """
default_class: best-effort
enforcement: enforce
classes:
  guaranteed: {sharing: [none, mig], allow_implicit_defaults: false}
  best-effort: {sharing: [time-slicing], allows_pod_classes: [guaranteed]}
quotas:
  team-a: 160Gi
schedulers: [vramguard, default-scheduler]
direct_placement: {allowed_groups: ["system:nodes"]}
"""
POLICY = Policy.from_yaml(POLICY_YAML)
MiB = 1 << 20
GiB = 1 << 30
CUDA_CONTEXT = 512 * MiB
"""What the pods' vLLM (v0.21.0: CUDA graphs inside its share) holds beside its share on each GPU."""

Client = TestClient[web.Request, web.Application]
ClientFactory = Callable[[web.Application], Awaitable[Client]]


def gpu_node(name: str, *, memory_mib: int = 81920, gpus: int = 2, replicas: int = 4,
             sharing: str = "time-slicing") -> dict[str, Any]:
    """A node of A100s (two by default)."""
    return builders.gpu_node(name, gpus, replicas, memory_mib, "NVIDIA-A100-SXM4-80GB", sharing)


def vllm_pod(utilization: str = "0.3", *, name: str = "p", namespace: str = "default",
             annotations: dict[str, str] | None = None, uid: str | None = None, node: str | None = None,
             **spec: Any) -> dict[str, Any]:
    obj = pod(container("vllm", image="vllm/vllm-openai:v0.21.0",
                        args=["--model", "m", "--gpu-memory-utilization", utilization]),
              annotations=annotations, **spec)
    obj["metadata"].update(name=name, namespace=namespace)
    if uid is not None:
        obj["metadata"]["uid"] = uid
    if node is not None:
        obj["spec"]["nodeName"] = node
    return obj


def _name(obj: Any) -> str:
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    return str(metadata.get("name", "")) if isinstance(metadata, dict) else ""


def admission_review(obj: Any, *, operation: str = "CREATE", kind: str = "Pod",
                     namespace: str = "default", uid: str = "7f3c-req", old: Mapping[str, Any] | None = None,
                     dry_run: bool = False, sub_resource: str | None = None,
                     groups: tuple[str, ...] = ("system:authenticated",)) -> dict[str, Any]:
    group, version = SUPPORTED_KINDS.get(kind, ("", "v1"))
    request: dict[str, Any] = {
        "uid": uid,
        "kind": {"group": group, "version": version, "kind": kind},
        "resource": {"group": group, "version": version, "resource": kind.lower() + "s"},
        "requestKind": {"group": group, "version": version, "kind": kind},
        "name": _name(obj),
        "namespace": namespace,
        "operation": operation,
        "userInfo": {"username": "alice", "groups": list(groups)},
        "object": obj,
        "oldObject": old,
        "dryRun": dry_run,
        "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
    }
    if sub_resource is not None:
        request["subResource"] = sub_resource
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def make_state(
    policy: Policy = POLICY,
    *,
    namespaces: Mapping[str, Mapping[str, str]] | None = None,
    nodes: tuple[dict[str, Any], ...] = (),
    pods: tuple[dict[str, Any], ...] = (),
    lookup: Callable[[str], Awaitable[Mapping[str, Any] | None]] | None = None,
) -> WebhookState:
    state = WebhookState(PolicySource(policy), namespace_lookup=lookup)
    # As in webhook.main: one cluster model reads every watch.
    state.cluster.namespaces.replace(
        [{"metadata": {"name": n, "labels": dict(labels)}} for n, labels in
         (namespaces or {"default": {ENFORCE_LABEL: "enforce"}}).items()])
    state.cluster.nodes.replace([gpu_node("gpu-1"), *nodes])
    state.cluster.pods.replace(list(pods))
    return state


@pytest.fixture
def client_for(aiohttp_client: ClientFactory) -> Callable[[WebhookState], Awaitable[Client]]:
    async def make(state: WebhookState, readiness: Readiness | None = None) -> Client:
        app = create_webhook_app(state, registry=CollectorRegistry(), readiness=readiness)
        return await aiohttp_client(app)

    return make


async def post(client: Client, body: Any) -> tuple[int, dict[str, Any]]:
    response = await client.post("/validate", json=body)
    return response.status, await response.json()


# --------------------------------------------------------------------------- the wire


async def test_allowed_response_copies_the_uid(client_for: Any) -> None:
    client = await client_for(make_state())
    status, body = await post(client, admission_review(vllm_pod(), uid="d0f1-42"))
    assert status == 200
    assert body == {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                    "response": {"uid": "d0f1-42", "allowed": True}}


async def test_denial_carries_status_403_and_the_message(client_for: Any) -> None:
    client = await client_for(make_state())
    status, body = await post(client, admission_review(vllm_pod("1.5")))
    assert status == 200
    assert body["response"]["allowed"] is False
    assert body["response"]["status"] == {
        "code": 403, "reason": "Forbidden",
        "message": "container vllm: --gpu-memory-utilization 1.5 is outside (0, 1]",
    }


async def test_warn_namespace_admits_with_warnings(client_for: Any) -> None:
    client = await client_for(make_state(namespaces={"dev": {ENFORCE_LABEL: "warn"}}))
    status, body = await post(client, admission_review(vllm_pod("1.5", namespace="dev"), namespace="dev"))
    assert status == 200
    assert body["response"]["allowed"] is True
    assert body["response"]["warnings"] == [
        "would deny: container vllm: --gpu-memory-utilization 1.5 is outside (0, 1]"
    ]
    assert "auditAnnotations" not in body["response"]


async def test_audit_namespace_admits_with_audit_annotations(client_for: Any) -> None:
    client = await client_for(make_state(namespaces={"lab": {ENFORCE_LABEL: "audit"}}))
    status, body = await post(client, admission_review(vllm_pod("1.5", namespace="lab"), namespace="lab"))
    assert status == 200
    response = body["response"]
    assert response["allowed"] is True
    assert json.loads(response["auditAnnotations"]["would-deny"]) == [
        "container vllm: --gpu-memory-utilization 1.5 is outside (0, 1]"
    ]
    assert response["auditAnnotations"]["qos-class"] == "best-effort"
    assert response["warnings"] == ["audit: would deny: container vllm: --gpu-memory-utilization 1.5 is outside (0, 1]"]


async def test_non_blocking_warnings_come_in_enforce_mode_too(client_for: Any) -> None:
    obj = pod(container("vllm", image="vllm/vllm-openai:v0.21.0", args=["--model", "m"]))
    client = await client_for(make_state())
    _, body = await post(client, admission_review(obj))
    assert body["response"]["allowed"] is True
    assert body["response"]["warnings"] == [
        "container vllm relies on vLLM's default --gpu-memory-utilization (0.92 of the GPU); set it explicitly"
    ]


@pytest.mark.parametrize("operation", ["DELETE", "CONNECT"])
async def test_delete_and_connect_are_allowed_at_once(client_for: Any, operation: str) -> None:
    client = await client_for(make_state())
    status, body = await post(client, admission_review(None, operation=operation, old=vllm_pod("1.5")))
    assert (status, body["response"]) == (200, {"uid": "7f3c-req", "allowed": True})


async def test_subresources_are_allowed_at_once(client_for: Any) -> None:
    client = await client_for(make_state())
    status, body = await post(client, admission_review(vllm_pod("1.5"), operation="UPDATE", sub_resource="status"))
    assert (status, body["response"]["allowed"]) == (200, True)


async def test_pod_asking_for_no_gpu_is_allowed_without_a_word(client_for: Any) -> None:
    client = await client_for(make_state())
    _, body = await post(client, admission_review(pod(container("web", gpus=None))))
    assert body["response"] == {"uid": "7f3c-req", "allowed": True}


@pytest.mark.parametrize("kind", ["Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob"])
async def test_workload_templates_are_validated(client_for: Any, kind: str) -> None:
    template = {"metadata": {"labels": {"app": "x"}}, "spec": vllm_pod("1.5")["spec"]}
    spec: dict[str, Any] = {"template": template}
    if kind == "CronJob":
        spec = {"schedule": "* * * * *", "jobTemplate": {"spec": {"template": template}}}
    obj = {"apiVersion": "/".join(filter(None, SUPPORTED_KINDS[kind])), "kind": kind,
           "metadata": {"name": "w", "namespace": "default"}, "spec": spec}
    client = await client_for(make_state())
    status, body = await post(client, admission_review(obj, kind=kind))
    assert status == 200
    assert body["response"]["status"]["message"] == "container vllm: --gpu-memory-utilization 1.5 is outside (0, 1]"


async def test_update_keeps_problems_it_did_not_introduce(client_for: Any) -> None:
    old = vllm_pod("1.5")
    new = copy.deepcopy(old)
    new["metadata"]["labels"] = {"team": "a"}
    client = await client_for(make_state())
    _, body = await post(client, admission_review(new, operation="UPDATE", old=old))
    assert body["response"]["allowed"] is True


# --------------------------------------------------------------------------- bad input

BAD_REQUESTS = [
    pytest.param(b"{not json", "invalid JSON", id="malformed-json"),
    pytest.param(b"", "request body is empty", id="empty-body"),
    pytest.param(b"[1, 2]", "expected a JSON object, got an array", id="json-array"),
    pytest.param(b"\xff\xfe", "not UTF-8", id="not-utf8"),
    pytest.param(b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}', "request: Field required",
                 id="missing-request"),
    pytest.param(json.dumps(admission_review(vllm_pod()) | {"apiVersion": "admission.k8s.io/v1beta1"}).encode(),
                 "apiVersion", id="v1beta1"),
    pytest.param(json.dumps(admission_review(vllm_pod()) | {"kind": "ConversionReview"}).encode(), "kind",
                 id="wrong-review-kind"),
    pytest.param(json.dumps(admission_review(vllm_pod(), uid="")).encode(), "request.uid", id="empty-uid"),
    pytest.param(json.dumps(admission_review(vllm_pod(), operation="PATCH")).encode(), "request.operation",
                 id="unknown-operation"),
    pytest.param(json.dumps(admission_review({"kind": "ConfigMap", "metadata": {}}, kind="ConfigMap")).encode(),
                 "vramguard does not validate core/v1 ConfigMap", id="unsupported-object-kind"),
    pytest.param(json.dumps(admission_review(None)).encode(), "request.object is missing for CREATE",
                 id="missing-object"),
    pytest.param(json.dumps(admission_review(vllm_pod() | {"kind": "Service"})).encode(),
                 "request.object is a 'Service', but request.kind is Pod", id="object-kind-mismatch"),
    pytest.param(json.dumps(admission_review(vllm_pod(namespace=""), namespace="")).encode(),
                 "request.namespace is missing", id="missing-namespace"),
    pytest.param(json.dumps(admission_review(vllm_pod() | {"metadata": "x"})).encode(),
                 "request.object.metadata is not an object", id="metadata-not-an-object"),
    pytest.param(json.dumps(admission_review("a pod")).encode(), "request.object", id="object-not-an-object"),
]


@pytest.mark.parametrize(("body", "fragment"), BAD_REQUESTS)
async def test_malformed_requests_are_a_clear_400(client_for: Any, body: bytes, fragment: str) -> None:
    client = await client_for(make_state())
    response = await client.post("/validate", data=body, headers={"Content-Type": "application/json"})
    assert response.status == 400
    error = (await response.json())["error"]
    assert fragment in error


async def test_padded_review_is_read_and_judged_not_refused_with_413(client_for: Any) -> None:
    # An UPDATE carries the object twice: two 1.1 MB env vars must still reach the rules, or the
    # API server applies the failure policy (Ignore would admit the pod unchecked).
    obj = vllm_pod("1.5")
    obj["spec"]["containers"][0]["env"] = [{"name": "PAD", "value": "x" * 1_100_000}]
    client = await client_for(make_state())
    status, body = await post(client, admission_review(obj, operation="UPDATE", old=obj))
    assert status == 200
    assert body["response"]["allowed"] is True  # the old object had the problem too
    status, body = await post(client, admission_review(obj))
    assert (status, body["response"]["allowed"]) == (200, False)
    assert "--gpu-memory-utilization 1.5 is outside (0, 1]" in body["response"]["status"]["message"]


async def test_every_review_the_api_server_can_send_is_read_and_nothing_larger(client_for: Any) -> None:
    # The largest pod etcd stores (--max-request-bytes, 1.5 MiB), all '<': Go's encoding/json writes each
    # as \u003c, and an UPDATE carries it twice. Such a review is judged, not turned away with a 413
    # (which the failure policy makes an unreviewed admission where the namespace does not enforce).
    obj = vllm_pod("1.5")
    obj["metadata"]["annotations"] = {"filler": "<" * (1_572_864 - 2_000)}
    body = json.dumps(admission_review(obj, operation="UPDATE", old=vllm_pod("0.5") | {
        "metadata": obj["metadata"]})).replace("<", "\\u003c").encode()
    assert len(body) > 2 * (8 << 20)  # twice the old limit
    client = await client_for(make_state())
    response = await client.post("/validate", data=body, headers={"Content-Type": "application/json"})
    assert response.status == 200
    answer = (await response.json())["response"]
    assert answer["allowed"] is False and "--gpu-memory-utilization 1.5 is outside" in answer["status"]["message"]
    obj["metadata"]["annotations"] = {"filler": "x" * BODY_LIMIT}
    response = await client.post("/validate", data=json.dumps(admission_review(obj)).encode(),
                                 headers={"Content-Type": "application/json"})
    assert response.status == 413
    assert f"exceeds the limit of {BODY_LIMIT} bytes" in (await response.json())["error"]
    assert BODY_LIMIT == 19 << 20


async def test_junk_inside_the_object_is_never_a_server_error(client_for: Any) -> None:
    junk = {"kind": "Pod", "metadata": {"name": 5, "labels": [1], "annotations": {"vramguard.io/vram": 7}},
            "spec": {"containers": [None, 3, {"name": ["x"], "resources": {"limits": {"nvidia.com/gpu": {}}},
                                             "args": [None, 1.5], "env": "oops"}], "nodeName": 12}}
    client = await client_for(make_state())
    status, body = await post(client, admission_review(junk))
    assert status == 200
    assert body["response"]["uid"] == "7f3c-req"


async def test_wrong_method_and_path(client_for: Any) -> None:
    client = await client_for(make_state())
    assert (await client.get("/validate")).status == 405
    assert (await client.get("/mutate")).status == 405
    assert (await client.post("/convert", json={})).status == 404


# --------------------------------------------------------------------------- cluster state


async def test_quota_holds_across_back_to_back_pods(client_for: Any) -> None:
    # 0.49375 of an 80 GiB GPU is 39.5 GiB, and vLLM's CUDA context 0.5 GiB: four pods fill the
    # 160 GiB quota exactly, the fifth is refused even though the pod watch has not shown any of them yet.
    client = await client_for(make_state(namespaces={"team-a": {ENFORCE_LABEL: "enforce"}}))
    answers = []
    for i in range(5):
        obj = vllm_pod("0.49375", name=f"p{i}", namespace="team-a", uid=f"uid-{i}")
        _, body = await post(client, admission_review(obj, namespace="team-a", uid=f"req-{i}"))
        answers.append(body["response"]["allowed"])
    assert answers == [True, True, True, True, False]
    _, body = await post(client, admission_review(vllm_pod("0.49375", namespace="team-a", uid="uid-9"),
                                                  namespace="team-a"))
    assert body["response"]["status"]["message"] == (
        "namespace team-a would hold 200Gi of its 160Gi VRAM quota (this pod 40Gi, 4 other pod(s) 160Gi)"
    )


async def test_quota_counts_the_pods_the_watch_shows(client_for: Any) -> None:
    running = [vllm_pod("0.5", name=f"r{i}", namespace="team-a", uid=f"run-{i}", node="gpu-1") for i in range(3)]
    done = vllm_pod("0.5", name="done", namespace="team-a", uid="done")
    done["status"] = {"phase": "Succeeded"}
    other = vllm_pod("0.9", name="o", namespace="team-b", uid="other")
    state = make_state(namespaces={"team-a": {ENFORCE_LABEL: "enforce"}}, pods=(*running, done, other))
    client = await client_for(state)
    _, body = await post(client, admission_review(vllm_pod("0.6", namespace="team-a", uid="new"),
                                                  namespace="team-a"))
    # Only the three running pods of team-a count, each 0.5 of an 80 GiB GPU and its CUDA context.
    others, this = 3 * (40 * GiB + CUDA_CONTEXT), 48 * GiB + CUDA_CONTEXT
    assert body["response"]["status"]["message"] == (
        f"namespace team-a would hold {quantity_text(others + this)} of its 160Gi VRAM quota "
        f"(this pod {quantity_text(this)}, 3 other pod(s) {quantity_text(others)})"
    )
    state.cluster.pods.delete(running[0])
    _, body = await post(client, admission_review(vllm_pod("0.6", namespace="team-a", uid="new"),
                                                  namespace="team-a"))
    assert body["response"]["allowed"] is True


async def test_pod_update_does_not_count_itself_twice(client_for: Any) -> None:
    running = [vllm_pod("0.5", name=f"r{i}", namespace="team-a", uid=f"run-{i}", node="gpu-1") for i in range(4)]
    client = await client_for(make_state(namespaces={"team-a": {ENFORCE_LABEL: "enforce"}}, pods=tuple(running)))
    updated = copy.deepcopy(running[0])
    updated["metadata"]["labels"] = {"x": "y"}
    _, body = await post(client, admission_review(updated, operation="UPDATE", old=running[0], namespace="team-a"))
    assert body["response"]["allowed"] is True


async def test_dry_run_holds_no_quota(client_for: Any) -> None:
    state = make_state(namespaces={"team-a": {ENFORCE_LABEL: "enforce"}})
    client = await client_for(state)
    for i in range(5):
        _, body = await post(client, admission_review(vllm_pod("0.5", namespace="team-a", uid=f"u{i}"),
                                                      namespace="team-a", dry_run=True))
        assert body["response"]["allowed"] is True
    assert state.cluster.pending_admissions() == 0


async def test_namespace_the_watch_has_not_shown_is_looked_up(client_for: Any) -> None:
    asked: list[str] = []

    async def lookup(name: str) -> Mapping[str, Any] | None:
        asked.append(name)
        return {"metadata": {"name": name, "labels": {ENFORCE_LABEL: "warn"}}}

    state = make_state(lookup=lookup)
    client = await client_for(state)
    for _ in range(2):
        _, body = await post(client, admission_review(vllm_pod("1.5", namespace="fresh"), namespace="fresh"))
        assert body["response"]["allowed"] is True
        assert body["response"]["warnings"][0].startswith("would deny: ")
    assert asked == ["fresh"]  # cached in the store after the first lookup


@pytest.mark.parametrize("outcome", ["error", "timeout", "missing"])
async def test_namespace_lookup_failure_falls_back_to_the_default_mode(
    client_for: Any, monkeypatch: pytest.MonkeyPatch, outcome: str
) -> None:
    monkeypatch.setattr("webhook.app.NAMESPACE_LOOKUP_TIMEOUT", 0.05)

    async def lookup(name: str) -> Mapping[str, Any] | None:
        if outcome == "error":
            raise OSError("connection refused")
        if outcome == "timeout":
            await asyncio.sleep(1)
        return None

    client = await client_for(make_state(lookup=lookup))  # the policy's default is enforce
    _, body = await post(client, admission_review(vllm_pod("1.5", namespace="ghost"), namespace="ghost"))
    assert body["response"]["allowed"] is False


async def test_bound_pod_is_sized_on_its_node(client_for: Any) -> None:
    # 0.4875 of the bound node's 40 GiB GPU is 19.5 GiB, 20 GiB with vLLM's CUDA context; unbound it
    # would count 0.4875 of 80 GiB (the largest GPU) and the context.
    small = gpu_node("small", memory_mib=40960)
    state = make_state(namespaces={"team-a": {ENFORCE_LABEL: "enforce"}}, nodes=(small,),
                       pods=tuple(vllm_pod("0.4875", name=f"r{i}", namespace="team-a", uid=f"r{i}", node="small")
                                  for i in range(7)))
    client = await client_for(state)
    # The kubelet's mirror pods (system:nodes) are allow-listed past the node's ledger.
    _, body = await post(client, admission_review(vllm_pod("0.4875", namespace="team-a", uid="n", node="small"),
                                                  namespace="team-a", groups=("system:nodes",)))
    assert body["response"]["allowed"] is True  # 8 x 20 GiB = 160 GiB
    _, body = await post(client, admission_review(vllm_pod("0.4875", namespace="team-a", uid="m"),
                                                  namespace="team-a"))
    unbound = 39 * GiB + CUDA_CONTEXT
    assert body["response"]["status"]["message"].startswith(
        f"namespace team-a would hold {quantity_text(160 * GiB + unbound)} of its 160Gi"
    )


# --------------------------------------------------------------------------- direct placement


G1_BUDGET = 80 * GiB * 97 // 100
"""One time-sliced (shared) 80 GiB GPU: its budget keeps 3% free."""
G1_POD = int(Fraction(9, 10) * 80 * GiB) + CUDA_CONTEXT
"""A 0.9 vLLM pod and its CUDA context: one fits the budget, two do not."""
DIRECT = {
    "fits": ("enforce", ("system:authenticated",), 0, True, None),
    "over-budget-denied": ("enforce", ("system:authenticated",), 1, False,
                           "spec.nodeName g1 places the pod past the scheduler and it does not fit there: "
                           f"GPU 0 (NVIDIA A100 SXM4 80GB): {format_bytes(G1_BUDGET - G1_POD)} of "
                           f"{format_bytes(G1_BUDGET)} VRAM budget free, pod needs {format_bytes(G1_POD)} per GPU"),
    "over-budget-warned": ("warn", ("system:authenticated",), 1, True, None),
    "allow-listed-group": ("enforce", ("system:nodes",), 1, True, None),
}


@pytest.mark.parametrize(("mode", "groups", "bound", "allowed", "message"), DIRECT.values(), ids=DIRECT.keys())
async def test_pod_created_on_a_node_must_fit_its_ledger(
    client_for: Any, mode: str, groups: tuple[str, ...], bound: int, allowed: bool, message: str | None
) -> None:
    # One time-sliced 80 GiB GPU (a 77.6 GiB budget): one 0.9 pod fits, a second does not.
    state = make_state(namespaces={"default": {ENFORCE_LABEL: mode}}, nodes=(gpu_node("g1", gpus=1),),
                       pods=tuple(vllm_pod("0.9", name=f"b{i}", uid=f"b{i}", node="g1") for i in range(bound)))
    client = await client_for(state)
    _, body = await post(client, admission_review(vllm_pod("0.9", uid="new", node="g1"), groups=groups))
    assert body["response"]["allowed"] is allowed
    if message is not None:
        assert body["response"]["status"]["message"] == message
    if mode == "warn":
        assert any(w.startswith("would deny: spec.nodeName g1 places the pod") for w in body["response"]["warnings"])


async def test_bound_pods_of_the_watch_fill_the_ledger_and_leave_it(client_for: Any) -> None:
    state = make_state(nodes=(gpu_node("g1", gpus=1),))
    client = await client_for(state)
    pods = state.cluster.pods
    pods.upsert(vllm_pod("0.9", name="b0", uid="b0", node="g1"))
    _, body = await post(client, admission_review(vllm_pod("0.9", uid="new", node="g1")))
    assert body["response"]["allowed"] is False
    pods.delete(vllm_pod("0.9", name="b0", uid="b0", node="g1"))
    _, body = await post(client, admission_review(vllm_pod("0.9", uid="new", node="g1")))
    assert body["response"]["allowed"] is True


async def test_quota_counts_live_env_only_engines_as_whole_gpus_where_the_class_distrusts_them(
    client_for: Any,
) -> None:
    policy = Policy.from_yaml(POLICY_YAML.replace(
        "guaranteed: {sharing: [none, mig], allow_implicit_defaults: false}",
        "guaranteed: {sharing: [none, mig], allow_implicit_defaults: false, trust_env_only_engines: false}"))
    jax = pod(container("jax", env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.01"}))
    live = []
    for i, qos in enumerate(("guaranteed", "best-effort")):
        obj = copy.deepcopy(jax)
        obj["metadata"].update(name=f"j{i}", namespace="team-a", uid=f"j{i}", labels={QOS_CLASS_LABEL: qos})
        live.append(obj)
    state = make_state(policy, namespaces={"team-a": {ENFORCE_LABEL: "enforce"}}, pods=tuple(live))
    # gpu-1 offers 80 GiB GPUs: the distrusted pod holds all 80 GiB, the trusted one 1% of it.
    usage = state.cluster.usage("team-a")
    # The trusted one holds its share and its CUDA context.
    assert usage.bytes == 80 * GiB + int(Fraction(1, 100) * 80 * GiB) + CUDA_CONTEXT
    assert usage.pods == 2


async def test_gpus_over_budget_are_a_metric(client_for: Any) -> None:
    # Two 0.9 pods placed on a one-GPU node past the webhook (an allow-listed requester, or a race).
    state = make_state(nodes=(gpu_node("g1", gpus=1),),
                       pods=tuple(vllm_pod("0.9", name=f"b{i}", uid=f"b{i}", node="g1") for i in range(2)))
    client = await client_for(state)
    text = await (await client.get("/metrics")).text()
    assert "vramguard_webhook_gpus_over_budget 1.0" in text
    state.cluster.pods.delete(vllm_pod("0.9", name="b1", uid="b1", node="g1"))
    text = await (await client.get("/metrics")).text()
    assert "vramguard_webhook_gpus_over_budget 0.0" in text


async def test_scheduler_not_wired_to_vramguard_is_refused(client_for: Any) -> None:
    policy = Policy.from_yaml(
        POLICY_YAML.replace("schedulers: [vramguard, default-scheduler]", "schedulers: [vramguard]")
    )
    client = await client_for(make_state(policy))
    _, body = await post(client, admission_review(vllm_pod()))
    assert body["response"]["status"]["message"] == (
        "spec.schedulerName default-scheduler does not call vramguard, so nothing would check this pod's GPU "
        "memory; set spec.schedulerName: vramguard (policy schedulers: vramguard); the mutating webhook did "
        "not route it (is it running?)"
    )
    _, body = await post(client, admission_review(vllm_pod(schedulerName="vramguard")))
    assert body["response"]["allowed"] is True


async def test_user_info_of_the_wrong_type_is_a_400(client_for: Any) -> None:
    review = admission_review(vllm_pod())
    review["request"]["userInfo"] = {"username": ["x"], "groups": "system:masters"}
    status, body = await post(await client_for(make_state()), review)
    assert status == 400 and "userInfo" in body["error"]


# --------------------------------------------------------------------------- probes, metrics, policy


async def test_not_ready_until_the_caches_are_synced(client_for: Any) -> None:
    synced = False
    client = await client_for(make_state(), Readiness({"informers-synced": lambda: synced}))
    response = await client.get("/readyz")
    assert response.status == 503
    assert (await response.json())["failing"] == ["informers-synced"]
    synced = True
    assert (await client.get("/readyz")).status == 200


async def test_review_counter_by_kind_operation_and_result(client_for: Any) -> None:
    client = await client_for(make_state(namespaces={"default": {ENFORCE_LABEL: "enforce"},
                                                     "dev": {ENFORCE_LABEL: "warn"}}))
    await post(client, admission_review(vllm_pod("1.5")))
    await post(client, admission_review(vllm_pod("1.5", namespace="dev"), namespace="dev"))
    await post(client, admission_review(vllm_pod()))
    await post(client, admission_review(pod(container("web", gpus=None))))
    await post(client, admission_review(None, operation="DELETE"))
    metrics = await (await client.get("/metrics")).text()
    for line in (
        'vramguard_webhook_reviews_total{kind="Pod",operation="CREATE",result="denied"} 1.0',
        'vramguard_webhook_reviews_total{kind="Pod",operation="CREATE",result="warned"} 1.0',
        'vramguard_webhook_reviews_total{kind="Pod",operation="CREATE",result="allowed"} 1.0',
        'vramguard_webhook_reviews_total{kind="Pod",operation="CREATE",result="skipped"} 1.0',
        'vramguard_webhook_reviews_total{kind="Pod",operation="DELETE",result="skipped"} 1.0',
        'vramguard_webhook_http_request_duration_seconds_count{code="200",route="/validate"} 5.0',
    ):
        assert line in metrics


async def test_policy_file_changes_apply_without_a_restart(client_for: Any, tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY_YAML)
    source = PolicySource.from_file(PolicyFile(path))
    state = WebhookState(source)
    state.cluster.nodes.replace([gpu_node("gpu-1")])
    client = await client_for(state)
    _, body = await post(client, admission_review(vllm_pod("1.5")))
    assert body["response"]["allowed"] is False  # enforcement: enforce
    path.write_text(POLICY_YAML.replace("enforcement: enforce", "enforcement: audit"))
    assert state.refresh_policy()
    assert state.cluster.policy is source.policy  # the ledger's budgets follow the new margins
    _, body = await post(client, admission_review(vllm_pod("1.5")))
    assert body["response"]["allowed"] is True
    path.write_text("classes: [broken")
    assert not source.refresh()  # the previous policy stays in force
    assert source.policy.enforcement == "audit"


def test_fixed_policy_never_refreshes() -> None:
    assert not PolicySource(default_policy()).refresh()
