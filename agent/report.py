"""From what NVML, the kubelet and the API server say to the report in ``vramguard.io/gpus``.

Pure functions: no I/O. The report is :class:`vramguard.codecs.AgentReport`, version 1 (which
encodes it), and names devices as :attr:`vramguard.inventory.Gpu.id` does:

- a GPU that is not in MIG mode: its NVML index, ``"0"``; the device plugin numbers GPUs the same
  way, and GPU Feature Discovery counts them.
- a MIG device: ``"<profile>#<n>"``, ``n`` counting the node's MIG devices of that profile in
  (GPU index, MIG slot) order. Devices of one profile are interchangeable for the ledger, so only
  the consistency of the numbering inside one report matters, and the order makes it stable.

**Foreign bytes** of a device are the memory in use there that no pod holding a GPU accounts for.
The rule, per device, from the most to the least that is known:

1. The kubelet's answer is complete and no container holds the device: everything in use on it
   is foreign (a leaked process, another scheduler's pod reaching it without a GPU request).
2. Processes can be attributed to pods (the agent runs with ``hostPID`` and ``--host-pid``):
   used memory minus the memory of processes whose cgroup names a pod that holds GPUs (from the
   kubelet; when it cannot be asked, pods whose spec requests a GPU resource), never below 0.
   When such a pod's process has an unknown usage the device's foreign bytes are unknown.
3. Otherwise foreign usage is not measurable (PIDs of the host mean nothing in the agent's own
   PID namespace) and is reported as 0, the format's default: the ledger then counts only what
   pods declare.

"Used" is NVML's used memory, which (with the v2 query) leaves out the driver's reserve: the
shared devices' margin covers that. A device whose used memory is unknown, or that is lost, is left
out of the report, so the extender keeps the labels' sizes for it.

**Placements** are reported per pod UID and container, only for containers whose every GPU device
id maps to a device of this snapshot; an unmapped container is left out (its placement stays
unknown, which the ledger treats conservatively).

**Used** (needs process attribution): the memory a GPU pod's processes use on a device, reported
where the ledger must count it: where it exceeds what the pod declares on that device (what the
ledger holds for it: a declaration never below the engine's own claim there) by more than
:data:`vramguard.ledger.MEASURED_TOLERANCE_BYTES` (*over-use*, also listed in
:attr:`AgentView.overuse` for the Event and the metric), or where the pod's placement is unknown.
Pods within their declaration are left out, so their usage moving up and down does not rewrite
the Node annotation; amounts are rounded up to :data:`USED_STEP_BYTES` for the same reason. A pod
whose declaration on the device is unknown holds a whole device in the ledger and is left out too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.nvml import MemoryInfo, ProcessUsage, Snapshot
from agent.podresources import PodDevices
from agent.processes import ProcessOwner
from vramguard.codecs import AGENT_REPORT_VERSION, AgentReport, ReportedGpu
from vramguard.demand import DemandOptions, derive_pod_demand
from vramguard.ledger import over_use

__all__ = [
    "NVML_UNAVAILABLE",
    "PODRESOURCES_UNAVAILABLE",
    "USED_STEP_BYTES",
    "AgentView",
    "ContainerUsage",
    "DeviceView",
    "OverUse",
    "PodInfo",
    "build_view",
    "devices_of",
    "owners_for",
    "snapshot_pids",
]

_DEFAULT_DEMAND = DemandOptions()
USED_STEP_BYTES = 64 << 20
"""Reported use is rounded up to this step: small fluctuations leave the report unchanged."""


NVML_UNAVAILABLE = "NVML unavailable: no device is measured"
"""The note of a cycle without NVML (the agent logs the reason where it reads NVML)."""
PODRESOURCES_UNAVAILABLE = "kubelet PodResources unavailable: placements unknown"
"""The note of a cycle without the kubelet's PodResources API (logged where it is read)."""


@dataclass(frozen=True, slots=True)
class DeviceView:
    """A device as the report names it, with what NVML measured on it."""

    id: str
    gpu_index: int
    uuid: str | None
    product: str | None
    memory: MemoryInfo | None
    processes: tuple[ProcessUsage, ...] | None
    lost: bool = False
    mig_profile: str | None = None
    mig_slot: int | None = None


@dataclass(frozen=True, slots=True)
class PodInfo:
    """What the API server says about one pod on this node."""

    uid: str
    namespace: str
    name: str
    containers: Mapping[str, str] = field(default_factory=dict)
    """Container ID (without the runtime prefix) -> container name, from the pod's status."""
    wants_gpu: bool = False
    """Whether its spec requests a GPU resource."""
    declared: Mapping[str, Any] = field(default_factory=dict)
    """Container name -> its :class:`vramguard.demand.model.ContainerDemand`, where its VRAM is known:
    what the ledger holds for it on a device (``held_on``: a declaration never below the engine's own
    claim there)."""

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any], options: DemandOptions = _DEFAULT_DEMAND) -> PodInfo | None:
        """Read a Pod object (JSON-decoded); ``None`` when it has no UID."""
        metadata = pod.get("metadata") or {}
        uid = metadata.get("uid")
        if not isinstance(uid, str) or not uid:
            return None
        status = pod.get("status") or {}
        ids: dict[str, str] = {}
        for key in ("initContainerStatuses", "containerStatuses"):
            for entry in status.get(key) or ():
                if isinstance(entry, Mapping) and isinstance(entry.get("containerID"), str) and entry.get("name"):
                    ids[entry["containerID"].rpartition("://")[2]] = str(entry["name"])
        demand = derive_pod_demand(pod, options)
        declared = {c.name: c for c in demand.containers if c.reservations}
        return cls(
            uid, str(metadata.get("namespace", "")), str(metadata.get("name", "")), ids, demand.wants_gpu, declared
        )


@dataclass(frozen=True, slots=True)
class ContainerUsage:
    """One container's VRAM on one device: declared (per the pod spec) and used (per NVML)."""

    namespace: str
    pod: str
    container: str
    """Empty when a process could be tied to the pod but not to one of its containers."""
    device: str
    declared_bytes: int | None
    used_bytes: int | None


@dataclass(frozen=True, slots=True)
class OverUse:
    """A pod using more VRAM on a device than it declares there (beyond the tolerance)."""

    uid: str
    namespace: str
    pod: str
    device: str
    declared_bytes: int
    used_bytes: int

    @property
    def excess_bytes(self) -> int:
        """What the ledger counts on top of the declaration."""
        return self.used_bytes - self.declared_bytes


@dataclass(frozen=True, slots=True)
class AgentView:
    """Everything one cycle learned: the report, and the detail behind it for metrics and logs."""

    report: AgentReport
    devices: tuple[DeviceView, ...]
    foreign: Mapping[str, int | None]
    """Device id -> foreign bytes (``None``: not measurable, reported as 0)."""
    usage: tuple[ContainerUsage, ...] = ()
    notes: tuple[str, ...] = ()
    placements_known: bool = False
    overuse: tuple[OverUse, ...] = ()


def devices_of(snapshot: Snapshot) -> list[DeviceView]:
    """The snapshot's devices as the report names them, in (GPU index, MIG slot) order."""
    devices: list[DeviceView] = []
    ordinals: dict[str, int] = {}
    for gpu in snapshot.gpus:
        if gpu.mig_enabled:
            for instance in sorted(gpu.mig_instances, key=lambda i: i.index):
                if instance.profile is None:
                    continue
                n = ordinals.get(instance.profile, 0)
                ordinals[instance.profile] = n + 1
                devices.append(DeviceView(
                    f"{instance.profile}#{n}", gpu.index, instance.uuid, gpu.name, instance.memory,
                    instance.processes, gpu.lost, instance.profile, instance.index,
                ))
        else:
            devices.append(DeviceView(
                str(gpu.index), gpu.index, gpu.uuid, gpu.name, gpu.memory, gpu.processes, gpu.lost
            ))
    return devices


class _DeviceIds:
    """Device plugin ids -> report ids: UUIDs, indexes (``--device-id-strategy=index``), replicas."""

    def __init__(self, snapshot: Snapshot, devices: Sequence[DeviceView]) -> None:
        self._ids: dict[str, str] = {}
        for device in devices:
            if device.uuid:
                self._ids[device.uuid] = device.id
            if device.mig_slot is None:
                self._ids[str(device.gpu_index)] = device.id
            else:
                self._ids[f"{device.gpu_index}:{device.mig_slot}"] = device.id
        # A MIG-enabled GPU's own UUID or index names no device the plugin hands out.
        self._mig_parents = {g.uuid for g in snapshot.gpus if g.mig_enabled and g.uuid}

    def map(self, plugin_id: str) -> str | None:
        """The report id of a device plugin id, or ``None`` when it names no known device."""
        physical = plugin_id.split("::", 1)[0]
        if physical in self._mig_parents:
            return None
        return self._ids.get(physical)


def build_view(
    snapshot: Snapshot | None,
    pod_devices: Sequence[PodDevices] | None,
    pods: Mapping[tuple[str, str], PodInfo] | None,
    owners: Mapping[int, ProcessOwner | None] | None,
    options: DemandOptions = _DEFAULT_DEMAND,
) -> AgentView:
    """Combine one cycle's readings.

    ``snapshot``: NVML's, ``None`` when NVML is unavailable. ``pod_devices``: the kubelet's answer,
    ``None`` when it could not be asked. ``pods``: this node's pods by (namespace, name), ``None``
    before the API server answered. ``owners``: the pod of every GPU process by PID, ``None`` when
    processes cannot be attributed (no host PID namespace).
    """
    notes: list[str] = []
    if snapshot is None:
        notes.append(NVML_UNAVAILABLE)
    devices = devices_of(snapshot) if snapshot is not None else []
    by_id = {d.id: d for d in devices}
    placements, holders, complete = _placements(snapshot, devices, pod_devices, pods, options, notes)
    gpu_pods = _gpu_pods(pod_devices, pods, options)

    foreign: dict[str, int | None] = {}
    reported: list[ReportedGpu] = []
    for device in devices:
        if device.lost or device.memory is None:
            notes.append(f"device {device.id}: {'lost' if device.lost else 'memory unknown'}; left out of the report")
            continue
        amount = _foreign(device, holders.get(device.id, set()), complete, gpu_pods, owners)
        foreign[device.id] = amount
        reported.append(ReportedGpu(id=device.id, memory_bytes=usable_bytes(device.memory), foreign_bytes=amount or 0))

    usage = _usage(by_id, placements, pods, owners)
    measured = _measured([by_id[r.id] for r in reported], gpu_pods, owners)
    used, overuse = _over_use(measured, placements, pods, by_id)
    report = AgentReport(version=AGENT_REPORT_VERSION, gpus=tuple(reported), placements=placements, used=used)
    return AgentView(report, tuple(devices), foreign, usage, tuple(notes), pod_devices is not None, overuse)


def usable_bytes(memory: MemoryInfo) -> int:
    """What processes can allocate on a device: NVML's total less what the driver reserves for itself
    (NVML v2's ``reserved``), which is the total CUDA reports (``cudaMemGetInfo``, ``torch.cuda.mem_get_info``)
    and the one every engine takes its fraction of. Where only the v1 query works, NVML's total."""
    reserved = memory.reserved or 0
    return memory.total - reserved if 0 <= reserved < memory.total else memory.total


def _measured(
    devices: Sequence[DeviceView], gpu_pods: set[str] | None, owners: Mapping[int, ProcessOwner | None] | None
) -> dict[tuple[str, str], int]:
    """Bytes used per (GPU pod UID, device id) by the pod's attributed processes."""
    if owners is None or gpu_pods is None:
        return {}
    used: dict[tuple[str, str], int] = {}
    for device in devices:
        for process in device.processes or ():
            owner = owners.get(process.pid)
            if owner is None or owner.pod_uid not in gpu_pods or process.used_bytes is None:
                continue
            key = (owner.pod_uid, device.id)
            used[key] = used.get(key, 0) + process.used_bytes
    return used


def _over_use(
    measured: Mapping[tuple[str, str], int],
    placements: Mapping[str, Mapping[str, tuple[str, ...]]],
    pods: Mapping[tuple[str, str], PodInfo] | None,
    devices: Mapping[str, DeviceView],
) -> tuple[dict[str, dict[str, int]], tuple[OverUse, ...]]:
    """The report's ``used`` section and the over-use rows (see the module docstring)."""
    by_uid = {p.uid: p for p in (pods or {}).values()}
    used: dict[str, dict[str, int]] = {}
    rows: list[OverUse] = []
    for (uid, device_id), amount in sorted(measured.items()):
        info = by_uid.get(uid)
        placed = placements.get(uid)
        memory = devices[device_id].memory
        if info is None or memory is None:
            continue
        if placed is not None:
            # Each replica of the device a container holds is one claim of its declaration.
            vrams = [info.declared.get(c) for c, ids in placed.items() for i in ids if i == device_id]
            if any(v is None for v in vrams):
                continue  # unknown VRAM holds a whole device in the ledger
            declared = sum(v.held_on(usable_bytes(memory)) or 0 for v in vrams if v is not None)
            if not over_use(declared, amount):
                continue
            rows.append(OverUse(uid, info.namespace, info.name, device_id, declared, amount))
        used.setdefault(uid, {})[device_id] = -(-amount // USED_STEP_BYTES) * USED_STEP_BYTES
    return used, tuple(rows)


def _placements(
    snapshot: Snapshot | None,
    devices: Sequence[DeviceView],
    pod_devices: Sequence[PodDevices] | None,
    pods: Mapping[tuple[str, str], PodInfo] | None,
    options: DemandOptions,
    notes: list[str],
) -> tuple[dict[str, dict[str, tuple[str, ...]]], dict[str, set[str]], bool]:
    """Placements by pod UID, holders (pod UIDs, ``""`` for unknown) by device, and completeness.

    Complete means every GPU device the kubelet listed maps to a device of the snapshot: only
    then does "no container holds this device" hold.
    """
    if pod_devices is None:
        notes.append(PODRESOURCES_UNAVAILABLE)
        return {}, {}, False
    if snapshot is None:
        return {}, {}, False
    ids = _DeviceIds(snapshot, devices)
    placements: dict[str, dict[str, tuple[str, ...]]] = {}
    holders: dict[str, set[str]] = {}
    complete = snapshot.complete
    if pods is None:
        notes.append("pods of the node not listed yet: placements cannot be keyed by pod UID")
    for pod in pod_devices:
        info = pods.get((pod.namespace, pod.name)) if pods is not None else None
        for container in pod.containers:
            plugin_ids = [i for resource, found in container.devices if options.is_gpu(resource) for i in found]
            if not plugin_ids:
                continue
            mapped = [ids.map(i) for i in plugin_ids]
            known = [m for m in mapped if m is not None]
            for device_id in known:
                holders.setdefault(device_id, set()).add(info.uid if info is not None else "")
            if len(known) != len(mapped):
                complete = False
                missing = [i for i, m in zip(plugin_ids, mapped, strict=True) if m is None]
                notes.append(
                    f"pod {pod.namespace}/{pod.name} container {container.name}: devices {', '.join(missing)} "
                    "not seen by NVML; placement left unknown"
                )
                continue
            if info is None:
                if pods is not None:
                    notes.append(f"pod {pod.namespace}/{pod.name}: not among the node's pods yet; placement left out")
                continue
            placements.setdefault(info.uid, {})[container.name] = tuple(known)
    return placements, holders, complete


def _gpu_pods(
    pod_devices: Sequence[PodDevices] | None,
    pods: Mapping[tuple[str, str], PodInfo] | None,
    options: DemandOptions,
) -> set[str] | None:
    """UIDs of the pods the ledger accounts: those holding GPU devices (else requesting them)."""
    if pods is None:
        return None
    if pod_devices is not None:
        uids = set()
        for pod in pod_devices:
            if any(options.is_gpu(r) and ids for c in pod.containers for r, ids in c.devices):
                info = pods.get((pod.namespace, pod.name))
                if info is None:
                    return None  # a GPU pod whose UID is unknown: its processes cannot be told apart
                uids.add(info.uid)
        return uids
    return {p.uid for p in pods.values() if p.wants_gpu}


def _foreign(
    device: DeviceView,
    holders: set[str],
    complete: bool,
    gpu_pods: set[str] | None,
    owners: Mapping[int, ProcessOwner | None] | None,
) -> int | None:
    assert device.memory is not None
    used = device.memory.used
    if complete and not holders:
        return used  # rule 1: nobody holds it, so nobody's declaration covers what is in use
    if owners is None or gpu_pods is None or device.processes is None:
        return None  # rule 3: not measurable
    accounted = 0
    for process in device.processes:
        owner = owners.get(process.pid)
        if owner is None or owner.pod_uid not in gpu_pods:
            continue
        if process.used_bytes is None:
            return None
        accounted += process.used_bytes
    return max(0, used - accounted)


def _usage(
    devices: Mapping[str, DeviceView],
    placements: Mapping[str, Mapping[str, tuple[str, ...]]],
    pods: Mapping[tuple[str, str], PodInfo] | None,
    owners: Mapping[int, ProcessOwner | None] | None,
) -> tuple[ContainerUsage, ...]:
    """Declared (pods with a known placement) and used (attributed processes) VRAM per container."""
    if pods is None:
        return ()
    by_uid = {p.uid: p for p in pods.values()}
    rows: dict[tuple[str, str, str], list[int | None]] = {}  # (uid, container, device) -> [declared, used]
    for uid, containers in placements.items():
        info = by_uid.get(uid)
        if info is None:
            continue
        for container, device_ids in containers.items():
            vram = info.declared.get(container)
            for device_id in device_ids:
                device = devices[device_id]
                declared = vram.held_on(usable_bytes(device.memory)) if vram is not None and device.memory else None
                rows.setdefault((uid, container, device_id), [None, None])[0] = declared
    if owners is not None:
        for device in devices.values():
            for process in device.processes or ():
                owner = owners.get(process.pid)
                info = by_uid.get(owner.pod_uid) if owner is not None else None
                if owner is None or info is None:
                    continue
                container = info.containers.get(owner.container_id or "", "")
                row = rows.setdefault((info.uid, container, device.id), [None, None])
                if process.used_bytes is not None:
                    row[1] = (row[1] or 0) + process.used_bytes
    return tuple(
        ContainerUsage(by_uid[uid].namespace, by_uid[uid].name, container, device, declared, used)
        for (uid, container, device), (declared, used) in sorted(rows.items())
    )


def snapshot_pids(snapshot: Snapshot | None) -> list[int]:
    """Every PID NVML reported on any device of the snapshot, once each."""
    if snapshot is None:
        return []
    pids: dict[int, None] = {}
    for device in devices_of(snapshot):
        for process in device.processes or ():
            pids[process.pid] = None
    return list(pids)


def owners_for(pids: Iterable[int], read: Callable[[int], ProcessOwner | None]) -> dict[int, ProcessOwner | None]:
    """``read(pid)`` for every distinct PID (``read``: e.g. ``partial(owner_of, proc_root=...)``)."""
    return {pid: read(pid) for pid in dict.fromkeys(pids)}
