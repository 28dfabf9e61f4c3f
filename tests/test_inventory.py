"""Inventory: GPU Feature Discovery labels and the agent's report -> the devices of a node."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vramguard.codecs import AGENT_REPORT_ANNOTATION, AgentReport, ReportedGpu
from vramguard.inventory import MAX_NODE_DEVICES, Gpu, human_product, mig_profile_bytes, read_inventory
from vramguard.quantity import MiB

H100 = {
    "nvidia.com/gpu.count": "1",
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    "nvidia.com/gpu.memory": "81559",
    "nvidia.com/gpu.replicas": "1",
    "nvidia.com/gpu.sharing-strategy": "none",
}


def node(
    labels: dict[str, str], allocatable: dict[str, str] | None = None, report: str | None = None
) -> dict[str, Any]:
    """A Node object as the API server returns it (only the fields vramguard reads)."""
    annotations = {AGENT_REPORT_ANNOTATION: report} if report is not None else {}
    obj: dict[str, Any] = {"metadata": {"name": "gpu-1", "labels": labels, "annotations": annotations}}
    if allocatable is not None:
        obj["status"] = {"allocatable": {"cpu": "16", **allocatable}}
    return obj


def summary(devices: tuple[Gpu, ...]) -> list[tuple[str, str, int, str, int, str]]:
    return [(d.id, d.product, d.memory_bytes // MiB, d.sharing, d.replicas, d.resource) for d in devices]


CASES = [
    pytest.param(
        node(H100, {"nvidia.com/gpu": "1"}),
        [("0", "NVIDIA H100 80GB HBM3", 81559, "none", 1, "nvidia.com/gpu")],
        id="whole-h100",
    ),
    pytest.param(
        node(
            {
                **H100,
                "nvidia.com/gpu.count": "2",
                "nvidia.com/gpu.replicas": "4",
                "nvidia.com/gpu.sharing-strategy": "time-slicing",
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-SHARED",
            },
            {"nvidia.com/gpu": "8"},
        ),
        [
            ("0", "NVIDIA H100 80GB HBM3", 81559, "time-slicing", 4, "nvidia.com/gpu"),
            ("1", "NVIDIA H100 80GB HBM3", 81559, "time-slicing", 4, "nvidia.com/gpu"),
        ],
        id="time-sliced-two-gpus",
    ),
    pytest.param(
        node(
            {**H100, "nvidia.com/gpu.replicas": "4", "nvidia.com/gpu.sharing-strategy": "time-slicing"},
            {"nvidia.com/gpu.shared": "4"},
        ),
        [("0", "NVIDIA H100 80GB HBM3", 81559, "time-slicing", 4, "nvidia.com/gpu.shared")],
        id="renamed-shared-resource",
    ),
    pytest.param(
        node({**H100, "nvidia.com/gpu.replicas": "2", "nvidia.com/gpu.sharing-strategy": "mps"}),
        [("0", "NVIDIA H100 80GB HBM3", 81559, "mps", 2, "nvidia.com/gpu")],
        id="mps-without-status",
    ),
    pytest.param(
        node({**H100, "nvidia.com/gpu.replicas": "3", "nvidia.com/gpu.sharing-strategy": ""}),
        [("0", "NVIDIA H100 80GB HBM3", 81559, "time-slicing", 3, "nvidia.com/gpu")],
        id="replicas-without-strategy-label",
    ),
    pytest.param(
        node({**H100, "nvidia.com/gpu.count": "4"}, {"nvidia.com/gpu": "3"}),
        [(str(i), "NVIDIA H100 80GB HBM3", 81559, "none", 1, "nvidia.com/gpu") for i in range(3)],
        id="unhealthy-gpu-left-allocatable",
    ),
    pytest.param(
        node(
            {
                "nvidia.com/mig.strategy": "single",
                "nvidia.com/gpu.count": "2",
                "nvidia.com/gpu.product": "A100-SXM4-40GB-MIG-3g.20gb",
                "nvidia.com/gpu.memory": "20096",
                "nvidia.com/gpu.replicas": "1",
            },
            {"nvidia.com/gpu": "2"},
        ),
        [
            ("3g.20gb#0", "A100 SXM4 40GB", 20096, "mig", 1, "nvidia.com/gpu"),
            ("3g.20gb#1", "A100 SXM4 40GB", 20096, "mig", 1, "nvidia.com/gpu"),
        ],
        id="mig-single",
    ),
    pytest.param(
        node(
            {
                **H100,
                "nvidia.com/gpu.replicas": "0",
                "nvidia.com/mig.strategy": "mixed",
                "nvidia.com/mig-3g.40gb.count": "2",
                "nvidia.com/mig-3g.40gb.memory": "40448",
                "nvidia.com/mig-3g.40gb.product": "NVIDIA-H100-80GB-HBM3-MIG-3g.40gb",
                "nvidia.com/mig-3g.40gb.replicas": "1",
                "nvidia.com/mig-1g.10gb.count": "1",
            },
            {"nvidia.com/gpu": "0", "nvidia.com/mig-3g.40gb": "2", "nvidia.com/mig-1g.10gb": "1"},
        ),
        [
            ("1g.10gb#0", "NVIDIA H100 80GB HBM3", 9728, "mig", 1, "nvidia.com/mig-1g.10gb"),
            ("3g.40gb#0", "NVIDIA H100 80GB HBM3", 40448, "mig", 1, "nvidia.com/mig-3g.40gb"),
            ("3g.40gb#1", "NVIDIA H100 80GB HBM3", 40448, "mig", 1, "nvidia.com/mig-3g.40gb"),
        ],
        id="mig-mixed-memory-from-profile-name",
    ),
    pytest.param(
        node(
            {
                **H100,
                "nvidia.com/gpu.replicas": "0",
                "nvidia.com/mig.strategy": "mixed",
                "nvidia.com/mig-7g.80gb.count": "1",
                "nvidia.com/mig-7g.80gb.memory": "80896",
                "nvidia.com/mig-7g.80gb.replicas": "2",
                "nvidia.com/mig-7g.80gb.sharing-strategy": "time-slicing",
            }
        ),
        [("7g.80gb#0", "NVIDIA H100 80GB HBM3", 80896, "time-slicing", 2, "nvidia.com/mig-7g.80gb")],
        id="time-sliced-mig-instance-is-shared",
    ),
    pytest.param(node({"kubernetes.io/hostname": "cpu-1"}, {"cpu": "4"}), [], id="no-gpu-labels"),
    pytest.param(node(H100, {"cpu": "4"}), [], id="labels-but-plugin-advertises-nothing"),
]


@pytest.mark.parametrize(("obj", "expected"), CASES)
def test_devices_from_labels(obj: dict[str, Any], expected: list[tuple[str, str, int, str, int, str]]) -> None:
    assert summary(read_inventory(obj).devices) == expected


def test_memory_of_an_unlabelled_profile_is_nvmls_size_not_its_name() -> None:
    inventory = read_inventory(node({"nvidia.com/mig.strategy": "mixed", "nvidia.com/mig-1g.18gb.count": "1"}))
    assert inventory.devices[0].memory_bytes == 16 * 2**30  # H200's 1g.18gb: 16.00 GiB, not 18 GB


def test_junk_labels_are_noted_not_raised() -> None:
    inventory = read_inventory(node({**H100, "nvidia.com/gpu.count": "two", "nvidia.com/gpu.memory": "-1"}))
    assert inventory.devices == ()
    assert any("gpu.count='two'" in note for note in inventory.notes)


@pytest.mark.parametrize("obj", [
    node({"nvidia.com/mig.strategy": "mixed", "nvidia.com/mig-1g.10gb.count": "1"}, {"nvidia.com/mig-1g.10gb": "1e30"}),
    node({"nvidia.com/mig.strategy": "mixed", "nvidia.com/mig-1g.10gb.count": str(10**18)}),
    node({**H100, "nvidia.com/gpu.count": str(10**18)}),
], ids=["allocatable-1e30", "mig-count-label", "gpu-count-label"])
def test_a_node_claiming_absurd_device_counts_is_cut_with_a_note(obj: dict[str, Any]) -> None:
    # Whoever writes the node's labels or status (its kubelet) could otherwise make every reader
    # build 10^30 devices.
    inventory = read_inventory(obj)
    assert len(inventory.devices) == MAX_NODE_DEVICES
    assert any("more than any node has" in note for note in inventory.notes)


def test_missing_memory_label_leaves_size_unknown() -> None:
    labels = {k: v for k, v in H100.items() if k != "nvidia.com/gpu.memory"}
    inventory = read_inventory(node(labels))
    assert inventory.devices[0].memory_bytes == 0
    assert any("nvidia.com/gpu.memory is missing" in note for note in inventory.notes)


def test_label_names_the_device() -> None:
    inventory = read_inventory(node(H100))
    assert inventory.devices[0].label == "GPU 0 (NVIDIA H100 80GB HBM3)"
    assert inventory.resources() == ("nvidia.com/gpu",)
    assert inventory.devices_for("nvidia.com/mig-1g.10gb") == ()


@pytest.mark.parametrize(
    ("label", "human"),
    [
        ("NVIDIA-H100-80GB-HBM3", "NVIDIA H100 80GB HBM3"),
        ("NVIDIA-H100-80GB-HBM3-SHARED", "NVIDIA H100 80GB HBM3"),
        ("NVIDIA-A100-80GB-PCIe-MIG-1g.10gb", "NVIDIA A100 80GB PCIe"),
        ("Tesla-T4", "Tesla T4"),
        ("", "unknown GPU"),
    ],
)
def test_human_product(label: str, human: str) -> None:
    assert human_product(label) == human


@pytest.mark.parametrize(
    ("profile", "size"),
    [
        # NVML's sizes (nvidia-smi -lgip): A100 80GB 3g.40gb 39.25 GiB, H200 1g.18gb 16.00 GiB (under
        # its name's 18 GB), H100 1g.10gb+me as its profile (the A100 80GB's 9.50 GiB is smaller).
        ("3g.40gb", 40192 * 2**20),
        ("1g.18gb", 16 * 2**30),
        ("1g.10gb+me", 9728 * 2**20),
        ("1g.10gb.me", 9728 * 2**20),
        ("7g.141gb", int(139.75 * 2**30)),
        # Unlisted: nine tenths of the name's decimal gigabytes.
        ("7g.180gb", 162 * 10**9),
        ("weird", None),
    ],
)
def test_mig_profile_bytes(profile: str, size: int | None) -> None:
    assert mig_profile_bytes(profile) == size


TWO_GPUS = {
    **H100,
    "nvidia.com/gpu.count": "2",
    "nvidia.com/gpu.replicas": "4",
    "nvidia.com/gpu.sharing-strategy": "time-slicing",
}


def test_agent_report_overrides_memory_and_places_pods() -> None:
    report = {
        "version": 1,
        "gpus": [{"id": "1", "memory_bytes": 80 * 1024 * MiB, "foreign_bytes": 512 * MiB}],
        "pods": {"uid-a": {"vllm": ["1"]}},
    }
    inventory = read_inventory(node(TWO_GPUS, report=json.dumps(report)))
    assert [d.memory_bytes // MiB for d in inventory.devices] == [81559, 80 * 1024]
    assert inventory.devices[1].foreign_bytes == 512 * MiB
    assert inventory.placements == {"uid-a": {"vllm": ("1",)}}
    assert inventory.notes == ()


def test_the_agent_state_says_whether_the_report_is_used() -> None:
    report = json.dumps({"version": 1, "pods": {"uid-a": {"c": ["0"]}}})
    assert read_inventory(node(TWO_GPUS, report=report)).agent == "fresh"
    assert read_inventory(node(TWO_GPUS, report=report), distrust="the agent's Lease expired").agent == "stale"
    assert read_inventory(node(TWO_GPUS)).agent == "none"


def test_explicit_report_wins_over_annotation() -> None:
    annotated = json.dumps({"version": 1, "pods": {"uid-a": {"c": ["0"]}}})
    report = AgentReport(gpus=(ReportedGpu(id="0", foreign_bytes=7),), placements={"uid-b": {"c": ("1",)}})
    inventory = read_inventory(node(TWO_GPUS, report=annotated), report)
    assert inventory.placements == {"uid-b": {"c": ("1",)}}
    assert inventory.devices[0].foreign_bytes == 7


JUNK_REPORTS = [
    pytest.param("not json", "not JSON", id="not-json"),
    pytest.param("[1, 2]", "not a JSON object", id="not-an-object"),
    pytest.param('{"version": 2}', "version 2 is not 1", id="future-version"),
    pytest.param('{"version": true}', "version True is not 1", id="boolean-version"),
    pytest.param('{"gpus": []}', "version None", id="no-version"),
]


@pytest.mark.parametrize(("text", "reason"), JUNK_REPORTS)
def test_unusable_report_is_ignored_with_a_reason(text: str, reason: str) -> None:
    report, problems = AgentReport.decode(text)
    assert report is None
    assert any(reason in p for p in problems)
    inventory = read_inventory(node(TWO_GPUS, report=text))
    assert len(inventory.devices) == 2
    assert any(reason in note for note in inventory.notes)


PARTLY_JUNK = [
    pytest.param({"gpus": "all"}, "'gpus' is not a list", id="gpus-not-list"),
    pytest.param({"gpus": [{"memory_bytes": 1}]}, "gpus[0] has no string 'id'", id="gpu-without-id"),
    pytest.param({"gpus": [{"id": "0", "memory_bytes": -5}]}, "memory_bytes=-5", id="negative-memory"),
    pytest.param({"gpus": [{"id": "0", "foreign_bytes": "1Gi"}]}, "foreign_bytes='1Gi'", id="foreign-as-text"),
    pytest.param({"gpus": [{"id": "9"}]}, "device '9' is not among", id="unknown-device"),
    pytest.param({"pods": []}, "'pods' is not an object", id="pods-not-object"),
    pytest.param({"pods": {"u": ["0"]}}, "pod u: not an object", id="pod-not-object"),
    pytest.param({"pods": {"u": {"c": "0"}}}, "container c: not a list", id="ids-not-list"),
    pytest.param({"pods": {"u": {"c": ["0", "7"]}}}, "names unknown devices", id="unknown-device-in-pod"),
]


@pytest.mark.parametrize(("body", "reason"), PARTLY_JUNK)
def test_junk_inside_a_report_is_skipped(body: dict[str, Any], reason: str) -> None:
    text = json.dumps({"version": 1, **body})
    inventory = read_inventory(node(TWO_GPUS, report=text))
    assert [d.memory_bytes // MiB for d in inventory.devices] == [81559, 81559]
    assert any(reason in note for note in inventory.notes), inventory.notes


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=12,
)


@given(st.dictionaries(st.sampled_from(["version", "gpus", "pods", "x"]), JSON, max_size=4), st.booleans())
def test_no_report_makes_inventory_raise(body: dict[str, Any], versioned: bool) -> None:
    if versioned:
        body["version"] = 1
    inventory = read_inventory(node(TWO_GPUS, report=json.dumps(body)))
    assert len(inventory.devices) == 2


@given(st.dictionaries(st.text(max_size=30), st.text(max_size=8), max_size=8), JSON)
def test_no_node_makes_inventory_raise(labels: dict[str, str], status: Any) -> None:
    read_inventory({"metadata": {"name": "n", "labels": {**labels, **H100}}, "status": status})
    read_inventory({"metadata": {"labels": labels}, "status": {"allocatable": status}})


# The AMD node labeller's labels as published (ROCm/k8s-device-plugin v1.31.0.10 docs/user-guide/
# installation.md: an MI300X in SPX mode; PR #108: the same GPUs in CPX mode, 24G a partition).
MI300X = {
    "amd.com/gpu.cu-count": "304", "amd.com/gpu.device-id": "74a1", "amd.com/gpu.family": "AI",
    "amd.com/gpu.product-name": "AMD_Instinct_MI300X_OAM", "amd.com/gpu.simd-count": "1216", "amd.com/gpu.vram": "192G",
}
MI300X_CPX = {**MI300X, "amd.com/gpu.vram": "24G", "amd.com/gpu.cu-count": "38",
              "amd.com/gpu.compute-memory-partition": "cpx_nps4"}


def test_amd_gpus_and_partitions_are_devices_of_their_own() -> None:
    whole = read_inventory(node(MI300X, {"amd.com/gpu": "8"}))
    assert summary(whole.devices) == [
        (f"amd.com/gpu#{i}", "AMD Instinct MI300X OAM", 192 * 1024, "none", 1, "amd.com/gpu") for i in range(8)
    ]
    # The node says plainly that these devices' use is not measured (the agent reads NVML only).
    assert whole.notes == ("amd.com/gpu: each device is counted from the pods' declarations alone: the node agent "
                           "reads NVIDIA's NVML only, so what runs on these devices is not measured",)
    partitions = read_inventory(node(MI300X_CPX, {"amd.com/cpx_nps4": "64"}))
    assert len(partitions.devices) == 64
    assert summary(partitions.devices)[0] == (
        "amd.com/cpx_nps4#0", "AMD Instinct MI300X OAM cpx_nps4 partition", 24 * 1024, "none", 1, "amd.com/cpx_nps4"
    )
    # Devices of several sizes: the labeller writes no plain vram label; the memory is unknown, said.
    mixed = {k: v for k, v in MI300X.items() if k != "amd.com/gpu.vram"} | {"amd.com/gpu.vram.192G": "5"}
    unknown = read_inventory(node(mixed, {"amd.com/gpu": "5", "amd.com/cpx_nps1": "24"}))
    assert {d.memory_bytes for d in unknown.devices} == {0} and len(unknown.devices) == 29
    assert any("amd.com/gpu.vram" in n for n in unknown.notes)
    # Junk sizes and counts are bounded and noted, never raised.
    junk = read_inventory(node({**MI300X, "amd.com/gpu.vram": "9e99G"}, {"amd.com/gpu": "1e30"}))
    assert len(junk.devices) == MAX_NODE_DEVICES and {d.memory_bytes for d in junk.devices} == {0}


def test_a_policy_without_amd_reads_no_amd_device() -> None:
    inventory = read_inventory(node(MI300X, {"amd.com/gpu": "8"}), gpu_resources=("nvidia.com/gpu",),
                               mig_prefixes=("nvidia.com/mig-",))
    assert inventory.devices == ()


def test_an_nvidia_node_is_read_as_before_beside_the_vendor_table() -> None:
    assert summary(read_inventory(node(H100, {"nvidia.com/gpu": "1"})).devices) == [
        ("0", "NVIDIA H100 80GB HBM3", 81559, "none", 1, "nvidia.com/gpu")
    ]
