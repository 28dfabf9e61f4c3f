"""What every benchmark shares to report honestly: no tracer during a timed run, enough samples.

A profiler, ``tracemalloc`` or a tracer (coverage, a debugger) slows every call or allocation
down, so a figure timed under one says nothing; :func:`refuse_if_traced` stops such a run, and
:func:`untraced_environment` keeps the variables that switch them on away from the benchmarks'
interpreters. A percentile of fewer than :data:`MIN_PERCENTILE_SAMPLES` values is mostly noise
(a p99 of 24 samples is their maximum): :func:`undersampled` names each one in a set of records.
"""

from __future__ import annotations

import os
import re
import sys
import tracemalloc
from collections.abc import Iterator, Mapping
from typing import Any

MIN_PERCENTILE_SAMPLES = 100
"""The fewest values a reported percentile may rest on (a p99 needs 100 to differ from the maximum)."""
TRACING_VARIABLES = (
    "PYTHONTRACEMALLOC",
    "PYTHONPROFILEIMPORTTIME",
    "PYTHONMALLOC",
    "PYTHONDEVMODE",
    "COVERAGE_PROCESS_START",
)
"""Environment variables that make a fresh interpreter trace allocations, imports or lines."""
_PERCENTILE_KEY = re.compile(r"^p\d+(?:\.\d+)?(?:_(?:ms|us|ns|s|bytes|mib))?$")
"""``p50``, ``p99_ms``, ``p99.9_us``: a percentile and its unit (``p99_ratio_to_quiet`` is a ratio, not one)."""


def is_percentile(key: str) -> bool:
    """Whether a figure's name is a percentile (``p99_ms``)."""
    return bool(_PERCENTILE_KEY.match(key))


def tracing() -> list[str]:
    """What is watching this process now and would distort a timing: empty when nothing."""
    found = []
    if tracemalloc.is_tracing():
        found.append("tracemalloc")
    if sys.getprofile() is not None:
        found.append("a profiler (sys.setprofile)")
    if sys.gettrace() is not None:
        found.append("a tracer (sys.settrace: coverage, a debugger)")
    return found


def refuse_if_traced() -> None:
    """Raise ``RuntimeError`` when a timed run is about to start under a profiler or tracer."""
    found = tracing()
    if found:
        raise RuntimeError(f"a timed benchmark must not run under {' and '.join(found)}")


def untraced_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) without :data:`TRACING_VARIABLES`, for a benchmark's interpreter."""
    source = os.environ if environ is None else environ
    return {name: value for name, value in source.items() if name not in TRACING_VARIABLES}


def undersampled(record: Mapping[str, Any], where: str = "") -> Iterator[tuple[str, str]]:
    """Each group of percentiles in ``record`` (at any depth) with no ``n`` or ``n`` under the minimum:
    its path (``.filter``; empty for the record itself) and why."""
    percentiles = sorted(key for key in record if isinstance(key, str) and is_percentile(key))
    if percentiles:
        n = record.get("n")
        if not isinstance(n, int) or isinstance(n, bool):
            yield where, f"{', '.join(percentiles)} without n"
        elif n < MIN_PERCENTILE_SAMPLES:
            yield where, f"{', '.join(percentiles)} of n={n} (< {MIN_PERCENTILE_SAMPLES})"
    for key, value in record.items():
        if isinstance(value, Mapping):
            yield from undersampled(value, f"{where}.{key}")
