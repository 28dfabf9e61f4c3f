"""Run every benchmark of ``make bench`` and write all their figures to one JSON file.

    python -m bench.run [--out FILE] [--compare OLD.json] [--quick] [--extender PARTS]

Each benchmark runs in its own interpreter (no state, cache or profiler shared between them) and
prints JSON lines; they are gathered, with the machine and its load, into ``--out``. With
``--compare`` every number found under the same key in both files is printed with its ratio new /
old, so that two runs (two commits, two machines) can be set side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

JSON = dict[str, Any]
DEFAULT_OUT = Path("bench-results.json")
DEFAULT_EXTENDER_PARTS = "latency,lag,scrape,memory"
"""``throughput`` needs the control-plane binaries of the e2e suite: add it with ``--extender``."""


def benchmarks(quick: bool, extender_parts: str) -> dict[str, list[str]]:
    """Name -> command line of each benchmark."""
    python = sys.executable
    commands = {
        "demand": [python, "-m", "bench.demand", *(["--seconds", "0.5"] if quick else [])],
        "webhook": [python, "-m", "bench.webhook", *(["--requests", "2000"] if quick else [])],
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
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        sys.stderr.write(done.stdout)
        sys.stderr.write(done.stderr[-4000:])
        results["benchmarks"][name] = {
            "command": command[1:], "returncode": done.returncode,
            "seconds": round(time.perf_counter() - started, 1), "records": json_lines(done.stdout),
        }
    results["machine"]["load_average_after"] = [round(v, 1) for v in os.getloadavg()]
    return results


def _record_key(record: JSON) -> str:
    # What tells two records of one benchmark apart: their string-valued fields (bench, mode, phase, case).
    return ",".join(f"{k}={v}" for k, v in sorted(record.items()) if isinstance(v, str | bool) and k != "command")


def figures(results: JSON) -> Iterator[tuple[str, float]]:
    """Every number of a results file, keyed by benchmark, record and path inside the record."""
    def walk(prefix: str, value: Any) -> Iterator[tuple[str, float]]:
        if isinstance(value, dict):
            for key, inner in value.items():
                yield from walk(f"{prefix}.{key}", inner)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            yield prefix, float(value)

    for name, bench in results.get("benchmarks", {}).items():
        for record in bench.get("records", []):
            yield from walk(f"{name}[{_record_key(record)}]", {k: v for k, v in record.items()
                                                              if not isinstance(v, str | bool)})


def compare(new: JSON, old: JSON) -> list[str]:
    """One line per figure present in both: old, new and new / old."""
    before = dict(figures(old))
    lines = []
    for key, value in figures(new):
        if key in before:
            ratio = f"{value / before[key]:.2f}" if before[key] else "-"
            lines.append(f"{key}: {before[key]:g} -> {value:g} ({ratio}x)")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks, write the results file, print the comparison when asked."""
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results file (default {DEFAULT_OUT})")
    parser.add_argument("--compare", type=Path, help="an earlier results file: print every figure's ratio")
    parser.add_argument("--quick", action="store_true", help="smaller runs, for a smoke test")
    parser.add_argument("--extender", default=DEFAULT_EXTENDER_PARTS,
                        help=f"parts of bench.extender (default {DEFAULT_EXTENDER_PARTS}; empty for none)")
    args = parser.parse_args(argv)
    old = json.loads(args.compare.read_text()) if args.compare else None
    results = run(benchmarks(args.quick, args.extender))
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    if old is not None:
        print("\n".join(compare(results, old)))
    failed = [name for name, bench in results["benchmarks"].items() if bench["returncode"] != 0]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
