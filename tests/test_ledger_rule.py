"""The rule's own terms, against their plain definitions."""

from __future__ import annotations

from fractions import Fraction
from itertools import combinations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vramguard.inventory import Gpu
from vramguard.ledger_fast import largest_first
from vramguard.ledger_rule import budget_of, whole_share, worst_case


@given(
    st.integers(0, 1000),
    st.integers(-2, 6),
    st.lists(st.integers(0, 500), max_size=6),
)
def test_worst_case_is_the_adversarys_best_pick(known: int, free: int, unknown: list[int]) -> None:
    """Known bytes plus the heaviest choice of at most ``free`` unknown claims the plugin could stack."""
    picks = [sum(chosen) for k in range(max(free, 0) + 1) for chosen in combinations(unknown, min(k, len(unknown)))]
    assert worst_case(known, free, largest_first(unknown)) == known + max(picks)


@pytest.mark.parametrize(
    ("gpu", "margin", "budget", "whole"),
    [
        pytest.param(Gpu("0", 0, "H100", 81559 << 20, "time-slicing", 4, "g"), Fraction(1, 10),
                     76968728985, 76968728985, id="h100-time-sliced"),
        pytest.param(Gpu("0", 0, "H100", 1000, "mps", 4, "g"), Fraction(1, 10), 900, 225, id="mps-replica-share"),
        pytest.param(Gpu("0", 0, "H100", 999, "none", 1, "g"), Fraction(1, 3), 666, 666, id="rounded-down"),
    ],
)
def test_budget_and_whole_share(gpu: Gpu, margin: Fraction, budget: int, whole: int) -> None:
    assert budget_of(gpu, margin) == budget
    assert whole_share(gpu, budget) == whole
