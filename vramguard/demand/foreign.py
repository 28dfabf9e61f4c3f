"""Other GPU-sharing systems' declarations, read as declarations of the container's VRAM.

Each system names a container's share of a GPU its own way. What they mean, from their source:

- **HAMi** (Project-HAMi/HAMi v2.10.0, ``pkg/device/nvidia/device.go``): ``nvidia.com/gpu`` is the
  number of GPUs; ``nvidia.com/gpumem`` the MiB per GPU, which wins over
  ``nvidia.com/gpumem-percentage``, the percent of each device. HAMi-core (``src/cuda/memory.c``,
  ``src/nvml/hook.c``) reports the cap as the device's total to CUDA and NVML, so an engine's
  fraction (vLLM's ``--gpu-memory-utilization``) is a fraction of the cap; ``CUDA_DISABLE_CONTROL=true``
  turns the cap off (``plugin/server.go``).
- **Volcano vGPU** (volcano v1.15.1, ``pkg/scheduler/api/devices/nvidia/vgpu``, with HAMi-core):
  ``volcano.sh/vgpu-number`` GPUs (1 when only memory is given), ``volcano.sh/vgpu-memory`` MiB per
  GPU, ``volcano.sh/vgpu-memory-percentage`` the percent, which wins here; HAMi-core enforces it
  the same way.
- **gpushare** (AliyunContainerService/gpushare-device-plugin, ``cmd/nvidia/main.go``):
  ``aliyun.com/gpu-mem`` in GiB (the device plugin's default ``--memory-unit``), on one GPU; it
  only schedules, so the engine sees the whole device.
- **KAI scheduler** (NVIDIA/KAI-Scheduler v0.12.17, ``docs/gpu-sharing``): the pod annotations
  ``gpu-fraction`` (0 < f < 1) or ``gpu-memory`` (MiB) per device, on ``gpu-fraction-num-devices``
  devices (1), for the container ``gpu-fraction-container-name`` names (else the first); it only
  schedules ("does not enforce memory allocation limit").

A ``vramguard.io/vram`` declaration wins over these; like it, they count no less than the engine's
own claim.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from vramguard.demand.model import Vram
from vramguard.quantity import GiB, MiB, excerpt

__all__ = ["FOREIGN_RESOURCES", "KAI_ANNOTATIONS", "KAI_CONTAINER", "ForeignShare", "foreign_share", "kai_container"]

FOREIGN_RESOURCES = frozenset({
    "nvidia.com/gpumem", "nvidia.com/gpumem-percentage",
    "volcano.sh/vgpu-number", "volcano.sh/vgpu-memory", "volcano.sh/vgpu-memory-percentage",
    "aliyun.com/gpu-mem",
})
"""Resources whose value is a container's memory share (or GPUs) under another sharing system."""
KAI_FRACTION, KAI_MEMORY, KAI_DEVICES, KAI_CONTAINER = (
    "gpu-fraction", "gpu-memory", "gpu-fraction-num-devices", "gpu-fraction-container-name")
KAI_ANNOTATIONS = frozenset({KAI_FRACTION, KAI_MEMORY})
MAX_MIB = 1 << 33
"""More MiB than any GPU holds (8 PiB): a larger value is not a share."""


@dataclass(frozen=True, slots=True)
class ForeignShare:
    """A container's share of each of its GPUs as another system gives it."""

    system: str
    resource: str
    """The resource that counts its GPUs (the policy's ``nvidia.com/gpu`` under HAMi)."""
    gpus: int
    vram: Vram | None
    """Per GPU: bytes, or a fraction of the device; ``None`` when the value cannot be read."""
    virtual_total: bool
    """The system makes the cap the device's total that the container's processes see."""
    evidence: str
    problem: str | None = None


def foreign_share(
    container: Mapping[str, Any], annotations: Mapping[str, str], kai_target: bool
) -> ForeignShare | None:
    """The share another system gives ``container``; ``kai_target``: the container KAI's pod
    annotations apply to. ``None`` when no system's declaration applies."""
    resources = container.get("resources")
    limits: dict[str, Any] = {}
    if isinstance(resources, Mapping):
        for section in ("requests", "limits"):  # limits last: they win
            values = resources.get(section)
            if isinstance(values, Mapping):
                limits.update({k: v for k, v in values.items() if isinstance(k, str)})
    if limits.keys() & FOREIGN_RESOURCES:
        if "nvidia.com/gpumem" in limits or "nvidia.com/gpumem-percentage" in limits:
            return _hami(limits, container)
        if any(key.startswith("volcano.sh/") for key in limits):
            return _volcano(limits, container)
        return _gpushare(limits)
    if kai_target and annotations.keys() & KAI_ANNOTATIONS:
        return _kai(annotations)
    return None


def kai_container(annotations: Mapping[str, str], names: list[str]) -> str | None:
    """The container KAI's fraction applies to: the one ``gpu-fraction-container-name`` names, else
    the first of ``names`` (the pod's containers in order)."""
    if not annotations.keys() & KAI_ANNOTATIONS:
        return None
    named = annotations.get(KAI_CONTAINER)
    return named if named is not None else (names[0] if names else None)


def _hami(limits: Mapping[str, Any], container: Mapping[str, Any]) -> ForeignShare:
    gpus = _whole(limits.get("nvidia.com/gpu"), 1)
    enforced = not _env_true(container, "CUDA_DISABLE_CONTROL")
    if "nvidia.com/gpumem" in limits:
        return _share("HAMi", "nvidia.com/gpu", gpus, enforced, "nvidia.com/gpumem", limits, MiB)
    return _share("HAMi", "nvidia.com/gpu", gpus, enforced, "nvidia.com/gpumem-percentage", limits, None)


def _volcano(limits: Mapping[str, Any], container: Mapping[str, Any]) -> ForeignShare:
    gpus = _whole(limits.get("volcano.sh/vgpu-number"), 1)
    enforced = not _env_true(container, "CUDA_DISABLE_CONTROL")
    if "volcano.sh/vgpu-memory-percentage" in limits:
        return _share("Volcano vGPU", "volcano.sh/vgpu-number", gpus, enforced,
                      "volcano.sh/vgpu-memory-percentage", limits, None)
    if "volcano.sh/vgpu-memory" in limits:
        return _share("Volcano vGPU", "volcano.sh/vgpu-number", gpus, enforced, "volcano.sh/vgpu-memory", limits, MiB)
    return ForeignShare("Volcano vGPU", "volcano.sh/vgpu-number", gpus, Vram(Fraction(1)), enforced,
                        f"volcano.sh/vgpu-number {gpus} with no memory: the whole of each GPU")


def _gpushare(limits: Mapping[str, Any]) -> ForeignShare:
    return _share("gpushare", "aliyun.com/gpu-mem", 1, False, "aliyun.com/gpu-mem", limits, GiB)


def _kai(annotations: Mapping[str, str]) -> ForeignShare:
    gpus = _whole(annotations.get(KAI_DEVICES), 1)
    if KAI_FRACTION in annotations:
        return _share("KAI scheduler", KAI_FRACTION, gpus, False, KAI_FRACTION, annotations, None, fraction=True)
    return _share("KAI scheduler", KAI_FRACTION, gpus, False, KAI_MEMORY, annotations, MiB)


def _share(
    system: str, resource: str, gpus: int, virtual: bool, key: str, values: Mapping[str, Any], unit: int | None,
    fraction: bool = False,
) -> ForeignShare:
    """The share ``values[key]`` gives: ``unit`` bytes each, a percent (``unit`` ``None``), or a
    fraction of the device."""
    raw = values.get(key)
    text = excerpt(str(raw), quote=False)
    evidence = f"{key} {text}" + (" (the cap the container's processes see as the device's total)" if virtual else "")
    vram: Vram | None = None
    if fraction:
        share = _fraction(raw)
        vram = Vram(share) if share is not None and 0 < share < 1 else None
        problem = None if vram is not None else f"{system}: {key}={text} is not a fraction in (0, 1)"
    elif unit is None:
        percent = _whole(raw, 0)
        vram = Vram(Fraction(percent, 100)) if 0 < percent <= 100 else None
        problem = None if vram is not None else f"{system}: {key}={text} is not a percent in 1..100"
    else:
        amount = _whole(raw, 0)
        vram = Vram(bytes=amount * unit) if 0 < amount * unit <= MAX_MIB * MiB else None
        problem = None if vram is not None else f"{system}: {key}={text} is not a positive whole number"
    return ForeignShare(system, resource, gpus, vram, virtual, evidence, problem)


def _whole(raw: Any, default: int) -> int:
    if raw is None:
        return default
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw if raw >= 0 else -1
    if isinstance(raw, str) and raw.strip().isascii() and raw.strip().isdigit() and len(raw) <= 12:
        return int(raw.strip())
    return -1


def _fraction(raw: Any) -> Fraction | None:
    if not isinstance(raw, str | int | float) or isinstance(raw, bool) or len(str(raw)) > 32:
        return None
    try:
        return Fraction(str(raw).strip())
    except (ValueError, ZeroDivisionError):
        return None


def _env_true(container: Mapping[str, Any], name: str) -> bool:
    env = container.get("env")
    return isinstance(env, list) and any(
        isinstance(e, Mapping) and e.get("name") == name and str(e.get("value", "")).lower() == "true" for e in env
    )
