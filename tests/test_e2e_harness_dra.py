"""DRA objects of the e2e harness have the shapes the NVIDIA DRA driver and vLLM's guide give them."""

from __future__ import annotations

from typing import Any

import pytest

from e2e import dra_objects as dra
from vramguard.dra import read_resource_slices


def _device(shares: dra.ConsumableShares, model: str = "H100-80GB") -> dict[str, Any]:
    spec = dra.dra_node("node-a", model, gpus=2, shares=shares)
    return dra.resource_slice(spec, "uid-1")["spec"]["devices"][1]


@pytest.mark.parametrize(
    ("shares", "shareable", "memory", "extra"),
    [
        pytest.param("disabled", False, {"value": "81559Mi"}, None, id="disabled-exclusive"),
        pytest.param(
            "memory",
            True,
            {
                "value": "81559Mi",
                "requestPolicy": {"default": "81559Mi", "validRange": {"min": "1Mi", "max": "81559Mi", "step": "1Mi"}},
            },
            None,
            id="memory-default-whole-gpu",
        ),
        pytest.param(
            "unlimited",
            True,
            {
                "value": "81559Mi",
                "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "81559Mi", "step": "1Mi"}},
            },
            None,
            id="unlimited-default-zero",
        ),
        pytest.param(
            4,
            True,
            {
                "value": "81559Mi",
                "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "81559Mi", "step": "1Mi"}},
            },
            {"value": "4", "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "4", "step": "1"}}},
            id="share-count",
        ),
    ],
)
def test_consumable_shares_modes(
    shares: dra.ConsumableShares, shareable: bool, memory: dict[str, Any], extra: dict[str, Any] | None
) -> None:
    device = _device(shares)
    assert device.get("allowMultipleAllocations", False) is shareable
    assert device["capacity"]["memory"] == memory
    assert device["capacity"].get("shares") == extra


def test_device_attributes_follow_the_driver() -> None:
    device = _device("memory")
    assert device["name"] == "gpu-1"
    attributes = device["attributes"]
    assert attributes["type"] == {"string": "gpu"}
    assert attributes["uuid"]["string"].startswith("GPU-")
    assert attributes["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert attributes["architecture"] == {"string": "Hopper"}
    assert attributes["cudaComputeCapability"] == {"version": "9.0.0"}
    # The driver publishes versions through semver: no leading zeros.
    assert attributes["driverVersion"] == {"version": "580.95.5"}


def test_slice_is_one_pool_per_node_owned_by_the_node() -> None:
    spec = dra.dra_node("node-a", "H100-80GB", gpus=2)
    body = dra.resource_slice(spec, "uid-1")
    assert body["spec"]["driver"] == "gpu.nvidia.com"
    assert body["spec"]["nodeName"] == "node-a"
    assert body["spec"]["pool"] == {"name": "node-a", "generation": 1, "resourceSliceCount": 1}
    assert body["metadata"]["generateName"] == "node-a-gpu.nvidia.com-"
    assert body["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    uuids = [d["attributes"]["uuid"]["string"] for d in body["spec"]["devices"]]
    assert len(set(uuids)) == 2
    assert uuids == [d["attributes"]["uuid"]["string"] for d in dra.resource_slice(spec)["spec"]["devices"]]


def test_dra_node_has_no_gpu_labels_or_allocatable() -> None:
    spec = dra.dra_node("node-a", "H100-80GB")
    labels = dra.node_manifest(spec)["metadata"]["labels"]
    assert not any(key.startswith("nvidia.com/") for key in labels)
    status = dra.node_status(spec)
    assert not any(key.startswith("nvidia.com/") for key in status["allocatable"])
    assert status["allocatable"]["pods"] == "110"


@pytest.mark.parametrize(
    ("shares", "message"),
    [
        pytest.param(0, "positive integer", id="zero-count"),
        pytest.param(True, "positive integer", id="boolean"),
        pytest.param("time-slicing", "disabled, memory, unlimited", id="unknown-mode"),
    ],
)
def test_bad_consumable_shares_are_refused(shares: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dra.dra_node("n", "H100-80GB", shares=shares)


def test_device_class_matches_the_chart() -> None:
    body = dra.device_class()
    assert body["metadata"]["name"] == "gpu.nvidia.com"
    assert body["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    expression = body["spec"]["selectors"][0]["cel"]["expression"]
    assert expression == "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"
    assert "extendedResourceName" not in dra.device_class(extended_resource=False)["spec"]


@pytest.mark.parametrize(
    ("memory", "exactly"),
    [
        pytest.param(
            "4Gi",
            {"deviceClassName": "gpu.nvidia.com", "capacity": {"requests": {"memory": "4Gi"}}},
            id="memory-sharing-demo",
        ),
        pytest.param(None, {"deviceClassName": "gpu.nvidia.com"}, id="unlimited-demo"),
    ],
)
def test_claim_template_matches_the_demos(memory: str | None, exactly: dict[str, Any]) -> None:
    body = dra.claim_template("gpu-4gi", "ns", memory)
    assert body["spec"]["spec"]["devices"]["requests"] == [{"name": "gpu", "exactly": exactly}]


@pytest.mark.parametrize(
    ("options", "claims", "gpu_limit"),
    [
        pytest.param(
            {"template": "gpu-24gi"}, [{"name": "gpu", "resourceClaimTemplateName": "gpu-24gi"}], None, id="template"
        ),
        pytest.param({"claim_name": "shared"}, [{"name": "gpu", "resourceClaimName": "shared"}], None, id="claim"),
        pytest.param({"extended": True}, None, "1", id="extended-resource"),
    ],
)
def test_vllm_pod_forms(options: dict[str, Any], claims: list[dict[str, str]] | None, gpu_limit: str | None) -> None:
    pod = dra.vllm_pod("p", "0.30", **options)
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["/bin/sh", "-c"]
    assert "vllm serve" in container["args"][0] and "--gpu-memory-utilization 0.30" in container["args"][0]
    assert pod["spec"].get("resourceClaims") == claims
    assert container["resources"]["limits"].get("nvidia.com/gpu") == gpu_limit
    assert ("claims" in container["resources"]) is (claims is not None)


def test_vllm_pod_needs_exactly_one_gpu_source() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        dra.vllm_pod("p", "0.30", template="t", extended=True)
    with pytest.raises(ValueError, match="exactly one"):
        dra.vllm_pod("p", "0.30")


@pytest.mark.parametrize(
    ("shares", "sharing"),
    [
        pytest.param("disabled", "exclusive", id="disabled"),
        pytest.param("memory", "memory", id="memory"),
        pytest.param("unlimited", "unlimited", id="unlimited"),
        pytest.param(3, "shares", id="share-count"),
    ],
)
def test_the_core_reads_the_harness_slices_in_their_mode(shares: dra.ConsumableShares, sharing: str) -> None:
    spec = dra.dra_node("node-a", "H100-80GB", gpus=2, shares=shares)
    body = dra.resource_slice(spec, "uid-1")
    body["metadata"]["name"] = "node-a-gpu.nvidia.com-x"
    inventory = read_resource_slices([body])
    assert [d.sharing for d in inventory.devices] == [sharing, sharing]
    assert {d.memory_bytes for d in inventory.devices} == {81559 * dra.MiB}
    assert [d.node for d in inventory.devices] == ["node-a", "node-a"]
    assert inventory.notes == ()
