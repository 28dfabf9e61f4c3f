"""Measured use meets declared use: the ledger holds max(claims, use) per pod and device.

A declaration (``vramguard.io/vram: 1Mi``) is a floor, not a ceiling: once the agent reports what a
pod really uses, the ledger counts it, on the fast path and the general rule alike.
"""

from __future__ import annotations

import json
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramguard.codecs import AGENT_REPORT_ANNOTATION
from vramguard.demand.model import Vram
from vramguard.inventory import Gpu, NodeInventory, Sharing, read_inventory
from vramguard.ledger import MEASURED_TOLERANCE_BYTES, Claim, Ledger, PodRef, over_use
from vramguard.quantity import GiB, MiB

TENTH: dict[Sharing, Fraction] = dict.fromkeys(("none", "time-slicing", "mps", "mig"), Fraction(1, 10))
GPU = "nvidia.com/gpu"
H100 = 81559 * MiB


def h100s(count: int, measured: dict[str, dict[str, int]] | None = None) -> NodeInventory:
    gpus = tuple(Gpu(str(i), i, "NVIDIA H100 80GB HBM3", H100, "time-slicing", 4, GPU) for i in range(count))
    return NodeInventory("n", gpus, measured=measured or {})


def declared(amount: int, gpu: str | None = None) -> Claim:
    return Claim(GPU, "c", (Vram(bytes=amount),), gpu=gpu)


def general_fit(ledger: Ledger, claims: list[Claim]) -> Any:
    return ledger._fit(ledger._nodes["n"], tuple(claims), None, None)


def test_a_pod_declaring_1mi_that_uses_20gib_blocks_the_next_pod() -> None:
    """The defect: the ledger trusted the 1 MiB declaration forever, so a 60 GiB pod was placed next
    to 20 GiB of real use on a 71.7 GiB budget. With the agent's measurement it is refused."""
    ledger = Ledger(TENTH)
    ledger.upsert_node(h100s(1))
    ledger.reserve("n", PodRef("liar", "ml", "liar"), [declared(MiB)])
    assert ledger.fits("n", [declared(60 * GiB)]).ok  # by declaration alone it would fit

    ledger.upsert_node(h100s(1, {"liar": {"0": 20 * GiB}}))
    fit = ledger.fits("n", [declared(60 * GiB)])
    assert not fit.ok and not fit.unresolvable  # it may fit again once the liar leaves
    assert fit == general_fit(ledger, [declared(60 * GiB)])
    assert [u.known_bytes for u in ledger.usage("n")] == [20 * GiB]
    assert ledger.check_invariants() == []
    assert ledger.fits("n", [declared(50 * GiB)]).ok

    ledger.release("liar")
    assert ledger.fits("n", [declared(60 * GiB)]).ok
    assert [u.known_bytes for u in ledger.usage("n")] == [0]


@pytest.mark.parametrize(
    ("claimed", "used", "held"),
    [
        pytest.param(10 * GiB, 10 * GiB, 10 * GiB, id="uses-what-it-declares"),
        pytest.param(10 * GiB, 2 * GiB, 10 * GiB, id="uses-less-declaration-holds"),
        pytest.param(10 * GiB, 10 * GiB + MEASURED_TOLERANCE_BYTES, 10 * GiB, id="within-tolerance-not-counted"),
        pytest.param(10 * GiB, 10 * GiB + MEASURED_TOLERANCE_BYTES + 1, 10 * GiB + MEASURED_TOLERANCE_BYTES + 1,
                     id="just-over-tolerance-counts-in-full"),
        pytest.param(MiB, 20 * GiB, 20 * GiB, id="tiny-declaration-large-use"),
    ],
)
def test_known_placement_holds_the_larger_of_claim_and_use(claimed: int, used: int, held: int) -> None:
    ledger = Ledger(TENTH)
    ledger.upsert_node(h100s(2, {"p": {"1": used}}))
    ledger.reserve("n", PodRef("p"), [declared(claimed, gpu="1")])
    assert [u.known_bytes for u in ledger.usage("n")] == [0, held]
    assert ledger.check_invariants() == []


def test_use_on_a_device_none_of_its_claims_is_known_on_counts_on_top() -> None:
    """Placement unknown (no PodResources): its claim may be anywhere, its use is on GPU 1."""
    ledger = Ledger(TENTH)
    ledger.upsert_node(h100s(2, {"p": {"1": 8 * GiB}}))
    ledger.reserve("n", PodRef("p"), [declared(4 * GiB)])
    usage = ledger.usage("n")
    assert [u.known_bytes for u in usage] == [0, 8 * GiB]
    assert [u.worst_bytes for u in usage] == [4 * GiB, 12 * GiB]


def test_re_checking_a_pod_does_not_compete_with_its_own_use() -> None:
    budget = H100 * 9 // 10
    ledger = Ledger(TENTH)
    ledger.upsert_node(h100s(1, {"p": {"0": budget}}))
    ledger.reserve("n", PodRef("p"), [declared(MiB)], force=True)
    assert ledger.fits("n", [declared(budget)], uid="p").ok
    assert not ledger.fits("n", [declared(budget)]).ok


def test_over_use_rule() -> None:
    assert over_use(GiB, GiB + MEASURED_TOLERANCE_BYTES) == 0
    assert over_use(GiB, 3 * GiB) == 2 * GiB
    assert over_use(3 * GiB, GiB) == 0


def test_measured_use_is_parsed_from_the_report_and_capped_at_the_device() -> None:
    node = {
        "metadata": {"name": "n", "labels": {"nvidia.com/gpu.count": "1", "nvidia.com/gpu.memory": "81559",
                                             "nvidia.com/gpu.replicas": "4"},
                     "annotations": {AGENT_REPORT_ANNOTATION: json.dumps({
                         "version": 1, "gpus": [{"id": "0"}], "pods": {},
                         "used": {"a": {"0": 20 * GiB}, "b": {"0": 10**15}, "c": {"7": 1}, "d": {"0": -1},
                                  "e": "junk"},
                     })}},
    }
    inventory = read_inventory(node)
    assert inventory.measured == {"a": {"0": 20 * GiB}, "b": {"0": H100}}
    assert len(inventory.notes) == 3


# -- fast path and general rule agree with measured use; no placement overcommits ------------------

DEVICE = 20 * GiB
STEP = 2 * GiB  # claims and use in steps well above the tolerance, so over-use is never ambiguous
AMOUNTS = st.one_of(
    st.integers(0, 9).map(lambda n: Vram(bytes=n * STEP)),
    st.integers(1, 9).map(lambda n: Vram(fraction=Fraction(n, 10))),
    st.none(),
)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[NodeInventory, list[list[Claim]], list[list[Claim]]]:
    count = draw(st.integers(1, 3))
    sharing: Sharing = draw(st.sampled_from(["time-slicing", "none", "mps"]))
    replicas = 1 if sharing == "none" else draw(st.integers(2, 3))
    gpus = tuple(Gpu(str(i), i, "Test GPU", DEVICE, sharing, replicas, GPU) for i in range(count))
    ids = [g.id for g in gpus]

    def claims(most: int) -> list[Claim]:
        return [
            Claim(GPU, "c", (draw(AMOUNTS),), gpu=draw(st.none() | st.sampled_from(ids)))
            for _ in range(draw(st.integers(1, most)))
        ]

    held = [claims(2) for _ in range(draw(st.integers(0, 5)))]
    measured = {
        str(i): {d: draw(st.integers(1, 10)) * STEP + 1 for d in draw(st.sets(st.sampled_from(ids)))}
        for i in range(len(held))
        if draw(st.booleans())
    }
    asked = [claims(2) for _ in range(3)]
    return NodeInventory("n", gpus, measured=measured), held, asked


SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(scenarios())
def test_fast_check_equals_the_general_check_with_measured_use(
    scenario: tuple[NodeInventory, list[list[Claim]], list[list[Claim]]],
) -> None:
    inventory, held, asked = scenario
    ledger = Ledger(TENTH)
    ledger.upsert_node(inventory)
    for i, claims in enumerate(held):
        ledger.reserve("n", PodRef(str(i)), claims, force=True)
    for claims in asked:
        assert ledger.fits("n", tuple(claims)) == general_fit(ledger, claims)
    # The counters agree with a recount (over-use included), whatever the budget says.
    assert [v for v in ledger.check_invariants() if "recount" in v] == []
    for i in range(len(held)):
        ledger.release(str(i))
    assert all(u.known_bytes == 0 for u in ledger.usage("n"))


def worst_load(inventory: NodeInventory, pods: dict[str, list[Claim]]) -> dict[str, int] | None:
    """The largest load any placement of the unknown claims puts on a device over its budget, where a pod
    on a device really holds the larger of its claims landing there and its measured use there (use
    above the claims by no more than the tolerance counts as the claims)."""
    gpus = {g.id: g for g in inventory.devices}
    budget = {d: g.memory_bytes * 9 // 10 for d, g in gpus.items()}
    whole = {d: budget[d] // g.replicas if g.sharing == "mps" else budget[d] for d, g in gpus.items()}
    single = len(gpus) == 1
    items = [(uid, c) for uid, cs in pods.items() for c in cs]
    fixed = [(uid, c, c.gpu or "0") for uid, c in items if c.gpu is not None or single]
    loose = [(uid, c) for uid, c in items if c.gpu is None and not single]

    def place(rest: list[tuple[str, Claim]], free: dict[str, int]) -> Any:
        if not rest:
            yield []
            return
        for d, slots in free.items():
            if slots:
                free[d] -= 1
                for tail in place(rest[1:], free):
                    yield [d, *tail]
                free[d] += 1

    free = {d: g.replicas - sum(1 for _, _, on in fixed if on == d) for d, g in gpus.items()}
    for choice in place(loose, dict(free)):
        per_pod: dict[tuple[str, str], int] = {}
        for (uid, c), d in [*(((u, c), d) for u, c, d in fixed), *zip(loose, choice, strict=True)]:
            per_pod[(uid, d)] = per_pod.get((uid, d), 0) + c.bytes_on(gpus[d].memory_bytes, whole[d])
        for uid, devices in inventory.measured.items():
            if uid in pods:
                for d, used in devices.items():
                    # Use within the tolerance (allocator slack) is the margin's, not over-use.
                    claimed = per_pod.get((uid, d), 0)
                    per_pod[(uid, d)] = claimed + over_use(claimed, used)
        load = dict.fromkeys(gpus, 0)
        for (_, d), amount in per_pod.items():
            load[d] += amount
        if any(load[d] > budget[d] for d in gpus):
            return load
    return None


@SETTINGS
@given(scenarios())
def test_no_placement_overcommits_a_gpu_counting_measured_use(
    scenario: tuple[NodeInventory, list[list[Claim]], list[list[Claim]]],
) -> None:
    """Running pods (some measured above their claims) are held; new pods are admitted only where no
    placement the device plugin may choose overcommits a device, where a running pod measured on a
    device holds the larger of its claims and its use there. Without counting use this fails."""
    inventory, running, asked = scenario
    ledger = Ledger(TENTH)
    ledger.upsert_node(inventory)
    pods = {str(i): claims for i, claims in enumerate(running)}
    for uid, claims in pods.items():
        ledger.hold("n", PodRef(uid), claims)
    if worst_load(inventory, pods) is not None:
        return  # already overcommitted by what runs: nothing new may fit, checked elsewhere
    for j, claims in enumerate(asked):
        if ledger.reserve("n", PodRef(f"new-{j}"), claims).ok:
            pods[f"new-{j}"] = claims
            assert worst_load(inventory, pods) is None
    assert [v for v in ledger.check_invariants() if "recount" in v] == []
