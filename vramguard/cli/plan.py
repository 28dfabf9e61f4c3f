"""``vramguard plan``: where the GPU pods of a manifest would go on a set of Nodes, and why some cannot.

Reads Nodes, Namespaces, Pods and workloads from one file (YAML or JSON), places the pods one by one
in file order with the same filter, score and GPU choice as the extender, and prints the placement,
the pods left pending with each node's reason, and the final state of every GPU. Pods that already
name a node (``spec.nodeName``) are counted there first, as the extender counts pods it did not place.
Pure: it reads files and prints; it talks to no cluster.

DRA: the file may also hold ResourceSlices, DeviceClasses (the NVIDIA chart's are assumed when it
has none), ResourceClaims (allocated ones count where they are) and ResourceClaimTemplates. Pods
whose GPUs come from claims, and pods asking an extended resource that a DeviceClass serves where
no node's device plugin does, are allocated as the scheduler's allocator counts claims
(:mod:`vramguard.dra.allocate`: the memory a claim consumes, not what its engine takes), and a
claim short of its engine's memory is a finding on the pod, as admission words it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from vramguard.admission import Code, Decision
from vramguard.cli.inputs import InputError, add_input_arguments, read_sources
from vramguard.cli.judge import DRA_COLLECTIONS, Judge, LiveError, add_cluster_arguments, read_live, snapshot_of
from vramguard.cli.kubectl_vram import ClusterSnapshot
from vramguard.demand import DemandOptions, PodDemand
from vramguard.dra.allocate import DraBook
from vramguard.dra.claims import ClaimRequest, DeviceRequest
from vramguard.dra.classes import class_for_extended_resource
from vramguard.dra.pods import container_claim_uses, pod_claim_sources
from vramguard.dra.review import DraContext, review_pod_claims
from vramguard.dra.state import KIND_STORES, DraState
from vramguard.inventory import read_inventory
from vramguard.ledger import Ledger, PodRef
from vramguard.node_selection import placement_refusal
from vramguard.placement import NodeVerdict, PodClaims, Verdict, choose_gpus, filter_node, pod_claims, score_node
from vramguard.policy import ClassChoice, Policy, PolicyError, default_policy, load_policy
from vramguard.quantity import format_bytes
from vramguard.workloads import Inputs, object_parts, parts_demand, read_inputs, unread_warning

EXIT_ALL_PLACED, EXIT_SOME_PENDING, EXIT_UNREADABLE, EXIT_SKIPPED = 0, 1, 2, 3
MAX_PLANNED_PODS = 4096
"""Pods planned per template at most: a plan is read by a person, and replicas may be a typo."""
ADMISSION_REFUSAL = "refused at admission (see below): the API server would not create it"
_REPLICATED = {"Deployment", "StatefulSet", "ReplicaSet", "ReplicationController"}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``plan`` sub-command."""
    parser = subparsers.add_parser(
        "plan",
        help="show where GPU pods would be placed on given Nodes, and which stay pending and why",
        description="Read Nodes, Namespaces, Pods and workloads (YAML, JSON, multi-document, kind: List) "
        "and place the GPU pods in file order as the vramguard extender would, each object first judged "
        "by the admission webhook's rules (a refused one stays pending); with --cluster, on the live "
        "cluster's nodes, namespaces and pods. Exit 0: every pod placed; 1: some pods stay pending or "
        "are refused; 2: unreadable input, document, policy or cluster; 3: every pod placed, but an "
        "object of a kind vramguard does not read asks for a GPU (skipped).",
    )
    add_input_arguments(parser)
    parser.add_argument(
        "--policy", metavar="FILE",
        help="policy file (default: with --cluster its ConfigMap vramguard-system/vramguard-policy, else the shipped "
        "policy)",
    )
    add_cluster_arguments(parser)
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text")
    parser.set_defaults(handler=run)


@dataclass
class Plan:
    """The outcome of placing every pod."""

    placed: list[dict[str, Any]] = field(default_factory=list)
    pending: list[dict[str, Any]] = field(default_factory=list)
    gpus: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Objects of kinds vramguard does not read that ask for a GPU: their pods are not placed."""


def run(args: argparse.Namespace) -> int:
    """Plan the input and print it; the exit code says whether every pod was placed."""
    try:
        policy = load_policy(args.policy) if args.policy else default_policy()
        sources = read_sources(args)
        live = read_live(args)
    except (InputError, PolicyError, LiveError) as exc:
        print(f"vramguard plan: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    if live is not None:
        policy = live.policy
    documents = [document for source in sources for document in source.documents]
    for source in sources:
        for document in source.documents:
            if document.error is not None:
                print(f"vramguard plan: {source.name}: document {document.index}: {document.error}", file=sys.stderr)
    objects = [obj for document in documents for obj in document.objects]
    if live is not None:
        # The cluster's nodes and bound pods hold their GPUs first; the input's objects replace the
        # cluster's of the same name.
        objects = [*live_objects(live.snapshot), *objects]
    plan = make_plan(objects, policy, live.snapshot if live is not None else None)
    if args.output == "json":
        print(json.dumps({"placed": plan.placed, "pending": plan.pending, "gpus": plan.gpus,
                          "notes": plan.notes, "skipped": plan.skipped}, indent=2))
    else:
        print(render_text(plan))
    if any(document.error is not None for document in documents):
        return EXIT_UNREADABLE
    if plan.pending:
        return EXIT_SOME_PENDING
    return EXIT_SKIPPED if plan.skipped else EXIT_ALL_PLACED


def make_plan(objects: list[Mapping[str, Any]], policy: Policy, live: ClusterSnapshot | None = None) -> Plan:
    """Place the pods of ``objects`` on its Nodes, in order, each object first judged by the
    admission webhook's rules (``live``: the cluster read with ``--cluster``, its Namespaces and live
    pods counted too)."""
    plan = Plan()
    ledger = Ledger(policy.budget_rule())
    selection: dict[str, tuple[Any, Any]] = {}
    for obj in objects:
        if obj.get("kind") == "Node":
            inventory = read_inventory(
                obj, gpu_resources=policy.gpu_resources, mig_prefixes=policy.gpu_resource_prefixes
            )
            ledger.upsert_node(inventory)
            plan.notes.extend(f"node {inventory.node}: {note}" for note in inventory.notes)
            spec = obj.get("spec")
            selection[inventory.node] = (_meta(obj).get("labels"), spec.get("taints") if isinstance(spec, Mapping)
                                         else None)
    judge = Judge(policy, snapshot_of(objects, live))
    namespaces = judge.state.namespace_labels
    options = policy.demand_options()
    inputs = read_inputs(objects)
    dra = DraState()
    dra.feed(objects)
    plan.notes.extend(dra.notes())
    book = DraBook(dra.devices(), dra.usage())
    context = dra.context()
    offered = {r for node in ledger.node_names() for r in (ledger.inventory(node) or _NO_GPUS).resources()}
    # Claims named by several pods (resourceClaimName): where they are allocated (in the input's
    # status, or by the first pod that named them).
    shared: dict[str, str] = {}
    by_key = dra.inventory().by_key()
    for allocation in dra.allocations():
        nodes = [by_key[r.key].node for r in allocation.results if r.key in by_key]
        if nodes:
            shared[f"{allocation.namespace}/{allocation.name}"] = nodes[0]
    pods = [
        pod for obj in _last_of_each_name(objects, plan) for pod in _admitted(judge, obj, policy, options, inputs, plan)
    ]
    # Pods already on a node hold their GPUs before anything is placed, as in a running cluster.
    pods.sort(key=lambda pod: not pod.node)
    for pod in pods:
        choice = policy.choose_class(_labels(_meta(pod.template)), namespaces.get(pod.ref.namespace))
        if pod.admission is not None and not pod.admission.allowed:
            plan.pending.append({
                "pod": str(pod.ref), "class": choice.name,
                "reasons": {"-": {"unresolvable": True, "rule": "admission", "message": ADMISSION_REFUSAL}},
                "findings": _admission_findings(pod),
            })
            continue
        requests = _dra_requests(pod, context, offered, shared, plan)
        if requests:
            _place_dra(plan, book, pod, requests, context, choice, shared)
        elif pod.demand.wants_gpu:
            _place(plan, ledger, pod, pod_claims(pod.demand, choice, pod.ref.uid), choice, selection)
    for node in sorted(ledger.node_names()):
        for row in ledger.usage(node):
            plan.gpus.append({
                "node": node, "gpu": row.device.label, "budget": row.budget, "known": row.known_bytes,
                "reserved": row.worst_bytes, "free": row.budget - row.worst_bytes,
                "free_is_worst_case": row.worst_bytes > row.known_bytes, "pods": list(row.pods),
            })
    for entry in book.rows():
        plan.gpus.append({
            "node": entry.device.node, "gpu": entry.device.label, "budget": entry.device.memory_bytes,
            "known": entry.consumed, "reserved": entry.consumed, "free": entry.free, "free_is_worst_case": False,
            "pods": list(entry.holders), "dra": True,
        })
    plan.notes.extend(ledger.check_invariants())
    if any(g["free_is_worst_case"] for g in plan.gpus):
        plan.notes.append(CONSERVATIVE_NOTE)
    return plan


_NO_GPUS = read_inventory({})


def live_objects(snapshot: ClusterSnapshot) -> list[Mapping[str, Any]]:
    """What a plan reads from the cluster: its Nodes and Namespaces, the pods bound to a node and the
    DRA objects (each with its kind, which listed items lack)."""
    dra = [
        {**obj, "kind": kind, "apiVersion": "resource.k8s.io/v1"}
        for kind, store in DRA_COLLECTIONS for obj in snapshot.dra.get(store, [])
    ]
    return [*snapshot.nodes, *snapshot.namespaces, *snapshot.bound_pods, *dra]


def _dra_requests(
    pod: _Pod, context: DraContext, offered: set[str], shared: dict[str, str], plan: Plan
) -> list[tuple[str, ClaimRequest]]:
    """The claim requests the pod's containers use, each named ``<claim>/<request>``; a claim named
    by an earlier pod (``resourceClaimName``) is shared, not allocated again. Extended resources a
    DeviceClass serves and no device plugin in the input offers become the scheduler's requests."""
    used = {use.claim for use in container_claim_uses(pod.template)}
    found: list[tuple[str, ClaimRequest]] = []
    for source in pod_claim_sources(pod.template):
        if source.name not in used:
            continue
        namespace = pod.ref.namespace
        if source.claim_name:
            key = f"{namespace}/{source.claim_name}"
            spec = context.claim(namespace, source.claim_name)
            if key in shared:
                found.append((f"{source.name}/shared", ClaimRequest("shared", ())))
                continue
        else:
            spec = context.template(namespace, source.template_name or "")
        if spec is None:
            missing = source.claim_name or source.template_name
            plan.notes.append(f"pod {pod.ref}: claim {source.name}: {missing} is not in the input; not placed")
            continue
        found.extend((f"{source.name}/{request.name}", request) for request in spec.requests)
    for index, container in enumerate(pod.demand.containers):
        device_class = class_for_extended_resource(context.classes, container.resource)
        if device_class is None or container.resource in offered or not device_class.could_match(context.devices):
            continue
        name = f"container-{index}-request-0"
        request = ClaimRequest(name, (DeviceRequest(name, device_class.name, count=container.gpus),))
        found.append((f"{container.resource}/{name}", request))
    return found


def _place_dra(
    plan: Plan,
    book: DraBook,
    pod: _Pod,
    requests: list[tuple[str, ClaimRequest]],
    context: DraContext,
    choice: ClassChoice,
    shared: dict[str, str],
) -> None:
    """Allocate a pod's claims on the first node (by name) where all of them fit, as the allocator
    counts them; a claim shared with an earlier pod pins the pod to that pod's node."""
    entry: dict[str, Any] = {"pod": str(pod.ref), "class": choice.name, "containers": {}}
    review = review_pod_claims(pod.template, pod.ref.namespace, pod.demand, context)
    findings = [
        {"rule": rule, "message": s.message(), "mode": choice.enforcement}
        for rule, items in (("claim-memory", review.shortfalls), ("extended-resource-memory", review.extended))
        for s in items
    ]
    if findings and choice.enforcement == "enforce":
        refusal = {"unresolvable": True, "rule": "admission", "message": ADMISSION_REFUSAL}
        plan.pending.append({**entry, "reasons": {"-": refusal}, "findings": findings})
        return
    own = [(name, request) for name, request in requests if request.alternatives]
    pinned = {shared[k] for k in _shared_keys(pod) if k in shared}
    nodes = [pod.node] if pod.node else sorted(pinned) if pinned else book.nodes()
    reasons: dict[str, dict[str, Any]] = {}
    for node in nodes:
        allocation, why = book.allocate(pod.ref.name, [r for _, r in own], context.classes, node)
        if allocation is None:
            reasons[node] = {"unresolvable": False, "rule": "dra-allocation", "message": why}
            continue
        for key in _shared_keys(pod):
            shared.setdefault(key, node)
        claims = {
            name: list(allocation.devices.get(request.name, ())) for name, request in own
        }
        plan.placed.append({**entry, "node": node, "bound": bool(pod.node), "claims": claims, "findings": findings})
        return
    if not nodes:
        # No node publishes DRA devices: say so, not that the input has no nodes.
        reasons["-"] = {"unresolvable": True, "rule": "dra-allocation", "message": (
            "no ResourceSlice in the input publishes a device for its claims (the DRA driver publishes them "
            "per node): add them, e.g. kubectl get resourceslices -o yaml"
        )}
    plan.pending.append({**entry, "reasons": reasons, "findings": findings})


def _shared_keys(pod: _Pod) -> list[str]:
    return [f"{pod.ref.namespace}/{s.claim_name}" for s in pod_claim_sources(pod.template) if s.claim_name]


CONSERVATIVE_NOTE = (
    "* FREE is a worst case: the device plugin, not the scheduler, picks the device of each pod, so "
    "its claim is held on every device of its node it could get (the conservative rule: WORST-CASE "
    "less KNOWN), though those GPUs may be idle; in a cluster the node agent's report narrows it to "
    "the device it got"
)


def _last_of_each_name(objects: list[Mapping[str, Any]], plan: Plan) -> list[Mapping[str, Any]]:
    """The objects, each name kept once: as ``kubectl apply`` would, the last one wins."""
    last: dict[tuple[str, str, str], int] = {}
    for index, obj in enumerate(objects):
        metadata = _meta(obj)
        if not metadata.get("name") or obj.get("kind") in ("Node", "Namespace"):
            continue
        key = (str(obj.get("kind")), str(metadata.get("namespace") or "default"), str(metadata["name"]))
        if key in last:
            plan.notes.append(
                f"{key[0]} {key[1]}/{key[2]} appears more than once; only the last one is planned, "
                "as kubectl apply would keep it"
            )
        last[key] = index
    kept = set(last.values())
    return [
        obj for index, obj in enumerate(objects)
        if index in kept or not _meta(obj).get("name") or obj.get("kind") in ("Node", "Namespace")
    ]


def _place(
    plan: Plan,
    ledger: Ledger,
    pod: _Pod,
    claims: PodClaims,
    choice: ClassChoice,
    selection: Mapping[str, tuple[Any, Any]],
) -> None:
    """Count a bound pod where it is, or place a pending one on the best node that fits: among the
    nodes its node selector, required node affinity and tolerations allow, as kube-scheduler's own
    filters narrow them before the extender's."""
    entry: dict[str, Any] = {"pod": str(pod.ref), "class": choice.name}
    if pod.node:
        ledger.reserve(pod.node, pod.ref, claims.claims, force=True)
        plan.placed.append({**entry, "node": pod.node, "containers": {}, "bound": True, "findings": []})
        return
    nodes = sorted(ledger.node_names())
    spec = _mapping(pod.template.get("spec"))
    verdicts = {}
    for node in nodes:
        labels, taints = selection.get(node, (None, None))
        refusal = placement_refusal(spec, node, labels, taints)
        verdicts[node] = (
            NodeVerdict(Verdict.UNRESOLVABLE, refusal, None) if refusal is not None
            else filter_node(ledger, node, claims, choice)
        )
    fitting = [node for node, verdict in verdicts.items() if verdict.ok]
    if not fitting:
        reasons = {
            node: {
                "unresolvable": verdict.verdict is Verdict.UNRESOLVABLE,
                "rule": str(verdict.rule) if verdict.rule is not None else "node-selection",
                "message": verdict.message,
            }
            for node, verdict in verdicts.items()
        }
        plan.pending.append({**entry, "reasons": reasons})
        return
    # The highest score wins; ties go to the first node by name, so the plan is reproducible.
    best = max(fitting, key=lambda node: (score_node(ledger, node, claims, choice, checked=True), -nodes.index(node)))
    assignment = choose_gpus(ledger, best, claims, choice)
    assert assignment is not None
    ledger.reserve(best, pod.ref, assignment.claims)
    plan.placed.append({
        **entry, "node": best, "containers": dict(assignment.containers), "bound": False,
        "findings": [
            *({**f.to_json(), "mode": choice.enforcement} for f in verdicts[best].findings), *_admission_findings(pod)
        ],
    })


def render_text(plan: Plan) -> str:
    """Placed pods, pending pods with each node's reason, and a table of GPUs."""
    lines: list[str] = []
    for entry in plan.placed:
        how = "already bound to" if entry["bound"] else "->"
        devices = ", ".join(f"{c}: GPU {'+'.join(ids)}" for c, ids in entry["containers"].items())
        devices += ", ".join(f"claim {c}: {'+'.join(ids) or 'shared'}" for c, ids in entry.get("claims", {}).items())
        suffix = f"  [{devices}]" if devices else ""
        lines.append(f"placed   {entry['pod']} ({entry['class']}) {how} {entry['node']}{suffix}")
        for finding in entry.get("findings", ()):
            how = "note" if finding.get("note") else f"not enforced in {finding['mode']} mode"
            lines.append(f"           [{finding['rule']}, {how}] {finding['message']}")
    for entry in plan.pending:
        lines.append(f"pending  {entry['pod']} ({entry['class']})")
        for node, reason in entry["reasons"].items():
            kind = "never" if reason["unresolvable"] else "now"
            lines.append(f"           {node} ({kind}, {reason['rule']}): {reason['message']}")
        for finding in entry.get("findings", ()):
            lines.append(f"           [{finding['rule']}, {finding['mode']} mode] {finding['message']}")
        if not entry["reasons"]:
            lines.append("           no nodes in the input")
    if plan.gpus:
        rows = [("NODE", "GPU", "BUDGET", "KNOWN", "WORST-CASE", "FREE", "PODS")]
        rows += [
            (g["node"], g["gpu"], format_bytes(g["budget"]), format_bytes(g["known"]), format_bytes(g["reserved"]),
             format_bytes(g["free"]) + ("*" if g["free_is_worst_case"] else ""), ", ".join(g["pods"]) or "-")
            for g in plan.gpus
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(6)]
        lines.append("")
        lines.extend("  ".join(row[i].ljust(widths[i]) for i in range(6)) + "  " + row[6] for row in rows)
    lines.extend(f"note: {note}" for note in plan.notes)
    lines.extend(f"skipped: {entry}" for entry in plan.skipped)
    return "\n".join(lines)


@dataclass(frozen=True)
class _Pod:
    ref: PodRef
    template: Mapping[str, Any]
    node: str
    demand: PodDemand
    admission: Decision | None = None
    """The webhook's decision on the pod's object; ``None`` for a pod already bound (not judged)."""


def _admitted(
    judge: Judge, obj: Mapping[str, Any], policy: Policy, options: DemandOptions, inputs: Inputs, plan: Plan
) -> list[_Pod]:
    """The pods of ``obj``, each carrying the webhook's decision on ``obj``; pods of an admitted object
    count in their namespace's quota before the next object is judged, as the webhook counts them."""
    pods = _pods_of(obj, policy, options, inputs, plan)
    if not pods or all(pod.node for pod in pods):
        return pods
    decision = judge.review(obj)
    if not decision.wants_gpu:
        return pods
    if decision.allowed:
        judge.count(
            {"kind": "Pod", "metadata": {**_meta(pod.template), "uid": pod.ref.uid, "namespace": pod.ref.namespace,
                                         "name": pod.ref.name},
             "spec": pod.template.get("spec")}
            for pod in pods if not pod.node
        )
    return [replace(pod, admission=decision) for pod in pods]


def _admission_findings(pod: _Pod) -> list[dict[str, Any]]:
    """What admission found on the pod's object (refusing in ``enforce``, warned or audited elsewhere),
    and its notes on the placement (``note``: estimates counted as the whole GPU)."""
    if pod.admission is None:
        return []
    mode = pod.admission.mode
    return [
        *({"rule": str(f.code), "message": f.message, "mode": mode} for f in pod.admission.problems),
        *({"rule": str(f.code), "message": f.message, "mode": mode, "note": True}
          for f in pod.admission.remarks if f.code is Code.ESTIMATE_CAPPED),
    ]


# Objects that describe pods but run none themselves.
_NOT_RUN = frozenset({
    # Templates other objects run pods from: none of their own.
    "PodTemplate", "ServingRuntime", "ClusterServingRuntime", "ClusterTrainingRuntime", "TrainingRuntime",
    "WorkflowTemplate",
})


def _pods_of(
    obj: Mapping[str, Any],
    policy: Policy,
    options: DemandOptions,
    inputs: Inputs,
    plan: Plan,
) -> list[_Pod]:
    """A Pod, or one pod per replica of each of a workload's templates (``<workload>-<n>``)."""
    if obj.get("kind") in _NOT_RUN or obj.get("kind") in KIND_STORES:
        return []
    notes: list[str] = []
    parts = object_parts(obj, policy.workload_kinds, _replicas, inputs, notes=notes)
    metadata = _meta(obj)
    namespace = str(metadata.get("namespace") or "default")
    name = str(metadata.get("name") or metadata.get("generateName") or "unnamed")
    plan.notes.extend(f"{obj.get('kind')} {namespace}/{name}: {note}" for note in notes)
    if parts is None:
        warning = unread_warning(obj, options.is_gpu)
        if warning is not None:
            plan.skipped.append(f"{obj.get('kind')} {namespace}/{name}: {warning}")
        return []
    pods: list[_Pod] = []
    several = len(parts) > 1
    for part, demand in zip(parts, parts_demand(parts, options), strict=True):
        spec = part.template.get("spec")
        node = str(spec.get("nodeName") or "") if isinstance(spec, Mapping) else ""
        if obj.get("kind") == "Pod":
            uid = str(metadata.get("uid") or f"{namespace}/{name}")
            pods.append(_Pod(PodRef(uid, namespace, name), part.template, node, demand))
            continue
        stem = f"{name}-{part.name}" if several else name
        pods.extend(
            _Pod(PodRef(f"{namespace}/{stem}-{i}", namespace, f"{stem}-{i}"), part.template, node, demand)
            for i in range(min(part.pods, MAX_PLANNED_PODS))
        )
    return pods


def _replicas(kind: str, obj: Mapping[str, Any]) -> int:
    """Pods a built-in workload runs: its replicas, or a Job's parallelism."""
    workload = obj.get("spec") if isinstance(obj.get("spec"), Mapping) else {}
    assert isinstance(workload, Mapping)
    count = workload.get("replicas", 1) if kind in _REPLICATED else workload.get("parallelism", 1)
    return count if isinstance(count, int) and count >= 0 else 1


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return _mapping(obj.get("metadata"))


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _labels(metadata: Mapping[str, Any]) -> dict[str, str]:
    labels = metadata.get("labels")
    if not isinstance(labels, Mapping):
        return {}
    return {k: v for k, v in labels.items() if isinstance(k, str) and isinstance(v, str)}
