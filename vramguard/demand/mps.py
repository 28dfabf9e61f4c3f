"""CUDA MPS client limits: ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``.

The memory limit is ``<device>=<amount><M|G>`` entries separated by commas (``0=16G``,
``0=12288M,1=8G``); the device is an index or a GPU UUID (or its prefix); ``M`` is MiB and ``G`` GiB.
It is enforced only where an MPS server runs; on a time-sliced node it is a declaration.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vramguard.demand.commandline import ContainerEnv
from vramguard.engines.base import Findings, parse_fraction
from vramguard.quantity import QuantityError, excerpt, parse_bytes

MEM_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
THREAD_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
_ENTRY = re.compile(r"^\s*(?P<device>[A-Za-z0-9-]+)\s*=\s*(?P<amount>\d+)\s*(?P<unit>[MG])B?\s*$", re.ASCII)
_UNITS = {"M": "Mi", "G": "Gi"}
"""The units as quantity suffixes, so that one parser bounds the amount."""


@dataclass(frozen=True, slots=True)
class MpsSettings:
    """The MPS limits a container asks for."""

    limit_bytes: int | None = None
    """The largest per-device pinned memory limit."""
    sm_percent: int | None = None


NO_MPS = MpsSettings()


def read_mps(env: ContainerEnv, gpus: int, found: Findings) -> MpsSettings:
    """Read both MPS variables from the container's environment, recording evidence and errors."""
    if MEM_LIMIT not in env.values and THREAD_PERCENTAGE not in env.values:
        return NO_MPS  # the common case: neither is set
    return MpsSettings(_memory_limit(env, gpus, found), _thread_percentage(env, found))


def _memory_limit(env: ContainerEnv, gpus: int, found: Findings) -> int | None:
    entry = env.values.get(MEM_LIMIT)
    if entry is None:
        return None
    if entry.value is None:
        found.warn(f"{MEM_LIMIT} comes from {entry.source}, which vramguard cannot read")
        return None
    limits: dict[str, int] = {}
    for part in entry.value.split(","):
        if not part.strip():
            continue
        match = _ENTRY.match(part)
        if match is None:
            found.error(
                f"{MEM_LIMIT}={excerpt(entry.value, quote=False)}: {excerpt(part.strip())} is not <device>=<amount>M|G "
                "(for example 0=16G or 0=12288M)"
            )
            return None
        try:
            amount = parse_bytes(match["amount"] + _UNITS[match["unit"]])
        except QuantityError as exc:  # more than a quantity of bytes may name
            found.error(f"{MEM_LIMIT}: {exc}")
            return None
        if amount == 0:
            found.error(f"{MEM_LIMIT}={excerpt(entry.value, quote=False)}: a limit of 0 leaves no memory")
            return None
        limits[match["device"]] = amount
    if not limits:
        found.error(f"{MEM_LIMIT} is empty")
        return None
    found.evidence.append(f"env {MEM_LIMIT}={excerpt(entry.value, quote=False)}")
    indexed = [device for device in limits if device.isdigit()]
    missing = [str(i) for i in range(gpus) if str(i) not in limits]
    if indexed and len(limits) == len(indexed) and missing:
        found.warn(f"{MEM_LIMIT} sets no limit for device(s) {', '.join(missing)} of its {gpus} GPU(s)")
    return max(limits.values())


def _thread_percentage(env: ContainerEnv, found: Findings) -> int | None:
    entry = env.values.get(THREAD_PERCENTAGE)
    if entry is None:
        return None
    if entry.value is None:
        found.warn(f"{THREAD_PERCENTAGE} comes from {entry.source}, which vramguard cannot read")
        return None
    value = parse_fraction(entry.value)
    if value is None or not 0 < value <= 100:
        found.error(f"{THREAD_PERCENTAGE}={excerpt(entry.value, quote=False)} is not a percentage in (0, 100]")
        return None
    found.evidence.append(f"env {THREAD_PERCENTAGE}={excerpt(entry.value, quote=False)}")
    return max(1, int(value))
