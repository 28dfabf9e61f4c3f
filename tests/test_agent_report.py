"""The agent's report: device ids, placements, foreign bytes, and its round trip into the ledger."""

from __future__ import annotations

import json
from fractions import Fraction
from typing import Any

import pytest

from agent.nvml import MemoryInfo
from agent.podresources import ContainerDevices, PodDevices
from agent.processes import ProcessOwner
from agent.report import AgentView, OverUse, PodInfo, build_view, devices_of, usable_bytes
from tests.agent_support import (
    H100_TIME_SLICED,
    H100_USABLE,
    H100_UUIDS,
    H200_MIG_LOST,
    MiB,
    pod_object,
    recording,
    snapshot_of,
)
from vramguard.codecs import AGENT_REPORT_ANNOTATION, AgentReport
from vramguard.demand.model import Vram
from vramguard.inventory import Sharing, read_inventory
from vramguard.ledger import Claim, Ledger, PodRef

GPU = "nvidia.com/gpu"
UIDS = {
    "vllm-a": "0b6e9a55-1111-4c3d-8e2f-000000000001",
    "vllm-b": "0b6e9a55-2222-4c3d-8e2f-000000000002",
    "trainer": "0b6e9a55-3333-4c3d-8e2f-000000000003",
}
CIDS = {"vllm-a": "a" * 64, "vllm-b": "b" * 64, "trainer": "c" * 64}
# Host PIDs in the H100 recording: two vLLM servers on GPU 0; a trainer and a stray process on GPU 1.
PIDS = {48213: "vllm-a", 48377: "vllm-b", 51002: "trainer"}


def kubelet(*pods: tuple[str, dict[str, list[str]]]) -> list[PodDevices]:
    """PodResources answer: ``(pod name, {container: device ids})`` in namespace ``ml``."""
    return [
        PodDevices("ml", name, tuple(ContainerDevices(c, ((GPU, tuple(ids)),)) for c, ids in containers.items()))
        for name, containers in pods
    ]


SERVER_IMAGE = "registry.example/ml/server:1.0"
"""An image that starts no engine vramguard knows: the declaration is all the ledger holds."""


def node_pods(vram: str = "0.3", image: str = SERVER_IMAGE) -> dict[tuple[str, str], PodInfo]:
    pods = {}
    for name, uid in UIDS.items():
        obj = pod_object("ml", name, uid, {"server": {GPU: "1"}}, annotations={"vramguard.io/vram": vram},
                         container_ids={"server": CIDS[name]}, image=image)
        info = PodInfo.from_pod(obj)
        assert info is not None
        pods[("ml", name)] = info
    return pods


H100_KUBELET = kubelet(
    ("vllm-a", {"server": [f"{H100_UUIDS[0]}::0"]}),
    ("vllm-b", {"server": [f"{H100_UUIDS[0]}::1"]}),
    ("trainer", {"server": [f"{H100_UUIDS[1]}::0"]}),
)
ALL_OWNERS = {pid: ProcessOwner(UIDS[name], CIDS[name]) for pid, name in PIDS.items()} | {31337: None}


def h100_view(**overrides: Any) -> AgentView:
    arguments: dict[str, Any] = {
        "snapshot": snapshot_of(H100_TIME_SLICED), "pod_devices": H100_KUBELET, "pods": node_pods(),
        "owners": ALL_OWNERS,
    }
    arguments.update(overrides)
    return build_view(**arguments)


def test_report_names_devices_and_placements_as_the_inventory_does() -> None:
    view = h100_view()
    data = json.loads(view.report.encode())
    assert data == {
        "version": 1,
        "gpus": [
            # What CUDA reports, the fractions' base: NVML's total less the driver's reserve.
            {"id": "0", "memory_bytes": H100_USABLE, "foreign_bytes": 0},
            {"id": "1", "memory_bytes": H100_USABLE, "foreign_bytes": 2048 * MiB},
        ],
        "pods": {
            UIDS["vllm-a"]: {"server": ["0"]},
            UIDS["vllm-b"]: {"server": ["0"]},
            UIDS["trainer"]: {"server": ["1"]},
        },
        # The trainer declares 0.3 of GPU 1 and uses 40 GiB there: over-use, reported (rounded up to
        # 64 MiB) for the ledger to count. The vLLM pods use their 0.3 within the tolerance: left out.
        "used": {UIDS["trainer"]: {"1": 41024 * MiB}},
    }
    parsed, problems = AgentReport.decode(view.report.encode())
    assert problems == [] and parsed == view.report
    assert view.overuse == (
        OverUse(UIDS["trainer"], "ml", "trainer", "1", int(Fraction(3, 10) * H100_USABLE), 40962 * MiB),
    )


def test_report_text_is_compact_and_stable() -> None:
    first, second = h100_view().report.encode(), h100_view().report.encode()
    assert first == second and " " not in first and "\n" not in first


@pytest.mark.parametrize(
    ("overrides", "foreign"),
    [
        pytest.param({}, {"0": 0, "1": 2048 * MiB}, id="attributed-processes"),
        pytest.param({"owners": None}, {"0": None, "1": None}, id="no-host-pid-not-measurable"),
        pytest.param({"pod_devices": kubelet(("vllm-a", {"server": [f"{H100_UUIDS[0]}::0"]})), "owners": None},
                     {"0": None, "1": 43010 * MiB}, id="unheld-device-is-all-foreign"),
        pytest.param({"pod_devices": []}, {"0": 2 * 24470 * MiB, "1": 43010 * MiB}, id="no-pods-all-foreign"),
        pytest.param({"pod_devices": None}, {"0": 0, "1": 2048 * MiB}, id="kubelet-down-spec-gpu-pods-count"),
        pytest.param({"pods": None}, {"0": None, "1": None}, id="api-server-not-listed"),
    ],
)
def test_foreign_bytes_rules(overrides: dict[str, Any], foreign: dict[str, int | None]) -> None:
    view = h100_view(**overrides)
    assert dict(view.foreign) == foreign
    assert {g.id: g.foreign_bytes for g in view.report.gpus} == {k: v or 0 for k, v in foreign.items()}


def test_a_pod_process_of_unknown_usage_makes_foreign_unknown() -> None:
    data = recording(H100_TIME_SLICED)
    data["gpus"][0]["processes"][0]["used_bytes"] = None
    view = h100_view(snapshot=snapshot_of(data))
    assert view.foreign["0"] is None and view.foreign["1"] == 2048 * MiB


def test_a_process_of_a_pod_without_gpus_is_foreign() -> None:
    owners = dict(ALL_OWNERS)
    owners[31337] = ProcessOwner("0b6e9a55-9999-4c3d-8e2f-000000000009", None)  # a CPU pod reaching the GPU
    assert h100_view(owners=owners).foreign["1"] == 2048 * MiB


def test_replica_index_and_mig_device_ids() -> None:
    snapshot = snapshot_of(H200_MIG_LOST)
    assert [d.id for d in devices_of(snapshot)] == ["3g.71gb#0", "1g.18gb#0", "1g.18gb#1", "1", "2"]
    pods = {("ml", n): PodInfo(UIDS[n], "ml", n) for n in UIDS}
    answer = [
        PodDevices("ml", "vllm-a", (ContainerDevices("server", (
            ("nvidia.com/mig-3g.71gb", ("MIG-0a1b2c3d-4e5f-5a6b-9c7d-8e9f0a1b2c3d",)),)),)),
        PodDevices("ml", "vllm-b", (ContainerDevices("server", (("nvidia.com/mig-1g.18gb", ("0:2",)),)),)),
        PodDevices("ml", "trainer", (ContainerDevices("server", (("nvidia.com/gpu.shared", ("1::3",)),)),)),
    ]
    view = build_view(snapshot, answer, pods, None)
    assert view.report.placements == {
        UIDS["vllm-a"]: {"server": ("3g.71gb#0",)},
        UIDS["vllm-b"]: {"server": ("1g.18gb#1",)},
        UIDS["trainer"]: {"server": ("1",)},
    }
    # The lost GPU is left out; the unheld 1g.18gb#0 is idle, so all measured devices are known.
    assert [g.id for g in view.report.gpus] == ["3g.71gb#0", "1g.18gb#0", "1g.18gb#1", "1"]
    assert view.foreign == {"3g.71gb#0": None, "1g.18gb#0": 0, "1g.18gb#1": None, "1": None}
    assert any("device 2: lost" in n for n in view.notes)


def test_a_container_on_a_device_nvml_cannot_see_keeps_an_unknown_placement() -> None:
    answer = kubelet(("vllm-a", {"server": [f"{H100_UUIDS[0]}::0", "GPU-00000000-dead-beef-0000-000000000000"]}),
                     ("vllm-b", {"server": [f"{H100_UUIDS[0]}::1"]}))
    view = h100_view(pod_devices=answer, owners=None)
    assert view.report.placements == {UIDS["vllm-b"]: {"server": ("0",)}}
    # Incomplete: the unseen device may be GPU 1 under another name, so GPU 1 is not called unheld.
    assert view.foreign["1"] is None
    assert any("not seen by NVML" in n for n in view.notes)


def test_without_nvml_the_report_is_empty_and_valid() -> None:
    view = build_view(None, H100_KUBELET, node_pods(), None)
    assert json.loads(view.report.encode()) == {"version": 1, "gpus": [], "pods": {}}
    assert "NVML unavailable: no device is measured" in view.notes


def test_usage_rows_declared_and_used_per_container() -> None:
    rows = {(r.pod, r.device): (r.container, r.declared_bytes, r.used_bytes) for r in h100_view().usage}
    declared = int(Fraction(3, 10) * H100_USABLE)
    assert rows == {
        ("vllm-a", "0"): ("server", declared, 24470 * MiB),
        ("vllm-b", "0"): ("server", declared, 24470 * MiB),
        ("trainer", "1"): ("server", declared, 40962 * MiB),
    }


# -- the report in the extender's inventory and ledger ---------------------------------------------


def time_sliced_node(report: str | None) -> dict[str, Any]:
    """Two H100s with 4 time-slicing replicas each, as GPU Feature Discovery labels them."""
    labels = {
        "nvidia.com/gpu.count": "2", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-SHARED",
        "nvidia.com/gpu.memory": "81559", "nvidia.com/gpu.replicas": "4",
        "nvidia.com/gpu.sharing-strategy": "time-slicing",
    }
    annotations = {AGENT_REPORT_ANNOTATION: report} if report is not None else {}
    return {"metadata": {"name": "gpu-1", "labels": labels, "annotations": annotations},
            "status": {"allocatable": {GPU: "8", "cpu": "64", "pods": "110"}}}


def claim(fraction: str) -> Claim:
    return Claim(GPU, "server", (Vram(fraction=Fraction(fraction)),))


def fill(ledger: Ledger, pods: list[str]) -> int:
    """Reserve 0.3-GPU pods in order; return how many fitted."""
    placed = 0
    for name in pods:
        if ledger.reserve("gpu-1", PodRef(UIDS.get(name, name), "ml", name), [claim("0.3")]).ok:
            placed += 1
    return placed


def test_the_report_lets_the_ledger_place_more_than_the_conservative_rule() -> None:
    margins: dict[Sharing, Fraction] = {"time-slicing": Fraction(1, 10)}
    conservative = Ledger(margins)
    conservative.upsert_node(read_inventory(time_sliced_node(None)))
    assert fill(conservative, ["vllm-a", "vllm-b", "trainer", "new"]) == 3  # a 4th might join two on one GPU

    view = h100_view()
    informed = Ledger(margins)
    inventory = read_inventory(time_sliced_node(view.report.encode()))
    assert inventory.notes == ()
    assert [(d.memory_bytes, d.foreign_bytes) for d in inventory.devices] == [(H100_USABLE, 0),
                                                                             (H100_USABLE, 2048 * MiB)]
    informed.upsert_node(inventory)
    assert fill(informed, ["vllm-a", "vllm-b", "trainer", "new"]) == 4
    assert informed.check_invariants() == []
    # Not beyond the truth: GPU 0 holds 0.6 for sure, so a 5th and a 6th cannot both fit.
    assert fill(informed, ["fifth", "sixth"]) <= 1
    assert informed.check_invariants() == []


def test_the_reported_memory_is_what_cuda_reports() -> None:
    # cudaMemGetInfo's total is NVML's total less the driver's reserve (NVML v2 ``reserved``): 81,559 MiB
    # and 454 MiB reserved on an H100 80GB HBM3 give CUDA's 85,045,477,376 bytes (thamada/nvidia-smi,
    # ``nvidia-smi -q`` beside ``deviceQuery`` on one machine). vLLM takes its utilization of that total.
    h100 = MemoryInfo(81559 * MiB, 0, 454 * MiB)
    assert abs(usable_bytes(h100) - 85045477376) <= MiB
    assert usable_bytes(MemoryInfo(81559 * MiB, 0, None)) == 81559 * MiB  # v1 only: NVML's total
    assert usable_bytes(MemoryInfo(81559 * MiB, 0, 81559 * MiB)) == 81559 * MiB  # a reserve that is everything: junk
    assert usable_bytes(MemoryInfo(81559 * MiB, 0, -1)) == 81559 * MiB


def test_a_declaration_below_the_engines_own_claim_is_not_over_use_until_the_claim_is_passed() -> None:
    """vLLM v0.11.0 with no flags claims 0.9 of the GPU; a declaration of 0.3 does not lower what the
    ledger holds (``ContainerDemand.reservations``), so using 24 GiB is within it, and only use
    beyond the engine's claim is over-use, measured from that claim."""
    vllm = node_pods(image="vllm/vllm-openai:v0.11.0")
    rows = {(r.pod, r.device): r for r in h100_view(pods=vllm).usage}
    held = rows[("vllm-a", "0")].declared_bytes
    assert held is not None and held > int(Fraction(9, 10) * H100_USABLE)
    assert h100_view(pods=vllm).overuse == ()
    data = recording(H100_TIME_SLICED)
    data["gpus"][1]["processes"][0]["used_bytes"] = held + 2 * 2**30
    data["gpus"][1]["memory"]["used"] = held + 2 * 2**30
    (excess,) = h100_view(pods=vllm, snapshot=snapshot_of(data)).overuse
    assert (excess.pod, excess.declared_bytes, excess.excess_bytes) == ("trainer", held, 2 * 2**30)
