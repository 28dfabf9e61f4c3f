"""Admission rules: whether a pod, or a workload's pod template, may be created, and what to tell the user.

Pure: the webhook decodes the AdmissionReview, gathers what it knows about the cluster into a
:class:`ClusterView` (the namespace's labels, the GPU sizes and sharing strategies nodes offer,
the VRAM the namespace's live GPU pods hold), and calls :meth:`AdmissionRules.review`, which
returns a :class:`Decision` ready to encode.

**Findings.** Every rule produces messages of one of two kinds:

- *violations* would make the pod fail or break the policy: demand errors (a fraction outside
  (0, 1], a parallel size that does not match the GPUs requested, a claim above its MPS limit or its
  declaration), a ``vramguard.io/qos-class`` label naming no class, VRAM that cannot be derived in
  a class that rejects it, an engine's implicit default in a class that forbids them, a reservation
  above the class's ``max_vram_per_gpu``, a missing MPS limit where the class requires one, a GPU
  resource or sharing strategy the class does not allow, a namespace VRAM quota exceeded, a
  ``vramguard.io/qos-class`` pod label naming a class its namespace's class does not allow
  (``allows_pod_classes``), a ``spec.schedulerName`` that does not call the extender (policy
  ``schedulers``), a pod created with ``spec.nodeName`` that does not fit that node's ledger
  (``ClusterView.ledger``, the extender's cluster model) unless its requester is in the policy's
  ``direct_placement`` allow-list;
- *notes* are worth knowing but never block: the demand model's warnings (implicit defaults where
  allowed, unknown VRAM counted as a whole GPU, values from Secrets), problems that show only on
  some GPU sizes, labels with invalid values.

**Enforcement** (the namespace's ``vramguard.io/enforce`` label, else the policy's default, as
Pod Security Admission does it): ``enforce`` denies when there is a violation; ``warn`` admits and
returns each violation as an admission warning (``would deny: ...``); ``audit`` admits and records
the violations in the audit annotation ``would-deny`` (the API server prefixes the webhook's name).
In ``audit`` mode each violation is returned as a warning too (``audit: would deny: ...``), so that
what would be refused is never less visible than a note. Notes are returned as warnings in every
mode. Warnings are kept within 256 characters, beyond which the API server may cut them (the
AdmissionResponse's ``warnings`` field: "Warnings over 256 characters ... may be truncated"); the
full text stays in the denial message and the audit annotation.

**DRA claims** (:mod:`vramguard.dra.review`, when ``ClusterView.dra`` is given): a pod whose GPU
comes from a ResourceClaim or ResourceClaimTemplate must claim (``capacity.requests.memory``, else
the device's default, rounded up by its request policy) at least what the containers using the
claim reserve on each device the class and selectors could match (``claim-memory``), and a pod
asking an extended resource that a DeviceClass serves where no device plugin does must not land on
devices where that consumes less (``extended-resource-memory``: 0 in ``unlimited`` and share-count
modes). A claim several pods name (``resourceClaimName``) must cover the engines of all of them.
A Pod using a ResourceClaim or template that does not exist is refused (``claim-missing``: its
controller retries); for a workload that is a note, as are unknown classes or devices. A
ResourceClaim or ResourceClaimTemplate created after pods that name it is checked against them
(``claim-memory``); with no such pod it only draws warnings.

**Updates** must not be refused for a problem they did not introduce: a violation that the old
object had too is reported as a note, and an object being deleted (``deletionTimestamp`` set, e.g.
a finalizer being removed) is admitted at once. Otherwise turning a namespace to ``enforce``
would block label edits and deletions of everything admitted before.

**Engines named only by environment variables** (JAX) are not believed in a class with
``trust_env_only_engines: false``: such a container counts as unknown VRAM there (a note says so),
as it does in :func:`vramguard.placement.pod_claims` for the extender.

**GPU sizes.** A fraction of a GPU becomes bytes only on a device. A pod bound to a node is sized
on that node's devices; a pod not yet bound, or a workload's template, on the devices the cluster
offers under its resource: checks that deny use the size that is most favourable to the user
(the smallest device for "claim above a byte limit"), so a denial holds on every GPU the pod could
get, and the same check on the largest device only warns. The quota counts the *largest* device:
a namespace never ends up above its quota whatever GPU its pods land on.

**Quota.** A namespace's VRAM is the sum over its live GPU pods (pending and running, bound or
not) of the bytes each holds per device replica, counted as above; VRAM that cannot be derived
counts as the whole device (one replica's share on an MPS GPU). A Pod is checked against the live
sum. A workload is checked for ``pods x per-pod VRAM``: on CREATE on top of the namespace's live sum
(its pods do not exist yet), on UPDATE alone (its own pods are already in the live sum; a rolling
update's surge is then checked pod by pod). Replicas: ``spec.replicas`` (Deployment, StatefulSet,
ReplicaSet, default 1), ``min(parallelism, completions)`` for Jobs and CronJobs (pods running at
once), the nodes that offer the GPU resource and match the ``nodeSelector`` for a DaemonSet.
A workload made by a controller (a Deployment's ReplicaSet, a CronJob's Job) is not quota-checked
again: its owner was, and its pods will be.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from fractions import Fraction
from typing import Any, Literal

from vramguard.codecs import PLACEMENT_ANNOTATION, QOS_CLASS_LABEL, VRAM_ANNOTATION, Placement
from vramguard.demand import MAX_DEVICES, PodDemand, Vram, derive_pod_demand
from vramguard.demand.derive import reads_annotation
from vramguard.demand.model import ContainerDemand
from vramguard.demand.mps import MEM_LIMIT
from vramguard.demand.objects import pod_template
from vramguard.demand.visible import DeviceReach, device_reaches
from vramguard.dra.claims import read_claim, read_claim_template
from vramguard.dra.review import (
    ClaimReview,
    DraContext,
    claims_may_get_gpus,
    review_claim_spec,
    review_claim_users,
    review_pod_claims,
)
from vramguard.inventory import Gpu, NodeInventory
from vramguard.ledger import Claim, Fit, Ledger, ResourceOffer
from vramguard.mutation import (
    DEFAULT_SCHEDULER,
    ROUTING_LABEL,
    Mutation,
    plan_mutation,
    routes_namespace,
    routing_scheduler,
)
from vramguard.placement import apply_intended, describe_fit, filter_node, pod_claims
from vramguard.policy import ClassChoice, Enforcement, Policy, QosClass
from vramguard.quantity import GiB, format_bytes, quantity_text
from vramguard.template_part import TemplatePart
from vramguard.workloads import parts_demand, workload_parts

__all__ = [
    "AUDIT_CLASS_KEY",
    "AUDIT_WOULD_DENY_KEY",
    "SUPPORTED_KINDS",
    "WARNING_LIMIT",
    "AdmissionRules",
    "ClusterView",
    "Decision",
    "NamespaceUsage",
    "Operation",
    "ResourceOffer",
    "Subject",
    "claims_bytes",
    "fit_warning",
    "offers_from_inventories",
    "quantity_text",
    "quota_claims",
    "workload_pods",
]

Operation = Literal["CREATE", "UPDATE"]

# The kinds the webhook validates: (API group, version) as the API server sends them.
SUPPORTED_KINDS: Mapping[str, tuple[str, str]] = {
    "Pod": ("", "v1"),
    "Deployment": ("apps", "v1"),
    "StatefulSet": ("apps", "v1"),
    "DaemonSet": ("apps", "v1"),
    "ReplicaSet": ("apps", "v1"),
    "Job": ("batch", "v1"),
    "CronJob": ("batch", "v1"),
    "ResourceClaim": ("resource.k8s.io", "v1"),
    "ResourceClaimTemplate": ("resource.k8s.io", "v1"),
}
CLAIM_KINDS = frozenset({"ResourceClaim", "ResourceClaimTemplate"})
"""Reviewed on their own (warnings only: the pod that will use them is not known yet)."""

# The API server may cut admission warnings longer than this (AdmissionResponse.warnings).
WARNING_LIMIT = 256
# kubectl prints every warning on its own line; past this many, one line says how many are left.
MAX_WARNINGS = 16
# Audit annotation keys: a qualified name without a prefix (the API server adds "<webhook>/").
AUDIT_WOULD_DENY_KEY = "would-deny"
AUDIT_CLASS_KEY = "qos-class"
# Pod templates whose demand is remembered (the replicas of a workload share one).
DEMAND_CACHE_SIZE = 2048
# Audit events are kept small; the violations are cut past this many characters.
AUDIT_VALUE_LIMIT = 8192

_ENGINE_TITLES = {"vllm": "vLLM", "tgi": "TGI", "jax": "JAX"}
_DEFAULT_KNOB = {
    "vLLM": "--gpu-memory-utilization",
    "TGI": "--cuda-memory-fraction",
    "JAX": "pre-allocation",
}
_DEFAULT_FIX = {
    "vLLM": "set it explicitly",
    "TGI": "set it explicitly",
    "JAX": "set XLA_PYTHON_CLIENT_MEM_FRACTION",
}
# How messages name the sharing strategies of the devices a node offers.
_SHARING_WORDS = {"none": "exclusive", "time-slicing": "time-sliced", "mps": "MPS", "mig": "MIG"}
# A class that holds unknown VRAM as a whole device, for the quota's arithmetic.
_WHOLE_DEVICE = ClassChoice("quota", QosClass(sharing=("none",)), "default")


def offers_from_inventories(
    inventories: Iterable[NodeInventory], labels: Mapping[str, Mapping[str, str]] | None = None
) -> dict[str, ResourceOffer]:
    """The :class:`ResourceOffer` of every GPU resource found on ``inventories``.

    ``labels`` maps node names to their labels; nodes without an entry count with no labels.
    """
    devices: dict[str, list[Gpu]] = {}
    nodes: dict[str, list[Mapping[str, str]]] = {}
    for inventory in inventories:
        for resource in inventory.resources():
            devices.setdefault(resource, []).extend(inventory.devices_for(resource))
            nodes.setdefault(resource, []).append((labels or {}).get(inventory.node, {}))
    return {resource: ResourceOffer.of(gpus, tuple(nodes[resource])) for resource, gpus in devices.items()}


@dataclass(frozen=True, slots=True)
class NamespaceUsage:
    """VRAM held by a namespace's live GPU pods, other than the object under review."""

    bytes: int = 0
    pods: int = 0
    unsized: tuple[str, ...] = ()
    """Pods whose VRAM could not be sized (no node offers their resource), not counted."""


@dataclass(frozen=True, slots=True)
class ClusterView:
    """What the webhook knows about the cluster for one review (from its watches)."""

    namespace_labels: Mapping[str, str] | None = None
    offers: Mapping[str, ResourceOffer] = field(default_factory=dict)
    """Per GPU resource, what the cluster offers (for pods not bound yet and workloads)."""
    node_offers: Mapping[str, ResourceOffer] | None = None
    """For a pod already bound (``spec.nodeName``): what its node offers, when the node is known."""
    usage: NamespaceUsage | None = None
    """The namespace's VRAM in use; ``None`` when it was not computed (the namespace has no quota)."""
    ledger: Ledger | None = None
    """The cluster's GPU ledger (the extender's model, fed by the same watches), to check pods
    created with ``spec.nodeName``; ``None``: not checked."""
    held_back: str | None = None
    """Why the pod's node cannot be judged right now (its pods are being re-read after a watch
    event that could not be read), or ``None``: a direct placement there is not admitted."""
    dra: DraContext | None = None
    """DRA devices, classes and claims (the webhook's watches); ``None``: claims are not checked."""


@dataclass(frozen=True, slots=True)
class Subject:
    """The object under review."""

    kind: str
    operation: Operation
    namespace: str
    obj: Mapping[str, Any]
    old: Mapping[str, Any] | None = None
    """The object before an UPDATE."""
    user: str = ""
    """Who asks (``request.userInfo.username``)."""
    groups: tuple[str, ...] = ()
    """The requester's groups (``request.userInfo.groups``)."""
    demand: PodDemand | None = None
    """A workload template's demand as its workload gives it (the scripts its containers run, the
    engine another template of the group starts: :func:`vramguard.workloads.parts_demand`); ``None``:
    derived from the object alone."""


class Code(StrEnum):
    """Which rule an admission :class:`Finding` is about: for tools and tests; the text is for people."""

    ENFORCEMENT_LABEL = "enforcement-label"
    """The namespace's enforcement label names no mode (a note)."""
    DEMAND_ERROR = "demand-error"
    """The pod's VRAM cannot be derived: a bad declaration or engine flag, a conflict."""
    DEMAND_WARNING = "demand-warning"
    """Something the demand model assumed or could not see (a note)."""
    DEVICE_COUNT = "device-count"
    """More GPU devices than any node offers."""
    ENV_ONLY_ENGINE = "env-only-engine"
    """The class does not trust an engine recognised only from environment variables (a note)."""
    SCHEDULER = "scheduler"
    """The pod's scheduler does not call vramguard."""
    DIRECT_PLACEMENT = "direct-placement"
    """``spec.nodeName`` places the pod past the scheduler onto a node it does not fit."""
    CLASS_LABEL = "class-label"
    """A class label names no class, or one the namespace's class does not allow."""
    CONFLICT = "conflict"
    """An engine claims more than the declaration or the MPS limit, once the GPU's size is known."""
    IMPLICIT_DEFAULT = "implicit-default"
    """The class forbids relying on an engine's default memory share."""
    UNKNOWN_VRAM = "unknown-vram"
    """The class rejects pods whose VRAM is unknown."""
    MAX_VRAM = "max-vram"
    """A container reserves more per GPU than its class allows."""
    MPS_LIMIT = "mps-limit"
    """The class requires an MPS pinned memory limit."""
    SHARING = "sharing"
    """The class does not allow the sharing strategy the pod would get."""
    RESOURCE_MISSING = "resource-missing"
    """No node offers the GPU resource yet (a note)."""
    QUOTA = "quota"
    """The namespace's VRAM quota."""
    CLAIM_MEMORY = "claim-memory"
    """A ResourceClaim request consumes less memory than the engine using it reserves."""
    EXTENDED_RESOURCE_MEMORY = "extended-resource-memory"
    """An extended resource served through DRA consumes less memory than the engine reserves."""
    CLAIM_UNCHECKED = "claim-unchecked"
    """A claim's memory could not be checked (its template, class or devices not known yet; a note)."""
    CLAIM_MISSING = "claim-missing"
    """A pod's container reserving memory uses a claim whose ResourceClaim or template does not exist."""
    BOUND_CHANGE = "bound-change"
    """An update of a bound pod (a new image, an ephemeral container) makes it hold more than its
    devices have room for."""
    VISIBLE_DEVICES = "visible-devices"
    """A container names its own GPUs in ``NVIDIA_VISIBLE_DEVICES``, past what it requests."""
    ESTIMATE_CAPPED = "estimate-capped"
    """What the engine holds beside its share (estimated) does not fit beside it on the GPU: the pod
    counts the whole GPU, placed only where it is alone (a note)."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem found by a review: which rule, and the message for people.

    Whether it denies is the review's answer (:attr:`Decision.problems` or :attr:`Decision.remarks`):
    an update is not refused for a problem its old object had too, so it becomes a remark.
    """

    code: Code
    message: str
    container: str | None = None
    """The container it is about, when it is about one."""
    brief: str | None = None
    """The message cut to what a warning line holds, where the whole one would not fit."""


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer to one review, ready to encode as an AdmissionResponse."""

    allowed: bool
    mode: Enforcement
    problems: tuple[Finding, ...] = ()
    """What would deny the object (denied only in ``enforce`` mode)."""
    remarks: tuple[Finding, ...] = ()
    """What never denies but is returned as warnings."""
    message: str | None = None
    """The denial message (``allowed`` is false)."""
    warnings: tuple[str, ...] = ()
    audit_annotations: Mapping[str, str] = field(default_factory=dict)
    qos_class: str | None = None
    wants_gpu: bool = False
    claims: tuple[Claim, ...] = ()
    """The claims of one pod, as the quota counts them (for the webhook's pending admissions)."""
    pods: int = 1
    """How many such pods the object makes (replicas of a workload, 1 for a Pod)."""

    @property
    def violations(self) -> tuple[str, ...]:
        """The messages of :attr:`problems`."""
        return tuple(f.message for f in self.problems)

    @property
    def notes(self) -> tuple[str, ...]:
        """The messages of :attr:`remarks`."""
        return tuple(f.message for f in self.remarks)


def quota_claims(demand: PodDemand) -> tuple[Claim, ...]:
    """A pod's claims as the quota counts them: unknown VRAM holds a whole device.

    One claim per device. The demand model caps each container at :data:`MAX_DEVICES`; a pod whose
    containers ask for more than that in all gets none (and a violation):
    a 1 MiB pod of ten thousand such containers must not cost gigabytes of claims.
    """
    if sum(c.gpus for c in demand.containers) > MAX_DEVICES:
        return ()
    return pod_claims(demand, _WHOLE_DEVICE).claims


def claims_bytes(claims: Iterable[Claim], offers: Mapping[str, ResourceOffer]) -> tuple[int, tuple[str, ...]]:
    """Bytes the claims hold on the largest devices of their resources, and the resources not sized.

    A claim in bytes needs no device; a fraction or a whole device needs the resource's size.
    """
    total = 0
    unsized: list[str] = []
    for claim in claims:
        if all(v is not None and v.bytes is not None for v in claim.vram):
            total += max(v.bytes or 0 for v in claim.vram if v is not None)
            continue
        offer = offers.get(claim.resource)
        if offer is None or not offer.sized:
            unsized.append(claim.resource)
            continue
        total += claim.bytes_on(offer.largest_bytes, offer.largest_whole_bytes)
    return total, tuple(dict.fromkeys(unsized))


def workload_pods(kind: str, obj: Mapping[str, Any], daemonset_nodes: int | None = None) -> int:
    """How many pods of its template a workload runs at once (1 for a Pod); see the module docstring."""
    spec = _mapping(obj.get("spec"))
    if kind in ("Deployment", "StatefulSet", "ReplicaSet"):
        return _count(spec.get("replicas"), 1)
    if kind == "CronJob":
        spec = _mapping(_mapping(spec.get("jobTemplate")).get("spec"))
        kind = "Job"
    if kind == "Job":
        parallelism = _count(spec.get("parallelism"), 1)
        completions = spec.get("completions")
        return min(parallelism, _count(completions, parallelism)) if completions is not None else parallelism
    if kind == "DaemonSet":
        return daemonset_nodes if daemonset_nodes is not None else 1
    return 1


PART_KIND = "ReplicaSet"
"""How one pod template of a custom workload is reviewed: as that many replicas of it."""


def _part_object(obj: Mapping[str, Any], part: TemplatePart) -> dict[str, Any]:
    """One template of a custom workload as a ReplicaSet of its pods, keeping the owner's metadata."""
    return {"metadata": obj.get("metadata"), "spec": {"replicas": part.pods, "template": part.template}}


def _count(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


def fit_warning(text: str, limit: int = WARNING_LIMIT) -> str:
    """``text`` on one line, at most ``limit`` characters.

    Too long: parenthesised details are dropped from the end first (they qualify, the sentence
    before them says what to do), then the text is cut at a word boundary and ends with ``...``.
    """
    flat = " ".join(text.split())
    while len(flat) > limit:
        close = flat.rfind(")")
        open_ = flat.rfind("(", 0, close) if close != -1 else -1
        if open_ <= 0:
            break
        flat = (flat[:open_].rstrip() + flat[close + 1 :]).strip()
    if len(flat) <= limit:
        return flat
    cut = flat[: limit - 3]
    space = cut.rfind(" ")
    if space >= limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:-(") + "..."


class AdmissionRules:
    """The policy's admission rules; build one per policy version and call :meth:`review`."""

    def __init__(self, policy: Policy, *, cache_size: int = DEMAND_CACHE_SIZE) -> None:
        """Prepare the rules of ``policy`` (the demand options are derived once)."""
        self.policy = policy
        self.options = policy.demand_options()
        self._cache_size = cache_size
        self._quotas = {namespace: policy.quota_bytes(namespace) for namespace in policy.quotas}
        self._demands: OrderedDict[bytes, tuple[PodDemand, tuple[Claim, ...]]] = OrderedDict()

    def quota_bytes(self, namespace: str) -> int | None:
        """The namespace's VRAM quota in bytes (``None``: no quota), parsed once per policy."""
        return self._quotas.get(namespace)

    def demand(self, template: Mapping[str, Any]) -> PodDemand:
        """The demand of a pod template (see :meth:`_derive`)."""
        return self._derive(template)[0]

    def _derive(self, template: Mapping[str, Any]) -> tuple[PodDemand, tuple[Claim, ...]]:
        """The demand of a pod template, remembered by content.

        The replicas of a workload arrive with the same spec, and an UPDATE carries the old spec
        too; reading the spec as JSON costs a tenth of deriving its demand. The key holds all that
        the derivation reads (the spec, the ``vramguard.io/`` annotations and the group size of a
        LeaderWorkerSet's pods), so a hit is exact.
        """
        metadata = _mapping(template.get("metadata"))
        annotations = {
            k: v
            for k, v in _mapping(metadata.get("annotations")).items()
            if isinstance(k, str) and reads_annotation(k)
        }
        try:
            text = json.dumps([template.get("spec"), annotations], separators=(",", ":"))
        except (TypeError, ValueError):
            demand = derive_pod_demand(template, self.options)  # not JSON (a YAML date, a cycle): no caching
            return demand, quota_claims(demand)
        # A digest, not the text, is kept: specs may be large, and 128 bits do not collide in practice.
        key = hashlib.blake2b(text.encode(), digest_size=16).digest()
        cached = self._demands.get(key)
        if cached is not None:
            self._demands.move_to_end(key)
            return cached
        demand = derive_pod_demand(template, self.options)
        derived = (demand, quota_claims(demand) if demand.wants_gpu else ())
        self._demands[key] = derived
        if len(self._demands) > self._cache_size:
            self._demands.popitem(last=False)
        return derived

    def mutation(self, namespace: str, pod: Mapping[str, Any], cluster: ClusterView) -> Mutation:
        """What the mutating webhook changes in a Pod being created (:mod:`vramguard.mutation`)."""
        demand, claims = self._derive(pod)
        choice = self._class(pod, cluster, _Findings())
        demand, _ = self._believed(demand, claims, choice, _Findings())
        offers = cluster.node_offers if cluster.node_offers is not None else cluster.offers
        return plan_mutation(self.policy, pod, namespace, cluster.namespace_labels, demand, choice, offers, cluster.dra)

    def review(self, subject: Subject, cluster: ClusterView) -> Decision:
        """Decide on one CREATE or UPDATE of a Pod or a workload, in the namespace's enforcement mode."""
        mode, mode_problem = self.policy.enforcement_for(cluster.namespace_labels)
        metadata = _mapping(subject.obj.get("metadata"))
        if subject.operation == "UPDATE" and metadata.get("deletionTimestamp"):
            return Decision(True, mode)
        if subject.kind in CLAIM_KINDS:
            return self._review_claim_object(subject, cluster, mode)
        template = pod_template(subject.obj, subject.kind)
        if template is None:
            parts = workload_parts(subject.obj, self.policy.workload_kinds, subject.kind)
            return self._review_parts(subject, parts, cluster) if parts else Decision(True, mode)
        if subject.demand is not None:
            demand = subject.demand
            claims = quota_claims(demand) if demand.wants_gpu else ()
        else:
            demand, claims = self._derive(template)
        dra = (
            review_pod_claims(
                template, subject.namespace, demand, cluster.dra, workload_pods(subject.kind, subject.obj)
            )
            if cluster.dra is not None
            else None
        )
        reaches = device_reaches(template, self.options.is_gpu)
        # A container using a claim that may get a GPU makes a GPU pod, judged like any (the mutating
        # webhook routes it alike), even where no known device matches the claim yet.
        claims_gpus = dra is not None and dra.uses_claims and claims_may_get_gpus(
            template, subject.namespace, cluster.dra
        )
        if not demand.wants_gpu and (dra is None or not (dra.found_anything or claims_gpus)):
            if not reaches:
                return Decision(True, mode)
            return self._review_reaches(subject, template, reaches, cluster, mode)

        found = _Findings()
        if mode_problem is not None:
            found.note(Code.ENFORCEMENT_LABEL, mode_problem)
        if dra is not None:
            _claim_findings(dra, found, subject.kind == "Pod")
        choice = self._class(template, cluster, found)
        self._visible_devices(reaches, choice, found)
        if not demand.wants_gpu:  # only claims: the device-plugin rules have nothing to check
            pods = workload_pods(subject.kind, subject.obj)
            assert dra is not None
            self._quota(subject, (), pods, {}, cluster, found, dra.per_pod_bytes)
            if subject.operation == "UPDATE" and subject.old is not None:
                self._spare_old_claim_violations(subject, cluster, found)
            return self._decide(mode, choice, found, (), pods)
        demand, claims = self._believed(demand, claims, choice, found)
        offers = cluster.node_offers if cluster.node_offers is not None else cluster.offers
        pods = self._pods(subject.kind, subject.obj, template, demand, offers)
        self._rules(
            subject, demand, choice, offers, claims, pods, cluster, found, dra.per_pod_bytes if dra is not None else 0
        )
        if cluster.dra is not None:
            _drop_served_by_dra(demand, cluster.dra, found)

        if subject.operation == "UPDATE" and subject.old is not None:
            self._spare_old_violations(subject, cluster, found)
            if cluster.dra is not None:
                self._spare_old_claim_violations(subject, cluster, found)
        return self._decide(mode, choice, found, claims, pods)

    def _review_parts(self, subject: Subject, parts: Sequence[TemplatePart], cluster: ClusterView) -> Decision:
        """Review each pod template of a custom workload as a replicated workload of its own.

        Each part is checked like a ReplicaSet of ``part.pods`` replicas; the answers are merged,
        every message naming its template, and the object is refused when any part is.
        """
        old_parts = {
            p.name: p for p in workload_parts(subject.old, self.policy.workload_kinds, subject.kind)
        } if subject.old is not None else {}
        decisions: list[tuple[str, Decision]] = []
        for part, demand in zip(parts, parts_demand(parts, self.options), strict=True):
            old = old_parts.get(part.name)
            decision = self.review(
                replace(
                    subject,
                    kind=PART_KIND,
                    obj=_part_object(subject.obj, part),
                    old=_part_object(subject.old, old) if subject.old is not None and old is not None else None,
                    demand=demand,
                ),
                cluster,
            )
            if decision.wants_gpu:
                decisions.append((f"{subject.kind} {part.name}: ", decision))
        if not decisions:
            return Decision(True, self.policy.enforcement_for(cluster.namespace_labels)[0])
        first = decisions[0][1]
        whole = self._whole_quota(subject, decisions, cluster)
        problems = tuple(replace(f, message=prefix + f.message) for prefix, d in decisions for f in d.problems) + whole
        annotations: dict[str, str] = {}
        for _, d in decisions:
            for key, value in d.audit_annotations.items():
                annotations[key] = f"{annotations[key]}; {value}" if key in annotations else value
        warnings = [w for _, d in decisions for w in d.warnings]
        whole_text = [f.message for f in whole]
        if whole and first.mode == "warn":
            warnings[:0] = [f"would deny: {v}" for v in whole_text]
        elif whole and first.mode == "audit":
            annotations[AUDIT_WOULD_DENY_KEY] = _audit_value(
                [annotations[AUDIT_WOULD_DENY_KEY], *whole_text] if AUDIT_WOULD_DENY_KEY in annotations else whole_text
            )
            annotations.setdefault(AUDIT_CLASS_KEY, first.qos_class or "")
            warnings[:0] = [f"audit: would deny: {v}" for v in whole_text]
        refused = [prefix + v for prefix, d in decisions if not d.allowed for v in d.violations]
        if whole and first.mode == "enforce":
            refused += whole_text
        allowed = not refused
        return Decision(
            allowed=allowed,
            mode=first.mode,
            problems=problems,
            remarks=tuple(replace(f, message=prefix + f.message) for prefix, d in decisions for f in d.remarks),
            message=None if allowed else denial_message(refused),
            warnings=_fit_warnings(warnings),
            audit_annotations=annotations,
            qos_class=first.qos_class,
            wants_gpu=True,
            pods=sum(d.pods for _, d in decisions),
        )

    def _whole_quota(
        self, subject: Subject, decisions: Sequence[tuple[str, Decision]], cluster: ClusterView
    ) -> tuple[Finding, ...]:
        """The namespace quota for all the templates of a custom workload together, at full scale.

        Each template was checked on its own; together they may still exceed the quota.
        """
        quota = self.quota_bytes(subject.namespace)
        usage = cluster.usage
        if quota is None or usage is None or len(decisions) < 2 or _controlled(subject.obj):
            return ()
        offers = cluster.node_offers if cluster.node_offers is not None else cluster.offers
        workload = sum(claims_bytes(d.claims, offers)[0] * d.pods for _, d in decisions)
        total = workload + (usage.bytes if subject.operation == "CREATE" else 0)
        if total <= quota:
            return ()
        return (Finding(
            Code.QUOTA,
            f"namespace {subject.namespace} would hold {quantity_text(total)} of its {quantity_text(quota)} "
            f"VRAM quota ({subject.kind} at full scale {quantity_text(workload)}, "
            f"{usage.pods if subject.operation == 'CREATE' else 0} other pod(s))",
        ),)

    # -- the rules -------------------------------------------------------------------------------

    def _rules(
        self,
        subject: Subject,
        demand: PodDemand,
        choice: ClassChoice,
        offers: Mapping[str, ResourceOffer],
        claims: tuple[Claim, ...],
        pods: int,
        cluster: ClusterView,
        found: _Findings,
        claimed: int = 0,
    ) -> None:
        for error in demand.errors:
            found.violate(Code.DEMAND_ERROR, error)
        devices = sum(c.gpus for c in demand.containers)
        if devices > MAX_DEVICES:
            found.violate(
                Code.DEVICE_COUNT,
                f"the pod asks for {devices} GPU devices in all; no node offers more than {MAX_DEVICES}"
            )
        implicit = {c.name: _implicit_default(c) for c in demand.containers}
        disallowed = {name for name, engine in implicit.items() if engine and not choice.qos.allow_implicit_defaults}
        # Where the class forbids an engine's default, the violation below replaces the warning.
        replaced = {c.default_warning for c in demand.containers if c.name in disallowed}
        for warning in demand.warnings:
            if warning not in replaced:
                found.note(Code.DEMAND_WARNING, warning)
        for container in demand.containers:
            offer = offers.get(container.resource)
            self._conflicts(container, offer, found)
            self._capped(container, offer, found)
            self._implicit(container, implicit[container.name], choice, found)
            self._unknown(container, choice, found)
            self._max_vram(container, choice, offer, found)
            self._mps_limit(container, choice, found)
            self._sharing(container, choice, offer, cluster.node_offers is not None, found)
        self._quota(subject, claims, pods, offers, cluster, found, claimed)
        template = pod_template(subject.obj, subject.kind) or {}
        node = _mapping(template.get("spec")).get("nodeName")
        if isinstance(node, str) and node:
            self._direct_placement(subject, node, demand, choice, cluster, found)
            self._bound_change(subject, node, demand, choice, cluster, found)
        else:
            self._scheduler(subject.kind, template, cluster.namespace_labels, found)

    @staticmethod
    def _believed(
        demand: PodDemand, claims: tuple[Claim, ...], choice: ClassChoice, found: _Findings
    ) -> tuple[PodDemand, tuple[Claim, ...]]:
        """The demand as the class believes it: engines named only by env vars are unknown VRAM there."""
        guesses = demand.env_only_guesses()
        if choice.qos.trust_env_only_engines or not guesses:
            return demand, claims
        for name in guesses:
            found.note(
                Code.ENV_ONLY_ENGINE,
                f"container {name}: class {choice.name} does not trust engines recognised only from "
                f"environment variables; its VRAM counts as unknown unless declared ({VRAM_ANNOTATION}.{name})",
                container=name,
            )
        believed = demand.distrusting_env_only()
        return believed, quota_claims(believed)

    def _scheduler(
        self, kind: str, template: Mapping[str, Any], namespace_labels: Mapping[str, str] | None, found: _Findings
    ) -> None:
        """A GPU pod must be placed by a scheduler that calls the extender, or nothing checks its GPU.

        A workload's template naming none is fine where routing applies: its pods are routed as
        they are created. A Pod arrives here after the mutating webhook: one still unrouted was not
        routed (the webhook was down, or the namespace opts out)."""
        name = _mapping(template.get("spec")).get("schedulerName")
        name = name if isinstance(name, str) and name else DEFAULT_SCHEDULER  # the API server default
        wired = self.policy.schedulers
        routed = routing_scheduler(self.policy) is not None and routes_namespace(namespace_labels)
        if kind != "Pod" and name == DEFAULT_SCHEDULER and routed:
            return
        if name not in wired:
            hint = brief_hint = ""
            if name == DEFAULT_SCHEDULER and routing_scheduler(self.policy) is not None:
                if routed:
                    hint, brief_hint = "; the mutating webhook did not route it (is it running?)", " (not routed)"
                else:
                    hint = f"; the namespace opts out of routing ({ROUTING_LABEL}=disabled)"
                    brief_hint = " (namespace opts out of routing)"
            found.violate(
                Code.SCHEDULER,
                f"spec.schedulerName {name} does not call vramguard, so nothing would check this pod's GPU "
                f"memory; set spec.schedulerName: {wired[0]} (policy schedulers: {', '.join(wired)}){hint}",
                brief=f"{name[:40]} does not call vramguard{brief_hint}; set schedulerName: {wired[0][:30]}",
            )

    def _direct_placement(
        self,
        subject: Subject,
        node: str,
        demand: PodDemand,
        choice: ClassChoice,
        cluster: ClusterView,
        found: _Findings,
    ) -> None:
        """A pod created with ``spec.nodeName`` skips the scheduler: it must fit that node's ledger.

        It runs whatever its class says about unknown VRAM, so such VRAM holds a whole GPU here,
        as it does in the ledger once the pod is bound.
        """
        if subject.kind != "Pod" or subject.operation != "CREATE" or cluster.ledger is None:
            return
        if self.policy.direct_placement.allows(subject.user, subject.groups):
            return
        whole_gpu = _whole_gpu(choice)
        uid = _mapping(subject.obj.get("metadata")).get("uid")
        if cluster.held_back is not None:
            found.violate(
                Code.DIRECT_PLACEMENT, f"spec.nodeName {node} places the pod past the scheduler: {cluster.held_back}"
            )
            return
        claims = pod_claims(demand, whole_gpu, uid if isinstance(uid, str) else "")
        verdict = filter_node(cluster.ledger, node, claims, whole_gpu)
        if not verdict.ok:
            found.violate(
                Code.DIRECT_PLACEMENT,
                f"spec.nodeName {node} places the pod past the scheduler and it does not fit there: "
                f"{verdict.message}"
            )

    def _bound_change(
        self,
        subject: Subject,
        node: str,
        demand: PodDemand,
        choice: ClassChoice,
        cluster: ClusterView,
        found: _Findings,
    ) -> None:
        """An update of a pod already bound that changes what it holds must fit the devices it holds.

        A running pod's images can change (``kubectl set image``), and with an image the engine's
        version, hence its rules; the ledger would count the new claims at once. So the new claims
        are checked on the pod's node, on the devices it holds (recorded at bind, or reported by
        the agent), without what the pod itself holds there now. Unknown VRAM holds a whole GPU, as
        for every bound pod.
        """
        if subject.kind != "Pod" or subject.operation != "UPDATE" or subject.old is None or cluster.ledger is None:
            return
        if _node_name(subject.old) != node:
            return  # bound by this update (a Binding is a subresource): bind checked it
        whole_gpu = _whole_gpu(choice)
        metadata = _mapping(subject.obj.get("metadata"))
        uid = metadata.get("uid")
        uid = uid if isinstance(uid, str) else ""
        old_demand, _ = self._believed(self._derive(subject.old)[0], (), choice, _Findings())
        new = pod_claims(demand, whole_gpu, uid)
        old = pod_claims(old_demand, whole_gpu, uid)
        if new.claims == old.claims and new.refusal == old.refusal:
            return
        placement = Placement.decode(_mapping(metadata.get("annotations")).get(PLACEMENT_ANNOTATION))
        claims = apply_intended(new.claims, placement.containers)
        fit = cluster.ledger.fits(node, claims, uid or None)
        if fit.ok:
            return
        before = cluster.ledger.fits(node, apply_intended(old.claims, placement.containers), uid or None)
        if not before.ok and not fit.problems and _need(fit) <= _need(before):
            return  # over its budget before the change already (the ledger reports it); it adds nothing
        found.violate(
            Code.BOUND_CHANGE,
            f"pod is bound to {node} and this change alters what it holds there, which no longer fits: "
            f"{describe_fit(fit, claims)}; create a new pod instead, so that the scheduler places it",
            brief=f"bound to {node[:60]}: the change no longer fits its GPUs",
        )

    def _visible_devices(self, reaches: Sequence[DeviceReach], choice: ClassChoice, found: _Findings) -> None:
        """Containers naming their own GPUs break their class unless it allows it (a note then). One that
        leaves the variable to its image gets a note only: it may never touch a GPU (a download or a
        benchmark client in a serving image), and refusing it would break what ran before."""
        for reach in reaches:
            if reach.inherited:
                found.note(Code.VISIBLE_DEVICES, reach.describe(), container=reach.container)
            elif choice.qos.allow_visible_devices:
                found.note(Code.VISIBLE_DEVICES, f"{reach.describe()} (class {choice.name} allows it)",
                           container=reach.container)
            else:
                found.violate(
                    Code.VISIBLE_DEVICES, f"{reach.describe()} (class {choice.name})", container=reach.container,
                    brief=f"{reach.kind} {reach.container[:40]} sets NVIDIA_VISIBLE_DEVICES: GPUs nobody counted",
                )

    def _review_reaches(
        self,
        subject: Subject,
        template: Mapping[str, Any],
        reaches: Sequence[DeviceReach],
        cluster: ClusterView,
        mode: Enforcement,
    ) -> Decision:
        """A pod (or template) that asks for no GPU but names GPUs in ``NVIDIA_VISIBLE_DEVICES``."""
        found = _Findings()
        choice = self._class(template, cluster, found)
        self._visible_devices(reaches, choice, found)
        if subject.operation == "UPDATE" and subject.old is not None:
            old_found = _Findings()
            old_template = pod_template(subject.old, subject.kind) or {}
            self._visible_devices(device_reaches(old_template, self.options.is_gpu), choice, old_found)
            found.spare(old_found.violations)
        return self._decide(mode, choice, found, (), workload_pods(subject.kind, subject.obj))

    def _class(self, template: Mapping[str, Any], cluster: ClusterView, found: _Findings) -> ClassChoice:
        labels = _string_map(_mapping(template.get("metadata")).get("labels"))
        choice = self.policy.choose_class(labels, cluster.namespace_labels)
        asked = labels.get(QOS_CLASS_LABEL)
        if asked is not None and asked not in self.policy.classes:
            found.violate(
                Code.CLASS_LABEL,
                f"label {QOS_CLASS_LABEL}={asked} names no class; use one of {', '.join(self.policy.classes)}"
            )
        elif asked is not None and choice.name != asked:
            allowed = self.policy.pod_classes_under(choice.name)
            found.violate(
                Code.CLASS_LABEL,
                f"label {QOS_CLASS_LABEL}={asked} is not allowed in namespace class {choice.name}; "
                f"use one of {', '.join(allowed)} (a namespace admin sets the namespace's class)"
            )
        namespace_class = (cluster.namespace_labels or {}).get(QOS_CLASS_LABEL)
        if namespace_class is not None and namespace_class not in self.policy.classes:
            found.note(
                Code.CLASS_LABEL,
                f"namespace label {QOS_CLASS_LABEL}={namespace_class} names no class; "
                f"using class {choice.name}"
            )
        return choice

    @staticmethod
    def _conflicts(container: ContainerDemand, offer: ResourceOffer | None, found: _Findings) -> None:
        """Claims above a byte declaration or MPS limit that show only once the GPU's size is known."""
        if offer is None or not offer.sized:
            return
        for problem in container.conflicts(offer.smallest_bytes):
            found.violate(Code.CONFLICT, problem, container=container.name)
        if offer.largest_bytes != offer.smallest_bytes:
            for problem in container.conflicts(offer.largest_bytes):
                found.note(Code.CONFLICT, problem, container=container.name)

    @staticmethod
    def _capped(container: ContainerDemand, offer: ResourceOffer | None, found: _Findings) -> None:
        """A share the device holds, with estimated overheads it does not: counted as the whole device."""
        if offer is None or not offer.sized:
            return
        device = offer.smallest_bytes
        for held in container.reservations:
            if held.capped_on(device):
                estimates = ", ".join(a.describe() for a in held.allowances if a.estimate)
                found.note(
                    Code.ESTIMATE_CAPPED,
                    f"container {container.name}: {held.describe()} does not fit a {format_bytes(device)} GPU with "
                    f"its estimated overheads ({estimates}): it counts the whole GPU, so it is placed only where "
                    "it is alone, and it fails at start if its overheads are as large as estimated",
                    container=container.name,
                )
                return

    @staticmethod
    def _implicit(container: ContainerDemand, engine: str | None, choice: ClassChoice, found: _Findings) -> None:
        if engine is None or choice.qos.allow_implicit_defaults:
            return
        share = f"{float(container.claim.fraction):g}" if container.claim and container.claim.fraction else "?"
        found.violate(
            Code.IMPLICIT_DEFAULT,
            f"container {container.name} relies on {engine}'s default {_DEFAULT_KNOB[engine]} ({share} of the "
            f"GPU); {_DEFAULT_FIX[engine]} (class {choice.name})",
            container=container.name,
        )

    @staticmethod
    def _unknown(container: ContainerDemand, choice: ClassChoice, found: _Findings) -> None:
        if container.reservation is not None or container.errors or choice.qos.unknown_vram != "reject":
            return
        found.violate(
            Code.UNKNOWN_VRAM,
            f"container {container.name}: VRAM unknown and class {choice.name} rejects that; declare it, "
            f"e.g. annotation {VRAM_ANNOTATION}.{container.name}: 16Gi",
            container=container.name,
        )

    @staticmethod
    def _max_vram(
        container: ContainerDemand, choice: ClassChoice, offer: ResourceOffer | None, found: _Findings
    ) -> None:
        limit = choice.qos.max_vram
        limit_text = choice.qos.max_vram_per_gpu
        if limit is None or limit_text is None or container.errors:
            return
        if not container.reservations and choice.qos.unknown_vram == "reject":
            return  # already refused as unknown
        # Unknown VRAM is held as a whole GPU (the class's unknown_vram: whole-gpu).
        helds = container.reservations or (Vram(fraction=Fraction(1)),)
        smallest = offer.smallest_bytes if offer is not None and offer.sized else None
        largest = offer.largest_bytes if offer is not None and offer.sized else None
        verdicts = [(held.exceeds(limit, smallest), held) for held in helds]
        over = True if any(v for v, _ in verdicts) else None if any(v is None for v, _ in verdicts) else False
        held = next((h for v, h in verdicts if v), helds[0])
        if over:
            message = _max_vram_message(container, choice, held, limit, limit_text, smallest)
            found.violate(Code.MAX_VRAM, message, container=container.name)
        elif over is None:
            found.note(
                Code.MAX_VRAM,
                f"container {container.name}: cannot check max_vram_per_gpu {limit_text}: "
                f"no node offers {container.resource} with a known size",
                container=container.name,
            )
        elif largest is not None and largest != smallest and any(h.exceeds(limit, largest) for h in helds):
            held = next(h for h in helds if h.exceeds(limit, largest))
            message = _max_vram_message(container, choice, held, limit, limit_text, largest)
            found.note(Code.MAX_VRAM, message, container=container.name)

    @staticmethod
    def _mps_limit(container: ContainerDemand, choice: ClassChoice, found: _Findings) -> None:
        if not choice.qos.require_mps_limit or container.mps_limit is not None:
            return
        reservation = container.reservation
        per_gpu = "16G"
        if reservation is not None and reservation.bytes is not None:
            per_gpu = f"{-(-reservation.bytes // GiB)}G"
        example = ",".join(f"{i}={per_gpu}" for i in range(min(container.gpus, 4)))
        found.violate(
            Code.MPS_LIMIT, f"container {container.name}: class {choice.name} requires env {MEM_LIMIT}, e.g. {example}",
            container=container.name,
        )

    def _sharing(
        self,
        container: ContainerDemand,
        choice: ClassChoice,
        offer: ResourceOffer | None,
        bound: bool,
        found: _Findings,
    ) -> None:
        allowed = set(choice.qos.sharing)
        resource = container.resource
        if resource.startswith(tuple(self.policy.gpu_resource_prefixes)) and "mig" not in allowed:
            found.violate(
                Code.SHARING,
                f"container {container.name}: class {choice.name} does not allow MIG ({resource}); "
                f"{self._classes_allowing({'mig'})}",
                container=container.name,
            )
            return
        if resource.endswith(".shared") and not allowed & {"time-slicing", "mps"}:
            found.violate(
                Code.SHARING,
                f"container {container.name}: class {choice.name} does not allow shared GPUs ({resource}); "
                f"{self._classes_allowing({'time-slicing', 'mps'})}",
                container=container.name,
            )
            return
        if offer is None:
            where = f"its node offers no {resource}" if bound else f"no node offers {resource} yet"
            found.note(
                Code.RESOURCE_MISSING, f"container {container.name}: {where}; the pod cannot run until one does",
                container=container.name,
            )
            return
        if offer.sharing and not offer.sharing & allowed:
            where = "its node offers" if bound else "nodes offer"
            offered = " or ".join(_SHARING_WORDS.get(s, s) for s in sorted(offer.sharing))
            found.violate(
                Code.SHARING,
                f"container {container.name}: {where} {resource} only as {offered} GPUs, which class "
                f"{choice.name} does not allow (it allows {', '.join(choice.qos.sharing)})",
                container=container.name,
            )

    def _classes_allowing(self, strategies: set[str]) -> str:
        names = [name for name, qos in self.policy.classes.items() if strategies & set(qos.sharing)]
        if not names:
            return "no class of the policy allows it"
        return f"set label {QOS_CLASS_LABEL} to {' or '.join(names)}"

    def _quota(
        self,
        subject: Subject,
        claims: tuple[Claim, ...],
        pods: int,
        offers: Mapping[str, ResourceOffer],
        cluster: ClusterView,
        found: _Findings,
        claimed: int = 0,
    ) -> None:
        """``claimed``: what the pod's own DRA claims hold, beside its device-plugin GPUs."""
        quota = self.quota_bytes(subject.namespace)
        usage = cluster.usage
        if quota is None or usage is None:
            return
        per_pod, unsized = claims_bytes(claims, offers)
        per_pod += claimed
        for resource in unsized:
            found.note(
                Code.QUOTA,
                f"namespace {subject.namespace} VRAM quota: no node offers {resource} with a known size, "
                "so this pod's share of it is not counted"
            )
        if usage.unsized:
            found.note(
                Code.QUOTA,
                f"namespace {subject.namespace} VRAM quota: {len(usage.unsized)} pod(s) cannot be sized "
                "(no node offers their GPU resource) and are not counted"
            )
        ns, limit = subject.namespace, quantity_text(quota)
        if subject.kind == "Pod":
            total = usage.bytes + per_pod
            if total > quota:
                found.violate(
                    Code.QUOTA,
                    f"namespace {ns} would hold {quantity_text(total)} of its {limit} VRAM quota "
                    f"(this pod {quantity_text(per_pod)}, {usage.pods} other pod(s) {quantity_text(usage.bytes)})"
                )
            return
        if _controlled(subject.obj):
            return
        workload = pods * per_pod
        if subject.operation == "CREATE":
            total = usage.bytes + workload
            if total > quota:
                found.violate(
                    Code.QUOTA,
                    f"namespace {ns} would hold {quantity_text(total)} of its {limit} VRAM quota "
                    f"({pods} pod(s) x {quantity_text(per_pod)}, {usage.pods} other pod(s) "
                    f"{quantity_text(usage.bytes)})"
                )
        elif workload > quota:
            found.violate(
                Code.QUOTA,
                f"{subject.kind} needs {quantity_text(workload)} of VRAM ({pods} pod(s) x {quantity_text(per_pod)}), "
                f"more than namespace {ns}'s {limit} VRAM quota"
            )

    @staticmethod
    def _pods(
        kind: str,
        obj: Mapping[str, Any],
        template: Mapping[str, Any],
        demand: PodDemand,
        offers: Mapping[str, ResourceOffer],
    ) -> int:
        """Pods the object runs at once; a DaemonSet's are the nodes that offer its GPUs and match."""
        if kind != "DaemonSet":
            return workload_pods(kind, obj)
        selector = _string_map(_mapping(template.get("spec")).get("nodeSelector"))
        counts = []
        for resource in dict.fromkeys(c.resource for c in demand.containers):
            offer = offers.get(resource)
            labels = offer.node_labels if offer is not None else ()
            counts.append(sum(1 for node in labels if all(node.get(k) == v for k, v in selector.items())))
        return workload_pods(kind, obj, max(counts, default=0))

    # -- updates and the answer ------------------------------------------------------------------

    def _review_claim_object(self, subject: Subject, cluster: ClusterView, mode: Enforcement) -> Decision:
        """A ResourceClaim or ResourceClaimTemplate: checked against the live pods already naming it
        (created after them), as they are checked against it (``claim-memory``); with no such pod,
        warnings only (the pod that will use it is checked when it is created). Its spec is
        immutable, so only CREATE is reviewed."""
        if cluster.dra is None or subject.operation != "CREATE":
            return Decision(True, mode)
        spec = (read_claim if subject.kind == "ResourceClaim" else read_claim_template)(subject.obj)
        spec = replace(spec, namespace=subject.namespace)
        found = _Findings()
        for shortfall in review_claim_users(spec, subject.kind, cluster.dra):
            found.violate(Code.CLAIM_MEMORY, shortfall.message())
        for text in review_claim_spec(spec, cluster.dra, subject.kind):
            found.note(Code.CLAIM_UNCHECKED, text)
        if not found.violations:
            remarks = tuple(found.notes)
            return Decision(True, mode, remarks=remarks, warnings=_fit_warnings([f.message for f in remarks]))
        return self._decide(mode, self.policy.choose_class(None, cluster.namespace_labels), found, (), 1)

    def _spare_old_claim_violations(self, subject: Subject, cluster: ClusterView, found: _Findings) -> None:
        """Demote claim violations the old object had too (see :meth:`_spare_old_violations`)."""
        assert subject.old is not None and cluster.dra is not None
        old_template = pod_template(subject.old, subject.kind)
        if old_template is None:
            return
        old_found = _Findings()
        old_demand = self._derive(old_template)[0]
        old_review = review_pod_claims(
            old_template, subject.namespace, old_demand, cluster.dra, workload_pods(subject.kind, subject.old)
        )
        _claim_findings(old_review, old_found, subject.kind == "Pod")
        old = {f.message for f in old_found.violations}
        kept = [f for f in found.violations if f.message not in old]
        found.notes.extend(f for f in found.violations if f.message in old)
        found.violations[:] = kept

    def _spare_old_violations(self, subject: Subject, cluster: ClusterView, found: _Findings) -> None:
        """Demote violations the old object had too: an update must not be refused for them."""
        assert subject.old is not None
        old_subject = Subject(subject.kind, "UPDATE", subject.namespace, subject.old)
        old_template = pod_template(subject.old, subject.kind)
        if old_template is None:
            return
        old_demand, claims = self._derive(old_template)
        if not old_demand.wants_gpu:
            return
        old_found = _Findings()
        choice = self._class(old_template, cluster, old_found)
        offers = cluster.node_offers if cluster.node_offers is not None else cluster.offers
        pods = self._pods(subject.kind, subject.old, old_template, old_demand, offers)
        self._rules(old_subject, old_demand, choice, offers, claims, pods, cluster, old_found)
        self._visible_devices(device_reaches(old_template, self.options.is_gpu), choice, old_found)
        found.spare(old_found.violations)

    def _decide(
        self, mode: Enforcement, choice: ClassChoice, found: _Findings, claims: tuple[Claim, ...], pods: int
    ) -> Decision:
        problems = tuple(dict.fromkeys(found.violations))
        remarks = tuple(n for n in dict.fromkeys(found.notes) if n not in problems)
        # The response's texts are rendered here, from the findings, and only here.
        violations = tuple(f.message for f in problems)
        warnings: list[str] = []
        annotations: dict[str, str] = {}
        message: str | None = None
        allowed = True
        if violations and mode == "enforce":
            allowed = False
            message = denial_message(violations)
        elif violations and mode == "warn":
            warnings.extend(line for f in problems for line in _would_deny(f))
        elif violations:
            annotations[AUDIT_WOULD_DENY_KEY] = _audit_value(violations)
            annotations[AUDIT_CLASS_KEY] = choice.name
            # Recorded, and said: what would be refused is never less visible than a note. A pod
            # nothing will guard is said in the fewest words (its GPU is shared unchecked).
            warnings.extend(
                f"not guarded: {f.brief or f.message}" if f.code is Code.SCHEDULER else line
                for f in problems for line in _would_deny(f, "audit: would deny: ")
            )
        warnings.extend(f.message for f in remarks)
        return Decision(
            allowed=allowed,
            mode=mode,
            problems=problems,
            remarks=remarks,
            message=message,
            warnings=_fit_warnings(warnings),
            audit_annotations=annotations,
            qos_class=choice.name,
            wants_gpu=True,
            claims=claims,
            pods=pods,
        )


def _max_vram_message(
    container: ContainerDemand, choice: ClassChoice, held: Vram, limit: Vram, limit_text: str, device: int | None
) -> str:
    if container.reservation is None:
        whole = f" of {format_bytes(device)}" if device is not None and limit.bytes is not None else ""
        return (
            f"container {container.name}: VRAM unknown, so it holds a whole GPU{whole}, above class "
            f"{choice.name}'s max_vram_per_gpu {limit_text}; declare {VRAM_ANNOTATION}.{container.name}"
        )
    amount = f"{held.describe()} per GPU"
    if device is not None and held.fraction is not None and limit.bytes is not None:
        extra = f" + {format_bytes(held.allowance_bytes)}" if held.allowance_bytes else ""
        amount = (
            f"{format_bytes(held.on_device(device))} per GPU "
            f"({float(held.fraction):g} x {format_bytes(device)}{extra})"
        )
    return (
        f"container {container.name}: reserves {amount}, above class {choice.name}'s "
        f"max_vram_per_gpu {limit_text}"
    )


def denial_message(violations: Sequence[str]) -> str:
    """The message of a denial: the one violation, or a list of them."""
    if len(violations) == 1:
        return violations[0]
    return f"{len(violations)} problems:\n" + "\n".join(f"- {v}" for v in violations)


def _fit_warnings(warnings: Sequence[str]) -> tuple[str, ...]:
    fitted = [fit_warning(w) for w in warnings]
    if len(fitted) > MAX_WARNINGS:
        rest = len(fitted) - (MAX_WARNINGS - 1)
        fitted = [*fitted[: MAX_WARNINGS - 1], f"and {rest} more; run vramguard explain on the manifest to see all"]
    return tuple(dict.fromkeys(fitted))


def _audit_value(violations: Sequence[str]) -> str:
    kept: list[str] = []
    size = 2
    for violation in violations:
        size += len(json.dumps(violation)) + 1
        if size > AUDIT_VALUE_LIMIT:
            kept.append(f"and {len(violations) - len(kept)} more")
            break
        kept.append(violation)
    return json.dumps(kept)


@dataclass(slots=True)
class _Findings:
    violations: list[Finding] = field(default_factory=list)
    notes: list[Finding] = field(default_factory=list)

    def violate(self, code: Code, message: str, container: str | None = None, brief: str | None = None) -> None:
        self.violations.append(Finding(code, message, container, brief))

    def note(self, code: Code, message: str, container: str | None = None) -> None:
        self.notes.append(Finding(code, message, container))

    def spare(self, before: Sequence[Finding]) -> None:
        """Demote the violations ``before`` (the old object's) had too: an update is not refused for them."""
        had = set(before)
        for violation in [v for v in self.violations if v in had]:
            self.violations.remove(violation)
            self.notes.append(violation)


_SPLIT_CODES = frozenset({Code.CLAIM_MEMORY, Code.EXTENDED_RESOURCE_MEMORY})


def _would_deny(finding: Finding, prefix: str = "would deny: ") -> tuple[str, ...]:
    """A violation as ``warn`` (and ``audit``) mode returns it. A claim's memory message too long for
    one warning is split before the number to write (``set capacity.requests.memory: 72Gi``), which
    must survive."""
    text = f"{prefix}{finding.message}"
    if len(text) > WARNING_LIMIT and finding.brief:
        return (f"{prefix}{finding.brief}",)
    head, _, fix = finding.message.rpartition("; ")
    if len(text) <= WARNING_LIMIT or finding.code not in _SPLIT_CODES or not head:
        return (text,)
    return (f"{prefix}{head}", f"to fix it: {fix}")


def _drop_served_by_dra(demand: PodDemand, dra: DraContext, found: _Findings) -> None:
    """No device plugin offers a resource that a DeviceClass serves on DRA devices: that is no
    reason to say the pod cannot run (the DRA extended-resource path serves it)."""
    served = {
        c.name
        for c in demand.containers
        if (device_class := dra.extended_class(c.resource)) is not None and dra.candidates(device_class)
    }
    found.notes[:] = [f for f in found.notes if not (f.code is Code.RESOURCE_MISSING and f.container in served)]


def _claim_findings(review: ClaimReview, found: _Findings, pod: bool) -> None:
    """The DRA review's findings: memory shortfalls and demand errors deny, the rest are notes. A
    claim or template that does not exist denies a Pod (nothing else checks its memory before it
    runs); a workload's pods are checked when its controller makes them, so there it is a note."""
    for missing in review.missing:
        if pod:
            found.violate(Code.CLAIM_MISSING, missing)
        else:
            found.note(Code.CLAIM_UNCHECKED, missing)
    for shortfall in review.shortfalls:
        found.violate(Code.CLAIM_MEMORY, shortfall.message(), shortfall.needs[0].container)
    for shortfall in review.extended:
        found.violate(Code.EXTENDED_RESOURCE_MEMORY, shortfall.message(), shortfall.needs[0].container)
    for error in review.errors:
        found.violate(Code.DEMAND_ERROR, error)
    for note in review.notes:
        found.note(Code.CLAIM_UNCHECKED, note)


def _implicit_default(container: ContainerDemand) -> str | None:
    """The engine whose implicit memory default the container relies on (``vLLM``, ``TGI``, ``JAX``)."""
    if not container.implicit_default or container.engine is None:
        return None
    return _ENGINE_TITLES.get(container.engine)


def _need(fit: Fit) -> int:
    """The most a failed fit's pod adds to one device."""
    return max((shortfall.need for shortfall in fit.shortfalls), default=0)


def _whole_gpu(choice: ClassChoice) -> ClassChoice:
    """``choice`` with unknown VRAM held as a whole GPU, as it is held once the pod runs."""
    if choice.qos.unknown_vram == "whole-gpu":
        return choice
    return ClassChoice(choice.name, choice.qos.model_copy(update={"unknown_vram": "whole-gpu"}), choice.source)


def _node_name(obj: Mapping[str, Any]) -> str:
    node = _mapping(obj.get("spec")).get("nodeName")
    return node if isinstance(node, str) else ""


def _controlled(obj: Mapping[str, Any]) -> bool:
    """Whether a controller made the object (a Deployment's ReplicaSet, a CronJob's Job)."""
    owners = _mapping(obj.get("metadata")).get("ownerReferences")
    return isinstance(owners, list) and any(isinstance(o, Mapping) and o.get("controller") is True for o in owners)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _string_map(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}
