"""vramguard's predictions against published measurements of what servers really held.

Each entry of ``tests/data/measurements.yaml`` is a manifest as it was run, the GPU it ran on and
what its process held there, with the source and its words. The prediction, for the same manifest on
a GPU of that size that the pod owns alone, must never be below what was observed; and docs/vram-model.md
lists each with both numbers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from vramguard.demand.derive import derive_pod_demand
from vramguard.policy import default_policy
from vramguard.quantity import MiB

ROOT = Path(__file__).resolve().parent.parent
MEASUREMENTS: list[dict[str, Any]] = yaml.safe_load((ROOT / "tests" / "data" / "measurements.yaml").read_text())[
    "measurements"
]


def predicted_mib(entry: dict[str, Any]) -> int:
    container: dict[str, Any] = {"name": "server", "image": entry["image"],
                                 "resources": {"limits": {"nvidia.com/gpu": str(entry["gpus"])}}}
    for key in ("command", "args"):
        if key in entry:
            container[key] = entry[key]
    demand = derive_pod_demand({"metadata": {"name": "p"}, "spec": {"containers": [container]}},
                               default_policy().demand_options())
    [found] = demand.containers
    device = entry["gpu_mib"] * MiB
    return max(v.on_device(device, whole=device) for v in found.reservations) // MiB


@pytest.mark.parametrize("entry", MEASUREMENTS, ids=[m["id"] for m in MEASUREMENTS])
def test_never_below_what_was_measured(entry: dict[str, Any]) -> None:
    assert predicted_mib(entry) >= entry["observed_mib"]


def test_the_docs_table_shows_each_measurement() -> None:
    text = (ROOT / "docs" / "vram-model.md").read_text()
    for entry in MEASUREMENTS:
        row = next((line for line in text.splitlines() if line.startswith(f"| {entry['id']} |")), None)
        assert row is not None, entry["id"]
        numbers = [int(n.replace(",", "")) for n in re.findall(r"\b\d{1,3}(?:,\d{3})+\b|\b\d{4,}\b", row)]
        assert entry["observed_mib"] in numbers and predicted_mib(entry) in numbers, row
        assert entry["source"] in row
