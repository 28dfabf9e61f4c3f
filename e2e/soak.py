"""A seeded soak of vramguard on the real control plane, checked from the API server's objects alone.

Command line (starts its own cluster with two extender replicas, loopback only)::

    python -m e2e.soak --seed 1 --ops 10000 --duration 7200 --out soak.json

One run is a seeded random mix of operations, bounded by ``--ops`` and ``--duration`` (whichever
comes first):

* GPU pods of several shapes and engines (vLLM, SGLang, TGI, declared ``vramguard.io/vram``
  annotations, unknown VRAM, multi-GPU, MPS) created and deleted, in an ``enforce`` and an
  ``audit`` namespace; Deployments scaled up and down (where the cluster runs
  kube-controller-manager; otherwise replica groups, pods sharing an owner label that the soak
  creates and deletes as a ReplicaSet would);
* pods placed directly with ``spec.nodeName`` (the webhook's check, on nodes of their own: the
  scheduler and the webhook race on a shared node, which is documented);
* GPU nodes appearing, changing their GPU count (drained first, as an operator would) and
  disappearing (drained first);
* the extender's leader SIGKILLed and restarted, the leader SIGTERMed (a rolling replacement and a
  leader change), the webhook restarted, kube-apiserver restarted: each ``--extender-kills``,
  ``--leader-changes``, ``--webhook-restarts``, ``--apiserver-restarts`` times, at seeded positions.

After every operation and at the end, :class:`Checker` looks at the API server's objects alone (the
ledger rebuilt from them, as a restarted extender would build it; never an extender's view):

* no GPU above its budget (every invariant of the core ledger);
* every pending pod that fits some node given the bound pods is bound within ``--bind-within``
  seconds (counted from when it fits and the control plane is whole again: a leader is ready);
* every deleted pod is gone from the API server, so its VRAM is released (and the pods that then
  fit are bound, which only happens if the extender released it too);
* no pod lost (every pod created and not deleted is still there, and every Deployment has as many
  pods as replicas within ``--bind-within`` seconds) or bound twice (a pod's node never changes once
  set).

The summary (operations by kind, kills, restarts, leader changes, bind latency percentiles, the
processes' peak RSS from /proc, violations) is printed and written as JSON with ``--out``; the exit
status is 1 if any check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e import gpu_nodes
from e2e.cluster import Cluster
from e2e.procs import group_members, http_status
from e2e.scenario import AGENT_LEASES, pin_to_test, private_node
from vramguard.cluster import ClusterState
from vramguard.node_selection import placement_refusal
from vramguard.placement import Verdict, filter_nodes
from vramguard.policy import default_policy

EXTENDER_LEASE = "/apis/coordination.k8s.io/v1/namespaces/vramguard-system/leases/vramguard-extender"
RUN_LABEL = "soak.vramguard.io/run"
GROUP_LABEL = "soak.vramguard.io/group"
DEPLOYMENT_LABEL = "soak.vramguard.io/deployment"
DIRECT_LABEL = "soak.vramguard.io/direct"
ENFORCE_NS = "soak-enforce"
AUDIT_NS = "soak-audit"
LEASE_DURATION = 15.0
DISRUPTIONS = ("extender-kill", "leader-change", "webhook-restart", "apiserver-restart")


def _log(message: str) -> None:
    print(f"e2e.soak: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- workload shapes


def _container(
    name: str, image: str, args: Sequence[str], gpus: int, resource: str = "nvidia.com/gpu"
) -> dict[str, Any]:
    return {"name": name, "image": image, "args": list(args), "resources": {"limits": {resource: str(gpus)}}}


def _vllm(utilization: str, gpus: int = 1) -> tuple[dict[str, Any], dict[str, str]]:
    args = ["--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu-memory-utilization", utilization]
    if gpus > 1:
        args += ["--tensor-parallel-size", str(gpus)]
    return _container("vllm", "vllm/vllm-openai:v0.21.0", args, gpus), {}


def _sglang(fraction: str) -> tuple[dict[str, Any], dict[str, str]]:
    args = [
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "Qwen/Qwen2.5-7B-Instruct",
        "--mem-fraction-static",
        fraction,
    ]
    return _container("sglang", "lmsysorg/sglang:v0.5.4", args, 1), {}


def _tgi(fraction: str) -> tuple[dict[str, Any], dict[str, str]]:
    args = ["--model-id", "Qwen/Qwen2.5-7B-Instruct", "--cuda-memory-fraction", fraction]
    return _container("tgi", "ghcr.io/huggingface/text-generation-inference:3.3.4", args, 1), {}


def _declared(size: str) -> tuple[dict[str, Any], dict[str, str]]:
    return _container("worker", "python:3.12", ["python", "serve.py"], 1), {"vramguard.io/vram.worker": size}


def _unknown() -> tuple[dict[str, Any], dict[str, str]]:
    return _container("cuda", "nvidia/cuda:12.9.1-base-ubuntu24.04", ["sleep", "infinity"], 1), {}


SHAPES: dict[str, Callable[[], tuple[dict[str, Any], dict[str, str]]]] = {
    "vllm-0.30": lambda: _vllm("0.30"),
    "vllm-0.45": lambda: _vllm("0.45"),
    "vllm-tp2-0.40": lambda: _vllm("0.40", gpus=2),
    "sglang-0.35": lambda: _sglang("0.35"),
    "tgi-0.25": lambda: _tgi("0.25"),
    "declared-20Gi": lambda: _declared("20Gi"),
    "declared-48Gi": lambda: _declared("48Gi"),
    "unknown-vram": _unknown,
    "mps-vllm-0.80": lambda: _vllm("0.80"),
}
"""Pod shapes by name; ``mps-*`` shapes select MPS nodes (each replica a quarter of a GPU)."""

SHAPE_WEIGHTS = {
    "vllm-0.30": 4,
    "vllm-0.45": 3,
    "vllm-tp2-0.40": 1,
    "sglang-0.35": 2,
    "tgi-0.25": 2,
    "declared-20Gi": 2,
    "declared-48Gi": 1,
    "unknown-vram": 1,
    "mps-vllm-0.80": 2,
}


def pod_manifest(
    name: str, shape: str, run: str, *, node: str | None = None, group: str | None = None, scheduler: str | None = None
) -> dict[str, Any]:
    """A GPU pod of ``shape`` that only the soak's nodes accept (or placed on ``node`` directly)."""
    container, annotations = SHAPES[shape]()
    labels = {RUN_LABEL: run, "soak.vramguard.io/shape": shape}
    if group:
        labels[GROUP_LABEL] = group
    spec: dict[str, Any] = pin_to_test({"containers": [container], "terminationGracePeriodSeconds": 0}, run)
    if shape.startswith("mps-"):
        spec["nodeSelector"] = {**spec["nodeSelector"], "nvidia.com/gpu.sharing-strategy": "mps"}
    if node is not None:
        labels[DIRECT_LABEL] = "true"
        spec["nodeName"] = node
        spec["tolerations"] = [*spec["tolerations"], {"key": DIRECT_LABEL, "operator": "Exists"}]
    if scheduler is not None:
        spec["schedulerName"] = scheduler
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": spec,
    }


def deployment_manifest(name: str, shape: str, run: str) -> dict[str, Any]:
    """A Deployment of ``shape`` pods, at 0 replicas (the soak scales it)."""
    pod = pod_manifest(name, shape, run)
    labels = {**pod["metadata"]["labels"], DEPLOYMENT_LABEL: name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": {RUN_LABEL: run}},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {DEPLOYMENT_LABEL: name}},
            "template": {
                "metadata": {"labels": labels, "annotations": pod["metadata"]["annotations"]},
                "spec": pod["spec"],
            },
        },
    }


NODE_SHAPES: dict[str, Callable[[str], gpu_nodes.GPUNodeSpec]] = {
    "h100-ts": lambda name: gpu_nodes.time_sliced(name, "H100-80GB", gpus=2, replicas=4),
    "a100-whole": lambda name: gpu_nodes.exclusive(name, "A100-80GB", gpus=2),
    "l40s-mps": lambda name: gpu_nodes.mps(name, "L40S", gpus=2, replicas=4),
    "h200-ts": lambda name: gpu_nodes.time_sliced(name, "H200", gpus=1, replicas=4),
}
INITIAL_NODES = ("h100-ts", "h100-ts", "a100-whole", "l40s-mps", "h200-ts")
DIRECT_NODES = 2
"""Nodes only direct placements use (tainted; scheduled pods do not tolerate the taint)."""
DRAIN_SETTLE = 1.5
"""Seconds between cordoning a node and deleting its pods: a bind the scheduler began before the
cordon lands meanwhile (changing a node's GPUs under a running pod is not the guard's to prevent)."""


# --------------------------------------------------------------------------- the API, with retries


class Api:
    """JSON requests to the API server as the admin, retried while it restarts."""

    def __init__(self, cluster: Cluster, patience: float = 120.0) -> None:
        self.cluster = cluster
        self.patience = patience

    def call(
        self, method: str, path: str, body: Mapping[str, Any] | None = None, *, content_type: str | None = None
    ) -> Any:
        """One request; connection failures and 5xx are retried for ``patience`` seconds, 4xx raise."""
        deadline = time.monotonic() + self.patience
        while True:
            try:
                if content_type is None:
                    return self.cluster.request(method, path, body)
                return self._patch(path, body or {}, content_type)
            except urllib.error.HTTPError as error:
                if error.code < 500 or time.monotonic() > deadline:
                    raise
            except (urllib.error.URLError, OSError, ConnectionError):
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.5)

    def _patch(self, path: str, body: Mapping[str, Any], content_type: str) -> Any:
        state = self.cluster.state
        assert state is not None
        request = urllib.request.Request(state.server + path, data=json.dumps(body).encode(), method="PATCH")
        request.add_header("Authorization", f"Bearer {state.admin_token}")
        request.add_header("Content-Type", content_type)
        with urllib.request.urlopen(request, timeout=30, context=self.cluster.ssl_context()) as response:
            return json.loads(response.read() or b"null")

    def pods(self) -> list[dict[str, Any]]:
        """Every pod in the cluster."""
        items: list[dict[str, Any]] = self.call("GET", "/api/v1/pods")["items"]
        return items


# --------------------------------------------------------------------------- the checks


@dataclass
class Tracked:
    """A pod the soak created, as the soak remembers it."""

    namespace: str
    name: str
    uid: str
    created: float
    direct: bool
    owned: bool = False
    """Made by a ReplicaSet: its controller may delete it (scaling down), so only its count is checked."""
    node: str | None = None
    bound_seen: float | None = None
    fits_since: float | None = None


@dataclass
class Checker:
    """Every check of the soak, made on the API server's objects alone."""

    run: str
    bind_within: float
    live: dict[str, Tracked] = field(default_factory=dict)
    """uid -> pods created and not deleted by the soak."""
    deleted: dict[str, float] = field(default_factory=dict)
    """uid -> when the soak's DELETE returned."""
    deployments: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Deployment name -> (namespace, replicas the soak asked for)."""
    short_since: dict[str, float] = field(default_factory=dict)
    """Deployment name -> since when it has had fewer or more pods than replicas."""
    quiet_since: float = field(default_factory=time.monotonic)
    """When the control plane was last whole again (a ready extender leader, the API server up)."""
    violations: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    checks: int = 0
    peak_bound: int = 0
    peak_pending_fitting: int = 0
    pending_fitting: int = 0
    _seen: set[str] = field(default_factory=set)
    """Pending pods that fit somewhere, at the last check."""

    def check(self, api: Api, now: float | None = None) -> list[str]:
        """Run every check once; return (and remember) the new violations."""
        pods = api.pods()
        nodes = api.call("GET", "/api/v1/nodes")["items"]
        state = ClusterState(default_policy())
        state.leases.replace(api.call("GET", AGENT_LEASES)["items"])
        state.nodes.replace(nodes)
        state.namespaces.replace(api.call("GET", "/api/v1/namespaces")["items"])
        state.pods.replace(pods)
        now = time.monotonic() if now is None else now
        found = [f"over budget: {v}" for v in state.ledger.check_invariants()]
        self._adopt(pods, now)
        found += self._lost_or_rebound(pods, now)
        found += self._replicas(pods, now)
        found += self._released(pods)
        found += self._bound_in_time(state, pods, nodes, now)
        self.checks += 1
        for message in found:
            # A pod left pending is one violation however many checks see it.
            key = message.split(" fits but", 1)[0]
            if key not in self._seen:
                self._seen.add(key)
                _log(f"VIOLATION {message}")
                self.violations.append(message)
        return found

    def _adopt(self, pods: list[dict[str, Any]], now: float) -> None:
        """Track the pods the Deployments' ReplicaSets made; forget those their controller deleted."""
        present = {p["metadata"]["uid"] for p in pods}
        for uid in [uid for uid, t in self.live.items() if t.owned and uid not in present]:
            del self.live[uid]
        for pod in pods:
            meta = pod["metadata"]
            if (meta.get("labels") or {}).get(DEPLOYMENT_LABEL) and meta["uid"] not in self.live:
                self.live[meta["uid"]] = Tracked(meta["namespace"], meta["name"], meta["uid"], now, False, owned=True)

    def _replicas(self, pods: list[dict[str, Any]], now: float) -> list[str]:
        """Every Deployment has as many live pods as replicas, within ``bind_within`` once quiet."""
        found = []
        for name, (namespace, replicas) in self.deployments.items():
            count = sum(
                1
                for p in pods
                if p["metadata"]["namespace"] == namespace
                and (p["metadata"].get("labels") or {}).get(DEPLOYMENT_LABEL) == name
                and not p["metadata"].get("deletionTimestamp")
            )
            if count == replicas:
                self.short_since.pop(name, None)
                continue
            since = self.short_since.setdefault(name, now)
            if now - max(since, self.quiet_since) > self.bind_within:
                found.append(f"lost: Deployment {namespace}/{name} has {count} pods for {replicas} replicas")
        return found

    def _lost_or_rebound(self, pods: list[dict[str, Any]], now: float) -> list[str]:
        by_uid = {p["metadata"]["uid"]: p for p in pods}
        found = []
        bound = 0
        for uid, pod in self.live.items():
            seen = by_uid.get(uid)
            if seen is None:
                found.append(f"lost: pod {pod.namespace}/{pod.name} ({uid}) is gone but was never deleted")
                continue
            node = seen["spec"].get("nodeName")
            if pod.node is not None and node != pod.node:
                found.append(f"bound twice: pod {pod.namespace}/{pod.name} was on {pod.node}, now on {node}")
            elif node and pod.node is None:
                pod.node = node
                pod.bound_seen = now
                if not pod.direct and not pod.owned:
                    self.latencies.append(now - pod.created)
            bound += bool(node)
        self.peak_bound = max(self.peak_bound, bound)
        return found

    def _released(self, pods: list[dict[str, Any]]) -> list[str]:
        present = {p["metadata"]["uid"] for p in pods}
        return [f"not released: deleted pod {uid} is still on the API server" for uid in self.deleted if uid in present]

    def _bound_in_time(
        self, state: ClusterState, pods: list[dict[str, Any]], nodes: list[dict[str, Any]], now: float
    ) -> list[str]:
        by_uid = {p["metadata"]["uid"]: p for p in pods}
        found = []
        fitting = 0
        for uid, tracked in self.live.items():
            pod = by_uid.get(uid)
            if pod is None or tracked.node is not None or tracked.direct:
                continue
            fitting_nodes = self.fitting_nodes(state, pod, nodes)
            if not fitting_nodes:
                tracked.fits_since = None
                continue
            fitting += 1
            if tracked.fits_since is None:
                tracked.fits_since = now
            waited = now - max(tracked.fits_since, self.quiet_since)
            if waited > self.bind_within:
                found.append(
                    f"not bound in time: pod {tracked.namespace}/{tracked.name} fits but has been pending "
                    f"{waited:.0f}s (> {self.bind_within:.0f}s) with the control plane whole; it fits "
                    f"{', '.join(fitting_nodes[:3])}; the scheduler said: {scheduling_message(pod)[:400]}"
                )
        self.pending_fitting = fitting
        self.peak_pending_fitting = max(self.peak_pending_fitting, fitting)
        return found

    @staticmethod
    def fits_somewhere(state: ClusterState, pod: Mapping[str, Any], nodes: Sequence[Mapping[str, Any]]) -> bool:
        """Whether the pod passes the node's selectors and taints and the VRAM rule on some node."""
        return bool(Checker.fitting_nodes(state, pod, nodes))

    @staticmethod
    def fitting_nodes(state: ClusterState, pod: Mapping[str, Any], nodes: Sequence[Mapping[str, Any]]) -> list[str]:
        """The nodes whose selectors, taints and VRAM rule the pod passes."""
        spec = pod.get("spec") or {}
        eligible = [
            n["metadata"]["name"]
            for n in nodes
            if not (n.get("spec") or {}).get("unschedulable")
            and placement_refusal(
                spec, n["metadata"]["name"], n["metadata"].get("labels") or {}, (n.get("spec") or {}).get("taints")
            )
            is None
        ]
        if not eligible:
            return []
        choice = state.choose_class(pod)
        claims = state.claims_for(pod, choice)
        verdicts = filter_nodes(state.ledger, eligible, claims, choice)
        return [node for node, verdict in zip(eligible, verdicts, strict=True) if verdict.verdict is Verdict.PASS]


def scheduling_message(pod: Mapping[str, Any]) -> str:
    """The scheduler's last word on a pending pod (its PodScheduled condition), if any."""
    for condition in (pod.get("status") or {}).get("conditions") or ():
        if condition.get("type") == "PodScheduled":
            return str(condition.get("message") or condition.get("reason") or "")
    return ""


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """p50, p90, p99 and max of ``values`` in seconds (empty: nothing)."""
    if not values:
        return {}
    ordered = sorted(values)
    if len(ordered) == 1:
        return {"p50": ordered[0], "p90": ordered[0], "p99": ordered[0], "max": ordered[0]}
    cuts = statistics.quantiles(ordered, n=100, method="inclusive")
    return {
        "p50": round(cuts[49], 2),
        "p90": round(cuts[89], 2),
        "p99": round(cuts[98], 2),
        "max": round(ordered[-1], 2),
    }


def rss_kib(pgid: int) -> int:
    """Resident set size of every process in the group, from /proc (KiB)."""
    total = 0
    for pid in group_members([pgid]):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return total


# --------------------------------------------------------------------------- the soak


@dataclass
class SoakConfig:
    """How long, how hard and how often to break things."""

    seed: int = 1
    ops: int = 200
    duration: float = 120.0
    bind_within: float = 60.0
    max_pods: int = 160
    max_nodes: int = 9
    extender_kills: int = 1
    leader_changes: int = 1
    webhook_restarts: int = 1
    apiserver_restarts: int = 1
    check_every: int = 1
    """Run the checks after every n-th operation (1: after every one)."""


class Soak:
    """One seeded run against ``cluster`` (two extender replicas; see the module docstring)."""

    def __init__(self, cluster: Cluster, config: SoakConfig, run: str | None = None) -> None:
        self.cluster = cluster
        self.config = config
        self.rng = random.Random(config.seed)
        self.run = run or f"s{config.seed}"
        self.api = Api(cluster)
        self.checker = Checker(self.run, config.bind_within)
        self.ops: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.nodes: dict[str, gpu_nodes.GPUNodeSpec] = {}
        self.direct_nodes: list[str] = []
        self.groups: dict[str, tuple[str, str]] = {}
        """group -> (namespace, shape)."""
        self.deployments = any(proc.name == "kube-controller-manager" for proc in cluster.processes)
        """Groups are Deployments (kube-controller-manager runs), else pods the soak makes itself."""
        self.serial = 0
        self.leader_changes_seen = 0
        self.holder: str | None = None
        self.disruption_seconds: dict[str, list[float]] = {kind: [] for kind in DISRUPTIONS}
        self.rss_peak: dict[str, int] = {}
        self.started = time.monotonic()

    # -- set-up -----------------------------------------------------------------------------

    def setup(self) -> None:
        """Namespaces (one enforcing, one auditing) and the initial nodes."""
        for name, mode in ((ENFORCE_NS, "enforce"), (AUDIT_NS, "audit")):
            self.cluster.create(
                {
                    "apiVersion": "v1",
                    "kind": "Namespace",
                    "metadata": {"name": name, "labels": {"vramguard.io/enforce": mode}},
                }
            )
        for shape in INITIAL_NODES:
            self._add_node(shape)
        for _ in range(DIRECT_NODES):
            name = self._name("direct")
            spec = private_node(NODE_SHAPES["h100-ts"](name), self.run)
            spec = dataclasses.replace(
                spec, taints=(*spec.taints, {"key": DIRECT_LABEL, "value": "true", "effect": "NoSchedule"})
            )
            self._create_node(spec)
            self.direct_nodes.append(spec.name)
        for index, shape in enumerate(("vllm-0.30", "tgi-0.25", "declared-20Gi")):
            self.groups[f"g{index}"] = (ENFORCE_NS if index % 2 == 0 else AUDIT_NS, shape)
        if self.deployments:
            for name, (namespace, shape) in self.groups.items():
                self.api.call(
                    "POST",
                    f"/apis/apps/v1/namespaces/{namespace}/deployments",
                    deployment_manifest(name, shape, self.run),
                )
                self.checker.deployments[name] = (namespace, 0)
        self.holder = self._lease_holder()

    def _name(self, prefix: str) -> str:
        self.serial += 1
        return f"{prefix}-{self.serial:05d}"

    def _create_node(self, spec: gpu_nodes.GPUNodeSpec) -> None:
        self.api.call("POST", "/api/v1/nodes", gpu_nodes.node_manifest(spec))
        self.api.call(
            "PATCH",
            f"/api/v1/nodes/{spec.name}/status",
            {"status": gpu_nodes.node_status(spec)},
            content_type="application/merge-patch+json",
        )
        self.nodes[spec.name] = spec

    def _add_node(self, shape: str) -> None:
        self._create_node(private_node(NODE_SHAPES[shape](self._name(shape)), self.run))

    # -- operations -------------------------------------------------------------------------

    def _weights(self) -> dict[str, float]:
        live = len(self.checker.live)
        full = live >= self.config.max_pods
        nodes = len(self.nodes)
        return {
            "create-pod": 0 if full else 40,
            "delete-pod": 25 if live else 0,
            "direct-create": 0 if full else 7,
            "direct-delete": 5,
            "scale-group": 10,
            "add-node": 2 if nodes < self.config.max_nodes else 0,
            "resize-node": 2,
            "remove-node": 2 if nodes > 3 + DIRECT_NODES else 0,
        }

    def step(self) -> str:
        """One random operation (not a disruption); returns its kind."""
        weights = self._weights()
        kind = self.rng.choices(list(weights), weights=list(weights.values()))[0]
        getattr(self, "_op_" + kind.replace("-", "_"))()
        self.ops[kind] += 1
        return kind

    def _create(self, namespace: str, manifest: dict[str, Any], direct: bool) -> None:
        name = manifest["metadata"]["name"]
        try:
            created = self.api.call("POST", f"/api/v1/namespaces/{namespace}/pods", manifest)
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")
            if error.code == 403 and "denied the request" in detail:
                self.outcomes["refused by the webhook"] += 1
            elif "failed calling webhook" in detail:
                self.outcomes["refused: webhook unavailable"] += 1
            elif error.code == 409:
                created = self.api.call("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
                self._track(created, direct)  # created before a connection broke, then retried
            else:
                raise RuntimeError(f"creating pod {namespace}/{name}: {error.code} {detail}") from error
            return
        self._track(created, direct)
        self.outcomes["direct placements admitted" if direct else "pods created"] += 1

    def _track(self, pod: Mapping[str, Any], direct: bool) -> None:
        metadata = pod["metadata"]
        self.checker.live[metadata["uid"]] = Tracked(
            metadata["namespace"], metadata["name"], metadata["uid"], time.monotonic(), direct
        )

    def _delete(self, tracked: Tracked) -> None:
        path = f"/api/v1/namespaces/{tracked.namespace}/pods/{tracked.name}"
        body = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": tracked.uid},
        }
        try:
            self.api.call("DELETE", path, body)
        except urllib.error.HTTPError as error:
            if error.code != 404:
                raise
        del self.checker.live[tracked.uid]
        self.checker.deleted[tracked.uid] = time.monotonic()
        self.outcomes["pods deleted"] += 1

    def _pick(self, predicate: Callable[[Tracked], bool]) -> Tracked | None:
        candidates = sorted((t for t in self.checker.live.values() if predicate(t)), key=lambda t: t.name)
        return self.rng.choice(candidates) if candidates else None

    def _shape(self) -> str:
        return self.rng.choices(list(SHAPE_WEIGHTS), weights=list(SHAPE_WEIGHTS.values()))[0]

    def _op_create_pod(self) -> None:
        namespace = self.rng.choice((ENFORCE_NS, AUDIT_NS))
        self._create(namespace, pod_manifest(self._name("pod"), self._shape(), self.run), direct=False)

    def _op_delete_pod(self) -> None:
        tracked = self._pick(lambda t: not t.direct)
        if tracked is not None:
            self._delete(tracked)

    def _op_direct_create(self) -> None:
        shape = self.rng.choice(("vllm-0.30", "vllm-0.45", "declared-20Gi", "tgi-0.25"))
        node = self.rng.choice(self.direct_nodes)
        self._create(ENFORCE_NS, pod_manifest(self._name("direct"), shape, self.run, node=node), direct=True)

    def _op_direct_delete(self) -> None:
        tracked = self._pick(lambda t: t.direct)
        if tracked is not None:
            self._delete(tracked)

    def _op_scale_group(self) -> None:
        """Scale a Deployment (or a replica group: new pods from its template, or the newest deleted,
        pending ones first, as a ReplicaSet scales down) to a random size."""
        group = self.rng.choice(sorted(self.groups))
        namespace, shape = self.groups[group]
        if self.deployments:
            current = self.checker.deployments[group][1]
            target = min(self.rng.randint(0, 8), current + max(0, self.config.max_pods - len(self.checker.live)))
            self.api.call(
                "PATCH",
                f"/apis/apps/v1/namespaces/{namespace}/deployments/{group}",
                {"spec": {"replicas": target}},
                content_type="application/merge-patch+json",
            )
            self.checker.deployments[group] = (namespace, target)
            self.checker.short_since.pop(group, None)
            self.outcomes["deployment pods asked for"] += max(0, target - current)
            return
        members = [t for t in self.checker.live.values() if t.name.startswith(f"{group}-")]
        target = self.rng.randint(0, 8)
        room = self.config.max_pods - len(self.checker.live)
        for _ in range(min(target - len(members), room)):
            self._create(namespace, pod_manifest(self._name(group), shape, self.run, group=group), direct=False)
        surplus = sorted(members, key=lambda t: (t.node is not None, -t.created))[: max(0, len(members) - target)]
        for tracked in surplus:
            self._delete(tracked)

    def _drain(self, node: str) -> None:
        """Cordon the node, let binds already under way land, then delete every pod on it, as
        ``kubectl drain`` does (a Deployment's ReplicaSet makes a new pod, placed elsewhere)."""
        self._patch_node(node, {"spec": {"unschedulable": True}})
        time.sleep(DRAIN_SETTLE)
        for _ in range(5):
            on_node = [p for p in self.api.pods() if p["spec"].get("nodeName") == node]
            if not on_node:
                return
            for pod in on_node:
                meta = pod["metadata"]
                # A Deployment's pod made since the last check is not tracked yet: track it first.
                tracked = self.checker.live.get(meta["uid"]) or Tracked(
                    meta["namespace"], meta["name"], meta["uid"], time.monotonic(), False, owned=True
                )
                self.checker.live[meta["uid"]] = tracked
                self._delete(tracked)
            time.sleep(0.2)
        raise RuntimeError(f"node {node} still has pods after draining it")

    def _patch_node(self, node: str, body: Mapping[str, Any], subresource: str = "") -> None:
        self.api.call("PATCH", f"/api/v1/nodes/{node}{subresource}", body, content_type="application/merge-patch+json")

    def _changeable_nodes(self) -> list[str]:
        return sorted(name for name in self.nodes if name not in self.direct_nodes)

    def _op_add_node(self) -> None:
        self._add_node(self.rng.choice(sorted(NODE_SHAPES)))

    def _op_resize_node(self) -> None:
        """Drain a node and change its GPU count, as after a repair (labels and capacity change)."""
        name = self.rng.choice(self._changeable_nodes())
        spec = self.nodes[name]
        gpus = self.rng.choice([g for g in (1, 2, 4) if g != spec.gpus])
        self._drain(name)
        new = dataclasses.replace(spec, gpus=gpus)
        self._patch_node(name, {"metadata": {"labels": gpu_nodes.node_labels(new)}})
        self._patch_node(name, {"status": gpu_nodes.node_status(new)}, "/status")
        self._patch_node(name, {"spec": {"unschedulable": None}})
        self.nodes[name] = new

    def _op_remove_node(self) -> None:
        name = self.rng.choice(self._changeable_nodes())
        self._drain(name)
        try:
            self.api.call("DELETE", f"/api/v1/nodes/{name}")
        except urllib.error.HTTPError as error:
            if error.code != 404:
                raise
        del self.nodes[name]

    # -- disruptions ------------------------------------------------------------------------

    def _lease_holder(self) -> str | None:
        try:
            lease = self.api.call("GET", EXTENDER_LEASE)
        except urllib.error.HTTPError:
            return None
        holder = (lease.get("spec") or {}).get("holderIdentity")
        return str(holder) if holder else None

    def leader(self) -> int | None:
        """The extender replica that is ready (only the leader is), if any."""
        state = self.cluster.state
        assert state is not None
        for key, url in sorted(state.vramguard_ops.items()):
            if key.startswith("extender-") and http_status(f"{url}/readyz") == 200:
                return int(key.rpartition("-")[2])
        return None

    def _wait_leader(self, timeout: float) -> float:
        started = time.monotonic()
        while self.leader() is None:
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"no extender replica became the leader within {timeout:.0f}s")
            time.sleep(0.2)
        return time.monotonic() - started

    def disrupt(self, kind: str) -> None:
        """One disruption; the checker's clock for binding restarts once the control plane is whole."""
        started = time.monotonic()
        if kind in ("extender-kill", "leader-change"):
            leader = self.leader()
            if leader is None:
                self._wait_leader(4 * LEASE_DURATION)
                leader = self.leader()
            sig = signal.SIGKILL if kind == "extender-kill" else signal.SIGTERM
            self.cluster.restart_vramguard("extender", sig, replica=leader)
            self._wait_leader(4 * LEASE_DURATION)
        elif kind == "webhook-restart":
            self.cluster.restart_vramguard("webhook", signal.SIGTERM)
        elif kind == "apiserver-restart":
            self.cluster.restart_apiserver()
            self._wait_leader(4 * LEASE_DURATION)
        else:
            raise ValueError(kind)
        took = time.monotonic() - started
        self.disruption_seconds[kind].append(round(took, 1))
        self.ops[kind] += 1
        self.checker.quiet_since = time.monotonic()
        _log(f"{kind}: whole again after {took:.1f}s")

    def plan(self) -> dict[int, str]:
        """Operation index -> disruption, at seeded positions spread over the run."""
        config = self.config
        wanted = {
            "extender-kill": config.extender_kills,
            "leader-change": config.leader_changes,
            "webhook-restart": config.webhook_restarts,
            "apiserver-restart": config.apiserver_restarts,
        }
        total = sum(wanted.values())
        if total == 0:
            return {}
        kinds = [kind for kind, count in wanted.items() for _ in range(count)]
        self.rng.shuffle(kinds)
        # Evenly spaced slots with jitter, none in the first tenth (let the nodes fill up first).
        span = config.ops * 0.9 / total
        return {int(config.ops * 0.1 + span * (i + self.rng.random() * 0.5)): kind for i, kind in enumerate(kinds)}

    # -- the loop ---------------------------------------------------------------------------

    def observe(self) -> None:
        """Leader changes (the Lease's holder) and peak RSS of every component."""
        holder = self._lease_holder()
        if holder and self.holder and holder != self.holder:
            self.leader_changes_seen += 1
        self.holder = holder or self.holder
        for proc in self.cluster.processes:
            component = proc.name.rpartition("-")[0] if proc.name.startswith("vramguard-extender-") else proc.name
            self.rss_peak[component] = max(self.rss_peak.get(component, 0), rss_kib(proc.record.pid))
        if self.leader() is None:
            self.checker.quiet_since = time.monotonic()

    def execute(self) -> dict[str, Any]:
        """Set up, run every operation with the checks after each, settle, and summarise."""
        self.setup()
        plan = self.plan()
        deadline = self.started + self.config.duration
        done = 0
        for index in range(self.config.ops):
            if time.monotonic() > deadline:
                _log(f"duration reached after {done} operations")
                break
            if index in plan:
                self.disrupt(plan[index])
            else:
                self.step()
            done += 1
            if done % self.config.check_every == 0:
                self.observe()
                self.checker.check(self.api)
            if done % 250 == 0:
                _log(
                    f"{done} operations, {len(self.checker.live)} live pods, {len(self.checker.violations)} violations"
                )
        self.settle()
        return self.summary(done)

    def settle(self) -> None:
        """The final check: wait until no pending pod fits (or ``bind_within`` runs out)."""
        deadline = time.monotonic() + self.config.bind_within + 5
        while True:
            self.observe()
            self.checker.check(self.api)
            if self.checker.pending_fitting == 0 or time.monotonic() > deadline:
                return
            time.sleep(1.0)

    def summary(self, done: int) -> dict[str, Any]:
        """What happened, in numbers."""
        return {
            "seed": self.config.seed,
            "operations": done,
            "seconds": round(time.monotonic() - self.started, 1),
            "ops_by_kind": dict(sorted(self.ops.items())),
            "outcomes": dict(sorted(self.outcomes.items())),
            "extender_kills": self.ops["extender-kill"],
            "leader_changes": self.leader_changes_seen,
            "apiserver_restarts": self.ops["apiserver-restart"],
            "webhook_restarts": self.ops["webhook-restart"],
            "disruption_recovery_seconds": self.disruption_seconds,
            "bind_latency_seconds": percentiles(self.checker.latencies),
            "pods_bound_by_scheduler": len(self.checker.latencies),
            "peak_bound_pods": self.checker.peak_bound,
            "live_pods_at_end": len(self.checker.live),
            "nodes_at_end": len(self.nodes),
            "bind_within_seconds": self.config.bind_within,
            "checks": self.checker.checks,
            "rss_peak_mib": {k: round(v / 1024, 1) for k, v in sorted(self.rss_peak.items())},
            "violations": len(self.checker.violations),
            "violation_messages": self.checker.violations[:50],
        }


@contextmanager
def soak_cluster(directory: Path, kube_version: str | None = None, drain_delay: float = 1.0) -> Iterator[Cluster]:
    """A cluster for the soak: two extender replicas electing a leader, the webhook, one scheduler."""
    cluster = Cluster.up(
        directory,
        kube_version=kube_version,
        vramguard="on",
        extender_replicas=2,
        service_args={"extender": ["--drain-delay", str(drain_delay)]},
    )
    try:
        yield cluster
    finally:
        cluster.down()


def render(summary: Mapping[str, Any]) -> str:
    """The summary for people."""
    lines = [f"soak seed {summary['seed']}: {summary['operations']} operations in {summary['seconds']}s"]
    lines.append("  ops: " + ", ".join(f"{k} {v}" for k, v in summary["ops_by_kind"].items()))
    lines.append("  outcomes: " + ", ".join(f"{k} {v}" for k, v in summary["outcomes"].items()))
    lines.append(
        f"  extender kills {summary['extender_kills']}, leader changes {summary['leader_changes']}, "
        f"apiserver restarts {summary['apiserver_restarts']}, webhook restarts {summary['webhook_restarts']}"
    )
    latency = summary["bind_latency_seconds"]
    if latency:
        lines.append(
            f"  bind latency (s): p50 {latency['p50']} p90 {latency['p90']} p99 {latency['p99']} "
            f"max {latency['max']} over {summary['pods_bound_by_scheduler']} pods"
        )
    lines.append("  peak RSS (MiB): " + ", ".join(f"{k} {v}" for k, v in summary["rss_peak_mib"].items()))
    lines.append(f"  checks {summary['checks']}, violations {summary['violations']}")
    lines.extend(f"    {message}" for message in summary["violation_messages"])
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m e2e.soak``: see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m e2e.soak", description=__doc__.splitlines()[0])
    defaults = SoakConfig()
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--ops", type=int, default=defaults.ops, help="at most this many operations")
    parser.add_argument("--duration", type=float, default=defaults.duration, help="at most this many seconds")
    parser.add_argument(
        "--bind-within",
        type=float,
        default=defaults.bind_within,
        help="seconds a fitting pod may stay pending once the control plane is whole",
    )
    parser.add_argument("--max-pods", type=int, default=defaults.max_pods)
    parser.add_argument("--extender-kills", type=int, default=defaults.extender_kills)
    parser.add_argument("--leader-changes", type=int, default=defaults.leader_changes)
    parser.add_argument("--webhook-restarts", type=int, default=defaults.webhook_restarts)
    parser.add_argument("--apiserver-restarts", type=int, default=defaults.apiserver_restarts)
    parser.add_argument("--check-every", type=int, default=defaults.check_every)
    parser.add_argument("--dir", type=Path, help="cluster directory (default: a temporary one)")
    parser.add_argument("--kube-version")
    parser.add_argument("--out", type=Path, help="write the summary here as JSON")
    args = parser.parse_args(argv)
    for name in ("ops", "duration", "bind_within", "max_pods", "check_every"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    config = SoakConfig(
        seed=args.seed,
        ops=args.ops,
        duration=args.duration,
        bind_within=args.bind_within,
        max_pods=args.max_pods,
        extender_kills=args.extender_kills,
        leader_changes=args.leader_changes,
        webhook_restarts=args.webhook_restarts,
        apiserver_restarts=args.apiserver_restarts,
        check_every=args.check_every,
    )
    directory = args.dir or Path(tempfile.mkdtemp(prefix="vramguard-soak-"))
    with soak_cluster(directory, args.kube_version) as cluster:
        summary = Soak(cluster, config).execute()
    print(render(summary))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if summary["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
