"""``vramguard audit``: measure a live cluster against the policy before enforcing anything.

Reads Nodes, Namespaces, live Pods and the workloads that make pods (Deployments, StatefulSets,
DaemonSets, ReplicaSets, Jobs, CronJobs, the policy's ``workload_kinds`` and the serving operators'
kinds: :func:`vramguard.workloads.kinds_to_list`) and changes nothing. It reports:

- **GPU nodes vramguard cannot read**: nodes advertising GPUs that no GPU Feature Discovery, platform or
  instance-type label describes and no agent reports: no budget is checked there.
- **GPUs committed beyond their budget**: the ledger the extender builds from the bound pods
  (``vramguard.cluster.ClusterState``), device by device. Only pods placed without vramguard can put a
  GPU there; the extender refuses every pod that would.
- **Placements the class rules would refuse**: each bound GPU pod on a node whose sharing strategy
  its class does not allow, as the extender sees it (``vramguard.placement.class_findings``), with
  its rule and what the namespace's mode does with it: refused at the next scheduling (enforce),
  warned or audited. This is what to look at before switching a namespace to warn, then enforce.
- **Objects the webhook would deny or warn about**: each live GPU pod and each workload not made by
  a controller, reviewed with the webhook's rules (``vramguard.admission.AdmissionRules``) and the
  webhook's view of the cluster (the same ``ClusterState``: offers, namespace usage for quotas). A pod is
  reviewed as if created now (its namespace's other pods count for the quota), a workload as an
  update of itself (its pods are already counted). Each violation is labelled with what the
  namespace's enforcement mode would do with it: denied, warned or audited. Pods whose GPUs come
  from DRA claims are reviewed too: a claim that consumes less than its engine reserves.
- **Allocated DRA claims short of their workload's memory**: each allocated ResourceClaim whose
  pods' containers reserve more on the device it got than the claim consumes there (the scheduler
  shares the device by what claims consume, so such a device is overcommitted in fact).
- **Pending GPU pods and why**: each GPU pod not yet bound, with what every node says to it under
  the extender's rules (grouped: ``3 nodes: GPU (...): VRAM budget free below ...``) and the
  scheduler's own last reason (its ``PodScheduled`` condition). Informational: a pod the VRAM keeps
  Pending is vramguard doing its job; this says why, and what would let it in.
- **GPU pods placed by a scheduler that does not call vramguard**: each bound GPU pod whose
  ``spec.schedulerName`` is not one of the policy's ``schedulers`` (placed before vramguard was
  installed, or not routed: the routing webhook was down, the namespace opts out). Informational:
  the ledger counts their VRAM on their GPUs (an overcommitted GPU is a finding above), but nothing
  checked it when they were placed.
- **Pods using more VRAM than the model predicted**: each pod and device the node agents measure
  beyond the demand model's prediction there (:mod:`vramguard.accuracy`), with the numbers, and the
  predicted and measured sums per engine and version. Informational: the ledger already holds such a
  pod's measured use, so they do not change the exit code; they say where the model is wrong.

Exit code: 0 nothing found, 1 an overcommitted GPU or an object with a violation, 2 bad input or
an unreadable cluster. Notes (what the webhook returns as plain warnings) are listed, not counted.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramguard.accuracy import ModelAccuracy, model_accuracy
from vramguard.admission import SUPPORTED_KINDS, AdmissionRules, ClusterView, Operation, Subject
from vramguard.cli import kubectl_vram
from vramguard.cluster import ClusterState
from vramguard.dra.review import AllocatedShortfall, audit_allocations
from vramguard.inventory import UNREADABLE
from vramguard.ledger import Invariant
from vramguard.mutation import DEFAULT_SCHEDULER
from vramguard.placement import class_findings, filter_nodes
from vramguard.policy import Policy, PolicyError
from vramguard.quantity import format_bytes
from vramguard.report import GpuRow, gpu_table, render_table
from vramguard.workloads import WorkloadKind, kinds_to_list, reads_kind

__all__ = [
    "AuditReport",
    "ObjectFinding",
    "PendingPod",
    "PlacementFinding",
    "audit_snapshot",
    "pending_pods",
    "register",
    "run",
]

_PROG = "vramguard audit"
EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2
_OUTCOME = {"enforce": "denied", "warn": "warned", "audit": "audited"}
JSON = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ObjectFinding:
    """What the webhook's rules say about one existing object."""

    kind: str
    namespace: str
    name: str
    mode: str
    """The namespace's enforcement mode (``enforce``, ``warn``, ``audit``)."""
    violations: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def outcome(self) -> str:
        """What admission would do now: ``denied``, ``warned``, ``audited``, or ``ok``."""
        return _OUTCOME[self.mode] if self.violations else "ok"

    def to_json(self) -> JSON:
        """The finding as a JSON object."""
        return {
            "kind": self.kind,
            "namespace": self.namespace,
            "name": self.name,
            "mode": self.mode,
            "outcome": self.outcome,
            "violations": list(self.violations),
            "notes": list(self.notes),
        }


_PLACEMENT_OUTCOME = {"enforce": "refused", "warn": "warned", "audit": "audited"}


@dataclass(frozen=True, slots=True)
class PlacementFinding:
    """A bound pod on a node its class's rules do not allow, as the extender would judge it."""

    namespace: str
    name: str
    node: str
    mode: str
    rule: str
    message: str

    @property
    def outcome(self) -> str:
        """What the extender does with such a placement now: ``refused``, ``warned``, ``audited``.

        A class guarantee refuses in every mode."""
        return "refused" if self.rule == "class-guarantee" else _PLACEMENT_OUTCOME[self.mode]

    def to_json(self) -> JSON:
        """The finding as a JSON object."""
        return {"namespace": self.namespace, "name": self.name, "node": self.node, "mode": self.mode,
                "outcome": self.outcome, "rule": self.rule, "message": self.message}


@dataclass(frozen=True, slots=True)
class PendingPod:
    """A GPU pod not yet bound, with each node's reason under the extender's rules."""

    namespace: str
    name: str
    scheduler: str
    reasons: tuple[tuple[str, tuple[str, ...]], ...]
    """``(reason, nodes)``, the largest group first; empty when a node would take it now."""
    scheduler_message: str = ""
    """The scheduler's last word (the pod's ``PodScheduled`` condition), when it has said one."""

    def to_json(self) -> JSON:
        """The pending pod as a JSON object."""
        return {"namespace": self.namespace, "name": self.name, "scheduler": self.scheduler,
                "reasons": [{"message": m, "nodes": list(n)} for m, n in self.reasons],
                "scheduler_message": self.scheduler_message}


@dataclass(frozen=True, slots=True)
class UnguardedPod:
    """A bound GPU pod whose scheduler does not call vramguard."""

    namespace: str
    name: str
    node: str
    scheduler: str

    def to_json(self) -> JSON:
        """The pod as a JSON object."""
        return {"namespace": self.namespace, "name": self.name, "node": self.node, "scheduler": self.scheduler}


@dataclass(slots=True)
class AuditReport:
    """Everything the audit found."""

    policy: str
    gpus: list[GpuRow] = field(default_factory=list)
    """Every GPU device the ledger knows."""
    ledger_problems: list[str] = field(default_factory=list)
    """The ledger's invariant violations: over budget, replicas over-used, claims above an MPS share."""
    objects: list[ObjectFinding] = field(default_factory=list)
    """Objects with violations or notes."""
    placements: list[PlacementFinding] = field(default_factory=list)
    """Bound pods on nodes their class's rules do not allow."""
    claims: list[AllocatedShortfall] = field(default_factory=list)
    """Allocated DRA claims whose pods reserve more on their device than the claim consumes."""
    pending: list[PendingPod] = field(default_factory=list)
    """GPU pods not yet bound, and why (informational, not counted by :attr:`clean`)."""
    unguarded: list[UnguardedPod] = field(default_factory=list)
    """Bound GPU pods placed by a scheduler that does not call vramguard (informational)."""
    unreadable: list[str] = field(default_factory=list)
    """Nodes advertising GPUs whose memory vramguard cannot read: no budget is checked there."""
    model: ModelAccuracy = field(default_factory=ModelAccuracy)
    """The demand model's predictions against the agents' measurements (informational, not counted
    by :attr:`clean`)."""

    @property
    def overcommitted(self) -> list[GpuRow]:
        """Devices that may hold more than their budget."""
        return [row for row in self.gpus if row.over_budget]

    @property
    def violating(self) -> list[ObjectFinding]:
        """Objects admission would deny (or warn or audit, by the namespace's mode)."""
        return [finding for finding in self.objects if finding.violations]

    @property
    def clean(self) -> bool:
        """Whether nothing would be refused and no GPU is overcommitted."""
        return (
            not self.overcommitted and not self.ledger_problems and not self.violating and not self.placements
            and not self.claims and not self.unreadable
        )

    def to_json(self) -> JSON:
        """The report as one JSON object."""
        return {
            "policy": self.policy,
            "clean": self.clean,
            "gpus_checked": len(self.gpus),
            "unreadable_gpu_nodes": list(self.unreadable),
            "overcommitted_gpus": [row.to_json() for row in self.overcommitted],
            "ledger_problems": list(self.ledger_problems),
            "placements": [finding.to_json() for finding in self.placements],
            "objects": [finding.to_json() for finding in self.objects],
            "claims": [
                {"namespace": c.namespace, "claim": c.claim, "node": c.node, "device": c.device.label,
                 "consumed_bytes": c.consumed, "reserved_bytes": c.reserved, "pods": list(c.pods),
                 "message": c.message()}
                for c in self.claims
            ],
            "pending": [p.to_json() for p in self.pending],
            "unguarded_pods": [p.to_json() for p in self.unguarded],
            "model_accuracy": self.model.to_json(),
        }

    def to_text(self) -> str:
        """A report for people."""
        parts = [f"Policy: {self.policy}\n"]
        if self.unreadable:
            parts.append(
                f"\nGPU nodes vramguard cannot read: {len(self.unreadable)} ({', '.join(self.unreadable[:10])}"
                f"{', ...' if len(self.unreadable) > 10 else ''}): {UNREADABLE}; their pods are refused where a "
                "namespace enforces and placed unguarded elsewhere\n"
            )
        over = self.overcommitted
        parts.append(f"\nGPUs over their VRAM budget: {len(over)} of {len(self.gpus)}\n")
        if over:
            parts.append(gpu_table(over))
        if self.ledger_problems:
            parts.append("\nLedger problems:\n")
            parts.extend(f"- {problem}\n" for problem in self.ledger_problems)
        parts.append(f"\nPlacements the class rules would refuse: {len(self.placements)}\n")
        if self.placements:
            parts.append(render_table(
                ("OUTCOME", "RULE", "NAMESPACE", "POD", "NODE", "FINDING"),
                ((f.outcome, f.rule, f.namespace, f.name, f.node, f.message) for f in self.placements),
            ))
        violating = self.violating
        parts.append(f"\nObjects admission would deny, warn about or audit: {len(violating)}\n")
        if violating:
            parts.append(render_table(
                ("OUTCOME", "KIND", "NAMESPACE", "NAME", "VIOLATION"),
                (
                    (f.outcome, f.kind, f.namespace, f.name, violation)
                    for f in violating
                    for violation in f.violations
                ),
            ))
        parts.append(f"\nAllocated DRA claims short of their workload's memory: {len(self.claims)}\n")
        if self.claims:
            parts.append(render_table(
                ("NAMESPACE", "CLAIM", "NODE", "PODS", "FINDING"),
                ((c.namespace, c.claim, c.node, ",".join(c.pods) or "-", c.message()) for c in self.claims),
            ))
        parts.append(_pending_text(self.pending))
        parts.append(_unguarded_text(self.unguarded))
        parts.append(_model_text(self.model))
        noted = [f for f in self.objects if f.notes]
        if noted:
            parts.append(f"\nNotes (returned as warnings, never refused): {sum(len(f.notes) for f in noted)}\n")
            parts.append(render_table(
                ("KIND", "NAMESPACE", "NAME", "NOTE"),
                ((f.kind, f.namespace, f.name, note) for f in noted for note in f.notes),
            ))
        listed = len(self.pending) + len(self.unguarded) + len(self.model.over_prediction())
        if not self.clean:
            parts.append("\nFindings above; nothing was changed.\n")
        elif listed:
            parts.append(f"\nNo findings: nothing would be refused and no GPU is overcommitted; {listed} pod(s) "
                         "listed above for information.\n")
        else:
            parts.append("\nClean.\n")
        return "".join(parts)


def audit_snapshot(snapshot: Any, policy: Policy, policy_source: str = "built-in") -> AuditReport:
    """Audit a :class:`vramguard.cli.kubectl_vram.ClusterSnapshot` under ``policy``."""
    state = kubectl_vram.build_state(snapshot, policy)
    report = AuditReport(policy_source, gpus=kubectl_vram.node_rows(state))
    report.ledger_problems = [
        v.message for v in state.ledger.invariant_violations() if v.invariant is not Invariant.COUNTERS
    ]

    report.placements = placement_findings(state, snapshot.bound_pods)
    report.unreadable = state.unreadable_nodes()

    # The webhook's rules on the webhook's view, read from the same model (namespaces, offers, the
    # quota's sums over every live pod).
    rules = AdmissionRules(policy)
    for obj in _subjects(snapshot.pods, snapshot.workloads, policy.workload_kinds):
        kind = str(obj.get("kind"))
        metadata = obj.get("metadata") or {}
        namespace = str(metadata.get("namespace", ""))
        operation: Operation = "CREATE" if kind == "Pod" else "UPDATE"
        node = str((obj.get("spec") or {}).get("nodeName") or "") if kind == "Pod" else ""
        usage = None
        if policy.quota_bytes(namespace) is not None:
            usage = state.usage_with_dra(namespace, exclude=str(metadata.get("uid", "")) if kind == "Pod" else None)
        view = ClusterView(
            state.namespace_labels.get(namespace), state.offers(), state.node_offers(node) if node else None, usage,
            dra=state.dra_context(),
        )
        decision = rules.review(Subject(kind, operation, namespace, obj), view)
        if decision.wants_gpu and (decision.violations or decision.notes):
            report.objects.append(ObjectFinding(
                kind, namespace, str(metadata.get("name", "")), decision.mode, decision.violations, decision.notes
            ))
    report.objects.sort(key=lambda f: (not f.violations, f.namespace, f.kind, f.name))
    report.claims = audit_allocations(state.dra, snapshot.pods)
    report.pending = pending_pods(state, snapshot.pods)
    report.unguarded = unguarded_pods(state, snapshot.bound_pods)
    report.model = model_accuracy(state)
    return report


MAX_NODES_NAMED = 5
"""Nodes named per reason; the rest are counted."""


def pending_pods(state: ClusterState, pods: Iterable[Mapping[str, Any]]) -> list[PendingPod]:
    """Each GPU pod not yet bound, with what every node says to it under the extender's rules."""
    nodes = sorted(state.node_names())
    found: list[PendingPod] = []
    for pod in pods:
        spec = pod.get("spec") or {}
        status = pod.get("status") or {}
        metadata = pod.get("metadata") or {}
        if spec.get("nodeName") or status.get("phase", "Pending") != "Pending":
            continue
        choice = state.choose_class(pod)
        claims = state.claims_for(pod, choice)
        if claims.refusal is None and not claims.claims:
            continue  # no GPU of the policy's (a DRA-only pod is the scheduler's to allocate)
        grouped: dict[str, list[str]] = {}
        for node, verdict in zip(nodes, filter_nodes(state.ledger, nodes, claims, choice), strict=True):
            if not verdict.ok:
                grouped.setdefault(verdict.message, []).append(node)
        fits = len(nodes) - sum(len(names) for names in grouped.values())
        reasons = () if fits else tuple(
            (message, tuple(names)) for message, names in sorted(grouped.items(), key=lambda i: -len(i[1])))
        conditions = [c for c in status.get("conditions") or [] if isinstance(c, Mapping)]
        scheduled = next((c for c in conditions if c.get("type") == "PodScheduled"), {})
        found.append(PendingPod(
            str(metadata.get("namespace", "")), str(metadata.get("name", "")),
            str(spec.get("schedulerName") or "default-scheduler"), reasons, str(scheduled.get("message") or ""),
        ))
    found.sort(key=lambda p: (p.namespace, p.name))
    return found


def _pending_text(pending: Sequence[PendingPod]) -> str:
    parts = [f"\nGPU pods Pending (informational): {len(pending)}\n"]
    for pod in pending:
        parts.append(f"- {pod.namespace}/{pod.name} (scheduler {pod.scheduler})\n")
        if not pod.reasons:
            parts.append("    a node would take it now under vramguard's rules\n")
        for message, nodes in pod.reasons:
            named = ", ".join(nodes[:MAX_NODES_NAMED]) + (f" and {len(nodes) - MAX_NODES_NAMED} more"
                                                          if len(nodes) > MAX_NODES_NAMED else "")
            parts.append(f"    {len(nodes)} node(s) ({named}): {message}\n")
        if pod.scheduler_message:
            parts.append(f"    the scheduler says: {pod.scheduler_message}\n")
    return "".join(parts)


def unguarded_pods(state: ClusterState, pods: Iterable[Mapping[str, Any]]) -> list[UnguardedPod]:
    """Bound pods holding GPUs in the ledger whose scheduler is not one of the policy's ``schedulers``."""
    found = []
    for pod in pods:
        spec = pod.get("spec") or {}
        metadata = pod.get("metadata") or {}
        scheduler = str(spec.get("schedulerName") or DEFAULT_SCHEDULER)
        if scheduler in state.policy.schedulers or state.ledger.holding(str(metadata.get("uid", ""))) is None:
            continue
        found.append(UnguardedPod(
            str(metadata.get("namespace", "")), str(metadata.get("name", "")), str(spec.get("nodeName")), scheduler
        ))
    found.sort(key=lambda p: (p.namespace, p.name))
    return found


def _unguarded_text(pods: Sequence[UnguardedPod]) -> str:
    parts = [f"\nGPU pods placed by a scheduler that does not call vramguard (informational): {len(pods)}\n"]
    if pods:
        parts.append(render_table(
            ("NAMESPACE", "POD", "NODE", "SCHEDULER"), ((p.namespace, p.name, p.node, p.scheduler) for p in pods)
        ))
        parts.append(
            "  nothing checked their VRAM when they were placed (placed before vramguard, or not routed: see "
            "docs/troubleshooting.md#scheduler); the ledger counts it on their GPUs\n"
        )
    return "".join(parts)


def _model_text(model: ModelAccuracy) -> str:
    """The pods measured over their prediction, then the sums per engine and version (when any)."""
    over = model.over_prediction()
    parts = [f"\nPods using more VRAM than the model predicted (informational): {len(over)}\n"]
    if over:
        parts.append(render_table(
            ("NAMESPACE", "POD", "NODE", "GPU", "ENGINE", "VERSION", "PREDICTED", "MEASURED", "EXCESS"),
            ((s.namespace, s.name, s.node, s.device, s.engine, s.version, format_bytes(s.predicted),
              format_bytes(s.measured), format_bytes(s.excess)) for s in over),
        ))
    if model.engines:
        parts.append("\nModel predictions against the agents' measurements:\n")
        parts.append(render_table(
            ("ENGINE", "VERSION", "POD-GPUS", "PREDICTED", "MEASURED", "PODS-OVER"),
            ((engine, version, str(t.pod_devices), format_bytes(t.predicted_bytes), format_bytes(t.measured_bytes),
              str(t.pods_over)) for (engine, version), t in sorted(model.engines.items())),
        ))
    if model.skipped:
        parts.append("Measured pod-GPUs without a prediction to compare: " + ", ".join(
            f"{count} {reason}" for reason, count in sorted(model.skipped.items())) + "\n")
    return "".join(parts)


def placement_findings(state: ClusterState, pods: Iterable[Mapping[str, Any]]) -> list[PlacementFinding]:
    """The class rules each bound GPU pod breaks on its node, as the extender would find them."""
    findings: list[PlacementFinding] = []
    for pod in pods:
        node = str((pod.get("spec") or {}).get("nodeName") or "")
        offers = state.ledger.offers(node) if node else None
        metadata = pod.get("metadata") or {}
        if not offers or state.ledger.holding(str(metadata.get("uid", ""))) is None:
            continue
        choice = state.choose_class(pod)
        resources = state.claims_for(pod, choice).resources
        for finding in class_findings(offers, resources, choice):
            findings.append(PlacementFinding(
                str(metadata.get("namespace", "")), str(metadata.get("name", "")), node, choice.enforcement,
                str(finding.rule), finding.message,
            ))
    findings.sort(key=lambda f: (f.namespace, f.name))
    return findings


def _subjects(
    pods: Iterable[Mapping[str, Any]], workloads: Iterable[Mapping[str, Any]], kinds: Sequence[WorkloadKind]
) -> list[Mapping[str, Any]]:
    """Live pods, and the workloads not made by a controller (their owner is reviewed instead):
    the built-in kinds, the policy's ``workload_kinds`` and the serving operators' kinds."""
    chosen: list[Mapping[str, Any]] = [p for p in pods if p.get("kind", "Pod") == "Pod"]
    for obj in workloads:
        kind = obj.get("kind")
        group = str(obj.get("apiVersion", "")).rpartition("/")[0] or None
        if kind not in SUPPORTED_KINDS and (not isinstance(kind, str) or not reads_kind(kinds, kind, group)):
            continue
        owners = (obj.get("metadata") or {}).get("ownerReferences") or []
        if any(isinstance(o, Mapping) and o.get("controller") is True for o in owners):
            continue
        chosen.append(obj)
    return chosen


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``audit`` sub-command."""
    parser = subparsers.add_parser(
        "audit",
        help="report overcommitted GPUs and objects the policy would refuse, changing nothing",
        description=(
            "Read a live cluster (nodes, namespaces, live pods, workloads) and report, without changing "
            "anything, which GPUs are already committed beyond their VRAM budget and which pods and "
            "workloads the webhook would deny, warn about or audit under the policy. "
            "Exit code: 0 clean, 1 findings, 2 bad input or unreadable cluster."
        ),
    )
    parser.add_argument(
        "--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG or ~/.kube/config)"
    )
    parser.add_argument("--context", help="kubeconfig context (default: the current one)")
    parser.add_argument(
        "--policy", type=Path, metavar="FILE",
        help="policy to audit against (default: ConfigMap vramguard-system/vramguard-policy, else built-in)",
    )
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text", help="output format")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handle ``vramguard audit``; return its exit code."""
    try:
        snapshot, configmap_text = kubectl_vram.read_cluster(args.kubeconfig, args.context, workloads=True)
    except Exception as exc:  # the client raises many types: config, network, API
        print(f"{_PROG}: error: cannot read the cluster: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        policy, source = kubectl_vram.choose_policy(args.policy, configmap_text)
    except PolicyError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    listed = kinds_to_list(policy.workload_kinds)
    if listed:
        try:
            custom, unread = kubectl_vram.read_custom_workloads(args.kubeconfig, args.context, listed)
        except Exception as exc:  # as above: config, network, API
            print(f"{_PROG}: error: cannot read the cluster's workloads: {exc}", file=sys.stderr)
            return EXIT_USAGE
        snapshot.workloads = [*snapshot.workloads, *custom]
        for note in unread:
            print(f"{_PROG}: warning: {note}", file=sys.stderr)
    report = audit_snapshot(snapshot, policy, source)
    if args.output == "json":
        print(json.dumps(report.to_json(), indent=2))
    else:
        sys.stdout.write(report.to_text())
    return EXIT_CLEAN if report.clean else EXIT_FINDINGS

