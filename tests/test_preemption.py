"""Preemption by VRAM (vramguard.preemption) and the extender's preempt verb over HTTP."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from fractions import Fraction
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from extender.app import build_app
from extender.preemption import LowestPriorities, mark_unhelpable, preempt
from extender.verbs import Verbs
from tests.builders import gpu_node, vllm_pod
from tests.served_extender import ServedClient, served
from tests.test_extender import make
from vramguard.cluster import ClusterState, slim_pod
from vramguard.demand.model import ContainerDemand, PodDemand, Vram
from vramguard.inventory import read_inventory
from vramguard.io.http import Readiness
from vramguard.ledger import PodRef
from vramguard.placement import pod_claims
from vramguard.policy import default_policy
from vramguard.preemption import (
    DisruptionBudget,
    DisruptionBudgets,
    Holder,
    choose_victims,
    read_budget,
    selects,
    split_by_budgets,
)

POLICY = default_policy()
CHOICE = POLICY.choose_class({}, {})


def claims_of(fraction: str, uid: str = "new") -> Any:
    vram = Vram(fraction=Fraction(fraction))
    return pod_claims(PodDemand((ContainerDemand(name="c", resource="nvidia.com/gpu", gpus=1, declared=vram),)),
                      CHOICE, uid)


def holder(name: str, fraction: str, priority: int = 0, *, evictable: bool = True,
           labels: dict[str, str] | None = None) -> Holder:
    return Holder(PodRef(f"uid-{name}", "default", name), claims_of(fraction, f"uid-{name}").claims, priority,
                  evictable, labels or {})


INVENTORY = read_inventory(gpu_node("ts"))
"""One H100 time-sliced 4 ways: a shared device, so its budget keeps the default 3% margin (0.97 of it).
The holders' and the new pod's VRAM is declared: a total, with no allowance on top."""

VICTIM_CASES = [
    pytest.param([holder("a", "0.2")], ("0.5", 10), (), id="fits-without-eviction"),
    pytest.param([holder("a", "0.1"), holder("b", "0.1"), holder("c", "0.35"), holder("d", "0.35")],
                 ("0.5", 10), ("c", "d"), id="evicts-the-pods-that-free-the-memory"),
    pytest.param([holder("hi", "0.4", 5), holder("lo", "0.4", 1)], ("0.5", 10), ("lo",),
                 id="most-important-reprieved-first"),
    pytest.param([holder("a", "0.5", 20), holder("b", "0.5", 1)], ("0.5", 10), None,
                 id="higher-priority-pods-stay-so-nothing-helps"),
    pytest.param([holder("a", "0.3", evictable=False), holder("b", "0.45")], ("0.5", 10), ("b",),
                 id="a-bind-in-flight-is-not-a-victim"),
    pytest.param([holder("a", "0.1")], ("0.98", 10), None, id="bigger-than-the-budget"),
]


@pytest.mark.parametrize(("holders", "pod", "victims"), VICTIM_CASES)
def test_choose_victims(holders: list[Holder], pod: tuple[str, int], victims: tuple[str, ...] | None) -> None:
    evictable = [h if h.priority < pod[1] else Holder(h.pod, h.claims, h.priority, False) for h in holders]
    chosen = choose_victims(INVENTORY, POLICY.budget_rule(), evictable, claims_of(pod[0]))
    assert (tuple(v.name for v in chosen.pods) if chosen is not None else None) == victims


# --------------------------------------------------------------------------- PodDisruptionBudgets


def budget(allowed: int, *, disrupted: tuple[str, ...] = (), namespace: str = "default",
           selector: dict[str, Any] | None = None) -> DisruptionBudget:
    return DisruptionBudget(namespace, {"matchLabels": {"app": "foo"}} if selector is None else selector, allowed,
                            frozenset(disrupted))


FOO = {"app": "foo"}

# The cases of kube-scheduler's TestDryRunPreemption (pkg/scheduler/framework/plugins/defaultpreemption/
# default_preemption_test.go, v1.36.3) about PDBs, with VRAM for resources: two (three) pods of
# "mediumRes" labelled app=foo, a preemptor of "veryLargeRes" that needs them all gone.
PDB_CASES = [
    pytest.param([holder("p1.1", "0.4", labels=FOO), holder("p1.2", "0.4", labels=FOO)], budget(1),
                 ("p1.1", "p1.2"), 1, id="violation-of-same-pdb"),
    pytest.param([holder("p1.1", "0.4", labels=FOO), holder("p1.2", "0.4", labels=FOO)],
                 budget(1, disrupted=("p2",)), ("p1.1", "p1.2"), 1, id="victim-not-in-disrupted-pods"),
    pytest.param([holder("p1.1", "0.4", labels=FOO), holder("p1.2", "0.4", labels=FOO)],
                 budget(1, disrupted=("p1.2",)), ("p1.1", "p1.2"), 0, id="victim-in-disrupted-pods"),
    pytest.param([holder(f"p1.{i}", "0.3", labels=FOO) for i in (1, 2, 3)], budget(1, disrupted=("p1.3",)),
                 ("p1.1", "p1.2", "p1.3"), 1, id="disrupted-pod-treated-as-non-violating"),
]


@pytest.mark.parametrize(("holders", "pdb", "victims", "violations"), PDB_CASES)
def test_pdb_violations_are_counted_as_kube_scheduler_counts_them(
    holders: list[Holder], pdb: DisruptionBudget, victims: tuple[str, ...], violations: int
) -> None:
    chosen = choose_victims(INVENTORY, POLICY.budget_rule(), holders, claims_of("0.9"), [pdb])
    assert chosen is not None
    assert (tuple(v.name for v in chosen.pods), chosen.pdb_violations) == (victims, violations)


def test_a_protected_pod_is_spared_where_an_unprotected_one_frees_the_room() -> None:
    # Either pod frees enough; the protected one is the larger, which VRAM alone would evict.
    holders = [holder("protected", "0.45", labels=FOO), holder("plain", "0.4", labels={"app": "bar"})]
    chosen = choose_victims(INVENTORY, POLICY.budget_rule(), holders, claims_of("0.5"), [budget(0)])
    assert chosen is not None
    assert (tuple(v.name for v in chosen.pods), chosen.pdb_violations) == (("plain",), 0)


def test_a_protected_pod_goes_when_nothing_else_frees_the_room_and_counts() -> None:
    holders = [holder("protected", "0.45", labels=FOO), holder("plain", "0.1")]
    chosen = choose_victims(INVENTORY, POLICY.budget_rule(), holders, claims_of("0.6"), [budget(0)])
    assert chosen is not None
    assert (tuple(v.name for v in chosen.pods), chosen.pdb_violations) == (("protected",), 1)


def test_budgets_of_other_namespaces_protect_nothing() -> None:
    pods = [holder("a", "0.4", labels=FOO)]
    assert split_by_budgets(pods, [budget(0, namespace="other")]) == ([], pods)
    assert split_by_budgets(pods, [budget(0)]) == (pods, [])


def test_the_most_important_pods_take_the_allowed_disruptions_first() -> None:
    # filterPodsWithPDBViolation walks the candidates in order: the first takes the one allowed disruption.
    first, second = holder("first", "0.1", labels=FOO), holder("second", "0.1", labels=FOO)
    assert split_by_budgets([first, second], [budget(1)]) == ([second], [first])


SELECTOR_CASES = [
    # metav1.LabelSelectorAsSelector (apimachinery v0.36), as filterPodsWithPDBViolation uses it:
    # a nil or empty selector, and an invalid one, select nothing.
    pytest.param(None, {"app": "foo"}, False, id="nil"),
    pytest.param({}, {"app": "foo"}, False, id="empty"),
    pytest.param({"matchLabels": {"app": "foo"}}, {"app": "foo", "x": "y"}, True, id="match-labels"),
    pytest.param({"matchLabels": {"app": "foo"}}, {"app": "bar"}, False, id="match-labels-differ"),
    pytest.param({"matchExpressions": [{"key": "app", "operator": "In", "values": ["foo", "bar"]}]},
                 {"app": "bar"}, True, id="in"),
    pytest.param({"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["foo"]}]},
                 {"tier": "x"}, True, id="not-in-holds-without-the-key"),
    pytest.param({"matchExpressions": [{"key": "app", "operator": "Exists"}]}, {"app": ""}, True, id="exists"),
    pytest.param({"matchExpressions": [{"key": "app", "operator": "DoesNotExist"}]}, {"app": "foo"}, False,
                 id="does-not-exist"),
    pytest.param({"matchExpressions": [{"key": "app", "operator": "Gt", "values": ["1"]}]}, {"app": "2"}, False,
                 id="node-only-operator-is-invalid"),
    pytest.param({"matchExpressions": [{"key": "app", "operator": "In", "values": []}]}, {"app": "foo"}, False,
                 id="in-without-values-is-invalid"),
    pytest.param({"matchExpressions": [{"key": "app", "operator": "Exists", "values": ["foo"]}]}, {"app": "foo"},
                 False, id="exists-with-values-is-invalid"),
    pytest.param({"matchLabels": ["app"]}, {"app": "foo"}, False, id="junk"),
]


@pytest.mark.parametrize(("selector", "labels", "selected"), SELECTOR_CASES)
def test_budget_selectors(selector: Any, labels: dict[str, str], selected: bool) -> None:
    assert selects(selector, labels) is selected


def test_budgets_read_from_watch_objects_junk_allows_nothing() -> None:
    pdb = {"metadata": {"name": "db", "namespace": "team"}, "spec": {"selector": {"matchLabels": FOO}},
           "status": {"disruptionsAllowed": 2, "disruptedPods": {"db-0": "2026-01-01T00:00:00Z"}}}
    assert read_budget(pdb) == DisruptionBudget("team", {"matchLabels": FOO}, 2, frozenset({"db-0"}))
    junk = {"metadata": {"name": "x", "namespace": "team"}, "spec": {"selector": "app=foo"},
            "status": {"disruptionsAllowed": "2", "disruptedPods": ["db-0"]}}
    assert read_budget(junk) == DisruptionBudget("team", None, 0)
    store = DisruptionBudgets()
    store.replace([pdb, junk])
    assert len(store.in_namespaces(["team", "team", "other"])) == 2
    store.delete(junk)
    assert store.in_namespaces(["team"]) == (read_budget(pdb),)
    store.delete(pdb)
    assert store.in_namespaces(["team"]) == ()


def protected_gpu(*, budgets: bool) -> ClusterState:
    """One H100 time-sliced 4 ways, all replicas held: a 0.45 pod a PodDisruptionBudget protects
    (allowing no disruption, as the disruption controller says of minAvailable 1 over one pod),
    a 0.4 pod nothing protects, and two of 0.03."""
    pods = [prioritized("protected", "0.45", 1, labels=FOO), prioritized("plain", "0.4", 1),
            prioritized("tiny-1", "0.03", 1), prioritized("tiny-2", "0.03", 1)]
    state, _, _ = make([gpu_node("ts")], pods)
    if budgets:
        state.disruption_budgets.replace([{
            "metadata": {"name": "protect", "namespace": "default"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": FOO}}, "status": {"disruptionsAllowed": 0}}])
    return state


def test_the_model_keeps_pod_labels_shared_by_replicas_and_current() -> None:
    state = protected_gpu(budgets=False)
    twin = prioritized("twin", "0.03", 1, labels=FOO)
    state.pods.upsert(twin)
    assert state.records["uid-twin"].labels is state.records["uid-protected"].labels
    assert state.records["uid-twin"].labels.values == FOO
    state.pods.upsert(prioritized("twin", "0.03", 1, labels={"app": "bar"}))
    assert state.records["uid-twin"].labels.values == {"app": "bar"}
    assert state.records["uid-plain"].labels.values == {}


def test_preempt_spares_the_protected_pod_and_counts_violations_again() -> None:
    urgent = prioritized("urgent", "0.4", 1000, node=None)
    # The scheduler counted replicas and named a tiny pod, with the violation count of its own choice.
    assert preempt(protected_gpu(budgets=False), urgent, {"ts": (["uid-tiny-1"], 0)}) == {
        "ts": (["uid-protected"], 0)}
    assert preempt(protected_gpu(budgets=True), urgent, {"ts": (["uid-tiny-1"], 0)}) == {"ts": (["uid-plain"], 0)}
    # Two unprotected pods go rather than one protected pod (as the scheduler prefers them)...
    bigger = prioritized("urgent", "0.47", 1000, node=None)
    assert preempt(protected_gpu(budgets=True), bigger, {"ts": (["uid-plain"], 0)}) == {
        "ts": (["uid-tiny-2", "uid-plain"], 0)}
    # ...and where no set of them makes the room, the protected pod goes and counts as a violation.
    biggest = prioritized("urgent", "0.53", 1000, node=None)
    assert preempt(protected_gpu(budgets=True), biggest, {"ts": (["uid-plain"], 0)}) == {
        "ts": (["uid-plain", "uid-protected"], 1)}


def test_preempt_counts_the_schedulers_other_victims_at_most_as_it_did() -> None:
    # A victim holding no GPU (its labels are not watched) counts as a violation where the scheduler
    # counted one; the scheduler's count for its GPU victims, replaced by vramguard's, does not.
    urgent = prioritized("urgent", "0.4", 1000, node=None)
    state = protected_gpu(budgets=True)
    assert preempt(state, urgent, {"ts": (["uid-cpu-hog", "uid-protected"], 2)}) == {
        "ts": (["uid-cpu-hog", "uid-plain"], 1)}
    assert preempt(state, urgent, {"ts": (["uid-protected"], 1)}) == {"ts": (["uid-plain"], 0)}


def prioritized(name: str, utilization: str, priority: int, node: str | None = "ts",
                labels: dict[str, str] | None = None) -> dict[str, Any]:
    pod = vllm_pod(name, utilization, node, labels=labels)
    pod["spec"]["priority"] = priority
    return pod


def full_gpu() -> ClusterState:
    """One H100 time-sliced 4 ways, all four replicas held: 0.1 + 0.1 + 0.35 + 0.35 of its memory,
    each with vLLM's CUDA context (512 MiB) beside it, against a budget of 0.97 of it."""
    pods = [prioritized("small-1", "0.1", 1), prioritized("small-2", "0.1", 1),
            prioritized("big-1", "0.35", 1), prioritized("big-2", "0.35", 1)]
    state, _, _ = make([gpu_node("ts"), gpu_node("other")], pods)
    return state


def test_preempt_replaces_victims_blind_to_vram() -> None:
    state = full_gpu()
    pod = prioritized("urgent", "0.5", 1000, node=None)
    # kube-scheduler counted replicas: one small pod frees a replica but not the memory.
    accepted = preempt(state, pod, {"ts": (["uid-small-1", "uid-cpu-hog"], 0)})
    assert accepted == {"ts": (["uid-cpu-hog", "uid-big-1", "uid-big-2"], 0)}


def test_preempt_drops_a_node_no_eviction_helps() -> None:
    state = full_gpu()
    pod = prioritized("equal", "0.5", 1, node=None)  # the same priority: nobody may be evicted
    assert preempt(state, pod, {"ts": (["uid-small-1"], 0)}) == {}


@pytest.fixture
async def client() -> AsyncIterator[ServedClient]:
    state = full_gpu()
    synced = asyncio.Event()
    synced.set()
    app = build_app(Verbs(state, None), synced, Readiness(), CollectorRegistry())
    async with served(app) as test_client:
        yield test_client


async def test_preempt_wire_format_meta_victims(client: ServedClient) -> None:
    body = {"Pod": prioritized("urgent", "0.5", 1000, node=None),
            "NodeNameToMetaVictims": {"ts": {"Pods": [{"UID": "uid-small-1"}], "NumPDBViolations": 1}}}
    response = await client.post("/preempt", json=body)
    assert response.status == 200
    # The scheduler's count was for its own victim; vramguard's victims are protected by no budget.
    assert await response.json() == {"NodeNameToMetaVictims": {"ts": {
        "Pods": [{"UID": "uid-big-1"}, {"UID": "uid-big-2"}], "NumPDBViolations": 0}}}


@pytest.mark.parametrize(
    "victims",
    [{"Pods": [], "NumPDBViolations": 0}, {"Pods": None, "NumPDBViolations": 0}, None],
    ids=["empty-list", "null-pods", "null-victims"],
)
async def test_preempt_chooses_victims_for_a_candidate_with_none(client: ServedClient, victims: Any) -> None:
    # kubernetes/kubernetes#135486 (v1.38.0-beta.0): a node the filter extender refused but the built-in filters pass
    # is sent with no victims ("Preemption-capable scheduler extenders must now handle candidates with empty
    # victim lists"): vramguard names the pods whose VRAM makes room.
    body = {"Pod": prioritized("urgent", "0.5", 1000, node=None), "NodeNameToMetaVictims": {"ts": victims}}
    response = await client.post("/preempt", json=body)
    assert response.status == 200
    assert await response.json() == {"NodeNameToMetaVictims": {"ts": {
        "Pods": [{"UID": "uid-big-1"}, {"UID": "uid-big-2"}], "NumPDBViolations": 0}}}


async def test_preempt_wire_format_full_victims(client: ServedClient) -> None:
    body = {"Pod": prioritized("urgent", "0.5", 1000, node=None),
            "NodeNameToVictims": {"ts": {"Pods": [prioritized("small-1", "0.1", 1)], "NumPDBViolations": 0}}}
    result = await (await client.post("/preempt", json=body)).json()
    assert [p["UID"] for p in result["NodeNameToMetaVictims"]["ts"]["Pods"]] == ["uid-big-1", "uid-big-2"]


@pytest.mark.parametrize(
    "body",
    [b'{"Pod": {}, "NodeNameToMetaVictims": 3}', b'{"NodeNameToMetaVictims": {}}',
     b'{"Pod": {}, "NodeNameToMetaVictims": {"n": {"Pods": [{"UID": 7}]}}}'],
    ids=["victims-not-a-map", "no-pod", "uid-not-a-string"],
)
async def test_preempt_bad_input_is_400(client: ServedClient, body: bytes) -> None:
    response = await client.post("/preempt", data=body, headers={"Content-Type": "application/json"})
    assert response.status == 400


async def test_preempt_not_synced_is_503() -> None:
    _, verbs, _ = make([gpu_node("ts")])
    app = build_app(verbs, asyncio.Event(), Readiness(), CollectorRegistry())
    async with served(app) as test_client:
        response = await test_client.post("/preempt", json={"Pod": vllm_pod("p", "0.2"), "NodeNameToMetaVictims": {}})
        assert response.status == 503


@pytest.mark.parametrize(("utilization", "priority", "verdict"), [
    ("0.5", 1, "unresolvable"),
    ("0.5", 1000, "failed"),
    # 0.97 of the GPU is its whole budget, and the CUDA context (512 MiB) comes on top of vLLM's share.
    ("0.97", 1000, "unresolvable"),
], ids=["equal-priority-nothing-helps", "lower-priority-victims-help", "bigger-than-the-budget"])
async def test_filter_marks_vram_failures_no_eviction_cures(utilization: str, priority: int, verdict: str) -> None:
    state = full_gpu()
    pod = prioritized("new", utilization, priority, node=None)
    outcome = mark_unhelpable(state, pod, await Verbs(state, None).filter(pod, ["ts"]))
    assert outcome.passing == []
    assert list(getattr(outcome, verdict)) == ["ts"]
    if verdict == "unresolvable" and priority == 1:
        # The filter's reason as it is: the scheduler's event counts nodes failing alike as one line,
        # and its own message says that preemption does not help.
        assert outcome.unresolvable["ts"] == (await Verbs(state, None).filter(pod, ["ts"])).failed["ts"]


async def test_filter_over_http_marks_unhelpable(client: ServedClient) -> None:
    body = {"Pod": prioritized("equal", "0.5", 1, node=None), "NodeNames": ["ts"]}
    result = await (await client.post("/filter", json=body)).json()
    assert list(result["FailedAndUnresolvableNodes"]) == ["ts"] and result["FailedNodes"] == {}


async def test_full_eviction_checks_are_capped_per_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the cap a failure stays resolvable (preempt still drops the node): bounded filter work."""
    pods = []
    for node in ("a", "b"):
        pods += [prioritized(f"{node}-high", "0.5", 500, node=node), prioritized(f"{node}-low", "0.45", 1, node=node)]
    state, verbs, _ = make([gpu_node("a"), gpu_node("b")], pods)
    pod = prioritized("new", "0.5", 100, node=None)
    outcome = await verbs.filter(pod, ["a", "b"])
    assert sorted(mark_unhelpable(state, pod, outcome).unresolvable) == ["a", "b"]
    monkeypatch.setattr("extender.preemption.EVICTION_CHECKS_PER_FILTER", 1)
    capped = mark_unhelpable(state, pod, outcome)
    assert (list(capped.unresolvable), list(capped.failed)) == (["a"], ["b"])
    assert preempt(state, pod, {"b": (["uid-b-low"], 0)}) == {}


def test_priority_survives_the_slim_watch_objects() -> None:
    """The informers keep slim pods: the priority must be among the fields kept, or every holder looks evictable."""
    state, _, _ = make([gpu_node("ts")])
    state.pods.upsert(slim_pod(prioritized("vip", "0.8", 2_000_000)))
    assert state.priority("uid-vip") == 2_000_000
    assert preempt(state, prioritized("new", "0.5", 1000, node=None), {"ts": (["uid-vip"], 0)}) == {}
    state.pods.delete(slim_pod(prioritized("vip", "0.8", 2_000_000)))
    assert state.priority("uid-vip") == 0


async def test_nodes_failing_alike_share_one_unhelpable_reason() -> None:
    """Equal reasons stay one string object (the scheduler counts them as one line; a 5,000-node
    answer builds one text, not 5,000)."""
    pods = [prioritized(f"{node}-equal", "0.9", 1, node=node) for node in ("a", "b", "c")]
    state, verbs, _ = make([gpu_node("a"), gpu_node("b"), gpu_node("c")], pods)
    pod = prioritized("new", "0.5", 1, node=None)
    marked = mark_unhelpable(state, pod, await verbs.filter(pod, ["a", "b", "c"]))
    assert sorted(marked.unresolvable) == ["a", "b", "c"]
    assert len({id(text) for text in marked.unresolvable.values()}) == 1


async def test_lowest_priorities_kept_per_node_follow_its_holdings() -> None:
    """The lowest priority kept per node answers as the walk over its pods does, also after the
    pod there is replaced by one of lower priority (a new generation: eviction now helps), and for
    a holder the watch has not shown (in flight: its priority may come later, so the exact check
    decides)."""
    high = prioritized("high", "0.5", 50)
    state, verbs, _ = make([gpu_node("ts")], [high])
    lowest = LowestPriorities()
    pod = prioritized("new", "0.5", 10, node=None)

    async def marked(kept: LowestPriorities | None) -> tuple[list[str], list[str]]:
        outcome = mark_unhelpable(state, pod, await verbs.filter(pod, ["ts"]), kept)
        return list(outcome.failed), list(outcome.unresolvable)

    assert await marked(lowest) == await marked(None) == ([], ["ts"])  # only a pod of higher priority
    assert lowest.lowest(state, "ts") == 50
    state.pods.delete(slim_pod(high))
    state.pods.upsert(slim_pod(prioritized("low", "0.5", 1)))
    assert await marked(lowest) == await marked(None) == (["ts"], [])  # evicting it makes room
    state.ledger.reserve("ts", PodRef("uid-flying", "default", "flying"), claims_of("0.05", "uid-flying").claims)
    assert lowest.lowest(state, "ts") == -math.inf


def test_lowest_priority_of_a_node_without_gpu_pods_is_infinite() -> None:
    state, _, _ = make([gpu_node("ts")])
    assert LowestPriorities().lowest(state, "ts") == math.inf
