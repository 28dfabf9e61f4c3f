"""``bench.demand``: what it times, that it refuses to time under tracemalloc, and its alternated comparison."""

from __future__ import annotations

import tracemalloc

import pytest

from bench.demand import CASES, HERE, TYPICAL_VLLM_POD, against, measure, ten_container_pod
from vramguard.demand import derive_pod_demand


def test_the_cases_are_the_pods_the_readme_names() -> None:
    assert [name for name, _ in CASES] == ["typical vLLM pod", "10-container pod"]
    typical = derive_pod_demand(TYPICAL_VLLM_POD)
    assert [(c.engine, c.gpus, c.errors) for c in typical.containers] == [("vllm", 1, ())]
    assert len(derive_pod_demand(ten_container_pod()).containers) == 10


def test_measure_refuses_to_time_under_tracemalloc() -> None:
    tracemalloc.start()
    try:
        with pytest.raises(RuntimeError, match="tracemalloc"):
            measure("typical vLLM pod", lambda: TYPICAL_VLLM_POD, 0.01)
    finally:
        tracemalloc.stop()
    assert measure("typical vLLM pod", lambda: TYPICAL_VLLM_POD, 0.01)["pods"] >= 2000


def test_against_alternates_two_checkouts_and_reports_ratios() -> None:
    # This checkout against itself: both sides run, and the ratio is their medians' quotient.
    records = against(HERE, rounds=1, seconds=0.01)
    assert [r["case"] for r in records] == ["typical vLLM pod", "10-container pod"]
    for record in records:
        assert record["rounds"] == 1
        assert record["pods_per_cpu_second"] > 0 and record["baseline_pods_per_cpu_second"] > 0
        assert record["ratio"] == round(record["pods_per_cpu_second"] / record["baseline_pods_per_cpu_second"], 2)
