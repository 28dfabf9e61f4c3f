"""The extender's verdict cache: a verdict that left a pod's own holding out is never reused for another pod."""

from __future__ import annotations

from tests.builders import gpu_node, vllm_pod
from tests.test_extender import make, schedule


async def test_verdict_for_a_pod_being_bound_is_not_reused_for_its_twin() -> None:
    state, verbs, fake = make([gpu_node("h100")])
    assert [await schedule(verbs, fake, vllm_pod(f"p{i}", "0.30"), ["h100"]) for i in range(2)] == ["h100"] * 2
    third = vllm_pod("third", "0.30")
    fake.pods["third"] = third
    assert (await verbs.filter(third, ["h100"])).passing == ["h100"]
    assert await verbs.bind("third", "default", "uid-third", "h100") == ""  # the watch has not seen it yet
    # Asked again while being bound, the third pod does not compete with itself ...
    assert (await verbs.filter(third, ["h100"])).passing == ["h100"]
    # ... but a fourth pod of the same shape sees the third's reservation.
    fourth = vllm_pod("fourth", "0.30")
    outcome = await verbs.filter(fourth, ["h100"])
    assert outcome.passing == [] and "VRAM budget" in outcome.failed["h100"]
    assert state.ledger.check_invariants() == []


async def test_cached_verdicts_follow_the_generation_of_each_node() -> None:
    _state, verbs, fake = make([gpu_node("a"), gpu_node("b")])
    pod = vllm_pod("p0", "0.45")
    assert (await verbs.filter(pod, ["a", "b"])).passing == ["a", "b"]
    assert await schedule(verbs, fake, vllm_pod("big", "0.55"), ["a"]) == "a"  # 0.55 + 0.45 > 0.97
    outcome = await verbs.filter(vllm_pod("p1", "0.45"), ["a", "b"])
    assert outcome.passing == ["b"] and list(outcome.failed) == ["a"]


async def test_cached_outcomes_equal_fresh_ones_through_a_scheduling_wave() -> None:
    """Snapshots and per-node verdicts, through binds, deletions and changing candidate lists,
    always give what a verbs object without any cache gives."""
    import random  # noqa: PLC0415

    from extender.verbs import Verbs  # noqa: PLC0415

    rng = random.Random(3)
    nodes = [gpu_node(f"n{i}", gpus=rng.choice([1, 2])) for i in range(12)]
    state, verbs, fake = make(nodes)
    names = [n["metadata"]["name"] for n in nodes]
    bound: list[str] = []
    for step in range(60):
        pod = vllm_pod(f"p{step}", rng.choice(["0.20", "0.30", "0.45"]))
        candidates = names if rng.random() < 0.6 else rng.sample(names, rng.randrange(1, len(names)))
        cached = await verbs.filter(pod, candidates)
        fresh = await Verbs(state, None).filter(pod, candidates)
        assert sorted(cached.passing) == sorted(fresh.passing)
        assert cached.failed == fresh.failed and cached.unresolvable == fresh.unresolvable
        if cached.passing and rng.random() < 0.7:
            fake.pods[pod["metadata"]["name"]] = pod
            node = rng.choice(cached.passing)
            assert await verbs.bind(pod["metadata"]["name"], "default", pod["metadata"]["uid"], node) == ""
            fake.deliver(pod["metadata"]["name"])
            bound.append(pod["metadata"]["name"])
        if bound and rng.random() < 0.3:
            state.pods.delete(fake.pods[bound.pop(rng.randrange(len(bound)))])
    assert state.ledger.check_invariants() == []


async def test_a_pod_bound_elsewhere_keeps_its_holding_when_bind_is_retried() -> None:
    """kube-scheduler may time out on a bind that then succeeds, and retry the pod on another node."""
    state, verbs, fake = make([gpu_node("a"), gpu_node("b")])
    assert await schedule(verbs, fake, vllm_pod("p", "0.30"), ["a"]) == "a"
    error = await verbs.bind("p", "default", "uid-p", "b")
    assert "already bound to a" in error
    holding = state.ledger.holding("uid-p")
    assert holding is not None and holding[1] == "a"
