"""The bounded caches drop the least recently used entry, not the oldest: a template or pod shape in
constant use stays cached however many others pass by."""

from __future__ import annotations

from typing import Any

import pytest

import extender.verbs
import vramguard.cluster
from tests.builders import gpu_node, vllm_pod
from tests.test_extender import make


def test_claims_of_a_template_in_use_survive_newer_templates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vramguard.cluster, "CACHED_DEMANDS", 2)
    state, _verbs, _fake = make([gpu_node("h100")])

    def claims(name: str, utilization: str) -> Any:
        pod = vllm_pod(name, utilization)
        return state.claims_for(pod, state.choose_class(pod)).claims

    used = claims("a0", "0.20")
    claims("b0", "0.30")
    assert claims("a1", "0.20") is used  # a hit: the template in use is now the most recent
    claims("c0", "0.40")  # evicts the least recently used template, 0.30
    # Replicas share one claims tuple while their template is cached (a FIFO would have dropped it).
    assert claims("a2", "0.20") is used


async def test_verdicts_of_a_shape_in_use_survive_newer_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extender.verbs, "CACHED_POD_SHAPES", 2)
    state, verbs, _fake = make([gpu_node("a"), gpu_node("b")])
    # Verdicts judged one by one are the ones cached per node (the bound index decides again).
    state.ledger.split_by_bound = lambda *_: None  # type: ignore[method-assign]
    computed: list[str] = []
    original = extender.verbs.filter_nodes

    def counting(ledger: Any, nodes: list[str], *args: Any) -> Any:
        computed.extend(nodes)
        return original(ledger, nodes, *args)

    monkeypatch.setattr(extender.verbs, "filter_nodes", counting)
    await verbs.filter(vllm_pod("a0", "0.20"), ["a", "b"])
    await verbs.filter(vllm_pod("b0", "0.30"), ["a", "b"])
    await verbs.filter(vllm_pod("a1", "0.20"), ["a", "b"])  # a hit: nothing computed
    assert computed == ["a", "b", "a", "b"]
    await verbs.filter(vllm_pod("c0", "0.40"), ["a", "b"])  # evicts the shape 0.30
    computed.clear()
    outcome = await verbs.filter(vllm_pod("a2", "0.20"), ["a", "b"])
    assert outcome.passing == ["a", "b"]
    assert computed == []  # still cached: a FIFO would have dropped 0.20, the oldest shape
    await verbs.filter(vllm_pod("b1", "0.30"), ["a", "b"])
    assert computed == ["a", "b"]  # the least recently used shape was the one dropped


async def test_prioritize_rescores_only_the_nodes_changed_since_its_last_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from extender.verbs import Verbs  # noqa: PLC0415
    from tests.test_extender import schedule  # noqa: PLC0415

    state, verbs, fake = make([gpu_node("a"), gpu_node("b"), gpu_node("c")])
    scored: list[str] = []
    original = extender.verbs.score_node

    def counting(ledger: Any, node: str, *args: Any, **kwargs: Any) -> int:
        scored.append(node)
        return original(ledger, node, *args, **kwargs)

    monkeypatch.setattr(extender.verbs, "score_node", counting)
    nodes = ["a", "b", "c"]
    first = await verbs.prioritize(vllm_pod("r0", "0.20"), nodes)
    assert scored == nodes
    scored.clear()
    assert await verbs.prioritize(vllm_pod("r1", "0.20"), nodes) == first  # another replica: lookups only
    assert scored == []
    assert await schedule(verbs, fake, vllm_pod("r2", "0.20"), ["a"]) == "a"
    scored.clear()
    after = await verbs.prioritize(vllm_pod("r3", "0.20"), nodes)
    assert scored == ["a"]  # the bound pod changed node a alone
    fresh = Verbs(state, fake)  # type: ignore[arg-type]
    assert after == await fresh.prioritize(vllm_pod("r4", "0.20"), nodes)  # as if computed afresh
    assert after["a"] != first["a"]
