"""The NVML snapshot: typed readings from recorded H100/H200 machines, and failures call by call."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from agent.nvml import (
    DeviceAttributes,
    MemoryInfo,
    NvmlProblem,
    NvmlUnavailable,
    ProcessUsage,
    PynvmlBackend,
    mig_profile_from_attributes,
    mig_profile_from_name,
    take_snapshot,
)
from agent.recorded import RecordedNvml, snapshot_to_json
from tests.agent_support import (
    H100_BYTES,
    H100_TIME_SLICED,
    H100_UUIDS,
    H200_BYTES,
    H200_MIG_LOST,
    MiB,
    recording,
    snapshot_of,
)


def test_h100_time_sliced_recording_reads_every_field() -> None:
    snapshot = snapshot_of(H100_TIME_SLICED)
    assert snapshot.driver_version == "580.95.05"
    assert snapshot.complete and snapshot.problems == ()
    assert [g.uuid for g in snapshot.gpus] == list(H100_UUIDS)
    first = snapshot.gpus[0]
    assert first.name == "NVIDIA H100 80GB HBM3"
    assert first.memory == MemoryInfo(H100_BYTES, 2 * 24470 * MiB, 580 * MiB)
    assert first.mig_enabled is False and first.mig_instances == ()
    assert first.processes == (ProcessUsage(48213, 24470 * MiB), ProcessUsage(48377, 24470 * MiB))


def test_h200_mig_instances_and_a_lost_gpu() -> None:
    snapshot = snapshot_of(H200_MIG_LOST)
    mig, plain, lost = snapshot.gpus
    assert mig.mig_enabled is True and mig.processes is None
    assert [(i.index, i.profile, i.gpu_instance_id) for i in mig.mig_instances] == [
        (0, "3g.71gb", 1), (1, "1g.18gb", 9), (2, "1g.18gb", 10)
    ]
    assert mig.mig_instances[2].processes == (ProcessUsage(60500, None),)
    assert plain.memory is not None and plain.memory.total == H200_BYTES
    assert lost.lost and lost.uuid is None and lost.memory is None
    assert snapshot.problems == (NvmlProblem("gpu 2", "device_handle", "GPU_IS_LOST"),)


def test_a_recording_replays_to_the_same_snapshot() -> None:
    for path in (H100_TIME_SLICED, H200_MIG_LOST):
        snapshot = snapshot_of(path)
        again = snapshot_of(snapshot_to_json(snapshot))
        # The lost GPU's handle error is replayed as UNKNOWN: it was recorded as nulls.
        assert again.gpus[:2] == snapshot.gpus[:2]


@pytest.mark.parametrize(
    ("field", "error", "check"),
    [
        pytest.param("memory", "GPU_IS_LOST", lambda g: g.memory is None and g.lost, id="memory-lost"),
        pytest.param("memory", "UNKNOWN", lambda g: g.memory is None and not g.lost, id="memory-error"),
        pytest.param("processes", "NO_PERMISSION", lambda g: g.processes is None and g.memory, id="processes"),
        pytest.param("uuid", "RESET_REQUIRED", lambda g: g.uuid is None and g.lost, id="reset-required"),
        pytest.param("name", "NOT_SUPPORTED", lambda g: g.name is None and g.uuid, id="name"),
    ],
)
def test_one_failing_call_costs_one_field(field: str, error: str, check: Any) -> None:
    data = recording(H100_TIME_SLICED)
    data["gpus"][0][field] = {"error": error}
    snapshot = snapshot_of(data)
    assert check(snapshot.gpus[0])
    assert snapshot.gpus[1] == snapshot_of(H100_TIME_SLICED).gpus[1]
    assert [p.call for p in snapshot.problems] == [field if field != "processes" else "compute_processes"]


def test_mig_not_supported_means_no_mig_and_no_problem() -> None:
    data = recording(H100_TIME_SLICED)
    del data["gpus"][0]["mig_enabled"]  # an L4 or T4: NVML answers NOT_SUPPORTED
    snapshot = snapshot_of(data)
    assert snapshot.gpus[0].mig_enabled is False and snapshot.problems == ()


def test_unknown_device_count_makes_an_incomplete_empty_snapshot() -> None:
    data = recording(H100_TIME_SLICED)
    data["device_count"] = {"error": "DRIVER_NOT_LOADED"}
    snapshot = snapshot_of(data)
    assert snapshot.gpus == () and not snapshot.complete
    assert snapshot.problems == (NvmlProblem("node", "device_count", "DRIVER_NOT_LOADED"),)


def test_a_mig_slot_that_fails_is_skipped_and_the_others_read() -> None:
    data = recording(H200_MIG_LOST)
    data["gpus"][0]["mig_instances"][1] = {"index": 1, "error": "UNKNOWN"}
    instances = snapshot_of(data).gpus[0].mig_instances
    assert [i.index for i in instances] == [0, 2]


def test_a_mig_device_without_a_profile_in_its_name_is_named_from_its_attributes() -> None:
    data = recording(H200_MIG_LOST)
    instance = data["gpus"][0]["mig_instances"][0]
    instance.update(name="NVIDIA H200 MIG", profile=None,
                    attributes={"gpu_instance_slices": 3, "compute_instance_slices": 3, "memory_mib": 70656})
    assert snapshot_of(data).gpus[0].mig_instances[0].profile == "3g.71gb"


@pytest.mark.parametrize(
    ("name", "profile"),
    [
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "1g.10gb"),
        ("NVIDIA H200 MIG 3g.71gb", "3g.71gb"),
        ("NVIDIA A100-SXM4-40GB MIG 1c.2g.10gb", "1c.2g.10gb"),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me", "1g.10gb+me"),
        ("NVIDIA H100 80GB HBM3", None),
    ],
)
def test_mig_profile_from_name(name: str, profile: str | None) -> None:
    assert mig_profile_from_name(name) == profile


@pytest.mark.parametrize(
    ("slices", "memory_mib", "total", "profile"),
    [
        pytest.param((1, 1), 9984, H100_BYTES, "1g.10gb", id="h100-1g"),
        pytest.param((3, 3), 40448, H100_BYTES, "3g.40gb", id="h100-3g"),
        pytest.param((7, 7), 80896, H100_BYTES, "7g.80gb", id="h100-7g"),
        pytest.param((1, 1), 16896, H200_BYTES, "1g.18gb", id="h200-1g"),
        pytest.param((3, 3), 70656, H200_BYTES, "3g.71gb", id="h200-3g-half-rounds-up"),
        pytest.param((2, 1), 9984 * 2, H100_BYTES, "1c.2g.20gb", id="compute-instance"),
        pytest.param((1, 1), 4864, 40960 * MiB, "1g.5gb", id="a100-40gb"),
    ],
)
def test_mig_profile_from_attributes(slices: tuple[int, int], memory_mib: int, total: int, profile: str) -> None:
    attributes = DeviceAttributes(slices[0], slices[1], memory_mib * MiB)
    assert mig_profile_from_attributes(attributes, total) == profile


# -- the pynvml adapter, on a stand-in for the driver library --------------------------------------


class _FakeLibrary:
    """pynvml's functions over one recorded GPU, raising pynvml's own error classes."""

    def __init__(self, lost: bool = False) -> None:
        self.lost = lost
        self.shut = False

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        calls = {
            "nvmlInit": lambda: None,
            "nvmlShutdown": self.shutdown,
            "nvmlSystemGetDriverVersion": lambda: "580.95.05",
            "nvmlDeviceGetCount": lambda: 1,
            "nvmlDeviceGetHandleByIndex": lambda i: f"gpu{i}",
            "nvmlDeviceGetUUID": lambda h: H100_UUIDS[0],
            "nvmlDeviceGetName": lambda h: "NVIDIA H100 80GB HBM3",
            "nvmlDeviceGetMemoryInfo": self.memory,
            "nvmlDeviceGetMigMode": self.mig_mode,
            "nvmlDeviceGetComputeRunningProcesses_v3": lambda h: [
                SimpleNamespace(pid=48213, usedGpuMemory=24470 * MiB), SimpleNamespace(pid=9, usedGpuMemory=None)
            ],
        }
        for name, function in calls.items():
            monkeypatch.setattr(pynvml, name, function)

    def shutdown(self) -> None:
        self.shut = True

    def memory(self, handle: Any, version: Any = None) -> Any:
        if self.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if version is None:
            return SimpleNamespace(total=H100_BYTES, free=H100_BYTES - 600 * MiB, used=600 * MiB)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)  # an old driver: v1 only

    def mig_mode(self, handle: Any) -> Any:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


def test_pynvml_backend_reads_through_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    library = _FakeLibrary()
    library.install(monkeypatch)
    backend = PynvmlBackend()
    backend.init()
    snapshot = take_snapshot(backend)
    backend.shutdown()
    gpu = snapshot.gpus[0]
    assert gpu.memory == MemoryInfo(H100_BYTES, 600 * MiB, None)  # v1 fallback: reserve unknown
    assert gpu.mig_enabled is False
    assert gpu.processes == (ProcessUsage(48213, 24470 * MiB), ProcessUsage(9, None))
    assert snapshot.problems == () and library.shut


def test_pynvml_backend_names_the_library_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeLibrary(lost=True).install(monkeypatch)
    backend = PynvmlBackend()
    backend.init()
    snapshot = take_snapshot(backend)
    assert snapshot.gpus[0].lost and snapshot.gpus[0].memory is None
    assert snapshot.problems == (NvmlProblem("gpu 0", "memory", "GPU_IS_LOST"),)
    assert backend.error_name(ValueError("not NVML")) is None


def test_pynvml_backend_without_a_driver_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_library() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    with pytest.raises(NvmlUnavailable, match="NVML initialisation failed"):
        PynvmlBackend().init()


def test_recorded_nvml_rereads_its_file(tmp_path: Any) -> None:
    path = tmp_path / "nvml.json"
    path.write_text(H100_TIME_SLICED.read_text())
    nvml = RecordedNvml(path)
    nvml.init()
    assert nvml.device_count() == 2
    path.write_text('{"gpus": []}')
    nvml.init()
    assert nvml.device_count() == 0


def test_a_recording_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    """A test or a demo may change what the GPUs show while the agent runs; a file caught half
    written (or junk) leaves the last reading in place."""
    path = tmp_path / "nvml.json"
    data = json.loads(H100_TIME_SLICED.read_text())
    path.write_text(json.dumps(data))
    nvml = RecordedNvml(path)
    nvml.init()
    assert take_snapshot(nvml).gpus[1].processes[1].pid == 31337
    data["gpus"][1]["processes"] = [{"pid": 4242, "used_bytes": 2**30}]
    path.write_text(json.dumps(data))
    assert [p.pid for p in take_snapshot(nvml).gpus[1].processes] == [4242]
    path.write_text('{"gpus": [')
    assert [p.pid for p in take_snapshot(nvml).gpus[1].processes] == [4242]
    path.unlink()
    assert len(take_snapshot(nvml).gpus) == 2
