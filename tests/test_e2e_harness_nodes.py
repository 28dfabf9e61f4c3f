"""Fake GPU Nodes have the shape the NVIDIA device plugin and GPU Feature Discovery give them."""

from __future__ import annotations

import pytest

from e2e import gpu_nodes as gn


@pytest.mark.parametrize(
    ("key", "product", "memory"),
    [
        ("H100-80GB", "NVIDIA-H100-80GB-HBM3", 81559),
        ("H200", "NVIDIA-H200", 143771),
        ("A100-80GB", "NVIDIA-A100-SXM4-80GB", 81920),
        ("A100-40GB", "NVIDIA-A100-SXM4-40GB", 40960),
        ("H100-NVL", "NVIDIA-H100-NVL", 95830),
        ("L40S", "NVIDIA-L40S", 46068),
        ("L4", "NVIDIA-L4", 23034),
        ("T4", "Tesla-T4", 15360),
    ],
)
def test_models_match_nvml(key: str, product: str, memory: int) -> None:
    model = gn.GPU_MODELS[key]
    assert model.product_label == product
    assert model.memory_mib == memory


@pytest.mark.parametrize(
    ("spec", "resources", "labels"),
    [
        pytest.param(
            gn.exclusive("n", "H100-80GB", gpus=8),
            {"nvidia.com/gpu": "8"},
            {
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                "nvidia.com/gpu.count": "8",
                "nvidia.com/gpu.replicas": "1",
                "nvidia.com/gpu.sharing-strategy": "none",
                "nvidia.com/gpu.memory": "81559",
                "nvidia.com/mig.capable": "true",
                "nvidia.com/gpu.family": "hopper",
            },
            id="exclusive",
        ),
        pytest.param(
            gn.time_sliced("n", "H100-80GB", gpus=2, replicas=4),
            {"nvidia.com/gpu": "8"},
            {
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-SHARED",
                "nvidia.com/gpu.count": "2",
                "nvidia.com/gpu.replicas": "4",
                "nvidia.com/gpu.sharing-strategy": "time-slicing",
                "nvidia.com/mps.capable": "false",
            },
            id="time-slicing",
        ),
        pytest.param(
            gn.time_sliced("n", "L4", gpus=1, replicas=4, renamed=True),
            {"nvidia.com/gpu.shared": "4"},
            {
                "nvidia.com/gpu.product": "NVIDIA-L4",
                "nvidia.com/gpu.replicas": "4",
                "nvidia.com/gpu.family": "ada-lovelace",
                "nvidia.com/mig.capable": "false",
            },
            id="time-slicing-renamed",
        ),
        pytest.param(
            gn.mps("n", "H200", gpus=4, replicas=2),
            {"nvidia.com/gpu": "8"},
            {
                "nvidia.com/gpu.product": "NVIDIA-H200-SHARED",
                "nvidia.com/gpu.sharing-strategy": "mps",
                "nvidia.com/mps.capable": "true",
                "nvidia.com/gpu.memory": "143771",
            },
            id="mps",
        ),
        pytest.param(
            gn.mig_mixed("n", "A100-40GB", ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"], gpus=2),
            {"nvidia.com/mig-3g.20gb": "2", "nvidia.com/mig-2g.10gb": "2", "nvidia.com/mig-1g.5gb": "4"},
            {
                "nvidia.com/mig.strategy": "mixed",
                "nvidia.com/gpu.replicas": "0",
                "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB",
                "nvidia.com/mig-1g.5gb.count": "4",
                "nvidia.com/mig-1g.5gb.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb",
                "nvidia.com/mig-3g.20gb.slices.gi": "3",
            },
            id="mig-mixed",
        ),
    ],
)
def test_node_shape(spec: gn.GPUNodeSpec, resources: dict[str, str], labels: dict[str, str]) -> None:
    assert gn.gpu_resources(spec) == resources
    actual = gn.node_labels(spec)
    assert {key: actual.get(key) for key in labels} == labels
    status = gn.node_status(spec)
    for name, quantity in resources.items():
        assert status["capacity"][name] == quantity
        assert status["allocatable"][name] == quantity
    assert {"cpu", "memory", "pods"} <= set(status["allocatable"])
    assert {"type": "Ready", "status": "True"}.items() <= status["conditions"][-1].items()
    assert "status" not in gn.node_manifest(spec), "status is written through the subresource"


def test_mig_nodes_do_not_advertise_whole_gpus() -> None:
    spec = gn.mig_mixed("n", "H100-80GB", ["7g.80gb"], gpus=8)
    assert "nvidia.com/gpu" not in gn.gpu_resources(spec)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: gn.time_sliced("n", "T4", replicas=1), id="time-slicing-needs-replicas"),
        pytest.param(lambda: gn.mig_mixed("n", "L40S", ["1g.10gb"]), id="no-mig-on-l40s"),
        pytest.param(lambda: gn.mig_mixed("n", "H100-80GB", ["4g.40gb", "4g.40gb"]), id="too-many-slices"),
        pytest.param(lambda: gn.mig_mixed("n", "H100-80GB", ["1g.20gb"] * 5), id="too-many-of-a-profile"),
        pytest.param(lambda: gn.exclusive("n", "H100-80GB", gpus=0), id="no-gpus"),
        pytest.param(lambda: gn.exclusive("n", "B999"), id="unknown-model"),
    ],
)
def test_invalid_shapes_are_rejected(make: object) -> None:
    with pytest.raises(ValueError):
        make()  # type: ignore[operator]


def test_extra_labels_and_taints_are_applied() -> None:
    taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    spec = gn.exclusive("n", "T4", extra_labels={"pool": "a"}, taints=(taint,))
    manifest = gn.node_manifest(spec)
    assert manifest["metadata"]["labels"]["pool"] == "a"
    assert manifest["spec"]["taints"] == [taint]
