"""The vLLM production-stack operator's ``VLLMRuntime`` (``production-stack.vllm.ai/v1alpha1``).

From the operator's source (vllm-project/production-stack, ``operator/``,
``internal/controller/vllmruntime_controller.go``, ``deploymentForVLLMRuntime``): one Deployment of
``deploymentConfig.replicas`` pods (``autoscalingConfig.maxReplicas`` at full scale when enabled),
its container ``vllm`` running ``/opt/venv/bin/vllm serve <modelURL>`` with, among others,
``--tensor-parallel-size`` (``vllmConfig.tensorParallelSize``), ``--gpu_memory_utilization``
(``vllmConfig.gpuMemoryUtilization``, when set), ``--max-model-len`` and then
``vllmConfig.extraArgs``; ``deploymentConfig.resources.gpu`` is its ``nvidia.com/gpu`` (or
``gpuType``) request and limit; the image is ``deploymentConfig.image.registry/name``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramguard.operators.common import count, env_entries, full_scale, mapping, pod, string, words
from vramguard.template_part import TemplatePart

__all__ = ["runtime_parts"]


def runtime_parts(obj: Mapping[str, Any], notes: list[str]) -> list[TemplatePart]:
    """The pods of a ``VLLMRuntime``."""
    spec = mapping(obj.get("spec"))
    model = mapping(spec.get("model"))
    config = mapping(spec.get("vllmConfig"))
    deployment = mapping(spec.get("deploymentConfig"))
    image = mapping(deployment.get("image"))
    port = str(count(config.get("port")) or 8000)
    args = [string(model.get("modelURL")) or "model", "--host", "0.0.0.0", "--port", port]
    for flag, key in (("--max-model-len", "maxModelLen"), ("--tensor-parallel-size", "tensorParallelSize"),
                      ("--max-num-seqs", "maxNumSeqs")):
        value = count(model.get(key) if key != "tensorParallelSize" else config.get(key))
        if value:
            args += [flag, str(value)]
    if string(config.get("gpuMemoryUtilization")):
        args += ["--gpu_memory_utilization", config["gpuMemoryUtilization"]]
    args += words(config.get("extraArgs"))
    resources = mapping(deployment.get("resources"))
    limits: dict[str, Any] = {k: resources[k] for k in ("cpu", "memory") if resources.get(k) is not None}
    if resources.get("gpu") not in (None, ""):
        limits[string(resources.get("gpuType")) or "nvidia.com/gpu"] = resources["gpu"]
    registry, name = string(image.get("registry")), string(image.get("name")) or "vllm/vllm-openai"
    container = {
        "name": "vllm",
        "image": f"{registry}/{name}" if registry else name,
        "command": ["/opt/venv/bin/vllm", "serve"],
        "args": args,
        "env": env_entries(config.get("env")),
        "resources": {"limits": limits, "requests": dict(limits)},
    }
    autoscaling = mapping(spec.get("autoscalingConfig"))
    pods = (
        full_scale(autoscaling.get("maxReplicas"), deployment.get("replicas"))
        if autoscaling.get("enabled") is True
        else full_scale(deployment.get("replicas"))
    )
    return [TemplatePart("deployment", pod(obj, [container]), pods)]
