"""vramguard's own formats on Kubernetes objects: the one module that spells them.

Every ``vramguard.io/`` annotation and label, and the name of the agent's Lease, is named here
once, with the typed model that encodes it and decodes it back. The wire formats are fixed: pods
and nodes already in clusters carry them, so an encoding changes only with a new version.

=================================  ==========  ====================================================
name                               on          what
=================================  ==========  ====================================================
``vramguard.io/vram``              pod         VRAM declaration of every GPU container
``vramguard.io/vram.<container>``  pod         VRAM declaration of one container (wins)
``vramguard.io/placement``         pod         devices chosen at bind (:class:`Placement`)
``vramguard.io/class-findings``    pod         class rules let through at bind
                                               (:class:`ClassFindingRecord`)
``vramguard.io/gpus``              node        the agent's report (:class:`AgentReport`)
``vramguard.io/qos-class``         pod, ns     the class a pod or namespace asks for (label)
``vramguard.io/enforce``           ns          the namespace's enforcement mode (label)
``vramguard-agent-<node>``         Lease       the agent's liveness (:func:`agent_lease_name`)
``<entry>.vramguard.io``           webhook     an admission webhook entry (:func:`webhook_name`)
=================================  ==========  ====================================================

Decoders never raise: what others wrote may be junk (a user can edit a pod's annotations, a broken
agent can write anything), and junk degrades to "nothing recorded" or "report ignored", with a
note where a reader shows notes. The values of the VRAM declarations are read by
:mod:`vramguard.demand.annotations` (a quantity or a fraction, with the demand's error messages).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from vramguard.quantity import MAX_BYTES

__all__ = [
    "AGENT_LEASE_PREFIX",
    "AGENT_REPORT_ANNOTATION",
    "AGENT_REPORT_VERSION",
    "CLASS_FINDINGS_ANNOTATION",
    "DOMAIN",
    "ENFORCE_LABEL",
    "MAX_LEASE_NAME",
    "PLACEMENT_ANNOTATION",
    "PREFIX",
    "QOS_CLASS_LABEL",
    "VRAM_ANNOTATION",
    "AgentReport",
    "ClassFindingRecord",
    "Placement",
    "ReportedGpu",
    "agent_lease_name",
    "agent_lease_nodes",
    "decode_class_findings",
    "encode_class_findings",
    "is_vramguard_key",
    "vram_annotation",
    "webhook_name",
]

DOMAIN = "vramguard.io"
PREFIX = DOMAIN + "/"
"""Every annotation and label vramguard owns starts with this."""
VRAM_ANNOTATION = PREFIX + "vram"
PLACEMENT_ANNOTATION = PREFIX + "placement"
CLASS_FINDINGS_ANNOTATION = PREFIX + "class-findings"
AGENT_REPORT_ANNOTATION = PREFIX + "gpus"
AGENT_REPORT_VERSION = 1
QOS_CLASS_LABEL = PREFIX + "qos-class"
ENFORCE_LABEL = PREFIX + "enforce"
AGENT_LEASE_PREFIX = "vramguard-agent-"
MAX_LEASE_NAME = 253
"""A Lease's name is a DNS subdomain: at most 253 characters."""

_COMPACT = (",", ":")


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", validate_by_name=True, validate_by_alias=True)


def is_vramguard_key(key: object) -> bool:
    """Whether an annotation or label key is one of vramguard's (what slimmed objects keep)."""
    return isinstance(key, str) and key.startswith(PREFIX)


def vram_annotation(container: str | None = None) -> str:
    """The VRAM declaration of every GPU container (``None``) or of the named one."""
    return VRAM_ANNOTATION if container is None else f"{VRAM_ANNOTATION}.{container}"


def webhook_name(entry: str) -> str:
    """The name of a ValidatingWebhookConfiguration's entry: ``pods`` -> ``pods.vramguard.io``."""
    return f"{entry}.{DOMAIN}"


# -- the placement annotation (written at bind, read back by the cluster model) -------------------


class Placement(_Model):
    """The devices vramguard chose at bind: ``{"node":"n","containers":{"vllm":["0"]}}``."""

    node: str | None = None
    containers: Mapping[str, tuple[str, ...]] = Field(default_factory=dict)
    """Container name -> the device ids vramguard intends it to use (init containers included)."""

    def encode(self) -> str:
        """The annotation's value: compact JSON, node first."""
        return json.dumps(
            {"node": self.node, "containers": {name: list(ids) for name, ids in self.containers.items()}},
            separators=_COMPACT,
        )

    @classmethod
    def decode(cls, value: Any) -> Placement:
        """Read the annotation's value; junk (not JSON, wrong types) records nothing, entries that
        are not lists are skipped, device ids are read as text."""
        if not isinstance(value, str):
            return cls()
        try:
            decoded = json.loads(value)
        except ValueError:
            return cls()
        if not isinstance(decoded, dict):
            return cls()
        node = decoded.get("node")
        containers = decoded.get("containers")
        if not isinstance(containers, dict):
            containers = {}
        return cls(
            node=node if isinstance(node, str) else None,
            containers={
                str(name): tuple(str(d) for d in devices)
                for name, devices in containers.items()
                if isinstance(devices, list)
            },
        )


# -- the class-findings annotation (written at bind in warn and audit namespaces) -----------------


class ClassFindingRecord(_Model):
    """One class rule let through at bind, as recorded on the pod."""

    rule: str
    class_name: str = Field(validation_alias="class", serialization_alias="class")
    resource: str
    sharing: tuple[str, ...]
    message: str


_FINDINGS = TypeAdapter(tuple[ClassFindingRecord, ...])


def encode_class_findings(records: Sequence[ClassFindingRecord]) -> str:
    """The annotation's value: a compact JSON list of the records."""
    return json.dumps([r.model_dump(mode="json", by_alias=True) for r in records], separators=_COMPACT)


def decode_class_findings(value: Any) -> tuple[ClassFindingRecord, ...]:
    """Read the annotation's value; junk reads as no findings."""
    if not isinstance(value, str):
        return ()
    try:
        return _FINDINGS.validate_json(value)
    except ValidationError:
        return ()


# -- the agent's report (node annotation) ---------------------------------------------------------

_ByteCount = TypeAdapter(Annotated[int, Field(strict=True, ge=0, le=MAX_BYTES)])
"""A byte count as the agent reports it: no more than a quantity may name, so every sum and message
built on it stays in range."""


def _is_byte_count(value: Any) -> bool:
    try:
        _ByteCount.validate_python(value)
    except ValidationError:
        return False
    return True


class ReportedGpu(_Model):
    """What the agent measured on one device."""

    id: str
    memory_bytes: int | None = None
    foreign_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        """The entry of the report's ``gpus`` list (``memory_bytes`` left out when unknown)."""
        entry: dict[str, Any] = {"id": self.id}
        if self.memory_bytes is not None:
            entry["memory_bytes"] = self.memory_bytes
        entry["foreign_bytes"] = self.foreign_bytes
        return entry


class AgentReport(_Model):
    """The node agent's report (annotation ``vramguard.io/gpus``), format version 1.

    JSON shape::

        {"version": 1,
         "gpus": [{"id": "0", "memory_bytes": 85520809984, "foreign_bytes": 0}, ...],
         "pods": {"<pod uid>": {"<container>": ["0", "1"]}},
         "used": {"<pod uid>": {"0": 21474836480}}}

    Device ids are the inventory's device ids. ``pods`` lists the devices each container really
    holds, as the kubelet's PodResources API reports them. ``used`` (optional; readers that predate
    it ignore it) is the memory NVML measured for each GPU pod's processes on each device.
    """

    version: int = AGENT_REPORT_VERSION
    gpus: tuple[ReportedGpu, ...] = ()
    placements: Mapping[str, Mapping[str, tuple[str, ...]]] = Field(default_factory=dict)
    """Per pod UID, per container: the device ids it holds (``pods`` on the wire)."""
    used: Mapping[str, Mapping[str, int]] = Field(default_factory=dict)
    """Per pod UID, per device id: bytes its processes use there, as measured."""

    def to_json(self) -> dict[str, Any]:
        """The report as the annotation's JSON object (what :meth:`decode` reads)."""
        pods = {uid: {c: list(ids) for c, ids in sorted(cs.items())} for uid, cs in sorted(self.placements.items())}
        result: dict[str, Any] = {"version": self.version, "gpus": [g.to_json() for g in self.gpus], "pods": pods}
        if self.used:
            result["used"] = {uid: dict(sorted(ds.items())) for uid, ds in sorted(self.used.items())}
        return result

    def encode(self) -> str:
        """The annotation's value: compact JSON with sorted keys, so equal reports are equal strings."""
        return json.dumps(self.to_json(), separators=_COMPACT, sort_keys=True)

    @classmethod
    def decode(cls, text: str) -> tuple[AgentReport | None, list[str]]:
        """Read the annotation's value; junk is skipped with a reason, never raised.

        Returns ``(None, reasons)`` when nothing usable is left (not JSON, unknown version).
        """
        problems: list[str] = []
        try:
            data = json.loads(text)
        except (ValueError, TypeError) as exc:
            return None, [f"agent report ignored: not JSON ({exc})"]
        if not isinstance(data, Mapping):
            return None, ["agent report ignored: not a JSON object"]
        version = data.get("version")
        if version != AGENT_REPORT_VERSION or isinstance(version, bool):
            return None, [
                f"agent report ignored: version {version!r} is not {AGENT_REPORT_VERSION}, "
                "the version this vramguard reads"
            ]
        raw_gpus = data.get("gpus", [])
        if not isinstance(raw_gpus, list):
            problems.append("agent report: 'gpus' is not a list; ignored")
            raw_gpus = []
        gpus = [gpu for position, entry in enumerate(raw_gpus) if (gpu := _reported_gpu(entry, position, problems))]
        report = cls(
            version=AGENT_REPORT_VERSION,
            gpus=tuple(gpus),
            placements=_placements(data.get("pods", {}), problems),
            used=_used(data.get("used", {}), problems),
        )
        return report, problems


def _reported_gpu(entry: Any, position: int, problems: list[str]) -> ReportedGpu | None:
    if not isinstance(entry, Mapping) or not isinstance(entry.get("id"), str):
        problems.append(f"agent report: gpus[{position}] has no string 'id'; ignored")
        return None
    memory = entry.get("memory_bytes")
    foreign = entry.get("foreign_bytes", 0)
    if memory is not None and not _is_byte_count(memory):
        problems.append(f"agent report: gpus[{position}].memory_bytes={memory!r} is not a byte count; ignored")
        memory = None
    if not _is_byte_count(foreign):
        problems.append(f"agent report: gpus[{position}].foreign_bytes={foreign!r} is not a byte count; ignored")
        foreign = 0
    return ReportedGpu(id=entry["id"], memory_bytes=memory, foreign_bytes=foreign)


def _placements(raw: Any, problems: list[str]) -> dict[str, dict[str, tuple[str, ...]]]:
    """The report's ``pods`` section: pod UID -> container -> device ids; junk is skipped with a reason."""
    if not isinstance(raw, Mapping):
        problems.append("agent report: 'pods' is not an object; ignored")
        return {}
    placements: dict[str, dict[str, tuple[str, ...]]] = {}
    for uid, containers in raw.items():
        if not isinstance(containers, Mapping):
            problems.append(f"agent report: pod {uid}: not an object of containers; ignored")
            continue
        per_container: dict[str, tuple[str, ...]] = {}
        for container, ids in containers.items():
            if isinstance(ids, list) and all(isinstance(i, str) for i in ids):
                per_container[str(container)] = tuple(ids)
            else:
                problems.append(f"agent report: pod {uid} container {container}: not a list of ids; ignored")
        placements[str(uid)] = per_container
    return placements


def _used(raw: Any, problems: list[str]) -> dict[str, dict[str, int]]:
    """The report's ``used`` section: pod UID -> device id -> bytes; junk is skipped with a reason."""
    if not isinstance(raw, Mapping):
        problems.append("agent report: 'used' is not an object; ignored")
        return {}
    used: dict[str, dict[str, int]] = {}
    for uid, devices in raw.items():
        if not isinstance(devices, Mapping):
            problems.append(f"agent report: used[{uid}]: not an object of devices; ignored")
            continue
        per_device: dict[str, int] = {}
        for device, amount in devices.items():
            if _is_byte_count(amount):
                per_device[str(device)] = amount
            else:
                problems.append(f"agent report: used[{uid}][{device}]={amount!r} is not a byte count; ignored")
        if per_device:
            used[str(uid)] = per_device
    return used


# -- the agent's Lease ----------------------------------------------------------------------------


def agent_lease_name(node: str) -> str:
    """The Lease name of ``node``'s agent: ``vramguard-agent-<node>``, hashed when too long."""
    name = AGENT_LEASE_PREFIX + node
    if len(name) <= MAX_LEASE_NAME:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:16]
    return f"{name[:MAX_LEASE_NAME - 17]}-{digest}"


def agent_lease_nodes(lease: str, nodes: Mapping[str, Any]) -> list[str]:
    """The node of ``nodes`` an agent's Lease name belongs to; every node when the name was
    shortened with a hash; none when it is not an agent's Lease."""
    if not lease.startswith(AGENT_LEASE_PREFIX):
        return []
    node = lease.removeprefix(AGENT_LEASE_PREFIX)
    if node in nodes:
        return [node]
    return list(nodes) if len(lease) == MAX_LEASE_NAME else []
