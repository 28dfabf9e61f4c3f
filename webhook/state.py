"""What the webhook knows about the cluster, kept current by watches: namespaces, GPU nodes, GPU pods.

Each store is an :class:`vramguard.io.kube.Store` an :class:`vramguard.io.kube.Informer` fills. Only what the
rules need is kept: a namespace's labels; a node's GPU inventory and labels; for each live pod that
asks for a GPU, its namespace, node and claims as the quota counts them. The stores are touched
only from the event loop, so they need no locks.

A pod admitted a moment ago may not have reached the pod watch yet; without care two pods
reviewed back to back would both see the quota's old sum and both be admitted. So every GPU pod
admitted in a namespace with a quota is held as *pending* until the watch shows it (or
``PENDING_TTL`` passes: the API server may have refused it after the webhook admitted it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vramguard.admission import (
    NamespaceUsage,
    ResourceOffer,
    claims_bytes,
    offers_from_inventories,
    quota_claims,
)
from vramguard.demand import DemandOptions, derive_pod_demand
from vramguard.inventory import NodeInventory, read_inventory
from vramguard.io.kube import SuspectingStore
from vramguard.ledger import Claim

__all__ = ["PENDING_TTL", "FanOut", "NamespaceStore", "NodeStore", "PodStore"]

logger = logging.getLogger(__name__)

JSON = dict[str, Any]
# Long enough for the watch to deliver a created pod under load, short enough that a pod the API
# server refused after the webhook admitted it does not hold quota for long.
PENDING_TTL = 30.0
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


def _metadata(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    metadata = obj.get("metadata")
    return metadata if isinstance(metadata, Mapping) else {}


def _labels(obj: Mapping[str, Any]) -> dict[str, str]:
    labels = _metadata(obj).get("labels")
    if not isinstance(labels, Mapping):
        return {}
    return {k: v for k, v in labels.items() if isinstance(k, str) and isinstance(v, str)}


def _name(obj: Mapping[str, Any]) -> str:
    name = _metadata(obj).get("name")
    return name if isinstance(name, str) else ""


class FanOut:
    """One informer feeding several stores (the quota's and the cluster model's), so the webhook
    watches each kind once."""

    def __init__(self, *stores: Any) -> None:
        """Forward every event to each of ``stores`` (objects with replace, upsert and delete)."""
        self._stores = stores

    def replace(self, objects: list[JSON]) -> None:
        """The full list after a (re-)list."""
        for store in self._stores:
            store.replace(objects)

    def upsert(self, obj: JSON) -> None:
        """An object was added or changed."""
        for store in self._stores:
            store.upsert(obj)

    def delete(self, obj: JSON) -> None:
        """An object was deleted."""
        for store in self._stores:
            store.delete(obj)

    def suspect(self, nodes: frozenset[str]) -> None:
        """A watch event about ``nodes`` could not be read: the stores that can hold nodes back do."""
        for store in self._stores:
            if isinstance(store, SuspectingStore):
                store.suspect(nodes)


class NamespaceStore:
    """Labels of every namespace (they carry the enforcement mode and the default class)."""

    def __init__(self) -> None:
        """Start empty."""
        self._labels: dict[str, dict[str, str]] = {}

    def replace(self, objects: list[JSON]) -> None:
        """The full list after a (re-)list."""
        self._labels = {_name(o): _labels(o) for o in objects if _name(o)}

    def upsert(self, obj: JSON) -> None:
        """A namespace was added or changed."""
        if _name(obj):
            self._labels[_name(obj)] = _labels(obj)

    def delete(self, obj: JSON) -> None:
        """A namespace was deleted."""
        self._labels.pop(_name(obj), None)

    def labels(self, namespace: str) -> dict[str, str] | None:
        """The namespace's labels, or ``None`` when the watch has not shown it."""
        return self._labels.get(namespace)

    def __len__(self) -> int:
        """How many namespaces are known."""
        return len(self._labels)


class NodeStore:
    """GPU inventory and labels of every node, and what the cluster offers per GPU resource."""

    def __init__(self, gpu_resources: tuple[str, ...], mig_prefixes: tuple[str, ...]) -> None:
        """Read nodes with the policy's GPU resource names."""
        self._gpu_resources = gpu_resources
        self._mig_prefixes = mig_prefixes
        self._nodes: dict[str, tuple[NodeInventory, dict[str, str]]] = {}
        self._offers: dict[str, ResourceOffer] | None = None
        self._node_offers: dict[str, dict[str, ResourceOffer]] = {}
        self.generation = 0
        """Changes whenever what the nodes offer may have changed (sizes computed earlier are stale)."""

    def replace(self, objects: list[JSON]) -> None:
        """The full list after a (re-)list."""
        self._nodes = {}
        for obj in objects:
            self._put(obj)
        self._changed()

    def upsert(self, obj: JSON) -> None:
        """A node was added or changed (labels, allocatable, the agent's report)."""
        self._put(obj)
        self._changed()

    def delete(self, obj: JSON) -> None:
        """A node was deleted."""
        self._nodes.pop(_name(obj), None)
        self._changed()

    def _put(self, obj: JSON) -> None:
        name = _name(obj)
        if not name:
            return
        inventory = read_inventory(obj, gpu_resources=self._gpu_resources, mig_prefixes=self._mig_prefixes)
        self._nodes[name] = (inventory, _labels(obj))

    def _changed(self) -> None:
        self._offers = None
        self._node_offers = {}
        self.generation += 1

    def offers(self) -> dict[str, ResourceOffer]:
        """Per GPU resource, the sizes and sharing strategies of the devices nodes offer (cached)."""
        if self._offers is None:
            labels = {name: node_labels for name, (_, node_labels) in self._nodes.items()}
            self._offers = offers_from_inventories((inventory for inventory, _ in self._nodes.values()), labels)
        return self._offers

    def node_offers(self, node: str) -> dict[str, ResourceOffer] | None:
        """What one node offers, or ``None`` when the node is not known."""
        cached = self._node_offers.get(node)
        if cached is not None:
            return cached
        entry = self._nodes.get(node)
        if entry is None:
            return None
        inventory, labels = entry
        offers = offers_from_inventories([inventory], {node: labels})
        self._node_offers[node] = offers
        return offers

    def __len__(self) -> int:
        """How many nodes are known (with or without GPUs)."""
        return len(self._nodes)


@dataclass(frozen=True, slots=True)
class PodRecord:
    """A live GPU pod as the quota sees it."""

    namespace: str
    name: str
    node: str
    claims: tuple[Claim, ...]


@dataclass(frozen=True, slots=True)
class _NamespaceSum:
    """The bytes each live GPU pod of a namespace holds, as sized under one node generation."""

    generation: int
    held: dict[str, int]
    unsized: dict[str, str]
    """UID -> name of pods that could not be sized."""
    total: int


@dataclass(frozen=True, slots=True)
class _Pending:
    namespace: str
    node: str
    claims: tuple[Claim, ...]
    expires: float


class PodStore:
    """The live GPU pods of every namespace, and those admitted but not yet seen by the watch."""

    def __init__(
        self,
        options: DemandOptions,
        nodes: NodeStore,
        *,
        clock: Callable[[], float] = time.monotonic,
        trusts_env_only: Callable[[Mapping[str, Any]], bool] | None = None,
    ) -> None:
        """Derive pods' demand with ``options``; size their claims on ``nodes``.

        ``trusts_env_only`` says whether a pod's class believes engines recognised only from
        environment variables; where it does not, such a container counts as unknown VRAM (a whole
        device), as the rules count the pod under review.
        """
        self._options = options
        self._nodes = nodes
        self._clock = clock
        self._trusts_env_only = trusts_env_only
        self._pods: dict[str, PodRecord] = {}
        self._by_namespace: dict[str, set[str]] = {}
        self._pending: dict[str, _Pending] = {}
        # Sizing every pod of a namespace on every review would cost more than the rules; the sums
        # are kept per namespace until one of its pods or any node changes.
        self._sums: dict[str, _NamespaceSum] = {}

    # -- the watch -------------------------------------------------------------------------------

    def replace(self, objects: list[JSON]) -> None:
        """The full list after a (re-)list."""
        self._pods = {}
        self._by_namespace = {}
        self._sums = {}
        for obj in objects:
            self.upsert(obj)

    def upsert(self, obj: JSON) -> None:
        """A pod was added or changed: keep it while it is live and asks for a GPU."""
        metadata = _metadata(obj)
        uid = metadata.get("uid")
        if not isinstance(uid, str) or not uid:
            return
        self._pending.pop(uid, None)
        record = self._record(obj)
        if record is None:
            self._remove(uid)
            return
        previous = self._pods.get(uid)
        if previous == record:
            return  # a status or metadata change that moves no VRAM
        if previous is not None:
            self._remove(uid)
        self._pods[uid] = record
        self._by_namespace.setdefault(record.namespace, set()).add(uid)
        self._sums.pop(record.namespace, None)

    def delete(self, obj: JSON) -> None:
        """A pod was deleted (or left the watch's field selector by finishing)."""
        uid = _metadata(obj).get("uid")
        if isinstance(uid, str):
            self._pending.pop(uid, None)
            self._remove(uid)

    def _record(self, obj: Mapping[str, Any]) -> PodRecord | None:
        status = obj.get("status")
        if isinstance(status, Mapping) and status.get("phase") in TERMINAL_PHASES:
            return None  # a finished pod holds no GPU
        demand = derive_pod_demand(obj, self._options)
        if not demand.wants_gpu:
            return None
        if self._trusts_env_only is not None and demand.env_only_guesses() and not self._trusts_env_only(obj):
            demand = demand.distrusting_env_only()
        metadata = _metadata(obj)
        spec = obj.get("spec")
        node = spec.get("nodeName") if isinstance(spec, Mapping) else None
        namespace = metadata.get("namespace")
        return PodRecord(
            namespace=namespace if isinstance(namespace, str) else "",
            name=_name(obj),
            node=node if isinstance(node, str) else "",
            claims=quota_claims(demand),
        )

    def _remove(self, uid: str) -> None:
        record = self._pods.pop(uid, None)
        if record is None:
            return
        self._sums.pop(record.namespace, None)
        members = self._by_namespace.get(record.namespace)
        if members is not None:
            members.discard(uid)
            if not members:
                del self._by_namespace[record.namespace]

    # -- admissions ------------------------------------------------------------------------------

    def hold(self, uid: str, namespace: str, claims: tuple[Claim, ...], node: str = "") -> None:
        """Count a pod just admitted until the watch shows it (or ``PENDING_TTL`` passes)."""
        if uid in self._pods:
            return
        self._pending[uid] = _Pending(namespace, node, claims, self._clock() + PENDING_TTL)

    def usage(self, namespace: str, exclude: str | None = None) -> NamespaceUsage:
        """VRAM held by the namespace's live GPU pods and pending admissions, without pod ``exclude``.

        A bound pod is sized on its node's devices, a pod not bound yet on the largest device the
        cluster offers under its resource (it may land there).
        """
        sums = self._namespace_sum(namespace)
        total = sums.total - sums.held.get(exclude or "", 0)
        pods = len(sums.held) - (1 if exclude in sums.held else 0)
        unsized = [name for uid, name in sums.unsized.items() if uid != exclude]
        now = self._clock()
        for uid, pending in list(self._pending.items()):
            if pending.expires <= now:
                del self._pending[uid]
                continue
            if pending.namespace != namespace or uid == exclude:
                continue
            held, missing = claims_bytes(pending.claims, self._offers_for(pending.node))
            total += held
            pods += 1
            if missing:
                unsized.append(uid)
        return NamespaceUsage(total, pods, tuple(unsized))

    def _namespace_sum(self, namespace: str) -> _NamespaceSum:
        cached = self._sums.get(namespace)
        if cached is not None and cached.generation == self._nodes.generation:
            return cached
        held: dict[str, int] = {}
        unsized: dict[str, str] = {}
        for uid in self._by_namespace.get(namespace, ()):
            record = self._pods[uid]
            held[uid], missing = claims_bytes(record.claims, self._offers_for(record.node))
            if missing:
                unsized[uid] = record.name
        sums = _NamespaceSum(self._nodes.generation, held, unsized, sum(held.values()))
        self._sums[namespace] = sums
        return sums

    def _offers_for(self, node: str) -> Mapping[str, ResourceOffer]:
        """The bound node's offers when it is known, else the whole cluster's (the largest GPUs)."""
        offers = self._nodes.node_offers(node) if node else None
        return offers if offers is not None else self._nodes.offers()

    def pending(self) -> int:
        """Admissions not yet seen by the watch (expired ones included until the next usage call)."""
        return len(self._pending)

    def __len__(self) -> int:
        """How many live GPU pods are known."""
        return len(self._pods)
