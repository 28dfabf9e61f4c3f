"""The Grafana dashboard queries only metrics the code exports, and shows every failure mode's metric.

The code's metric names are read from its source (every ``vramguard_*`` string, and the f-strings
that build names from a module's ``PREFIX`` constants or an app's ``metrics_prefix``), so a panel
that names a metric nobody exports, or a metric renamed in the code but not on the dashboard, fails.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "manifests" / "grafana" / "vramguard-dashboard.json"
SOURCES = ("vramguard", "extender", "webhook", "agent")
METRIC = re.compile(r"\bvramguard_[a-z0-9_]+")
# What the Prometheus client adds to a metric's name in the exposition, by type.
EXPOSITION_SUFFIXES = ("_total", "_created", "_bucket", "_count", "_sum")


def _python_files() -> Iterator[Path]:
    for package in SOURCES:
        yield from (path for path in (ROOT / package).rglob("*.py") if "_pb2" not in path.name)


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "literal"`` assignments."""
    constants = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    constants[target.id] = node.value.value
    return constants


def _prefixes(trees: list[ast.Module]) -> set[str]:
    """Every value a ``metrics_prefix`` takes: parameter defaults and keyword arguments (literal or a constant)."""
    found = set()
    for tree in trees:
        constants = _string_constants(tree)
        for node in ast.walk(tree):
            values: list[ast.expr] = []
            if isinstance(node, ast.keyword) and node.arg == "metrics_prefix":
                values.append(node.value)
            if isinstance(node, ast.arguments):
                positional = node.args[len(node.args) - len(node.defaults) :]
                pairs = [
                    *zip(positional, node.defaults, strict=True),
                    *zip(node.kwonlyargs, node.kw_defaults, strict=True),
                ]
                values += [d for a, d in pairs if a.arg == "metrics_prefix" and d is not None]
            for value in values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    found.add(value.value)
                elif isinstance(value, ast.Name) and value.id in constants:
                    found.add(constants[value.id])
    return found


@functools.cache
def code_metric_names() -> frozenset[str]:
    """The metric names the code can export (without the exposition's suffixes)."""
    trees = [ast.parse(path.read_text(), str(path)) for path in _python_files()]
    prefixes = _prefixes(trees)
    names: set[str] = set()
    for tree in trees:
        constants = _string_constants(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.update(METRIC.findall(node.value))
            elif isinstance(node, ast.JoinedStr) and len(node.values) == 2:
                head, tail = node.values
                if not (
                    isinstance(head, ast.FormattedValue)
                    and isinstance(head.value, ast.Name)
                    and isinstance(tail, ast.Constant)
                    and isinstance(tail.value, str)
                ):
                    continue
                if head.value.id in constants:
                    names.add(constants[head.value.id] + tail.value)
                elif head.value.id == "metrics_prefix":
                    names.update(prefix + tail.value for prefix in prefixes)
    return frozenset(name for name in names if METRIC.fullmatch(name))


def panel_metrics() -> dict[str, set[str]]:
    """Panel title -> the metric names its queries use."""
    dashboard = json.loads(DASHBOARD.read_text())
    return {
        panel["title"]: {m for target in panel.get("targets", []) for m in METRIC.findall(target["expr"])}
        for panel in dashboard["panels"]
    }


def exported(name: str, known: frozenset[str]) -> bool:
    """Whether ``name`` (as a query writes it, perhaps with an exposition suffix) is one the code exports."""
    return name in known or any(name.endswith(s) and name.removesuffix(s) in known for s in EXPOSITION_SUFFIXES)


def test_the_code_scan_finds_names_built_from_prefixes() -> None:
    known = code_metric_names()
    # Built as f"{metrics_prefix}_http_request_duration_seconds" and f"{PREFIX}_gpu_memory_used_bytes".
    assert "vramguard_http_request_duration_seconds" in known
    assert "vramguard_webhook_http_request_duration_seconds" in known
    assert "vramguard_agent_gpu_memory_used_bytes" in known
    assert not exported("vramguard_extender_no_such_metric_total", known)


@pytest.mark.parametrize("title", sorted(panel_metrics()))
def test_every_panel_queries_metrics_the_code_exports(title: str) -> None:
    known = code_metric_names()
    used = panel_metrics()[title]
    assert used, f"panel {title!r} queries no vramguard metric"
    assert {name for name in used if not exported(name, known)} == set()


@pytest.mark.parametrize(
    ("failure_mode", "metric"),
    [
        ("watch restarts", "vramguard_watch_restarts_total"),
        ("re-lists", 'vramguard_watch_restarts_total{reason!="connection"}'),
        ("oversized events", "vramguard_watch_oversized_events_total"),
        ("in-flight reservations", "vramguard_extender_in_flight_reservations"),
        ("oldest in-flight reservation", "vramguard_extender_in_flight_oldest_seconds"),
        ("binds refused at bind", 'vramguard_extender_decisions_total{verb="bind",result="error"}'),
        ("binds refused by a standby", 'vramguard_extender_not_leader_refusals_total{verb="bind"}'),
        ("leader status", "vramguard_extender_leader"),
        ("leader transitions", "vramguard_extender_lease_transitions_total"),
        ("worst case held for pods whose GPU is not known", "vramguard_node_unplaced_bytes"),
        ("nodes without a fresh agent report", "vramguard_node_agent_report"),
        ("GPU pods pending on VRAM", "vramguard_extender_unschedulable_pods"),
    ],
)
def test_the_dashboard_shows_each_failure_mode(failure_mode: str, metric: str) -> None:
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])]
    assert any(metric in expr for expr in exprs), f"no panel shows {failure_mode} ({metric})"
