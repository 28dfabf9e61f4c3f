"""resource.k8s.io/v1 objects as the NVIDIA DRA driver, the scheduler and users write them, for tests.

Shapes follow the driver (``gpu.nvidia.com``, one pool per node named after it, consumable-shares
modes ``memory`` / ``unlimited`` / N), its demo ResourceClaimTemplates (``gpu-4gi``), the claim the
scheduler creates on the DRA extended-resource path, and vLLM pods as the vLLM docs publish them.
"""

from __future__ import annotations

from typing import Any

H100_MEMORY = "81559Mi"
H100_PRODUCT = "NVIDIA H100 80GB HBM3"
GPU_SELECTOR = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"
MIG_SELECTOR = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'"


def gpu_device(
    name: str = "gpu-0",
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000",
    memory: str = H100_MEMORY,
    mode: str | int = "memory",
    product: str = H100_PRODUCT,
) -> dict[str, Any]:
    """A full GPU as the driver publishes it; ``mode`` is its ``--consumable-shares`` value."""
    device: dict[str, Any] = {
        "name": name,
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": uuid},
            "productName": {"string": product},
            "architecture": {"string": "Hopper"},
            "cudaComputeCapability": {"version": "9.0.0"},
            "driverVersion": {"version": "580.126.20"},
        },
        "capacity": {"memory": {"value": memory}},
    }
    _share(device, memory, mode)
    return device


def mig_device(
    name: str = "gpu-0-mig-1g10gb-19-0",
    uuid: str = "MIG-11111111-1111-1111-1111-111111111111",
    parent: str = "GPU-00000000-0000-0000-0000-000000000000",
    profile: str = "1g.10gb",
    memory: str = "9728Mi",
    mode: str | int = "disabled",
) -> dict[str, Any]:
    """A static MIG device as the driver publishes it."""
    device: dict[str, Any] = {
        "name": name,
        "attributes": {
            "type": {"string": "mig"},
            "uuid": {"string": uuid},
            "parentUUID": {"string": parent},
            "profile": {"string": profile},
            "productName": {"string": H100_PRODUCT},
        },
        "capacity": {"memory": {"value": memory}, "multiprocessors": {"value": "16"}, "memorySlice0": {"value": "1"}},
    }
    _share(device, memory, mode)
    return device


def _share(device: dict[str, Any], memory: str, mode: str | int) -> None:
    """The driver's consumable-shares modes (``consumable_shares.go``)."""
    if mode == "disabled":
        return
    device["allowMultipleAllocations"] = True
    step = "1Mi"
    if mode == "memory":
        device["capacity"]["memory"]["requestPolicy"] = {
            "default": memory,
            "validRange": {"min": step, "max": memory, "step": step},
        }
        return
    device["capacity"]["memory"]["requestPolicy"] = {
        "default": "0",
        "validRange": {"min": "0", "max": memory, "step": step},
    }
    if isinstance(mode, int):
        device["capacity"]["shares"] = {
            "value": str(mode),
            "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": str(mode), "step": "1"}},
        }


def resource_slice(
    node: str = "node-a",
    devices: list[dict[str, Any]] | None = None,
    *,
    generation: int = 1,
    count: int = 1,
    name: str | None = None,
    driver: str = "gpu.nvidia.com",
) -> dict[str, Any]:
    """A node-local ResourceSlice of the driver's pool (named after the node)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name or f"{node}-{driver}-{generation}"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
            "devices": [gpu_device()] if devices is None else devices,
        },
    }


def device_class(
    name: str = "gpu.nvidia.com",
    selector: str = GPU_SELECTOR,
    extended_resource: str | None = "nvidia.com/gpu",
    created: str = "2026-11-01T00:00:00Z",
) -> dict[str, Any]:
    """The driver chart's DeviceClass (``extendedResourceName`` on v1)."""
    spec: dict[str, Any] = {"selectors": [{"cel": {"expression": selector}}]}
    if extended_resource is not None:
        spec["extendedResourceName"] = extended_resource
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name, "creationTimestamp": created},
        "spec": spec,
    }


def claim_spec(
    memory: str | None = None,
    device_class_name: str = "gpu.nvidia.com",
    request: str = "gpu",
    selectors: list[str] | None = None,
    count: int | None = None,
) -> dict[str, Any]:
    """A ResourceClaimSpec with one ``exactly`` request."""
    exactly: dict[str, Any] = {"deviceClassName": device_class_name}
    if memory is not None:
        exactly["capacity"] = {"requests": {"memory": memory}}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    if count is not None:
        exactly["count"] = count
    return {"devices": {"requests": [{"name": request, "exactly": exactly}]}}


def claim_template(name: str = "gpu-4gi", namespace: str = "gpu-share-memory", **kwargs: Any) -> dict[str, Any]:
    """The driver's demo template (``demo/specs/consumable-shares/memory-sharing.yaml``)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"spec": claim_spec(**kwargs)},
    }


def claim(name: str = "shared-gpu", namespace: str = "default", **kwargs: Any) -> dict[str, Any]:
    """A ResourceClaim made by hand."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": claim_spec(**kwargs),
    }


def allocated(
    obj: dict[str, Any],
    results: list[dict[str, Any]],
    pods: tuple[str, ...] = ("vllm-0",),
    node: str = "node-a",
) -> dict[str, Any]:
    """``obj`` with ``status.allocation`` as the scheduler writes it."""
    return {
        **obj,
        "status": {
            "allocation": {
                "devices": {"results": results},
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                    ]
                },
            },
            "reservedFor": [{"resource": "pods", "name": p, "uid": f"uid-{p}"} for p in pods],
        },
    }


def result(
    device: str = "gpu-0",
    memory: str | None = "20Gi",
    share: str | None = "6f1c0000-0000-4000-8000-000000000001",
    request: str = "gpu",
    pool: str = "node-a",
) -> dict[str, Any]:
    """One allocation result (``shareID`` and ``consumedCapacity`` only on shareable devices)."""
    entry: dict[str, Any] = {"request": request, "driver": "gpu.nvidia.com", "pool": pool, "device": device}
    if share is not None:
        entry["shareID"] = share
    if memory is not None:
        entry["consumedCapacity"] = {"memory": memory}
    return entry


def extended_resource_claim(pod: str = "vllm-0", namespace: str = "default", **result_args: Any) -> dict[str, Any]:
    """The claim the scheduler creates on the DRA extended-resource path (no capacity requests)."""
    obj = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": f"{pod}-extended-resources-abcde",
            "generateName": f"{pod}-extended-resources-",
            "namespace": namespace,
            "uid": f"uid-{pod}-erc",
            "annotations": {"resource.kubernetes.io/extended-resource-claim": "true"},
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": f"uid-{pod}", "controller": True}
            ],
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "container-0-request-0",
                        "exactly": {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 1},
                    }
                ]
            }
        },
    }
    return allocated(obj, [result(request="container-0-request-0", **result_args)], pods=(pod,))


def vllm_claim_pod(
    name: str = "vllm-0",
    utilization: str | None = "0.9",
    *,
    template: str | None = "gpu-4gi",
    claim_name: str | None = None,
    namespace: str = "gpu-share-memory",
    request: str | None = None,
) -> dict[str, Any]:
    """A vLLM server (``vllm/vllm-openai``, args only, as the vLLM docs deploy it) using a claim ``gpu``."""
    args = ["--model", "Qwen/Qwen2.5-1.5B-Instruct"]
    if utilization is not None:
        args += ["--gpu-memory-utilization", utilization]
    source: dict[str, Any] = {"name": "gpu"}
    if claim_name is not None:
        source["resourceClaimName"] = claim_name
    else:
        source["resourceClaimTemplateName"] = template
    use: dict[str, Any] = {"name": "gpu"}
    if request is not None:
        use["request"] = request
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {
            "resourceClaims": [source],
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.10.1",
                    "args": args,
                    "ports": [{"containerPort": 8000}],
                    "resources": {"claims": [use]},
                }
            ],
        },
    }


def vllm_extended_resource_pod(
    name: str = "vllm-0", utilization: str = "0.9", namespace: str = "default"
) -> dict[str, Any]:
    """A vLLM pod asking ``nvidia.com/gpu: 1`` (served by DRA where no device plugin is)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.10.1",
                    "args": ["--model", "Qwen/Qwen2.5-1.5B-Instruct", "--gpu-memory-utilization", utilization],
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }
            ],
        },
    }
