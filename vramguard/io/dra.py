"""The watches of resource.k8s.io/v1 objects that feed the cluster model's DRA state.

A cluster without DRA (``resource.k8s.io/v1`` not served, e.g. switched off by
``--runtime-config``) answers 404: those watches then keep an empty store, count as synced, and
log once (:attr:`vramguard.io.kube.Informer.may_be_absent`), so the service works as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from vramguard.cluster import LIVE_PODS_SELECTOR
from vramguard.dra.state import DraState, claim_pod
from vramguard.dra.views import per_node_product
from vramguard.io.runtime import Watch

RESOURCE_API = "/apis/resource.k8s.io/v1"
RESOURCE_SLICES = f"{RESOURCE_API}/resourceslices"
DEVICE_CLASSES = f"{RESOURCE_API}/deviceclasses"
RESOURCE_CLAIMS = f"{RESOURCE_API}/resourceclaims"
RESOURCE_CLAIM_TEMPLATES = f"{RESOURCE_API}/resourceclaimtemplates"
PODS = "/api/v1/pods"


def _slim_pod(pod: dict[str, Any]) -> dict[str, Any]:
    """A pod using claims as the DRA state keeps it; any other pod, its name only (the store drops it)."""
    slim = claim_pod(pod)
    if slim is not None:
        return slim
    metadata = pod.get("metadata")
    if not isinstance(metadata, dict):
        metadata = {}
    return {"metadata": {"name": metadata.get("name"), "namespace": metadata.get("namespace")}}


def dra_watches(state: DraState, *, templates: bool = True) -> list[Watch]:
    """Watches for ResourceSlices, DeviceClasses, ResourceClaims, the live pods using claims, and
    (``templates``: admission needs them, the extender does not) ResourceClaimTemplates; marks
    ``state`` as watched.

    The pods' watch is a second one beside the cluster model's, which keeps GPU-resource pods only:
    every other pod is slimmed to nothing on arrival (:func:`vramguard.dra.state.claim_pod`), so it
    costs the decoding of pod events, not memory."""
    state.watched = True
    watches = [
        Watch(RESOURCE_SLICES, state.slices, may_be_absent=True),
        Watch(DEVICE_CLASSES, state.classes, may_be_absent=True),
        Watch(RESOURCE_CLAIMS, state.claims, may_be_absent=True),
        Watch(PODS, state.pods, {"fieldSelector": LIVE_PODS_SELECTOR}, slim=_slim_pod, name="pods-with-claims"),
    ]
    if templates:
        watches.append(Watch(RESOURCE_CLAIM_TEMPLATES, state.templates, may_be_absent=True))
    return watches


DRA_FAMILIES = (
    ("vramguard_dra_devices", "DRA GPU devices (GPUs and MIG devices in ResourceSlices) of one product on a node."),
    ("vramguard_dra_memory_bytes", "Memory of a node's DRA devices of one product."),
    ("vramguard_dra_consumed_bytes", "Memory allocated ResourceClaims consume on a node's DRA devices of one product."),
    ("vramguard_dra_shares", "Allocations (shares) held on a node's DRA devices of one product."),
    (
        "vramguard_dra_overcommitted_devices",
        "DRA devices of one product on a node whose claims consume more memory than they have.",
    ),
)


class DraMetrics(Collector):
    """The DRA devices and what claims consume on them, aggregated per node and product (as the
    ledger's per-node series are), computed at scrape time from the cached usage."""

    def __init__(self, state: DraState) -> None:
        self._state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """One family per figure, one series per node and product."""
        families = [GaugeMetricFamily(name, text, labels=("node", "product")) for name, text in DRA_FAMILIES]
        for total in per_node_product(self._state.usage().values()):
            labels = (total.node, total.product)
            values = (total.devices, total.memory_bytes, total.consumed_bytes, total.shares, total.overcommitted)
            for family, value in zip(families, values, strict=True):
                family.add_metric(labels, value)
        yield from families
