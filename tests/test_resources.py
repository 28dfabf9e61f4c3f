"""Memory requests and limits of the shipped containers cover the measured resident memory.

The figures are ``python -m e2e.soak_memory --nodes 1000 --pods 10000`` (docs/benchmarks.md, "Resources"):
process RSS from /proc, steady with that load and at the peak of a restart's re-list. A request
must hold the steady figure, a limit the peak with room for a cluster several times larger, and
the kustomize manifests and the Helm chart's defaults must agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from vramguard.quantity import MiB, parse_bytes

ROOT = Path(__file__).resolve().parent.parent
STEADY_MIB = {"extender": 101, "webhook": 102, "agent": 88}
"""RSS with 1,000 nodes and 10,000 GPU pods (the agent: reporting one node)."""
PEAK_MIB = {"extender": 125, "webhook": 125, "agent": 88}
"""RSS at the peak of a restart's re-list of the same cluster."""
LIMIT_HEADROOM = 2
"""A limit is at least twice the measured peak: the re-list grows about 5 MiB per 1,000 pods."""

KUSTOMIZE = {
    "extender": [
        (ROOT / "manifests" / "base" / "scheduler.yaml", "Deployment", "extender"),
        (ROOT / "manifests" / "overlays" / "default-scheduler" / "extender.yaml", "Deployment", "extender"),
    ],
    "webhook": [(ROOT / "manifests" / "webhook" / "deployment.yaml", "Deployment", "webhook")],
    "agent": [(ROOT / "manifests" / "base" / "agent.yaml", "DaemonSet", "agent")],
}


def container_resources(path: Path, kind: str, container: str) -> dict[str, Any]:
    """The ``resources`` of ``container`` in the first ``kind`` of the YAML file."""
    for document in yaml.safe_load_all(path.read_text()):
        if isinstance(document, dict) and document.get("kind") == kind:
            for item in document["spec"]["template"]["spec"]["containers"]:
                if item["name"] == container:
                    resources: dict[str, Any] = item["resources"]
                    return resources
    raise AssertionError(f"no container {container} in a {kind} of {path}")


def chart_resources(component: str) -> dict[str, Any]:
    """The chart's default ``resources`` of a component."""
    values = yaml.safe_load((ROOT / "charts" / "vramguard" / "values.yaml").read_text())
    resources: dict[str, Any] = values[component]["resources"]
    return resources


CASES = [
    pytest.param(component, path, kind, container, id=f"{component}-{path.parent.name}-{path.stem}")
    for component, places in KUSTOMIZE.items()
    for path, kind, container in places
]


@pytest.mark.parametrize(("component", "path", "kind", "container"), CASES)
def test_requests_and_limits_cover_the_measured_memory(component: str, path: Path, kind: str, container: str) -> None:
    resources = container_resources(path, kind, container)
    request = parse_bytes(str(resources["requests"]["memory"]))
    limit = parse_bytes(str(resources["limits"]["memory"]))
    assert request >= STEADY_MIB[component] * MiB, f"{component}: request {request // MiB} MiB below steady RSS"
    assert limit >= LIMIT_HEADROOM * PEAK_MIB[component] * MiB, f"{component}: limit {limit // MiB} MiB too tight"
    assert request <= limit


@pytest.mark.parametrize(("component", "path", "kind", "container"), CASES)
def test_the_chart_ships_the_same_resources_as_the_manifests(
    component: str, path: Path, kind: str, container: str
) -> None:
    assert chart_resources(component) == container_resources(path, kind, container)
