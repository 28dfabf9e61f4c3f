"""``kubectl vram``: the per-GPU VRAM budget table and what each pod holds, computed client-side.

Installed as the executable ``kubectl-vram``, so kubectl finds it as a plugin::

    kubectl vram nodes [-o table|json]
    kubectl vram pods  [-n NAMESPACE] [-o table|json]

It lists Nodes, Namespaces and live Pods with the caller's credentials, through the services' API
client (``vramguard.io.kube``), and feeds the one cluster model the services use
(``vramguard.cluster.ClusterState``), so the numbers are the ones the scheduler extender decides
with. It changes nothing. The policy is, in order: ``--policy FILE``, the ConfigMap
``vramguard-system/vramguard-policy`` when it can be read, the built-in one.

The API client is imported inside the function that lists the cluster, for start-up time.
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
from vramguard.dra.views import dra_rows
from vramguard.learning import LEARNED_CONFIGMAP, LEARNED_KEY
from vramguard.lease import DEFAULT_AGENT_NAMESPACE
from vramguard.policy import Policy, PolicyError, default_policy, read_failure
from vramguard.report import GpuRow, PodHolding, gpu_rows, gpu_table, pod_holding, pods_table
from vramguard.workloads import ServedKind, WorkloadKind

if TYPE_CHECKING:
    from vramguard.cluster import ClusterState
    from vramguard.io.kube import Connection

__all__ = [
    "ClusterSnapshot",
    "build_state",
    "ledger_rows",
    "main",
    "node_rows",
    "pod_holdings",
    "read_cluster",
    "report_notes",
]

_PROG = "kubectl vram"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
POLICY_NAMESPACE = "vramguard-system"
POLICY_CONFIGMAP = "vramguard-policy"
POLICY_KEY = "policy.yaml"
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
    learned: str | None = None
    """The extender's learned allowances as stored (ConfigMap ``vramguard-learned-allowances``), if read."""
    dra: dict[str, list[JSON]] = field(default_factory=dict)
    """resource.k8s.io/v1 objects by collection (``resourceslices``, ``deviceclasses``,
    ``resourceclaims``, ``resourceclaimtemplates``); a collection not served is empty."""

    @property
    def bound_pods(self) -> list[JSON]:
        """The pods bound to a node."""
        return [p for p in self.pods if (p.get("spec") or {}).get("nodeName")]


def read_cluster(
    kubeconfig: str | None, context: str | None, *, workloads: bool = False
) -> tuple[ClusterSnapshot, str | None]:
    """List the cluster through the services' API client; returns the snapshot and the policy YAML found.

    Credentials come from :func:`vramguard.io.kube.load_connection`, as for the services (exec
    plugins and OIDC included). The policy ConfigMap is optional: when it is missing or not
    readable, ``None`` is returned.
    """
    # Imported here for start-up time, not for layering: aiohttp and the kubeconfig loader take
    # about 0.4 s to import, which every ``kubectl vram --help`` and ``vramguard explain`` would pay.
    import asyncio  # noqa: PLC0415

    from vramguard.io.kube import load_connection  # noqa: PLC0415

    return asyncio.run(_read_cluster(load_connection(kubeconfig, context), workloads))


# Collections the audit reviews (workloads that make pods): path, kind, apiVersion.
WORKLOADS = (
    ("/apis/apps/v1/deployments", "Deployment", "apps/v1"),
    ("/apis/apps/v1/statefulsets", "StatefulSet", "apps/v1"),
    ("/apis/apps/v1/daemonsets", "DaemonSet", "apps/v1"),
    ("/apis/apps/v1/replicasets", "ReplicaSet", "apps/v1"),
    ("/apis/batch/v1/jobs", "Job", "batch/v1"),
    ("/apis/batch/v1/cronjobs", "CronJob", "batch/v1"),
)


DRA_COLLECTIONS = (
    "/apis/resource.k8s.io/v1/resourceslices",
    "/apis/resource.k8s.io/v1/deviceclasses",
    "/apis/resource.k8s.io/v1/resourceclaims",
    "/apis/resource.k8s.io/v1/resourceclaimtemplates",
)


async def _read_cluster(connection: Connection, workloads: bool) -> tuple[ClusterSnapshot, str | None]:
    """One listing, through one client and its pager, the lists read concurrently."""
    import asyncio  # noqa: PLC0415

    from vramguard.cluster import LIVE_PODS_SELECTOR  # noqa: PLC0415
    from vramguard.io.kube import LEASES, ApiError, KubeClient, collection_path  # noqa: PLC0415

    async with KubeClient(connection) as client:

        async def items(path: str, kind: str, api_version: str, params: dict[str, str] | None = None) -> list[JSON]:
            # Lists carry no kind per item; the rules read it.
            listed, _ = await client.list_all(path, params)
            for item in listed:
                item.setdefault("kind", kind)
                item.setdefault("apiVersion", api_version)
            return listed

        async def agent_leases() -> list[JSON]:
            # Unreadable Leases leave every report untrusted; the table then says why.
            try:
                listed, _ = await client.list_all(collection_path(LEASES, DEFAULT_AGENT_NAMESPACE))
            except ApiError:
                return []
            return listed

        async def dra_objects(path: str) -> list[JSON]:
            # A cluster without DRA does not serve the group; one that denies it leaves a note-free gap.
            try:
                listed, _ = await client.list_all(path)
            except ApiError:
                return []
            return listed

        async def configmap_text(name: str, key: str) -> str | None:
            try:
                configmap = await client.get(f"/api/v1/namespaces/{POLICY_NAMESPACE}/configmaps/{name}")
            except ApiError:
                return None
            text = (configmap.get("data") or {}).get(key)
            return text if isinstance(text, str) else None

        lists, policy_text, learned = await asyncio.gather(
            asyncio.gather(
                items("/api/v1/nodes", "Node", "v1"),
                items("/api/v1/namespaces", "Namespace", "v1"),
                items("/api/v1/pods", "Pod", "v1", {"fieldSelector": LIVE_PODS_SELECTOR}),
                agent_leases(),
                *(dra_objects(path) for path in DRA_COLLECTIONS),
                *(items(*workload) for workload in (WORKLOADS if workloads else ())),
            ),
            configmap_text(POLICY_CONFIGMAP, POLICY_KEY),
            configmap_text(LEARNED_CONFIGMAP, LEARNED_KEY),
        )
    nodes, namespaces, pods, leases, *rest = lists
    dra, made = rest[: len(DRA_COLLECTIONS)], rest[len(DRA_COLLECTIONS) :]
    snapshot = ClusterSnapshot(nodes=nodes, namespaces=namespaces, pods=pods, leases=leases, learned=learned)
    snapshot.dra = {path.rpartition("/")[2]: listed for path, listed in zip(DRA_COLLECTIONS, dra, strict=True)}
    snapshot.workloads = [obj for listed in made for obj in listed]
    return snapshot, policy_text


def read_custom_workloads(
    kubeconfig: str | None, context: str | None, kinds: Sequence[ServedKind | WorkloadKind]
) -> tuple[list[JSON], list[str]]:
    """List the objects of the given kinds (the policy's workload kinds, the serving operators':
    :func:`vramguard.workloads.kinds_to_list`); returns them and a note per kind that could not be
    listed.

    Each kind is listed at the first of its versions the cluster serves; a kind whose CRD is not
    installed (every version answers 404) is simply absent. A kind the credentials may not list is
    a note, so the audit says what it could not see instead of reporting a clean cluster.
    """
    import asyncio  # noqa: PLC0415 - start-up time, as in read_cluster

    from vramguard.io.kube import load_connection  # noqa: PLC0415

    return asyncio.run(_read_custom_workloads(load_connection(kubeconfig, context), kinds))


async def _read_custom_workloads(
    connection: Connection, kinds: Sequence[ServedKind | WorkloadKind]
) -> tuple[list[JSON], list[str]]:
    import asyncio  # noqa: PLC0415

    from vramguard.io.kube import ApiError, KubeClient  # noqa: PLC0415

    async with KubeClient(connection) as client:

        async def listed(entry: ServedKind | WorkloadKind) -> tuple[list[JSON], str | None]:
            for version in entry.versions:
                try:
                    items, _ = await client.list_all(f"/apis/{entry.group}/{version}/{entry.resource}")
                except ApiError as exc:
                    if exc.status == 404:
                        continue  # this version (or the whole CRD) is not served here
                    return [], f"{entry.kind} ({entry.group}) not read: {exc.message or exc}"
                for item in items:
                    item.setdefault("kind", entry.kind)
                    item.setdefault("apiVersion", f"{entry.group}/{version}")
                return items, None
            return [], None

        results = await asyncio.gather(*(listed(entry) for entry in kinds))
    objects = [obj for items, _ in results for obj in items]
    return objects, [note for _, note in results if note is not None]


def choose_policy(path: Path | None, configmap_text: str | None) -> tuple[Policy, str]:
    """The policy to use and where it came from; raise :class:`PolicyError` for an invalid one."""
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise PolicyError(f"cannot read {path}: {read_failure(exc)}") from None
        return Policy.from_yaml(text), str(path)
    if configmap_text is not None:
        return Policy.from_yaml(configmap_text), f"ConfigMap {POLICY_NAMESPACE}/{POLICY_CONFIGMAP}"
    return default_policy(), "built-in"


def build_state(snapshot: ClusterSnapshot, policy: Policy) -> ClusterState:
    """The cluster model the services keep, fed from ``snapshot``: Leases, nodes and namespaces
    first (the pods' claims need their classes and devices), then every live pod (the ledger keeps
    the bound ones, the quota all of them)."""
    from vramguard.cluster import ClusterState  # noqa: PLC0415

    state = ClusterState(policy)
    if snapshot.learned is not None:
        apply_stored_learning(state, snapshot.learned)
    state.leases.replace(snapshot.leases)
    state.nodes.replace(snapshot.nodes)
    state.namespaces.replace(snapshot.namespaces)
    state.pods.replace(snapshot.pods)
    feed_dra(state, snapshot.dra)
    return state


def apply_stored_learning(state: ClusterState, text: str) -> None:
    """Size the pods with the extender's learned allowances, as it does; a table that is not one the
    extender writes is left out (the static estimates count)."""
    from vramguard.learning import LearnedTable, LearnedTableError  # noqa: PLC0415

    try:
        table = LearnedTable.from_json(text)
    except LearnedTableError:
        return
    state.set_learned(table.allowances(state.policy.learning.rules()))


def feed_dra(state: ClusterState, objects: dict[str, list[JSON]]) -> None:
    """Feed the model's DRA state from listed (or read from files) resource.k8s.io/v1 objects."""
    state.dra.watched = True
    state.dra.slices.replace(objects.get("resourceslices", []))
    state.dra.classes.replace(objects.get("deviceclasses", []))
    state.dra.claims.replace(objects.get("resourceclaims", []))
    state.dra.templates.replace(objects.get("resourceclaimtemplates", []))


def ledger_rows(state: ClusterState) -> list[GpuRow]:
    """Every device-plugin GPU of every node, with the ledger's budget and reservations and the
    state of the node's agent report."""
    agents = {node: inventory.agent for node in state.node_names()
              if (inventory := state.ledger.inventory(node)) is not None}
    return gpu_rows((row for node in state.node_names() for row in state.ledger.usage(node)), agents)


def node_rows(state: ClusterState) -> list[GpuRow]:
    """:func:`ledger_rows`, then every DRA device, with what allocated claims consume on it."""
    return ledger_rows(state) + dra_rows(state.dra.usage().values())


def report_notes(state: ClusterState) -> list[str]:
    """Nodes whose agent report was set aside, and why (a stale or missing Lease); DRA objects left out."""
    notes = []
    for node in sorted(state.node_names()):
        inventory = state.ledger.inventory(node)
        if inventory is not None and inventory.distrust is not None:
            notes.append(f"node {node}: {inventory.distrust}; counted as if unreported")
    return notes + list(state.dra.notes())


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
    common.add_argument("-o", "--output", choices=("text", "json", "table"), default="text",
                        help="output format, as for every vramguard command (table: the same as text)")
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
