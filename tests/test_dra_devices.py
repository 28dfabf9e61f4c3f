"""ResourceSlices -> DRA GPU devices: modes, pools, nodes, MIG, rounding, junk."""

from __future__ import annotations

from typing import Any

import pytest

from tests.dra_objects import gpu_device, mig_device, resource_slice
from vramguard.dra import DraDevice, RequestPolicy, read_resource_slices
from vramguard.quantity import GiB, MiB

H100 = 81559 * MiB


@pytest.mark.parametrize(
    ("mode", "sharing", "shareable", "shares", "default_consumption"),
    [
        pytest.param("disabled", "exclusive", False, None, H100, id="not-shareable-takes-whole"),
        pytest.param("memory", "memory", True, None, H100, id="memory-mode-default-is-whole"),
        pytest.param("unlimited", "unlimited", True, None, 0, id="unlimited-default-is-zero"),
        pytest.param(4, "shares", True, 4, 0, id="share-count-default-is-zero"),
    ],
)
def test_nvidia_modes(
    mode: str | int, sharing: str, shareable: bool, shares: int | None, default_consumption: int
) -> None:
    inventory = read_resource_slices([resource_slice(devices=[gpu_device(mode=mode)])])
    assert inventory.notes == ()
    (device,) = inventory.devices
    assert (device.sharing, device.shareable, device.shares) == (sharing, shareable, shares)
    assert device.memory_bytes == H100
    assert device.uuid == "GPU-00000000-0000-0000-0000-000000000000"
    assert (device.node, device.pool, device.name, device.type) == ("node-a", "node-a", "gpu-0", "gpu")
    assert device.product == "NVIDIA H100 80GB HBM3"
    assert device.consumes(None) == default_consumption


@pytest.mark.parametrize(
    ("mode", "requested", "consumed"),
    [
        pytest.param("memory", 8 * GiB, 8 * GiB, id="exact-step"),
        pytest.param("memory", 8 * GiB + 1, 8 * GiB + MiB, id="rounded-up-to-1Mi-step"),
        pytest.param("memory", 1, MiB, id="below-min-rounded-to-min"),
        pytest.param("memory", H100 + 1, None, id="above-device-cannot-serve"),
        pytest.param("unlimited", 0, 0, id="unlimited-zero-request"),
        pytest.param("unlimited", 20 * GiB, 20 * GiB, id="unlimited-explicit-request"),
        pytest.param("disabled", 4 * GiB, H100, id="exclusive-request-takes-whole"),
    ],
)
def test_consumption_rounding(mode: str, requested: int, consumed: int | None) -> None:
    (device,) = read_resource_slices([resource_slice(devices=[gpu_device(mode=mode)])]).devices
    assert device.consumes(requested) == consumed


@pytest.mark.parametrize(
    ("policy", "amount", "expected"),
    [
        pytest.param(RequestPolicy(valid_values=(4 * GiB, 8 * GiB)), 5 * GiB, 8 * GiB, id="valid-values-next"),
        pytest.param(RequestPolicy(valid_values=(4 * GiB, 8 * GiB)), 4 * GiB, 4 * GiB, id="valid-values-exact"),
        pytest.param(RequestPolicy(valid_values=(4 * GiB, 8 * GiB)), 9 * GiB, None, id="valid-values-above"),
        pytest.param(RequestPolicy(minimum=GiB, step=GiB), 1, GiB, id="range-below-min"),
        pytest.param(RequestPolicy(minimum=GiB, step=2 * GiB), 2 * GiB, 3 * GiB, id="range-step-from-min"),
        pytest.param(RequestPolicy(minimum=GiB, maximum=4 * GiB), 5 * GiB, None, id="range-above-max"),
        pytest.param(RequestPolicy(minimum=GiB), 5 * GiB + 3, 5 * GiB + 3, id="range-without-step"),
        pytest.param(RequestPolicy(), 7, 7, id="no-rounding"),
    ],
)
def test_request_policy_rounding(policy: RequestPolicy, amount: int, expected: int | None) -> None:
    assert policy.round_up(amount) == expected


def test_valid_values_policy_read_from_slice() -> None:
    device = gpu_device(mode="memory")
    device["capacity"]["memory"]["requestPolicy"] = {"default": "8Gi", "validValues": ["16Gi", "8Gi", "bogus"]}
    inventory = read_resource_slices([resource_slice(devices=[device])])
    (read,) = inventory.devices
    assert read.policy == RequestPolicy(default=8 * GiB, valid_values=(8 * GiB, 16 * GiB))
    assert read.sharing == "partial"
    assert read.consumes(None) == 8 * GiB
    assert read.consumes(9 * GiB) == 16 * GiB
    assert any("bogus" in note for note in inventory.notes)


def test_mig_device() -> None:
    (device,) = read_resource_slices([resource_slice(devices=[mig_device()])]).devices
    assert device.type == "mig"
    assert device.parent_uuid == "GPU-00000000-0000-0000-0000-000000000000"
    assert device.profile == "1g.10gb"
    assert device.memory_bytes == 9728 * MiB
    assert device.sharing == "exclusive"
    assert device.uuid == "MIG-11111111-1111-1111-1111-111111111111"


def _names(inventory: Any) -> list[str]:
    return [d.uuid for d in inventory.devices]


A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"


@pytest.mark.parametrize(
    ("slices", "uuids", "note"),
    [
        pytest.param(
            [resource_slice(devices=[gpu_device(uuid=A)], count=2)],
            [],
            "1 of 2 ResourceSlices seen",
            id="incomplete-pool",
        ),
        pytest.param(
            [
                resource_slice(devices=[gpu_device(uuid=A)], count=2, name="s1"),
                resource_slice(devices=[gpu_device("gpu-1", uuid=B)], count=2, name="s2"),
            ],
            [A, B],
            None,
            id="complete-two-slice-pool",
        ),
        pytest.param(
            [
                resource_slice(devices=[gpu_device(uuid=A)], count=2, name="s1"),
                resource_slice(devices=[gpu_device(uuid=A)], count=2, name="s1"),
            ],
            [],
            "1 of 2",
            id="same-slice-twice-is-not-complete",
        ),
        pytest.param(
            [
                resource_slice(devices=[gpu_device(uuid=A)], generation=1),
                resource_slice(devices=[gpu_device(uuid=B)], generation=2),
            ],
            [B],
            None,
            id="highest-generation-wins",
        ),
        pytest.param(
            [
                resource_slice(devices=[gpu_device(uuid=A)], generation=1),
                resource_slice(devices=[gpu_device(uuid=B)], generation=2, count=2),
            ],
            [],
            "generation 2: 1 of 2",
            id="newest-generation-incomplete-hides-older",
        ),
        pytest.param([resource_slice(driver="other.example.com")], [], None, id="other-driver-ignored"),
        pytest.param(
            [
                resource_slice(devices=[gpu_device(uuid=A)], count=2, name="s1"),
                resource_slice(devices=[gpu_device("gpu-1", uuid=A)], count=2, name="s2"),
            ],
            [A],
            "appears twice",
            id="uuid-keys-devices",
        ),
    ],
)
def test_pools(slices: list[dict[str, Any]], uuids: list[str], note: str | None) -> None:
    inventory = read_resource_slices(slices)
    assert _names(inventory) == uuids
    if note is None:
        assert inventory.notes == ()
    else:
        assert any(note in n for n in inventory.notes), inventory.notes


def _without_node(**spec: Any) -> dict[str, Any]:
    obj = resource_slice()
    del obj["spec"]["nodeName"]
    obj["spec"].update(spec)
    return obj


@pytest.mark.parametrize(
    ("obj", "nodes", "note"),
    [
        pytest.param(_without_node(allNodes=True), [], "not bound to one node", id="all-nodes-ignored"),
        pytest.param(
            _without_node(nodeSelector={"nodeSelectorTerms": []}),
            [],
            "not bound to one node",
            id="node-selector-ignored",
        ),
        pytest.param(
            _without_node(
                perDeviceNodeSelection=True,
                devices=[{**gpu_device(), "nodeName": "node-b"}, {**gpu_device("gpu-1", uuid=B), "allNodes": True}],
            ),
            ["node-b"],
            "device gpu-1: not bound to one node",
            id="per-device-node-name",
        ),
    ],
)
def test_nodes(obj: dict[str, Any], nodes: list[str], note: str) -> None:
    inventory = read_resource_slices([obj])
    assert [d.node for d in inventory.devices] == nodes
    assert any(note in n for n in inventory.notes), inventory.notes


def test_qualified_attribute_names_and_missing_uuid() -> None:
    device = {
        "name": "gpu-3",
        "attributes": {"gpu.nvidia.com/type": {"string": "gpu"}, "gpu.nvidia.com/productName": {"string": "NVIDIA L4"}},
        "capacity": {"gpu.nvidia.com/memory": {"value": "23034Mi"}},
    }
    (read,) = read_resource_slices([resource_slice(devices=[device])]).devices
    assert read.uuid == "gpu.nvidia.com/node-a/gpu-3"
    assert read.product == "NVIDIA L4"
    assert read.memory_bytes == 23034 * MiB


def test_other_device_types_skipped() -> None:
    vfio = {"name": "gpu-vfio-0", "attributes": {"type": {"string": "vfio"}}, "capacity": {}}
    inventory = read_resource_slices([resource_slice(devices=[vfio, gpu_device()])])
    assert [d.name for d in inventory.devices] == ["gpu-0"]


JUNK: list[Any] = [
    None,
    "slice",
    42,
    {"spec": None},
    {"spec": {"driver": "gpu.nvidia.com", "pool": "x"}},
    {
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": "n",
            "pool": {"name": "n", "generation": "1", "resourceSliceCount": 1},
        }
    },
    {
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": "n",
            "pool": {"name": "n", "generation": 1, "resourceSliceCount": 0},
        }
    },
    {
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": "n",
            "pool": {"name": "n", "generation": True, "resourceSliceCount": 1},
        }
    },
    {"spec": {"driver": ["gpu.nvidia.com"], "nodeName": "n"}},
]


@pytest.mark.parametrize("obj", JUNK, ids=[f"junk-{i}" for i in range(len(JUNK))])
def test_junk_slices_never_raise(obj: Any) -> None:
    assert read_resource_slices([obj]).devices == ()


@pytest.mark.parametrize(
    ("device", "memory", "note"),
    [
        pytest.param(
            {**gpu_device(), "capacity": {"memory": {"value": "lots"}}},
            0,
            "not a non-negative quantity",
            id="bad-memory",
        ),
        pytest.param(
            {**gpu_device(), "capacity": {"memory": {"value": "-1Gi"}}}, 0, "not a non-negative", id="negative-memory"
        ),
        pytest.param(
            {**gpu_device(), "capacity": {"memory": {"value": ["1Gi"]}}}, 0, "not a quantity", id="list-memory"
        ),
        pytest.param({**gpu_device(), "capacity": "80Gi"}, 0, "no memory capacity", id="capacity-not-a-map"),
        pytest.param(
            {**gpu_device(), "capacity": {"memory": {"value": "1" * 100}}}, 0, "at most 8Ei", id="huge-number"
        ),
    ],
)
def test_junk_memory(device: dict[str, Any], memory: int, note: str) -> None:
    inventory = read_resource_slices([resource_slice(devices=[device])])
    (read,) = inventory.devices
    assert read.memory_bytes == memory
    assert any(note in n for n in inventory.notes), inventory.notes


def test_unnamed_device_and_too_many_devices() -> None:
    many = [gpu_device(f"gpu-{i}", uuid=f"GPU-{i}") for i in range(130)]
    inventory = read_resource_slices([resource_slice(devices=[{"attributes": {}}, *many])])
    assert len(inventory.devices) == 127  # the first 128 entries, one of them unnamed
    assert any("device without a name" in n for n in inventory.notes)
    assert any("only the first 128" in n for n in inventory.notes)


def test_inventory_views() -> None:
    inventory = read_resource_slices(
        [resource_slice("node-a", [gpu_device(uuid=A)]), resource_slice("node-b", [gpu_device(uuid=B)])]
    )
    assert inventory.nodes() == ("node-a", "node-b")
    assert [d.uuid for d in inventory.on_node("node-b")] == [B]
    assert isinstance(inventory.by_key()[("gpu.nvidia.com", "node-a", "gpu-0")], DraDevice)
    assert inventory.by_key()[("gpu.nvidia.com", "node-a", "gpu-0")].label == "gpu-0 (NVIDIA H100 80GB HBM3)"
