"""``make bench``'s results file: every figure gathered, two runs compared figure by figure."""

from __future__ import annotations

import pytest

from bench.run import compare, figures, json_lines


def results(records: list[dict[str, object]]) -> dict[str, object]:
    return {"benchmarks": {"extender": {"records": records, "returncode": 0}}}


def test_json_lines_keep_the_records_and_skip_tables() -> None:
    text = '{"bench":"scrape","mode":"quiet","filter":{"p99_ms":4.5}}\n| Measurement | Result |\n[1, 2]\n'
    assert json_lines(text) == [{"bench": "scrape", "mode": "quiet", "filter": {"p99_ms": 4.5}}]


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ([{"bench": "scrape", "mode": "quiet", "filter": {"p99_ms": 4.0}}],
         [{"bench": "scrape", "mode": "quiet", "filter": {"p99_ms": 6.0}}],
         ["extender[bench=scrape,mode=quiet].filter.p99_ms: 4 -> 6 (1.50x)"]),
        # Records told apart by their string fields: quiet is not compared with a scrape.
        ([{"bench": "scrape", "mode": "quiet", "n": 100}],
         [{"bench": "scrape", "mode": "scrape-per-node", "n": 100}],
         []),
        ([{"bench": "memory", "rss_bytes": 0}], [{"bench": "memory", "rss_bytes": 5}],
         ["extender[bench=memory].rss_bytes: 0 -> 5 (-x)"]),
        ([{"bench": "memory", "traced": True, "rss_bytes": 2}], [{"bench": "memory", "traced": False, "rss_bytes": 2}],
         []),
    ],
    ids=["same-record", "different-records", "zero-before", "flag-tells-apart"],
)
def test_compare_pairs_figures_by_benchmark_record_and_path(
    old: list[dict[str, object]], new: list[dict[str, object]], expected: list[str]
) -> None:
    assert compare(results(new), results(old)) == expected


def test_figures_skip_flags_and_strings() -> None:
    found = dict(figures(results([{"bench": "scrape", "per_gpu": True, "bytes": 10, "note": "x"}])))
    assert found == {"extender[bench=scrape,note=x,per_gpu=True].bytes": 10.0}
