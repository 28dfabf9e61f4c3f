"""``kubectl vram``: the per-GPU VRAM budget table and what each pod holds, computed client-side.

Installed as the executable ``kubectl-vram``, so kubectl finds it as a plugin::

    kubectl vram nodes [-o table|json]
    kubectl vram pods  [-n NAMESPACE] [-o table|json]

It lists Nodes, Namespaces and bound, non-terminal Pods with the caller's credentials and builds
the ledger the extender builds (``vramguard.cluster.ClusterState``), so the numbers are the ones the
scheduler extender decides with. It changes nothing. The policy is, in order: ``--policy FILE``,
the ConfigMap ``vramguard-system/vramguard-policy`` when it can be read, the built-in one.

The Kubernetes client is imported inside the function that lists the cluster, for start-up time.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vramguard.demand import derive_pod_demand
from vramguard.lease import DEFAULT_AGENT_NAMESPACE
from vramguard.policy import Policy, PolicyError, default_policy
from vramguard.report import GpuRow, PodHolding, gpu_rows, gpu_table, pod_holding, pods_table

if TYPE_CHECKING:
    from vramguard.cluster import ClusterState

__all__ = ["ClusterSnapshot", "build_state", "main", "node_rows", "pod_holdings", "read_cluster", "report_notes"]

_PROG = "kubectl vram"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
POLICY_NAMESPACE = "vramguard-system"
POLICY_CONFIGMAP = "vramguard-policy"
POLICY_KEY = "policy.yaml"
# Bound, non-terminal pods: the ones that hold GPUs (the extender's informer uses the same selector).
BOUND_PODS = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"
LIVE_PODS = "status.phase!=Succeeded,status.phase!=Failed"
_API_TIMEOUT_S = 60
JSON = dict[str, Any]


@dataclass(slots=True)
class ClusterSnapshot:
    """What was read from the API server, as plain JSON objects (camelCase, as the API sends them)."""

    nodes: list[JSON] = field(default_factory=list)
    namespaces: list[JSON] = field(default_factory=list)
    pods: list[JSON] = field(default_factory=list)
    """Live pods (not Succeeded or Failed); bound or not."""
    workloads: list[JSON] = field(default_factory=list)
    """Deployments, StatefulSets, DaemonSets, ReplicaSets, Jobs and CronJobs (read by the audit)."""
    policy_source: str = "built-in"
    leases: list[JSON] = field(default_factory=list)
    """The node agents' Leases: a node's report counts only while its Lease is fresh."""

    @property
    def bound_pods(self) -> list[JSON]:
        """The pods bound to a node."""
        return [p for p in self.pods if (p.get("spec") or {}).get("nodeName")]


def read_cluster(
    kubeconfig: str | None, context: str | None, *, workloads: bool = False
) -> tuple[ClusterSnapshot, str | None]:
    """List the cluster with the kubernetes client; returns the snapshot and the policy YAML found.

    The policy ConfigMap is optional: when it is missing or not readable, ``None`` is returned.
    """
    # Imported here for start-up time, not for layering: the client takes about 0.3 s to import,
    # which every ``kubectl vram --help`` and ``vramguard explain`` would otherwise pay.
    # Typed as Any: the client's own annotations are partial.
    import kubernetes as kubernetes_client  # noqa: PLC0415

    kubernetes: Any = kubernetes_client
    if kubeconfig is None and context is None:
        try:
            kubernetes.config.load_incluster_config()
            client = kubernetes.client.ApiClient()
        except kubernetes.config.ConfigException:
            client = kubernetes.config.new_client_from_config()
    else:
        client = kubernetes.config.new_client_from_config(config_file=kubeconfig, context=context)
    core = kubernetes.client.CoreV1Api(client)
    coordination = kubernetes.client.CoordinationV1Api(client)
    apps = kubernetes.client.AppsV1Api(client)
    batch = kubernetes.client.BatchV1Api(client)
    try:
        snapshot = ClusterSnapshot(
            nodes=_list(core.list_node, "Node", "v1"),
            namespaces=_list(core.list_namespace, "Namespace", "v1"),
            pods=_list(core.list_pod_for_all_namespaces, "Pod", "v1", LIVE_PODS),
        )
        snapshot.leases = _agent_leases(coordination, kubernetes.client.exceptions.ApiException)
        if workloads:
            for method, kind, api_version in (
                (apps.list_deployment_for_all_namespaces, "Deployment", "apps/v1"),
                (apps.list_stateful_set_for_all_namespaces, "StatefulSet", "apps/v1"),
                (apps.list_daemon_set_for_all_namespaces, "DaemonSet", "apps/v1"),
                (apps.list_replica_set_for_all_namespaces, "ReplicaSet", "apps/v1"),
                (batch.list_job_for_all_namespaces, "Job", "batch/v1"),
                (batch.list_cron_job_for_all_namespaces, "CronJob", "batch/v1"),
            ):
                snapshot.workloads.extend(_list(method, kind, api_version))
        policy_text = _policy_configmap(core, kubernetes.client.exceptions.ApiException)
    finally:
        client.close()
    return snapshot, policy_text


def _list(method: Any, kind: str, api_version: str, field_selector: str | None = None) -> list[JSON]:
    """Every item of a collection as plain JSON, following ``continue`` tokens, with ``kind`` set.

    The raw JSON (``_preload_content=False``) keeps the API's field names, which the core reads.
    """
    items: list[JSON] = []
    token: str | None = None
    while True:
        options: dict[str, Any] = {"limit": 500, "_preload_content": False, "_request_timeout": _API_TIMEOUT_S}
        if field_selector:
            options["field_selector"] = field_selector
        if token:
            options["_continue"] = token
        body = json.loads(method(**options).data)
        for item in body.get("items") or []:
            item.setdefault("kind", kind)
            item.setdefault("apiVersion", api_version)
            items.append(item)
        token = (body.get("metadata") or {}).get("continue")
        if not token:
            return items


def _agent_leases(coordination: Any, api_exception: type[Exception]) -> list[JSON]:
    """The agents' Leases; none when they cannot be read (the reports then count as untrusted, and
    the table says why)."""
    try:
        response = coordination.list_namespaced_lease(
            DEFAULT_AGENT_NAMESPACE, _preload_content=False, _request_timeout=_API_TIMEOUT_S
        )
    except api_exception:
        return []
    items: list[JSON] = json.loads(response.data).get("items") or []
    return items


def _policy_configmap(core: Any, api_exception: type[Exception]) -> str | None:
    try:
        response = core.read_namespaced_config_map(
            POLICY_CONFIGMAP, POLICY_NAMESPACE, _preload_content=False, _request_timeout=_API_TIMEOUT_S
        )
    except api_exception:
        return None
    data = json.loads(response.data).get("data") or {}
    text = data.get(POLICY_KEY)
    return text if isinstance(text, str) else None


def choose_policy(path: Path | None, configmap_text: str | None) -> tuple[Policy, str]:
    """The policy to use and where it came from; raise :class:`PolicyError` for an invalid one."""
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise PolicyError(f"cannot read {path}: {exc.strerror or exc}") from None
        return Policy.from_yaml(text), str(path)
    if configmap_text is not None:
        return Policy.from_yaml(configmap_text), f"ConfigMap {POLICY_NAMESPACE}/{POLICY_CONFIGMAP}"
    return default_policy(), "built-in"


def build_state(snapshot: ClusterSnapshot, policy: Policy) -> ClusterState:
    """The extender's cluster state, filled from ``snapshot``: nodes and namespaces first, then pods."""
    from vramguard.cluster import ClusterState  # noqa: PLC0415

    state = ClusterState(policy)
    state.leases.replace(snapshot.leases)
    state.nodes.replace(snapshot.nodes)
    state.namespaces.replace(snapshot.namespaces)
    state.pods.replace(snapshot.bound_pods)
    return state


def node_rows(state: ClusterState) -> list[GpuRow]:
    """Every GPU device of every node, with the ledger's budget and reservations."""
    return gpu_rows(row for node in state.node_names() for row in state.ledger.usage(node))


def report_notes(state: ClusterState) -> list[str]:
    """Nodes whose agent report was set aside, and why (a stale or missing Lease)."""
    notes = []
    for node in sorted(state.node_names()):
        inventory = state.ledger.inventory(node)
        if inventory is not None and inventory.distrust is not None:
            notes.append(f"node {node}: {inventory.distrust}; counted as if unreported")
    return notes


def pod_holdings(state: ClusterState, pods: Sequence[JSON], namespace: str | None = None) -> list[PodHolding]:
    """What each bound GPU pod holds (optionally only in ``namespace``), as the ledger counts it."""
    holdings: list[PodHolding] = []
    for pod in pods:
        metadata = pod.get("metadata") or {}
        if namespace is not None and metadata.get("namespace") != namespace:
            continue
        held = state.ledger.holding(str(metadata.get("uid", "")))
        if held is None:
            continue
        _, node, claims = held
        inventory = state.ledger.inventory(node)
        devices = inventory.devices if inventory is not None else ()
        budgets = {d.id: state.ledger.budget(node, d.id) or d.memory_bytes for d in devices}
        demand = derive_pod_demand(pod, state.options)
        holdings.append(pod_holding(pod, demand, state.choose_class(pod).name, claims, devices, budgets))
    return holdings


def build_parser() -> argparse.ArgumentParser:
    """The ``kubectl vram`` parser."""
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Per-GPU VRAM budgets and reservations, computed the way the vramguard extender does.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")
    common.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    common.add_argument("--context", help="kubeconfig context (default: the current one)")
    common.add_argument("--policy", type=Path, metavar="FILE",
                        help=f"policy file (default: ConfigMap {POLICY_NAMESPACE}/{POLICY_CONFIGMAP}, else built-in)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("nodes", parents=[common], help="the per-GPU budget table: budget, reserved, free, pods")
    pods = sub.add_parser("pods", parents=[common], help="what each bound GPU pod holds, and why")
    pods.add_argument("-n", "--namespace", help="only this namespace (default: all)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Read the cluster, build the ledger, print the table; return the exit code."""
    try:
        snapshot, configmap_text = read_cluster(args.kubeconfig, args.context)
    except Exception as exc:  # the client raises many types: config, network, API
        print(f"{_PROG}: error: cannot read the cluster: {exc}", file=sys.stderr)
        return EXIT_FAILED
    try:
        policy, source = choose_policy(args.policy, configmap_text)
    except PolicyError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    snapshot.policy_source = source
    state = build_state(snapshot, policy)
    if args.command == "nodes":
        rows = node_rows(state)
        notes = report_notes(state)
        if args.output == "json":
            print(json.dumps({"policy": source, "gpus": [r.to_json() for r in rows], "notes": notes}, indent=2))
        else:
            sys.stdout.write(gpu_table(rows))
            sys.stdout.write("".join(f"note: {note}\n" for note in notes))
        return EXIT_OK
    holdings = pod_holdings(state, snapshot.bound_pods, args.namespace)
    if args.output == "json":
        print(json.dumps({"policy": source, "pods": [h.to_json() for h in holdings]}, indent=2))
    else:
        sys.stdout.write(pods_table(holdings))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kubectl-vram`` executable."""
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
