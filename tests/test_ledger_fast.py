"""The ledger's fast check (group summaries, claims prepared once per pod) gives exactly the general one's verdict."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.ledger_strategies import AMOUNTS, GPU, OTHER, TENTH
from vramguard.demand.model import Vram
from vramguard.inventory import Gpu, NodeInventory, Sharing
from vramguard.ledger import Claim, Fit, Ledger, PodRef


@st.composite
def nodes(draw: st.DrawFn) -> NodeInventory:
    """One or two resources, each with devices of one size and sharing (or, sometimes, mixed sizes)."""
    gpus: list[Gpu] = []
    for resource in draw(st.sampled_from([(GPU,), (GPU, OTHER)])):
        sharing: Sharing = draw(st.sampled_from(["time-slicing", "none", "mps"]))
        replicas = 1 if sharing == "none" else draw(st.integers(2, 4))
        memory = draw(st.sampled_from([800, 1000]))
        for _ in range(draw(st.integers(1, 3))):
            size = memory if draw(st.integers(0, 9)) else 1800 - memory
            gpus.append(Gpu(str(len(gpus)), len(gpus), "Test GPU", size, sharing, replicas, resource))
    return NodeInventory("n", tuple(gpus))


def claims_for(draw: st.DrawFn, inventory: NodeInventory, most: int) -> list[Claim]:
    resources = [*inventory.resources(), "nvidia.com/mig-1g.10gb"]
    ids = [g.id for g in inventory.devices]
    return [
        Claim(
            draw(st.sampled_from(resources) if draw(st.integers(0, 9)) == 0 else st.sampled_from(resources[:-1])),
            "c",
            (draw(AMOUNTS),),
            gpu=draw(st.sampled_from(ids)) if draw(st.integers(0, 5)) == 0 else None,
        )
        for _ in range(draw(st.integers(1, most)))
    ]


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[NodeInventory, list[tuple[list[Claim], bool]], list[list[Claim]]]:
    inventory = draw(nodes())
    held = [(claims_for(draw, inventory, 2), draw(st.booleans())) for _ in range(draw(st.integers(0, 10)))]
    asked = [claims_for(draw, inventory, 3) for _ in range(4)]
    return inventory, held, asked


def general(ledger: Ledger, claims: list[Claim]) -> Fit:
    state = ledger._nodes["n"]
    return ledger._fit(state, tuple(claims), None, None)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_fast_check_equals_the_general_check(
    scenario: tuple[NodeInventory, list[tuple[list[Claim], bool]], list[list[Claim]]],
) -> None:
    """Same verdict, same problems, same shortfalls with the same numbers, in the same order;
    also on nodes overcommitted by pods bound without vramguard (forced)."""
    inventory, held, asked = scenario
    ledger = Ledger(TENTH)
    ledger.upsert_node(inventory)
    for i, (claims, force) in enumerate(held):
        ledger.reserve("n", PodRef(str(i)), claims, force=force)
        for claims_asked in asked:
            prepared = tuple(claims_asked)
            assert ledger.fits("n", prepared) == general(ledger, claims_asked)
            assert ledger.fits("n", prepared) == general(ledger, claims_asked)  # the prepared query again
    for claims_asked in asked:
        assert ledger.fits("n", claims_asked) == general(ledger, claims_asked)


def test_a_query_is_not_reused_for_other_claims_or_pods() -> None:
    ledger = Ledger(TENTH)
    ledger.upsert_node(NodeInventory("n", (Gpu("0", 0, "Test GPU", 1000, "time-slicing", 4, GPU),)))
    small = (Claim(GPU, "c", (Vram(bytes=100),)),)
    large = (Claim(GPU, "c", (Vram(bytes=950),)),)
    assert ledger.fits("n", small).ok
    assert not ledger.fits("n", large).ok
    assert ledger.fits("n", small, "someone").ok
