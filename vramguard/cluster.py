"""The cluster as vramguard sees it: nodes, namespaces and bound GPU pods, kept by informers.

Everything here is derived from the API server, so a restart loses nothing: the ledger is rebuilt
from the Nodes (GPU Feature Discovery labels, the agent's report) and from the bound, non-terminal
pods that hold GPU resources, whoever placed them. Only a few fields of each object are kept.

Reservations made by ``bind`` that the watch has not confirmed yet are *in flight*; a re-list keeps
them, so no interleaving of watch events and binds can drop a reservation and overcommit a GPU.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cachetools import LRUCache

from vramguard.codecs import (
    AGENT_REPORT_ANNOTATION,
    PLACEMENT_ANNOTATION,
    VRAM_ANNOTATION,
    Placement,
    agent_lease_nodes,
    is_vramguard_key,
)
from vramguard.demand import DemandOptions, PodDemand, derive_pod_demand
from vramguard.inventory import NodeInventory, read_inventory
from vramguard.lease import DEFAULT_AGENT_NAMESPACE, AgentLeases
from vramguard.ledger import Ledger, PodRef
from vramguard.placement import PodClaims, apply_intended, pod_claims
from vramguard.policy import ClassChoice, Policy

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
JSON = dict[str, Any]
CACHED_DEMANDS = 4096
"""Distinct pod templates whose demand and claims are kept (least recently used dropped first):
replicas share one entry."""


PodKey = PodRef
"""What identifies a pod in messages and the ledger: the ledger's reference."""


def pod_key(pod: Mapping[str, Any]) -> PodKey:
    """UID, namespace and name of a pod object."""
    metadata = pod.get("metadata") or {}
    return PodKey(str(metadata.get("uid", "")), str(metadata.get("namespace", "")), str(metadata.get("name", "")))


_CONTAINER_FIELDS = ("name", "image", "command", "args", "env", "envFrom", "resources", "restartPolicy")


def slim_pod(pod: Mapping[str, Any]) -> JSON:
    """The fields of a pod the extender reads (demand, class, placement), nothing else."""
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    annotations = metadata.get("annotations") or {}
    slim_spec: JSON = {"nodeName": spec.get("nodeName"), "priority": spec.get("priority")}
    for field_name in ("containers", "initContainers"):
        containers = spec.get(field_name)
        if isinstance(containers, list):
            slim_spec[field_name] = [
                {k: c[k] for k in _CONTAINER_FIELDS if k in c} if isinstance(c, dict) else c for c in containers
            ]
    return {
        "metadata": {
            "uid": metadata.get("uid"),
            "name": metadata.get("name"),
            "namespace": metadata.get("namespace"),
            "resourceVersion": metadata.get("resourceVersion"),
            "labels": metadata.get("labels"),
            "annotations": {k: v for k, v in annotations.items() if is_vramguard_key(k)}
            if isinstance(annotations, dict) else None,
        },
        "spec": slim_spec,
        "status": {"phase": (pod.get("status") or {}).get("phase")},
    }


def slim_node(node: Mapping[str, Any]) -> JSON:
    """The fields of a node the inventory reads (labels, vramguard annotations, GPU capacity), and
    the taints that bind checks against the pod's tolerations."""
    metadata = node.get("metadata") or {}
    status = node.get("status") or {}
    spec = node.get("spec") or {}
    annotations = metadata.get("annotations") or {}
    return {
        "metadata": {
            "name": metadata.get("name"),
            "uid": metadata.get("uid"),
            "resourceVersion": metadata.get("resourceVersion"),
            "labels": metadata.get("labels"),
            "annotations": {k: v for k, v in annotations.items() if is_vramguard_key(k)}
            if isinstance(annotations, dict) else None,
        },
        "spec": {"taints": spec.get("taints") if isinstance(spec, dict) else None},
        "status": {"capacity": status.get("capacity"), "allocatable": status.get("allocatable")},
    }


def asks_for_gpu(pod: Mapping[str, Any], options: DemandOptions) -> bool:
    """A cheap check before deriving demand: does any container name a GPU resource?"""
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        return False
    for field_name in ("containers", "initContainers"):
        for container in spec.get(field_name) or ():
            resources = container.get("resources") if isinstance(container, dict) else None
            if not isinstance(resources, dict):
                continue
            for section in ("limits", "requests"):
                values = resources.get(section)
                if isinstance(values, dict) and any(options.is_gpu(k) for k in values):
                    return True
    return False


@dataclass(frozen=True, slots=True)
class NodeSelection:
    """What a pod's node selection and tolerations are checked against."""

    labels: Mapping[str, Any]
    taints: list[Any]


class ClusterState:
    """Nodes, namespaces and GPU pods, with the ledger that follows them."""

    def __init__(
        self,
        policy: Policy,
        *,
        clock: Callable[[], float] = time.time,
        agent_namespace: str = DEFAULT_AGENT_NAMESPACE,
    ) -> None:
        """``clock``: seconds since the epoch, for the agents' Leases; ``agent_namespace``: where they are."""
        self.policy = policy
        self.policy_version = 0
        """Counts policy reloads (cached verdicts are per version)."""
        self.options = demand_options(policy)
        self.ledger = Ledger(policy.headrooms())
        self.namespace_labels: dict[str, dict[str, str]] = {}
        self._inventories: dict[str, NodeInventory] = {}
        self._largest_node: int | None = None
        self._selection: dict[str, NodeSelection] = {}
        """Per node: what bind checks the pod's node selection and tolerations against."""
        self._bound: dict[str, str] = {}
        """Bound pod UID -> node, for the pods the ledger holds because the API says so."""
        self.in_flight: dict[str, tuple[str, PodRef, PodClaims]] = {}
        """Pod UID -> (node, pod, claims) reserved by bind and not yet seen bound by the watch."""
        self.priorities: dict[str, int] = {}
        """Bound pod UID -> its priority, for preemption."""
        self.nodes = _Delegate(self._replace_nodes, self._upsert_node, self._delete_node)
        self.pods = _SuspectingDelegate(self._relist_pods, self._upsert_pod, self._delete_pod, self._suspect)
        self.suspects: set[str] = set()
        """Nodes whose pods are being re-read after a watch event that could not be read."""
        self.namespaces = _Delegate(self._replace_namespaces, self._upsert_namespace, self._delete_namespace)
        self.agent_leases = AgentLeases(agent_namespace, clock)
        self._reported: dict[str, JSON] = {}
        """Nodes carrying an agent report, whose inventory changes when their agent's Lease does."""
        self.leases = _Delegate(self._replace_leases, self._upsert_lease, self._delete_lease)
        # Derived once per pod template, not per pod: replicas of a Deployment share their demand and
        # their claims (the same objects, so 50,000 pods of a few hundred templates hold few claims).
        self._demands: LRUCache[str, PodDemand] = LRUCache(CACHED_DEMANDS)
        self._claims: LRUCache[tuple[object, ...], PodClaims] = LRUCache(CACHED_DEMANDS)

    # -- policy -------------------------------------------------------------------------------

    def set_policy(self, policy: Policy) -> None:
        """Apply a reloaded policy: budgets follow the new headrooms."""
        self.policy = policy
        self.policy_version += 1
        self.options = demand_options(policy)
        self._demands.clear()
        self._claims.clear()
        self.ledger.set_headrooms(policy.headrooms())

    def choose_class(self, pod: Mapping[str, Any]) -> ClassChoice:
        """The class of a pod, from its labels and its namespace's."""
        metadata = pod.get("metadata") or {}
        labels = metadata.get("labels") if isinstance(metadata.get("labels"), dict) else None
        namespace = str(metadata.get("namespace", ""))
        return self.policy.choose_class(labels, self.namespace_labels.get(namespace))

    def claims_for(self, pod: Mapping[str, Any], choice: ClassChoice) -> PodClaims:
        """The pod's claims under its class (pods still to be placed)."""
        return self._pod_claims(pod, choice, pod_key(pod).uid)

    def devices_asked(self, pod: Mapping[str, Any]) -> int:
        """How many GPU devices the pod holds at once (from the cached demand): per resource, its
        app containers' sum or its largest init container's, whichever is more."""
        per_resource: dict[str, tuple[int, int]] = {}
        for container in self._demand(pod, _template_key(pod)).containers:
            apps, init = per_resource.get(container.resource, (0, 0))
            per_resource[container.resource] = (
                (apps, max(init, container.gpus)) if container.init else (apps + container.gpus, init)
            )
        return sum(max(apps, init) for apps, init in per_resource.values())

    def largest_node_devices(self) -> int:
        """The most GPU devices (replicas and MIG instances included) any one node hands out."""
        if self._largest_node is None:
            self._largest_node = max(
                (sum(gpu.replicas for gpu in inventory.devices) for inventory in self._inventories.values()), default=0
            )
        return self._largest_node

    def _pod_claims(
        self,
        pod: Mapping[str, Any],
        choice: ClassChoice,
        uid: str,
        recorded: Mapping[str, tuple[str, ...]] | None = None,
    ) -> PodClaims:
        """``pod_claims`` of the pod's demand, with ``recorded`` devices as intended; cached per template."""
        template = _template_key(pod)
        key = (template, choice.name, choice.qos.unknown_vram, tuple(sorted(recorded.items())) if recorded else ())
        shared = self._claims.get(key)
        if shared is None:
            shared = pod_claims(self._demand(pod, template), choice)
            if recorded:
                shared = PodClaims("", apply_intended(shared.claims, recorded), shared.init, shared.refusal)
            self._claims[key] = shared
        return PodClaims(uid, shared.claims, shared.init, shared.refusal)

    def _demand(self, pod: Mapping[str, Any], template: str) -> PodDemand:
        demand = self._demands.get(template)
        if demand is None:
            demand = self._demands[template] = derive_pod_demand(pod, self.options)
        return demand

    # -- nodes ----------------------------------------------------------------------------------

    def _upsert_node(self, node: JSON) -> None:
        self._remember_selection(node)
        inventory = read_inventory(
            node,
            gpu_resources=tuple(self.policy.gpu_resources),
            mig_prefixes=tuple(self.policy.gpu_resource_prefixes),
            distrust=self._report_distrust(node),
        )
        if self._inventories.get(inventory.node) == inventory:
            return  # a status heartbeat: nothing vramguard reads has changed
        self._inventories[inventory.node] = inventory
        self._largest_node = None
        self.ledger.upsert_node(inventory)

    def _delete_node(self, node: JSON) -> None:
        name = str((node.get("metadata") or {}).get("name", ""))
        self._inventories.pop(name, None)
        self._reported.pop(name, None)
        self._largest_node = None
        self._selection.pop(name, None)
        self.ledger.remove_node(name)

    def _replace_nodes(self, nodes: list[JSON]) -> None:
        seen = set()
        for node in nodes:
            self._upsert_node(node)
            seen.add(str((node.get("metadata") or {}).get("name", "")))
        for name in set(self._inventories) - seen:
            self._delete_node({"metadata": {"name": name}})

    # -- agent leases ---------------------------------------------------------------------------

    def _report_distrust(self, node: JSON) -> str | None:
        """Why the node's agent report is set aside now (``None``: trusted, or no report); remembers
        reporting nodes so that a Lease change or expiry can re-read them."""
        metadata = node.get("metadata") or {}
        name = str(metadata.get("name", ""))
        annotations = metadata.get("annotations")
        if not isinstance(annotations, dict) or AGENT_REPORT_ANNOTATION not in annotations:
            self._reported.pop(name, None)
            return None
        self._reported[name] = node
        return self.agent_leases.distrust(name)

    def refresh_agent_reports(self, nodes: Iterable[str] | None = None) -> list[str]:
        """Re-read the reporting nodes (or only ``nodes``) whose report's trust changed since it was
        read (a Lease renewed, deleted or expired); returns their names. Leases expire without any
        event, so the owner of the state calls this every few seconds."""
        changed = []
        for name in list(self._reported if nodes is None else nodes):
            node = self._reported.get(name)
            inventory = self._inventories.get(name)
            if node is None or inventory is None or inventory.distrust == self.agent_leases.distrust(name):
                continue
            self._upsert_node(node)
            changed.append(name)
        return changed

    def _upsert_lease(self, lease: JSON) -> None:
        name = self.agent_leases.upsert(lease)
        if name is not None:
            self.refresh_agent_reports(agent_lease_nodes(name, self._reported))

    def _delete_lease(self, lease: JSON) -> None:
        name = self.agent_leases.delete(lease)
        if name is not None:
            self.refresh_agent_reports(agent_lease_nodes(name, self._reported))

    def _replace_leases(self, leases: list[JSON]) -> None:
        self.agent_leases.replace(leases)
        self.refresh_agent_reports()

    def _remember_selection(self, node: JSON) -> None:
        metadata = node.get("metadata") or {}
        spec = node.get("spec") or {}
        labels = metadata.get("labels") if isinstance(metadata, dict) else None
        taints = spec.get("taints") if isinstance(spec, dict) else None
        self._selection[str(metadata.get("name", ""))] = NodeSelection(
            dict(labels) if isinstance(labels, dict) else {}, list(taints) if isinstance(taints, list) else []
        )

    def node_selection(self, name: str) -> NodeSelection | None:
        """The node's labels and taints as the watch last said, ``None`` for an unknown node."""
        return self._selection.get(name)

    # -- namespaces -----------------------------------------------------------------------------

    def _upsert_namespace(self, namespace: JSON) -> None:
        metadata = namespace.get("metadata") or {}
        labels = metadata.get("labels")
        self.namespace_labels[str(metadata.get("name", ""))] = dict(labels) if isinstance(labels, dict) else {}

    def _delete_namespace(self, namespace: JSON) -> None:
        self.namespace_labels.pop(str((namespace.get("metadata") or {}).get("name", "")), None)

    def _replace_namespaces(self, namespaces: list[JSON]) -> None:
        self.namespace_labels.clear()
        for namespace in namespaces:
            self._upsert_namespace(namespace)

    # -- pods -----------------------------------------------------------------------------------

    def bound_claims(self, pod: Mapping[str, Any]) -> PodClaims:
        """The claims of a pod already on a node: unknown VRAM holds a whole GPU, whatever its
        class says (it runs, so it counts), and the devices recorded at bind are kept as intended."""
        choice = self.choose_class(pod)
        if choice.qos.unknown_vram != "whole-gpu":
            whole_gpu = choice.qos.model_copy(update={"unknown_vram": "whole-gpu"})
            choice = ClassChoice(choice.name, whole_gpu, choice.source)
        annotations = (pod.get("metadata") or {}).get("annotations") or {}
        placement = annotations.get(PLACEMENT_ANNOTATION) if isinstance(annotations, dict) else None
        recorded = Placement.decode(placement).containers
        return self._pod_claims(pod, choice, pod_key(pod).uid, recorded)

    def _upsert_pod(self, pod: JSON) -> None:
        key = pod_key(pod)
        node = (pod.get("spec") or {}).get("nodeName")
        phase = (pod.get("status") or {}).get("phase")
        if not node or phase in TERMINAL_PHASES or not asks_for_gpu(pod, self.options):
            self._forget(key.uid)
            return
        self.in_flight.pop(key.uid, None)
        claims = self.bound_claims(pod)
        self.ledger.hold(node, key, claims.claims)
        self._bound[key.uid] = node
        self.priorities[key.uid] = pod_priority(pod)

    def _delete_pod(self, pod: JSON) -> None:
        self._forget(pod_key(pod).uid)

    def _forget(self, uid: str) -> None:
        self.priorities.pop(uid, None)
        node = self._bound.pop(uid, None)
        if node is None and uid in self.in_flight:
            return  # being bound right now; the bind itself releases it if it fails
        self.ledger.release(uid)

    def _replace_pods(self, pods: list[JSON]) -> None:
        self.priorities.clear()
        for uid in list(self._bound):
            del self._bound[uid]
            self.ledger.release(uid)
        for pod in pods:
            self._upsert_pod(pod)
        for uid, (node, ref, claims) in self.in_flight.items():
            if uid not in self._bound:
                self.ledger.hold(node, ref, claims.claims)

    # -- nodes held back after an unreadable watch event ---------------------------------------

    def _suspect(self, nodes: frozenset[str]) -> None:
        """A pod event about these nodes could not be read (over the size limit): until the pods
        are re-listed, their ledger may miss a bind or keep a deleted pod, so place nothing there."""
        self.suspects |= nodes

    def _relist_pods(self, pods: list[JSON]) -> None:
        """A full list of the bound pods: the ledger is exact again, every node is trusted."""
        self._replace_pods(pods)
        self.suspects.clear()

    def suspect_message(self, node: str) -> str | None:
        """Why nothing may be placed on ``node`` right now, or None (the usual case)."""
        if node in self.suspects:
            return f"node {node}: vramguard is re-reading its pods after an oversized watch event"
        return None

    # -- bind bookkeeping -----------------------------------------------------------------------

    def begin_bind(self, node: str, pod: PodKey, claims: PodClaims) -> None:
        """Remember a reservation bind made, until the watch shows the pod bound (or bind fails)."""
        self.in_flight[pod.uid] = (node, pod, claims)

    def abort_bind(self, uid: str) -> None:
        """Bind failed: release what it reserved, unless the watch already shows the pod bound."""
        entry = self.in_flight.pop(uid, None)
        if entry is not None and uid not in self._bound:
            self.ledger.release(uid)

    def is_bound(self, uid: str) -> str | None:
        """The node a pod is bound to, as the watch last said."""
        return self._bound.get(uid)

    def node_names(self) -> Iterable[str]:
        """Every node with an inventory."""
        return self._inventories.keys()


class _Delegate:
    """Adapts three callables to the informer's ``Store`` protocol."""

    def __init__(self, replace: Any, upsert: Any, delete: Any) -> None:
        self.replace = replace
        self.upsert = upsert
        self.delete = delete


def pod_priority(pod: Mapping[str, Any]) -> int:
    """``spec.priority`` (set by the API server from the PriorityClass), 0 when absent or not an int."""
    spec = pod.get("spec")
    value = spec.get("priority") if isinstance(spec, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class _SuspectingDelegate(_Delegate):
    """A :class:`_Delegate` that can also hold nodes back (``suspect``), for the pods."""

    def __init__(self, replace: Any, upsert: Any, delete: Any, suspect: Any) -> None:
        super().__init__(replace, upsert, delete)
        self.suspect = suspect


def demand_options(policy: Policy) -> DemandOptions:
    """Which resources are GPUs, from the policy."""
    return DemandOptions(frozenset(policy.gpu_resources), tuple(policy.gpu_resource_prefixes))


def _template_key(pod: Mapping[str, Any]) -> str:
    """What a pod's demand depends on, as text: its containers, init containers and VRAM annotations."""
    metadata = pod.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, dict) else None
    declared = (
        sorted((k, v) for k, v in annotations.items() if isinstance(k, str) and k.startswith(VRAM_ANNOTATION))
        if isinstance(annotations, dict)
        else None
    )
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        return json.dumps([declared, repr(spec)], default=repr)
    return json.dumps([declared, spec.get("initContainers"), spec.get("containers")], default=repr)
