"""The NVIDIA DRA driver's sharing settings in a claim's opaque configuration.

A claim (or claim template) may carry ``spec.devices.config[]`` entries whose ``opaque`` parameters
are the driver's ``GpuConfig`` (NVIDIA/k8s-dra-driver-gpu v0.4.0,
``api/nvidia.com/resource/v1beta1/sharing.go``; ``demo/specs/quickstart/v1/gpu-test-mps.yaml``)::

    - requests: [gpu]                # the requests it applies to; every request when absent
      opaque:
        driver: gpu.nvidia.com
        parameters:
          apiVersion: resource.nvidia.com/v1beta1
          kind: GpuConfig
          sharing:
            strategy: MPS
            mpsConfig:
              defaultActiveThreadPercentage: 50
              defaultPinnedDeviceMemoryLimit: 10Gi
              defaultPerDevicePinnedMemoryLimit: {"0": 5Gi}   # by GPU UUID or index in the claim

The driver starts an MPS control daemon for the claim and sets those limits as the daemon's defaults
(``set_default_device_pinned_mem_limit <uuid> <MiB>M``, rounded down to MiB), which bind every client
process of the containers using the request; it sets no variable in the containers. So they read as
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` would: a limit per
process, the largest of the per-device ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vramguard.dra.fields import integer, items, mapping, quantity_bytes, text
from vramguard.quantity import MiB

__all__ = ["DRIVER", "MpsDefaults", "read_mps_configs"]

DRIVER = "gpu.nvidia.com"
MAX_CONFIGS = 32


@dataclass(frozen=True, slots=True)
class MpsDefaults:
    """The MPS limits a claim's configuration sets for the processes of the containers using it."""

    pinned_mib: int | None = None
    """The largest per-device pinned memory limit, in whole MiB."""
    thread_percentage: int | None = None

    def env(self, devices: int) -> list[dict[str, str]]:
        """The limits as the client variables that would set them, for ``devices`` devices."""
        found = []
        if self.pinned_mib is not None:
            limit = ",".join(f"{index}={self.pinned_mib}M" for index in range(max(devices, 1)))
            found.append({"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": limit})
        if self.thread_percentage is not None:
            found.append({"name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "value": str(self.thread_percentage)})
        return found


def read_mps_configs(spec: Mapping[str, Any], where: str, notes: list[str]) -> dict[str | None, MpsDefaults]:
    """The MPS settings by request name (``None``: every request) of a claim spec's configuration."""
    found: dict[str | None, MpsDefaults] = {}
    for raw in items(mapping(spec.get("devices")).get("config"))[:MAX_CONFIGS]:
        entry = mapping(raw)
        opaque = mapping(entry.get("opaque"))
        parameters = mapping(opaque.get("parameters"))
        if opaque.get("driver") != DRIVER or parameters.get("kind") != "GpuConfig":
            continue
        sharing = mapping(parameters.get("sharing"))
        if sharing.get("strategy") != "MPS":
            continue
        defaults = _mps(mapping(sharing.get("mpsConfig")), f"{where} GpuConfig mpsConfig", notes)
        names: list[str | None] = [n for n in (text(r) for r in items(entry.get("requests"))) if n]
        for name in names or [None]:
            found[name] = defaults
    return found


def _mps(config: Mapping[str, Any], where: str, notes: list[str]) -> MpsDefaults:
    limits: list[int] = []
    if config.get("defaultPinnedDeviceMemoryLimit") is not None:
        key = "defaultPinnedDeviceMemoryLimit"
        value = quantity_bytes(config[key], f"{where}.{key}", notes)
        if value is not None:
            limits.append(value)
    for key, raw in list(mapping(config.get("defaultPerDevicePinnedMemoryLimit")).items())[:64]:
        value = quantity_bytes(raw, f"{where}.defaultPerDevicePinnedMemoryLimit[{key}]", notes)
        if value is not None:
            limits.append(value)
    pinned = max(limits) // MiB if limits else None
    if pinned == 0:
        notes.append(f"{where}: a pinned memory limit under 1Mi; the driver refuses it")
        pinned = None
    percentage = integer(config.get("defaultActiveThreadPercentage"))
    if percentage is not None and not 0 < percentage <= 100:
        notes.append(f"{where}.defaultActiveThreadPercentage {percentage} is not in 1..100; ignored")
        percentage = None
    return MpsDefaults(pinned, percentage)
