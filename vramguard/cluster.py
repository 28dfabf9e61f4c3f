"""The one cluster model: nodes, namespaces, GPU pods and agent Leases, fed by watch events.

Every service and CLI builds its picture of the cluster here: the extender (bound pods only), the
webhook (every live pod), ``vramguard audit`` and ``kubectl vram`` (one listing). Each kind has
``replace`` (a full list), ``upsert`` and ``delete``; the model keeps slim records, never objects:

- per node its inventory (GPU Feature Discovery labels, the agent's report under a fresh Lease),
  labels and taints, and what it offers per GPU resource (admission sizes pods on that);
- per namespace its labels (enforcement mode, default class);
- per live GPU pod a :class:`PodRecord` pointing at a shared :class:`Template` (replicas of a
  workload share one), from which demand is derived once per template and policy;
- the ledger of the bound GPU pods, whoever placed them; binds in flight; nodes held back;
- the quota's sums per namespace, and admissions pending (admitted, not yet seen by the watch).

Everything is derived from the API server, so a restart loses nothing. Reservations made by
``bind`` that the watch has not confirmed yet are *in flight*; a re-list keeps them, so no
interleaving of watch events and binds can drop a reservation and overcommit a GPU. Likewise a pod
admitted a moment ago may not have reached the pod watch yet: without care two pods reviewed back
to back would both see the quota's old sum and both be admitted, so it is held as *pending* until
the watch shows it (or :data:`PENDING_TTL` passes: the API server may have refused it after
admission). Whoever can reach the webhook can send it a review, so a pending admission is not
believed when it matters: before it refuses another pod, the webhook asks the API server whether its
pod exists (:meth:`ClusterState.unconfirmed_holds`, :meth:`ClusterState.settle_hold`). Touched only
from one event loop, so no locks.
"""

from __future__ import annotations

import json
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
from cachetools import LRUCache

from vramguard.admission import NamespaceUsage, claims_bytes, offers_from_inventories, quota_claims
from vramguard.codecs import (
    AGENT_REPORT_ANNOTATION,
    PLACEMENT_ANNOTATION,
    Placement,
    agent_lease_nodes,
)
from vramguard.demand import DemandOptions, PodDemand, derive_pod_demand
from vramguard.demand.derive import reads_annotation
from vramguard.dra.claims import ClaimAllocation, device_usage
from vramguard.dra.devices import DraDevice, DraInventory
from vramguard.dra.extended import DraLedgerPart, container_names, ledger_part, serving_classes
from vramguard.dra.review import DraContext
from vramguard.dra.state import DraState
from vramguard.inventory import Gpu, NodeInventory, read_inventory
from vramguard.learning import LearnedAllowance, LearnKey, apply_learned
from vramguard.lease import DEFAULT_AGENT_NAMESPACE, AgentLeases
from vramguard.ledger import Claim, Ledger, PodRef, ResourceOffer
from vramguard.placement import PodClaims, apply_intended, pod_claims
from vramguard.policy import ClassChoice, Policy
from vramguard.preemption import DisruptionBudgets
from vramguard.quantity import QuantityError, format_bytes, parse_quantity

_TERMINAL = ("Succeeded", "Failed")
TERMINAL_PHASES = frozenset(_TERMINAL)
"""A pod in these phases holds no GPU, whichever watch delivered it (see :func:`is_live`)."""
LIVE_PODS_SELECTOR = ",".join(f"status.phase!={phase}" for phase in _TERMINAL)
"""The field selector of a live-pod feed (the webhook, the CLI): a pod that finishes leaves it as DELETED."""
BOUND_PODS_SELECTOR = f"spec.nodeName!=,{LIVE_PODS_SELECTOR}"
"""The field selector of the bound-pod feed (the extender)."""
MAX_DISOWNED = 4096
"""Disowned holds remembered (a shared one lives :data:`PENDING_TTL` at most)."""
PENDING_TTL = 30.0
"""Seconds an admitted pod counts for its namespace's quota before the watch shows it: long enough
for the watch to deliver a created pod under load, short enough that a pod the API server refused
after the webhook admitted it does not hold quota for long."""
HOLD_GRACE = 1.0
"""Seconds after an admission before the API server is asked whether its pod exists: it stores the
pod only once every webhook has answered, a moment after this one."""
JSON = dict[str, Any]
CACHED_DEMANDS = 4096
"""Distinct pod templates whose demand and claims are kept (least recently used dropped first):
replicas share one entry."""


PodKey = PodRef
"""What identifies a pod in messages and the ledger: the ledger's reference."""


def pod_key(pod: Mapping[str, Any]) -> PodKey:
    """UID, namespace and name of a pod object. The namespace is interned: tens of thousands of
    pods share a few namespaces, and each decoded object brings its own copy of the name."""
    metadata = pod.get("metadata") or {}
    namespace = sys.intern(str(metadata.get("namespace", "")))
    return PodKey(str(metadata.get("uid", "")), namespace, str(metadata.get("name", "")))


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
            "annotations": {k: v for k, v in annotations.items() if reads_annotation(k)}
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
            "annotations": {k: v for k, v in annotations.items() if reads_annotation(k)}
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


def is_live(pod: Mapping[str, Any]) -> bool:
    """Whether a pod may hold a GPU: not Succeeded or Failed (the one terminal-phase rule)."""
    status = pod.get("status")
    return not (isinstance(status, Mapping) and status.get("phase") in TERMINAL_PHASES)


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class Template:
    """What a pod's demand depends on (containers, init containers, VRAM annotations), shared by
    every pod made from it: records point here, so demand is re-derived per template, not per pod."""

    key: str
    pod: JSON
    """A pod-shaped object holding only those fields (what :func:`derive_pod_demand` reads)."""
    quota: dict[tuple[int, bool], tuple[Claim, ...]] = field(default_factory=dict)
    """Claims as the quota counts them, per (policy version, trusts env-only engines)."""


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class PodLabels:
    """A pod's labels, one object per distinct set: the replicas of a workload share theirs."""

    values: Mapping[str, str]


NO_LABELS = PodLabels({})


@dataclass(frozen=True, slots=True)
class PodRecord:
    """A live GPU pod, as slim as the model keeps it."""

    namespace: str
    name: str
    node: str
    """``spec.nodeName``; empty while the pod is not bound."""
    template: Template
    trusts_env_only: bool
    """Whether the pod's class believes engines recognised from environment variables only; where
    it does not, such a container counts as unknown VRAM (a whole device), as admission counts it."""
    priority: int
    """``spec.priority``, for preemption."""
    labels: PodLabels = NO_LABELS
    """``metadata.labels``, which PodDisruptionBudgets select (preemption)."""


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
    name: str
    node: str
    claims: tuple[Claim, ...]
    made: float
    expires: float
    confirmed: bool = False
    """The API server showed its pod: it is no forgery, only not in the pod watch yet."""
    bytes: int | None = None
    """What it holds, as another replica counted it (its claims are not known here)."""


@dataclass(frozen=True, slots=True)
class SharedHold:
    """A pending admission as the webhook's replicas share it (through the API server): what it holds of
    its namespace's quota, until when (seconds since the epoch: replicas share no monotonic clock)."""

    uid: str
    name: str
    bytes: int
    expires: float


@dataclass(frozen=True, slots=True)
class HeldAdmission:
    """A pending admission whose pod the API server has not been asked about yet."""

    uid: str
    name: str
    age: float
    """Seconds since it was admitted."""


MAX_GROWTHS = 1000
"""Growths kept until reported (the oldest go first)."""


@dataclass(frozen=True, slots=True)
class Growth:
    """A bound pod whose claims changed while it ran, leaving devices of its node past their budget."""

    pod: PodKey
    node: str
    devices: tuple[tuple[str, int, int], ...]
    """(device label, bytes it may hold in the worst case, budget) of each device past its budget."""

    @property
    def message(self) -> str:
        """The growth in words, for an Event on the pod."""
        devices = "; ".join(
            f"{label} may hold {format_bytes(worst)} of its {format_bytes(budget)} budget"
            for label, worst, budget in self.devices
        )
        return (
            f"pod {self.pod.namespace}/{self.pod.name} changed while bound to {self.node} (a new image?) and now "
            f"claims more VRAM than its GPU has room for: {devices}"
        )


@dataclass(frozen=True, slots=True)
class MeasuredPod:
    """A pod the node agent measured (:meth:`ClusterState.measured_pods`)."""

    uid: str
    record: PodRecord | None
    used: Mapping[str, int]
    """Bytes per device id."""
    devices: Mapping[str, Gpu]
    """The node's devices by id."""
    placements: Mapping[str, tuple[str, ...]] | None
    """Container -> device ids, when the agent knows them."""


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
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: seconds since the epoch, for the agents' Leases; ``agent_namespace``: where they
        are; ``monotonic``: for the expiry of pending admissions."""
        self.policy = policy
        self.policy_version = 0
        """Counts policy reloads and learned-table changes (cached verdicts are per version)."""
        self.learned: Mapping[LearnKey, LearnedAllowance] = {}
        """Allowances learned from the fleet (:mod:`vramguard.learning`), applied to every demand."""
        self.options = policy.demand_options()
        self.ledger = Ledger(policy.budget_rule())
        self.namespace_labels: dict[str, dict[str, str]] = {}
        self._inventories: dict[str, NodeInventory] = {}
        self._largest_node: int | None = None
        self._selection: dict[str, NodeSelection] = {}
        """Per node: what bind checks the pod's node selection and tolerations against."""
        self.in_flight: dict[str, tuple[str, PodRef, PodClaims]] = {}
        """Pod UID -> (node, pod, claims) reserved by bind and not yet seen bound by the watch."""
        self.nodes = _Delegate(self._replace_nodes, self._upsert_node, self._delete_node)
        self.pods = _SuspectingDelegate(
            self._relist_pods, self._upsert_pod, self._delete_pod, self._suspect, self._begin_pods_relist
        )
        self.suspects: set[str] = set()
        """Nodes whose pods are being re-read after a watch event that could not be read."""
        self.namespaces = _Delegate(self._replace_namespaces, self._upsert_namespace, self._delete_namespace)
        self.agent_leases = AgentLeases(agent_namespace, clock)
        self._reported: dict[str, JSON] = {}
        """Nodes carrying an agent report, whose inventory changes when their agent's Lease does."""
        self.leases = _Delegate(self._replace_leases, self._upsert_lease, self._delete_lease)
        # Derived once per pod template, not per pod: replicas of a Deployment share their demand and
        # their claims (the same objects, so 50,000 pods of a few hundred templates hold few claims).
        self._derived: LRUCache[str, PodDemand] = LRUCache(CACHED_DEMANDS)
        """Per template, the demand as the policy derives it: kept when the learned table changes."""
        self._demands: LRUCache[str, PodDemand] = LRUCache(CACHED_DEMANDS)
        """Per template, the derived demand with the learned allowances applied."""
        self._claims: LRUCache[tuple[object, ...], PodClaims] = LRUCache(CACHED_DEMANDS)
        self._templates: weakref.WeakValueDictionary[str, Template] = weakref.WeakValueDictionary()
        """Every template a record points at, once (it goes with its last record)."""
        self._label_sets: weakref.WeakValueDictionary[tuple[tuple[str, str], ...], PodLabels] = (
            weakref.WeakValueDictionary()
        )
        """Every label set a record points at, once (it goes with its last record)."""
        self.disruption_budgets = DisruptionBudgets()
        """PodDisruptionBudgets (fed only where their watch runs: the extender, for preemption)."""
        self.records: dict[str, PodRecord] = {}
        """Pod UID -> record, for every live pod naming a GPU resource that the pod feed delivered
        (bound or not); the bound ones are those the ledger holds because the API says so."""
        self._by_namespace: dict[str, dict[str, None]] = {}
        """Namespace -> the UIDs of its records (a dict as an ordered set: a third of a set's memory)."""
        self._pending: dict[str, _Pending] = {}
        self._disowned: dict[str, None] = {}
        """Holds found to have no pod (:meth:`settle_hold`), oldest first: not adopted again."""
        self._monotonic = monotonic
        # Sizing every pod of a namespace on every review would cost more than the rules; the sums
        # are kept per namespace until one of its pods or any node changes.
        self._sums: dict[str, _NamespaceSum] = {}
        self.node_generation = 0
        """Changes whenever what the nodes offer may have changed (sizes computed earlier are stale)."""
        self._offers: dict[str, ResourceOffer] | None = None
        self._node_offers: dict[str, dict[str, ResourceOffer]] = {}
        self._plugin_resources: dict[str, frozenset[str]] = {}
        """Per node, the extended resources its status advertises (a device plugin serves them there)."""
        self.dra = DraState()
        """DRA devices, classes and claims (fed only where their watches run: :mod:`vramguard.io.dra`)."""
        self._dra_context: tuple[tuple[int, int], DraContext] | None = None
        self._label_inventories: dict[str, NodeInventory] = {}
        """Per node, its inventory before DRA devices are added (what its labels and agent say)."""
        self._dra_parts: dict[str, DraLedgerPart] = {}
        """Per node, the DRA devices and placements in its ledger inventory (extended-resource path)."""
        self._dra_synced: tuple[int, int, int] | None = None
        self._dra_pod_changes = 0
        """Counts bound pods appearing on DRA nodes: their placements come from their claims."""
        self._dra_pods_seen: set[str] = set()
        """DRA nodes where a pod appeared bound since the last sync."""
        self._dra_inputs: dict[str, tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]] = {}
        """Per DRA node, what its ledger part was computed from (see :meth:`sync_dra`)."""
        self.grown: deque[Growth] = deque(maxlen=MAX_GROWTHS)
        """Bound pods whose claims grew past a device's budget (an image changed on a running pod,
        past the webhook), oldest first, for the extender to report (:meth:`take_growths`)."""

    # -- policy -------------------------------------------------------------------------------

    def set_policy(self, policy: Policy) -> None:
        """Apply a reloaded policy: budgets follow the new margins, claims the new allowances."""
        self.policy = policy
        self.policy_version += 1
        self.options = policy.demand_options()
        self._derived.clear()
        self._demands.clear()
        self._claims.clear()
        self._sums.clear()  # the quota's claims are re-derived per template under the new policy
        self.ledger.set_budget_rule(policy.budget_rule())

    def set_learned(self, learned: Mapping[LearnKey, LearnedAllowance]) -> bool:
        """Apply a new table of learned allowances; ``False`` when it is the one applied. Pods still to
        be placed are sized with it at once; a bound pod keeps what it was held with until its next
        event or re-list (what the agent measures it using counts meanwhile)."""
        if dict(learned) == dict(self.learned):
            return False
        self.learned = dict(learned)
        self.policy_version += 1
        self._demands.clear()
        self._claims.clear()
        self._sums.clear()
        return True

    def choose_class(self, pod: Mapping[str, Any]) -> ClassChoice:
        """The class of a pod, from its labels and its namespace's."""
        metadata = pod.get("metadata") or {}
        labels = metadata.get("labels") if isinstance(metadata.get("labels"), dict) else None
        namespace = str(metadata.get("namespace", ""))
        return self.policy.choose_class(labels, self.namespace_labels.get(namespace))

    def claims_for(self, pod: Mapping[str, Any], choice: ClassChoice, template: str | None = None) -> PodClaims:
        """The pod's claims under its class (pods still to be placed); ``template``: the pod's
        :func:`pod_template_key`, when the caller has it."""
        return self._pod_claims(pod, choice, pod_key(pod).uid, template_key=template)

    def devices_asked(self, pod: Mapping[str, Any], template: str | None = None) -> int:
        """How many GPU devices the pod holds at once (from the cached demand), as kube-scheduler
        counts them (:meth:`PodDemand.devices_per_resource`). ``template``: the pod's
        :func:`pod_template_key`, when the caller has it."""
        demand = self._demand(pod, pod_template_key(pod) if template is None else template)
        return sum(demand.devices_per_resource().values())

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
        template_key: str | None = None,
    ) -> PodClaims:
        """``pod_claims`` of the pod's demand, with ``recorded`` devices as intended; cached per template."""
        template = pod_template_key(pod) if template_key is None else template_key
        key = (template, choice.name, choice.qos.unknown_vram, tuple(sorted(recorded.items())) if recorded else ())
        shared = self._claims.get(key)
        if shared is None:
            shared = pod_claims(self._demand(pod, template), choice)
            if recorded:
                shared = PodClaims("", apply_intended(shared.claims, recorded), shared.init, shared.refusal)
            self._claims[key] = shared
        return PodClaims(uid, shared.claims, shared.init, shared.refusal)

    def record_demand(self, record: PodRecord) -> PodDemand:
        """The demand of a recorded pod, as the model derived it (once per template and policy)."""
        return self._demand(record.template.pod, record.template.key)

    def _demand(self, pod: Mapping[str, Any], template: str) -> PodDemand:
        demand = self._demands.get(template)
        if demand is None:
            derived = self._derived.get(template)
            if derived is None:
                derived = self._derived[template] = derive_pod_demand(pod, self.options)
            demand = self._demands[template] = apply_learned(derived, self.learned)
        return demand

    # -- nodes ----------------------------------------------------------------------------------

    def _upsert_node(self, node: JSON) -> None:
        labels_changed = self._remember_plugin_resources(node) | self._remember_selection(node)
        inventory = self._with_dra(self._read_inventory(node, self._report_distrust(node)))
        if self._inventories.get(inventory.node) == inventory:
            if labels_changed:
                self._nodes_changed()
            return  # a status heartbeat: nothing vramguard reads has changed
        self._inventories[inventory.node] = inventory
        self._nodes_changed()
        self.ledger.upsert_node(inventory)

    def _read_inventory(self, node: Mapping[str, Any], distrust: str | None) -> NodeInventory:
        return read_inventory(
            node,
            gpu_resources=tuple(self.policy.gpu_resources),
            mig_prefixes=tuple(self.policy.gpu_resource_prefixes),
            distrust=distrust,
        )

    def _delete_node(self, node: JSON) -> None:
        name = str((node.get("metadata") or {}).get("name", ""))
        self._inventories.pop(name, None)
        self._reported.pop(name, None)
        self._nodes_changed()
        self._selection.pop(name, None)
        self._plugin_resources.pop(name, None)
        self._label_inventories.pop(name, None)
        self._dra_parts.pop(name, None)
        self._dra_inputs.pop(name, None)
        self.ledger.remove_node(name)

    def _nodes_changed(self) -> None:
        self._largest_node = None
        self._offers = None
        self._node_offers = {}
        self.node_generation += 1

    def offers(self) -> dict[str, ResourceOffer]:
        """Per GPU resource, the sizes and sharing strategies of the devices nodes offer (cached)."""
        if self._offers is None:
            self._offers = offers_from_inventories(
                (self._offer_inventory(name) for name in self._inventories), self._offer_labels()
            )
        return self._offers

    def node_offers(self, node: str) -> dict[str, ResourceOffer] | None:
        """What one node offers, or ``None`` when the node is not known."""
        cached = self._node_offers.get(node)
        if cached is not None:
            return cached
        if node not in self._inventories:
            return None
        offers = offers_from_inventories([self._offer_inventory(node)], self._offer_labels([node]))
        self._node_offers[node] = offers
        return offers

    def _offer_inventory(self, name: str) -> NodeInventory:
        """The node's inventory as admission sizes pods on it: the agent's report as written, even
        without a fresh Lease (admission sizes the devices; only the ledger's placements need the
        report to be current)."""
        inventory = self._inventories[name]
        reported = self._reported.get(name)
        if inventory.distrust is None or reported is None:
            return inventory
        return self._read_inventory(reported, None)

    def _offer_labels(self, names: Iterable[str] | None = None) -> dict[str, dict[str, str]]:
        chosen = self._selection if names is None else {n: self._selection[n] for n in names if n in self._selection}
        return {
            name: {k: v for k, v in selection.labels.items() if isinstance(k, str) and isinstance(v, str)}
            for name, selection in chosen.items()
        }

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

    def _remember_selection(self, node: JSON) -> bool:
        """Keep the node's labels and taints; returns whether its labels changed."""
        metadata = node.get("metadata") or {}
        spec = node.get("spec") or {}
        labels = metadata.get("labels") if isinstance(metadata, dict) else None
        taints = spec.get("taints") if isinstance(spec, dict) else None
        name = str(metadata.get("name", ""))
        previous = self._selection.get(name)
        selection = self._selection[name] = NodeSelection(
            _interned(labels) if isinstance(labels, dict) else {}, list(taints) if isinstance(taints, list) else []
        )
        return previous is None or previous.labels != selection.labels

    def node_selection(self, name: str) -> NodeSelection | None:
        """The node's labels and taints as the watch last said, ``None`` for an unknown node."""
        return self._selection.get(name)

    # -- namespaces -----------------------------------------------------------------------------

    def _upsert_namespace(self, namespace: JSON) -> None:
        metadata = namespace.get("metadata") or {}
        labels = metadata.get("labels")
        self.namespace_labels[str(metadata.get("name", ""))] = (
            {k: v for k, v in labels.items() if isinstance(k, str) and isinstance(v, str)}
            if isinstance(labels, dict)
            else {}
        )

    def upsert_namespace(self, namespace: Mapping[str, Any]) -> None:
        """A namespace read outside the watch (one the watch has not delivered yet)."""
        self._upsert_namespace(dict(namespace))

    def _delete_namespace(self, namespace: JSON) -> None:
        self.namespace_labels.pop(str((namespace.get("metadata") or {}).get("name", "")), None)

    def _replace_namespaces(self, namespaces: list[JSON]) -> None:
        self.namespace_labels.clear()
        for namespace in namespaces:
            self._upsert_namespace(namespace)

    # -- pods -----------------------------------------------------------------------------------

    def bound_claims(
        self, pod: Mapping[str, Any], choice: ClassChoice | None = None, template: Template | None = None
    ) -> PodClaims:
        """The claims of a pod already on a node: unknown VRAM holds a whole GPU, whatever its
        class says (it runs, so it counts), and the devices recorded at bind are kept as intended."""
        choice = self.choose_class(pod) if choice is None else choice
        if choice.qos.unknown_vram != "whole-gpu":
            whole_gpu = choice.qos.model_copy(update={"unknown_vram": "whole-gpu"})
            choice = ClassChoice(choice.name, whole_gpu, choice.source)
        annotations = (pod.get("metadata") or {}).get("annotations") or {}
        placement = annotations.get(PLACEMENT_ANNOTATION) if isinstance(annotations, dict) else None
        recorded = Placement.decode(placement).containers
        return self._pod_claims(pod, choice, pod_key(pod).uid, recorded, template.key if template else None)

    def _upsert_pod(self, pod: JSON) -> None:
        """Either feed: every live pod (the webhook, the CLI) or the bound ones (the extender)."""
        key = pod_key(pod)
        self._pending.pop(key.uid, None)
        was_bound = self.is_bound(key.uid) is not None
        entry = self._pod_entry(pod, key)
        if entry is None:
            self._drop_record(key.uid)
            self._release(key.uid, was_bound)
            return
        self._apply_pod(entry, was_bound)

    def _pod_entry(self, pod: Mapping[str, Any], key: PodKey) -> _PodEntry | None:
        """What the model keeps of a pod (its record, and its claims when bound), read from the
        object without changing anything; ``None`` for a pod that holds no GPU."""
        if not is_live(pod) or not asks_for_gpu(pod, self.options):
            return None
        spec = pod.get("spec")
        node = spec.get("nodeName") if isinstance(spec, Mapping) else None
        # Interned: a node's pods share one copy of its name (each decoded object brings its own).
        node = sys.intern(str(node)) if node and isinstance(node, str) else ""
        choice = self.choose_class(pod)
        template = self._template(pod)
        record = PodRecord(
            key.namespace, key.name, node, template, choice.qos.trust_env_only_engines, pod_priority(pod),
            self._labels(pod),
        )
        # An unchanged pod (most of a re-list) keeps the objects the model holds: the new state being
        # built shares them with the old one instead of doubling the memory of every record.
        if self.records.get(key.uid) == record:
            record = self.records[key.uid]
        held = self.ledger.holding(key.uid)
        if held is not None and held[0] == key:
            key = held[0]
        return _PodEntry(key, record, self.bound_claims(pod, choice, template).claims if node else None)

    def _apply_pod(self, entry: _PodEntry, was_bound: bool) -> None:
        """Keep a pod's record, and hold its claims in the ledger when it is bound."""
        key, record = entry.key, entry.record
        if entry.claims is None:
            self._record(key, record)
            self._release(key.uid, was_bound)
            return
        self.in_flight.pop(key.uid, None)
        if record.node in self._dra_parts and not was_bound:
            # Its placement comes from its claim, read at the next sync.
            self._dra_pod_changes += 1
            self._dra_pods_seen.add(record.node)
        held = self.ledger.holding(key.uid) if was_bound else None
        changed = held is not None and held[1] == record.node and held[2] != entry.claims
        before = (
            {row.device.id: row.worst_bytes for row in self.ledger.usage(record.node, pods=False)} if changed else None
        )
        self.ledger.hold(record.node, key, entry.claims)
        if before is not None:
            self._note_growth(key, record.node, before)
        self._record(key, record)

    def _note_growth(self, pod: PodKey, node: str, before: Mapping[str, int]) -> None:
        """A bound pod's claims changed: the devices of its node it took past their budget, if any
        (those already past it keep being reported by the ledger's metrics)."""
        over = [
            row for row in self.ledger.usage(node, pods=False)
            if row.over_budget and row.worst_bytes > before.get(row.device.id, 0)
        ]
        if over:
            self.grown.append(Growth(pod, node, tuple((row.device.label, row.worst_bytes, row.budget) for row in over)))

    def take_growths(self) -> list[Growth]:
        """The growths noted since the last call (see :attr:`grown`)."""
        taken = list(self.grown)
        self.grown.clear()
        return taken

    def _delete_pod(self, pod: JSON) -> None:
        uid = pod_key(pod).uid
        self._pending.pop(uid, None)
        was_bound = self.is_bound(uid) is not None
        self._drop_record(uid)
        self._release(uid, was_bound)

    def _record(self, key: PodKey, record: PodRecord) -> None:
        """Keep the record of a live pod that names a GPU resource (bound, or ``node`` empty)."""
        if not key.uid:
            return
        previous = self.records.get(key.uid)
        if previous == record:
            return  # a status or metadata change that moves no VRAM
        if previous is not None:
            self._drop_record(key.uid)
        self.records[key.uid] = record
        self._by_namespace.setdefault(record.namespace, {})[key.uid] = None
        self._sums.pop(record.namespace, None)

    def _template(self, pod: Mapping[str, Any]) -> Template:
        """The pod's template, interned: replicas share one object."""
        key = pod_template_key(pod)
        template = self._templates.get(key)
        if template is None:
            template = self._templates[key] = Template(key, _template_pod(pod))
        return template

    def _labels(self, pod: Mapping[str, Any]) -> PodLabels:
        """The pod's labels, interned: replicas share one object."""
        metadata = pod.get("metadata")
        labels = metadata.get("labels") if isinstance(metadata, Mapping) else None
        if not isinstance(labels, Mapping) or not labels:
            return NO_LABELS
        key = tuple(sorted((k, v) for k, v in labels.items() if isinstance(k, str) and isinstance(v, str)))
        interned = self._label_sets.get(key)
        if interned is None:
            interned = self._label_sets[key] = PodLabels(_interned(dict(key)))
        return interned

    def _drop_record(self, uid: str) -> None:
        record = self.records.pop(uid, None)
        if record is None:
            return
        self._sums.pop(record.namespace, None)
        members = self._by_namespace.get(record.namespace)
        if members is not None:
            members.pop(uid, None)
            if not members:
                del self._by_namespace[record.namespace]

    def _release(self, uid: str, was_bound: bool) -> None:
        """The pod holds nothing the watch says (any more): free what the ledger holds for it."""
        if not was_bound and uid in self.in_flight:
            return  # being bound right now; the bind itself releases it if it fails
        self.ledger.release(uid)

    def _replace_pods(self, pods: list[JSON]) -> None:
        replacement = _PodsReplacement(self, clears_suspects=False)
        replacement.add(pods)
        replacement.commit()

    def _commit_pods(self, entries: dict[str, _PodEntry], pending_seen: set[str]) -> None:
        """Swap in a complete list of pods (read into ``entries``, by UID), in one step: the ledger
        holds exactly what the list says, plus the binds still in flight. A pod the list shows
        unchanged keeps its record and holding (most of a re-list): nothing is rebuilt for it."""
        for uid, record in list(self.records.items()):
            entry = entries.get(uid)
            if entry is not None and entry.record is record and self._holds_as_listed(entry):
                continue
            if record.node:
                self.ledger.release(uid)
            self._drop_record(uid)
        for uid in pending_seen:
            self._pending.pop(uid, None)
        for entry in entries.values():
            self._apply_pod(entry, was_bound=self.is_bound(entry.key.uid) is not None)
        for uid, (node, ref, claims) in self.in_flight.items():
            if self.is_bound(uid) is None:
                self.ledger.hold(node, ref, claims.claims)

    def _holds_as_listed(self, entry: _PodEntry) -> bool:
        """Whether the ledger holds what a listed pod claims (nothing, when it is not bound)."""
        if entry.claims is None:
            return True
        held = self.ledger.holding(entry.key.uid)
        return held is not None and held[1] == entry.record.node and held[2] == entry.claims

    # -- nodes held back after an unreadable watch event ---------------------------------------

    def _suspect(self, nodes: frozenset[str]) -> None:
        """A pod event about these nodes could not be read (over the size limit): until the pods
        are re-listed, their ledger may miss a bind or keep a deleted pod, so place nothing there."""
        self.suspects |= nodes

    def _relist_pods(self, pods: list[JSON]) -> None:
        """A full list of the pods: the ledger is exact again, every node is trusted."""
        replacement = self._begin_pods_relist()
        replacement.add(pods)
        replacement.commit()

    def _begin_pods_relist(self) -> _PodsReplacement:
        """A re-list of the pods, read page by page (see :class:`_PodsReplacement`)."""
        return _PodsReplacement(self, clears_suspects=True)

    def suspect_message(self, node: str) -> str | None:
        """Why nothing may be placed on ``node`` right now, or None (the usual case)."""
        if node in self.suspects:
            return f"node {node}: vramguard is re-reading its pods after an oversized watch event"
        return None

    # -- the quota: live GPU pods and admissions pending ---------------------------------------

    def quota_claims(self, record: PodRecord) -> tuple[Claim, ...]:
        """A live pod's claims as the quota counts them (unknown VRAM holds a whole device), derived
        once per template, policy and trust in env-only engines."""
        key = (self.policy_version, record.trusts_env_only)
        claims = record.template.quota.get(key)
        if claims is None:
            demand = self._demand(record.template.pod, record.template.key)
            if not record.trusts_env_only and demand.env_only_guesses():
                demand = demand.distrusting_env_only()
            if any(version != self.policy_version for version, _ in record.template.quota):
                record.template.quota.clear()
            claims = record.template.quota[key] = quota_claims(demand)
        return claims

    def hold_admission(
        self, uid: str, namespace: str, name: str, claims: tuple[Claim, ...], node: str = ""
    ) -> None:
        """Count pod ``namespace/name`` (``uid``), just admitted, until the watch shows it (or
        :data:`PENDING_TTL` passes, or the API server says it does not exist)."""
        if uid in self.records:
            return
        now = self._monotonic()
        self._pending[uid] = _Pending(namespace, name, node, claims, now, now + PENDING_TTL)

    def shared_hold(self, uid: str, wall_clock: float) -> SharedHold | None:
        """This replica's pending admission ``uid`` as the other replicas are to count it."""
        pending = self._pending.get(uid)
        if pending is None:
            return None
        held, _ = claims_bytes(pending.claims, self._offers_for(pending.node))
        return SharedHold(uid, pending.name, held, wall_clock + (pending.expires - self._monotonic()))

    def adopt_holds(self, namespace: str, holds: Iterable[SharedHold], wall_clock: float) -> None:
        """Count the pending admissions other replicas share for ``namespace`` (those the pod watch has
        not shown, not expired, not known here and not disowned: a hold found to have no pod is not
        taken back from the shared record)."""
        now = self._monotonic()
        for hold in holds:
            left = hold.expires - wall_clock
            if left <= 0 or hold.uid in self.records or hold.uid in self._pending or hold.uid in self._disowned:
                continue
            self._pending[hold.uid] = _Pending(
                namespace, hold.name, "", (), now, now + min(left, PENDING_TTL), bytes=max(hold.bytes, 0)
            )

    def unreadable_nodes(self) -> list[str]:
        """Nodes advertising GPUs whose memory nobody can read (:data:`vramguard.inventory.UNREADABLE`):
        no budget is checked there (refused where a namespace enforces, unguarded elsewhere)."""
        return sorted(name for name, inventory in self._inventories.items()
                      if any(gpu.memory_bytes == 0 for gpu in inventory.devices))

    def drop_hold(self, uid: str) -> None:
        """Forget this replica's pending admission ``uid`` (its decision is being made again)."""
        self._pending.pop(uid, None)

    def is_settled(self, uid: str) -> bool:
        """Whether a shared hold needs no sharing any more: the watch shows its pod, or it was disowned."""
        return uid in self.records or uid in self._disowned

    def unconfirmed_holds(self, namespace: str, exclude: str | None = None) -> list[HeldAdmission]:
        """The namespace's pending admissions (other than pod ``exclude``) whose pod the API server
        has not shown yet."""
        now = self._monotonic()
        return [
            HeldAdmission(uid, pending.name, now - pending.made)
            for uid, pending in self._pending.items()
            if pending.namespace == namespace and uid != exclude and not pending.confirmed and pending.expires > now
        ]

    def settle_hold(self, uid: str, pod: Mapping[str, Any] | None) -> bool:
        """What the API server answered about a pending admission's pod (``None``: it does not exist):
        the hold stays, confirmed, where that pod is the one admitted (same UID) and asks for a GPU, and
        is dropped otherwise. Returns whether it was dropped."""
        pending = self._pending.get(uid)
        if pending is None:
            return False  # the watch caught up meanwhile
        if pod is not None and pod_key(pod).uid == uid and is_live(pod) and asks_for_gpu(pod, self.options):
            self._pending[uid] = replace(pending, confirmed=True)
            return False
        del self._pending[uid]
        self._disowned[uid] = None
        while len(self._disowned) > MAX_DISOWNED:
            del self._disowned[next(iter(self._disowned))]
        return True

    def pending_admissions(self) -> int:
        """Admissions not yet seen by the watch (expired ones included until the next usage call)."""
        return len(self._pending)

    def usage(self, namespace: str, exclude: str | None = None) -> NamespaceUsage:
        """VRAM held by the namespace's live GPU pods and pending admissions, without pod ``exclude``.

        A bound pod is sized on its node's devices, a pod not bound yet on the largest device the
        cluster offers under its resource (it may land there).
        """
        sums = self._namespace_sum(namespace)
        total = sums.total - sums.held.get(exclude or "", 0)
        pods = len(sums.held) - (1 if exclude in sums.held else 0)
        unsized = [name for uid, name in sums.unsized.items() if uid != exclude]
        now = self._monotonic()
        for uid, pending in list(self._pending.items()):
            if pending.expires <= now:
                del self._pending[uid]
                continue
            if pending.namespace != namespace or uid == exclude:
                continue
            missing: tuple[str, ...] = ()
            if pending.bytes is not None:
                held = pending.bytes
            else:
                held, missing = claims_bytes(pending.claims, self._offers_for(pending.node))
            total += held
            pods += 1
            if missing:
                unsized.append(uid)
        return NamespaceUsage(total, pods, tuple(unsized))

    def _namespace_sum(self, namespace: str) -> _NamespaceSum:
        cached = self._sums.get(namespace)
        if cached is not None and cached.generation == self.node_generation:
            return cached
        held: dict[str, int] = {}
        unsized: dict[str, str] = {}
        for uid in self._by_namespace.get(namespace, ()):
            record = self.records[uid]
            if not self._demand(record.template.pod, record.template.key).wants_gpu:
                continue  # names a GPU resource, asks for no device
            held[uid], missing = claims_bytes(self.quota_claims(record), self._offers_for(record.node))
            if missing:
                unsized[uid] = record.name
        sums = _NamespaceSum(self.node_generation, held, unsized, sum(held.values()))
        self._sums[namespace] = sums
        return sums

    def _offers_for(self, node: str) -> Mapping[str, ResourceOffer]:
        """The bound node's offers when it is known, else the whole cluster's (the largest GPUs)."""
        offers = self.node_offers(node) if node else None
        return offers if offers is not None else self.offers()

    # -- bind bookkeeping -----------------------------------------------------------------------

    def begin_bind(self, node: str, pod: PodKey, claims: PodClaims) -> None:
        """Remember a reservation bind made, until the watch shows the pod bound (or bind fails)."""
        self.in_flight[pod.uid] = (node, pod, claims)

    def abort_bind(self, uid: str) -> None:
        """Bind failed: release what it reserved, unless the watch already shows the pod bound."""
        entry = self.in_flight.pop(uid, None)
        if entry is not None and self.is_bound(uid) is None:
            self.ledger.release(uid)

    def priority(self, uid: str) -> int:
        """The priority of a pod the watch shows bound (0 for any other)."""
        record = self.records.get(uid)
        return record.priority if record is not None and record.node else 0

    def is_bound(self, uid: str) -> str | None:
        """The node a GPU pod is bound to, as the watch last said."""
        record = self.records.get(uid)
        return record.node if record is not None and record.node else None

    def node_names(self) -> Iterable[str]:
        """Every node with an inventory."""
        return self._inventories.keys()

    def measured_pods(self, node: str) -> Iterator[MeasuredPod]:
        """The pods the agent measured on ``node`` (nothing without a trusted report), each with its
        record (``None``: not known on the node), its use per device and its placements."""
        inventory = self.ledger.inventory(node)
        if inventory is None or not inventory.measured:
            return
        devices = {gpu.id: gpu for gpu in inventory.devices}
        for uid, per_device in inventory.measured.items():
            record = self.records.get(uid)
            yield MeasuredPod(uid, record if record is not None and record.node == node else None, per_device,
                              devices, inventory.placements.get(uid))

    # -- DRA ------------------------------------------------------------------------------------

    def usage_with_dra(self, namespace: str, exclude: str | None = None) -> NamespaceUsage:
        """:meth:`usage`, plus the memory the namespace's allocated DRA claims consume (claims reserved
        for pod ``exclude`` left out): a namespace's quota counts GPUs however they are shared."""
        usage = self.usage(namespace, exclude)
        consumed, claims = self.dra.namespace_consumed(namespace, exclude)
        if not claims:
            return usage
        return NamespaceUsage(usage.bytes + consumed, usage.pods + claims, usage.unsized)

    def _remember_plugin_resources(self, node: JSON) -> bool:
        """Keep which extended resources the node advertises (allocatable above 0); returns whether
        that changed. The scheduler serves a resource through DRA only where it is not advertised."""
        metadata = node.get("metadata") or {}
        status = node.get("status") or {}
        allocatable = status.get("allocatable") if isinstance(status, dict) else None
        advertised = frozenset(
            key for key, value in (allocatable.items() if isinstance(allocatable, dict) else ())
            if isinstance(key, str) and "/" in key and _positive_quantity(value)
        )
        name = str(metadata.get("name", ""))
        changed = self._plugin_resources.get(name) != advertised
        self._plugin_resources[name] = advertised
        return changed

    def dra_context(self) -> DraContext:
        """What admission checks claims against: the DRA state, and per extended resource the nodes
        whose device plugin advertises it (DRA serves it only elsewhere). Cached until devices, classes
        or nodes change: claims and templates are looked up live."""
        key = (self.dra.devices_generation, self.node_generation)
        if self._dra_context is not None and self._dra_context[0] == key:
            return self._dra_context[1]
        plugin: dict[str, set[str]] = {}
        for name, resources in self._plugin_resources.items():
            for resource in resources:
                plugin.setdefault(resource, set()).add(name)
        context = self.dra.context({resource: frozenset(nodes) for resource, nodes in plugin.items()})
        self._dra_context = (key, context)
        return context

    def _with_dra(self, inventory: NodeInventory) -> NodeInventory:
        """The node's inventory with its DRA devices and placements added (see :meth:`sync_dra`)."""
        self._label_inventories[inventory.node] = inventory
        part = self._dra_parts.get(inventory.node)
        if part is None or not part.devices:
            return inventory
        served = {gpu.resource for gpu in part.devices}
        return replace(
            inventory,
            # A resource the device plugin serves on the node is not DRA's there (and vice versa).
            devices=(*(d for d in inventory.devices if d.resource not in served), *part.devices),
            placements={**inventory.placements, **part.placements},
        )

    def sync_dra(self) -> None:
        """Bring the DRA devices of the ledger up to date with the DRA state (the extended-resource
        path, :mod:`vramguard.dra.extended`). Called before the ledger is read (the extender's verbs,
        the CLI): claim events are many, and this runs once after any number of them, redoing only
        the nodes whose devices, allocated claims, serving classes or bound pods changed."""
        if self._dra_synced == (self.dra.generation, self._dra_pod_changes, self.node_generation):
            return
        classes = self.dra.device_classes()
        devices: dict[str, list[DraDevice]] = {}
        for device in self.dra.devices():
            devices.setdefault(device.node, []).append(device)
        by_key = {d.key: d.node for d in self.dra.devices()}
        allocations: dict[str, list[ClaimAllocation]] = {}
        for allocation in self.dra.allocations():
            for node in dict.fromkeys(by_key[r.key] for r in allocation.results if r.key in by_key):
                allocations.setdefault(node, []).append(allocation)
        changed = False
        for name in set(devices) | set(self._dra_parts):
            base = self._label_inventories.get(name)
            if base is None:
                continue  # the Node itself is not known (yet)
            serving = serving_classes(classes, self._plugin_resources.get(name, frozenset()))
            inputs = (
                tuple(devices.get(name, ())),
                tuple(allocations.get(name, ())),
                tuple(part for item in serving.items() for part in item),
            )
            previous = self._dra_inputs.get(name)
            if previous is not None and name not in self._dra_pods_seen and _same(previous, inputs):
                continue  # records are re-parsed per event: unchanged ones are the same objects
            self._dra_inputs[name] = inputs
            self._dra_pods_seen.discard(name)
            node_devices, node_allocations, _ = inputs
            usage = device_usage(DraInventory(node_devices), node_allocations)
            part = ledger_part(node_devices, usage, node_allocations, serving, self._containers_of)
            if self._dra_parts.get(name, DraLedgerPart()) == part:
                continue
            if part.devices:
                self._dra_parts[name] = part
            else:
                self._dra_parts.pop(name, None)
            inventory = self._with_dra(base)
            self._inventories[name] = inventory
            self.ledger.upsert_node(inventory)
            changed = True
        for name in set(self._dra_inputs) - set(devices) - set(self._dra_parts):
            del self._dra_inputs[name]
        if changed:
            self._nodes_changed()
        # Node events count too: a device plugin appearing on a node takes its resource from DRA.
        self._dra_synced = (self.dra.generation, self._dra_pod_changes, self.node_generation)

    def _containers_of(self, uid: str) -> list[str] | None:
        """A bound pod's init containers then containers, by name (how DRA numbers its requests)."""
        record = self.records.get(uid)
        return container_names(record.template.pod) if record is not None else None

    def dra_resources(self, node: str) -> frozenset[str]:
        """The GPU resources DRA serves on ``node`` through the extended-resource path (as of the
        last :meth:`sync_dra`)."""
        part = self._dra_parts.get(node)
        return frozenset(gpu.resource for gpu in part.devices) if part is not None else frozenset()


def _interned(labels: Mapping[Any, Any]) -> dict[Any, Any]:
    """A copy of ``labels`` whose text keys and values are interned: thousands of nodes carry the
    same few dozen label keys and mostly the same values, and each decoded object brings its own
    copies (about 8 MiB at 5,000 nodes)."""
    return {
        sys.intern(k) if type(k) is str else k: sys.intern(v) if type(v) is str else v for k, v in labels.items()
    }


def _positive_quantity(value: Any) -> bool:
    """Whether an allocatable entry is a quantity above 0 (junk counts as not advertised)."""
    try:
        return parse_quantity(str(value)[:64]) > 0
    except QuantityError:
        return False


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
    """A :class:`_Delegate` that can also hold nodes back (``suspect``) and read a list page by page
    (``begin_replace``), for the pods."""

    def __init__(self, replace: Any, upsert: Any, delete: Any, suspect: Any, begin_replace: Any) -> None:
        super().__init__(replace, upsert, delete)
        self.suspect = suspect
        self.begin_replace = begin_replace


@dataclass(frozen=True, slots=True)
class _PodEntry:
    """A listed pod as the model keeps it: its record, and its claims when it is bound."""

    key: PodKey
    record: PodRecord
    claims: tuple[Claim, ...] | None
    """The claims the ledger holds (shared per template and class), when the pod is bound."""


class _PodsReplacement:
    """A list of pods read page by page into compact entries (records pointing at shared templates,
    claims shared per template), swapped in at :meth:`commit`. Until then the model serves the old
    list unchanged: a list that fails half-way leaves no half-listed ledger behind."""

    def __init__(self, state: ClusterState, *, clears_suspects: bool) -> None:
        self._state = state
        self._clears_suspects = clears_suspects
        self._entries: dict[str, _PodEntry] = {}
        self._pending_seen: set[str] = set()

    def add(self, pods: list[JSON]) -> None:
        """One page: only each pod's entry is kept, not the object."""
        state = self._state
        for pod in pods:
            key = pod_key(pod)
            if key.uid in state._pending:
                self._pending_seen.add(key.uid)
            entry = state._pod_entry(pod, key)
            if entry is not None:
                self._entries[key.uid] = entry

    def commit(self) -> None:
        """The list is complete: it becomes the model's pods at once."""
        self._state._commit_pods(self._entries, self._pending_seen)
        self._entries = {}
        if self._clears_suspects:
            self._state.suspects.clear()


def _same(old: tuple[tuple[Any, ...], ...], new: tuple[tuple[Any, ...], ...]) -> bool:
    """Whether two tuples of tuples hold the very same objects (records are never mutated)."""
    return all(
        len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True)) for a, b in zip(old, new, strict=True)
    )


def pod_template_key(pod: Mapping[str, Any]) -> str:
    """What a pod's demand depends on, as text: its containers, init containers and VRAM annotations.

    Computed for every filter, prioritize and bind, so through orjson; what it cannot encode (keys
    that are not strings, integers beyond 64 bits: never in an object the API server sends) through
    the standard library."""
    metadata = pod.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, dict) else None
    declared = (
        sorted((k, v) for k, v in annotations.items() if isinstance(k, str) and reads_annotation(k))
        if isinstance(annotations, dict)
        else None
    )
    spec = pod.get("spec")
    parts = [declared, spec.get("initContainers"), spec.get("containers")] if isinstance(spec, dict) else [
        declared, repr(spec)
    ]
    try:
        return orjson.dumps(parts, default=repr).decode()
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(parts, default=repr)


def _template_pod(pod: Mapping[str, Any]) -> JSON:
    """Only what demand reads of a pod: its containers, init containers and VRAM annotations."""
    metadata = pod.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    spec = pod.get("spec")
    kept: JSON = {}
    if isinstance(spec, Mapping):
        kept = slim_pod({"spec": {k: spec[k] for k in ("containers", "initContainers") if k in spec}})["spec"]
        del kept["nodeName"], kept["priority"]
    declared = (
        {k: v for k, v in annotations.items() if isinstance(k, str) and reads_annotation(k)}
        if isinstance(annotations, Mapping)
        else {}
    )
    return {"metadata": {"annotations": declared}, "spec": kept}
