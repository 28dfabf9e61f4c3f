"""Every DRA reader takes any JSON without raising (the objects come from clients that may lie)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.dra_objects import allocated, claim, device_class, gpu_device, resource_slice, result, vllm_claim_pod
from vramguard.dra import (
    container_claim_uses,
    device_usage,
    extended_resource_claim,
    pod_claim_sources,
    read_allocation,
    read_claim,
    read_claim_template,
    read_device_class,
    read_resource_slices,
)

_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.sampled_from(["80Gi", "0", "-1", "1e40", "gpu", "mig", "gpu.nvidia.com", "memory"]),
)
JSON = st.recursive(
    _LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=30,
)


def _mutate(obj: Any, data: st.DataObject) -> Any:
    """``obj`` with one nested value replaced by junk."""
    if isinstance(obj, dict) and obj and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(obj)))
        return {**obj, key: _mutate(obj[key], data)}
    if isinstance(obj, list) and obj and data.draw(st.booleans()):
        index = data.draw(st.integers(0, len(obj) - 1))
        return [*obj[:index], _mutate(obj[index], data), *obj[index + 1 :]]
    return data.draw(JSON)


SEEDS = [
    resource_slice(devices=[gpu_device(mode="memory"), gpu_device("gpu-1", uuid="u1", mode=4)]),
    allocated(claim(memory="8Gi"), [result()]),
    device_class(),
    vllm_claim_pod(),
]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_readers_never_raise(data: st.DataObject) -> None:
    obj = _mutate(data.draw(st.sampled_from(SEEDS)), data)
    inventory = read_resource_slices([obj])
    read_device_class(obj)
    read_claim(obj)
    read_claim_template(obj)
    allocation = read_allocation(obj)
    device_usage(inventory, [allocation] if allocation else [])
    if isinstance(obj, dict):
        pod_claim_sources(obj)
        container_claim_uses(obj)
        extended_resource_claim(obj)
    for device in inventory.devices:
        device.consumes(None)
        device.consumes(1 << 30)


@settings(max_examples=200, deadline=None)
@given(JSON)
def test_arbitrary_json_never_raises(obj: Any) -> None:
    read_resource_slices([obj])
    read_device_class(obj)
    read_claim(obj)
    read_claim_template(obj)
    read_allocation(obj)
    if isinstance(obj, dict):
        pod_claim_sources(obj)
        container_claim_uses(obj)
