"""Findings are data: a code and fields, rendered to text at the edge; nothing reads the text back."""

from __future__ import annotations

from typing import Any

import pytest
from test_admission import labelled, pod, review, vllm
from test_kubectl_vram import snapshot
from test_kubectl_vram import vllm_pod as bound_vllm_pod

from vramguard.admission import Code
from vramguard.cli.audit import audit_snapshot
from vramguard.demand import derive_pod_demand
from vramguard.ledger import Invariant, InvariantViolation
from vramguard.policy import default_policy

GPU = "GPU 0 (NVIDIA H100)"

INVARIANT_MESSAGES = {
    Invariant.REPLICAS_HELD: (
        InvariantViolation(Invariant.REPLICAS_HELD, "n", "nvidia.com/gpu", {"held": 5, "replicas": 4}),
        "n nvidia.com/gpu: 5 replicas held, 4 exist"),
    Invariant.KNOWN_CLAIMS: (InvariantViolation(Invariant.KNOWN_CLAIMS, "n", GPU, {"claims": 3, "replicas": 2}),
                             f"n {GPU}: 3 known claims, 2 replicas"),
    Invariant.OVER_BUDGET: (InvariantViolation(Invariant.OVER_BUDGET, "n", GPU, {"worst": 1600, "budget": 900}),
                            f"n {GPU}: may hold 1600 B (1600 B), budget 900 B (900 B)"),
    Invariant.MPS_SHARE: (InvariantViolation(Invariant.MPS_SHARE, "n", GPU, {"claims": 2}),
                          f"n {GPU}: 2 claims above one MPS replica's share"),
    Invariant.RESOURCE_MISSING: (InvariantViolation(Invariant.RESOURCE_MISSING, "n", "team-a/p (u1)"),
                                 "pod team-a/p (u1) asks for resources node n lacks"),
    Invariant.COUNTERS: (InvariantViolation(Invariant.COUNTERS, "n", "0", {
        "bytes": 10, "replicas": 1, "recount_bytes": 20, "recount_replicas": 2}),
        "n 0: counters say 10 B in 1 replicas, recount 20 B in 2"),
    Invariant.UNKNOWN_LIST: (
        InvariantViolation(Invariant.UNKNOWN_LIST, "n", "nvidia.com/gpu", {"listed": 1, "recount": 0}),
        "n nvidia.com/gpu: 1 unknown claims listed, recount 0"),
}


def test_every_invariant_has_a_message() -> None:
    assert set(INVARIANT_MESSAGES) == set(Invariant)


@pytest.mark.parametrize(
    ("violation", "message"), INVARIANT_MESSAGES.values(), ids=[str(k) for k in INVARIANT_MESSAGES]
)
def test_invariant_messages_keep_their_text(violation: InvariantViolation, message: str) -> None:
    assert violation.message == message


def test_audit_reports_an_overcommitted_gpu_whatever_its_product_is_called() -> None:
    """A node's product label (written by whoever labels nodes) cannot hide an overcommitted GPU."""
    snap = snapshot(*(bound_vllm_pod(f"p{i}", 0.3, "ts") for i in range(4)))
    labels: dict[str, Any] = snap.nodes[0]["metadata"]["labels"]
    labels["nvidia.com/gpu.product"] = "NVIDIA-counters-say-SHARED"
    report = audit_snapshot(snap, default_policy())
    assert [(r.node, r.gpu) for r in report.overcommitted] == [("ts", "0")]
    assert any("counters say" in p and "may hold" in p for p in report.ledger_problems), report.ledger_problems


def test_engines_tag_the_warning_about_their_default() -> None:
    demand = derive_pod_demand(pod(vllm()))
    (container,) = demand.containers
    assert container.implicit_default
    assert container.default_warning is not None and container.default_warning in demand.warnings
    explicit = derive_pod_demand(pod(vllm("vllm", "--gpu-memory-utilization", "0.5"))).containers[0]
    assert explicit.default_warning is None


def test_a_forbidden_default_is_a_problem_and_its_warning_is_not_repeated() -> None:
    strict = review(labelled(pod(vllm()), "guaranteed"), mode="warn")
    default_warning = derive_pod_demand(pod(vllm())).containers[0].default_warning
    assert [(f.code, f.container) for f in strict.problems if f.code is Code.IMPLICIT_DEFAULT] == [
        (Code.IMPLICIT_DEFAULT, "vllm")
    ]
    assert default_warning not in strict.notes
    relaxed = review(pod(vllm()), mode="warn")
    assert not any(f.code is Code.IMPLICIT_DEFAULT for f in relaxed.problems)
    assert any(f.code is Code.DEMAND_WARNING and f.message == default_warning for f in relaxed.remarks)


def test_decision_texts_are_rendered_from_its_findings() -> None:
    decision = review(labelled(pod(vllm()), "guaranteed"), mode="enforce")
    assert decision.violations == tuple(f.message for f in decision.problems)
    assert decision.notes == tuple(f.message for f in decision.remarks)
    assert not decision.allowed and decision.message is not None
    assert all(f.message in decision.message for f in decision.problems)
