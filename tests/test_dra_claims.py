"""Claims and templates: requests, effective consumption, allocations and per-device usage."""

from __future__ import annotations

from typing import Any

import pytest

from tests.dra_objects import (
    allocated,
    claim,
    claim_template,
    extended_resource_claim,
    gpu_device,
    resource_slice,
    result,
)
from vramguard.dra import (
    ClaimAllocation,
    DeviceRequest,
    device_usage,
    read_allocation,
    read_claim,
    read_claim_template,
    read_resource_slices,
)
from vramguard.quantity import GiB, MiB

H100 = 81559 * MiB


def test_demo_template() -> None:
    spec = read_claim_template(claim_template(memory="4Gi"))
    assert (spec.namespace, spec.name, spec.notes) == ("gpu-share-memory", "gpu-4gi", ())
    (request,) = spec.requests
    assert request.name == "gpu"
    assert request.alternatives == (DeviceRequest("gpu", "gpu.nvidia.com", memory=4 * GiB),)
    assert spec.request("gpu") is request
    assert spec.request("gpu/sub") is request
    assert spec.request("other") is None


def test_first_available_and_modes() -> None:
    obj = {
        "metadata": {"name": "c", "namespace": "n"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "firstAvailable": [
                            {
                                "name": "big",
                                "deviceClassName": "gpu.nvidia.com",
                                "capacity": {"requests": {"memory": "40Gi"}},
                            },
                            {"name": "mig", "deviceClassName": "mig.nvidia.com", "allocationMode": "All"},
                        ],
                    },
                    {
                        "name": "admin",
                        "exactly": {"deviceClassName": "gpu.nvidia.com", "adminAccess": True, "count": 2},
                    },
                ]
            }
        },
    }
    spec = read_claim(obj)
    gpu, admin = spec.requests
    assert [a.name for a in gpu.alternatives] == ["gpu/big", "gpu/mig"]
    assert gpu.alternatives[0].memory == 40 * GiB
    assert gpu.alternatives[1].all_devices
    assert admin.alternatives[0].admin_access and admin.alternatives[0].count == 2


@pytest.mark.parametrize(
    ("requests", "count", "note"),
    [
        pytest.param([{"exactly": {"deviceClassName": "c"}}], 0, "without a name", id="unnamed"),
        pytest.param([{"name": "r", "exactly": {}}], 0, "no deviceClassName", id="no-class"),
        pytest.param([{"name": "r"}], 0, "neither exactly nor firstAvailable", id="empty-request"),
        pytest.param(
            [{"name": "r", "exactly": {"deviceClassName": "c", "count": "2"}}],
            1,
            "not a positive integer",
            id="count-string",
        ),
        pytest.param(
            [{"name": "r", "exactly": {"deviceClassName": "c", "count": -1}}],
            1,
            "not a positive integer",
            id="count-negative",
        ),
        pytest.param(
            [{"name": "r", "exactly": {"deviceClassName": "c", "capacity": {"requests": {"memory": "8 GB"}}}}],
            1,
            "capacity.requests.memory",
            id="bad-memory",
        ),
        pytest.param(
            [{"name": f"r{i}", "exactly": {"deviceClassName": "c"}} for i in range(40)],
            32,
            "only the first 32",
            id="too-many",
        ),
    ],
)
def test_junk_requests(requests: list[Any], count: int, note: str) -> None:
    spec = read_claim({"metadata": {"name": "c"}, "spec": {"devices": {"requests": requests}}})
    assert len(spec.requests) == count
    assert any(note in n for n in spec.notes), spec.notes


@pytest.mark.parametrize(
    "obj",
    [None, 1, {"spec": 5}, {"spec": {"devices": {"requests": "x"}}}],
    ids=["none", "int", "spec-int", "requests-str"],
)
def test_junk_claims_never_raise(obj: Any) -> None:
    assert read_claim(obj).requests == ()
    assert read_claim_template(obj).requests == ()
    assert read_allocation(obj) is None


def test_qualified_memory_request() -> None:
    spec = read_claim(
        {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "r",
                            "exactly": {
                                "deviceClassName": "c",
                                "capacity": {"requests": {"gpu.nvidia.com/memory": "2Gi"}},
                            },
                        }
                    ]
                }
            }
        }
    )
    assert spec.requests[0].alternatives[0].memory == 2 * GiB


@pytest.mark.parametrize(
    ("mode", "memory", "consumed"),
    [
        pytest.param("memory", None, H100, id="memory-mode-no-request-whole"),
        pytest.param("memory", 8 * GiB, 8 * GiB, id="memory-mode-request"),
        pytest.param("unlimited", None, 0, id="unlimited-no-request-zero"),
        pytest.param(4, None, 0, id="shares-no-request-zero"),
        pytest.param("disabled", 8 * GiB, H100, id="exclusive-whole"),
        pytest.param("memory", 100 * GiB, None, id="too-large"),
    ],
)
def test_request_consumption(mode: str | int, memory: int | None, consumed: int | None) -> None:
    (device,) = read_resource_slices([resource_slice(devices=[gpu_device(mode=mode)])]).devices
    assert DeviceRequest("gpu", "gpu.nvidia.com", memory=memory).consumes_on(device) == consumed
    assert DeviceRequest("gpu", "gpu.nvidia.com", memory=memory, admin_access=True).consumes_on(device) == 0


def test_read_allocation() -> None:
    obj = allocated(claim(memory="20Gi"), [result()])
    allocation = read_allocation(obj)
    assert allocation is not None
    assert (allocation.namespace, allocation.name, allocation.uid) == ("default", "shared-gpu", "uid-shared-gpu")
    (entry,) = allocation.results
    assert entry.key == ("gpu.nvidia.com", "node-a", "gpu-0")
    assert entry.consumed_memory == 20 * GiB
    assert entry.share_id == "6f1c0000-0000-4000-8000-000000000001"
    assert allocation.reserved_for == (("vllm-0", "uid-vllm-0"),)
    assert not allocation.extended_resource
    assert read_allocation(claim()) is None


def test_extended_resource_claim_shape() -> None:
    allocation = read_allocation(extended_resource_claim(memory="0"))
    assert allocation is not None and allocation.extended_resource
    assert allocation.results[0].consumed_memory == 0
    assert allocation.results[0].request == "container-0-request-0"
    spec = read_claim(extended_resource_claim())
    assert spec.requests[0].alternatives[0].memory is None


def _usage(mode: str | int, claims: list[dict[str, Any]]) -> tuple[int, int, list[str]]:
    inventory = read_resource_slices([resource_slice(devices=[gpu_device(mode=mode)])])
    notes: list[str] = []
    allocations = [a for a in (read_allocation(c) for c in claims) if a is not None]
    usage = device_usage(inventory, allocations, notes)
    (entry,) = usage.values()
    return entry.consumed_bytes, len(entry.shares), notes


S1, S2 = "6f1c0000-0000-4000-8000-000000000001", "6f1c0000-0000-4000-8000-000000000002"


@pytest.mark.parametrize(
    ("mode", "claims", "consumed", "shares", "note"),
    [
        pytest.param("memory", [], 0, 0, None, id="idle"),
        pytest.param(
            "memory",
            [allocated(claim("a"), [result(share=S1)]), allocated(claim("b"), [result(share=S2, memory="30Gi")])],
            50 * GiB,
            2,
            None,
            id="two-shares-add-up",
        ),
        pytest.param(
            "memory",
            [allocated(claim("a"), [result(share=S1)]), allocated(claim("a"), [result(share=S1)])],
            20 * GiB,
            1,
            None,
            id="same-share-counted-once",
        ),
        pytest.param(
            "unlimited", [extended_resource_claim(memory="0", share=S1)], 0, 1, None, id="unlimited-extended-zero"
        ),
        pytest.param(
            "disabled", [allocated(claim("a"), [result(share=None, memory=None)])], H100, 1, None, id="exclusive-whole"
        ),
        pytest.param(
            "memory",
            [allocated(claim("a"), [result(share=S1, memory=None)])],
            H100,
            1,
            "without consumedCapacity",
            id="missing-consumed-whole",
        ),
        pytest.param(
            "memory",
            [allocated(claim("a"), [result(device="gpu-9")])],
            0,
            0,
            "in no complete pool",
            id="unknown-device",
        ),
        pytest.param(
            "memory",
            [allocated(claim("a"), [{**result(), "adminAccess": True}])],
            0,
            1,
            None,
            id="admin-access-consumes-nothing",
        ),
    ],
)
def test_device_usage(
    mode: str | int, claims: list[dict[str, Any]], consumed: int, shares: int, note: str | None
) -> None:
    got_consumed, got_shares, notes = _usage(mode, claims)
    assert (got_consumed, got_shares) == (consumed, shares)
    if note is None:
        assert notes == []
    else:
        assert any(note in n for n in notes), notes


def test_junk_allocation_results() -> None:
    obj = allocated(claim(), [None, {"driver": "gpu.nvidia.com"}, {**result(), "consumedCapacity": {"memory": "x"}}])
    obj["status"]["reservedFor"] = [{"resource": "pods", "name": 5}, "x", {"resource": "other", "name": "y"}]
    allocation = read_allocation(obj)
    assert isinstance(allocation, ClaimAllocation)
    assert len(allocation.results) == 1
    assert allocation.results[0].consumed_memory is None
    assert allocation.reserved_for == (("", ""),)
    assert any("without driver" in n for n in allocation.notes)
    assert any("consumedCapacity.memory" in n for n in allocation.notes)


def test_free_bytes() -> None:
    inventory = read_resource_slices([resource_slice(devices=[gpu_device(mode="memory")])])
    allocation = read_allocation(allocated(claim(), [result(memory="81559Mi")]))
    assert allocation is not None
    (usage,) = device_usage(inventory, [allocation]).values()
    assert usage.free_bytes == 0
