"""Other GPU-sharing systems' declarations are read as declarations (bytes or fractions of each
GPU), with the engine's own view where the system makes its cap the device's total. Each expected
value comes from the system's source or docs, cited in vramguard/demand/foreign.py."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.podspecs import container, pod
from vramguard.cli import main
from vramguard.demand import derive_pod_demand
from vramguard.demand.model import ContainerDemand, Vram
from vramguard.quantity import GiB, MiB

VLLM = "vllm/vllm-openai:v0.21.0"


def only(spec: dict[str, Any]) -> ContainerDemand:
    [found] = derive_pod_demand(spec).containers
    return found


def held(found: ContainerDemand, device: int = 80 * GiB) -> int:
    """What the container holds on a device of ``device`` bytes (the larger of its declaration and
    its engine's claim)."""
    return max(v.on_device(device) for v in found.reservations)


def vllm(utilization: str, resources: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return container("vllm", image=VLLM, args=["--model", "m", "--gpu-memory-utilization", utilization],
                     gpus=None, resources={"limits": resources}, **extra)


def test_hami_memory_in_mib_wins_over_the_percentage_and_the_engine_sees_the_cap() -> None:
    # HAMi's README example: 3000 MiB per GPU; gpumem wins over gpumem-percentage (device.go).
    found = only(pod(vllm("0.9", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000,
                                  "nvidia.com/gpumem-percentage": 50})))
    assert (found.resource, found.gpus, found.declared) == ("nvidia.com/gpu", 1, Vram(bytes=3000 * MiB))
    # vLLM's 0.9 is of the 3000 MiB HAMi-core reports as the total, and all it holds is within the cap.
    assert found.claim == Vram(bytes=int(Fraction("0.9") * 3000 * MiB))
    assert held(found) == 3000 * MiB


def test_hami_percentage_and_the_published_vllm_example() -> None:
    # examples/nvidia/vllm_cross_vgpu.yaml: 2 GPUs at 30% each, vLLM at 0.95 with tensor parallel 2.
    spec = pod(container("vllm", image=VLLM, gpus=None,
                         args=["--model", "m", "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.95"],
                         resources={"limits": {"nvidia.com/gpu": 2, "nvidia.com/gpumem-percentage": 30}}))
    demand = derive_pod_demand(spec)
    [found] = demand.containers
    assert not demand.errors and found.gpus == 2
    assert found.declared == Vram(Fraction(3, 10)) and found.claim == Vram(Fraction("0.285"))
    assert held(found) == int(Fraction(3, 10) * 80 * GiB)


def test_hami_without_its_cap_enforced_counts_the_engine_on_the_whole_device() -> None:
    # CUDA_DISABLE_CONTROL=true: HAMi does not mount its library (plugin/server.go), no cap is seen.
    found = only(pod(vllm("0.9", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000},
                          env={"CUDA_DISABLE_CONTROL": "true"})))
    assert found.claim is not None and found.claim.fraction == Fraction("0.9")
    assert held(found) > int(0.9 * 80 * GiB)


def test_volcano_percent_wins_number_defaults_to_one_and_no_memory_is_the_whole_gpu() -> None:
    assert only(pod(vllm("0.5", {"volcano.sh/vgpu-memory": 2000}))).gpus == 1
    both = only(pod(vllm("0.5", {"volcano.sh/vgpu-number": 2, "volcano.sh/vgpu-memory": 2000,
                                 "volcano.sh/vgpu-memory-percentage": 25})))
    assert (both.resource, both.gpus, both.declared) == ("volcano.sh/vgpu-number", 2, Vram(Fraction(1, 4)))
    assert both.claim == Vram(Fraction(1, 8))
    assert only(pod(vllm("0.5", {"volcano.sh/vgpu-number": 1}))).declared == Vram(Fraction(1))


def test_gpushare_is_gib_and_not_enforced_so_the_engine_counts_on_the_whole_device() -> None:
    found = only(pod(vllm("0.3", {"aliyun.com/gpu-mem": 4})))
    assert (found.resource, found.gpus, found.declared) == ("aliyun.com/gpu-mem", 1, Vram(bytes=4 * GiB))
    assert found.claim is not None and found.claim.fraction == Fraction("0.3")
    assert held(found) > int(0.3 * 80 * GiB)  # the engine's, the larger


def test_kai_fraction_applies_to_the_first_container_or_the_one_named() -> None:
    app = container("app", gpus=None)
    side = container("side", gpus=None)
    first = derive_pod_demand(pod(app, side, annotations={"gpu-fraction": "0.5"})).containers
    assert [(c.name, c.resource, c.declared) for c in first] == [("app", "gpu-fraction", Vram(Fraction(1, 2)))]
    named = derive_pod_demand(pod(app, side, annotations={"gpu-memory": "2000", "gpu-fraction-num-devices": "2",
                                                          "gpu-fraction-container-name": "side"})).containers
    assert [(c.name, c.gpus, c.declared) for c in named] == [("side", 2, Vram(bytes=2000 * MiB))]
    # An init container may be named (KAI checks them first).
    init = derive_pod_demand(pod(app, initContainers=[container("prep", gpus=None)],
                                 annotations={"gpu-fraction": "0.25", "gpu-fraction-container-name": "prep"}))
    assert [(c.name, c.init) for c in init.containers] == [("prep", True)]


def test_kai_annotations_are_not_read_beside_a_gpu_resource_and_bad_values_are_errors() -> None:
    beside = only(pod(container("app"), annotations={"gpu-fraction": "0.5"}))
    assert beside.declared is None  # KAI refuses a fraction with a GPU limit
    for value in ("1.5", "0", "half"):
        demand = derive_pod_demand(pod(container("app", gpus=None), annotations={"gpu-fraction": value}))
        assert demand.errors == (f"container app: KAI scheduler: gpu-fraction={value} is not a fraction in (0, 1)",)
    missing = derive_pod_demand(pod(container("app", gpus=None),
                                    annotations={"gpu-fraction": "0.5", "gpu-fraction-container-name": "nope"}))
    assert missing.containers == () and any("names 'nope', no container of the pod" in w for w in missing.warnings)


def test_a_vramguard_declaration_wins_over_another_systems() -> None:
    spec = pod(vllm("0.9", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 3000}),
               annotations={"vramguard.io/vram": "4Gi"})
    assert only(spec).declared == Vram(bytes=4 * GiB)


@pytest.mark.parametrize("value", ["-1", "x", "1" * 40, "0", None, [], {"a": 1}, True])
def test_nonsense_values_are_errors_not_crashes(value: Any) -> None:
    demand = derive_pod_demand(pod(vllm("0.5", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": value})))
    assert demand.errors and "HAMi: nvidia.com/gpumem=" in demand.errors[0]


H100_NODE = {
    "apiVersion": "v1", "kind": "Node",
    "metadata": {"name": "h100-1", "labels": {
        "nvidia.com/gpu.count": "1", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-SHARED",
        "nvidia.com/gpu.memory": "81559", "nvidia.com/gpu.replicas": "4",
        "nvidia.com/gpu.sharing-strategy": "time-slicing"}},
    "status": {"allocatable": {"cpu": "32", "nvidia.com/gpu": "4"}},
}


def test_plan_counts_a_hami_pod_by_its_cap_on_a_node_it_shares(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Bound there: vLLM at 0.95 under a 30% cap holds 0.3 of the GPU, so a vLLM at 0.6 fits beside it
    # (as 0.95 it would not).
    hami = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "hami", "namespace": "team-b", "uid": "u-hami"},
            "spec": {"nodeName": "h100-1", "containers": [
                vllm("0.95", {"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 30})]}}
    newcomer = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "new", "namespace": "team-a"},
                "spec": {"containers": [vllm("0.6", {"nvidia.com/gpu": 1})]}}
    path = tmp_path / "input.yaml"
    path.write_text(yaml.safe_dump_all([H100_NODE, hami, newcomer]))
    assert main(["plan", str(path), "-o", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert sorted(p["pod"] for p in plan["placed"]) == ["team-a/new", "team-b/hami"]
