"""Tables of the VRAM ledger for people and JSON for tools: per GPU budgets, and what each pod holds.

Pure: the rows are built from the ledger (:class:`vramguard.ledger.DeviceUsage`, the claims it holds
per pod) and the demand model, whoever filled them: ``kubectl vram`` and ``vramguard audit`` read the
cluster and build the same ledger the extender builds, then render it here.

Numbers are the ledger's: *budget* is the device's memory less the policy's margin for it, *known* is
what pods known to be on the device hold, *worst case* is what the device may hold whatever device
the plugin picked for pods whose device is not known (what the extender's filter checks: each such
pod is held on every device it may be on), *free* is budget less the worst case (negative when a GPU
is already overcommitted, which only pods placed without vramguard can do). Where the worst case
exceeds what is known, free is a worst case, not a fact, and the views say so: the node's agent
report (``agent``: fresh, stale or none) is what tells where such pods are.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vramguard.demand.model import PodDemand
from vramguard.inventory import Gpu
from vramguard.ledger import Claim, DeviceUsage
from vramguard.quantity import format_bytes

__all__ = [
    "ContainerHolding",
    "GpuRow",
    "PodHolding",
    "gpu_rows",
    "gpu_table",
    "pod_holding",
    "pods_table",
    "render_table",
    "worst_case_notes",
]

UNKNOWN_DEVICE = "?"


@dataclass(frozen=True, slots=True)
class GpuRow:
    """One device of one node, as ``kubectl vram nodes`` shows it."""

    node: str
    gpu: str
    """The device id: the GPU index, or ``<profile>#<n>`` for a MIG instance."""
    product: str
    sharing: str
    replicas: int
    resource: str
    memory_bytes: int
    budget_bytes: int
    reserved_bytes: int
    """Worst case over the device plugin's choices (what the extender checks)."""
    known_bytes: int
    """Claims known to be on this device, and memory used by processes of no known pod."""
    pods: tuple[str, ...]
    agent: str = "-"
    """The node's agent report: ``fresh``, ``stale``, ``none`` (``-``: not a device-plugin GPU)."""

    @property
    def unplaced_bytes(self) -> int:
        """What the worst case holds here for pods whose device is not known."""
        return max(0, self.reserved_bytes - self.known_bytes)

    @property
    def free_bytes(self) -> int:
        """Budget left in the worst case; negative when the device is overcommitted."""
        return self.budget_bytes - self.reserved_bytes

    @property
    def over_budget(self) -> bool:
        """Whether the device may hold more than its budget (never one whose memory nobody knows)."""
        return self.memory_bytes > 0 and self.reserved_bytes > self.budget_bytes

    def to_json(self) -> dict[str, Any]:
        """The row as a JSON object (bytes as integers)."""
        return {
            "node": self.node,
            "gpu": self.gpu,
            "product": self.product,
            "sharing": self.sharing,
            "replicas": self.replicas,
            "resource": self.resource,
            "memory_bytes": self.memory_bytes,
            "budget_bytes": self.budget_bytes,
            "reserved_bytes": self.reserved_bytes,
            "known_bytes": self.known_bytes,
            "unplaced_bytes": self.unplaced_bytes,
            "free_bytes": self.free_bytes,
            "free_is_worst_case": self.unplaced_bytes > 0,
            "agent": self.agent,
            "over_budget": self.over_budget,
            "pods": list(self.pods),
        }


def gpu_rows(usages: Iterable[DeviceUsage], agents: Mapping[str, str] | None = None) -> list[GpuRow]:
    """Rows from the ledger's :meth:`~vramguard.ledger.Ledger.usage`, sorted by node and device;
    ``agents``: each node's agent report state."""
    rows = [
        GpuRow(
            node=u.node,
            gpu=u.device.id,
            product=u.device.product,
            # A DRA device's slots are the allocator's, not a device plugin's replicas: named apart.
            sharing=f"dra-{u.device.dra_sharing}" if u.device.dra_sharing else u.device.sharing,
            replicas=u.device.replicas,
            resource=u.device.resource,
            memory_bytes=u.device.memory_bytes,
            budget_bytes=u.budget,
            reserved_bytes=u.worst_bytes,
            known_bytes=u.known_bytes,
            pods=u.pods,
            agent=(agents or {}).get(u.node, "-"),
        )
        for u in usages
    ]
    return sorted(rows, key=lambda r: (r.node, r.resource, _device_order(r.gpu)))


def _device_order(device_id: str) -> tuple[int, str]:
    return (int(device_id), "") if device_id.isdigit() else (1 << 30, device_id)


def render_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Left-aligned columns separated by three spaces, like ``kubectl get``; no trailing blanks."""
    table = [list(headers), *(list(row) for row in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(headers))]
    lines = ["   ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in table]
    return "\n".join(lines) + "\n"


def _sharing_text(row: GpuRow) -> str:
    if row.sharing in ("time-slicing", "mps"):
        return f"{row.sharing} x{row.replicas}"
    return row.sharing


def _free_text(row: GpuRow) -> str:
    text = format_bytes(row.free_bytes)
    if row.over_budget:
        return f"{text} (OVER)"
    return f"{text}*" if row.unplaced_bytes else text


def gpu_table(rows: Sequence[GpuRow]) -> str:
    """The ``kubectl vram nodes`` table: NODE GPU PRODUCT SHARING AGENT BUDGET KNOWN WORST-CASE FREE
    PODS, then a line for each node whose free memory is a worst case, saying why."""
    if not rows:
        return "No GPU nodes found (no node offers a GPU resource of the policy).\n"
    headers = ("NODE", "GPU", "PRODUCT", "SHARING", "AGENT", "BUDGET", "KNOWN", "WORST-CASE", "FREE", "PODS")
    table = render_table(
        headers,
        (
            (
                row.node,
                row.gpu,
                row.product,
                _sharing_text(row),
                row.agent,
                format_bytes(row.budget_bytes),
                format_bytes(row.known_bytes),
                format_bytes(row.reserved_bytes),
                _free_text(row),
                ",".join(row.pods) if row.pods else "-",
            )
            for row in rows
        ),
    )
    return table + "".join(f"* {line}\n" for line in worst_case_notes(rows))


def worst_case_notes(rows: Sequence[GpuRow]) -> list[str]:
    """For each node whose free memory is a worst case: why, and what would tell the facts."""
    notes = []
    by_node: dict[str, list[GpuRow]] = {}
    for row in rows:
        by_node.setdefault(row.node, []).append(row)
    for node, mine in by_node.items():
        if not any(row.unplaced_bytes for row in mine):
            continue
        agent = mine[0].agent
        why = {
            "none": "no agent report, so the GPUs its pods hold are not known",
            "stale": "its agent report is stale (the agent's Lease expired), so it is set aside",
        }.get(agent, "some pods' GPUs are not known yet")
        notes.append(
            f"{node}: FREE is a worst case: {why}; each such pod is held on every GPU it may be on "
            f"(WORST-CASE less KNOWN), though the GPUs may be idle"
            + ("; run the node agent to see where they are" if agent != "fresh" else "")
        )
    return notes


@dataclass(frozen=True, slots=True)
class ContainerHolding:
    """What one container of a pod holds, per device, and why."""

    name: str
    resource: str
    gpus: int
    devices: tuple[str, ...]
    """The device of each of its claims (``?``: the device plugin's choice, not known)."""
    bytes_per_gpu: int | None
    """What it holds on each device (on the largest candidate device when its device is unknown)."""
    vram: str
    """The reservation as declared or derived: ``0.3 of the GPU``, ``16.0 GiB``, or ``unknown``."""
    engine: str | None
    evidence: tuple[str, ...]
    warnings: tuple[str, ...]
    errors: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """The container as a JSON object."""
        return {
            "name": self.name,
            "resource": self.resource,
            "gpus": self.gpus,
            "devices": list(self.devices),
            "bytes_per_gpu": self.bytes_per_gpu,
            "vram": self.vram,
            "engine": self.engine,
            "evidence": list(self.evidence),
            "warnings": list(self.warnings),
            "errors": list(self.errors),
        }


@dataclass(frozen=True, slots=True)
class PodHolding:
    """One bound GPU pod: its node, class and containers."""

    namespace: str
    name: str
    node: str
    qos_class: str
    containers: tuple[ContainerHolding, ...]

    @property
    def total_bytes(self) -> int | None:
        """Bytes it holds over all its devices; ``None`` when some part is not sized."""
        total = 0
        for container in self.containers:
            if container.bytes_per_gpu is None:
                return None
            total += container.bytes_per_gpu * len(container.devices)
        return total

    def to_json(self) -> dict[str, Any]:
        """The pod as a JSON object."""
        return {
            "namespace": self.namespace,
            "name": self.name,
            "node": self.node,
            "qos_class": self.qos_class,
            "total_bytes": self.total_bytes,
            "containers": [c.to_json() for c in self.containers],
        }


def pod_holding(
    pod: Mapping[str, Any],
    demand: PodDemand,
    qos_class: str,
    claims: Sequence[Claim],
    devices: Sequence[Gpu],
    budgets: Mapping[str, int] | None = None,
) -> PodHolding:
    """Describe a bound pod from its demand and the claims the ledger holds for it.

    ``devices`` are the GPU devices of the pod's node; ``budgets`` (device id -> budget) size claims
    of unknown VRAM, which hold a whole device (one replica's share under MPS).
    """
    metadata: Mapping[str, Any] = pod.get("metadata") or {}
    spec: Mapping[str, Any] = pod.get("spec") or {}
    by_id = {d.id: d for d in devices}
    containers: list[ContainerHolding] = []
    for container in demand.containers:
        mine = [c for c in claims if c.container == container.name and c.resource == container.resource]
        candidates = [d for d in devices if d.resource == container.resource]
        # A device alone behind its resource is known whatever the device plugin picks.
        only = candidates[0].id if len(candidates) == 1 else UNKNOWN_DEVICE
        placed = tuple((c.gpu or c.intended or only) for c in mine)
        sizes: list[int] = []
        for claim, where in zip(mine, placed, strict=True):
            on = [by_id[where]] if where in by_id else candidates
            amounts = [claim.bytes_on(d.memory_bytes, _whole(d, budgets)) for d in on if d.memory_bytes > 0]
            if amounts:
                sizes.append(max(amounts))
        containers.append(
            ContainerHolding(
                name=container.name,
                resource=container.resource,
                gpus=container.gpus,
                devices=placed,
                bytes_per_gpu=max(sizes) if sizes and len(sizes) == len(mine) else None,
                vram=container.describe_reservation(),
                engine=container.engine,
                evidence=container.evidence,
                warnings=container.warnings,
                errors=container.errors,
            )
        )
    return PodHolding(
        namespace=str(metadata.get("namespace", "")),
        name=str(metadata.get("name", "")),
        node=str(spec.get("nodeName", "")),
        qos_class=qos_class,
        containers=tuple(containers),
    )


def _whole(device: Gpu, budgets: Mapping[str, int] | None) -> int:
    budget = (budgets or {}).get(device.id, device.memory_bytes)
    return budget // device.replicas if device.sharing == "mps" and device.replicas > 0 else budget


def pods_table(pods: Sequence[PodHolding]) -> str:
    """The ``kubectl vram pods`` table, one line per GPU container, with the evidence."""
    if not pods:
        return "No bound GPU pods found.\n"
    headers = ("NAMESPACE", "POD", "NODE", "CLASS", "CONTAINER", "GPUS", "DEVICES", "PER GPU", "ENGINE", "WHY")
    lines = []
    for pod in sorted(pods, key=lambda p: (p.namespace, p.name)):
        for container in pod.containers:
            per_gpu = format_bytes(container.bytes_per_gpu) if container.bytes_per_gpu is not None else "?"
            why = "; ".join(container.evidence) or container.vram
            if container.errors:
                why += f" [error: {'; '.join(container.errors)}]"
            lines.append((
                pod.namespace,
                pod.name,
                pod.node,
                pod.qos_class,
                container.name,
                f"{container.gpus} {container.resource}",
                ",".join(container.devices) or "-",
                per_gpu,
                container.engine or "-",
                why,
            ))
    return render_table(headers, lines)
