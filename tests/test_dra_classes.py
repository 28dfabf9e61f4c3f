"""DeviceClasses and CEL selectors: what a class (and a claim's selectors) could match."""

from __future__ import annotations

from typing import Any

import pytest

from tests.dra_objects import MIG_SELECTOR, device_class, gpu_device, mig_device, resource_slice
from vramguard.dra import (
    ANY_DEVICE,
    Selector,
    class_for_extended_resource,
    parse_expression,
    read_device_class,
    read_resource_slices,
    read_selectors,
)
from vramguard.quantity import GiB, MiB

L4 = gpu_device("gpu-1", uuid="GPU-L4", memory="23034Mi", product="NVIDIA L4")
INVENTORY = read_resource_slices([resource_slice(devices=[gpu_device(), L4, mig_device()])])


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        pytest.param("device.driver == 'gpu.nvidia.com'", Selector(driver="gpu.nvidia.com"), id="driver"),
        pytest.param('device.driver == "gpu.nvidia.com"', Selector(driver="gpu.nvidia.com"), id="double-quotes"),
        pytest.param(
            "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
            Selector(driver="gpu.nvidia.com", attributes=(("type", "gpu"),)),
            id="nvidia-gpu-class",
        ),
        pytest.param(
            "(device.attributes['gpu.nvidia.com'].productName == 'NVIDIA L4')",
            Selector(attributes=(("productName", "NVIDIA L4"),)),
            id="parenthesised-product",
        ),
        pytest.param(
            "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) <= 0",
            Selector(max_memory=40 * GiB),
            id="memory-at-most",
        ),
        pytest.param(
            "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity(\"40Gi\")) < 0",
            Selector(max_memory=40 * GiB - 1),
            id="memory-below",
        ),
        pytest.param(
            "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",
            Selector(min_memory=40 * GiB),
            id="memory-at-least",
        ),
        pytest.param(
            "device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('40Gi'))",
            Selector(min_memory=40 * GiB + 1),
            id="memory-greater-method",
        ),
        pytest.param(
            "device.capacity['gpu.nvidia.com'].memory.isLessThan(quantity('40Gi'))",
            Selector(max_memory=40 * GiB - 1),
            id="memory-less-method",
        ),
        pytest.param(
            "device.attributes['gpu.nvidia.com'].type == 'gpu' || device.attributes['gpu.nvidia.com'].type == 'mig'",
            ANY_DEVICE,
            id="disjunction-not-read",
        ),
        pytest.param("!(device.driver == 'x')", ANY_DEVICE, id="negation-not-read"),
        pytest.param(
            "device.attributes['gpu.nvidia.com'].cudaComputeCapability.isGreaterThan(semver('8.0.0'))",
            ANY_DEVICE,
            id="unknown-clause-any",
        ),
        pytest.param(
            "device.driver == 'a' && device.driver == 'b'", Selector(driver="b", impossible=True), id="contradiction"
        ),
    ],
)
def test_parse_expression(expression: str, expected: Selector) -> None:
    assert parse_expression(expression) == expected


@pytest.mark.parametrize(
    ("selectors", "names"),
    [
        pytest.param([], ["gpu-0", "gpu-1", "gpu-0-mig-1g10gb-19-0"], id="class-without-selectors"),
        pytest.param(["device.attributes['gpu.nvidia.com'].type == 'gpu'"], ["gpu-0", "gpu-1"], id="gpus"),
        pytest.param([MIG_SELECTOR], ["gpu-0-mig-1g10gb-19-0"], id="migs"),
        pytest.param(
            ["device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"], ["gpu-0-mig-1g10gb-19-0"], id="profile"
        ),
        pytest.param(
            ["device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('24Gi')) <= 0"],
            ["gpu-1", "gpu-0-mig-1g10gb-19-0"],
            id="memory-bound",
        ),
        pytest.param(["device.driver == 'other.example.com'"], [], id="other-driver"),
        pytest.param(["device.attributes['gpu.nvidia.com'].uuid == 'GPU-L4'"], ["gpu-1"], id="uuid"),
    ],
)
def test_matching(selectors: list[str], names: list[str]) -> None:
    selector = read_selectors([{"cel": {"expression": s}} for s in selectors])
    assert [d.name for d in INVENTORY.devices if selector.matches(d)] == names


def test_class_narrowed_by_request() -> None:
    gpu_class = read_device_class(device_class())
    assert gpu_class is not None
    assert gpu_class.driver == "gpu.nvidia.com"
    assert gpu_class.device_type == "gpu"
    assert gpu_class.extended_resource == "nvidia.com/gpu"
    assert [d.name for d in gpu_class.could_match(INVENTORY.devices)] == ["gpu-0", "gpu-1"]
    largest = gpu_class.largest(INVENTORY.devices)
    assert largest is not None and largest.memory_bytes == 81559 * MiB
    small = parse_expression("device.attributes['gpu.nvidia.com'].productName == 'NVIDIA L4'")
    narrowed = gpu_class.largest(INVENTORY.devices, small)
    assert narrowed is not None and narrowed.name == "gpu-1"
    mig_class = read_device_class(device_class("mig.nvidia.com", MIG_SELECTOR, None))
    assert mig_class is not None and mig_class.extended_resource is None
    assert mig_class.largest(INVENTORY.devices, small) is None


@pytest.mark.parametrize(
    "obj",
    [None, {}, {"metadata": {"name": 5}}, {"metadata": "x"}],
    ids=["none", "empty", "name-not-string", "metadata-not-map"],
)
def test_unnamed_class(obj: Any) -> None:
    assert read_device_class(obj) is None


@pytest.mark.parametrize(
    "spec",
    [
        {"selectors": "x"},
        {"selectors": [None, {"cel": None}, {"cel": {"expression": 5}}, {"cel": {"expression": "x" * 20_000}}]},
        {"selectors": [{"cel": {"expression": "device.capacity['d'].memory.compareTo(quantity('junk')) <= 0"}}]},
        {"extendedResourceName": ["nvidia.com/gpu"]},
    ],
    ids=["selectors-not-list", "junk-entries", "bad-quantity", "resource-not-string"],
)
def test_junk_class_matches_anything(spec: dict[str, Any]) -> None:
    info = read_device_class({"metadata": {"name": "c"}, "spec": spec})
    assert info is not None
    assert info.selector == ANY_DEVICE
    assert info.extended_resource is None


def test_too_many_selectors_are_not_read() -> None:
    clauses = [{"cel": {"expression": "device.driver == 'x'"}}] * 32 + [{"cel": {"expression": "device.driver == 'y'"}}]
    assert read_selectors(clauses) == Selector(driver="x")


@pytest.mark.parametrize(
    ("classes", "resource", "expected"),
    [
        pytest.param([device_class()], "nvidia.com/gpu", "gpu.nvidia.com", id="named"),
        pytest.param(
            [device_class("a", created="2026-01-01T00:00:00Z"), device_class("b", created="2026-02-01T00:00:00Z")],
            "nvidia.com/gpu",
            "b",
            id="newest-wins",
        ),
        pytest.param([device_class("b"), device_class("a")], "nvidia.com/gpu", "a", id="tie-first-by-name"),
        pytest.param(
            [device_class(extended_resource=None)],
            "deviceclass.resource.kubernetes.io/gpu.nvidia.com",
            "gpu.nvidia.com",
            id="implicit-name",
        ),
        pytest.param([device_class(extended_resource=None)], "nvidia.com/gpu", None, id="none"),
    ],
)
def test_class_for_extended_resource(classes: list[dict[str, Any]], resource: str, expected: str | None) -> None:
    infos = [read_device_class(c) for c in classes]
    found = class_for_extended_resource([i for i in infos if i is not None], resource)
    assert (found.name if found else None) == expected
