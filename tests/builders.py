"""Builders of the Kubernetes objects the tests feed vramguard: GPU nodes and vLLM pods.

Pod specs with arbitrary containers are built with :mod:`tests.podspecs`.
"""

from __future__ import annotations

from typing import Any

from tests.podspecs import container

H100_MIB = 81559


def gpu_node(name: str, gpus: int = 1, replicas: int = 4, memory_mib: int = H100_MIB,
             product: str = "NVIDIA-H100-80GB-HBM3", sharing: str = "time-slicing",
             *, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A Node as the device plugin and GPU Feature Discovery present it (``labels``: more labels)."""
    extra = labels or {}
    labels = {
        "nvidia.com/gpu.count": str(gpus),
        "nvidia.com/gpu.memory": str(memory_mib),
        "nvidia.com/gpu.product": product + ("-SHARED" if sharing != "none" else ""),
        "nvidia.com/gpu.replicas": str(replicas),
        "nvidia.com/gpu.sharing-strategy": sharing,
        **extra,
    }
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": str(gpus * replicas)}
    return {"metadata": {"name": name, "labels": labels},
            "status": {"capacity": capacity, "allocatable": capacity}}


def vllm_pod(name: str, utilization: str, node: str | None = None, namespace: str = "default",
             gpus: int = 1, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A vLLM pod for vramguard's scheduler asking for ``gpus`` GPUs (bound when ``node`` is given)."""
    args = ["--model", "m", "--gpu-memory-utilization", utilization]
    if gpus > 1:
        args += ["-tp", str(gpus)]
    spec: dict[str, Any] = {"containers": [container(name="vllm", image="vllm/vllm-openai:v0.21.0",
                                                     args=args, gpus=gpus)],
                            "schedulerName": "vramguard"}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "labels": labels or {},
                         "resourceVersion": "1"},
            "spec": spec, "status": {"phase": "Running" if node else "Pending"}}
