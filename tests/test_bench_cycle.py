"""The throughput benchmark's breakdown of a scheduling attempt, read from kube-scheduler's metrics."""

from __future__ import annotations

import os

from bench.extender import cpu_seconds, cycle_figures

EXPOSITION = """\
# HELP scheduler_scheduling_algorithm_duration_seconds [ALPHA] Scheduling algorithm latency in seconds
scheduler_scheduling_algorithm_duration_seconds_bucket{le="0.001"} 0
scheduler_scheduling_algorithm_duration_seconds_sum 3.0
scheduler_scheduling_algorithm_duration_seconds_count 100
scheduler_framework_extension_point_duration_seconds_sum{extension_point="Filter",status="Success"} 0.2
scheduler_framework_extension_point_duration_seconds_count{extension_point="Filter",status="Success"} 100
scheduler_framework_extension_point_duration_seconds_sum{extension_point="Score",status="Success"} 0.05
scheduler_framework_extension_point_duration_seconds_count{extension_point="Score",status="Success"} 100
scheduler_framework_extension_point_duration_seconds_sum{extension_point="PreBind",status="Success"} 9.0
scheduler_framework_extension_point_duration_seconds_count{extension_point="PreBind",status="Success"} 100
scheduler_scheduling_attempt_duration_seconds_sum{profile="vramguard",result="scheduled"} 40.0
scheduler_scheduling_attempt_duration_seconds_count{profile="vramguard",result="scheduled"} 100
scheduler_scheduling_attempt_duration_seconds_sum{profile="vramguard",result="unschedulable"} 1.0
scheduler_scheduling_attempt_duration_seconds_count{profile="vramguard",result="unschedulable"} 50
"""


def test_cycle_figures_are_means_per_attempt_in_milliseconds() -> None:
    # PreBind and unschedulable attempts are left out; buckets are not sums.
    assert cycle_figures(EXPOSITION) == {
        "algorithm_ms": 30.0, "filter_plugins_ms": 2.0, "score_plugins_ms": 0.5, "attempt_scheduled_ms": 400.0,
    }


def test_cycle_figures_of_an_exposition_without_them_are_empty() -> None:
    assert cycle_figures("# nothing\nprocess_cpu_seconds_total 3\n") == {}


def test_cpu_seconds_reads_this_process_and_skips_vanished_ones() -> None:
    used = cpu_seconds({"self": os.getpid(), "gone": 2**22 + 12345})
    assert set(used) == {"self"} and used["self"] >= 0


def test_handshake_part_alternates_both_server_contexts_and_counts_every_handshake() -> None:
    from bench.extender import bench_handshakes  # noqa: PLC0415

    records = bench_handshakes(5)
    assert [r["mode"] for r in records] == ["mutual", "server-only"]
    assert all(r["server_cpu"]["n"] == 5 and r["server_cpu"]["p50_ms"] > 0 for r in records)
