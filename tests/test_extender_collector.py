"""The cyclic collector once the extender's state is synced: frozen, full collections rare."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from extender.main import COLLECTOR_THRESHOLDS, freeze_collector


@pytest.fixture
def restored_collector() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("restored_collector")
def test_freezing_moves_the_state_out_of_reach_and_spaces_full_collections() -> None:
    state = [{"node": i} for i in range(100)]  # what the informers built
    freeze_collector()
    assert gc.get_freeze_count() >= len(state)
    assert gc.get_threshold() == COLLECTOR_THRESHOLDS
    young, middle, old = COLLECTOR_THRESHOLDS
    # A full collection after at least a million net allocations, against 70,000 by default.
    assert young * middle * old >= 1_000_000 > 700 * 10 * 10
