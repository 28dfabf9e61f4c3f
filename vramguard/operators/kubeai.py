"""KubeAI's ``Model`` (``kubeai.org/v1``): one pod per replica, its container ``server``.

From KubeAI's source (substratusai/kubeai, v0.21.0):

- ``spec.resourceProfile`` is ``<profile>:<N>``; every request and limit of the profile is
  multiplied by N (``internal/modelcontroller/model_controller.go``, ``getModelConfig``). The chart's
  profiles (``charts/kubeai/values.yaml``, ``resourceProfiles``) each give one ``nvidia.com/gpu``
  (``amd.com/gpu`` for ``amd-gpu-mi300x``) per unit; ``cpu`` and the TPU profiles give no GPU.
- vLLM (``spec.engine: VLLM``, and any unknown engine) runs
  ``python3 -m vllm.entrypoints.openai.api_server --model=... --served-model-name=<name>`` followed by
  ``spec.args`` verbatim (``internal/modelcontroller/engine_vllm.go``): KubeAI sets neither
  ``--gpu-memory-utilization`` nor ``--tensor-parallel-size``. OLlama, FasterWhisper and Infinity
  take ``spec.args`` as their arguments; their VRAM is not known.
- The image is ``spec.image``, else the chart's image for the profile's ``imageName``
  (``modelServers``: ``vllm/vllm-openai:v0.8.3`` for ``nvidia-gpu``).
- ``spec.env`` is a mapping; pods number ``spec.replicas`` within ``minReplicas``..``maxReplicas``
  (``pod_plan.go``); at full scale, ``maxReplicas``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vramguard.operators.common import count, env_entries, full_scale, mapping, pod, string, words
from vramguard.template_part import TemplatePart

__all__ = ["PROFILES", "model_parts"]

PROFILES: Mapping[str, tuple[str | None, str]] = {
    "cpu": (None, "cpu"),
    "nvidia-gpu-t4": ("nvidia.com/gpu", "nvidia-gpu"),
    "nvidia-gpu-l4": ("nvidia.com/gpu", "nvidia-gpu"),
    "nvidia-gpu-l40s": ("nvidia.com/gpu", "nvidia-gpu"),
    "nvidia-gpu-h100": ("nvidia.com/gpu", "nvidia-gpu"),
    "nvidia-gpu-gh200": ("nvidia.com/gpu", "gh200"),
    "nvidia-gpu-a100-80gb": ("nvidia.com/gpu", "nvidia-gpu"),
    "nvidia-gpu-a100-40gb": ("nvidia.com/gpu", "nvidia-gpu"),
    "nvidia-gpu-a16": ("nvidia.com/gpu", "nvidia-gpu"),
    "nvidia-gpu-rtx4070-8gb": ("nvidia.com/gpu", "nvidia-gpu"),
    "amd-gpu-mi300x": ("amd.com/gpu", "amd-gpu"),
}
"""The chart's resource profiles: the GPU resource each gives per unit, and its image name."""
VLLM_IMAGES = {
    "nvidia-gpu": "vllm/vllm-openai:v0.8.3",
    "gh200": "substratusai/vllm-gh200:v0.8.3",
    "amd-gpu": "substratusai/vllm-rocm:nightly_main_20250120",
    "cpu": "substratusai/vllm:v0.6.3.post1-cpu",
}
VLLM_COMMAND = ["python3", "-m", "vllm.entrypoints.openai.api_server"]
OTHER_ENGINES = {"OLlama": "ollama/ollama:latest", "FasterWhisper": "fedirz/faster-whisper-server:latest-cuda",
                 "Infinity": "michaelf34/infinity:latest"}


def model_parts(obj: Mapping[str, Any], notes: list[str]) -> list[TemplatePart]:
    """The pods of a KubeAI ``Model`` (notes: what was assumed)."""
    spec = mapping(obj.get("spec"))
    name = string(mapping(obj.get("metadata")).get("name")) or "model"
    resources, image_name = _profile(string(spec.get("resourceProfile")), notes)
    engine = string(spec.get("engine")) or "VLLM"
    args = words(spec.get("args"))
    container: dict[str, Any] = {"name": "server", "env": env_entries(spec.get("env")), "resources": resources}
    if engine in OTHER_ENGINES:
        container["image"] = string(spec.get("image")) or OTHER_ENGINES[engine]
        container["args"] = ["v2", *args] if engine == "Infinity" else args
    else:
        container["image"] = string(spec.get("image")) or VLLM_IMAGES.get(image_name, VLLM_IMAGES["nvidia-gpu"])
        container["command"] = VLLM_COMMAND
        container["args"] = [f"--model={_model(spec)}", f"--served-model-name={name}", *args]
    if spec.get("autoscalingDisabled") is True:
        pods = count(spec.get("replicas")) or 1
    else:
        pods = full_scale(spec.get("maxReplicas"), spec.get("replicas"), spec.get("minReplicas"))
    return [TemplatePart("model", pod(obj, [container]), pods)]


def _profile(text: str | None, notes: list[str]) -> tuple[dict[str, Any], str]:
    """The container's resources for ``<profile>:<N>``, and the profile's image name."""
    profile, _, multiple_text = (text or "").partition(":")
    multiple = count(multiple_text)
    if not profile or multiple is None:
        notes.append(f"resourceProfile {text!r} is not <profile>:<count>: KubeAI refuses the Model")
        return {}, "nvidia-gpu"
    known = PROFILES.get(profile)
    if known is None:
        if "gpu" not in profile:
            notes.append(f"resourceProfile {profile} is not one of KubeAI's chart profiles: counted as no GPU")
            return {}, "nvidia-gpu"
        assumed = "amd.com/gpu" if profile.startswith("amd") else "nvidia.com/gpu"
        notes.append(
            f"resourceProfile {profile} is not one of KubeAI's chart profiles: counted as {multiple} {assumed} "
            "(as the chart's GPU profiles give one per unit)"
        )
        known = (assumed, "nvidia-gpu")
    resource, image_name = known
    if resource is None or multiple == 0:
        return {}, image_name
    return {"limits": {resource: multiple}, "requests": {resource: multiple}}, image_name


def _model(spec: Mapping[str, Any]) -> str:
    url = string(spec.get("url")) or ""
    scheme, _, rest = url.partition("://")
    if scheme == "pvc":
        return "/model"
    return rest or url or "model"
