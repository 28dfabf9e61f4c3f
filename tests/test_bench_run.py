"""``make bench``'s results file: every figure gathered, two runs compared figure by figure."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import run as bench_run
from bench.extender import Wave, summarize_waves
from bench.report import MIN_PERCENTILE_SAMPLES, TRACING_VARIABLES, refuse_if_traced, undersampled, untraced_environment
from bench.run import HEADLINES, compare, compare_headlines, figures, json_lines, summarise


def results(records: list[dict[str, object]]) -> dict[str, object]:
    return {"benchmarks": {"extender": {"records": records, "returncode": 0}}}


def test_json_lines_keep_the_records_and_skip_tables() -> None:
    text = '{"bench":"scrape","mode":"quiet","filter":{"p99_ms":4.5}}\n| Measurement | Result |\n[1, 2]\n'
    assert json_lines(text) == [{"bench": "scrape", "mode": "quiet", "filter": {"p99_ms": 4.5}}]


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ([{"bench": "scrape", "mode": "quiet", "filter": {"n": 100, "p99_ms": 4.0}}],
         [{"bench": "scrape", "mode": "quiet", "filter": {"n": 100, "p99_ms": 6.0}}],
         ["extender[bench=scrape,mode=quiet].filter.n: 100 -> 100 (1.00x)",
          "extender[bench=scrape,mode=quiet].filter.p99_ms: 4 -> 6 (1.50x)"]),
        # A percentile of too few samples is compared, and marked.
        ([{"bench": "scrape", "mode": "quiet", "filter": {"n": 4, "p99_ms": 4.0}}],
         [{"bench": "scrape", "mode": "quiet", "filter": {"n": 4, "p99_ms": 6.0}}],
         ["extender[bench=scrape,mode=quiet].filter.n: 4 -> 4 (1.00x)",
          "extender[bench=scrape,mode=quiet].filter.p99_ms: 4 -> 6 (1.50x) [p99_ms of n=4 (< 100)]"]),
        # Records told apart by their string fields: quiet is not compared with a scrape.
        ([{"bench": "scrape", "mode": "quiet", "n": 100}],
         [{"bench": "scrape", "mode": "scrape-per-node", "n": 100}],
         []),
        ([{"bench": "memory", "rss_bytes": 0}], [{"bench": "memory", "rss_bytes": 5}],
         ["extender[bench=memory].rss_bytes: 0 -> 5 (-x)"]),
        ([{"bench": "memory", "traced": True, "rss_bytes": 2}], [{"bench": "memory", "traced": False, "rss_bytes": 2}],
         []),
    ],
    ids=["same-record", "undersampled-marked", "different-records", "zero-before", "flag-tells-apart"],
)
def test_compare_pairs_figures_by_benchmark_record_and_path(
    old: list[dict[str, object]], new: list[dict[str, object]], expected: list[str]
) -> None:
    assert compare(results(new), results(old)) == expected


def test_figures_skip_flags_and_strings() -> None:
    found = dict(figures(results([{"bench": "scrape", "per_gpu": True, "bytes": 10, "note": "x"}])))
    assert found == {"extender[bench=scrape,note=x,per_gpu=True].bytes": 10.0}


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"filter": {"n": 100, "p50_ms": 1, "p99_ms": 2}}, []),
        ({"filter": {"n": 99, "p50_ms": 1, "p99_ms": 2}}, [(".filter", "p50_ms, p99_ms of n=99 (< 100)")]),
        ({"lag": {"p99_ms": 2, "max_ms": 3}}, [(".lag", "p99_ms without n")]),
        ({"n": True, "p50": 1}, [("", "p50 without n")]),
        ({"p99_ratio_to_quiet": 1.2, "max_ms": 4, "filter_ms": 3}, []),
        ({"a": {"b": {"n": 5, "p99.9_us": 1}}}, [(".a.b", "p99.9_us of n=5 (< 100)")]),
    ],
    ids=["enough", "one-short", "no-n", "n-not-a-number", "not-percentiles", "nested"],
)
def test_undersampled_names_each_thin_percentile_group(
    record: dict[str, Any], expected: list[tuple[str, str]]
) -> None:
    assert MIN_PERCENTILE_SAMPLES == 100
    assert list(undersampled(record)) == expected


def full_results(**overrides: dict[str, Any]) -> dict[str, Any]:
    """Records of every benchmark as ``make bench`` prints them, each headline present once."""
    stats = {"n": 120, "p50_ms": 1.0, "p99_ms": 2.0, "max_ms": 3.0}
    extender: list[dict[str, Any]] = [
        {"bench": "latency", "mode": "in-process", "phase": "first-after-sync", "filter_ms": 7.0, "warm_ms": 20.0},
        {"bench": "lag", "phase": "pathological", "pod": "200x1000", "filter_ms": 9.9},
        {"bench": "memory", "rss_mib": 150.0, "peak_rss_mib": 190.0, "rss_delta_mib": 100.0,
         "tracemalloc_held_mib": 50.0, "relist_pods_s": 4.0},
    ]
    for mode in ("in-process", "https"):
        extender.append({"bench": "latency", "mode": mode, "phase": "steady", "filter": stats, "prioritize": stats})
        extender.append({"bench": "latency", "mode": mode, "phase": "first-of-wave",
                         "filter_ms": {"a": 1.0, "b": 2.0}, "prioritize_ms": {"a": 1.0, "b": 2.0}})
    for names in ("all", "default"):
        extender.append({"bench": "latency", "mode": "https", "phase": "cold-shapes", "names": names,
                         "filter": stats})
    for mode in ("sliced", "unsliced"):
        extender.append({"bench": "lag", "mode": mode, "lag": stats, "filter": stats})
    for per_gpu in (False, True):
        extender.append({"bench": "scrape", "phase": "exposition", "per_gpu": per_gpu, "bytes": 10, "series": 2,
                         "render_cpu_ms": 5.0})
    extender.append({"bench": "scrape", "mode": "quiet", "filter": stats})
    for mode in ("scrape-per-node", "scrape-per-gpu"):
        extender.append({"bench": "scrape", "mode": mode, "filter": stats, "p99_ratio_to_quiet": 1.1,
                         "render_sliced": stats})
    for mode in ("mutual", "server-only"):
        extender.append({"bench": "tls", "phase": "handshake", "mode": mode, "server_cpu": stats})
    extender.append({"bench": "verbs", "filter": stats, "prioritize": stats, "bind": stats, "watch_event": stats,
                     "mean_ms_per_pod": 0.4})
    benchmarks = {
        "demand": [{"case": "typical vLLM pod", "pods_per_cpu_second": 30000},
                   {"case": "10-container pod", "pods_per_cpu_second": 3000}],
        "webhook": [{"case": "in-process handler, typical GPU pod", "reviews_per_cpu_second": 9000}],
        "extender": extender,
    }
    benchmarks |= overrides
    return {"benchmarks": {name: {"records": records, "returncode": 0} for name, records in benchmarks.items()}}


def test_every_headline_is_found_in_a_full_run() -> None:
    results = summarise(full_results())
    assert results["missing"] == []
    assert results["undersampled"] == {}
    assert set(results["headlines"]) == {h.name for h in HEADLINES}
    assert len({h.name for h in HEADLINES}) == len(HEADLINES), "headline names must be unique"
    assert results["headlines"]["demand.typical_pod.pods_per_cpu_second"] == 30000
    assert results["headlines"]["latency.https.new_shape.default_names.filter.p99_ms"] == 2.0
    assert results["figures"]["demand[case=typical vLLM pod].pods_per_cpu_second"] == 30000


@pytest.mark.parametrize(
    ("overrides", "missing"),
    [
        ({"demand": [{"case": "typical vLLM pod", "pods_per_cpu_second": 30000}]},
         ["demand.ten_container_pod.pods_per_cpu_second"]),
        # A record that renamed its figure loses the headline: it is reported, not silently dropped.
        ({"webhook": [{"case": "in-process handler, typical GPU pod", "reviews_per_second": 9000}]},
         ["webhook.in_process.reviews_per_cpu_second"]),
    ],
    ids=["record-gone", "figure-renamed"],
)
def test_missing_headlines_are_listed(overrides: dict[str, Any], missing: list[str]) -> None:
    assert summarise(full_results(**overrides))["missing"] == missing


def test_headlines_of_a_benchmark_that_did_not_run_are_not_missing() -> None:
    results = full_results()
    results["benchmarks"]["extender"]["returncode"] = 1
    results["benchmarks"]["extender"]["records"] = []
    missing = summarise(results)["missing"]
    assert all(not name.startswith(("latency.", "lag.", "memory.", "scrape.")) for name in missing)


def test_compare_headlines_prints_ratios_in_table_order() -> None:
    old = full_results()
    new = full_results(demand=[{"case": "typical vLLM pod", "pods_per_cpu_second": 60000},
                               {"case": "10-container pod", "pods_per_cpu_second": 3000}])
    lines = compare_headlines(new, old)
    assert lines[:2] == ["demand.typical_pod.pods_per_cpu_second: 30000 -> 60000 (2.00x)",
                         "demand.ten_container_pod.pods_per_cpu_second: 3000 -> 3000 (1.00x)"]
    assert len(lines) == len(HEADLINES)


def test_tracing_variables_are_kept_from_the_benchmarks() -> None:
    environ = {"PATH": "/bin", **dict.fromkeys(TRACING_VARIABLES, "1")}
    assert untraced_environment(environ) == {"PATH": "/bin"}


def test_a_timed_run_refuses_tracemalloc() -> None:
    import tracemalloc  # noqa: PLC0415

    refuse_if_traced()
    tracemalloc.start()
    try:
        with pytest.raises(RuntimeError, match="tracemalloc"):
            refuse_if_traced()
    finally:
        tracemalloc.stop()


def test_main_writes_one_file_and_compares_with_the_previous_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench-results.json"
    out.write_text(json.dumps(full_results()))
    fresh = full_results(demand=[{"case": "typical vLLM pod", "pods_per_cpu_second": 45000},
                                 {"case": "10-container pod", "pods_per_cpu_second": 3000}])
    fresh["benchmarks"]["extender"]["records"][3]["filter"] = {"n": 4, "p50_ms": 1.0, "p99_ms": 2.0}
    monkeypatch.setattr(bench_run, "run", lambda commands: summarise(json.loads(json.dumps(fresh))))
    assert bench_run.main(["--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["headlines"]["demand.typical_pod.pods_per_cpu_second"] == 45000
    printed = capsys.readouterr()
    assert "demand.typical_pod.pods_per_cpu_second: 30000 -> 45000 (1.50x)" in printed.out
    assert "too few samples" in printed.err
    # --strict refuses a run with a thin percentile.
    assert bench_run.main(["--out", str(out), "--no-compare", "--strict"]) == 1


def test_the_latency_part_reports_no_percentile_of_the_four_wave_shapes() -> None:
    """Each wave's first request is one value per shape: reported as values, never as a percentile."""
    waves = {f"shape-{i}": Wave([0.001 * (i + 1)] * 76, [0.002] * 76, [10] * 76, [0] * 76) for i in range(4)}
    records = summarize_waves("https", waves, 5000)
    assert [list(undersampled(r)) for r in records] == [[], [], []]
    [first] = [r for r in records if r["phase"] == "first-of-wave"]
    assert first["filter_ms"] == {"shape-0": 1.0, "shape-1": 2.0, "shape-2": 3.0, "shape-3": 4.0}
    assert not any(r["phase"] == "cold" for r in records)
