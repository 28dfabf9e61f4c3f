"""The demand model's error in the field: what it predicted each pod would use against what the agent
measured, per engine and engine version.

Pure: read from the cluster model (:class:`vramguard.cluster.ClusterState`): its pod records, their
demand (derived once per template) and the nodes' inventories, whose ``measured`` map is the agent's
report of the bytes each pod's processes use on each device (nothing when the agent's Lease is stale).
The extender renders the sums as gauges (:mod:`extender.metrics`) and ``vramguard audit`` lists the
pods measured over their prediction.

**One sample per measured pod and device.** The *prediction* on a device is the reservation of the
pod's app containers on it (``ContainerDemand.reservation``, sized by :meth:`Vram.on_device` for the
device's memory and product, allowances such as the CUDA context included): the containers the agent
reports on that device, or the pod's one GPU app container when the agent reports no placement for the
pod. Init containers that run to completion are left out: they are done by the time the app's use is
measured. A ceiling share (TGI) is sized as the ledger holds it, at least just over half the device's
budget, so a ceiling engine's predicted sum may well exceed its use. The demand is the model's own,
whatever the pod's class thinks of engines recognised from environment variables only.

**Keys.** A sample counts under ``(engine, version)``: the engine the model recognised and the version
read from its image tag (:data:`UNKNOWN_VERSION` when none). A container whose reservation comes from
a ``vramguard.io/vram`` declaration or an MPS pinned limit, engine recognised or not, is not the
engine model's prediction: it counts under :data:`DECLARED_ENGINE` (version :data:`UNKNOWN_VERSION`),
so that declarations that fall short are visible without blurring the engines' numbers.

**Skipped** (counted by reason, never guessed): a measured pod the model has no record of on that node,
a device of unknown size, a container with no reservation (VRAM unknown: nothing was predicted),
several GPU app containers without a placement from the agent, a device none of the pod's containers
is placed on, and a device shared by containers of different keys (the agent measures per pod, so
their use cannot be split).

**Over the prediction**: measured use more than :data:`vramguard.ledger_rule.MEASURED_TOLERANCE_BYTES`
above the prediction, the slack the ledger itself allows before it counts *over-use*.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from vramguard.cluster import ClusterState
from vramguard.demand.model import ContainerDemand, PodDemand
from vramguard.inventory import Gpu
from vramguard.ledger_rule import MEASURED_TOLERANCE_BYTES, whole_share

__all__ = [
    "DECLARED_ENGINE",
    "UNKNOWN_VERSION",
    "EngineTotals",
    "ModelAccuracy",
    "PodDeviceSample",
    "Skip",
    "model_accuracy",
    "node_samples",
    "predict_on_device",
]

DECLARED_ENGINE = "declared"
"""The key of reservations that a declaration or an MPS pinned limit sets, not an engine's rules."""
UNKNOWN_VERSION = "unknown"
"""The version of an engine whose image tag names none (and of :data:`DECLARED_ENGINE`)."""


class Skip:
    """Why a measured pod and device gives no sample (the reasons :attr:`ModelAccuracy.skipped` counts)."""

    NO_RECORD = "pod not known on the node"
    DEVICE_SIZE = "device size unknown"
    NO_PREDICTION = "VRAM unknown (no prediction)"
    NO_PLACEMENT = "several GPU containers, placement unknown"
    NOT_PLACED = "no container placed on the device"
    MIXED = "containers of different engines on the device"


@dataclass(frozen=True, slots=True)
class PodDeviceSample:
    """One pod on one device: what the model predicted there and what the agent measured."""

    namespace: str
    name: str
    node: str
    device: str
    """The device id on the node (``"0"``, ``"1g.10gb#2"``)."""
    engine: str
    version: str
    predicted: int
    """Bytes: the reservation of the pod's containers on the device, allowances included."""
    measured: int
    """Bytes the agent measured the pod's processes using on the device."""

    @property
    def excess(self) -> int:
        """Measured less predicted (negative when the pod uses less than predicted)."""
        return self.measured - self.predicted

    def to_json(self) -> dict[str, Any]:
        """The sample as a JSON object (bytes as integers)."""
        return {
            "namespace": self.namespace, "name": self.name, "node": self.node, "device": self.device,
            "engine": self.engine, "version": self.version, "predicted_bytes": self.predicted,
            "measured_bytes": self.measured, "excess_bytes": self.excess,
        }


@dataclass(slots=True)
class EngineTotals:
    """The samples of one ``(engine, version)``, summed."""

    predicted_bytes: int = 0
    measured_bytes: int = 0
    pod_devices: int = 0
    """Measured pod-devices counted here."""
    over: list[PodDeviceSample] = field(default_factory=list)
    """The samples measured over their prediction (beyond the tolerance)."""

    @property
    def pods_over(self) -> int:
        """Distinct pods with at least one device measured over its prediction."""
        return len({(s.namespace, s.name) for s in self.over})


@dataclass(slots=True)
class ModelAccuracy:
    """The model's predictions against the agent's measurements, per ``(engine, version)``."""

    tolerance: int = MEASURED_TOLERANCE_BYTES
    """Bytes above its prediction a measurement may be without counting as over it."""
    engines: dict[tuple[str, str], EngineTotals] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    """Measured pod-devices that gave no sample, by reason (:class:`Skip`)."""

    def add(self, sample: PodDeviceSample) -> None:
        """Count one sample."""
        totals = self.engines.get((sample.engine, sample.version))
        if totals is None:
            totals = self.engines[(sample.engine, sample.version)] = EngineTotals()
        totals.predicted_bytes += sample.predicted
        totals.measured_bytes += sample.measured
        totals.pod_devices += 1
        if sample.excess > self.tolerance:  # as the ledger's over_use: beyond the slack only
            totals.over.append(sample)

    def skip(self, reason: str) -> None:
        """Count a measured pod-device that gave no sample."""
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def add_node(self, state: ClusterState, node: str) -> None:
        """Count the samples of one node (so that a caller can spread the work over several slices)."""
        for sample in node_samples(state, node):
            if isinstance(sample, str):
                self.skip(sample)
            else:
                self.add(sample)

    def over_prediction(self) -> list[PodDeviceSample]:
        """Every sample measured over its prediction, largest excess first."""
        found = [sample for totals in self.engines.values() for sample in totals.over]
        found.sort(key=lambda s: (-s.excess, s.namespace, s.name, s.node, s.device))
        return found

    def to_json(self) -> dict[str, Any]:
        """Sums per engine and version, what was skipped, and the samples over their prediction."""
        return {
            "tolerance_bytes": self.tolerance,
            "engines": [
                {"engine": engine, "version": version, "predicted_bytes": t.predicted_bytes,
                 "measured_bytes": t.measured_bytes, "pod_devices": t.pod_devices, "pods_over": t.pods_over}
                for (engine, version), t in sorted(self.engines.items())
            ],
            "skipped": dict(sorted(self.skipped.items())),
            "over_prediction": [sample.to_json() for sample in self.over_prediction()],
        }


def _key(container: ContainerDemand) -> tuple[str, str] | None:
    """``(engine, version)`` of a container's reservation; ``None`` when it has none."""
    if container.declared is not None or container.mps_limit is not None:
        return DECLARED_ENGINE, UNKNOWN_VERSION
    if container.reservation is None:
        return None
    return container.engine or UNKNOWN_VERSION, container.engine_version or UNKNOWN_VERSION


def predict_on_device(
    demand: PodDemand,
    placements: Mapping[str, tuple[str, ...]] | None,
    device: Gpu,
    whole: int | None = None,
) -> tuple[str, str, int] | str:
    """What the model predicts a pod uses on ``device``: ``(engine, version, bytes)``, or why there
    is no prediction (a :class:`Skip` reason).

    ``placements``: the agent's container -> device ids of the pod (``None`` or empty: unknown);
    ``whole``: the device's whole share in the ledger (its budget, or one MPS replica's share), which
    a ceiling share is held within.
    """
    if device.memory_bytes <= 0:
        return Skip.DEVICE_SIZE
    apps = [c for c in demand.containers if not c.init]
    if placements:
        on_device = [c for c in apps for placed in placements.get(c.name, ()) if placed == device.id]
        if not on_device:
            return Skip.NOT_PLACED
    elif len(apps) == 1:
        on_device = apps
    else:
        return Skip.NO_PLACEMENT if apps else Skip.NOT_PLACED
    keys = {_key(c) for c in on_device}
    if None in keys:
        return Skip.NO_PREDICTION
    if len(keys) > 1:
        return Skip.MIXED
    (key,) = keys
    assert key is not None
    predicted = 0
    for container in on_device:
        held = container.held_on(device.memory_bytes, device.product, whole)
        assert held is not None
        predicted += held
    return key[0], key[1], predicted


def node_samples(state: ClusterState, node: str) -> Iterator[PodDeviceSample | str]:
    """The samples of the pods measured on ``node``, or for each pod-device that gives none, why
    (a :class:`Skip` reason). Nothing for a node without a trusted agent report."""
    for pod in state.measured_pods(node):
        record = pod.record
        if record is None:
            for _ in pod.used:
                yield Skip.NO_RECORD
            continue
        demand = state.record_demand(record)
        for device_id, measured in pod.used.items():
            gpu = pod.devices.get(device_id)
            if gpu is None:
                yield Skip.DEVICE_SIZE
                continue
            budget = state.ledger.budget(node, device_id)
            whole = whole_share(gpu, budget) if budget is not None else None
            prediction = predict_on_device(demand, pod.placements, gpu, whole)
            if isinstance(prediction, str):
                yield prediction
                continue
            engine, version, predicted = prediction
            yield PodDeviceSample(record.namespace, record.name, node, device_id, engine, version, predicted, measured)


def model_accuracy(
    state: ClusterState, nodes: Iterable[str] | None = None, *, tolerance: int = MEASURED_TOLERANCE_BYTES
) -> ModelAccuracy:
    """The model's predictions against the agent's measurements on ``nodes`` (default: every node)."""
    accuracy = ModelAccuracy(tolerance)
    for node in sorted(state.node_names()) if nodes is None else nodes:
        accuracy.add_node(state, node)
    return accuracy
