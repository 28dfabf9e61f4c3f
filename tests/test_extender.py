"""The extender in-process: the cluster state, the three verbs and the wire format.

The API server is faked at the HTTP-client boundary (``FakeKube``); the end-to-end tests in
``e2e/`` run the same code against a real kube-apiserver and kube-scheduler.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from extender.app import NOT_SYNCED, build_app
from extender.verbs import Verbs
from service.http import Readiness
from service.kube import ApiError
from tests.podspecs import container
from vramguard.cluster import PLACEMENT_ANNOTATION, ClusterState, slim_node, slim_pod
from vramguard.policy import default_policy

H100_MIB = 81559


def gpu_node(name: str, gpus: int = 1, replicas: int = 4, memory_mib: int = H100_MIB,
             product: str = "NVIDIA-H100-80GB-HBM3", sharing: str = "time-slicing") -> dict[str, Any]:
    """A Node as the device plugin and GPU Feature Discovery present it."""
    labels = {
        "nvidia.com/gpu.count": str(gpus),
        "nvidia.com/gpu.memory": str(memory_mib),
        "nvidia.com/gpu.product": product + ("-SHARED" if sharing != "none" else ""),
        "nvidia.com/gpu.replicas": str(replicas),
        "nvidia.com/gpu.sharing-strategy": sharing,
    }
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": str(gpus * replicas)}
    return {"metadata": {"name": name, "labels": labels},
            "status": {"capacity": capacity, "allocatable": capacity}}


def vllm_pod(name: str, utilization: str, node: str | None = None, namespace: str = "default",
             gpus: int = 1, labels: dict[str, str] | None = None) -> dict[str, Any]:
    args = ["--model", "m", "--gpu-memory-utilization", utilization]
    if gpus > 1:
        args += ["-tp", str(gpus)]
    spec: dict[str, Any] = {"containers": [container(name="vllm", image="vllm/vllm-openai:v0.21.0",
                                                     args=args, gpus=gpus)],
                            "schedulerName": "vramguard"}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "labels": labels or {},
                         "resourceVersion": "1"},
            "spec": spec, "status": {"phase": "Running" if node else "Pending"}}


class FakeKube:
    """Records the calls bind makes; a bound pod is then fed back as the watch would."""

    def __init__(self, state: ClusterState, pods: dict[str, dict[str, Any]]) -> None:
        self.state = state
        self.pods = pods
        self.calls: list[tuple[str, str, Any]] = []
        self.fail_binding: ApiError | None = None

    async def get(self, path: str, params: Any = None) -> dict[str, Any]:
        self.calls.append(("GET", path, None))
        name = path.rsplit("/", 1)[-1]
        if name not in self.pods:
            raise ApiError(404, "NotFound", f"pods {name!r} not found")
        return self.pods[name]

    async def create(self, path: str, body: Any) -> dict[str, Any]:
        self.calls.append(("POST", path, body))
        await asyncio.sleep(0)
        if self.fail_binding is not None:
            raise self.fail_binding
        pod = self.pods[body["metadata"]["name"]]
        pod["spec"]["nodeName"] = body["target"]["name"]
        # As the API server does: the Binding's annotations land on the pod.
        pod["metadata"].setdefault("annotations", {}).update(body["metadata"].get("annotations", {}))
        return {}

    def deliver(self, name: str) -> None:
        """The watch event that follows a successful binding."""
        self.state.pods.upsert(self.pods[name])


def make(nodes: list[dict[str, Any]], pods: list[dict[str, Any]] = ()) -> tuple[ClusterState, Verbs, FakeKube]:
    state = ClusterState(default_policy())
    state.nodes.replace(nodes)
    state.namespaces.replace([{"metadata": {"name": "default"}}])
    state.pods.replace([p for p in pods if p["spec"].get("nodeName")])
    fake = FakeKube(state, {p["metadata"]["name"]: p for p in pods})
    return state, Verbs(state, fake), fake  # type: ignore[arg-type]


async def schedule(verbs: Verbs, fake: FakeKube, pod: dict[str, Any], nodes: list[str]) -> str:
    """What kube-scheduler does with the extender: filter, then bind to the first passing node."""
    fake.pods[pod["metadata"]["name"]] = pod
    outcome = await verbs.filter(pod, nodes)
    if not outcome.passing:
        return "pending: " + json.dumps(outcome.failed | outcome.unresolvable)
    node = outcome.passing[0]
    error = await verbs.bind(pod["metadata"]["name"], "default", pod["metadata"]["uid"], node)
    if error:
        return "bind error: " + error
    fake.deliver(pod["metadata"]["name"])
    return node


async def test_seed_four_pods_at_020_all_fit() -> None:
    state, verbs, fake = make([gpu_node("h100")])
    results = [await schedule(verbs, fake, vllm_pod(f"p{i}", "0.20"), ["h100"]) for i in range(4)]
    assert results == ["h100"] * 4
    assert state.ledger.check_invariants() == []


async def test_seed_fourth_pod_at_030_stays_pending_with_a_vram_reason() -> None:
    state, verbs, fake = make([gpu_node("h100")])
    results = [await schedule(verbs, fake, vllm_pod(f"p{i}", "0.30"), ["h100"]) for i in range(4)]
    assert results[:3] == ["h100"] * 3
    assert results[3].startswith("pending: ")
    message = json.loads(results[3].removeprefix("pending: "))["h100"]
    assert "GPU 0 (NVIDIA H100 80GB HBM3)" in message and "VRAM budget free" in message
    assert "pod needs 23.9 GiB per GPU" in message
    assert state.ledger.check_invariants() == []


async def test_bind_records_the_placement_and_creates_the_binding() -> None:
    _, verbs, fake = make([gpu_node("h100")])
    assert await schedule(verbs, fake, vllm_pod("p", "0.2"), ["h100"]) == "h100"
    methods = [(m, path) for m, path, _ in fake.calls]
    # bind trusts only the API server: it reads the pod first, whatever filter saw.
    assert methods == [("GET", "/api/v1/namespaces/default/pods/p"), ("POST", "/api/v1/namespaces/default/pods/p/binding")]
    placement = json.loads(fake.pods["p"]["metadata"]["annotations"][PLACEMENT_ANNOTATION])
    assert placement == {"node": "h100", "containers": {"vllm": ["0"]}}
    binding = fake.calls[1][2]
    assert binding["target"] == {"apiVersion": "v1", "kind": "Node", "name": "h100"}
    assert binding["metadata"]["uid"] == "uid-p"


async def test_bind_rechecks_and_refuses_when_filter_was_stale() -> None:
    state, verbs, fake = make([gpu_node("h100")])
    pods = [vllm_pod(f"p{i}", "0.45") for i in range(3)]
    for pod in pods:  # the scheduler may filter many pods before it binds any
        fake.pods[pod["metadata"]["name"]] = pod
        assert (await verbs.filter(pod, ["h100"])).passing == ["h100"]
    errors = [await verbs.bind(p["metadata"]["name"], "default", p["metadata"]["uid"], "h100") for p in pods]
    assert errors[:2] == ["", ""]
    assert "VRAM budget free" in errors[2]
    assert state.ledger.check_invariants() == []


async def test_failed_binding_releases_the_reservation() -> None:
    state, verbs, fake = make([gpu_node("h100")])
    fake.fail_binding = ApiError(409, "Conflict", "pod p is already assigned to node other")
    pod = vllm_pod("p", "0.6")
    fake.pods["p"] = pod
    error = await verbs.bind("p", "default", "uid-p", "h100")
    assert "already assigned" in error
    assert state.ledger.pod_count() == 0
    assert (await verbs.filter(vllm_pod("q", "0.6"), ["h100"])).passing == ["h100"]


async def test_bind_without_filter_reads_the_pod() -> None:
    _, verbs, fake = make([gpu_node("h100")], [vllm_pod("p", "0.2")])
    assert await verbs.bind("p", "default", "uid-p", "h100") == ""
    assert fake.calls[0][0] == "GET"
    assert await verbs.bind("gone", "default", "uid-gone", "h100") != ""


async def test_bind_is_idempotent_once_bound() -> None:
    _, verbs, fake = make([gpu_node("h100")])
    assert await schedule(verbs, fake, vllm_pod("p", "0.2"), ["h100"]) == "h100"
    calls = len(fake.calls)
    assert await verbs.bind("p", "default", "uid-p", "h100") == ""
    assert len(fake.calls) == calls


async def test_relist_keeps_in_flight_reservations() -> None:
    state, verbs, fake = make([gpu_node("h100")])
    pod = vllm_pod("p", "0.8")
    fake.pods["p"] = pod
    await verbs.filter(pod, ["h100"])
    gate = asyncio.Event()
    original = fake.create

    async def slow_create(path: str, body: Any) -> dict[str, Any]:
        await gate.wait()
        return await original(path, body)

    fake.create = slow_create  # type: ignore[method-assign]
    task = asyncio.create_task(verbs.bind("p", "default", "uid-p", "h100"))
    await asyncio.sleep(0.01)
    state.pods.replace([])  # a re-list that does not show the pod bound yet
    assert (await verbs.filter(vllm_pod("q", "0.2"), ["h100"])).failed, "the in-flight 0.8 still counts"
    gate.set()
    assert await task == ""


async def test_terminal_and_deleted_pods_release() -> None:
    bound = vllm_pod("p", "0.8", node="h100")
    state, verbs, _ = make([gpu_node("h100")], [bound])
    assert (await verbs.filter(vllm_pod("q", "0.2"), ["h100"])).failed
    finished = json.loads(json.dumps(bound))
    finished["status"]["phase"] = "Succeeded"
    state.pods.upsert(finished)
    assert (await verbs.filter(vllm_pod("q", "0.2"), ["h100"])).passing == ["h100"]
    state.pods.upsert(bound)
    state.pods.delete(bound)
    assert (await verbs.filter(vllm_pod("q", "0.2"), ["h100"])).passing == ["h100"]


async def test_pods_bound_by_others_count_and_unknown_takes_a_whole_gpu() -> None:
    foreign = {"metadata": {"name": "f", "namespace": "default", "uid": "uid-f"},
               "spec": {"nodeName": "h100", "containers": [container(name="x", command=["python", "x.py"])]},
               "status": {"phase": "Running"}}
    _, verbs, _ = make([gpu_node("h100")], [foreign])
    outcome = await verbs.filter(vllm_pod("q", "0.05"), ["h100"])
    assert outcome.failed and "0.0 GiB of 71.7 GiB" in outcome.failed["h100"]


async def test_multi_gpu_node_is_accounted_whatever_the_plugin_picks() -> None:
    state, verbs, fake = make([gpu_node("quad", gpus=4, replicas=4)])
    results = [await schedule(verbs, fake, vllm_pod(f"p{i}", "0.30"), ["quad"]) for i in range(5)]
    # The plugin could put any four replicas on one GPU: at most three 0.30 pods are safe until
    # the agent reports where each really runs.
    assert results[:3] == ["quad"] * 3
    assert results[3].startswith("pending") and "whose GPU is not known yet" in results[3]
    assert state.ledger.check_invariants() == []


async def test_class_steering_is_unresolvable_on_forbidden_sharing() -> None:
    _, verbs, _ = make([gpu_node("ts"), gpu_node("whole", replicas=1, sharing="none")])
    guaranteed = vllm_pod("g", "0.5", labels={"vramguard.io/qos-class": "guaranteed"})
    outcome = await verbs.filter(guaranteed, ["ts", "whole"])
    assert outcome.passing == ["whole"]
    assert "class guaranteed does not allow time-slicing" in outcome.unresolvable["ts"]


async def test_heterogeneous_gpus() -> None:
    _, verbs, fake = make([gpu_node("h100"), gpu_node("h200", memory_mib=143771, product="NVIDIA-H200")])
    # 0.5 of an H200 is 70 GiB, 0.5 of an H100 40 GiB: a fraction is of the GPU it lands on.
    assert await schedule(verbs, fake, vllm_pod("a", "0.5"), ["h100", "h200"]) == "h100"
    assert await schedule(verbs, fake, vllm_pod("b", "0.5"), ["h100", "h200"]) == "h200"
    assert (await schedule(verbs, fake, vllm_pod("c", "0.5"), ["h100", "h200"])).startswith("pending")


async def test_node_heartbeats_keep_cached_verdicts() -> None:
    node = gpu_node("h100")
    state, verbs, _ = make([node])
    await verbs.filter(vllm_pod("q", "0.2"), ["h100"])
    generation = state.ledger.generation("h100")
    heartbeat = json.loads(json.dumps(node))
    heartbeat["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    state.nodes.upsert(heartbeat)
    assert state.ledger.generation("h100") == generation


# -- over HTTP -------------------------------------------------------------------------------------

@pytest.fixture
async def client() -> TestClient:  # type: ignore[type-arg]
    _, verbs, _ = make([gpu_node("h100"), gpu_node("h200", memory_mib=143771, product="NVIDIA-H200")])
    synced = asyncio.Event()
    synced.set()
    app = build_app(verbs, synced, Readiness(), CollectorRegistry())
    async with TestClient(TestServer(app)) as test_client:
        yield test_client


async def test_filter_wire_format_node_names(client: TestClient) -> None:  # type: ignore[type-arg]
    response = await client.post("/filter", json={"Pod": vllm_pod("p", "0.6"), "Nodes": None,
                                                  "NodeNames": ["h100", "h200", "cpu-1"]})
    assert response.status == 200
    body = await response.json()
    assert body["NodeNames"] == ["h100", "h200"]
    assert body["Nodes"] is None
    assert body["Error"] == ""
    assert body["FailedNodes"] == {"cpu-1": "node cpu-1 is not known to vramguard yet"}


async def test_filter_wire_format_full_nodes(client: TestClient) -> None:  # type: ignore[type-arg]
    nodes = [gpu_node("h100"), gpu_node("h200", memory_mib=143771)]
    response = await client.post("/filter", json={"Pod": vllm_pod("p", "0.6"), "Nodes": {"items": nodes}})
    body = await response.json()
    assert [n["metadata"]["name"] for n in body["Nodes"]["items"]] == ["h100", "h200"]
    assert body["NodeNames"] == ["h100", "h200"]


async def test_filter_nothing_passes_gives_empty_list_not_null(client: TestClient) -> None:  # type: ignore[type-arg]
    response = await client.post("/filter", json={"Pod": vllm_pod("p", "0.6", gpus=2), "NodeNames": ["h100"]})
    body = await response.json()
    assert body["NodeNames"] == []
    assert "h100" in body["FailedNodes"] or "h100" in body["FailedAndUnresolvableNodes"]


async def test_prioritize_wire_format(client: TestClient) -> None:  # type: ignore[type-arg]
    response = await client.post("/prioritize", json={"Pod": vllm_pod("p", "0.3"), "NodeNames": ["h100", "h200"]})
    body = await response.json()
    assert [entry["Host"] for entry in body] == ["h100", "h200"]
    assert all(0 <= entry["Score"] <= 10 for entry in body)


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/filter", b"not json", 400),
        ("/filter", b"{}", 400),
        ("/filter", b'{"Pod": 3}', 400),
        ("/filter", b"[1, 2]", 400),
        ("/bind", b'{"PodName": "p"}', 400),
        ("/prioritize", b"\xff\xfe", 400),
        ("/filter", b'{"Pod": {}, "NodeNames": ["' + b"x" * (2 << 20) + b'"]}', 413),
    ],
    ids=["junk", "empty-object", "pod-not-object", "array", "bind-missing-fields", "not-utf8", "too-large"],
)
async def test_bad_input_is_a_clear_4xx(client: TestClient, path: str, body: bytes, status: int) -> None:  # type: ignore[type-arg]
    response = await client.post(path, data=body, headers={"Content-Type": "application/json"})
    assert response.status == status
    assert "error" in await response.json()


async def test_not_synced_answers_with_error() -> None:
    _, verbs, _ = make([gpu_node("h100")])
    readiness = Readiness()
    app = build_app(verbs, asyncio.Event(), readiness, CollectorRegistry())
    async with TestClient(TestServer(app)) as test_client:
        response = await test_client.post("/filter", json={"Pod": vllm_pod("p", "0.2"), "NodeNames": ["h100"]})
        assert (await response.json())["Error"] == NOT_SYNCED
        assert (await test_client.get("/readyz")).status == 503


async def test_metrics_show_per_gpu_budget(client: TestClient) -> None:  # type: ignore[type-arg]
    text = await (await client.get("/metrics")).text()
    assert 'vramguard_gpu_budget_bytes{gpu="0",node="h100"' in text


def test_namespace_bytes_for_chargeback() -> None:
    state, _, _ = make([gpu_node("h100"), gpu_node("quad", gpus=4)],
                       [vllm_pod("a", "0.25", node="h100", namespace="team-a"),
                        vllm_pod("b", "0.25", node="quad", namespace="team-a"),
                        vllm_pod("c", "0.5", node="h100", namespace="team-b")])
    quarter = (H100_MIB << 20) // 4
    assert state.ledger.namespace_bytes() == {"team-a": 2 * quarter, "team-b": 2 * quarter}


def test_slim_objects_keep_what_the_extender_reads() -> None:
    pod = vllm_pod("p", "0.3", node="h100")
    pod["metadata"]["managedFields"] = [{"manager": "kubectl"}] * 50
    pod["metadata"]["annotations"] = {"vramguard.io/vram": "0.5", "kubectl.kubernetes.io/last-applied": "x" * 1000}
    pod["spec"]["volumes"] = [{"name": "v"}]
    slim = slim_pod(pod)
    assert "managedFields" not in slim["metadata"] and "volumes" not in slim["spec"]
    assert slim["metadata"]["annotations"] == {"vramguard.io/vram": "0.5"}
    state = ClusterState(default_policy())
    state.nodes.replace([slim_node(gpu_node("h100"))])
    state.pods.replace([slim])
    full = ClusterState(default_policy())
    full.nodes.replace([gpu_node("h100")])
    full.pods.replace([pod])
    assert state.ledger.usage("h100") == full.ledger.usage("h100")
