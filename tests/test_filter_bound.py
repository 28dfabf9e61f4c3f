"""A filter's shortcut (the node's bound, the device check per kind of node, shared reasons) decides
exactly as the full check does, on random ledgers and pods."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.ledger_strategies import AMOUNTS, GPU, OTHER, TENTH
from vramguard.demand.model import Vram
from vramguard.inventory import Gpu, NodeInventory, Sharing
from vramguard.ledger import Claim, Fit, Ledger, PodRef
from vramguard.placement import FilterMemo, NodeVerdict, PodClaims, Verdict, filter_grouped, filter_nodes
from vramguard.policy import ClassChoice, QosClass

MIG = "nvidia.com/mig-1g.10gb"


def filter_sorted(
    ledger: Ledger, nodes: list[str], pod: PodClaims, choice: ClassChoice, memo: FilterMemo
) -> tuple[dict[str, NodeVerdict], list[str]]:
    """:func:`filter_grouped`'s verdicts per node."""
    groups, rest = filter_grouped(ledger, nodes, pod, choice, memo)
    decided: dict[str, NodeVerdict] = {}
    for verdict, names in groups:
        assert not decided.keys() & names, "a node in two groups"
        decided.update(dict.fromkeys(names, verdict))
    return decided, rest


CHOICES = [
    ClassChoice("any", QosClass(sharing=("none", "time-slicing", "mps", "mig")), "default"),
    ClassChoice("isolated", QosClass(sharing=("none", "mig")), "default", enforcement="enforce"),
    ClassChoice("shared", QosClass(sharing=("time-slicing",)), "default", enforcement="warn"),
    ClassChoice("mps-only", QosClass(sharing=("mps",)), "default", enforcement="enforce"),
]


@st.composite
def inventories(draw: st.DrawFn, name: str) -> NodeInventory:
    """Devices of one or two resources (one size mostly, sometimes mixed), MIG instances, a device
    of unknown size now and then, agent placements, and a report set aside."""
    gpus: list[Gpu] = []
    for resource in draw(st.sampled_from([(GPU,), (GPU, OTHER), (MIG,), (GPU, MIG), ()])):
        if resource == MIG:
            for i in range(draw(st.integers(1, 3))):
                gpus.append(Gpu(f"1g.10gb#{i}", i, "Test GPU", 1000, "mig", 1, MIG, mig_profile="1g.10gb"))
            continue
        sharing: Sharing = draw(st.sampled_from(["time-slicing", "none", "mps"]))
        replicas = 1 if sharing == "none" else draw(st.integers(2, 4))
        memory = draw(st.sampled_from([800, 1000]))
        for _ in range(draw(st.integers(1, 3))):
            size = memory if draw(st.integers(0, 9)) else draw(st.sampled_from([1800 - memory, 0]))
            gpus.append(Gpu(str(len(gpus)), len(gpus), "Test GPU", size, sharing, replicas, resource))
    placements = {"p0": {"c": (gpus[0].id,)}} if gpus and draw(st.integers(0, 4)) == 0 else {}
    distrust = "the agent's Lease is stale" if draw(st.integers(0, 5)) == 0 else None
    return NodeInventory(name, tuple(gpus), placements=placements, distrust=distrust)


def claims_for(draw: st.DrawFn, inventory: NodeInventory, most: int) -> list[Claim]:
    resources = [*inventory.resources(), GPU, MIG]
    ids = [g.id for g in inventory.devices] or ["0"]
    return [
        Claim(
            draw(st.sampled_from(resources)),
            "c",
            (draw(AMOUNTS),),
            gpu=draw(st.sampled_from(ids)) if draw(st.integers(0, 6)) == 0 else None,
        )
        for _ in range(draw(st.integers(1, most)))
    ]


Scenario = tuple[Ledger, list[str], list[tuple[tuple[Claim, ...], str | None]]]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    """A ledger of a few nodes with pods held (bound, in flight, or forced past the budget), and the
    pods to ask about: new ones, and pods re-checked against their own holding."""
    ledger = Ledger(TENTH)
    names = [f"n{i}" for i in range(draw(st.integers(1, 4)))]
    inventories_ = {name: draw(inventories(name)) for name in names}
    for inventory in inventories_.values():
        ledger.upsert_node(inventory)
    for i in range(draw(st.integers(0, 12))):
        node = draw(st.sampled_from(names))
        claims = claims_for(draw, inventories_[node], 3)
        ledger.reserve(node, PodRef(f"p{i}"), claims, force=draw(st.booleans()))
    if draw(st.booleans()):
        ledger.release(f"p{draw(st.integers(0, 12))}")
    asked = [
        (
            tuple(claims_for(draw, inventories_[draw(st.sampled_from(names))], 4)),
            draw(st.sampled_from([None, "new", "p0", "p1", "p2"])),
        )
        for _ in range(4)
    ]
    return ledger, names, asked


def general(ledger: Ledger, node: str, claims: tuple[Claim, ...], uid: str | None) -> Fit:
    """The general check, as :meth:`Ledger.fits` words it, without any of the fast path's caches."""
    state = ledger._nodes[node]
    record = ledger._records.get(uid) if uid is not None else None
    fit = ledger._fit(state, claims, uid, record if record is not None and record.node == node else None)
    distrust = state.inventory.distrust
    return (
        fit if fit.ok or distrust is None else Fit(False, fit.unresolvable, fit.shortfalls, (*fit.problems, distrust))
    )


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_a_bound_refusal_is_a_resolvable_failure_of_the_full_check(scenario: Scenario) -> None:
    """Also: verdicts shared by nodes of one kind (failing even empty) are each node's own."""
    ledger, names, asked = scenario
    for claims, uid in asked:
        for node in names:
            refusal = ledger.quick_refusal(node, claims, uid)
            fit = ledger.fits(node, claims, uid)
            assert fit == general(ledger, node, claims, uid)
            judged = ledger.judge(node, claims, uid)
            assert judged == (refusal if refusal is not None else fit)
            if refusal is not None:
                assert not fit.ok and not fit.unresolvable, (node, claims, uid, refusal, fit)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from(CHOICES))
def test_a_filter_with_the_memo_decides_as_one_without(scenario: Scenario, choice: ClassChoice) -> None:
    """Same verdict, rule and findings for every node; the same message unless the memo gave the kind's one."""
    ledger, names, asked = scenario
    for claims, uid in asked:
        pod = PodClaims(uid or "", claims)
        memo = FilterMemo()
        fast = filter_nodes(ledger, names, pod, choice, memo)
        full = filter_nodes(ledger, names, pod, choice)
        for node, quick, slow in zip(names, fast, full, strict=True):
            assert (quick.verdict, quick.rule, quick.findings) == (slow.verdict, slow.rule, slow.findings), node
            if quick.message not in memo.texts:
                assert quick.message == slow.message


def sorted_then_one_by_one(
    ledger: Ledger, names: list[str], pod: PodClaims, choice: ClassChoice, memo: FilterMemo
) -> list[NodeVerdict]:
    """What the extender does: the bound index first, then the nodes it left, one by one."""
    decided, rest = filter_sorted(ledger, names, pod, choice, memo)
    assert not set(decided) & set(rest)
    assert set(decided) | set(rest) == set(names)
    decided.update(zip(rest, filter_nodes(ledger, rest, pod, choice, memo), strict=True))
    return [decided[node] for node in names]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from(CHOICES), st.data())
def test_the_bound_index_decides_as_the_full_check(
    scenario: Scenario, choice: ClassChoice, data: st.DataObject
) -> None:
    """Same verdict, rule and findings as the full check for every node, the same message as the
    one-by-one filter with its memo; also after the ledger changed between two filters (the index
    follows the change log), and for any subset of the nodes asked."""
    ledger, names, asked = scenario
    for round_ in range(2):
        for claims, uid in asked:
            pod = PodClaims(uid or "", claims)
            subset = data.draw(st.lists(st.sampled_from(names), unique=True)) if round_ else names
            memo, alone = FilterMemo(), FilterMemo()
            indexed = sorted_then_one_by_one(ledger, subset, pod, choice, memo)
            one_by_one = filter_nodes(ledger, subset, pod, choice, alone)
            full = filter_nodes(ledger, subset, pod, choice)
            for node, quick, memoed, slow in zip(subset, indexed, one_by_one, full, strict=True):
                assert (quick.verdict, quick.rule, quick.findings) == (slow.verdict, slow.rule, slow.findings), node
                assert (quick.verdict, quick.rule, quick.findings) == (memoed.verdict, memoed.rule, memoed.findings)
                if memoed.message in alone.messages.values():
                    # Refused on its bound: one line per kind of device (the index) or per device
                    # and room (one by one).
                    assert quick.message in memo.texts
                else:
                    assert quick.message == memoed.message, node
        # Change the ledger: a pod leaves, another is forced in; the index must follow.
        ledger.release(f"p{data.draw(st.integers(0, 12))}")
        node = data.draw(st.sampled_from(names))
        inventory = ledger.inventory(node)
        assert inventory is not None
        if inventory.devices:
            extra = Claim(inventory.devices[0].resource, "c", (Vram(bytes=data.draw(st.integers(0, 9)) * 100),))
            ledger.reserve(node, PodRef(f"q{round_}"), [extra], force=True)


_PASS_VERDICT = NodeVerdict(Verdict.PASS)


def _ledger(*devices: Gpu, placements: dict[str, dict[str, tuple[str, ...]]] | None = None) -> Ledger:
    ledger = Ledger(TENTH)
    ledger.upsert_node(NodeInventory("n", devices, placements=placements or {}))
    return ledger


def _gpus(count: int, replicas: int = 4) -> tuple[Gpu, ...]:
    return tuple(Gpu(str(i), i, "Test GPU", 1000, "time-slicing", replicas, GPU) for i in range(count))


def _claim(amount: int, gpu: str | None = None) -> Claim:
    return Claim(GPU, "c", (Vram(bytes=amount),), gpu=gpu)


# Budget 900 per device (a tenth kept free). (ledger setup, claims asked, uid, refused by the bound)
CASES = {
    "a claim bigger than the room left on the fuller device": ((700,), (_claim(300),), None, True),
    "a claim that fits every device": ((300,), (_claim(500),), None, False),
    "a claim naming the emptier device": ((700,), (_claim(300, gpu="1"),), None, False),
    "the pod re-checked against its own holding": ((700,), (_claim(300),), "p0", False),
    "bigger than an empty device (unresolvable: the full check words it)": ((), (_claim(950),), None, False),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_when_the_bound_refuses(case: tuple[tuple[int, ...], tuple[Claim, ...], str | None, bool]) -> None:
    held, claims, uid, refused = case
    ledger = _ledger(*_gpus(2))
    for i, amount in enumerate(held):
        ledger.reserve("n", PodRef(f"p{i}"), [_claim(amount, gpu="0")])
    assert (ledger.quick_refusal("n", claims, uid) is not None) is refused
    if refused:
        assert not ledger.fits("n", claims, uid).ok


def test_the_bound_follows_the_ledger() -> None:
    """A bound kept from before a release would refuse a node that now fits."""
    ledger = _ledger(*_gpus(1))
    ledger.reserve("n", PodRef("a"), [_claim(700)])
    assert ledger.quick_refusal("n", (_claim(300),)) is not None
    ledger.release("a")
    assert ledger.quick_refusal("n", (_claim(300),)) is None
    assert ledger.fits("n", (_claim(300),)).ok


def test_nodes_refused_the_same_way_share_one_reason() -> None:
    """The scheduler counts equal reasons as one line: the bound's reason is one string per way."""
    ledger = Ledger(TENTH)
    for i in range(3):
        ledger.upsert_node(NodeInventory(f"n{i}", _gpus(1)))
        ledger.reserve(f"n{i}", PodRef(f"p{i}"), [_claim(700)])
    memo = FilterMemo()
    verdicts = filter_nodes(ledger, ["n0", "n1", "n2"], PodClaims("x", (_claim(300),)), CHOICES[0], memo)
    assert {v.verdict for v in verdicts} == {Verdict.FAIL}
    assert len({id(v.message) for v in verdicts}) == 1
    assert verdicts[0].message == "GPU (Test GPU): VRAM budget free below the pod's 300 B per GPU"


def test_the_bound_index_gives_one_reason_per_kind_of_device() -> None:
    """Nodes refused on their bound with different rooms share one line (the scheduler's event
    lists each distinct reason); the nodes that fit pass without a check of their own."""
    ledger = Ledger(TENTH)
    for i, held in enumerate((700, 650, 0)):
        ledger.upsert_node(NodeInventory(f"n{i}", _gpus(1)))
        ledger.reserve(f"n{i}", PodRef(f"p{i}"), [_claim(held)])
    memo = FilterMemo()
    decided, rest = filter_sorted(ledger, ["n0", "n1", "n2"], PodClaims("x", (_claim(300),)), CHOICES[0], memo)
    assert rest == []
    assert decided["n2"].ok
    assert decided["n0"].verdict is Verdict.FAIL and decided["n0"].message is decided["n1"].message
    assert decided["n0"].message == "GPU (Test GPU): VRAM budget free below the pod's 300 B per GPU"


def test_nodes_with_agent_reports_are_judged_one_by_one() -> None:
    """A node whose agent reports placements keeps the device and its room in the reason."""
    ledger = _ledger(*_gpus(1), placements={"other": {"c": ("0",)}})
    ledger.reserve("n", PodRef("p"), [_claim(700)])
    decided, rest = filter_sorted(ledger, ["n"], PodClaims("x", (_claim(300),)), CHOICES[0], FilterMemo())
    assert (decided, rest) == ({}, ["n"])


@pytest.mark.parametrize("changed", [1, 80], ids=["one-node-re-sorted", "many-nodes-sorted-again"])
def test_the_bound_index_follows_changes_to_many_nodes(changed: int) -> None:
    """After changes to a few nodes the index re-sorts them; after many (a re-list), all of them."""
    ledger = Ledger(TENTH)
    names = [f"n{i:03}" for i in range(120)]
    for name in names:
        ledger.upsert_node(NodeInventory(name, _gpus(1)))
    pod = PodClaims("x", (_claim(300),))
    assert sorted_then_one_by_one(ledger, names, pod, CHOICES[0], FilterMemo()) == [_PASS_VERDICT] * 120
    for i, name in enumerate(names[:changed]):
        ledger.reserve(name, PodRef(f"p{i}"), [_claim(700)])
    verdicts = sorted_then_one_by_one(ledger, names, pod, CHOICES[0], FilterMemo())
    assert [v.verdict for v in verdicts] == [Verdict.FAIL] * changed + [Verdict.PASS] * (120 - changed)
    assert [v.verdict for v in verdicts] == [v.verdict for v in filter_nodes(ledger, names, pod, CHOICES[0])]


def test_nodes_refused_one_by_one_with_different_rooms_share_their_kinds_reason() -> None:
    """Outside the index too, a node refused on its bound gets its kind's line, not its own room:
    nodes failing the same way give the scheduler's event one line, and the answer stays short."""
    ledger = Ledger(TENTH)
    for i, held in enumerate((700, 650, 820)):
        ledger.upsert_node(NodeInventory(f"n{i}", _gpus(2)))
        ledger.reserve(f"n{i}", PodRef(f"p{i}"), [_claim(held)])
    verdicts = filter_nodes(ledger, ["n0", "n1", "n2"], PodClaims("x", (_claim(300),)), CHOICES[0], FilterMemo())
    assert {v.verdict for v in verdicts} == {Verdict.FAIL}
    # The pods held on these nodes have no known GPU (no agent report): counted where they hurt most.
    assert {v.message for v in verdicts} == {
        "GPU (Test GPU): VRAM budget free below the pod's 300 B per GPU; counting pods whose GPU is not known yet"
    }
    assert len({id(v.message) for v in verdicts}) == 1


def test_a_fit_short_of_vram_names_the_kind_in_the_filter_and_the_device_at_bind() -> None:
    """Two claims the device plugin may stack on one GPU: the filter's reason is the kind's (equal
    for nodes of different rooms); without a request's memo (bind) the device and its numbers."""
    ledger = Ledger(TENTH)
    for i, held in enumerate((550, 500)):
        ledger.upsert_node(NodeInventory(f"n{i}", _gpus(2)))
        ledger.reserve(f"n{i}", PodRef(f"p{i}"), [_claim(held)])
    pod = PodClaims("x", (_claim(300), _claim(300)))
    verdicts = filter_nodes(ledger, ["n0", "n1"], pod, CHOICES[0], FilterMemo())
    assert {v.message for v in verdicts} == {
        "GPU (Test GPU): VRAM budget free below what the pod needs where the device plugin gives several of "
        "its GPU replicas one GPU; counting pods whose GPU is not known yet"
    }
    [alone] = filter_nodes(ledger, ["n0"], pod, CHOICES[0])
    assert alone.message.startswith("GPU 0 (Test GPU): 350 B of 900 B VRAM budget free, pod needs 600 B on it")


def test_the_bound_index_decides_claims_the_device_plugin_may_stack() -> None:
    """Room for each claim but not for two on one GPU: the index fails the nodes itself (no check
    of their own), with the line the one-by-one filter gives them."""
    ledger = Ledger(TENTH)
    for i, held in enumerate((550, 500, 0)):
        ledger.upsert_node(NodeInventory(f"n{i}", _gpus(2)))
        ledger.reserve(f"n{i}", PodRef(f"p{i}"), [_claim(held)])
    pod = PodClaims("x", (_claim(300), _claim(300)))
    decided, rest = filter_sorted(ledger, ["n0", "n1", "n2"], pod, CHOICES[0], FilterMemo())
    assert rest == []
    assert decided["n2"].ok
    one_by_one = filter_nodes(ledger, ["n0", "n1"], pod, CHOICES[0], FilterMemo())
    assert [decided["n0"], decided["n1"]] == one_by_one
    assert not one_by_one[0].ok
