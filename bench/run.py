"""Run every benchmark of ``make bench`` and write all their figures to one JSON file.

    python -m bench.run [--out FILE] [--compare OLD.json | --no-compare] [--quick] [--extender PARTS] [--strict]

Each benchmark runs in its own interpreter (no state, cache or profiler shared between them, and
none of the variables that switch on ``tracemalloc`` or a tracer) and prints JSON lines; they are
gathered, with the machine and its load, into ``--out``. The file holds the records as printed,
``figures`` (every number, under a key made of the benchmark, the record's string fields and the
path inside it) and ``headlines`` (the README's figures under stable names, see
:data:`HEADLINES`). Each percentile must rest on at least 100 samples and every headline must be
found: the ones that are not are listed under ``undersampled`` and ``missing``, printed, and make
``--strict`` fail. With ``--compare`` (by default the previous ``--out`` file, when there is one)
every figure found under the same key in both files is printed with its ratio new / old, so that
two runs (two commits, two machines) can be set side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from bench.report import is_percentile, undersampled, untraced_environment

JSON = dict[str, Any]
DEFAULT_OUT = Path("bench-results.json")
DEFAULT_EXTENDER_PARTS = "latency,lag,scrape,memory,tls,verbs"
"""``throughput`` needs the control-plane binaries of the e2e suite: add it with ``--extender``."""


def benchmarks(quick: bool, extender_parts: str) -> dict[str, list[str]]:
    """Name -> command line of each benchmark."""
    python = sys.executable
    commands = {
        "demand": [python, "-m", "bench.demand", *(["--seconds", "0.5"] if quick else [])],
        "webhook": [python, "-m", "bench.webhook", *(["--requests", "2000"] if quick else [])],
        "dra": [python, "-m", "bench.dra", *(["--samples", "100"] if quick else [])],
    }
    if extender_parts:
        commands["extender"] = [python, "-m", "bench.extender", "--only", extender_parts,
                                *(["--quick"] if quick else [])]
    return commands


def json_lines(text: str) -> list[JSON]:
    """The JSON objects among a benchmark's output lines (tables and logs are skipped)."""
    records = []
    for line in text.splitlines():
        if line.startswith("{"):
            value = json.loads(line)
            if isinstance(value, dict):
                records.append(value)
    return records


def run(commands: dict[str, list[str]]) -> JSON:
    """Run each benchmark; its records, wall time and exit status under its name."""
    results: JSON = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "load_average_before": [round(v, 1) for v in os.getloadavg()]},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "benchmarks": {},
    }
    for name, command in commands.items():
        print(f"== {name}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=False, env=untraced_environment())
        sys.stderr.write(done.stdout)
        sys.stderr.write(done.stderr[-4000:])
        results["benchmarks"][name] = {
            "command": command[1:], "returncode": done.returncode,
            "seconds": round(time.perf_counter() - started, 1), "records": json_lines(done.stdout),
        }
    results["machine"]["load_average_after"] = [round(v, 1) for v in os.getloadavg()]
    return summarise(results)


def summarise(results: JSON) -> JSON:
    """Add ``figures``, ``headlines``, ``missing`` and ``undersampled`` to a results file's records."""
    results["figures"] = dict(figures(results))
    results["headlines"] = headlines(results)
    ran = {name for name, bench in results.get("benchmarks", {}).items() if bench.get("returncode") == 0}
    results["missing"] = [h.name for h in HEADLINES if h.benchmark in ran and h.name not in results["headlines"]]
    results["undersampled"] = dict(undersampled_groups(results))
    return results


def _record_key(record: JSON) -> str:
    # What tells two records of one benchmark apart: their string-valued fields (bench, mode, phase, case).
    return ",".join(f"{k}={v}" for k, v in sorted(record.items()) if isinstance(v, str | bool) and k != "command")


def _records(results: JSON) -> Iterator[tuple[str, JSON]]:
    for name, bench in results.get("benchmarks", {}).items():
        for record in bench.get("records", []):
            yield name, record


def figures(results: JSON) -> Iterator[tuple[str, float]]:
    """Every number of a results file, keyed by benchmark, record and path inside the record."""
    def walk(prefix: str, value: Any) -> Iterator[tuple[str, float]]:
        if isinstance(value, dict):
            for key, inner in value.items():
                yield from walk(f"{prefix}.{key}", inner)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            yield prefix, float(value)

    for name, record in _records(results):
        yield from walk(f"{name}[{_record_key(record)}]", {k: v for k, v in record.items()
                                                          if not isinstance(v, str | bool)})


def undersampled_groups(results: JSON) -> Iterator[tuple[str, str]]:
    """Each group of percentiles resting on fewer samples than the minimum: its key prefix, and why."""
    for name, record in _records(results):
        prefix = f"{name}[{_record_key(record)}]"
        for where, why in undersampled(record):
            yield prefix + where, why


class Headline(NamedTuple):
    """A figure of the README's benchmark table: its stable name, and where its record prints it."""

    name: str
    benchmark: str
    match: Mapping[str, object]
    """Fields the record has (``bench``, ``mode``, ``phase``, ``case``)."""
    path: str
    """Dotted path of the number inside the record."""


def _latency_headlines() -> list[Headline]:
    rows = []
    for mode, short in (("in-process", "in_process"), ("https", "https")):
        # The steady requests only: a percentile of the 4 wave shapes' first requests would be its
        # maximum; the cold figures are the 120 new shapes' below.
        for verb in ("filter", "prioritize"):
            for stat in ("p50_ms", "p99_ms"):
                rows.append(Headline(f"latency.{short}.steady.{verb}.{stat}", "extender",
                                     {"bench": "latency", "mode": mode, "phase": "steady"}, f"{verb}.{stat}"))
    for names in ("all", "default"):
        for stat in ("p50_ms", "p99_ms"):
            rows.append(Headline(f"latency.https.new_shape.{names}_names.filter.{stat}", "extender",
                                 {"bench": "latency", "phase": "cold-shapes", "names": names}, f"filter.{stat}"))
    rows.append(Headline("latency.first_filter_after_sync_ms", "extender",
                         {"bench": "latency", "phase": "first-after-sync"}, "filter_ms"))
    rows.append(Headline("latency.warm_at_sync_ms", "extender", {"bench": "latency", "phase": "first-after-sync"},
                         "warm_ms"))
    return rows


def _other_headlines() -> list[Headline]:
    rows = [
        Headline("demand.typical_pod.pods_per_cpu_second", "demand", {"case": "typical vLLM pod"},
                 "pods_per_cpu_second"),
        Headline("demand.ten_container_pod.pods_per_cpu_second", "demand", {"case": "10-container pod"},
                 "pods_per_cpu_second"),
        Headline("webhook.in_process.reviews_per_cpu_second", "webhook",
                 {"case": "in-process handler, typical GPU pod"}, "reviews_per_cpu_second"),
        Headline("lag.pathological_200x1000.filter_ms", "extender", {"bench": "lag", "pod": "200x1000"}, "filter_ms"),
        Headline("memory.rss_mib", "extender", {"bench": "memory"}, "rss_mib"),
        Headline("memory.peak_rss_mib", "extender", {"bench": "memory"}, "peak_rss_mib"),
        Headline("memory.rss_growth_mib", "extender", {"bench": "memory"}, "rss_delta_mib"),
        Headline("memory.heap_mib", "extender", {"bench": "memory"}, "tracemalloc_held_mib"),
        Headline("memory.relist_pods_s", "extender", {"bench": "memory"}, "relist_pods_s"),
    ]
    for mode in ("sliced", "unsliced"):
        for stat in ("p50_ms", "p99_ms", "max_ms"):
            rows.append(Headline(f"lag.{mode}.lag.{stat}", "extender", {"bench": "lag", "mode": mode}, f"lag.{stat}"))
        rows.append(Headline(f"lag.{mode}.filter.p50_ms", "extender", {"bench": "lag", "mode": mode}, "filter.p50_ms"))
    for per_gpu, short in ((False, "per_node"), (True, "per_gpu")):
        for figure in ("bytes", "series", "render_cpu_ms"):
            rows.append(Headline(f"scrape.exposition.{short}.{figure}", "extender",
                                 {"bench": "scrape", "phase": "exposition", "per_gpu": per_gpu}, figure))
    for mode in ("quiet", "scrape-per-node", "scrape-per-gpu"):
        for stat in ("p50_ms", "p99_ms"):
            rows.append(Headline(f"scrape.filter.{mode.replace('-', '_')}.{stat}", "extender",
                                 {"bench": "scrape", "mode": mode}, f"filter.{stat}"))
    for mode in ("scrape-per-node", "scrape-per-gpu"):
        short = mode.replace("-", "_")
        rows.append(Headline(f"scrape.filter.{short}.p99_ratio_to_quiet", "extender", {"bench": "scrape", "mode": mode},
                             "p99_ratio_to_quiet"))
        rows.append(Headline(f"scrape.render_sliced.{short}.p50_ms", "extender", {"bench": "scrape", "mode": mode},
                             "render_sliced.p50_ms"))
    for mode in ("mutual", "server-only"):
        rows.append(Headline(f"tls.handshake.{mode.replace('-', '_')}.server_cpu.p50_ms", "extender",
                             {"bench": "tls", "mode": mode}, "server_cpu.p50_ms"))
    rows.append(Headline("verbs.wave.mean_ms_per_pod", "extender", {"bench": "verbs"}, "mean_ms_per_pod"))
    return rows


HEADLINES: tuple[Headline, ...] = (*_other_headlines()[:3], *_latency_headlines(), *_other_headlines()[3:])
"""The README's ``make bench`` figures under names that stay when records gain fields. The
throughput part (``--extender ...,throughput``) and ``bench.restart`` run outside ``make bench``:
their figures are under ``figures`` only."""


def headlines(results: JSON) -> dict[str, float]:
    """The value of each :data:`HEADLINES` entry found in the results (the first record that matches)."""
    return {name: value for name, (_, value) in _found_headlines(results).items()}


def _found_headlines(results: JSON) -> dict[str, tuple[str, float]]:
    """Each headline found: the key of its figure (as in :func:`figures`) and its value."""
    found: dict[str, tuple[str, float]] = {}
    for headline in HEADLINES:
        for name, record in _records(results):
            if name != headline.benchmark or any(record.get(k) != v for k, v in headline.match.items()):
                continue
            value: Any = record
            for part in headline.path.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if isinstance(value, int | float) and not isinstance(value, bool):
                found[headline.name] = (f"{name}[{_record_key(record)}].{headline.path}", float(value))
                break
    return found


def _ratio_line(key: str, old: float, new: float, flag: str = "") -> str:
    ratio = f"{new / old:.2f}" if old else "-"
    return f"{key}: {old:g} -> {new:g} ({ratio}x){flag}"


def _flag(key: str, thin: Mapping[str, str]) -> str:
    for prefix, why in thin.items():
        if key.startswith(prefix + ".") and is_percentile(key.rsplit(".", 1)[-1]):
            return f" [{why}]"
    return ""


def compare(new: JSON, old: JSON) -> list[str]:
    """One line per figure present in both: old, new and new / old (marked when too few samples)."""
    before = dict(figures(old))
    thin = dict(undersampled_groups(new))
    return [_ratio_line(key, before[key], value, _flag(key, thin)) for key, value in figures(new) if key in before]


def compare_headlines(new: JSON, old: JSON) -> list[str]:
    """One line per headline present in both, in :data:`HEADLINES`' order (marked when too few samples)."""
    before, after = headlines(old), _found_headlines(new)
    thin = dict(undersampled_groups(new))
    return [_ratio_line(h.name, before[h.name], after[h.name][1], _flag(after[h.name][0], thin))
            for h in HEADLINES if h.name in before and h.name in after]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks, write the results file, print the comparison and what is flagged."""
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results file (default {DEFAULT_OUT})")
    parser.add_argument("--compare", type=Path,
                        help="an earlier results file: print every figure's ratio (default: the previous --out)")
    parser.add_argument("--no-compare", action="store_true", help="do not compare with the previous --out file")
    parser.add_argument("--quick", action="store_true", help="smaller runs, for a smoke test")
    parser.add_argument("--extender", default=DEFAULT_EXTENDER_PARTS,
                        help=f"parts of bench.extender (default {DEFAULT_EXTENDER_PARTS}; empty for none)")
    parser.add_argument("--strict", action="store_true",
                        help="fail when a headline figure is missing or a percentile has fewer than 100 samples")
    args = parser.parse_args(argv)
    baseline = args.compare or (None if args.no_compare or not args.out.exists() else args.out)
    old = json.loads(baseline.read_text()) if baseline is not None else None
    results = run(benchmarks(args.quick, args.extender))
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    if old is not None:
        load = old.get("machine", {}).get("load_average_before", "?")
        print(f"compared with {baseline} (started {old.get('started', '?')}, load average {load}): old -> new")
        print("\n".join(["headlines:", *compare_headlines(results, old), "every figure:", *compare(results, old)]))
    for name in results["missing"]:
        print(f"missing headline figure: {name}", file=sys.stderr)
    for where, why in results["undersampled"].items():
        print(f"too few samples: {where}: {why}", file=sys.stderr)
    failed = [name for name, bench in results["benchmarks"].items() if bench["returncode"] != 0]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    flagged = args.strict and bool(results["missing"] or results["undersampled"])
    return 1 if failed or flagged else 0


if __name__ == "__main__":
    raise SystemExit(main())
