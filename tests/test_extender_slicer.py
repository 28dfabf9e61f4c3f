"""Filter and prioritize yield to the event loop after a slice of their own CPU work, not of wall time."""

from __future__ import annotations

import asyncio
import time

import pytest

from extender.verbs import Slicer


def _spin(seconds: float) -> None:
    """Work on the CPU for ``seconds`` of this thread's CPU time."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


async def _yielded(slicer: Slicer) -> bool:
    ran: list[int] = []
    asyncio.get_running_loop().call_soon(ran.append, 1)
    await slicer.pause()
    return ran == [1]


@pytest.mark.parametrize(
    ("off_cpu", "working", "yields"),
    [(0.0, 0.0, False), (0.02, 0.0, False), (0.0, 0.005, True), (0.02, 0.005, True)],
    ids=["fresh", "time-off-the-cpu-only", "a-slice-of-work", "work-after-time-off-the-cpu"],
)
async def test_slicer_yields_after_its_budget_of_cpu_work(off_cpu: float, working: float, yields: bool) -> None:
    slicer = Slicer(0.002)
    time.sleep(off_cpu)  # what a preempted or blocked thread sees: the wall clock runs, its CPU time does not
    _spin(working)
    assert await _yielded(slicer) is yields


async def test_slicer_without_a_budget_never_yields() -> None:
    slicer = Slicer(None)
    _spin(0.005)
    assert await _yielded(slicer) is False
