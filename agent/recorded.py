"""A recorded NVML snapshot, replayed through the :class:`agent.nvml.Nvml` interface.

The format is the JSON form of :class:`agent.nvml.Snapshot` (``snapshot_to_json``), so a reading
taken on a real GPU machine (``vramguard agent snapshot``) can be replayed as it is. To make a call
fail, put ``{"error": "<NVML error name>"}`` where its value would be (``"memory": {"error":
"GPU_IS_LOST"}``), or ``"error"`` in a GPU entry to make its handle fail. A value that is ``null``
(unknown when recorded) fails with ``UNKNOWN``, as it did then.

Used by the tests, and by ``vramguard agent --nvml-recording FILE`` to run the agent on a machine
without GPUs (demonstrations, end-to-end tests).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agent.nvml import DeviceAttributes, Handle, MemoryInfo, ProcessUsage, Snapshot

__all__ = ["RecordedNvml", "RecordedNvmlError", "snapshot_to_json"]

_MiB = 1 << 20
# H100/H200 and A100 have 7 MIG slots; a recording may say otherwise with "max_mig_devices".
_DEFAULT_MIG_SLOTS = 7


class RecordedNvmlError(Exception):
    """An NVML error replayed from a recording; ``name`` is NVML's (``GPU_IS_LOST``)."""

    def __init__(self, name: str) -> None:
        """Remember the error's name."""
        super().__init__(name)
        self.name = name


def snapshot_to_json(snapshot: Snapshot) -> dict[str, Any]:
    """The snapshot as JSON-ready data: the recording format."""
    return dataclasses.asdict(snapshot)


class RecordedNvml:
    """:class:`agent.nvml.Nvml` answering from a recording (a mapping or a JSON file)."""

    def __init__(self, recording: Mapping[str, Any] | Path) -> None:
        """Load the recording. A file is read at :meth:`init` and again at the start of each reading
        once it has changed, so what the GPUs show can change while the agent runs."""
        self._path = recording if isinstance(recording, Path) else None
        self._data: Mapping[str, Any] = {} if isinstance(recording, Path) else recording
        self._text: str | None = None
        self.initialised = False

    def init(self) -> None:
        """(Re-)read the file when the recording is one."""
        if self._path is not None:
            self._text = self._path.read_text(encoding="utf-8")
            self._data = json.loads(self._text)
        self.initialised = True

    def _refresh(self) -> None:
        """Read the file again when its content changed (a recording is a few KiB); one that cannot
        be read now (being replaced, junk) leaves the last reading in place until it can."""
        if self._path is None:
            return
        try:
            text = self._path.read_text(encoding="utf-8")
            if text == self._text:
                return
            data = json.loads(text)
        except (OSError, ValueError):
            return
        if isinstance(data, Mapping):
            self._data, self._text = data, text

    def shutdown(self) -> None:
        """Nothing to release."""
        self.initialised = False

    def driver_version(self) -> str:
        """The recorded driver version."""
        return str(_value(self._data, "driver_version"))

    def device_count(self) -> int:
        """How many GPU entries the recording has (or its ``device_count`` error); the first call of
        every reading, so the file is looked at again here."""
        self._refresh()
        if "device_count" in self._data:
            return int(_value(self._data, "device_count"))
        return len(self._gpus())

    def device_handle(self, index: int) -> Handle:
        """The GPU entry itself serves as the handle."""
        gpus = self._gpus()
        if not 0 <= index < len(gpus):
            raise RecordedNvmlError("INVALID_ARGUMENT")
        entry = gpus[index]
        if "error" in entry:
            raise RecordedNvmlError(str(entry["error"]))
        return entry

    def uuid(self, handle: Handle) -> str:
        """The recorded UUID."""
        return str(_value(handle, "uuid"))

    def name(self, handle: Handle) -> str:
        """The recorded name; a MIG device's is its parent's plus `` MIG <profile>``."""
        return str(_value(handle, "name"))

    def memory(self, handle: Handle) -> MemoryInfo:
        """The recorded memory."""
        memory = _value(handle, "memory")
        reserved = memory.get("reserved")
        return MemoryInfo(int(memory["total"]), int(memory["used"]), int(reserved) if reserved is not None else None)

    def mig_enabled(self, handle: Handle) -> bool:
        """The recorded MIG mode; a GPU recorded without one does not support MIG."""
        if handle.get("mig_enabled") is None and "mig_enabled" not in handle:
            raise RecordedNvmlError("NOT_SUPPORTED")
        return bool(_value(handle, "mig_enabled"))

    def max_mig_devices(self, handle: Handle) -> int:
        """The recorded slot count, else enough for every recorded instance (at least 7)."""
        if "max_mig_devices" in handle:
            return int(_value(handle, "max_mig_devices"))
        indices = [int(i.get("index", 0)) for i in handle.get("mig_instances") or ()]
        return max([_DEFAULT_MIG_SLOTS, *(i + 1 for i in indices)])

    def mig_device_handle(self, handle: Handle, index: int) -> Handle:
        """The instance recorded in slot ``index``; ``NOT_FOUND`` for an empty slot."""
        for instance in handle.get("mig_instances") or ():
            if int(instance.get("index", -1)) == index:
                if "error" in instance:
                    raise RecordedNvmlError(str(instance["error"]))
                profile = instance.get("profile")
                name = instance.get("name") or (
                    f"{handle.get('name')} MIG {profile}" if profile and handle.get("name") else None
                )
                return {**instance, "name": name}
        raise RecordedNvmlError("NOT_FOUND")

    def gpu_instance_id(self, handle: Handle) -> int:
        """The recorded GPU instance id."""
        return int(_value(handle, "gpu_instance_id"))

    def attributes(self, handle: Handle) -> DeviceAttributes:
        """The recorded attributes (``attributes``: slices and ``memory_mib``)."""
        found = _value(handle, "attributes")
        return DeviceAttributes(
            int(found["gpu_instance_slices"]), int(found["compute_instance_slices"]), int(found["memory_mib"]) * _MiB
        )

    def compute_processes(self, handle: Handle) -> Sequence[ProcessUsage]:
        """The recorded processes."""
        return [
            ProcessUsage(int(p["pid"]), int(p["used_bytes"]) if p.get("used_bytes") is not None else None)
            for p in _value(handle, "processes")
        ]

    def error_name(self, error: Exception) -> str | None:
        """The name of a replayed error."""
        return error.name if isinstance(error, RecordedNvmlError) else None

    def _gpus(self) -> list[Mapping[str, Any]]:
        gpus = self._data.get("gpus") or []
        return [g for g in gpus if isinstance(g, Mapping)]


def _value(entry: Mapping[str, Any], key: str) -> Any:
    """``entry[key]``, raising the recorded error, or ``UNKNOWN`` for a value missing when recorded."""
    value = entry.get(key)
    if isinstance(value, Mapping) and "error" in value:
        raise RecordedNvmlError(str(value["error"]))
    if value is None:
        raise RecordedNvmlError("UNKNOWN")
    return value
