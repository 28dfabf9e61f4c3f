"""The throughput benchmark's breakdown of a scheduling attempt, read from kube-scheduler's metrics."""

from __future__ import annotations

import os
from pathlib import Path

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


def _state(pid: int) -> str:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rfind(")") + 2]


def test_a_paused_wave_stops_its_scheduler_until_opened_and_never_leaves_it_stopped() -> None:
    import asyncio  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import time  # noqa: PLC0415

    from bench.extender import WaveGate  # noqa: PLC0415

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        gate = WaveGate("pause", ["node-a"], lambda *_: None, child.pid)

        def settled(expected: str) -> str:
            for _ in range(100):
                if _state(child.pid) == expected:
                    break
                time.sleep(0.01)
            return _state(child.pid)

        asyncio.run(gate.hold())
        assert settled("T") == "T"
        asyncio.run(gate.open())
        assert settled("S") == "S"
        asyncio.run(gate.hold())
        asyncio.run(gate.close())  # a wave that failed before opening
        assert settled("S") == "S"
    finally:
        child.kill()
        child.wait()


def test_an_uncordon_wave_patches_every_node_both_ways() -> None:
    import asyncio  # noqa: PLC0415

    from bench.extender import WaveGate  # noqa: PLC0415

    patched: list[tuple[str, bool]] = []

    async def patch(name: str, unschedulable: bool) -> None:
        patched.append((name, unschedulable))

    gate = WaveGate("uncordon", ["a", "b"], patch)
    asyncio.run(gate.hold())
    asyncio.run(gate.open())
    asyncio.run(gate.close())
    assert patched == [("a", False), ("b", False), ("a", True), ("b", True)]


def test_verb_figures_count_requests_connections_and_nodes_per_filter() -> None:
    from bench.extender import verb_figures  # noqa: PLC0415

    text = """\
# HELP vramguard_http_request_duration_seconds x
vramguard_http_request_duration_seconds_sum{code="200",route="/filter"} 2.0
vramguard_http_request_duration_seconds_count{code="200",route="/filter"} 1000
vramguard_http_request_duration_seconds_sum{code="200",route="/bind"} 15.0
vramguard_http_request_duration_seconds_count{code="200",route="/bind"} 1000
vramguard_http_request_duration_seconds_count{code="200",route="/metrics"} 3
vramguard_http_connections_total{route="/filter"} 260
vramguard_extender_decisions_total{result="pass",verb="filter"} 200000
vramguard_extender_decisions_total{result="fail",verb="filter"} 30000
vramguard_extender_decisions_total{result="bound",verb="bind"} 1000
"""
    assert verb_figures(text) == {
        "mean_ms": {"filter": 2.0, "bind": 15.0},
        "requests": {"filter": 1000, "bind": 1000},
        "tls_connections": {"filter": 260},
        "nodes_per_filter": 230.0,
    }


def test_the_verbs_part_times_every_step_of_every_pod_and_binds_them_all() -> None:
    import asyncio  # noqa: PLC0415

    from bench.extender import bench_verbs  # noqa: PLC0415

    (record,) = asyncio.run(bench_verbs(nodes=20, pods=30, names=10))
    assert all(record[step]["n"] == 30 for step in ("filter", "prioritize", "bind", "watch_event"))
    assert record["mean_ms_per_pod"] > 0
