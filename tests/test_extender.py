"""The extender in-process: the cluster state, the three verbs and the wire format.

The API server is faked at the HTTP-client boundary (``FakeKube``); the end-to-end tests in
``e2e/`` run the same code against a real kube-apiserver and kube-scheduler.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections.abc import AsyncIterator
from fractions import Fraction
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from extender import metrics
from extender.app import LEDGER_EXPOSITION_KEY, NOT_SYNCED, build_app
from extender.growth import GrowthReporter
from extender.metrics import LedgerExposition, render_ledger_now
from extender.verbs import NOT_LEADER, Verbs
from extender.wire import MAX_CONTAINER_DEPTH
from tests.builders import H100_MIB, gpu_node, vllm_pod
from tests.podspecs import container
from tests.served_extender import ServedClient, served
from vramguard.cluster import ClusterState, slim_node, slim_pod
from vramguard.codecs import PLACEMENT_ANNOTATION
from vramguard.io.http import Readiness
from vramguard.io.kube import ApiError
from vramguard.policy import default_policy
from vramguard.quantity import MiB, format_bytes

H100_BYTES = H100_MIB * MiB
CUDA_CONTEXT = 512 * MiB
"""What vLLM's process holds beside its share on each GPU (the builders' vLLM, v0.21.0, keeps its
CUDA graphs inside the share)."""


def vllm_bytes(utilization: str) -> int:
    """What a one-GPU vLLM pod of the builders holds on an H100: its share and its CUDA context."""
    return int(Fraction(utilization) * H100_BYTES) + CUDA_CONTEXT


class FakeKube:
    """Records the calls bind makes; a bound pod is then fed back as the watch would."""

    def __init__(self, state: ClusterState, pods: dict[str, dict[str, Any]]) -> None:
        self.state = state
        self.pods = pods
        self.calls: list[tuple[str, str, Any]] = []
        self.fail_binding: ApiError | None = None
        self.reads: list[Any] = []
        """The query of each GET (``{"resourceVersion": "0"}``: from the watch cache)."""
        self.watch_cache: dict[str, dict[str, Any] | None] = {}
        """What the watch cache answers instead of :attr:`pods`, where it lags (``None``: not there yet)."""

    async def get(self, path: str, params: Any = None) -> dict[str, Any]:
        self.calls.append(("GET", path, None))
        self.reads.append(params)
        name = path.rsplit("/", 1)[-1]
        if params == {"resourceVersion": "0"} and name in self.watch_cache:
            cached = self.watch_cache[name]
            if cached is None:
                raise ApiError(404, "NotFound", f"pods {name!r} not found")
            return cached
        if name not in self.pods:
            raise ApiError(404, "NotFound", f"pods {name!r} not found")
        return self.pods[name]

    async def create(self, path: str, body: Any) -> dict[str, Any]:
        self.calls.append(("POST", path, body))
        await asyncio.sleep(0)
        if self.fail_binding is not None:
            raise self.fail_binding
        pod = self.pods[body["metadata"]["name"]]
        # The API server's precondition (pkg/registry/core/pod/storage/storage.go setPodNodeAndMetadata,
        # v1.36.3): a Binding naming a resourceVersion binds only that version of the pod.
        version = body["metadata"].get("resourceVersion")
        if version is not None and version != pod["metadata"].get("resourceVersion"):
            raise ApiError(409, "Conflict", "the object has been modified")
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
    assert message == (
        f"GPU (NVIDIA H100 80GB HBM3): VRAM budget free below the pod's {format_bytes(vllm_bytes('0.30'))} per GPU"
    )
    assert state.ledger.check_invariants() == []


async def test_bind_records_the_placement_and_creates_the_binding() -> None:
    _, verbs, fake = make([gpu_node("h100")])
    assert await schedule(verbs, fake, vllm_pod("p", "0.2"), ["h100"]) == "h100"
    methods = [(m, path) for m, path, _ in fake.calls]
    # bind trusts only the API server: it reads the pod first, whatever filter saw.
    assert methods == [("GET", "/api/v1/namespaces/default/pods/p"),
                       ("POST", "/api/v1/namespaces/default/pods/p/binding")]
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
    expected = f"VRAM budget free below the pod's {format_bytes(vllm_bytes('0.05'))} per GPU"
    assert outcome.failed and expected in outcome.failed["h100"]


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
async def client() -> AsyncIterator[ServedClient]:
    _, verbs, _ = make([gpu_node("h100"), gpu_node("h200", memory_mib=143771, product="NVIDIA-H200")])
    synced = asyncio.Event()
    synced.set()
    app = build_app(verbs, synced, Readiness(), CollectorRegistry())
    async with served(app) as test_client:
        yield test_client


async def test_filter_wire_format_node_names(client: ServedClient) -> None:
    response = await client.post("/filter", json={"Pod": vllm_pod("p", "0.6"), "Nodes": None,
                                                  "NodeNames": ["h100", "h200", "cpu-1"]})
    assert response.status == 200
    body = await response.json()
    assert body["NodeNames"] == ["h100", "h200"]
    assert body["Nodes"] is None
    assert body["Error"] == ""
    assert body["FailedNodes"] == {"cpu-1": "node cpu-1 is not known to vramguard yet"}


def go_encoded_whole_nodes(nodes: list[dict[str, Any]]) -> bytes:
    """ExtenderArgs as kube-scheduler encodes it with nodeCacheCapable: false (field order, no spaces)."""
    return json.dumps({"Pod": vllm_pod("p", "0.6"), "Nodes": {"items": nodes}, "NodeNames": None},
                      separators=(",", ":")).encode()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/filter", go_encoded_whole_nodes([gpu_node("h100")])),
        # Never parsed: the raw bytes say what it is (megabytes of Nodes are not turned into objects).
        ("/filter", b'{"Pod":{},"Nodes":{"items":[{"not": json at all]},"NodeNames":null}'),
        # Another encoder (NodeNames left out, spaces): caught after parsing.
        ("/filter", json.dumps({"Pod": vllm_pod("p", "0.6"), "Nodes": {"items": [gpu_node("h100")]}}).encode()),
        ("/prioritize", go_encoded_whole_nodes([gpu_node("h100")])),
    ],
    ids=["filter-go-encoding", "filter-unparsed", "filter-other-encoder", "prioritize"],
)
async def test_whole_nodes_are_refused_naming_the_setting(
    client: ServedClient, path: str, body: bytes,  # type: ignore[type-arg]
) -> None:
    response = await client.post(path, data=body, headers={"Content-Type": "application/json"})
    answer = await response.json()
    if path == "/filter":
        assert response.status == 200, "the scheduler shows a filter's Error, not an HTTP status's body"
        assert answer["NodeNames"] == [] and answer["Nodes"] is None
        message = answer["Error"]
    else:
        assert response.status == 400
        message = answer["error"]
    assert "nodeCacheCapable: true" in message
    verb = path.strip("/")
    metrics = await (await client.get("/metrics")).text()
    assert f'vramguard_extender_node_cache_refused_total{{verb="{verb}"}} 1.0' in metrics


async def test_oversized_filter_body_names_the_setting(client: ServedClient) -> None:
    body = go_encoded_whole_nodes([gpu_node(f"n{i}") for i in range(3000)])
    assert len(body) > 1 << 20
    response = await client.post("/filter", data=body, headers={"Content-Type": "application/json"})
    assert response.status == 413
    assert "nodeCacheCapable: true" in (await response.json())["error"]


async def test_filter_nothing_passes_gives_empty_list_not_null(client: ServedClient) -> None:
    response = await client.post("/filter", json={"Pod": vllm_pod("p", "0.6", gpus=2), "NodeNames": ["h100"]})
    body = await response.json()
    assert body["NodeNames"] == []
    assert "h100" in body["FailedNodes"] or "h100" in body["FailedAndUnresolvableNodes"]


async def test_prioritize_wire_format(client: ServedClient) -> None:
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
async def test_bad_input_is_a_clear_4xx(client: ServedClient, path: str, body: bytes, status: int) -> None:  # type: ignore[type-arg]
    response = await client.post(path, data=body, headers={"Content-Type": "application/json"})
    assert response.status == status
    assert "error" in await response.json()


async def test_not_synced_answers_with_error() -> None:
    _, verbs, _ = make([gpu_node("h100")])
    readiness = Readiness()
    app = build_app(verbs, asyncio.Event(), readiness, CollectorRegistry())
    async with served(app) as test_client:
        response = await test_client.post("/filter", json={"Pod": vllm_pod("p", "0.2"), "NodeNames": ["h100"]})
        assert (await response.json())["Error"] == NOT_SYNCED
        assert (await test_client.get("/readyz")).status == 503


def samples(exposition: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The exposition parsed as Prometheus would (a format error raises)."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(exposition.decode())
        for sample in family.samples
    }


def test_without_an_agent_report_the_worst_case_is_named_apart_from_what_is_known() -> None:
    # Three 0.3 pods on an 8-GPU time-sliced node with no agent report: each may be on any GPU, so
    # the conservative rule holds each on all 8. Known: nothing. The agent state says why.
    octo = gpu_node("octo", gpus=8)
    state, _, _ = make([octo], [vllm_pod(name, "0.3", node="octo") for name in ("a", "b", "c")])
    found = samples(render_ledger_now(state))
    labels = frozenset({("node", "octo"), ("product", "NVIDIA H100 80GB HBM3")})
    assert found[("vramguard_node_known_bytes", labels)] == 0
    assert found[("vramguard_node_unplaced_bytes", labels)] == 8 * 3 * vllm_bytes("0.3")
    assert found[("vramguard_node_unplaced_bytes", labels)] == found[("vramguard_node_reserved_bytes", labels)]
    assert found[("vramguard_node_agent_report", frozenset({("node", "octo"), ("state", "none")}))] == 1


@pytest.mark.parametrize("per_gpu", [False, True], ids=["per-node-default", "per-gpu-opt-in"])
def test_ledger_series_per_node_and_product_and_per_gpu_opt_in(per_gpu: bool) -> None:
    quad = gpu_node("quad", gpus=4, product='H100 "SXM"\\x')
    state, _, _ = make([gpu_node("h100"), quad],
                       [vllm_pod("a", "0.6", node="h100"), vllm_pod("b", "0.6", node="h100"),
                        vllm_pod("c", "0.25", node="quad")])
    found = samples(render_ledger_now(state, per_gpu=per_gpu))
    budget = found[("vramguard_node_budget_bytes", frozenset({("node", "h100"), ("product", "NVIDIA H100 80GB HBM3")}))]
    product = next(dict(labels)["product"] for name, labels in found if dict(labels).get("node") == "quad")
    assert product == 'H100 "SXM"\\x', "label values are escaped and read back unchanged"
    quad_labels = frozenset({("node", "quad"), ("product", product)})
    assert found[("vramguard_node_gpus", quad_labels)] == 4
    assert found[("vramguard_node_budget_bytes", quad_labels)] == 4 * budget
    assert 0 < found[("vramguard_node_largest_free_bytes", quad_labels)] < budget, "c may be on any of them"
    assert found[("vramguard_node_free_bytes", quad_labels)] < 4 * budget
    h100 = frozenset({("node", "h100"), ("product", "NVIDIA H100 80GB HBM3")})
    assert found[("vramguard_node_overcommitted_gpus", h100)] == 1, "two 0.6 pods bound past the extender"
    assert found[("vramguard_node_overcommitted_gpus", quad_labels)] == 0
    assert found[("vramguard_node_pods", frozenset({("node", "h100")}))] == 2
    per_gpu_names = {name for name, _ in found if name.startswith("vramguard_gpu_")}
    assert per_gpu_names == ({"vramguard_gpu_budget_bytes", "vramguard_gpu_reserved_bytes", "vramguard_gpu_free_bytes",
                              "vramguard_gpu_pods"} if per_gpu else set())
    if per_gpu:
        assert found[("vramguard_gpu_pods", frozenset({("node", "h100"), ("gpu", "0"), ("sharing", "time-slicing"),
                                                       ("product", "NVIDIA H100 80GB HBM3")}))] == 2


async def test_a_scrape_sends_the_cached_rendering_and_does_not_render() -> None:
    state, verbs, _ = make([gpu_node("h100")])
    synced = asyncio.Event()
    synced.set()
    app = build_app(verbs, synced, Readiness(), CollectorRegistry())
    pods = frozenset({("node", "h100")})
    async with served(app) as test_client:
        before = samples(await (await test_client.get("/metrics")).read())
        assert before[("vramguard_node_pods", pods)] == 0, "rendered once at start-up"
        state.pods.upsert(vllm_pod("a", "0.5", node="h100"))
        cached = samples(await (await test_client.get("/metrics")).read())
        assert cached[("vramguard_node_pods", pods)] == 0, "a scrape must not render on the request path"
        await app.operational[LEDGER_EXPOSITION_KEY].render()  # what the periodic refresh does
        fresh = samples(await (await test_client.get("/metrics")).read())
        assert fresh[("vramguard_node_pods", pods)] == 1
        assert fresh[("vramguard_ledger_exposition_bytes", frozenset())] > 0


async def test_the_operational_listener_serves_the_cached_series_and_a_failed_rendering_keeps_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, verbs, _ = make([gpu_node("h100")])
    app = build_app(verbs, asyncio.Event(), Readiness(), CollectorRegistry())
    ledger = app.operational[LEDGER_EXPOSITION_KEY]
    await ledger.refresh()

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(metrics, "_node_rows", broken)
    await ledger.refresh()  # logged, not raised
    async with TestClient(TestServer(app.operational)) as ops:
        text = await (await ops.get("/metrics")).text()
    assert 'vramguard_node_budget_bytes{node="h100"' in text


async def test_rendering_yields_to_the_event_loop_between_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    # A zero budget: a pause after every step, so the count of the other task's turns is exact enough.
    monkeypatch.setattr(metrics, "RENDER_BUDGET_SECONDS", 0.0)
    monkeypatch.setattr(metrics, "RENDER_PAUSE_SECONDS", 0.0)
    nodes = [gpu_node(f"n{i}", gpus=2) for i in range(1000)]
    state, _, _ = make(nodes, [vllm_pod(f"p{i}", "0.1", node=f"n{i}") for i in range(0, 1000, 7)])
    exposition = LedgerExposition(state, CollectorRegistry(), per_gpu=True)
    ticks = 0

    async def other_requests() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(other_requests())
    await exposition.render()
    other.cancel()
    assert ticks >= 1000 // metrics.NODES_PER_STEP, ticks
    text = b"".join(exposition.cached())
    assert len(exposition.cached()) > 10, "kept in pieces, never joined into one copy"
    assert text.count(b"vramguard_gpu_budget_bytes{") == 2000
    assert text == render_ledger_now(state, per_gpu=True)
    namespaces = samples(text)
    assert namespaces[("vramguard_namespace_reserved_bytes", frozenset({("namespace", "default")}))] == sum(
        state.ledger.namespace_bytes().values()), "added up slice by slice, the same as in one piece"


@pytest.mark.parametrize(("nodes", "trims"), [(10, 0), (2000, 1)], ids=["small", "over a MiB"])
async def test_a_large_rendering_hands_the_freed_c_heap_back(
    monkeypatch: pytest.MonkeyPatch, nodes: int, trims: int
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(metrics, "trim_c_heap", lambda: calls.append(1) or True)
    state, _, _ = make([gpu_node(f"n{i}", gpus=2) for i in range(nodes)], [])
    exposition = LedgerExposition(state, CollectorRegistry(), per_gpu=True)
    await exposition.render()
    assert (sum(map(len, exposition.cached())) >= metrics.TRIM_AFTER_BYTES) == bool(trims)
    assert len(calls) == trims


def test_namespace_bytes_for_chargeback() -> None:
    state, _, _ = make([gpu_node("h100"), gpu_node("quad", gpus=4)],
                       [vllm_pod("a", "0.25", node="h100", namespace="team-a"),
                        vllm_pod("b", "0.25", node="quad", namespace="team-a"),
                        vllm_pod("c", "0.5", node="h100", namespace="team-b")])
    # Each pod holds its share and its CUDA context: two contexts for team-a, one for team-b.
    assert state.ledger.namespace_bytes() == {"team-a": 2 * vllm_bytes("0.25"), "team-b": vllm_bytes("0.5")}


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


# -- bind trusts only the API server ---------------------------------------------------------------

def posts(fake: FakeKube) -> list[str]:
    """The paths bind POSTed to (Bindings created)."""
    return [path for method, path, _ in fake.calls if method == "POST"]


async def test_forged_filter_body_does_not_decide_what_bind_reserves() -> None:
    # Half the GPU is held; the real pod asks for 0.9 of it. A forged filter body with the same
    # name and UID claims 0.05: bind must take the claims from the pod the API server returns.
    state, verbs, fake = make([gpu_node("h100")], [vllm_pod("held", "0.5", node="h100")])
    fake.pods["big"] = vllm_pod("big", "0.9")
    forged = vllm_pod("big", "0.05")
    assert (await verbs.filter(forged, ["h100"])).passing == ["h100"]
    error = await verbs.bind("big", "default", "uid-big", "h100")
    assert "VRAM budget free" in error
    assert posts(fake) == [] and state.in_flight == {}
    assert state.ledger.check_invariants() == []


async def test_bind_with_an_empty_pod_uid_is_refused() -> None:
    _, verbs, fake = make([gpu_node("h100")])
    fake.pods["p"] = vllm_pod("p", "0.2")
    no_uid = vllm_pod("p", "0.2")
    del no_uid["metadata"]["uid"]
    await verbs.filter(no_uid, ["h100"])  # a filter body without a UID caches nothing bind trusts
    error = await verbs.bind("p", "default", "", "h100")
    assert error.startswith("refused: no PodUID")
    assert fake.calls == []


async def test_bind_with_a_uid_other_than_the_pods_is_refused() -> None:
    _, verbs, fake = make([gpu_node("h100")])
    fake.pods["p"] = vllm_pod("p", "0.2")
    other = vllm_pod("p", "0.2")
    other["metadata"]["uid"] = "uid-forged"
    await verbs.filter(other, ["h100"])
    error = await verbs.bind("p", "default", "uid-forged", "h100")
    assert error == "refused: pod default/p was replaced (its UID is not uid-forged)"
    assert posts(fake) == []


async def test_bind_reads_the_pod_from_the_api_servers_watch_cache() -> None:
    # resourceVersion=0: the API server answers from its cache, without a read from etcd.
    _, verbs, fake = make([gpu_node("h100")])
    assert await schedule(verbs, fake, vllm_pod("p", "0.2"), ["h100"]) == "h100"
    assert fake.reads == [{"resourceVersion": "0"}]


def _replaced(name: str) -> dict[str, Any]:
    old = vllm_pod(name, "0.05")
    old["metadata"]["uid"] = "uid-old"
    return old


@pytest.mark.parametrize("cached", [None, _replaced("p")], ids=["not-in-the-cache-yet", "cache-shows-an-older-pod"])
async def test_bind_reads_from_etcd_when_the_watch_cache_lags(cached: dict[str, Any] | None) -> None:
    state, verbs, fake = make([gpu_node("h100")], [vllm_pod("held", "0.5", node="h100")])
    fake.pods["p"] = vllm_pod("p", "0.3")
    fake.watch_cache["p"] = cached
    assert await verbs.bind("p", "default", "uid-p", "h100") == ""
    assert fake.reads == [{"resourceVersion": "0"}, None]
    fake.deliver("p")
    # The claims are the current pod's (0.3), not the stale copy's (0.05, beside which 0.2 would fit).
    assert (await verbs.filter(vllm_pod("q", "0.2"), ["h100"])).failed
    assert state.ledger.check_invariants() == []


async def test_a_pod_changed_after_bind_read_it_is_judged_again_not_bound_as_read() -> None:
    # The watch cache still shows the pod at 0.05; its image changed since (a new version, more VRAM):
    # the Binding names the version read, the API server refuses it, and bind judges the pod again.
    state, verbs, fake = make([gpu_node("h100")], [vllm_pod("held", "0.5", node="h100")])
    stale = vllm_pod("p", "0.05")
    stale["metadata"]["resourceVersion"] = "10"
    current = vllm_pod("p", "0.6")
    current["metadata"]["resourceVersion"] = "11"
    fake.pods["p"], fake.watch_cache["p"] = current, stale
    error = await verbs.bind("p", "default", "uid-p", "h100")
    assert "VRAM budget free" in error  # 0.6 beside 0.5 does not fit; 0.05 would have been bound
    assert [body["metadata"]["resourceVersion"] for method, _, body in fake.calls if method == "POST"] == ["10"]
    assert fake.reads == [{"resourceVersion": "0"}, None]
    assert state.ledger.pod_count() == 1 and not state.in_flight
    current["metadata"]["resourceVersion"] = "12"
    fake.pods["p"] = vllm_pod("p", "0.3") | {"metadata": {**current["metadata"]}}
    fake.watch_cache["p"] = fake.pods["p"]
    assert await verbs.bind("p", "default", "uid-p", "h100") == ""


async def test_bind_refuses_when_etcd_shows_another_pod_too() -> None:
    _, verbs, fake = make([gpu_node("h100")])
    fake.pods["p"] = _replaced("p")
    fake.watch_cache["p"] = _replaced("p")
    error = await verbs.bind("p", "default", "uid-p", "h100")
    assert error == "refused: pod default/p was replaced (its UID is not uid-p)"
    assert fake.reads == [{"resourceVersion": "0"}, None] and posts(fake) == []


def _pod_with(**spec: Any) -> dict[str, Any]:
    pod = vllm_pod("p", "0.2")
    pod["spec"].update(spec)
    return pod


def _cpu_pod() -> dict[str, Any]:
    pod = vllm_pod("p", "0.2")
    pod["spec"]["containers"] = [container(name="web", gpus=None)]
    return pod


def _tainted(node: dict[str, Any], *taints: dict[str, str]) -> dict[str, Any]:
    node["spec"] = {"taints": list(taints)}
    return node


GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
H100_AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H200"]}]}]}}}


@pytest.mark.parametrize(
    ("pod", "node", "fragment"),
    [
        (_pod_with(schedulerName="default-scheduler"), gpu_node("h100"), "belongs to scheduler 'default-scheduler'"),
        (_pod_with(schedulerName=None), gpu_node("h100"), "belongs to scheduler 'default-scheduler'"),
        (_pod_with(schedulerName="other"), gpu_node("h100"), "belongs to scheduler 'other'"),
        (_pod_with(nodeName="h100"), gpu_node("h100"), "already bound to h100"),
        (vllm_pod("p", "0.2"), _tainted(gpu_node("h100"), GPU_TAINT), "taint nvidia.com/gpu=present:NoSchedule"),
        (_pod_with(tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}]),
         _tainted(gpu_node("h100"), GPU_TAINT, {"key": "drain", "effect": "NoExecute"}), "taint drain:NoExecute"),
        (_pod_with(nodeSelector={"pool": "inference"}), gpu_node("h100"), "nodeSelector pool=inference"),
        (_pod_with(affinity=H100_AFFINITY), gpu_node("h100"), "required node affinity"),
        (vllm_pod("p", "0.2"), gpu_node("other"), "node h100 is not known"),
    ],
    ids=["default-scheduler", "no-scheduler-name", "other-scheduler", "already-bound",
         "untolerated-taint", "second-taint-untolerated", "node-selector", "node-affinity", "unknown-node"],
)
async def test_bind_refuses_pods_that_are_not_its_business(pod: dict[str, Any], node: dict[str, Any],
                                                           fragment: str) -> None:
    state, verbs, fake = make([node])
    fake.pods["p"] = pod
    error = await verbs.bind("p", "default", "uid-p", "h100")
    assert error.startswith("refused: ") and fragment in error
    assert posts(fake) == [] and state.in_flight == {} and state.ledger.pod_count() == 0


@pytest.mark.parametrize("node", [gpu_node("h100"), {"metadata": {"name": "h100", "labels": {}}, "status": {}}],
                         ids=["gpu-node", "cpu-node"])
async def test_bind_places_a_pod_of_its_scheduler_that_asks_for_no_gpu(node: dict[str, Any]) -> None:
    """The second scheduler calls the extender for every pod it schedules (its configuration lists no
    managedResources, so claim pods reach it): a pod asking for nothing of a GPU is bound as asked,
    holding nothing in the ledger, not left Pending."""
    state, verbs, fake = make([node])
    fake.pods["p"] = _cpu_pod()
    assert await verbs.bind("p", "default", "uid-p", "h100") == ""
    assert posts(fake) == ["/api/v1/namespaces/default/pods/p/binding"]
    holding = state.ledger.holding("uid-p")
    assert holding is None or holding[2] == ()


@pytest.mark.parametrize(
    ("spec", "node"),
    [
        ({"tolerations": [{"operator": "Exists"}]}, _tainted(gpu_node("h100"), GPU_TAINT)),
        ({}, _tainted(gpu_node("h100"), {"key": "soft", "effect": "PreferNoSchedule"})),
        ({"nodeSelector": {"nvidia.com/gpu.count": "1"}}, gpu_node("h100")),
        ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["h100"]}]}]}}}}, gpu_node("h100")),
    ],
    ids=["tolerates-all", "prefer-no-schedule", "selector-matches", "match-fields-name"],
)
async def test_bind_places_pods_the_node_admits(spec: dict[str, Any], node: dict[str, Any]) -> None:
    _, verbs, fake = make([node])
    fake.pods["p"] = _pod_with(**spec)
    assert await verbs.bind("p", "default", "uid-p", "h100") == ""
    assert posts(fake) == ["/api/v1/namespaces/default/pods/p/binding"]


async def test_node_taints_follow_the_watch() -> None:
    node = gpu_node("h100")
    state, verbs, fake = make([slim_node(node)])
    state.nodes.upsert(slim_node(_tainted(json.loads(json.dumps(node)), GPU_TAINT)))  # a taint added later
    fake.pods["p"] = vllm_pod("p", "0.2")
    assert "does not tolerate" in await verbs.bind("p", "default", "uid-p", "h100")
    state.nodes.delete(node)
    assert "not known" in await verbs.bind("p", "default", "uid-p", "h100")


# -- in-flight housekeeping ------------------------------------------------------------------------

async def _bound_but_unwatched(api_says: str) -> tuple[ClusterState, Verbs, FakeKube]:
    """A pod bound by bind whose watch event never came; the API then says ``api_says``."""
    state, verbs, fake = make([gpu_node("h100")])
    fake.pods["p"] = vllm_pod("p", "0.6")
    assert await verbs.bind("p", "default", "uid-p", "h100") == ""
    if api_says == "gone":
        del fake.pods["p"]
    elif api_says == "unbound":
        fake.pods["p"]["spec"].pop("nodeName")
    elif api_says == "replaced":
        fake.pods["p"] = vllm_pod("p", "0.6", node="h100")
        fake.pods["p"]["metadata"]["uid"] = "uid-new"
    return state, verbs, fake


@pytest.mark.parametrize(
    ("api_says", "dropped", "holds"),
    [("bound", 0, True), ("gone", 1, False), ("unbound", 1, False), ("replaced", 1, False)],
    ids=["bound-kept", "gone-dropped", "unbound-dropped", "replaced-dropped"],
)
async def test_in_flight_reservations_are_confirmed_by_a_get(api_says: str, dropped: int, holds: bool) -> None:
    state, verbs, fake = await _bound_but_unwatched(api_says)
    assert await verbs.confirm_in_flight(older_than=3600) == 0  # not old yet: nothing read, nothing dropped
    assert [m for m, _, _ in fake.calls] == ["GET", "POST"]
    assert "uid-p" in state.in_flight
    assert await verbs.confirm_in_flight(older_than=0) == dropped
    assert fake.calls[-1][0] == "GET"
    assert state.in_flight == {}
    assert (state.ledger.holding("uid-p") is not None) is holds
    assert (state.is_bound("uid-p") == "h100") is holds


async def test_in_flight_reservation_is_kept_when_the_get_fails() -> None:
    state, verbs, fake = await _bound_but_unwatched("bound")

    async def failing_get(path: str, params: Any = None) -> dict[str, Any]:
        raise ApiError(503, "ServiceUnavailable", "etcd is down")

    fake.get = failing_get  # type: ignore[method-assign]
    assert await verbs.confirm_in_flight(older_than=0) == 0
    assert "uid-p" in state.in_flight and state.ledger.holding("uid-p") is not None


async def test_a_bind_cancelled_after_the_binding_went_through_keeps_its_reservation() -> None:
    state, verbs, fake = make([gpu_node("h100")])
    fake.pods["p"] = vllm_pod("p", "0.6")
    original = fake.create
    hang = asyncio.Event()

    async def lost_answer(path: str, body: Any) -> dict[str, Any]:
        await original(path, body)  # the API server binds the pod ...
        await hang.wait()  # ... and the answer never comes back before the scheduler hangs up
        return {}

    fake.create = lost_answer  # type: ignore[method-assign]
    task = asyncio.create_task(verbs.bind("p", "default", "uid-p", "h100"))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert state.ledger.holding("uid-p") is not None, "the pod may be bound: its GPU stays reserved"
    assert (await verbs.filter(vllm_pod("q", "0.6"), ["h100"])).failed
    assert await verbs.confirm_in_flight(older_than=0) == 0
    assert state.is_bound("uid-p") == "h100" and state.in_flight == {}


# -- bounded work ----------------------------------------------------------------------------------

def _many_gpus(*containers: tuple[int, bool]) -> dict[str, Any]:
    """A pod of (GPUs, is-init) containers."""
    pod = vllm_pod("huge", "0.2")
    pod["spec"]["containers"] = [container(name=f"c{i}", gpus=g) for i, (g, init) in enumerate(containers) if not init]
    pod["spec"]["initContainers"] = [container(name=f"i{i}", gpus=g) for i, (g, init) in enumerate(containers) if init]
    return pod


@pytest.mark.parametrize(
    ("pod", "devices"),
    [
        (_many_gpus(*[(1000, False)] * 200), 200_000),
        (_many_gpus((1000, False)), 1000),
        (_many_gpus((20, False), (13, False)), 33),
        (_many_gpus((40, True), (1, False)), 40),
    ],
    ids=["200x1000", "1000", "two-containers", "init-container"],
)
async def test_a_pod_asking_for_more_devices_than_any_node_has_is_cheaply_unresolvable(
    pod: dict[str, Any], devices: int
) -> None:
    # The largest node hands out 32 devices (8 GPUs x 4 replicas).
    _, verbs, _ = make([gpu_node(f"n{i}", gpus=8 if i == 0 else 1) for i in range(50)])
    started = time.perf_counter()
    outcome = await verbs.filter(pod, [f"n{i}" for i in range(50)])
    assert time.perf_counter() - started < 1.0
    assert outcome.passing == [] and len(outcome.unresolvable) == 50
    assert f"asks for {devices} GPU devices at once; no node offers more than 32" in outcome.unresolvable["n0"]


@pytest.mark.parametrize(
    "pod",
    [_many_gpus((32, False)), _many_gpus((32, True), (32, False)), _many_gpus((16, False), (16, False))],
    ids=["as-many-as-the-node", "init-runs-before-apps", "two-containers"],
)
async def test_a_pod_asking_for_what_the_largest_node_has_is_not_refused_by_the_cap(pod: dict[str, Any]) -> None:
    _, verbs, _ = make([gpu_node("big", gpus=8), gpu_node("small")])
    pod["metadata"]["annotations"] = {"vramguard.io/vram": "1Gi"}
    outcome = await verbs.filter(pod, ["big", "small"])
    assert outcome.passing == ["big"], outcome


@pytest.mark.parametrize(("slice_seconds", "yields"), [(0.0, True), (None, False)], ids=["sliced", "unsliced"])
async def test_long_filters_and_prioritizes_yield_to_the_event_loop(slice_seconds: float | None, yields: bool) -> None:
    nodes = [gpu_node(f"n{i}") for i in range(300)]
    state = ClusterState(default_policy())
    state.nodes.replace(nodes)
    verbs = Verbs(state, None, slice_seconds=slice_seconds)
    # As for claims the bound index does not serve (two resources, devices named): every node is
    # judged one by one, the long filter this is about. The index decides in one short step.
    state.ledger.split_by_bound = lambda *_: None  # type: ignore[method-assign]
    names = [n["metadata"]["name"] for n in nodes]
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = ticks
    passing = (await verbs.filter(vllm_pod("p", "0.2"), names)).passing
    during_filter = ticks - before
    before = ticks
    await verbs.prioritize(vllm_pod("p", "0.2"), passing)
    during_prioritize = ticks - before
    task.cancel()
    assert passing == names
    assert (during_filter >= 300 // 64) is yields and (during_prioritize >= 300 // 64) is yields


async def test_concurrent_filters_of_one_shape_answer_only_their_own_candidates() -> None:
    _, verbs, _ = make([gpu_node(f"n{i}") for i in range(200)])
    verbs.slice_seconds = 0.0  # yield after every slice, so the two filters interleave
    names = [f"n{i}" for i in range(200)]
    await verbs.filter(vllm_pod("warm", "0.2"), names[:50])
    # The first adds 100 nodes to the shape's last outcome, the second (done first) 50 others.
    wide, other = names[:150], names[:50] + names[150:]
    first, second = await asyncio.gather(
        verbs.filter(vllm_pod("a", "0.2"), wide), verbs.filter(vllm_pod("b", "0.2"), other)
    )
    assert sorted(first.passing) == sorted(wide)
    assert sorted(second.passing) == sorted(other)
    assert sorted((await verbs.filter(vllm_pod("c", "0.2"), other)).passing) == sorted(other)


# -- wrong types in the bodies ---------------------------------------------------------------------

def _body(verb: str, mutate: Any) -> dict[str, Any]:
    pod = vllm_pod("p", "0.2")
    mutate(pod)
    if verb == "preempt":
        return {"Pod": pod, "NodeNameToMetaVictims": {"h100": {"Pods": [{"UID": "u"}], "NumPDBViolations": 0}}}
    return {"Pod": pod, "NodeNames": ["h100"]}


def _nested(levels: int) -> list[Any]:
    """A list nesting ``levels`` lists deep, innermost included."""
    value: list[Any] = []
    for _ in range(levels - 1):
        value = [value]
    return value


def _container_depth(pod: dict[str, Any]) -> int:
    """How deep the pod's containers list nests (the list itself is the first level)."""
    def depth(value: Any) -> int:
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        return 0 if children is None else 1 + max((depth(child) for child in children), default=0)
    return int(depth(pod["spec"]["containers"]))


WRONG_TYPES = {
    "label-number": lambda p: p["metadata"].update(labels={"vramguard.io/qos-class": 3}),
    "label-object": lambda p: p["metadata"].update(labels={"vramguard.io/qos-class": {"a": 1}}),
    "labels-list": lambda p: p["metadata"].update(labels=["a"]),
    "annotation-number": lambda p: p["metadata"].update(annotations={"vramguard.io/vram": 16}),
    "annotations-list": lambda p: p["metadata"].update(annotations=[1]),
    "metadata-list": lambda p: p.update(metadata=[1, 2]),
    "uid-number": lambda p: p["metadata"].update(uid=7),
    "spec-string": lambda p: p.update(spec="x"),
    # Typed container fields nest under 10 levels; this deep, the template key's encoder would
    # exhaust the stack (a 500 before the check).
    "containers-nest-too-deep": lambda p: p["spec"]["containers"][0]["args"].append(_nested(300)),
    "init-containers-nest-too-deep": lambda p: p["spec"].update(
        initContainers=[{"name": "init", "image": "busybox", "command": _nested(300)}]
    ),
}


@pytest.mark.parametrize("verb", ["filter", "prioritize", "preempt"])
@pytest.mark.parametrize("case", list(WRONG_TYPES))
async def test_wrong_types_in_the_pod_are_a_400(client: ServedClient, verb: str, case: str) -> None:
    response = await client.post(f"/{verb}", json=_body(verb, WRONG_TYPES[case]))
    assert response.status == 400
    assert "Pod" in (await response.json())["error"]


@pytest.mark.parametrize("verb", ["filter", "prioritize", "preempt"])
async def test_containers_nesting_a_thousand_deep_are_a_400_not_a_500(client: ServedClient, verb: str) -> None:
    # Inside the request decoder's 1,024 levels, past the standard library encoder's stack.
    body = json.dumps(_body(verb, lambda p: p["spec"]["containers"][0]["args"].append("DEEP")))
    body = body.replace('"DEEP"', "[" * 1000 + "]" * 1000)
    response = await client.post(f"/{verb}", data=body, headers={"Content-Type": "application/json"})
    assert response.status == 400
    assert "spec.containers nests deeper than" in (await response.json())["error"]


@pytest.mark.parametrize("verb", ["filter", "prioritize", "preempt"])
async def test_containers_nesting_up_to_the_limit_are_served(client: ServedClient, verb: str) -> None:
    deepest = _body(verb, lambda p: p["spec"]["containers"][0]["args"].append(_nested(MAX_CONTAINER_DEPTH - 3)))
    assert _container_depth(deepest["Pod"]) == MAX_CONTAINER_DEPTH
    assert (await client.post(f"/{verb}", json=deepest)).status == 200
    beyond = _body(verb, lambda p: p["spec"]["containers"][0]["args"].append(_nested(MAX_CONTAINER_DEPTH - 2)))
    response = await client.post(f"/{verb}", json=beyond)
    assert response.status == 400
    assert f"spec.containers nests deeper than {MAX_CONTAINER_DEPTH} levels" in (await response.json())["error"]


@pytest.mark.parametrize(
    "body",
    [
        {"PodName": 3, "PodNamespace": "default", "PodUID": "u", "Node": "h100"},
        {"PodName": "p", "PodNamespace": {"a": 1}, "PodUID": "u", "Node": "h100"},
        {"PodName": "p", "PodNamespace": "default", "PodUID": ["u"], "Node": "h100"},
        {"PodName": "p", "PodNamespace": "default", "PodUID": "u", "Node": None},
    ],
    ids=["name-number", "namespace-object", "uid-list", "node-null"],
)
async def test_wrong_types_in_the_binding_are_a_400(client: ServedClient, body: dict[str, Any]) -> None:
    response = await client.post("/bind", json=body)
    assert response.status == 400


async def test_a_malformed_pod_from_the_api_is_refused_not_a_crash() -> None:
    _, verbs, fake = make([gpu_node("h100")])
    pod = vllm_pod("p", "0.2")
    pod["metadata"]["labels"] = {"vramguard.io/qos-class": {"nested": True}}
    fake.pods["p"] = pod
    error = await verbs.bind("p", "default", "uid-p", "h100")
    assert error.startswith("refused: the pod read from the API is malformed: metadata.labels")
    assert posts(fake) == []


# -- leader election -------------------------------------------------------------------------------

async def test_a_replica_that_is_not_the_leader_refuses_verbs_and_is_not_ready() -> None:
    _, verbs, fake = make([gpu_node("h100")])
    fake.pods["p"] = vllm_pod("p", "0.2")
    synced = asyncio.Event()
    synced.set()
    leading = False
    registry = CollectorRegistry()
    app = build_app(verbs, synced, Readiness(), registry, leader=lambda: leading)
    async with served(app) as test_client:
        response = await test_client.post("/filter", json={"Pod": vllm_pod("p", "0.2"), "NodeNames": ["h100"]})
        assert (await response.json())["Error"] == NOT_LEADER
        response = await test_client.post("/bind", json={"PodName": "p", "PodNamespace": "default",
                                                         "PodUID": "uid-p", "Node": "h100"})
        assert (await response.json())["Error"] == NOT_LEADER
        assert not [call for call in fake.calls if call[0] == "POST"]  # nothing bound
        assert (await test_client.get("/readyz")).status == 503
        response = await test_client.post("/preempt", json={"Pod": vllm_pod("p", "0.2"),
                                                            "NodeNameToMetaVictims": {}})
        assert response.status == 503 and (await response.json())["Error"] == NOT_LEADER
        assert registry.get_sample_value("vramguard_extender_not_leader_refusals_total", {"verb": "preempt"}) == 1
        assert registry.get_sample_value("vramguard_extender_not_leader_refusals_total", {"verb": "filter"}) == 1
        assert registry.get_sample_value("vramguard_extender_not_leader_refusals_total", {"verb": "bind"}) == 1
        leading = True
        response = await test_client.post("/filter", json={"Pod": vllm_pod("p", "0.2"), "NodeNames": ["h100"]})
        assert (await response.json())["NodeNames"] == ["h100"]
        assert (await test_client.get("/readyz")).status == 200


async def test_leadership_lost_while_the_pod_is_read_binds_nothing() -> None:
    state, verbs, fake = make([gpu_node("h100")])
    fake.pods["p"] = vllm_pod("p", "0.2")
    leading = True
    real_get = fake.get

    async def get_and_lose(path: str, params: Any = None) -> dict[str, Any]:
        nonlocal leading
        leading = False  # the renew deadline passes during the GET
        return await real_get(path, params)

    fake.get = get_and_lose  # type: ignore[method-assign]
    verbs.serving = lambda: leading
    assert await verbs.bind("p", "default", "uid-p", "h100") == NOT_LEADER
    assert not state.in_flight
    assert [m for m, _, _ in fake.calls] == ["GET"]


async def test_in_flight_reservations_and_the_oldest_age_are_exported() -> None:
    _, verbs, fake = make([gpu_node("h100")])
    fake.pods["p"] = vllm_pod("p", "0.2")
    registry = CollectorRegistry()
    synced = asyncio.Event()
    build_app(verbs, synced, Readiness(), registry)
    assert registry.get_sample_value("vramguard_extender_in_flight_reservations") == 0
    assert await verbs.bind("p", "default", "uid-p", "h100") == ""  # bound, not yet seen by the watch
    assert registry.get_sample_value("vramguard_extender_in_flight_reservations") == 1
    assert verbs.oldest_in_flight_seconds(time.monotonic() + 30) >= 30
    fake.deliver("p")
    assert registry.get_sample_value("vramguard_extender_in_flight_reservations") == 0
    assert verbs.oldest_in_flight_seconds(time.monotonic() + 30) == 0


async def test_kept_filter_outcomes_are_out_of_the_collectors_reach() -> None:
    """What a filter keeps per pod shape (the last outcome, the verdicts) holds strings only, in
    containers the garbage collector stops tracking: with hundreds of shapes of 5,000 nodes, a
    tracked list or set per shape makes every full collection a pause of hundreds of milliseconds."""
    _, verbs, _ = make([gpu_node(f"n{i}") for i in range(40)], [vllm_pod("held", "0.85", "n0")])
    names = [f"n{i}" for i in range(40)]
    await verbs.filter(vllm_pod("p", "0.3"), names)
    await verbs.filter(vllm_pod("q", "0.3"), names[::-1])  # another list of the same nodes
    gc.collect()
    [snapshot] = verbs._snapshots.values()
    kept = (snapshot.nodes, snapshot.members, snapshot.passing, snapshot.failed, snapshot.unresolvable)
    assert [gc.is_tracked(part) for part in kept] == [False] * 5
    assert not any(gc.is_tracked(verdicts) for verdicts in verbs._verdicts.values())


async def test_a_bound_pod_whose_claims_grow_past_the_budget_is_reported_not_silent() -> None:
    # An image changed on a running pod past the webhook: the ledger counts the new claims at once,
    # and the growth that takes the GPU past its budget is reported (Event VRAMOvercommitted, counter).
    state, _, _ = make([gpu_node("h100")], [vllm_pod("a", "0.5", node="h100"), vllm_pod("b", "0.3", node="h100")])
    assert state.take_growths() == []
    grown = vllm_pod("b", "0.6", node="h100")
    state.pods.upsert(grown)
    [growth] = state.take_growths()
    assert (growth.pod.name, growth.node) == ("b", "h100")
    assert growth.message.startswith("pod default/b changed while bound to h100 (a new image?) and now claims more "
                                     "VRAM than its GPU has room for: GPU 0 (NVIDIA H100 80GB HBM3) may hold")
    # Shrinking, or a change that leaves the GPU within its budget, is nothing to report.
    state.pods.upsert(vllm_pod("b", "0.3", node="h100"))
    state.pods.upsert(vllm_pod("b", "0.35", node="h100"))
    assert state.take_growths() == []

    class Events:
        def __init__(self) -> None:
            self.posted: list[Any] = []

        async def create(self, path: str, body: Any) -> dict[str, Any]:
            self.posted.append((path, body))
            return {}

    events = Events()
    reporter = GrowthReporter(state, events, CollectorRegistry(), serving=lambda: True)  # type: ignore[arg-type]
    state.pods.upsert(grown)
    assert await reporter.report() == 1
    [(path, event)] = events.posted
    assert path == "/api/v1/namespaces/default/events"
    assert (event["reason"], event["type"], event["involvedObject"]["name"]) == ("VRAMOvercommitted", "Warning", "b")
    assert reporter.counter._value.get() == 1


async def test_a_node_whose_gpus_nobody_can_read_is_reported_once_and_counted() -> None:
    # A GPU node with neither GPU Feature Discovery nor platform labels: its devices are of unknown memory.
    unlabelled = {"metadata": {"name": "bare"}, "status": {"allocatable": {"cpu": "8", "nvidia.com/gpu": "2"}}}
    state, _, _ = make([gpu_node("h100"), unlabelled])
    assert state.unreadable_nodes() == ["bare"]

    class Events:
        def __init__(self) -> None:
            self.posted: list[Any] = []

        async def create(self, path: str, body: Any) -> dict[str, Any]:
            self.posted.append((path, body))
            return {}

    events = Events()
    registry = CollectorRegistry()
    reporter = GrowthReporter(state, events, registry, serving=lambda: True)  # type: ignore[arg-type]
    await reporter.report()
    await reporter.report()
    [(path, event)] = events.posted
    assert path == "/api/v1/namespaces/default/events"
    assert (event["reason"], event["involvedObject"]["kind"], event["involvedObject"]["name"]) == (
        "GPUsUnreadable", "Node", "bare")
    metrics.ExtenderMetrics(registry, state)
    assert registry.get_sample_value("vramguard_unreadable_gpu_nodes") == 1


@pytest.mark.parametrize(("mode", "placed"), [("audit", True), ("warn", True), ("enforce", False)])
async def test_a_node_whose_gpus_nobody_can_read_takes_pods_only_outside_enforce(mode: str, placed: bool) -> None:
    # No budget can be checked there: where the namespace enforces, the pod waits (with the fix named);
    # elsewhere it goes where the stock scheduler would send it, recorded as unguarded.
    unlabelled = {"metadata": {"name": "bare"}, "status": {"allocatable": {"cpu": "8", "nvidia.com/gpu": "1"}}}
    state, verbs, fake = make([unlabelled])
    state.namespaces.replace([{"metadata": {"name": "default", "labels": {"vramguard.io/enforce": mode}}}])
    result = await schedule(verbs, fake, vllm_pod("p", "0.9"), ["bare"])
    if placed:
        assert result == "bare"
        binding = next(body for method, _, body in fake.calls if method == "POST")
        assert "unknown memory" in binding["metadata"]["annotations"]["vramguard.io/class-findings"]
        assert state.ledger.check_invariants() == []
    else:
        assert result.startswith("pending: ") and "memory size unknown" in result
