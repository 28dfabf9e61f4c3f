"""The webhook's admission rules, applied by the offline commands (``explain``, ``plan``, ``audit``).

A :class:`Judge` holds the model the webhook would review against: the nodes' offers, the
namespaces' labels (class and mode), the live pods each namespace's quota counts and the DRA
objects, fed from the input's files, from the live cluster (``--cluster``), or both. Each object is
then judged as the webhook judges its CREATE, so that an object the API server would refuse is
never reported placed or fine.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vramguard.admission import AdmissionRules, ClusterView, Decision, Operation, Subject
from vramguard.cli.kubectl_vram import ClusterSnapshot, choose_policy, read_cluster
from vramguard.dra.state import KIND_STORES
from vramguard.mutation import plan_mutation
from vramguard.policy import Policy, PolicyError

if TYPE_CHECKING:
    from vramguard.cluster import ClusterState

JSON = dict[str, Any]

_CONTEXT_KINDS = frozenset({"Node", "Namespace", *KIND_STORES})
DRA_COLLECTIONS = (
    ("ResourceSlice", "resourceslices"), ("DeviceClass", "deviceclasses"),
    ("ResourceClaim", "resourceclaims"), ("ResourceClaimTemplate", "resourceclaimtemplates"),
)
"""Each resource.k8s.io kind and its collection (a :class:`ClusterSnapshot`'s ``dra`` key)."""


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """``--cluster``, ``--kubeconfig`` and ``--context``."""
    parser.add_argument(
        "--cluster", action="store_true",
        help="also read the live cluster (nodes, namespaces, live pods, DRA objects, the policy ConfigMap) "
        "with the current kubeconfig, so the answer is the cluster's",
    )
    parser.add_argument("--kubeconfig", help="kubeconfig file for --cluster (default: $KUBECONFIG or ~/.kube/config)")
    parser.add_argument("--context", help="kubeconfig context for --cluster (default: the current one)")


@dataclass(frozen=True, slots=True)
class Live:
    """What ``--cluster`` read: the snapshot, and the policy it chose (``--policy``, else the
    cluster's ConfigMap, else the shipped one)."""

    snapshot: ClusterSnapshot
    policy: Policy
    policy_source: str


class LiveError(Exception):
    """The cluster could not be read, or its policy is invalid; the message says which."""


def read_live(args: argparse.Namespace) -> Live | None:
    """The cluster the arguments name with ``--cluster`` (``None`` without it); raises
    :class:`LiveError`."""
    if not getattr(args, "cluster", False):
        return None
    try:
        snapshot, configmap_text = read_cluster(args.kubeconfig, args.context)
    except Exception as exc:  # the client raises many types: config, network, API
        raise LiveError(f"cannot read the cluster: {exc}") from None
    path = Path(args.policy) if getattr(args, "policy", None) else None
    try:
        policy, source = choose_policy(path, configmap_text)
    except PolicyError as exc:
        raise LiveError(str(exc)) from None
    return Live(snapshot, policy, source)


def snapshot_of(objects: Sequence[Mapping[str, Any]], live: ClusterSnapshot | None = None) -> ClusterSnapshot:
    """The cluster as the input (and the live cluster) describe it: Nodes and Namespaces, pods
    bound to a node, and DRA objects. An object of the input replaces the cluster's of the same
    name (the input is what is about to be applied)."""
    base = live if live is not None else ClusterSnapshot()
    snapshot = ClusterSnapshot(
        nodes=_merged(base.nodes, _of_kind(objects, "Node")),
        namespaces=_merged(base.namespaces, _of_kind(objects, "Namespace")),
        pods=_merged(base.pods, [_with_uid(p) for p in _of_kind(objects, "Pod") if _node_name(p)]),
        policy_source=base.policy_source,
        leases=list(base.leases),
        learned=base.learned,
    )
    snapshot.dra = {
        store: _merged(base.dra.get(store, []), _of_kind(objects, kind))
        for kind, store in DRA_COLLECTIONS
    }
    return snapshot


def is_subject(obj: Mapping[str, Any]) -> bool:
    """Whether the object is one to judge (not a Node, Namespace or DRA object describing the cluster)."""
    return obj.get("kind") not in _CONTEXT_KINDS


class Judge:
    """The admission rules of one policy over a model of the cluster."""

    def __init__(self, policy: Policy, snapshot: ClusterSnapshot, *, stand_in_memory: int | None = None) -> None:
        """Build the model from ``snapshot``. ``stand_in_memory``: with no ResourceSlice, one stand-in
        GPU of that memory for DRA claims (``explain --gpu-memory``)."""
        from vramguard.cli.kubectl_vram import build_state  # noqa: PLC0415 - cluster model, once

        self.rules = AdmissionRules(policy)
        self.state: ClusterState = build_state(snapshot, policy)
        dra = [
            {**obj, "kind": kind, "apiVersion": obj.get("apiVersion") or "resource.k8s.io/v1"}
            for kind, store in DRA_COLLECTIONS
            for obj in snapshot.dra.get(store, [])
        ]
        # As the offline commands read DRA files: the NVIDIA chart's classes when none is given.
        self.state.dra.feed(dra, stand_in_memory=stand_in_memory)

    def view(self, kind: str, namespace: str, obj: Mapping[str, Any]) -> ClusterView:
        """What the webhook would know when reviewing ``obj``: the namespace's labels, the offers (the
        node's, for a pod bound to one), the namespace's usage when it has a quota (the pod itself left
        out) and the DRA objects. A pod's placement is the scheduler's: not judged here."""
        state = self.state
        node = _node_name(obj) if kind == "Pod" else ""
        usage = None
        if self.rules.quota_bytes(namespace) is not None:
            usage = state.usage_with_dra(namespace, exclude=pod_uid(obj) if kind == "Pod" else None)
        return ClusterView(
            state.namespace_labels.get(namespace), state.offers(), state.node_offers(node) if node else None, usage,
            dra=state.dra_context(),
        )

    def review(self, obj: Mapping[str, Any], operation: Operation = "CREATE") -> Decision:
        """The webhook's decision on ``obj`` (its namespace defaults to ``default``, as kubectl's); a
        Pod created is first routed as the mutating webhook routes it (the API server calls the
        mutating webhooks before the validating ones)."""
        kind = str(obj.get("kind"))
        namespace = str(_mapping(obj.get("metadata")).get("namespace") or "default")
        if kind == "Pod" and operation == "CREATE":
            obj = self.routed(obj, namespace)
        return self.rules.review(Subject(kind, operation, namespace, obj), self.view(kind, namespace, obj))

    def routed(self, pod: Mapping[str, Any], namespace: str) -> Mapping[str, Any]:
        """``pod`` as the mutating webhook leaves its scheduler: routed to vramguard's where it names
        none and asks for a GPU, unless routing is off or its namespace opts out."""
        labels = self.state.namespace_labels.get(namespace)
        demand = self.rules.demand(pod)
        choice = self.rules.policy.choose_class(_labels(pod), labels)
        mutation = plan_mutation(
            self.rules.policy, pod, namespace, labels, demand, choice, self.state.offers(), self.state.dra_context()
        )
        if mutation.routed_to is None:
            return pod
        return {**pod, "spec": {**_mapping(pod.get("spec")), "schedulerName": mutation.routed_to}}

    def count(self, pods: Iterable[JSON]) -> None:
        """Count admitted pods in their namespaces' quotas (and, bound, on their nodes), as the
        webhook counts what it admitted before the next review."""
        for pod in pods:
            self.state.pods.upsert(pod)


def admission_json(decision: Decision) -> JSON:
    """The decision as the commands print it: ``allowed`` (what the API server answers), ``mode``,
    the ``class``, ``problems`` (what denies in ``enforce``; warned or audited in other modes) and
    ``remarks`` (never denying), each with its ``rule``."""
    return {
        "allowed": decision.allowed,
        "mode": decision.mode,
        "class": decision.qos_class,
        "message": decision.message,
        "problems": [{"rule": str(f.code), "message": f.message} for f in decision.problems],
        "remarks": [{"rule": str(f.code), "message": f.message} for f in decision.remarks],
    }


def admission_lines(admission: Mapping[str, Any], indent: str = "  ") -> list[str]:
    """Text lines for :func:`admission_json`'s result: refused, or admitted with what the mode lets by,
    then the remarks (which never deny)."""
    problems = admission["problems"]
    if not admission["allowed"]:
        head = f"{indent}admission: refused ({admission['mode']} mode)"
    elif problems:
        head = f"{indent}admission: admitted in {admission['mode']} mode; refused where the namespace enforces"
    else:
        head = f"{indent}admission: admitted ({admission['mode']} mode)"
    return [head, *(f"{indent}  [{p['rule']}] {p['message']}" for p in problems),
            *(f"{indent}  note [{r['rule']}] {r['message']}" for r in admission.get("remarks", ()))]


def pod_uid(pod: Mapping[str, Any]) -> str:
    """The pod's UID, or for a pod of the input that has none, ``<namespace>/<name>``."""
    metadata = _mapping(pod.get("metadata"))
    return str(metadata.get("uid") or f"{metadata.get('namespace') or 'default'}/{metadata.get('name')}")


def _with_uid(pod: JSON) -> JSON:
    metadata = _mapping(pod.get("metadata"))
    if metadata.get("uid"):
        return pod
    return {**pod, "metadata": {**metadata, "uid": pod_uid(pod), "namespace": metadata.get("namespace") or "default"}}


def _labels(obj: Mapping[str, Any]) -> dict[str, str]:
    labels = _mapping(_mapping(obj.get("metadata")).get("labels"))
    return {k: v for k, v in labels.items() if isinstance(k, str) and isinstance(v, str)}


def _of_kind(objects: Iterable[Mapping[str, Any]], kind: str) -> list[JSON]:
    return [dict(obj) for obj in objects if obj.get("kind") == kind]


def _merged(base: Iterable[JSON], given: Iterable[JSON]) -> list[JSON]:
    """``base`` with ``given`` replacing objects of the same namespace and name."""
    merged = {_key(obj): obj for obj in base}
    merged.update((_key(obj), obj) for obj in given)
    return list(merged.values())


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    metadata = _mapping(obj.get("metadata"))
    return str(metadata.get("namespace") or ""), str(metadata.get("name") or id(obj))


def _node_name(obj: Mapping[str, Any]) -> str:
    return str(_mapping(obj.get("spec")).get("nodeName") or "")


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}
