"""Allowances learned from what the fleet's pods really hold beyond their certain part.

The demand model splits what a container holds on a GPU into a *certain* part (the engine's share,
its CUDA context) and *estimates* (CUDA graphs, communication buffers, activations, engine reserves:
:class:`vramguard.demand.model.Allowance`). The node agent measures each pod's processes on each
device. What a pod holds *beyond its certain part* is the truth the estimates stand for; this module
keeps it per key and turns it into an allowance the ledger counts for pods of that key:

**Key**: engine, engine version (image tag), GPU product, GPUs per container (the parallel layout
on the pod). Samples come from engine claims only (a declaration or an MPS limit is the user's
number, not the model's) that are not ceilings (a ceiling share counts at least half the device),
one container on the device.

**Robust against one tenant.** Each pod keeps its peak (bytes beyond its certain part); a namespace's
value is the lower median of its pods' peaks (most of its pods hold at least that), and the key's
target is the lower median of its namespaces' values (most namespaces agree). One tenant allocating
extra memory cannot move a key that other namespaces run too; where a key has a single namespace,
its value still moves the allowance, and each change is reported (an Event names the namespaces
behind it; :attr:`Change.single_namespace`). A namespace whose value is far above the key's target
is an :func:`outlier <outliers>`, reported and not followed.

**Bounded.** The published value moves toward the target by at most ``step`` per round (no jump,
no flapping), never past the device (an estimate never counts beyond it, :meth:`Vram.on_device`),
and the table is bounded: :data:`MAX_KEYS` keys, :data:`MAX_NAMESPACES` namespaces a key,
:data:`MAX_PODS` pods a namespace (the least recently seen go first). Pods not measured for
``max_age`` age out, and a key with none left is forgotten.

**Upward by default.** A container counts ``max(static estimates, learned)``; where the policy allows
downward learning, a key whose evidence is ``downward_min_pods`` pods over ``downward_min_age``
counts the learned value even when it is below the static estimates (never below the certain part).

Pure: the extender's leader runs the rounds, keeps the table in a ConfigMap, and applies it
(:meth:`vramguard.cluster.ClusterState.set_learned`); ``explain`` and ``plan`` read it with ``--cluster``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vramguard.demand.allowances import LEARNED
from vramguard.demand.model import Allowance, ContainerDemand, PodDemand, Vram
from vramguard.inventory import Gpu, human_product
from vramguard.quantity import GiB, format_bytes

if TYPE_CHECKING:  # the cluster model applies the table (apply_learned): imported for types only
    from vramguard.cluster import ClusterState

__all__ = [
    "LEARNED_CONFIGMAP",
    "LEARNED_KEY",
    "MAX_KEYS",
    "MAX_NAMESPACES",
    "MAX_PODS",
    "Change",
    "LearnKey",
    "LearnSample",
    "LearnedAllowance",
    "LearnedTable",
    "LearnedTableError",
    "LearningRules",
    "apply_learned",
    "learning_samples",
]

LEARNED_CONFIGMAP = "vramguard-learned-allowances"
"""Where the extender keeps the table, in its own namespace (data key :data:`LEARNED_KEY`)."""
LEARNED_KEY = "table.json"
MAX_KEYS = 64
"""Keys the table keeps (the least recently measured goes first)."""
MAX_NAMESPACES = 8
"""Namespaces a key keeps (the least recently measured goes first)."""
MAX_PODS = 8
"""Pods a namespace keeps per key (the least recently measured goes first)."""
MAX_TABLE_CHARS = 512 * 1024
"""The stored table's size limit (its bounds keep it near 300 KB at most): a longer text is refused."""
OUTLIER_FACTOR = 2
OUTLIER_MARGIN = GiB
"""A namespace is an outlier when its value passes twice the key's target and the target plus 1 GiB."""


class LearnedTableError(ValueError):
    """A stored table that is not one this module writes."""


@dataclass(frozen=True, slots=True, order=True)
class LearnKey:
    """What learned allowances are kept per."""

    engine: str
    version: str
    product: str
    gpus: int
    """GPUs of the container."""
    layout: str = ""
    """The engine's parallel sizes (``tensor-parallel-size=2``; empty: none above 1)."""

    def describe(self) -> str:
        """``vllm 0.9.2 on NVIDIA H100 80GB HBM3, 2 GPUs per container (tensor-parallel-size=2)``."""
        plural = "s" if self.gpus != 1 else ""
        layout = f" ({self.layout})" if self.layout else ""
        return (f"{self.engine} {self.version} on {human_product(self.product)}, {self.gpus} GPU{plural} per "
                f"container{layout}")


@dataclass(frozen=True, slots=True)
class LearningRules:
    """The policy's ``learning`` settings, in the units the rounds use."""

    enabled: bool = True
    min_pods: int = 2
    step_bytes: int = GiB
    max_age_seconds: float = 7 * 86400.0
    downward: bool = False
    downward_min_pods: int = 20
    downward_min_age_seconds: float = 7 * 86400.0


@dataclass(frozen=True, slots=True)
class LearnSample:
    """One measured pod on one device: the bytes it holds beyond its certain part."""

    key: LearnKey
    namespace: str
    uid: str
    name: str
    beyond: int
    """Measured use less the certain part (share and CUDA context), at least 0."""
    static: int
    """The static estimates on this device (graphs, buffers, reserve), the learned allowance left out."""
    room: int
    """The most an estimate may count on this device: its memory less the certain part."""


@dataclass(frozen=True, slots=True)
class LearnedAllowance:
    """A key's published value: what the ledger counts beyond the certain part."""

    key: LearnKey
    bytes: int
    pods: int
    namespaces: int
    downward: bool = False
    """The evidence allows counting it below the static estimates (policy ``learning.downward``)."""

    def source(self) -> str:
        """``learned from 5 pods in 2 namespaces on NVIDIA H100 80GB HBM3``."""
        pods = f"{self.pods} pod{'s' if self.pods != 1 else ''}"
        namespaces = f"{self.namespaces} namespace{'s' if self.namespaces != 1 else ''}"
        return f"learned from {pods} in {namespaces} on {human_product(self.key.product)}"


@dataclass(frozen=True, slots=True)
class Change:
    """A published value that moved in a round (for the Event and the log)."""

    key: LearnKey
    before: int | None
    after: int | None
    target: int
    namespaces: tuple[str, ...]
    pods: int

    @property
    def single_namespace(self) -> bool:
        """One namespace's pods alone moved it."""
        return len(self.namespaces) == 1

    def message(self) -> str:
        """What moved, from what, and who stands behind it."""
        before = format_bytes(self.before) if self.before is not None else "nothing"
        after = format_bytes(self.after) if self.after is not None else "nothing (static estimates)"
        who = ", ".join(self.namespaces)
        lone = "; ONE namespace alone decides it" if self.single_namespace else ""
        return (
            f"learned allowance for {self.key.describe()}: {before} -> {after} beyond the certain part "
            f"(target {format_bytes(self.target)}, {self.pods} pods in namespaces {who}{lone})"
        )


@dataclass(slots=True)
class _Peak:
    bytes: int
    seen: float
    name: str = ""


@dataclass(slots=True)
class _KeyHistory:
    namespaces: dict[str, dict[str, _Peak]] = field(default_factory=dict)
    """Namespace -> pod UID -> its peak beyond the certain part."""
    static: int = 0
    """The static estimates of the latest sample (where the published value starts)."""
    room: int = 0
    """The device's memory less the certain part, the latest sample's: the most an estimate counts."""
    published: int | None = None
    since: float = 0.0
    """When the key was first measured (downward learning needs evidence over time)."""
    seen: float = 0.0

    def pods(self) -> int:
        return sum(len(pods) for pods in self.namespaces.values())

    def namespace_values(self) -> dict[str, int]:
        return {ns: _lower_median([p.bytes for p in pods.values()]) for ns, pods in self.namespaces.items() if pods}


def _lower_median(values: list[int]) -> int:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def _upper_median(values: list[int]) -> int:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


class LearnedTable:
    """The learned allowances and the evidence behind them (what the leader keeps in its ConfigMap)."""

    def __init__(self) -> None:
        self._keys: dict[LearnKey, _KeyHistory] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def observe(self, sample: LearnSample, now: float) -> None:
        """Count one measurement: the pod's peak rises to it (a pod holds its peak until it ends)."""
        history = self._keys.get(sample.key)
        if history is None:
            if len(self._keys) >= MAX_KEYS:
                del self._keys[min(self._keys, key=lambda k: self._keys[k].seen)]
            history = self._keys[sample.key] = _KeyHistory(since=now)
        history.seen = now
        history.static = sample.static
        history.room = sample.room
        pods = history.namespaces.get(sample.namespace)
        if pods is None:
            if len(history.namespaces) >= MAX_NAMESPACES:
                oldest = min(history.namespaces, key=lambda ns: max(p.seen for p in history.namespaces[ns].values()))
                del history.namespaces[oldest]
            pods = history.namespaces[sample.namespace] = {}
        peak = pods.get(sample.uid)
        if peak is None:
            if len(pods) >= MAX_PODS:
                del pods[min(pods, key=lambda uid: pods[uid].seen)]
            pods[sample.uid] = _Peak(sample.beyond, now, sample.name)
        else:
            peak.bytes = max(peak.bytes, sample.beyond)
            peak.seen = now
            peak.name = sample.name

    def expire(self, now: float, max_age: float) -> None:
        """Forget pods not measured for ``max_age`` seconds, then namespaces and keys left empty."""
        for key in list(self._keys):
            history = self._keys[key]
            for ns in list(history.namespaces):
                pods = history.namespaces[ns]
                for uid in [uid for uid, peak in pods.items() if now - peak.seen > max_age]:
                    del pods[uid]
                if not pods:
                    del history.namespaces[ns]
            if not history.namespaces:
                del self._keys[key]

    def publish(self, rules: LearningRules) -> list[Change]:
        """Move each key's published value toward its target, at most ``rules.step_bytes``; the changes.

        The target is the lower median over namespaces of their pods' lower median (upward), the upper
        median where it lies below the static estimates and downward learning is allowed with enough
        evidence; never past the device. Below ``rules.min_pods`` pods nothing is published.
        """
        changes: list[Change] = []
        for key, history in sorted(self._keys.items()):
            before = history.published
            target = self._target(history, rules)
            if target is None:
                history.published = None
            else:
                start = before if before is not None else history.static
                step = max(-rules.step_bytes, min(rules.step_bytes, target - start))
                history.published = max(0, start + step)
            if history.published != before:
                changes.append(Change(key, before, history.published, target if target is not None else 0,
                                      tuple(sorted(history.namespaces)), history.pods()))
        return changes

    def _target(self, history: _KeyHistory, rules: LearningRules) -> int | None:
        values = list(history.namespace_values().values())
        if not rules.enabled or history.pods() < rules.min_pods or not values:
            return None
        target = min(_lower_median(values), history.room)
        if target >= history.static:
            return target
        if self._downward(history, rules, history.seen):
            return min(_upper_median(values), history.static)
        return None

    @staticmethod
    def _downward(history: _KeyHistory, rules: LearningRules, now: float) -> bool:
        return (rules.downward and history.pods() >= rules.downward_min_pods
                and now - history.since >= rules.downward_min_age_seconds)

    def allowances(self, rules: LearningRules) -> dict[LearnKey, LearnedAllowance]:
        """The published values, as the ledger applies them (:func:`apply_learned`)."""
        if not rules.enabled:
            return {}
        return {
            key: LearnedAllowance(key, history.published, history.pods(), len(history.namespaces),
                                  self._downward(history, rules, history.seen))
            for key, history in self._keys.items() if history.published is not None
        }

    def outliers(self) -> dict[LearnKey, tuple[str, ...]]:
        """Per key, the namespaces whose pods hold far more than the key's target (reported, not followed)."""
        found: dict[LearnKey, tuple[str, ...]] = {}
        for key, history in self._keys.items():
            values = history.namespace_values()
            if len(values) < 2:
                continue
            target = _lower_median(list(values.values()))
            bound = max(target * OUTLIER_FACTOR, target + OUTLIER_MARGIN)
            far = tuple(sorted(ns for ns, value in values.items() if value > bound))
            if far:
                found[key] = far
        return found

    def evidence(self, key: LearnKey) -> tuple[int, int]:
        """``(pods, namespaces)`` measured for ``key``."""
        history = self._keys.get(key)
        return (history.pods(), len(history.namespaces)) if history is not None else (0, 0)

    # -- storage ------------------------------------------------------------------------------

    def to_json(self) -> str:
        """The table as stored (compact JSON, keys sorted: an unchanged table is the same text)."""
        rows = []
        for key, h in sorted(self._keys.items()):
            rows.append({
                "engine": key.engine, "version": key.version, "product": key.product, "gpus": key.gpus,
                "layout": key.layout,
                "static": h.static, "room": h.room, "published": h.published, "since": round(h.since, 3),
                "seen": round(h.seen, 3),
                "namespaces": {
                    ns: {uid: [p.bytes, round(p.seen, 3), p.name] for uid, p in sorted(pods.items())}
                    for ns, pods in sorted(h.namespaces.items())
                },
            })
        return json.dumps({"version": 1, "keys": rows}, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LearnedTable:
        """A stored table; :class:`LearnedTableError` for anything this module would not have written
        (the ConfigMap can be edited by whoever may: nothing in it is trusted past its shape and bounds)."""
        if len(text) > MAX_TABLE_CHARS:
            raise LearnedTableError(f"{len(text)} characters, more than {MAX_TABLE_CHARS}")
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise LearnedTableError(f"not JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("version") != 1 or not isinstance(data.get("keys"), list):
            raise LearnedTableError("not a version 1 table ({\"version\": 1, \"keys\": [...]})")
        table = cls()
        for index, row in enumerate(data["keys"][:MAX_KEYS]):
            try:
                key, history = _read_row(row)
            except (KeyError, TypeError, ValueError) as exc:
                raise LearnedTableError(f"keys[{index}]: {exc}") from None
            table._keys[key] = history
        return table


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 50:
        raise ValueError(f"{what} must be a whole number of bytes")
    return value


def _time(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e11:
        raise ValueError(f"{what} must be seconds since the epoch")
    return float(value)


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= 253:
        raise ValueError(f"{what} must be a name")
    return value


def _read_row(row: Any) -> tuple[LearnKey, _KeyHistory]:
    if not isinstance(row, dict):
        raise TypeError("not an object")
    gpus = row["gpus"]
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= 1024:
        raise ValueError("gpus must be a count of GPUs")
    layout = row.get("layout", "")
    if not isinstance(layout, str) or len(layout) > 253:
        raise ValueError("layout must be a short text")
    key = LearnKey(_text(row["engine"], "engine"), _text(row["version"], "version"), _text(row["product"], "product"),
                   gpus, layout)
    published = row["published"]
    history = _KeyHistory(
        static=_count(row["static"], "static"), room=_count(row["room"], "room"),
        published=None if published is None else _count(published, "published"),
        since=_time(row["since"], "since"), seen=_time(row["seen"], "seen"),
    )
    namespaces = row["namespaces"]
    if not isinstance(namespaces, dict):
        raise TypeError("namespaces must be an object")
    for ns, pods in list(namespaces.items())[:MAX_NAMESPACES]:
        if not isinstance(pods, dict):
            raise TypeError(f"namespaces.{ns} must be an object")
        kept: dict[str, _Peak] = {}
        for uid, peak in list(pods.items())[:MAX_PODS]:
            if not isinstance(peak, list) or len(peak) != 3:
                raise TypeError(f"namespaces.{ns}.{uid} must be [bytes, seen, name]")
            kept[_text(uid, "a pod UID")] = _Peak(_count(peak[0], "a peak"), _time(peak[1], "seen"),
                                                  peak[2] if isinstance(peak[2], str) else "")
        history.namespaces[_text(ns, "a namespace")] = kept
    return key, history


# -- samples from the cluster model -----------------------------------------------------------


def _static(vram: Vram, product: str) -> int:
    return sum(a.bytes_for(product) for a in vram.allowances if a.estimate and a.name != LEARNED)


def _certain(vram: Vram, device: Gpu) -> int:
    return vram.share_on(device.memory_bytes) + sum(
        a.bytes_for(device.product) for a in vram.allowances if not a.estimate
    )


def _learnable(container: ContainerDemand) -> Vram | None:
    """The engine claim a container's samples are kept for, or ``None`` (a declaration, an MPS limit,
    unknown VRAM, a ceiling, an unknown engine)."""
    claim = container.claim
    if container.declared is not None or container.mps_limit is not None or claim is None or claim.ceiling:
        return None
    return claim if container.engine else None


def learn_key(container: ContainerDemand, product: str) -> LearnKey | None:
    """The key a container's measurements count under on a device of ``product``."""
    if _learnable(container) is None or not product:
        return None
    assert container.engine is not None
    return LearnKey(container.engine, container.engine_version or "unknown", product, container.gpus,
                    container.layout)


def learning_samples(state: ClusterState, nodes: Iterable[str] | None = None) -> Iterator[LearnSample]:
    """The samples of every measured pod-device with one learnable container on it."""
    for node in sorted(state.node_names()) if nodes is None else nodes:
        for pod in state.measured_pods(node):
            if pod.record is None:
                continue
            apps = [c for c in state.record_demand(pod.record).containers if not c.init]
            for device_id, measured in pod.used.items():
                gpu = pod.devices.get(device_id)
                if gpu is None or gpu.memory_bytes <= 0:
                    continue
                on = [c for c in apps if device_id in pod.placements.get(c.name, ())] if pod.placements else apps
                key = learn_key(on[0], gpu.product) if len(on) == 1 else None
                claim = _learnable(on[0]) if key is not None else None
                if key is None or claim is None:
                    continue
                certain = _certain(claim, gpu)
                yield LearnSample(key, pod.record.namespace, pod.uid, pod.record.name, max(0, measured - certain),
                                  _static(claim, gpu.product), max(0, gpu.memory_bytes - certain))


# -- applying the table -----------------------------------------------------------------------


def apply_learned(demand: PodDemand, learned: Mapping[LearnKey, LearnedAllowance]) -> PodDemand:
    """The demand with each learnable container's learned allowance: per product, the learned value
    less the static estimates where it is more (or, where downward learning is allowed, less)."""
    if not learned:
        return demand
    changed = False
    containers = []
    for container in demand.containers:
        claim = _learnable(container)
        if claim is None:
            containers.append(container)
            continue
        assert container.engine is not None
        version = container.engine_version or "unknown"
        by_product: list[tuple[str, int]] = []
        sources: list[str] = []
        for key, value in sorted(learned.items()):
            if (key.engine, key.version, key.gpus, key.layout) != (
                container.engine, version, container.gpus, container.layout
            ):
                continue
            difference = value.bytes - _static(claim, key.product)
            if difference > 0 or (difference < 0 and value.downward):
                by_product.append((key.product, difference))
                sources.append(value.source())
        if not by_product:
            containers.append(container)
            continue
        extra = Allowance(LEARNED, 0, "; ".join(sources) + " (beyond the static estimates; policy learning)",
                          by_product=tuple(by_product))
        kept = tuple(a for a in claim.allowances if a.name != LEARNED)
        containers.append(replace(container, claim=replace(claim, allowances=(*kept, extra))))
        changed = True
    return replace(demand, containers=tuple(containers)) if changed else demand
