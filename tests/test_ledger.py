"""Ledger: budgets, reservations, and the rule that no device can be overcommitted by the plugin's pick."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramguard.demand.model import Vram
from vramguard.inventory import Gpu, NodeInventory, Sharing
from vramguard.ledger import Claim, Ledger, PodRef
from vramguard.quantity import MiB

TENTH: dict[Sharing, Fraction] = dict.fromkeys(("none", "time-slicing", "mps", "mig"), Fraction(1, 10))
H100_BYTES = 81559 * MiB
GPU = "nvidia.com/gpu"


def devices(count: int, replicas: int, *, memory: int = 1000, sharing: Sharing = "time-slicing",
            resource: str = GPU) -> tuple[Gpu, ...]:
    return tuple(Gpu(str(i), i, "Test GPU", memory, sharing, replicas, resource) for i in range(count))


def ledger_with(*nodes: NodeInventory) -> Ledger:
    ledger = Ledger(TENTH)
    for node in nodes:
        ledger.upsert_node(node)
    return ledger


def claim(amount: int | Fraction | None, *, container: str = "c", gpu: str | None = None,
          resource: str = GPU) -> Claim:
    if amount is None:
        vram: Vram | None = None
    elif isinstance(amount, Fraction):
        vram = Vram(fraction=amount)
    else:
        vram = Vram(bytes=amount)
    return Claim(resource, container, (vram,), gpu=gpu)


def pod(uid: str) -> PodRef:
    return PodRef(uid, "team-a", f"pod-{uid}")


# -- the seed's example ------------------------------------------------------------------------

H100_TIME_SLICED = NodeInventory("h100", (Gpu("0", 0, "NVIDIA H100 80GB HBM3", H100_BYTES, "time-slicing", 4, GPU),))


@pytest.mark.parametrize(
    ("fraction", "admitted"),
    [(Fraction(1, 5), 4), (Fraction(3, 10), 3), (Fraction(9, 10), 1), (Fraction(91, 100), 0)],
    ids=["0.20-all-four", "0.30-three", "0.90-one", "0.91-none"],
)
def test_seed_example(fraction: Fraction, admitted: int) -> None:
    ledger = ledger_with(H100_TIME_SLICED)
    results = [ledger.reserve("h100", pod(str(i)), [claim(fraction)]).ok for i in range(4)]
    assert results == [True] * admitted + [False] * (4 - admitted)
    assert ledger.check_invariants() == []


def test_budget_is_exact_integer_bytes() -> None:
    ledger = ledger_with(H100_TIME_SLICED)
    assert ledger.budget("h100", "0") == H100_BYTES * 9 // 10 == 76968728985
    assert ledger.budget("h100", "9") is None
    assert ledger.budget("nowhere", "0") is None


def test_refusal_has_the_numbers() -> None:
    ledger = ledger_with(H100_TIME_SLICED)
    for i in range(3):
        ledger.reserve("h100", pod(str(i)), [claim(Fraction(3, 10))])
    fit = ledger.fits("h100", [claim(Fraction(3, 10))])
    assert not fit.ok and not fit.unresolvable
    (shortfall,) = fit.shortfalls
    assert shortfall.budget == 76968728985
    assert shortfall.free == 76968728985 - 3 * (H100_BYTES * 3 // 10)
    assert shortfall.need == H100_BYTES * 3 // 10
    assert (shortfall.devices, shortfall.unknown_pods) == (1, 0)


# -- reserve / release ---------------------------------------------------------------------------

def test_reserve_is_idempotent_and_release_frees_everything() -> None:
    mig = Gpu("3g.40gb#0", 0, "H100", 40 * 10**9, "mig", 1, "nvidia.com/mig-3g.40gb", "3g.40gb")
    node = NodeInventory("n", (*devices(1, 4), mig))
    ledger = ledger_with(node)
    claims = [claim(500), claim(Fraction(1, 2), container="m", resource="nvidia.com/mig-3g.40gb")]
    assert ledger.reserve("n", pod("a"), claims).ok
    assert ledger.reserve("n", pod("a"), claims).ok
    assert ledger.pod_count() == 1
    assert [u.known_bytes for u in ledger.usage("n")] == [500, 20 * 10**9]
    assert ledger.release("a")
    assert not ledger.release("a")
    assert [u.known_bytes for u in ledger.usage("n")] == [0, 0]
    assert ledger.check_invariants() == []


def test_reserving_again_with_other_claims_replaces_the_holding() -> None:
    ledger = ledger_with(NodeInventory("n", devices(1, 4)), NodeInventory("m", devices(1, 4)))
    ledger.reserve("n", pod("a"), [claim(800)])
    assert ledger.reserve("n", pod("a"), [claim(900)]).ok  # its own 800 does not count against it
    assert ledger.reserve("m", pod("a"), [claim(100)]).ok
    assert [u.known_bytes for u in ledger.usage("n")] == [0]
    assert [u.known_bytes for u in ledger.usage("m")] == [100]
    holding = ledger.holding("a")
    assert holding is not None and holding[1] == "m"
    assert ledger.check_invariants() == []


def test_fits_ignores_the_pods_own_holding() -> None:
    ledger = ledger_with(NodeInventory("n", devices(1, 4)))
    ledger.reserve("n", pod("a"), [claim(600)])
    assert ledger.fits("n", [claim(600)], uid="a").ok
    assert not ledger.fits("n", [claim(600)], uid="b").ok


# -- unknown placement -----------------------------------------------------------------------------

def test_two_pods_that_could_meet_on_one_gpu_are_refused() -> None:
    ledger = ledger_with(NodeInventory("n", devices(2, 2)))
    assert ledger.reserve("n", pod("a"), [claim(500)]).ok
    fit = ledger.reserve("n", pod("b"), [claim(500)])
    assert not fit.ok and not fit.unresolvable
    assert {(s.device.id, s.free, s.need, s.unknown_pods) for s in fit.shortfalls} == {
        ("0", 400, 500, 1), ("1", 400, 500, 1)
    }


def test_small_pods_fill_every_replica() -> None:
    ledger = ledger_with(NodeInventory("n", devices(2, 2)))
    assert all(ledger.reserve("n", pod(str(i)), [claim(400)]).ok for i in range(4))
    fit = ledger.fits("n", [claim(1)])
    assert fit.problems == ("pod needs 1 nvidia.com/gpu, node has 4 (0 free)",)
    assert not fit.unresolvable


def test_known_placement_relaxes_the_worst_case() -> None:
    node = NodeInventory("n", devices(2, 2), placements={"a": {"c": ("0",)}, "b": {"c": ("1",)}})
    ledger = ledger_with(node)
    assert ledger.reserve("n", pod("a"), [claim(500)]).ok
    assert ledger.reserve("n", pod("b"), [claim(500)], force=True).ok
    assert ledger.fits("n", [claim(400)]).ok
    assert not ledger.fits("n", [claim(401)]).ok


def test_agent_report_arriving_later_reaccounts_the_node() -> None:
    ledger = ledger_with(NodeInventory("n", devices(2, 2)))
    ledger.reserve("n", pod("a"), [claim(500)])
    assert not ledger.fits("n", [claim(500)]).ok
    ledger.upsert_node(NodeInventory("n", devices(2, 2), placements={"a": {"c": ("0",)}}))
    rows = ledger.usage("n")
    assert [r.known_bytes for r in rows] == [500, 0]
    assert ledger.fits("n", [claim(400)]).ok
    assert not ledger.fits("n", [claim(500)]).ok  # it could still land next to a
    assert ledger.check_invariants() == []


def test_a_pod_with_two_gpus_may_get_both_on_one() -> None:
    ledger = ledger_with(NodeInventory("n", devices(2, 2)))
    fit = ledger.fits("n", [claim(500), claim(500)])
    assert not fit.ok and fit.unresolvable
    assert fit.shortfalls[0].devices == 2 and fit.shortfalls[0].need == 1000


def test_single_device_is_always_known() -> None:
    ledger = ledger_with(NodeInventory("n", devices(1, 4)))
    ledger.reserve("n", pod("a"), [claim(300)])
    (row,) = ledger.usage("n")
    assert (row.known_bytes, row.worst_bytes, row.slots_used, row.pods) == (300, 300, 1, ("team-a/pod-a",))


def test_intended_device_is_expected_not_known() -> None:
    ledger = ledger_with(NodeInventory("n", devices(2, 4)))
    ledger.reserve("n", pod("a"), [Claim(GPU, "c", (Vram(bytes=300),), intended="1")])
    rows = ledger.usage("n")
    assert [(r.known_bytes, r.worst_bytes, r.expected_bytes, r.pods) for r in rows] == [
        (0, 300, 0, ()), (0, 300, 300, ("team-a/pod-a",))
    ]
    ledger.release("a")
    assert [r.expected_bytes for r in ledger.usage("n")] == [0, 0]
    assert ledger.check_invariants() == []


# -- exclusive, MPS, MIG ------------------------------------------------------------------------

def test_exclusive_gpus_are_counted_by_device() -> None:
    ledger = ledger_with(NodeInventory("n", devices(2, 1, sharing="none")))
    assert ledger.reserve("n", pod("a"), [claim(900)]).ok
    assert ledger.reserve("n", pod("b"), [claim(None)]).ok
    fit = ledger.fits("n", [claim(1)])
    assert not fit.ok and not fit.unresolvable
    too_big = ledger.fits("n", [claim(901)])
    assert too_big.unresolvable


def test_mps_claim_above_one_replica_share_never_fits() -> None:
    ledger = ledger_with(NodeInventory("n", devices(1, 4, sharing="mps")))
    fit = ledger.fits("n", [claim(226)])
    assert fit.unresolvable
    assert fit.problems == ("GPU 0 (Test GPU): pod needs 226 B per GPU, more than the 225 B one of its 4 MPS "
                            "replicas may use",)
    assert all(ledger.reserve("n", pod(str(i)), [claim(None)]).ok for i in range(4))
    assert [r.known_bytes for r in ledger.usage("n")] == [900]
    assert ledger.check_invariants() == []


def test_fraction_of_a_mig_instance_is_of_the_instance() -> None:
    mig = tuple(Gpu(f"1g.10gb#{i}", i, "H100", 10 * 10**9, "mig", 1, "nvidia.com/mig-1g.10gb", "1g.10gb")
                for i in range(2))
    ledger = ledger_with(NodeInventory("n", mig))
    assert ledger.reserve("n", pod("a"), [claim(Fraction(9, 10), resource="nvidia.com/mig-1g.10gb")]).ok
    assert [r.worst_bytes for r in ledger.usage("n")] == [9 * 10**9, 9 * 10**9]


def test_missing_resource_is_unresolvable() -> None:
    ledger = ledger_with(NodeInventory("n", devices(1, 4)))
    fit = ledger.fits("n", [claim(1, resource="nvidia.com/mig-3g.40gb")])
    assert fit.unresolvable and fit.problems == ("node offers no nvidia.com/mig-3g.40gb (it has nvidia.com/gpu)",)


def test_claim_takes_its_largest_candidate() -> None:
    ledger = ledger_with(NodeInventory("n", devices(1, 4)))
    ledger.reserve("n", pod("a"), [Claim(GPU, "c", (Vram(bytes=100), Vram(fraction=Fraction(1, 2))))])
    assert [r.known_bytes for r in ledger.usage("n")] == [500]


# -- pods bound without vramguard, nodes coming and going ---------------------------------------

def test_forced_pods_count_and_show_as_violations() -> None:
    ledger = ledger_with(NodeInventory("n", devices(1, 4)))
    ledger.reserve("n", pod("a"), [claim(800)])
    fit = ledger.reserve("n", pod("b"), [claim(800)], force=True)
    assert not fit.ok
    assert [r.known_bytes for r in ledger.usage("n")] == [1600]
    assert ledger.check_invariants() == ["n GPU 0 (Test GPU): may hold 1600 B (1600 B), budget 900 B (900 B)"]
    assert not ledger.fits("n", [claim(1)]).ok


def test_foreign_usage_counts() -> None:
    gpu = Gpu("0", 0, "Test GPU", 1000, "time-slicing", 4, GPU, foreign_bytes=300)
    ledger = ledger_with(NodeInventory("n", (gpu,)))
    assert ledger.fits("n", [claim(600)]).ok
    assert ledger.fits("n", [claim(601)]).unresolvable


def test_pods_wait_for_their_node_and_survive_its_removal() -> None:
    ledger = Ledger(TENTH)
    assert not ledger.fits("n", [claim(1)]).ok
    assert not ledger.reserve("n", pod("a"), [claim(700)]).ok
    ledger.reserve("n", pod("a"), [claim(700)], force=True)
    ledger.upsert_node(NodeInventory("n", devices(1, 4)))
    assert [r.known_bytes for r in ledger.usage("n")] == [700]
    ledger.remove_node("n")
    assert ledger.usage("n") == () and ledger.inventory("n") is None
    ledger.upsert_node(NodeInventory("n", devices(1, 4)))
    assert [r.known_bytes for r in ledger.usage("n")] == [700]
    assert ledger.node_names() == ["n"]
    assert ledger.check_invariants() == []


def test_node_that_loses_a_resource_reports_its_pods() -> None:
    ledger = ledger_with(NodeInventory("n", devices(1, 4)))
    ledger.reserve("n", pod("a"), [claim(100)])
    ledger.upsert_node(NodeInventory("n", devices(1, 4, resource="nvidia.com/gpu.shared")))
    assert ledger.check_invariants() == ["pod team-a/pod-a (a) asks for resources node n lacks"]


def test_new_margins_change_budgets() -> None:
    ledger = ledger_with(NodeInventory("n", devices(1, 4)))
    ledger.reserve("n", pod("a"), [claim(850)])
    ledger.set_budget_rule(dict.fromkeys(TENTH, Fraction(1, 5)))
    assert ledger.budget("n", "0") == 800
    assert ledger.check_invariants() == ["n GPU 0 (Test GPU): may hold 850 B (850 B), budget 800 B (800 B)"]


# -- the rule against a brute-force adversary --------------------------------------------------

@dataclass(frozen=True)
class NodeShape:
    memories: tuple[int, ...]
    replicas: int
    sharing: Sharing


def inventory_of(shape: NodeShape) -> NodeInventory:
    gpus = tuple(Gpu(str(i), i, "Test GPU", m, shape.sharing, shape.replicas, GPU)
                 for i, m in enumerate(shape.memories))
    return NodeInventory("n", gpus)


def assignments(claims: Sequence[Claim], free: dict[str, int]) -> Iterator[list[str]]:
    """Every way the device plugin could put ``claims`` on devices with ``free`` replica slots."""
    if not claims:
        yield []
        return
    for device, slots in free.items():
        if slots:
            free[device] -= 1
            for rest in assignments(claims[1:], free):
                yield [device, *rest]
            free[device] += 1


def overcommitted(shape: NodeShape, held: Sequence[Claim]) -> str | None:
    """A device some placement of the unknown claims overcommits, or ``None`` when none can."""
    gpus = inventory_of(shape).devices
    budget = {g.id: g.memory_bytes * 9 // 10 for g in gpus}
    whole = {g.id: budget[g.id] // g.replicas if g.sharing == "mps" else budget[g.id] for g in gpus}
    memory = {g.id: g.memory_bytes for g in gpus}
    single = len(gpus) == 1
    known = [(c.gpu or "0", c) for c in held if c.gpu is not None or single]
    unknown = [c for c in held if c.gpu is None and not single]
    free = {g.id: shape.replicas - sum(1 for d, _ in known if d == g.id) for g in gpus}
    for placement in assignments(unknown, dict(free)):
        load = dict.fromkeys(budget, 0)
        for device, c in [*known, *zip(placement, unknown, strict=True)]:
            load[device] += c.bytes_on(memory[device], whole[device])
        for device, amount in load.items():
            if amount > budget[device]:
                return device
    return None


AMOUNTS = st.one_of(
    st.integers(0, 18).map(lambda n: Vram(bytes=n * 50)),
    st.integers(1, 9).map(lambda n: Vram(fraction=Fraction(n, 10))),
    st.none(),
)
SHAPES = st.builds(
    NodeShape,
    st.lists(st.sampled_from([800, 1000]), min_size=1, max_size=3).map(tuple),
    st.integers(1, 2),
    st.sampled_from(["time-slicing", "none", "mps"]),
)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[NodeShape, list[tuple[str, list[Claim]]]]:
    shape = draw(SHAPES)
    ids = [str(i) for i in range(len(shape.memories))]
    operations: list[tuple[str, list[Claim]]] = []
    for step in range(draw(st.integers(1, 10))):
        if draw(st.booleans()) and step:
            operations.append((f"release {draw(st.integers(0, step))}", []))
            continue
        claims = [
            Claim(GPU, "c", (draw(AMOUNTS),), gpu=draw(st.none() | st.sampled_from(ids)))
            for _ in range(draw(st.integers(1, 2)))
        ]
        operations.append((str(step), claims))
    return shape, operations


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_no_placement_by_the_plugin_overcommits_a_gpu(
    scenario: tuple[NodeShape, list[tuple[str, list[Claim]]]],
) -> None:
    """Whatever sequence of reserves and releases, no pod admitted makes an assignment the plugin
    may choose overcommit a device, and the ledger's invariants agree with the brute force.

    And the rule is exact: a pod refused for VRAM has an assignment that would overcommit a device.

    A release alone may raise the worst case: the rule does not remember which slots were free when
    the remaining claims of unknown device were placed, so a freed slot lets the adversary move one
    there (a conservative false alarm, never an overcommit). The ledger must then report the
    device as over budget (its invariants agree with the brute force at every step).
    """
    shape, operations = scenario
    ledger = ledger_with(inventory_of(shape))
    holdings: dict[str, list[Claim]] = {}
    for uid, claims in operations:
        if uid.startswith("release"):
            target = uid.split()[1]
            assert ledger.release(target) == (target in holdings)
            holdings.pop(target, None)
            continue
        held = [c for cs in holdings.values() for c in cs]
        safe_before = overcommitted(shape, held) is None
        fit = ledger.reserve("n", pod(uid), claims)
        if fit.ok:
            holdings[uid] = claims
        elif fit.shortfalls and not fit.problems:
            # Unresolvable: it overcommits even an empty node; otherwise it does next to the others.
            witness = claims if fit.unresolvable else held + claims
            assert overcommitted(shape, witness) is not None, "refused a pod no placement overcommits"
        now = overcommitted(shape, [c for cs in holdings.values() for c in cs])
        if safe_before:
            assert now is None, "admitted a pod some placement overcommits"
        assert (now is None) == (ledger.check_invariants() == []), "the ledger and the brute force disagree"


def test_generation_changes_with_every_change_and_never_repeats() -> None:
    ledger = ledger_with(NodeInventory("n", devices(1, 4)), NodeInventory("m", devices(1, 4)))
    seen = {ledger.generation("n"), ledger.generation("m")}
    ledger.fits("n", [claim(100)])
    assert ledger.generation("n") in seen
    for change in (
        lambda: ledger.reserve("n", pod("a"), [claim(100)]),
        lambda: ledger.release("a"),
        lambda: ledger.upsert_node(NodeInventory("n", devices(2, 4))),
        lambda: (ledger.remove_node("n"), ledger.upsert_node(NodeInventory("n", devices(1, 4)))),
    ):
        change()
        assert ledger.generation("n") not in seen
        seen.add(ledger.generation("n"))
    assert ledger.generation("ghost") is None


def test_empty_node_check_follows_the_budget() -> None:
    ledger = ledger_with(NodeInventory("n", devices(1, 4)), NodeInventory("m", devices(1, 4)))
    assert ledger.fits("n", [claim(850)]).ok and ledger.fits("m", [claim(850)]).ok
    ledger.set_budget_rule(dict.fromkeys(TENTH, Fraction(1, 5)))
    assert ledger.fits("n", [claim(850)]).unresolvable
    assert ledger.fits("m", [claim(800)]).ok
