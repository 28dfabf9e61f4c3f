"""DRA devices in ``kubectl vram nodes`` and in the metrics: memory, consumed capacity, shares."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.dra_objects import (
    allocated,
    claim,
    device_class,
    extended_resource_claim,
    gpu_device,
    resource_slice,
    result,
)
from vramguard.cli import kubectl_vram
from vramguard.cli.kubectl_vram import ClusterSnapshot, build_state, node_rows, report_notes
from vramguard.dra.state import DraState
from vramguard.io.dra import DraMetrics
from vramguard.policy import default_policy
from vramguard.report import gpu_table

GiB = 1 << 30


def dra_objects() -> dict[str, list[dict[str, Any]]]:
    """node-a: an 80Gi GPU in memory mode holding 20Gi + 30Gi; node-b: one in unlimited mode holding
    an extended-resource claim of 0; and a claim on a device no slice publishes."""
    return {
        "resourceslices": [
            resource_slice("node-a", [gpu_device(memory="80Gi", mode="memory")]),
            resource_slice("node-b", [gpu_device(uuid="GPU-B", memory="80Gi", mode="unlimited")]),
        ],
        "deviceclasses": [device_class()],
        "resourceclaims": [
            allocated(claim("a", memory="20Gi"), [result(memory="20Gi", share="s1")], pods=("vllm-a",)),
            allocated(claim("b", memory="30Gi"), [result(memory="30Gi", share="s2")], pods=("vllm-b",)),
            extended_resource_claim("vllm-c", pool="node-b", memory="0", share="s3"),
            allocated(claim("lost"), [result(device="gpu-9")]),
        ],
        "resourceclaimtemplates": [],
    }


def test_nodes_rows_include_dra_devices() -> None:
    state = build_state(ClusterSnapshot(dra=dra_objects()), default_policy())
    rows = [r.to_json() for r in node_rows(state)]
    assert [(r["node"], r["gpu"], r["sharing"], r["reserved_bytes"], r["free_bytes"], r["pods"]) for r in rows] == [
        ("node-a", "gpu-0", "dra-memory", 50 * GiB, 30 * GiB, ["vllm-a", "vllm-b"]),
        ("node-b", "gpu-0", "dra-unlimited", 0, 80 * GiB, ["vllm-c"]),
    ]
    assert rows[0]["budget_bytes"] == 80 * GiB  # the scheduler fills a DRA device to 100%
    table = gpu_table(node_rows(state))
    assert "dra-memory" in table and "vllm-a,vllm-b" in table
    assert any("in no complete pool" in note for note in report_notes(state))


def test_main_prints_dra_devices(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    snap = ClusterSnapshot(dra=dra_objects())
    monkeypatch.setattr(kubectl_vram, "read_cluster", lambda *_args, **_kw: (snap, None))
    assert kubectl_vram.main(["nodes", "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [g["resource"] for g in out["gpus"]] == ["gpu.nvidia.com", "gpu.nvidia.com"]


def test_dra_metrics_aggregate_per_node_and_product() -> None:
    state = DraState()
    objects = dra_objects()
    state.slices.replace(objects["resourceslices"])
    state.claims.replace(objects["resourceclaims"])
    overfull = allocated(claim("big", memory="60Gi"), [result(memory="60Gi", share="s9")])
    state.claims.upsert(overfull)
    registry = CollectorRegistry()
    registry.register(DraMetrics(state))
    labels = {"node": "node-a", "product": "NVIDIA H100 80GB HBM3"}
    assert registry.get_sample_value("vramguard_dra_devices", labels) == 1
    assert registry.get_sample_value("vramguard_dra_memory_bytes", labels) == 80 * GiB
    assert registry.get_sample_value("vramguard_dra_consumed_bytes", labels) == 110 * GiB
    assert registry.get_sample_value("vramguard_dra_shares", labels) == 3
    assert registry.get_sample_value("vramguard_dra_overcommitted_devices", labels) == 1
    other = {"node": "node-b", "product": "NVIDIA H100 80GB HBM3"}
    assert registry.get_sample_value("vramguard_dra_consumed_bytes", other) == 0
    assert registry.get_sample_value("vramguard_dra_shares", other) == 1


def test_partitionable_devices_count_as_one_piece_of_hardware() -> None:
    """Dynamic MIG: a GPU and the MIG devices it can be cut into all consume gpu-0-counter-set."""
    from tests.dra_objects import mig_device  # noqa: PLC0415
    from vramguard.dra import read_allocation, read_resource_slices  # noqa: PLC0415
    from vramguard.dra.claims import device_usage  # noqa: PLC0415
    from vramguard.dra.views import per_node_product  # noqa: PLC0415

    consumes = [{"counterSet": "gpu-0-counter-set", "counters": {"memorySlice0": {"value": "1"}}}]
    full = {**gpu_device(memory="80Gi", mode="disabled"), "consumesCounters": consumes}
    migs = [
        {**mig_device(f"gpu-0-mig-1g10gb-19-{i}", uuid=f"MIG-{i}", memory="10Gi"), "consumesCounters": consumes}
        for i in range(2)
    ]
    counters = {
        **resource_slice(name="counters", count=2, devices=[]),
        "spec": {
            **resource_slice(count=2)["spec"],
            "devices": [],
            "sharedCounters": [{"name": "gpu-0-counter-set", "counters": {"memorySlice0": {"value": "1"}}}],
        },
    }
    inventory = read_resource_slices([resource_slice(devices=[full, *migs], count=2, name="devices"), counters])
    assert [d.counter_sets for d in inventory.devices] == [("gpu-0-counter-set",)] * 3
    allocation = read_allocation(allocated(claim("m"), [result("gpu-0-mig-1g10gb-19-0", memory=None, share=None)]))
    assert allocation is not None
    (total,) = per_node_product(device_usage(inventory, [allocation]).values())
    assert (total.devices, total.memory_bytes, total.consumed_bytes, total.shares) == (1, 80 * GiB, 10 * GiB, 1)
