"""What NVML says about the node's GPUs, read call by call so that one failure costs one fact.

:class:`Nvml` is the handful of NVML calls the agent makes, as a Protocol: :class:`PynvmlBackend`
implements it over ``pynvml`` (nvidia-ml-py), and :class:`agent.recorded.RecordedNvml` replays a
recorded snapshot in tests. :func:`take_snapshot` turns the calls into typed, immutable
dataclasses. Every call is guarded on its own: a GPU that fell off the bus (``GPU_IS_LOST``), a
query the driver does not support (``NOT_SUPPORTED``) or any other NVML error leaves that one
field ``None`` and records an :class:`NvmlProblem`; the rest of the snapshot is still taken.

Units: bytes throughout. NVML's ``memorySizeMB`` attribute is MiB.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

__all__ = [
    "DeviceAttributes",
    "GpuSnapshot",
    "MemoryInfo",
    "MigInstance",
    "Nvml",
    "NvmlProblem",
    "NvmlUnavailable",
    "ProcessUsage",
    "PynvmlBackend",
    "Snapshot",
    "mig_profile_from_attributes",
    "mig_profile_from_name",
    "take_snapshot",
]

T = TypeVar("T")
Handle = Any
"""An opaque device handle: whatever the backend hands out and takes back."""

_MiB = 1 << 20
_GiB = 1 << 30
# MIG device names end in the profile: "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "... MIG 1c.2g.20gb",
# "... MIG 1g.10gb+me".
_MIG_NAME = re.compile(r"\bMIG\s+(?P<profile>(?:\d+c\.)?\d+g\.\d+gb(?:\+\S+)?)\s*$")


class NvmlUnavailable(Exception):
    """NVML cannot be used at all (no driver library, init failed): nothing can be measured."""


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    """A device's memory as NVML reports it, in bytes."""

    total: int
    used: int
    """Memory allocated by processes and contexts; excludes what the driver reserves (NVML v2)."""
    reserved: int | None = None
    """Memory the driver keeps for itself; ``None`` where only the v1 query works (then ``used``
    includes it)."""


@dataclass(frozen=True, slots=True)
class DeviceAttributes:
    """The few MIG device attributes used to name a profile when the device name does not."""

    gpu_instance_slices: int
    compute_instance_slices: int
    memory_bytes: int


@dataclass(frozen=True, slots=True)
class ProcessUsage:
    """A compute process on a device."""

    pid: int
    """As NVML reports it: a PID of the host's PID namespace."""
    used_bytes: int | None
    """``None`` when NVML cannot tell (e.g. no permission to see the process's usage)."""


@dataclass(frozen=True, slots=True)
class NvmlProblem:
    """One NVML call that failed, for logs, metrics and the ``snapshot`` command's output."""

    where: str
    """``gpu 0``, ``gpu 0 mig 3``, or ``node``."""
    call: str
    error: str


@dataclass(frozen=True, slots=True)
class MigInstance:
    """A MIG device (GPU instance + compute instance) on a MIG-enabled GPU."""

    index: int
    """Its position among the parent GPU's MIG devices (``nvmlDeviceGetMigDeviceHandleByIndex``)."""
    uuid: str | None
    profile: str | None
    """The device plugin's name for it: ``1g.10gb``, ``3g.71gb``, ``1c.2g.20gb``."""
    gpu_instance_id: int | None
    memory: MemoryInfo | None
    processes: tuple[ProcessUsage, ...] | None
    """``None`` when unknown (the call failed); empty when nothing runs."""


@dataclass(frozen=True, slots=True)
class GpuSnapshot:
    """One physical GPU; ``None`` in a field means NVML could not say."""

    index: int
    uuid: str | None
    name: str | None
    memory: MemoryInfo | None
    mig_enabled: bool | None
    """Current MIG mode; ``False`` also where the GPU does not support MIG."""
    mig_instances: tuple[MigInstance, ...] = ()
    processes: tuple[ProcessUsage, ...] | None = None
    """Compute processes on the whole GPU (not collected for MIG-enabled GPUs: see the instances)."""
    lost: bool = False
    """NVML said the GPU is lost (fell off the bus) or needs a reset: every fact may be stale."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every GPU NVML sees on the node, and what could not be read."""

    driver_version: str | None
    gpus: tuple[GpuSnapshot, ...]
    problems: tuple[NvmlProblem, ...] = ()
    complete: bool = True
    """``False`` when the GPU count itself is unknown, so GPUs may be missing."""


class Nvml(Protocol):
    """The NVML calls the agent makes. Each raises on failure (``pynvml.NVMLError_*`` for pynvml)."""

    def init(self) -> None:
        """Load and initialise the library; raise :class:`NvmlUnavailable` when it cannot."""

    def shutdown(self) -> None:
        """Release the library."""

    def driver_version(self) -> str:
        """The kernel driver's version string."""

    def device_count(self) -> int:
        """How many GPUs NVML sees."""

    def device_handle(self, index: int) -> Handle:
        """The handle of GPU ``index``."""

    def uuid(self, handle: Handle) -> str:
        """``GPU-…`` or ``MIG-…``."""

    def name(self, handle: Handle) -> str:
        """Product name: ``NVIDIA H100 80GB HBM3`` (a MIG device: ``… MIG 1g.10gb``)."""

    def memory(self, handle: Handle) -> MemoryInfo:
        """Total, used and reserved memory of a GPU or MIG device."""

    def mig_enabled(self, handle: Handle) -> bool:
        """The current MIG mode (``NOT_SUPPORTED`` on GPUs without MIG)."""

    def max_mig_devices(self, handle: Handle) -> int:
        """How many MIG device slots the GPU has."""

    def mig_device_handle(self, handle: Handle, index: int) -> Handle:
        """The MIG device in slot ``index`` (``NOT_FOUND`` for an empty slot)."""

    def gpu_instance_id(self, handle: Handle) -> int:
        """The GPU instance id of a MIG device."""

    def attributes(self, handle: Handle) -> DeviceAttributes:
        """Slices and memory of a MIG device."""

    def compute_processes(self, handle: Handle) -> Sequence[ProcessUsage]:
        """Compute processes running on a GPU or MIG device."""

    def error_name(self, error: Exception) -> str | None:
        """A short name for one of the library's errors (``GPU_IS_LOST``); ``None`` for others."""


def take_snapshot(nvml: Nvml) -> Snapshot:
    """Read every GPU through ``nvml`` (already initialised); never raises for an NVML error."""
    problems: list[NvmlProblem] = []
    reader = _Reader(nvml, problems)
    driver = reader.call("node", "driver_version", nvml.driver_version)
    count = reader.call("node", "device_count", nvml.device_count)
    if count is None:
        return Snapshot(driver, (), tuple(problems), complete=False)
    gpus = tuple(_read_gpu(nvml, reader, index) for index in range(count))
    return Snapshot(driver, gpus, tuple(problems))


def _read_gpu(nvml: Nvml, reader: _Reader, index: int) -> GpuSnapshot:
    where = f"gpu {index}"
    reader.lost = False
    handle = reader.call(where, "device_handle", partial(nvml.device_handle, index))
    if handle is None:
        return GpuSnapshot(index, None, None, None, None, lost=reader.lost)
    uuid = reader.call(where, "uuid", partial(nvml.uuid, handle))
    name = reader.call(where, "name", partial(nvml.name, handle))
    memory = reader.call(where, "memory", partial(nvml.memory, handle))
    # GPUs without MIG answer NOT_SUPPORTED: that is a "no", not a problem worth reporting.
    mig = reader.call(where, "mig_enabled", partial(nvml.mig_enabled, handle), not_supported=False)
    instances: tuple[MigInstance, ...] = ()
    processes: tuple[ProcessUsage, ...] | None = None
    if mig:
        instances = _read_mig(nvml, reader, handle, index, memory)
    else:
        found = reader.call(where, "compute_processes", partial(nvml.compute_processes, handle))
        processes = tuple(found) if found is not None else None
    return GpuSnapshot(index, uuid, name, memory, mig, instances, processes, lost=reader.lost)


def _read_mig(
    nvml: Nvml, reader: _Reader, parent: Handle, gpu: int, parent_memory: MemoryInfo | None
) -> tuple[MigInstance, ...]:
    slots = reader.call(f"gpu {gpu}", "max_mig_devices", partial(nvml.max_mig_devices, parent))
    instances: list[MigInstance] = []
    for slot in range(slots or 0):
        where = f"gpu {gpu} mig {slot}"
        # Empty slots answer NOT_FOUND (or INVALID_ARGUMENT on some drivers): not a problem.
        handle = reader.call(
            where, "mig_device_handle", partial(nvml.mig_device_handle, parent, slot),
            quiet=("NOT_FOUND", "INVALID_ARGUMENT"),
        )
        if handle is None:
            continue
        uuid = reader.call(where, "uuid", partial(nvml.uuid, handle))
        name = reader.call(where, "name", partial(nvml.name, handle))
        profile = mig_profile_from_name(name) if name else None
        if profile is None and parent_memory is not None:
            attributes = reader.call(where, "attributes", partial(nvml.attributes, handle))
            if attributes is not None:
                profile = mig_profile_from_attributes(attributes, parent_memory.total)
        instance_id = reader.call(where, "gpu_instance_id", partial(nvml.gpu_instance_id, handle))
        memory = reader.call(where, "memory", partial(nvml.memory, handle))
        found = reader.call(where, "compute_processes", partial(nvml.compute_processes, handle))
        instances.append(MigInstance(
            slot, uuid, profile, instance_id, memory, tuple(found) if found is not None else None
        ))
    return tuple(instances)


def mig_profile_from_name(name: str) -> str | None:
    """``NVIDIA H100 80GB HBM3 MIG 1g.10gb`` -> ``1g.10gb``; ``None`` when the name carries none."""
    match = _MIG_NAME.search(name)
    return match["profile"] if match else None


def mig_profile_from_attributes(attributes: DeviceAttributes, parent_total: int) -> str:
    """The profile name NVIDIA's tools derive from a MIG device's slices and memory.

    The memory part is the instance's share of the GPU rounded up to eighths, times the GPU's
    size in whole GiB, rounded: a 9984 MiB instance of an 80 GiB H100 is ``1g.10gb``. Only used
    when the device's name carries no profile.
    """
    share = math.ceil(attributes.memory_bytes / parent_total * 8) / 8 if parent_total > 0 else 0.0
    # Halves round up (Go's math.Round), not to even: H200's half GPU is 3g.71gb (141 GiB / 2).
    gigabytes = math.floor(share * math.ceil(parent_total / _GiB) + 0.5)
    gpu_part = f"{attributes.gpu_instance_slices}g.{gigabytes}gb"
    if attributes.compute_instance_slices not in (0, attributes.gpu_instance_slices):
        return f"{attributes.compute_instance_slices}c.{gpu_part}"
    return gpu_part


class _Reader:
    """Runs one NVML call, turning its error into an :class:`NvmlProblem` and a ``None``."""

    _LOST = frozenset({"GPU_IS_LOST", "RESET_REQUIRED"})

    def __init__(self, nvml: Nvml, problems: list[NvmlProblem]) -> None:
        self.nvml = nvml
        self.problems = problems
        self.lost = False
        """Whether a call for the current GPU said the GPU is lost."""

    def call(
        self,
        where: str,
        call: str,
        function: Callable[[], T],
        *,
        not_supported: T | None = None,
        quiet: tuple[str, ...] = (),
    ) -> T | None:
        try:
            return function()
        except Exception as exc:
            # Any error, not only the library's: one bad answer must not stop the agent's loop.
            name = self.nvml.error_name(exc)
            if name == "NOT_SUPPORTED" and not_supported is not None:
                return not_supported
            if name in quiet:
                return None
            if name in self._LOST:
                self.lost = True
            self.problems.append(NvmlProblem(where, call, name or f"{type(exc).__name__}: {exc}"))
            return None


class PynvmlBackend:
    """:class:`Nvml` over ``pynvml`` (the ``nvidia-ml-py`` package), loaded on :meth:`init`."""

    def __init__(self) -> None:
        """Import nothing yet: the module is loaded by :meth:`init`, so tests never need it."""
        self._nvml: Any = None
        self._error_names: dict[int, str] = {}

    def init(self) -> None:
        """Load libnvidia-ml and initialise it; :class:`NvmlUnavailable` when either fails."""
        try:
            import pynvml  # noqa: PLC0415 - only the running agent needs the library
        except ImportError as exc:
            raise NvmlUnavailable(f"pynvml is not installed: {exc}") from exc
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML initialisation failed: {exc}") from exc
        self._nvml = pynvml
        # NVML_ERROR_GPU_IS_LOST -> "GPU_IS_LOST", for problems that read the same on every driver.
        self._error_names = {
            getattr(pynvml, n): n.removeprefix("NVML_ERROR_")
            for n in dir(pynvml)
            if n.startswith("NVML_ERROR_") and isinstance(getattr(pynvml, n), int)
        }

    def shutdown(self) -> None:
        """Release the library; errors on the way out are of no interest."""
        if self._nvml is not None:
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()
            self._nvml = None

    def driver_version(self) -> str:
        """The kernel driver's version string."""
        return str(self._nvml.nvmlSystemGetDriverVersion())

    def device_count(self) -> int:
        """How many GPUs NVML sees."""
        return int(self._nvml.nvmlDeviceGetCount())

    def device_handle(self, index: int) -> Handle:
        """The handle of GPU ``index``."""
        return self._nvml.nvmlDeviceGetHandleByIndex(index)

    def uuid(self, handle: Handle) -> str:
        """``GPU-…`` or ``MIG-…``."""
        return str(self._nvml.nvmlDeviceGetUUID(handle))

    def name(self, handle: Handle) -> str:
        """Product name."""
        return str(self._nvml.nvmlDeviceGetName(handle))

    def memory(self, handle: Handle) -> MemoryInfo:
        """Memory through the v2 query (which separates the driver's reserve), else v1."""
        nvml = self._nvml
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
            return MemoryInfo(int(info.total), int(info.used), int(info.reserved))
        except nvml.NVMLError as exc:
            # Old drivers and MIG devices on some drivers only know v1.
            if self.error_name(exc) not in ("NOT_SUPPORTED", "FUNCTION_NOT_FOUND", "ARGUMENT_VERSION_MISMATCH"):
                raise
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
        return MemoryInfo(int(info.total), int(info.used))

    def mig_enabled(self, handle: Handle) -> bool:
        """The current MIG mode."""
        current, _pending = self._nvml.nvmlDeviceGetMigMode(handle)
        return bool(current == self._nvml.NVML_DEVICE_MIG_ENABLE)

    def max_mig_devices(self, handle: Handle) -> int:
        """How many MIG device slots the GPU has."""
        return int(self._nvml.nvmlDeviceGetMaxMigDeviceCount(handle))

    def mig_device_handle(self, handle: Handle, index: int) -> Handle:
        """The MIG device in slot ``index``."""
        return self._nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)

    def gpu_instance_id(self, handle: Handle) -> int:
        """The GPU instance id of a MIG device."""
        return int(self._nvml.nvmlDeviceGetGpuInstanceId(handle))

    def attributes(self, handle: Handle) -> DeviceAttributes:
        """Slices and memory of a MIG device."""
        found = self._nvml.nvmlDeviceGetAttributes(handle)
        return DeviceAttributes(
            int(found.gpuInstanceSliceCount), int(found.computeInstanceSliceCount), int(found.memorySizeMB) * _MiB
        )

    def compute_processes(self, handle: Handle) -> Sequence[ProcessUsage]:
        """Compute processes, through the newest query this pynvml offers."""
        nvml = self._nvml
        query = getattr(nvml, "nvmlDeviceGetComputeRunningProcesses_v3", nvml.nvmlDeviceGetComputeRunningProcesses)
        return [
            ProcessUsage(int(p.pid), int(p.usedGpuMemory) if p.usedGpuMemory is not None else None)
            for p in query(handle)
        ]

    def error_name(self, error: Exception) -> str | None:
        """``GPU_IS_LOST`` for ``NVMLError_GpuIsLost`` and so on; ``None`` for other exceptions."""
        if self._nvml is None or not isinstance(error, self._nvml.NVMLError):
            return None
        value = getattr(error, "value", None)
        return self._error_names.get(value, f"NVML_ERROR_{value}") if isinstance(value, int) else None
