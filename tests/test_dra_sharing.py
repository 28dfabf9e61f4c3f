"""The NVIDIA DRA driver's MPS settings in a claim's opaque configuration bind the processes of
the containers using the request, as the client variables would (vramguard/dra/sharing.py cites
the driver's source for each rule)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.dra_objects import device_class, gpu_device, resource_slice
from vramguard.cli import main
from vramguard.dra.sharing import MpsDefaults, read_mps_configs
from vramguard.quantity import GiB

DEMO = Path(__file__).parent / "data" / "dra" / "gpu-test-mps.yaml"


def config(mps: dict[str, Any], requests: list[str] | None = None, driver: str = "gpu.nvidia.com",
           strategy: str = "MPS") -> dict[str, Any]:
    entry: dict[str, Any] = {"opaque": {"driver": driver, "parameters": {
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
        "sharing": {"strategy": strategy, "mpsConfig": mps}}}}
    if requests is not None:
        entry["requests"] = requests
    return {"devices": {"config": [entry]}}


def test_limits_by_request_the_largest_per_device_one_in_whole_mib() -> None:
    notes: list[str] = []
    found = read_mps_configs(config({"defaultPinnedDeviceMemoryLimit": "10Gi",
                                     "defaultPerDevicePinnedMemoryLimit": {"0": "12Gi", "GPU-abc": "1500Ki"},
                                     "defaultActiveThreadPercentage": 50}, ["gpu"]), "claim", notes)
    assert found == {"gpu": MpsDefaults(12 * 1024, 50)} and notes == []
    assert MpsDefaults(12 * 1024, 50).env(2) == [
        {"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=12288M,1=12288M"},
        {"name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "value": "50"},
    ]
    # Without requests it applies to every request.
    assert read_mps_configs(config({"defaultPinnedDeviceMemoryLimit": "1Gi"}), "claim", []) == {None: MpsDefaults(1024)}


@pytest.mark.parametrize(
    ("spec", "note"),
    [
        (config({"defaultPinnedDeviceMemoryLimit": "lots"}), "defaultPinnedDeviceMemoryLimit"),
        (config({"defaultPinnedDeviceMemoryLimit": "1Ki"}), "under 1Mi"),
        (config({"defaultActiveThreadPercentage": 250}), "is not in 1..100"),
    ],
)
def test_nonsense_settings_are_noted_not_applied(spec: dict[str, Any], note: str) -> None:
    notes: list[str] = []
    [defaults] = read_mps_configs(spec, "claim", notes).values()
    assert defaults == MpsDefaults() and any(note in n for n in notes)


def test_other_drivers_and_time_slicing_set_no_mps_limits() -> None:
    assert read_mps_configs(config({"defaultPinnedDeviceMemoryLimit": "1Gi"}, driver="other.example.com"),
                            "claim", []) == {}
    assert read_mps_configs(config({}, strategy="TimeSlicing"), "claim", []) == {}
    assert read_mps_configs({"devices": {"config": "junk"}}, "claim", []) == {}


def test_the_drivers_published_mps_demo_is_read_and_its_claim_sized(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # demo/specs/quickstart/v1/gpu-test-mps.yaml: two containers on one request, limited to 10Gi each.
    objects = [*yaml.safe_load_all(DEMO.read_text()), device_class(),
               resource_slice(devices=[gpu_device(mode="memory")])]
    path = tmp_path / "input.yaml"
    path.write_text(yaml.safe_dump_all([o for o in objects if o]))
    main(["explain", "-o", "json", str(path)])
    [report] = [r for r in json.loads(capsys.readouterr().out) if r["kind"] == "Pod"]
    assert [(c["name"], c["vram_bytes_per_gpu"], c["sm_percent"]) for c in report["containers"]] == [
        ("mps-ctr0", 10 * GiB, 50), ("mps-ctr1", 10 * GiB, 50)]
    [claim] = report["claims"]
    assert claim["containers"] == ["mps-ctr0", "mps-ctr1"] and claim["reserved_bytes"] == 20 * GiB
