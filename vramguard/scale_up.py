"""Scale-up for GPU pods no existing GPU can hold: the scheduling gate and its decision (pure).

Neither Cluster Autoscaler nor Karpenter calls scheduler extenders: each simulates the in-tree
filters, sees a free ``nvidia.com/gpu`` replica on a node whose GPU lacks the bytes, and adds no
node. So the pods of the classes ``scale_up`` names are created gated (the mutating webhook adds
:data:`GATE`: autoscalers skip a pod whose ``PodScheduled`` reason is ``SchedulingGated``), and the
extender's leader decides once per pod (docs/autoscaling.md):

- **Release**: some node the pod may go to (taints, node selection) has the VRAM: the gate is
  removed and nothing else changes, so the pod is placed as it would be without the gate.
- **Narrow and release**: no such node has it, but an empty node of a shape the cluster has would:
  the gate is removed in the same patch that appends ``<key> NotIn [the GPU nodes that refused it]``
  to every required node-affinity term (KEP-3838 allows adding to a gated pod's node affinity).
  kube-scheduler then finds no node, the pod turns ``Unschedulable``, and the autoscaler's own
  simulation, which honours node affinity, adds a node. ``key`` is ``kubernetes.io/hostname`` for
  Cluster Autoscaler (it renames every template node's hostname) and :data:`SCALE_UP_LABEL` for
  Karpenter (which ignores any pod naming ``kubernetes.io/hostname``).
- **Hold**: not even an empty node of any shape in the cluster would hold it (it asks for more VRAM
  than any GPU has): it stays gated, with a Warning Event, since a new node would not hold it either.

A pod is decided once its other scheduling gates are gone (:func:`other_gates`), and only once:
nothing flaps. A pod whose own selection names its nodes (:func:`pins_nodes`) is released as it is,
since no new node could match it. A released pod carries :data:`RELEASED_ANNOTATION` (when); one
still ``Unschedulable`` ``release_timeout_seconds`` later is evicted where a ReplicaSet or
StatefulSet owns it (:func:`recreatable`), so it is recreated and decided again (:func:`overdue`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from vramguard.placement import PodClaims
from vramguard.policy import SCALE_UP_LABEL, Autoscaler

__all__ = [
    "GATE",
    "HOSTNAME_LABEL",
    "MAX_EXCLUDED",
    "RELEASED_ANNOTATION",
    "Hold",
    "Release",
    "add_gate_patch",
    "decide",
    "exclusion_key",
    "fits_one_gpu",
    "gate_index",
    "label_value_for",
    "other_gates",
    "overdue",
    "pins_nodes",
    "protect_patch",
    "recreatable",
    "release_patch",
    "released_at",
]

GATE = "vramguard.io/vram"
"""The scheduling gate GPU pods of the gated classes are created with."""
RELEASED_ANNOTATION = "vramguard.io/released"
"""When the extender lifted the gate (RFC 3339, UTC), and how: ``<time>`` or ``<time> narrowed``."""
HOSTNAME_LABEL = "kubernetes.io/hostname"
MAX_EXCLUDED = 1000
"""The most nodes a narrowed pod excludes. Each required term gains the list (about 50 bytes a
hostname), and the pod, with its ReplicaSet's copies, is stored whole on every update: beyond this
the pod is held with its reason rather than grown toward the API server's object limit."""
CLOCK_SKEW = timedelta(seconds=60)
"""How far the extender's clock may trail the API server's when a release stamp is compared with the
pod's ``creationTimestamp``."""
RECREATING_OWNERS = frozenset({("apps/v1", "ReplicaSet"), ("apps/v1", "StatefulSet")})
"""The controllers that recreate an evicted pending pod as it was. A Job counts a deleted pod as
failed (its ``backoffLimit``), and workflow engines fail the step: theirs are never evicted."""
_LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$")


@dataclass(frozen=True, slots=True)
class Release:
    """Lift the gate; with ``exclude``, first keep the pod off the nodes with those label values."""

    exclude: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Hold:
    """Keep the gate: no node of any shape the cluster has could hold the pod."""

    reason: str


def fits_one_gpu(claims: PodClaims, memory_bytes: int) -> bool:
    """Whether each of the pod's claims fits, alone, a GPU of ``memory_bytes`` (a device of a node
    the autoscaler may add, whose shape the cluster does not show): a share of the device always
    does, an amount in bytes when it is not larger."""
    if claims.refusal is not None:
        return False
    return all(claim.bytes_on(memory_bytes, memory_bytes) <= memory_bytes for claim in claims.claims)


def exclusion_key(autoscaler: Autoscaler) -> str:
    """The node label a narrowed pod excludes nodes by."""
    return SCALE_UP_LABEL if autoscaler == "karpenter" else HOSTNAME_LABEL


def label_value_for(node: str) -> str:
    """The :data:`SCALE_UP_LABEL` value vramguard gives ``node``: its name where that is a valid
    label value (at most 63 characters), else a digest of it."""
    if _LABEL_VALUE.match(node):
        return node
    return "n-" + hashlib.sha256(node.encode()).hexdigest()[:32]


def gate_index(pod: Mapping[str, Any]) -> int | None:
    """Where :data:`GATE` is in the pod's ``spec.schedulingGates``, or ``None``."""
    spec = pod.get("spec")
    gates = spec.get("schedulingGates") if isinstance(spec, Mapping) else None
    for index, gate in enumerate(gates if isinstance(gates, list) else ()):
        if isinstance(gate, Mapping) and gate.get("name") == GATE:
            return index
    return None


def other_gates(pod: Mapping[str, Any]) -> bool:
    """Whether the pod carries a scheduling gate besides :data:`GATE` (a queue's admission, say): it is
    decided once the others are gone, on the cluster and node selection it will be placed with."""
    spec = pod.get("spec")
    gates = spec.get("schedulingGates") if isinstance(spec, Mapping) else None
    listed = gates if isinstance(gates, list) else ()
    return any(not (isinstance(g, Mapping) and g.get("name") == GATE) for g in listed)


def pins_nodes(spec: Mapping[str, Any]) -> bool:
    """Whether the pod's own selection names the nodes it may run on (a ``kubernetes.io/hostname``
    selector or ``In`` expression, or a ``metadata.name`` field, as DaemonSet pods have): a node the
    autoscaler adds could not match it, so narrowing would leave it no node at all."""
    selector = spec.get("nodeSelector")
    if isinstance(selector, Mapping) and HOSTNAME_LABEL in selector:
        return True
    affinity = spec.get("affinity")
    node_affinity = affinity.get("nodeAffinity") if isinstance(affinity, Mapping) else None
    required = (node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
                if isinstance(node_affinity, Mapping) else None)
    terms = required.get("nodeSelectorTerms") if isinstance(required, Mapping) else None
    if not isinstance(terms, list) or not terms:
        return False
    # A pod may run where any term matches: it is pinned when every term is.
    return all(isinstance(term, Mapping) and _term_pins(term) for term in terms)


def _term_pins(term: Mapping[str, Any]) -> bool:
    for name, key in (("matchExpressions", HOSTNAME_LABEL), ("matchFields", "metadata.name")):
        for requirement in term.get(name) or ():
            if not isinstance(requirement, Mapping):
                continue
            if requirement.get("key") == key and requirement.get("operator") == "In":
                return True
    return False


SCALE_DOWN_ANNOTATIONS: Mapping[str, tuple[str, str]] = {
    "cluster-autoscaler": ("cluster-autoscaler.kubernetes.io/safe-to-evict", "false"),
    "karpenter": ("karpenter.sh/do-not-disrupt", "true"),
}
"""The annotation each autoscaler reads to leave a pod's node alone when it scales down
(Cluster Autoscaler FAQ "What types of pods can prevent CA from removing a node?"; Karpenter
``karpenter.sh/do-not-disrupt``, docs "Disruption")."""


def protect_patch(metadata: Mapping[str, Any], autoscaler: Autoscaler) -> list[dict[str, Any]]:
    """The JSON Patch that gives the pod ``autoscaler``'s do-not-disrupt annotation, unless the pod
    sets that annotation itself (its own value wins)."""
    if autoscaler not in SCALE_DOWN_ANNOTATIONS:
        return []
    key, value = SCALE_DOWN_ANNOTATIONS[autoscaler]
    annotations = metadata.get("annotations")
    if isinstance(annotations, Mapping):
        if key in annotations:
            return []
        return [{"op": "add", "path": "/metadata/annotations/" + _escape(key), "value": value}]
    return [{"op": "add", "path": "/metadata/annotations", "value": {key: value}}]


def add_gate_patch(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The JSON Patch that creates the pod with :data:`GATE` (none where it has it already)."""
    gates = spec.get("schedulingGates")
    if isinstance(gates, list):
        if any(isinstance(g, Mapping) and g.get("name") == GATE for g in gates):
            return []
        return [{"op": "add", "path": "/spec/schedulingGates/-", "value": {"name": GATE}}]
    return [{"op": "add", "path": "/spec/schedulingGates", "value": [{"name": GATE}]}]


def decide(
    passing: Iterable[str],
    refused: Mapping[str, str | None],
    fits_empty_node: bool | None,
    largest: str,
    key: str,
) -> Release | Hold:
    """The decision for one gated pod.

    ``passing``: the nodes the pod may go to whose GPUs have its VRAM now; ``refused``: the GPU
    nodes it may go to that refused it, with the value of the label ``key`` that excludes each
    (``None``: the node has none); ``fits_empty_node``: whether an empty node of some shape the
    cluster has would hold it (``None``: the cluster has no GPU node to tell, so a new node is left
    to the autoscaler's own templates); ``largest``: the largest GPU, for the hold's reason.

    A pod is held rather than released with a node it cannot exclude: the autoscaler would count it
    as fitting there, add nothing, and the pod would wait, ungated, for no one.
    """
    if any(True for _ in passing):
        return Release()
    if fits_empty_node is False:
        return Hold(
            f"no GPU node in the cluster could hold this pod even empty (the largest GPU: {largest}): a new "
            "node of the same shapes would not either, so no scale-up is asked for; lower the pod's VRAM or "
            "add a node group with larger GPUs"
        )
    unlabelled = sorted(node for node, value in refused.items() if value is None)
    if unlabelled:
        return Hold(
            f"no GPU node this pod may use has its VRAM, and {len(unlabelled)} of them ({', '.join(unlabelled[:5])}"
            f"{', ...' if len(unlabelled) > 5 else ''}) have no {key} label to exclude them by: held until they do"
        )
    exclude = tuple(sorted({value for value in refused.values() if value is not None}))
    if len(exclude) > MAX_EXCLUDED:
        return Hold(
            f"no GPU node this pod may use has its VRAM, and excluding all {len(exclude)} of them would grow the "
            f"pod past {MAX_EXCLUDED} node names: held; narrow its node selection to a node pool"
        )
    return Release(exclude)


def release_patch(pod: Mapping[str, Any], index: int, key: str, exclude: Sequence[str], now: datetime) -> list[
    dict[str, Any]
]:
    """The JSON Patch that lifts the gate at ``index``, tested first so a gate list changed meanwhile
    fails the patch instead of removing another gate, and narrows the pod away from ``exclude``."""
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ") + (" narrowed" if exclude else "")
    operations: list[dict[str, Any]] = [
        {"op": "test", "path": f"/spec/schedulingGates/{index}/name", "value": GATE},
        {"op": "remove", "path": f"/spec/schedulingGates/{index}"},
    ]
    metadata = pod.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    if isinstance(annotations, Mapping):
        operations.append({"op": "add", "path": "/metadata/annotations/" + _escape(RELEASED_ANNOTATION),
                           "value": stamp})
    else:
        # Adding the whole map would replace one another writer added since the pod was read.
        version = metadata.get("resourceVersion") if isinstance(metadata, Mapping) else None
        if isinstance(version, str) and version:
            operations.insert(0, {"op": "test", "path": "/metadata/resourceVersion", "value": version})
        operations.append({"op": "add", "path": "/metadata/annotations", "value": {RELEASED_ANNOTATION: stamp}})
    if exclude:
        operations.extend(_narrowing(pod, {"key": key, "operator": "NotIn", "values": list(exclude)}))
    return operations


def _narrowing(pod: Mapping[str, Any], expression: dict[str, Any]) -> list[dict[str, Any]]:
    """Operations appending ``expression`` to every required node-affinity term (creating the
    required affinity where there is none). A pod's existing terms may only grow while it is gated
    (``validateNodeAffinityMutation``): each keeps its expressions and gains this one; a term that
    has neither expressions nor fields matches no node, may gain nothing, and is left alone."""
    spec = pod.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    required = {"nodeSelectorTerms": [{"matchExpressions": [expression]}]}
    affinity = spec.get("affinity")
    if not isinstance(affinity, Mapping):
        return [{"op": "add", "path": "/spec/affinity",
                 "value": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}}]
    node_affinity = affinity.get("nodeAffinity")
    if not isinstance(node_affinity, Mapping):
        return [{"op": "add", "path": "/spec/affinity/nodeAffinity",
                 "value": {"requiredDuringSchedulingIgnoredDuringExecution": required}}]
    base = "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution"
    existing = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    terms = existing.get("nodeSelectorTerms") if isinstance(existing, Mapping) else None
    if not isinstance(terms, list) or not terms:
        return [{"op": "add", "path": base, "value": required}]
    operations: list[dict[str, Any]] = []
    for number, term in enumerate(terms):
        if not isinstance(term, Mapping):
            continue
        expressions, fields = term.get("matchExpressions"), term.get("matchFields")
        path = f"{base}/nodeSelectorTerms/{number}/matchExpressions"
        if isinstance(expressions, list) and expressions:
            operations.append({"op": "add", "path": path + "/-", "value": expression})
        elif isinstance(fields, list) and fields:
            operations.append({"op": "add", "path": path, "value": [expression]})
    return operations


def _escape(key: str) -> str:
    """A JSON Pointer token (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def released_at(pod: Mapping[str, Any]) -> datetime | None:
    """When the gate was lifted (:data:`RELEASED_ANNOTATION`), or ``None``: also for a stamp older
    than the pod itself, copied from a template or another pod rather than written on this one."""
    metadata = pod.get("metadata")
    metadata = metadata if isinstance(metadata, Mapping) else {}
    annotations = metadata.get("annotations")
    value = annotations.get(RELEASED_ANNOTATION) if isinstance(annotations, Mapping) else None
    if not isinstance(value, str):
        return None
    stamp, created = _time(value.split(" ", 1)[0]), _time(metadata.get("creationTimestamp"))
    if stamp is None or (created is not None and stamp < created - CLOCK_SKEW):
        return None
    return stamp


def _time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return None


def recreatable(pod: Mapping[str, Any]) -> str | None:
    """The UID of the controller that recreates the pod as it was when it is evicted (a ReplicaSet or
    a StatefulSet: :data:`RECREATING_OWNERS`), or ``None``."""
    metadata = pod.get("metadata")
    owners = metadata.get("ownerReferences") if isinstance(metadata, Mapping) else None
    for owner in owners if isinstance(owners, list) else ():
        if (isinstance(owner, Mapping) and owner.get("controller") is True
                and (owner.get("apiVersion"), owner.get("kind")) in RECREATING_OWNERS):
            uid = owner.get("uid")
            return str(uid) if uid else str(owner.get("name", ""))
    return None


def overdue(pod: Mapping[str, Any], now: datetime, timeout_seconds: float) -> bool:
    """Whether a released pod, still unbound, has been refused by the scheduler (``PodScheduled``
    ``False``, reason ``Unschedulable``) for longer than ``timeout_seconds`` since its release."""
    spec = pod.get("spec")
    if isinstance(spec, Mapping) and spec.get("nodeName"):
        return False
    since = released_at(pod)
    if since is None or (now - since).total_seconds() < timeout_seconds:
        return False
    status = pod.get("status")
    conditions = status.get("conditions") if isinstance(status, Mapping) else None
    return any(
        isinstance(c, Mapping) and c.get("type") == "PodScheduled" and c.get("status") == "False"
        and c.get("reason") == "Unschedulable"
        for c in (conditions if isinstance(conditions, list) else ())
    )
