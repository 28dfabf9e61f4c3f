"""DRA objects shaped exactly as the NVIDIA DRA driver (``gpu.nvidia.com``) publishes them.

No kubelet and no driver run: a DRA node is a Node (kubelet labels only: the GPU operator's DRA
stack removes GPU Feature Discovery and the device plugin, so there are no ``nvidia.com/gpu.*``
labels and no ``nvidia.com/gpu`` allocatable) plus the ResourceSlice the driver's kubelet plugin
would publish for it. The shapes follow kubernetes-sigs/dra-driver-nvidia-gpu:

* one pool per node, named after the node, one slice (``resourceSliceCount: 1``), owned by the
  Node (``generateName: <node>-gpu.nvidia.com-``, as the kubelet plugin helper names it);
* one device per GPU, ``gpu-<minor>``, with the attributes of ``deviceinfo.go``: ``type``,
  ``uuid``, ``productName``, ``brand``, ``architecture``, and the versions
  ``cudaComputeCapability``, ``driverVersion``, ``cudaDriverVersion`` (semver, as the driver
  normalises them); ``capacity.memory`` is the NVML total, a BinarySI quantity;
* ``--consumable-shares`` (``consumable_shares.go``): ``disabled`` publishes exclusive devices;
  ``memory``, ``unlimited`` or a count N set ``allowMultipleAllocations: true``, round memory down
  to a MiB and give it a request policy (default the whole memory in ``memory`` mode, 0
  otherwise; range 1Mi or 0 .. memory, step 1Mi), and N adds a ``shares`` capacity (default 1,
  1 .. N, step 1).

Also the driver's DeviceClass ``gpu.nvidia.com`` (its Helm chart's CEL selector, and
``extendedResourceName: nvidia.com/gpu`` on resource.k8s.io/v1), ResourceClaimTemplates as the
driver's consumable-shares demos write them, and vLLM pods in the form vLLM's Kubernetes guide
publishes (``vllm/vllm-openai`` run through ``/bin/sh -c "vllm serve ..."``), asking for their GPU
either through a claim or as ``nvidia.com/gpu`` (the DRA extended-resource path).

Everything here is a plain JSON-shaped dict; :func:`create_dra_node` and friends write through a
``request(method, path, body)`` callable such as ``e2e.cluster.Cluster.request``.
"""

from __future__ import annotations

import uuid as uuidlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from e2e import gpu_nodes
from e2e.gpu_nodes import GPUModel, gpu_model

DRIVER = "gpu.nvidia.com"
"""The NVIDIA DRA driver's name; also the name of its DeviceClass for full GPUs."""
DEVICE_CLASS = "gpu.nvidia.com"
GPU_SELECTOR = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"
"""The CEL selector of the driver's ``gpu.nvidia.com`` DeviceClass (Helm ``deviceclass-gpu.yaml``)."""
EXTENDED_RESOURCE = "nvidia.com/gpu"
RESOURCE_API = "/apis/resource.k8s.io/v1"
CUDA_DRIVER_VERSION = "13.0.0"
MiB = 1 << 20

ConsumableShares = str | int
"""``disabled``, ``memory``, ``unlimited`` or a positive share count, as ``--consumable-shares``."""
Request = Callable[[str, str, Mapping[str, Any] | None], Any]
"""``request(method, path, body)``: a JSON call to the API server as the admin."""

_ARCHITECTURES = {7: "Volta", 8: "Ampere", 9: "Hopper", 10: "Blackwell", 12: "Blackwell"}


def architecture(model: GPUModel) -> str:
    """NVML's architecture name for the model (Turing is 7.5, Ada Lovelace 8.9)."""
    major, minor = model.compute
    if (major, minor) == (7, 5):
        return "Turing"
    if (major, minor) == (8, 9):
        return "Ada Lovelace"
    return _ARCHITECTURES.get(major, "Unknown")


def semver(version: str) -> str:
    """A dotted version as the driver publishes it (Masterminds semver): ``580.95.05`` -> ``580.95.5``."""
    parts = [str(int(part)) for part in version.split(".")]
    return ".".join([*parts, "0", "0"][:3])


@dataclass(frozen=True)
class DraNodeSpec:
    """A Node whose GPUs the NVIDIA DRA driver publishes; build it with :func:`dra_node`."""

    name: str
    model: GPUModel
    gpus: int = 1
    shares: ConsumableShares = "memory"
    cpu: str = "64"
    memory: str = "512Gi"
    pods: int = 110
    extra_labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Mapping[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError("a DRA GPU node needs at least one GPU")
        if isinstance(self.shares, bool) or (isinstance(self.shares, int) and self.shares < 1):
            raise ValueError(f"--consumable-shares {self.shares!r}: a share count must be a positive integer")
        if isinstance(self.shares, str) and self.shares not in ("disabled", "memory", "unlimited"):
            raise ValueError(f"--consumable-shares {self.shares!r}: disabled, memory, unlimited or a count")

    @property
    def shareable(self) -> bool:
        """Whether the driver publishes the devices with ``allowMultipleAllocations: true``."""
        return self.shares != "disabled"


def dra_node(
    name: str, model: GPUModel | str, gpus: int = 1, shares: ConsumableShares = "memory", **options: Any
) -> DraNodeSpec:
    """A node with ``gpus`` GPUs of ``model`` under ``--consumable-shares=<shares>``."""
    return DraNodeSpec(name=name, model=gpu_model(model), gpus=gpus, shares=shares, **options)


# --------------------------------------------------------------------------- the Node


def node_manifest(spec: DraNodeSpec) -> dict[str, Any]:
    """The Node as created: the kubelet's well-known labels, no GPU Feature Discovery label."""
    labels = {
        "kubernetes.io/hostname": spec.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        **spec.extra_labels,
    }
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": spec.name, "labels": labels},
        "spec": {},
    }
    if spec.taints:
        body["spec"]["taints"] = [dict(taint) for taint in spec.taints]
    return body


def node_status(spec: DraNodeSpec) -> dict[str, Any]:
    """A kubelet's status without a device plugin: cpu, memory and pods, no ``nvidia.com/gpu``."""
    status = gpu_nodes.cpu_node_status(spec.name, cpu=spec.cpu, memory=spec.memory, pods=spec.pods)
    status["nodeInfo"] = {"kubeletVersion": "v1.36.3", "operatingSystem": "linux", "architecture": "amd64"}
    return status


# --------------------------------------------------------------------------- the ResourceSlice


def gpu_uuid(node: str, minor: int) -> str:
    """A stable NVML-style UUID for GPU ``minor`` of ``node`` (``GPU-xxxxxxxx-...``)."""
    return "GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f"{node}.gpu-{minor}.vramguard.e2e"))


def memory_capacity(spec: DraNodeSpec) -> dict[str, Any]:
    """``capacity.memory`` of one GPU, with the request policy of the sharing mode."""
    # NVML totals are whole MiB for every model here, so rounding down to the 1Mi step changes nothing.
    total = f"{spec.model.memory_mib}Mi"
    if spec.shares == "disabled":
        return {"value": total}
    step = "1Mi"
    if spec.shares == "memory":
        policy = {"default": total, "validRange": {"min": step, "max": total, "step": step}}
    else:
        policy = {"default": "0", "validRange": {"min": "0", "max": total, "step": step}}
    return {"value": total, "requestPolicy": policy}


def gpu_device(spec: DraNodeSpec, minor: int) -> dict[str, Any]:
    """Device ``gpu-<minor>`` as the kubelet plugin publishes it."""
    major, minor_cc = spec.model.compute
    device: dict[str, Any] = {
        "name": f"gpu-{minor}",
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": gpu_uuid(spec.name, minor)},
            "productName": {"string": spec.model.nvml_name},
            "brand": {"string": "Nvidia"},
            "architecture": {"string": architecture(spec.model)},
            "cudaComputeCapability": {"version": f"{major}.{minor_cc}.0"},
            "driverVersion": {"version": semver(gpu_nodes.DRIVER_VERSION)},
            "cudaDriverVersion": {"version": CUDA_DRIVER_VERSION},
        },
        "capacity": {"memory": memory_capacity(spec)},
    }
    if spec.shareable:
        device["allowMultipleAllocations"] = True
    if isinstance(spec.shares, int):
        count = str(spec.shares)
        device["capacity"]["shares"] = {
            "value": count,
            "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": count, "step": "1"}},
        }
    return device


def resource_slice(spec: DraNodeSpec, node_uid: str | None = None, generation: int = 1) -> dict[str, Any]:
    """The node's ResourceSlice: pool = node name, every GPU a device; owned by the Node when its
    ``node_uid`` is given (the garbage collector then deletes the slice with the Node)."""
    metadata: dict[str, Any] = {"generateName": f"{spec.name}-{DRIVER}-"}
    if node_uid:
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": spec.name, "uid": node_uid, "controller": True}
        ]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": {
            "driver": DRIVER,
            "nodeName": spec.name,
            "pool": {"name": spec.name, "generation": generation, "resourceSliceCount": 1},
            "devices": [gpu_device(spec, minor) for minor in range(spec.gpus)],
        },
    }


# --------------------------------------------------------------------------- class, claims, pods


def device_class(extended_resource: bool = True) -> dict[str, Any]:
    """The driver's ``gpu.nvidia.com`` DeviceClass (with ``extendedResourceName`` as on v1)."""
    spec: dict[str, Any] = {"selectors": [{"cel": {"expression": GPU_SELECTOR}}]}
    if extended_resource:
        spec["extendedResourceName"] = EXTENDED_RESOURCE
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": DEVICE_CLASS}, "spec": spec}


def device_request(memory: str | None = None, name: str = "gpu") -> dict[str, Any]:
    """One request for a full GPU of the driver's class, asking ``memory`` of it when given."""
    exactly: dict[str, Any] = {"deviceClassName": DEVICE_CLASS}
    if memory is not None:
        exactly["capacity"] = {"requests": {"memory": memory}}
    return {"name": name, "exactly": exactly}


def claim_template(name: str, namespace: str, memory: str | None = None) -> dict[str, Any]:
    """A ResourceClaimTemplate as the driver's consumable-shares demos write it (``gpu-4gi``:
    ``capacity.requests.memory``; the unlimited and integer demos: no capacity)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"spec": {"devices": {"requests": [device_request(memory)]}}},
    }


def claim(name: str, namespace: str, memory: str | None = None) -> dict[str, Any]:
    """A ResourceClaim for one GPU (shared by every pod that names it)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [device_request(memory)]}},
    }


def vllm_container(utilization: str, model: str = "Qwen/Qwen2.5-7B-Instruct") -> dict[str, Any]:
    """vLLM as its Kubernetes guide runs it: the OpenAI image, ``vllm serve`` through a shell."""
    return {
        "name": "vllm",
        "image": "vllm/vllm-openai:v0.21.0",
        "command": ["/bin/sh", "-c"],
        "args": [f"vllm serve {model} --trust-remote-code --gpu-memory-utilization {utilization}"],
        "ports": [{"containerPort": 8000}],
        "resources": {"limits": {"cpu": "10", "memory": "20G"}, "requests": {"cpu": "2", "memory": "6G"}},
    }


def vllm_pod(
    name: str,
    utilization: str,
    *,
    template: str | None = None,
    claim_name: str | None = None,
    extended: bool = False,
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A vLLM pod whose GPU comes from a claim template, a named claim, or (``extended``) the
    extended resource ``nvidia.com/gpu`` that the DeviceClass maps to DRA devices."""
    if sum((template is not None, claim_name is not None, extended)) != 1:
        raise ValueError("a vLLM pod gets its GPU from exactly one of a template, a claim or nvidia.com/gpu")
    container = vllm_container(utilization)
    spec: dict[str, Any] = {"containers": [container]}
    if extended:
        container["resources"]["limits"][EXTENDED_RESOURCE] = "1"
    else:
        source = {"resourceClaimTemplateName": template} if template else {"resourceClaimName": claim_name}
        spec["resourceClaims"] = [{"name": "gpu", **source}]
        container["resources"]["claims"] = [{"name": "gpu"}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": dict(labels or {"app": "vllm"})},
        "spec": spec,
    }


# --------------------------------------------------------------------------- API calls


def create_dra_node(request: Request, spec: DraNodeSpec) -> dict[str, Any]:
    """Create the Node, write its status (as a kubelet would), then publish its ResourceSlice
    (as the driver's kubelet plugin would); returns the slice as the API server has it."""
    node = dict(request("POST", "/api/v1/nodes", node_manifest(spec)))
    # Like a kubelet: the status goes through the status subresource (a PUT of the whole Node).
    node["status"] = node_status(spec)
    request("PUT", f"/api/v1/nodes/{spec.name}/status", node)
    return dict(request("POST", f"{RESOURCE_API}/resourceslices", resource_slice(spec, node["metadata"]["uid"])))


def ensure_device_class(request: Request, extended_resource: bool = True) -> None:
    """Create the driver's DeviceClass unless it exists."""
    try:
        request("POST", f"{RESOURCE_API}/deviceclasses", device_class(extended_resource))
    except Exception as error:  # urllib's HTTPError: 409 means it is there already
        if getattr(error, "code", None) != 409:
            raise


def node_claims(request: Request, node: str) -> list[dict[str, Any]]:
    """Every allocated claim whose devices come from ``node``'s pool, as the API server has them."""
    claims = request("GET", f"{RESOURCE_API}/resourceclaims", None)["items"]
    return [c for c in claims if any(r.get("pool") == node for r in allocation_results(c))]


def allocation_results(claim_object: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``status.allocation.devices.results`` of a claim (empty while it is not allocated)."""
    allocation = (claim_object.get("status") or {}).get("allocation") or {}
    return list((allocation.get("devices") or {}).get("results") or [])
