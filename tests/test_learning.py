"""Allowances learned from what pods really hold (:mod:`vramguard.learning`): samples, the robust
statistics, bounded steps, ageing, downward learning, the stored form, and the ledger using them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.builders import H100_MIB, gpu_node, vllm_pod
from tests.test_model_accuracy import NOW, cluster, reported
from vramguard.cli.explain import explain_object, render_text
from vramguard.cli.judge import Judge, snapshot_of
from vramguard.cli.kubectl_vram import ClusterSnapshot
from vramguard.cluster import ClusterState
from vramguard.demand.allowances import LEARNED
from vramguard.learning import (
    MAX_KEYS,
    MAX_NAMESPACES,
    MAX_PODS,
    LearnedTable,
    LearnedTableError,
    LearningRules,
    LearnKey,
    LearnSample,
    learning_samples,
)
from vramguard.policy import Policy, PolicyError, default_policy
from vramguard.quantity import GiB, MiB

H100 = H100_MIB * MiB
PRODUCT = "NVIDIA H100 80GB HBM3"
IMAGE = "vllm/vllm-openai:v0.25.1"
"""Model Runner V2's release: CUDA graphs outside the share, estimated at 1 GiB (vllm-project/vllm#49224)."""
KEY = LearnKey("vllm", "0.25.1", PRODUCT, 1)
RULES = LearningRules(step_bytes=4 * GiB)
CONTEXT = 512 * MiB


def pod(name: str, namespace: str = "default", node: str = "n", utilization: str = "0.3") -> dict[str, Any]:
    made = vllm_pod(name, utilization, node=node, namespace=namespace)
    made["spec"]["containers"][0]["image"] = IMAGE
    return made


def certain(utilization: float = 0.3) -> int:
    """The share and the CUDA context on an H100: what vLLM certainly holds."""
    return int(utilization * H100) + CONTEXT


def sample(uid: str, beyond: int, namespace: str = "a", key: LearnKey = KEY) -> LearnSample:
    return LearnSample(key, namespace, uid, uid, beyond, GiB, H100 - certain())


def published(table: LearnedTable, rules: LearningRules = RULES, rounds: int = 10) -> int | None:
    for _ in range(rounds):
        table.publish(rules)
    value = table.allowances(rules).get(KEY)
    return value.bytes if value is not None else None


def test_a_sample_is_what_a_pod_holds_beyond_its_share_and_context() -> None:
    node = reported(gpu_node("n"), {"uid-p": {"0": certain() + 15 * GiB}})
    [found] = learning_samples(cluster([node], [pod("p")]))
    assert found.key == KEY
    assert (found.namespace, found.uid, found.name) == ("default", "uid-p", "p")
    assert found.beyond == 15 * GiB
    assert found.static == GiB, "the static estimate is the 1 GiB of CUDA graphs"
    assert found.room == H100 - certain()


def test_declarations_and_unknown_engines_give_no_sample() -> None:
    declared = pod("d")
    declared["metadata"]["annotations"] = {"vramguard.io/vram": "30Gi"}
    node = reported(gpu_node("n"), {"uid-d": {"0": 40 * GiB}})
    assert list(learning_samples(cluster([node], [declared]))) == []


def test_nothing_is_published_below_the_minimum_of_pods_then_it_moves_by_bounded_steps() -> None:
    table = LearnedTable()
    table.observe(sample("p1", 15 * GiB), NOW)
    assert published(table, RULES, rounds=1) is None, "one pod is not enough (min_pods 2)"
    table.observe(sample("p2", 15 * GiB), NOW)
    changes = table.publish(RULES)
    assert [(c.before, c.after) for c in changes] == [(None, GiB + 4 * GiB)], "from the static estimate, one step"
    assert changes[0].single_namespace and "ONE namespace" in changes[0].message()
    assert published(table) == 15 * GiB
    assert table.publish(RULES) == [], "no change once there"


def test_one_namespace_among_three_cannot_balloon_the_allowance_and_is_reported() -> None:
    table = LearnedTable()
    for i in range(3):
        table.observe(sample(f"liar{i}", 60 * GiB, "greedy"), NOW)
    for namespace in ("b", "c"):
        for i in range(2):
            table.observe(sample(f"{namespace}{i}", 3 * GiB, namespace), NOW)
    assert published(table) == 3 * GiB
    assert table.outliers() == {KEY: ("greedy",)}


def test_a_pod_keeps_its_peak_and_a_namespace_counts_what_most_of_its_pods_hold() -> None:
    table = LearnedTable()
    table.observe(sample("p1", 10 * GiB), NOW)
    table.observe(sample("p1", 2 * GiB), NOW + 1)
    table.observe(sample("p2", 2 * GiB), NOW)
    table.observe(sample("p3", 12 * GiB), NOW)
    assert published(table) == 10 * GiB, "peaks 10, 2, 12: the lower median"


def test_the_value_never_passes_the_device() -> None:
    table = LearnedTable()
    for uid in ("p1", "p2"):
        table.observe(sample(uid, 200 * GiB), NOW)
    assert published(table, rounds=40) == H100 - certain()


def test_old_measurements_age_out_and_the_key_is_forgotten() -> None:
    table = LearnedTable()
    table.observe(sample("p1", 8 * GiB), NOW)
    table.observe(sample("p2", 8 * GiB), NOW + 100)
    assert published(table) == 8 * GiB
    table.expire(NOW + 150, max_age=120)
    assert table.evidence(KEY) == (1, 1)
    assert published(table, rounds=1) is None, "below the minimum again: the static estimates count"
    table.expire(NOW + 1000, max_age=120)
    assert len(table) == 0


def test_below_the_static_estimate_counts_only_with_downward_learning_and_enough_evidence() -> None:
    table = LearnedTable()
    for i in range(4):
        table.observe(sample(f"p{i}", 256 * MiB), NOW)
    assert published(table) is None, "upward only by default"
    downward = LearningRules(step_bytes=4 * GiB, downward=True, downward_min_pods=4, downward_min_age_seconds=60)
    assert published(table, downward) is None, "not measured for long enough"
    table.observe(sample("p0", 256 * MiB), NOW + 61)
    assert published(table, downward) == 256 * MiB
    assert table.allowances(downward)[KEY].downward


def test_the_table_is_bounded() -> None:
    table = LearnedTable()
    for i in range(MAX_PODS + 3):
        table.observe(sample(f"p{i}", GiB), NOW + i)
    assert table.evidence(KEY) == (MAX_PODS, 1), "the least recently measured pods go first"
    for i in range(MAX_NAMESPACES + 3):
        table.observe(sample("x", GiB, f"ns{i}"), NOW + 100 + i)
    assert table.evidence(KEY) == (MAX_NAMESPACES, MAX_NAMESPACES), "and the least recently measured namespaces"
    for i in range(MAX_KEYS + 5):
        table.observe(sample("x", GiB, key=LearnKey("vllm", f"0.{i}.0", PRODUCT, 1)), NOW + 1000 + i)
    assert len(table) == MAX_KEYS
    assert len(table.to_json()) < 512 * 1024


def test_the_stored_form_round_trips_and_junk_is_refused() -> None:
    table = LearnedTable()
    for uid in ("p1", "p2"):
        table.observe(sample(uid, 9 * GiB), NOW)
    table.publish(RULES)
    text = table.to_json()
    again = LearnedTable.from_json(text)
    assert again.to_json() == text
    assert again.allowances(RULES) == table.allowances(RULES)

    row = json.loads(text)["keys"][0]
    for bad in (
        "not json", "[]", '{"version": 2, "keys": []}', "x" * (600 * 1024),
        json.dumps({"version": 1, "keys": [{**row, "gpus": True}]}),
        json.dumps({"version": 1, "keys": [{**row, "published": -1}]}),
        json.dumps({"version": 1, "keys": [{**row, "static": "1Gi"}]}),
        json.dumps({"version": 1, "keys": [{**row, "namespaces": {"a": {"p": [1, 2]}}}]}),
        json.dumps({"version": 1, "keys": [{**row, "engine": ""}]}),
        json.dumps({"version": 1, "keys": [{k: v for k, v in row.items() if k != "room"}]}),
        json.dumps({"version": 1, "keys": [{**row, "layout": 4}]}),
        json.dumps({"version": 1, "keys": [{**row, "layout": "x" * 300}]}),
    ):
        with pytest.raises(LearnedTableError):
            LearnedTable.from_json(bad)
    # A table stored before keys had a layout reads as keys without one (no parallel size above 1).
    older = json.dumps({"version": 1, "keys": [{k: v for k, v in row.items() if k != "layout"}]})
    assert LearnedTable.from_json(older).to_json() == text


def learned_state(beyond: int) -> ClusterState:
    nodes = [reported(gpu_node("n"), {"uid-p1": {"0": certain() + beyond}}),
             reported(gpu_node("m"), {"uid-p2": {"0": certain() + beyond}})]
    state = cluster(nodes, [pod("p1"), pod("p2", node="m")])
    table = LearnedTable()
    for found in learning_samples(state):
        table.observe(found, NOW)
    for _ in range(10):
        table.publish(RULES)
    state.set_learned(table.allowances(RULES))
    return state


def held_on_h100(state: ClusterState, made: dict[str, Any]) -> int:
    [claim] = state.claims_for(made, state.choose_class(made)).claims
    return claim.bytes_on(H100, H100, PRODUCT)


def test_the_next_pod_of_the_key_is_counted_with_what_was_learned() -> None:
    state = learned_state(15 * GiB)
    assert held_on_h100(state, pod("next")) == certain() + 15 * GiB
    [container] = state.record_demand(state.records["uid-p1"]).containers
    assert container.claim is not None
    [extra] = [a for a in container.claim.allowances if a.name == LEARNED]
    assert extra.bytes_for(PRODUCT) == 14 * GiB, "15 GiB learned, 1 GiB of it the static graphs estimate"
    assert "learned from 2 pods in 1 namespace on NVIDIA H100 80GB HBM3" in extra.source
    other = pod("other")
    other["spec"]["containers"][0]["image"] = "vllm/vllm-openai:v0.24.0"
    baseline = ClusterState(default_policy())
    assert held_on_h100(state, other) == held_on_h100(baseline, other), "another version is not this key"
    assert state.set_learned(state.learned) is False


def test_less_than_the_static_estimate_changes_nothing() -> None:
    state = learned_state(512 * MiB)
    assert state.learned == {}
    assert held_on_h100(state, pod("next")) == certain() + GiB


def test_the_policy_sets_the_rules_and_refuses_nonsense() -> None:
    policy = Policy.from_yaml("classes: {best-effort: {sharing: [time-slicing]}}\n"
                              "learning: {min_pods: 3, step: 512Mi, max_age_hours: 24, downward: true}\n")
    rules = policy.learning.rules()
    assert (rules.min_pods, rules.step_bytes, rules.max_age_seconds, rules.downward) == (3, 512 * MiB, 86400.0, True)
    for bad in ("{step: 1}", "{min_pods: 0}", "{max_age_hours: 0}", "{unknown: 1}", "{step: lots}"):
        with pytest.raises(PolicyError):
            Policy.from_yaml(f"classes: {{best-effort: {{sharing: [time-slicing]}}}}\nlearning: {bad}\n")
    assert default_policy().learning.rules() == LearningRules()
    off = LearningRules(enabled=False)
    table = LearnedTable()
    for uid in ("p1", "p2"):
        table.observe(sample(uid, 9 * GiB), NOW)
    assert table.publish(off) == [] and table.allowances(off) == {}


def test_explain_and_plan_show_and_count_what_the_extender_learned() -> None:
    state = learned_state(15 * GiB)
    report = explain_object({**pod("next"), "kind": "Pod", "apiVersion": "v1"}, H100, learned=state.learned)
    [container] = report["containers"]
    [learned] = [a for a in container["allowances"] if a["name"] == LEARNED]
    assert learned["bytes_by_product"] == {PRODUCT: 14 * GiB} and learned["estimate"]
    text = render_text([report], H100)
    assert "+ learned beyond the estimates +14.0 GiB on NVIDIA H100 80GB HBM3 (estimate): learned from 2 pods" in text

    table = LearnedTable()
    for found in learning_samples(state):
        table.observe(found, NOW)
    for _ in range(20):  # 1 GiB a round by default
        table.publish(default_policy().learning.rules())
    stored = ClusterSnapshot(nodes=[gpu_node("n")], learned=table.to_json())
    judge = Judge(default_policy(), snapshot_of([], stored))
    assert judge.state.learned[KEY].bytes == 15 * GiB, "plan and explain --cluster size pods as the extender does"
    junk = Judge(default_policy(), snapshot_of([], ClusterSnapshot(nodes=[gpu_node("n")], learned="{junk")))
    assert junk.state.learned == {}
