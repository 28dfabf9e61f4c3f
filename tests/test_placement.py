"""Placement: filter verdicts and their messages, scores, and the GPUs chosen at bind."""

from __future__ import annotations

import json
from fractions import Fraction
from typing import Any

import pytest

from vramguard.codecs import ENFORCE_LABEL, QOS_CLASS_LABEL
from vramguard.demand.model import ContainerDemand, PodDemand, Vram
from vramguard.inventory import Gpu, NodeInventory, read_inventory
from vramguard.ledger import Claim, Ledger, PodRef
from vramguard.placement import (
    PodClaims,
    Rule,
    Verdict,
    apply_intended,
    choose_gpus,
    filter_node,
    pod_claims,
    score_node,
)
from vramguard.policy import ClassChoice, Policy, default_policy
from vramguard.quantity import GiB, MiB, format_bytes

POLICY = default_policy()
BEST_EFFORT = POLICY.choose_class({}, {})
GUARANTEED = POLICY.choose_class({QOS_CLASS_LABEL: "guaranteed"}, {})
BURSTABLE = POLICY.choose_class({QOS_CLASS_LABEL: "burstable"}, {})
SHARED = {mode: POLICY.choose_class({}, {QOS_CLASS_LABEL: "shared", ENFORCE_LABEL: mode})
          for mode in ("enforce", "warn", "audit")}
GUARANTEED_AUDIT = POLICY.choose_class({QOS_CLASS_LABEL: "guaranteed"}, {ENFORCE_LABEL: "audit"})
REJECTING = Policy.from_yaml(
    "default_class: strict\nclasses: {strict: {sharing: [time-slicing], unknown_vram: reject}}"
).choose_class({}, {})


def gfd_node(name: str, *, count: int = 1, replicas: int = 4, sharing: str = "time-slicing",
             memory_mib: int = 81559, product: str = "NVIDIA-H100-80GB-HBM3") -> dict[str, Any]:
    labels = {
        "nvidia.com/gpu.count": str(count),
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.memory": str(memory_mib),
        "nvidia.com/gpu.replicas": str(replicas),
        "nvidia.com/gpu.sharing-strategy": sharing,
    }
    return {"metadata": {"name": name, "labels": labels},
            "status": {"allocatable": {"nvidia.com/gpu": str(count * replicas)}}}


def mig_node(name: str) -> dict[str, Any]:
    labels = {
        "nvidia.com/gpu.count": "1", "nvidia.com/gpu.replicas": "0", "nvidia.com/gpu.memory": "81559",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/mig.strategy": "mixed",
        "nvidia.com/mig-3g.40gb.count": "2", "nvidia.com/mig-3g.40gb.memory": "40448",
    }
    return {"metadata": {"name": name, "labels": labels},
            "status": {"allocatable": {"nvidia.com/mig-3g.40gb": "2"}}}


def ledger_of(*nodes: dict[str, Any], policy: Policy = POLICY) -> Ledger:
    ledger = Ledger(policy.budget_rule())
    for obj in nodes:
        ledger.upsert_node(read_inventory(obj))
    return ledger


def container(vram: Vram | None, *, name: str = "vllm", gpus: int = 1, resource: str = "nvidia.com/gpu",
              init: bool = False, sidecar: bool = False) -> ContainerDemand:
    return ContainerDemand(name=name, resource=resource, gpus=gpus, init=init, sidecar=sidecar, declared=vram)


def demand(*containers: ContainerDemand) -> PodDemand:
    return PodDemand(tuple(containers))


def hold(ledger: Ledger, node: str, uid: str, vram: Vram | None, choice: ClassChoice = BEST_EFFORT,
         **kwargs: Any) -> None:
    claims = pod_claims(demand(container(vram, **kwargs)), choice, uid)
    assert ledger.reserve(node, PodRef(uid, "team-a", uid), claims.claims).ok


GIB = Vram(bytes=GiB)


def gib(n: float) -> Vram:
    return Vram(bytes=int(n * GiB))


H100_BYTES = 81559 * MiB
H100_BUDGET = H100_BYTES * 97 // 100
"""A shared (time-sliced or MPS) H100's budget: the default policy keeps 3% of its memory free."""
BUDGET = format_bytes(H100_BUDGET)


def test_message_in_the_issues_style() -> None:
    ledger = ledger_of(gfd_node("h100"))
    hold(ledger, "h100", "a", Vram(bytes=H100_BUDGET - 8 * GiB))
    verdict = filter_node(ledger, "h100", pod_claims(demand(container(gib(24))), BEST_EFFORT, "b"), BEST_EFFORT)
    assert verdict.verdict is Verdict.FAIL
    assert verdict.message == (
        f"GPU 0 (NVIDIA H100 80GB HBM3): 8.0 GiB of {BUDGET} VRAM budget free, pod needs 24.0 GiB per GPU"
    )


def test_seed_scenario_four_pods_at_030() -> None:
    ledger = ledger_of(gfd_node("h100"))
    pods = [pod_claims(demand(container(Vram(fraction=Fraction(3, 10)))), BEST_EFFORT, f"p{i}") for i in range(4)]
    verdicts = []
    for claims in pods:
        verdict = filter_node(ledger, "h100", claims, BEST_EFFORT)
        verdicts.append(verdict.verdict)
        if verdict.ok:
            assignment = choose_gpus(ledger, "h100", claims, BEST_EFFORT)
            assert assignment is not None
            assert ledger.reserve("h100", PodRef(claims.uid), assignment.claims).ok
    assert verdicts == [Verdict.PASS] * 3 + [Verdict.FAIL]
    # A declaration is a total: no allowance on top of the 0.3.
    share = int(Fraction(3, 10) * H100_BYTES)
    assert filter_node(ledger, "h100", pods[3], BEST_EFFORT).message == (
        f"GPU 0 (NVIDIA H100 80GB HBM3): {format_bytes(H100_BUDGET - 3 * share)} of {BUDGET} VRAM budget free, "
        f"pod needs {format_bytes(share)} per GPU"
    )


FILTER_CASES = [
    # 78 GiB: under the GPU's 79.6 GiB of memory, over its budget.
    pytest.param(gfd_node("n"), demand(container(gib(78))), BEST_EFFORT, Verdict.UNRESOLVABLE,
                 f"GPU 0 (NVIDIA H100 80GB HBM3): {BUDGET} of {BUDGET} VRAM budget free, pod needs 78.0 GiB per GPU",
                 id="bigger-than-any-budget"),
    pytest.param(gfd_node("n"), demand(container(gib(10))), GUARANTEED, Verdict.UNRESOLVABLE,
                 "class guaranteed does not allow time-slicing GPUs (node offers time-slicing)",
                 id="class-forbids-time-slicing"),
    pytest.param(gfd_node("n", replicas=1, sharing="none"), demand(container(gib(10))), SHARED["enforce"],
                 Verdict.UNRESOLVABLE, "class shared does not allow unshared GPUs (node offers whole GPUs)",
                 id="shared-not-on-whole-gpus-in-enforce"),
    pytest.param(gfd_node("n", replicas=1, sharing="none"), demand(container(gib(10))), BEST_EFFORT,
                 Verdict.PASS, "", id="default-class-takes-a-whole-gpu"),
    pytest.param(mig_node("n"), demand(container(gib(10), resource="nvidia.com/mig-3g.40gb")), BEST_EFFORT,
                 Verdict.PASS, "", id="default-class-takes-a-mig-instance"),
    pytest.param(gfd_node("n"), demand(container(gib(10), resource="nvidia.com/mig-3g.40gb")), GUARANTEED,
                 Verdict.UNRESOLVABLE, "node offers no nvidia.com/mig-3g.40gb (it has nvidia.com/gpu)",
                 id="resource-missing"),
    pytest.param(mig_node("n"), demand(container(Vram(fraction=Fraction(1, 2)), resource="nvidia.com/mig-3g.40gb")),
                 GUARANTEED, Verdict.PASS, "", id="mig-for-guaranteed"),
    pytest.param(mig_node("n"), demand(container(gib(40), resource="nvidia.com/mig-3g.40gb")), GUARANTEED,
                 Verdict.UNRESOLVABLE,
                 # A MIG instance is one pod's alone: its budget is its whole memory (40448 MiB).
                 f"MIG 3g.40gb #0 (NVIDIA H100 80GB HBM3): {format_bytes(40448 * MiB)} of "
                 f"{format_bytes(40448 * MiB)} VRAM budget free, pod needs 40.0 GiB per GPU; also MIG 3g.40gb #1",
                 id="mig-instance-too-small"),
    pytest.param(gfd_node("n"), demand(container(None)), REJECTING, Verdict.UNRESOLVABLE,
                 "container vllm: VRAM unknown and class strict does not place such pods; declare it with the "
                 "annotation vramguard.io/vram (e.g. vramguard.io/vram.vllm: 16Gi)", id="unknown-vram-rejected"),
    pytest.param(gfd_node("n"), demand(container(None)), BEST_EFFORT, Verdict.PASS, "", id="unknown-vram-whole-gpu"),
    # One replica's share is half the budget: 38.6 GiB.
    pytest.param(gfd_node("n", replicas=2, sharing="mps"), demand(container(gib(39))), BURSTABLE,
                 Verdict.UNRESOLVABLE, "GPU 0 (NVIDIA H100 80GB HBM3): pod needs 39.0 GiB per GPU, more than the "
                 f"{format_bytes(H100_BUDGET // 2)} one of its 2 MPS replicas may use", id="mps-share-exceeded"),
    pytest.param(gfd_node("n", replicas=2, sharing="mps"), demand(container(None)), BURSTABLE, Verdict.PASS, "",
                 id="mps-unknown-takes-one-share"),
    pytest.param(gfd_node("n", count=2), demand(container(gib(40), gpus=2)), BEST_EFFORT, Verdict.UNRESOLVABLE,
                 f"GPU 0 (NVIDIA H100 80GB HBM3): {BUDGET} of {BUDGET} VRAM budget free, pod needs 80.0 GiB on it "
                 "(2 of its GPU replicas may be given the same GPU); also GPU 1", id="two-replicas-on-one-gpu"),
    pytest.param(gfd_node("n", count=1, replicas=1, sharing="none"), demand(container(gib(1), gpus=2)), GUARANTEED,
                 Verdict.UNRESOLVABLE, "pod needs 2 nvidia.com/gpu, node has 1 (1 free)",
                 id="more-devices-than-exist"),
    pytest.param({"metadata": {"name": "n", "labels": {}}}, demand(container(GIB)), BEST_EFFORT,
                 Verdict.UNRESOLVABLE, "node has no GPUs (no GPU Feature Discovery labels)", id="cpu-node"),
]


@pytest.mark.parametrize(("node", "pod", "choice", "verdict", "message"), FILTER_CASES)
def test_filter_on_an_empty_node(node: dict[str, Any], pod: PodDemand, choice: ClassChoice, verdict: Verdict,
                                 message: str) -> None:
    ledger = ledger_of(node)
    result = filter_node(ledger, "n", pod_claims(pod, choice, "uid"), choice)
    assert (result.verdict, result.message) == (verdict, message)


RULE_CASES = [
    pytest.param(gfd_node("n", replicas=1, sharing="none"), container(gib(10)), SHARED["enforce"],
                 Verdict.UNRESOLVABLE, Rule.CLASS_RULE, (), id="class-rule-enforced"),
    pytest.param(gfd_node("n", replicas=1, sharing="none"), container(gib(10)), SHARED["warn"],
                 Verdict.PASS, None, (Rule.CLASS_RULE,), id="class-rule-warned"),
    pytest.param(mig_node("n"), container(gib(10), resource="nvidia.com/mig-3g.40gb"), SHARED["audit"],
                 Verdict.PASS, None, (Rule.CLASS_RULE,), id="class-rule-audited"),
    pytest.param(gfd_node("n"), container(gib(10)), GUARANTEED_AUDIT, Verdict.UNRESOLVABLE, Rule.CLASS_GUARANTEE,
                 (), id="guarantee-holds-in-audit"),
    pytest.param(gfd_node("n"), container(gib(10)), BURSTABLE, Verdict.UNRESOLVABLE, Rule.CLASS_GUARANTEE,
                 (), id="mps-class-never-on-time-slicing"),
    pytest.param(gfd_node("n", replicas=1, sharing="none"), container(gib(100)), SHARED["audit"],
                 Verdict.UNRESOLVABLE, Rule.VRAM_BUDGET, (Rule.CLASS_RULE,), id="budget-holds-in-audit"),
    pytest.param(gfd_node("n"), container(gib(10), resource="nvidia.com/mig-3g.40gb"), BEST_EFFORT,
                 Verdict.UNRESOLVABLE, Rule.RESOURCE_MISSING, (), id="resource-missing"),
    pytest.param(gfd_node("n"), container(None), REJECTING, Verdict.UNRESOLVABLE, Rule.VRAM_UNKNOWN, (),
                 id="vram-unknown"),
]


@pytest.mark.parametrize(("node", "one", "choice", "verdict", "rule", "findings"), RULE_CASES)
def test_verdict_names_the_rule(node: dict[str, Any], one: ContainerDemand, choice: ClassChoice, verdict: Verdict,
                                rule: Rule | None, findings: tuple[Rule, ...]) -> None:
    """Class rules refuse only in enforce; the VRAM budget and a class's isolation guarantee in every mode."""
    result = filter_node(ledger_of(node), "n", pod_claims(demand(one), choice, "uid"), choice)
    assert (result.verdict, result.rule, tuple(f.rule for f in result.findings)) == (verdict, rule, findings)


def test_class_finding_is_data_rendered_at_the_edge() -> None:
    result = filter_node(ledger_of(mig_node("n")), "n",
                         pod_claims(demand(container(gib(10), resource="nvidia.com/mig-3g.40gb")), SHARED["warn"]),
                         SHARED["warn"])
    assert [f.to_json() for f in result.findings] == [{
        "rule": "class-rule", "class": "shared", "resource": "nvidia.com/mig-3g.40gb", "sharing": ["mig"],
        "message": "class shared does not allow MIG GPUs (node offers MIG instances)",
    }]


def test_class_preference_shows_in_scores() -> None:
    """Time-slicing first for the default class; a node the class allows only outside enforce scores lowest."""
    ledger = ledger_of(gfd_node("ts"), gfd_node("whole", replicas=1, sharing="none"),
                       gfd_node("mps", replicas=2, sharing="mps"))
    claims = pod_claims(demand(container(gib(10))), BEST_EFFORT, "p")
    scores = {node: score_node(ledger, node, claims, BEST_EFFORT) for node in ("ts", "mps", "whole")}
    assert scores["ts"] > scores["mps"] > scores["whole"] > 0
    shared = SHARED["audit"]
    claims = pod_claims(demand(container(gib(70))), shared, "q")
    # The unshared node is fuller for this pod (binpack) and still ranks below any allowed node.
    assert score_node(ledger, "whole", claims, shared) < score_node(ledger, "ts", claims, shared)


def test_unknown_node_fails_resolvably() -> None:
    pod = pod_claims(demand(container(GIB)), BEST_EFFORT)
    result = filter_node(Ledger(POLICY.budget_rule()), "ghost", pod, BEST_EFFORT)
    assert (result.verdict, result.message) == (Verdict.FAIL, "node ghost is not known to vramguard yet")


def test_a_gpu_without_memory_size_is_refused_where_enforced_and_unguarded_elsewhere() -> None:
    # Where the namespace enforces, no pod is placed on a GPU whose budget nobody can compute; elsewhere
    # vramguard must not keep a pod off a node the stock scheduler would use: placed, with a finding.
    node = gfd_node("n")
    del node["metadata"]["labels"]["nvidia.com/gpu.memory"]
    enforced = ClassChoice(BEST_EFFORT.name, BEST_EFFORT.qos, BEST_EFFORT.source, enforcement="enforce")
    claims = pod_claims(demand(container(GIB)), BEST_EFFORT)
    result = filter_node(ledger_of(node), "n", claims, enforced)
    assert result.verdict is Verdict.UNRESOLVABLE
    assert result.message.startswith("GPU 0 (NVIDIA H100 80GB HBM3): memory size unknown, so the pod's VRAM cannot")
    audited = ClassChoice(BEST_EFFORT.name, BEST_EFFORT.qos, BEST_EFFORT.source, enforcement="audit")
    result = filter_node(ledger_of(node), "n", claims, audited)
    assert result.verdict is Verdict.PASS
    [finding] = result.findings
    assert finding.unreadable and finding.rule is Rule.NODE_UNKNOWN


def test_unknown_vram_takes_the_whole_gpu() -> None:
    ledger = ledger_of(gfd_node("n"))
    hold(ledger, "n", "a", GIB)
    result = filter_node(ledger, "n", pod_claims(demand(container(None)), BEST_EFFORT, "b"), BEST_EFFORT)
    assert result.verdict is Verdict.FAIL
    assert result.message == (
        f"GPU 0 (NVIDIA H100 80GB HBM3): {format_bytes(H100_BUDGET - GiB)} of {BUDGET} VRAM budget free, "
        f"pod needs {BUDGET} per GPU; "
        "its VRAM is unknown, so it takes a whole GPU (declare vramguard.io/vram)"
    )


def test_message_counts_pods_of_unknown_placement() -> None:
    ledger = ledger_of(gfd_node("n", count=2))
    hold(ledger, "n", "a", gib(40))
    result = filter_node(ledger, "n", pod_claims(demand(container(gib(40))), BEST_EFFORT, "b"), BEST_EFFORT)
    assert result.verdict is Verdict.FAIL
    assert result.message == (
        f"GPU 0 (NVIDIA H100 80GB HBM3): {format_bytes(H100_BUDGET - 40 * GiB)} of {BUDGET} VRAM budget free, "
        "pod needs 40.0 GiB per GPU; "
        "counting 1 pod whose GPU is not known yet; also GPU 1"
    )


INIT_CASES = [
    pytest.param(
        [container(gib(10), name="warm", init=True), container(gib(20))],
        [("vllm", (gib(20), gib(10)))], [("vllm", 1), ("warm", 1)], id="init-shares-the-app-device"),
    pytest.param(
        [container(gib(10), name="warm", init=True, gpus=2), container(gib(20))],
        [("vllm", (gib(20), gib(10))), ("warm", (gib(10),))], [("vllm", 1), ("warm", 2)],
        id="init-needs-more-devices"),
    pytest.param(
        [container(gib(10), name="a"), container(gib(20), name="b", gpus=2)],
        [("a", (gib(10),)), ("b", (gib(20),)), ("b", (gib(20),))], [("a", 1), ("b", 2)],
        id="each-container-its-own-replicas"),
    pytest.param(
        [container(None)], [("vllm", (None,))], [("vllm", 1)], id="unknown-is-whole"),
]


@pytest.mark.parametrize(("containers", "claims", "assigned"), INIT_CASES)
def test_pod_claims(containers: list[ContainerDemand], claims: list[tuple[str, tuple[Vram | None, ...]]],
                    assigned: list[tuple[str, int]]) -> None:
    result = pod_claims(demand(*containers), BEST_EFFORT, "uid")
    assert [(c.container, c.vram) for c in result.claims] == claims
    ledger = ledger_of(gfd_node("n", count=2))
    assignment = choose_gpus(ledger, "n", result, BEST_EFFORT)
    assert assignment is not None
    assert sorted((name, len(ids)) for name, ids in assignment.containers.items()) == assigned


# kube-scheduler v1.36 pkg/api/v1/resource/helpers.go (PodRequests): a regular init container
# runs beside the sidecars (restartPolicy: Always) started before it; the app containers beside all
# sidecars. The pod needs the most any one of those phases holds.
SIDECAR_CASES = [
    pytest.param(
        [container(gib(36), name="proxy", sidecar=True), container(gib(36), name="warm", init=True)],
        2, id="init-after-sidecar-runs-beside-it"),
    pytest.param(
        [container(gib(36), name="warm", init=True), container(gib(36), name="proxy", sidecar=True)],
        1, id="init-before-sidecar-runs-alone"),
    pytest.param(
        [container(gib(36), name="proxy", sidecar=True), container(gib(36), name="warm", init=True),
         container(gib(36))],
        2, id="sidecar-and-app"),
    pytest.param(
        [container(gib(10), name="a", sidecar=True), container(gib(10), name="b", sidecar=True),
         container(gib(10), name="warm", init=True, gpus=2), container(gib(10))],
        4, id="two-sidecars-then-a-two-gpu-init"),
]


@pytest.mark.parametrize(("containers", "devices"), SIDECAR_CASES)
def test_sidecars_keep_their_devices_while_later_init_containers_run(
        containers: list[ContainerDemand], devices: int) -> None:
    pod = demand(*containers)
    assert pod.devices_per_resource() == {"nvidia.com/gpu": devices}
    claims = pod_claims(pod, BEST_EFFORT, "a").claims
    assert len(claims) == devices


def test_a_sidecar_and_the_init_container_after_it_are_counted_together() -> None:
    # 0.45 + 0.45 of an H100 run together: 0.90 is held, not 0.45.
    share = Vram(fraction=Fraction(45, 100))
    pod = demand(container(share, name="proxy", sidecar=True), container(share, name="warm", init=True))
    ledger = ledger_of(gfd_node("n"))
    assert ledger.reserve("n", PodRef("a"), pod_claims(pod, BEST_EFFORT, "a").claims).ok
    assert [u.known_bytes for u in ledger.usage("n")] == [2 * int(Fraction(45, 100) * 81559 * MiB)]
    with_app = demand(*pod.containers, container(share))
    assignment = choose_gpus(ledger_of(gfd_node("n", count=2)), "n", pod_claims(with_app, BEST_EFFORT, "a"),
                             BEST_EFFORT)
    assert assignment is not None
    assert assignment.containers["warm"] == assignment.containers["vllm"], "the init uses the app's device"
    assert len(assignment.claims) == 2


def test_a_declaration_counts_no_less_than_the_engines_own_flag_on_a_larger_gpu() -> None:
    # 64Gi was right for vLLM at 0.75 of an 80 GB H100; on a 141 GB H200 vLLM takes 0.75 of it.
    vllm = ContainerDemand(name="vllm", resource="nvidia.com/gpu", gpus=1, engine="vllm",
                           claim=Vram(fraction=Fraction(3, 4)), declared=Vram(bytes=64 * GiB))
    h200 = gfd_node("h200", replicas=4, memory_mib=143771, product="NVIDIA-H200")
    ledger = ledger_of(h200)
    claims = pod_claims(demand(vllm), BEST_EFFORT, "a").claims
    assert ledger.reserve("h200", PodRef("a"), claims).ok
    [usage] = ledger.usage("h200")
    assert usage.known_bytes == int(Fraction(3, 4) * 143771 * MiB)
    second = pod_claims(demand(container(gib(40), name="b")), BEST_EFFORT, "b")  # fits beside 64Gi
    assert filter_node(ledger, "h200", second, BEST_EFFORT).verdict is Verdict.FAIL
    # On an H100 the declaration is the larger, and counts.
    h100 = ledger_of(gfd_node("h100"))
    assert h100.reserve("h100", PodRef("a"), claims).ok
    assert [u.known_bytes for u in h100.usage("h100")] == [64 * GiB]


def test_init_container_larger_than_app_holds_its_amount() -> None:
    ledger = ledger_of(gfd_node("n"))
    claims = pod_claims(demand(container(gib(30), name="warm", init=True), container(gib(10))), BEST_EFFORT, "a")
    assert ledger.reserve("n", PodRef("a"), claims.claims).ok
    assert [u.known_bytes for u in ledger.usage("n")] == [30 * GiB]


def scored(ledger: Ledger, node: str, vram: Vram, choice: ClassChoice) -> int:
    return score_node(ledger, node, pod_claims(demand(container(vram)), choice, "new"), choice)


def test_binpack_prefers_the_fuller_node_and_spread_the_emptier() -> None:
    spread = ClassChoice("spread", BEST_EFFORT.qos.model_copy(update={"scoring": "spread"}), "default")
    ledger = ledger_of(gfd_node("empty"), gfd_node("busy"), gfd_node("full"))
    hold(ledger, "busy", "a", gib(40))
    hold(ledger, "full", "b", gib(70))
    binpack_scores = [scored(ledger, n, gib(10), BEST_EFFORT) for n in ("empty", "busy", "full")]
    spread_scores = [scored(ledger, n, gib(10), spread) for n in ("empty", "busy", "full")]
    assert binpack_scores[0] < binpack_scores[1]
    assert binpack_scores[2] == 0  # does not fit
    assert spread_scores[0] > spread_scores[1]
    assert all(0 <= s <= 10 for s in binpack_scores + spread_scores)
    assert scored(ledger, "empty", Vram(bytes=H100_BUDGET), BEST_EFFORT) == 10


@pytest.mark.parametrize(("scoring", "device"), [("binpack", "1"), ("spread", "0")])
def test_choose_gpus_follows_the_class(scoring: str, device: str) -> None:
    choice = ClassChoice("c", BEST_EFFORT.qos.model_copy(update={"scoring": scoring}), "default")
    ledger = ledger_of(gfd_node("n", count=2))
    ledger.reserve("n", PodRef("a"), [Claim("nvidia.com/gpu", "vllm", (gib(10),), intended="1")])
    claims = pod_claims(demand(container(gib(10))), choice, "b")
    assignment = choose_gpus(ledger, "n", claims, choice)
    assert assignment is not None
    assert assignment.containers == {"vllm": (device,)}
    assert assignment.claims[0].intended == device and assignment.claims[0].gpu is None
    assert json.loads(assignment.annotation()) == {"node": "n", "containers": {"vllm": [device]}}
    assert ledger.reserve("n", PodRef("b"), assignment.claims).ok
    assert ledger.check_invariants() == []


def test_choose_gpus_spreads_replicas_of_one_container() -> None:
    ledger = ledger_of(gfd_node("n", count=2, replicas=1, sharing="none"))
    claims = pod_claims(demand(container(gib(60), gpus=2)), GUARANTEED, "a")
    assignment = choose_gpus(ledger, "n", claims, GUARANTEED)
    assert assignment is not None and assignment.containers == {"vllm": ("0", "1")}
    assert choose_gpus(Ledger(POLICY.budget_rule()), "ghost", claims, GUARANTEED) is None


def test_apply_intended_rebuilds_claims_from_the_recorded_decision() -> None:
    claims = pod_claims(demand(container(GIB, gpus=2), container(GIB, name="side")), BEST_EFFORT, "a").claims
    rebuilt = apply_intended(claims, {"vllm": ["1", "0"]})
    assert [c.intended for c in rebuilt] == ["1", "0", None]


def test_filter_rechecks_a_reserved_pod_without_counting_it_twice() -> None:
    ledger = ledger_of(gfd_node("n"))
    claims = pod_claims(demand(container(gib(50))), BEST_EFFORT, "a")
    assert ledger.reserve("n", PodRef("a"), claims.claims).ok
    assert filter_node(ledger, "n", claims, BEST_EFFORT).ok
    assert not filter_node(ledger, "n", PodClaims("b", claims.claims), BEST_EFFORT).ok


def test_node_offering_a_shared_mig_instance_is_not_isolation() -> None:
    gpu = Gpu("7g.80gb#0", 0, "H100", 80 * 10**9, "time-slicing", 2, "nvidia.com/mig-7g.80gb", "7g.80gb")
    ledger = Ledger(POLICY.budget_rule())
    ledger.upsert_node(NodeInventory("n", (gpu,)))
    pod = pod_claims(demand(container(GIB, resource="nvidia.com/mig-7g.80gb")), GUARANTEED)
    assert filter_node(ledger, "n", pod, GUARANTEED).message == (
        "class guaranteed does not allow time-slicing GPUs (node offers time-slicing)"
    )
