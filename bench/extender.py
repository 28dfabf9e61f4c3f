"""Benchmark of the scheduler extender: latency, memory, and throughput on the real control plane.

    python -m bench.extender [--quick] [--only latency,lag,memory,throughput] [--work-dir DIR]

Prints one JSON line per measurement, then a summary table.

- **latency**: filter and prioritize for 5,000 time-sliced H100 nodes holding 50,000 running pods
  (``bench.cluster_model``), with ``NodeNames`` as kube-scheduler sends them when the extender is
  ``nodeCacheCapable``. A scheduling wave per pod shape: filter, prioritize, bind the best node, the
  watch event of the binding, and a running pod deleted elsewhere, so that every request sees a
  few nodes changed since the last. ``steady`` is every request but each shape's first, reported
  as percentiles; ``first-of-wave`` the first of each of the 4 shapes (no cached verdict), reported
  as its 4 values, too few for a percentile. Measured in-process (the verbs alone) and over HTTPS on loopback (the
  extender's endpoints behind ``vramguard.io.server.serve``, a client that keeps its connection),
  with the collector frozen after the sync as the extender freezes it. Then 2 x 120 pods of new
  shapes with all 5,000 names and with 500: the served filter and, alternating request by request,
  the baseline of every node judged one by one; with the answer's size, its distinct failure
  reasons and the collector's pauses (the extender's thresholds, :func:`extender.main.freeze_collector`).
- **lag**: the event loop's lag (a task sleeping 1 ms in a loop records how late it wakes, p50 /
  p99 / max) while filters and prioritizes of pods of new shapes run over the 5,000 nodes, with the
  work sliced as served and unsliced as the baseline, interleaved round by round. Then the filter
  time of pathological pods (200 containers x 1,000 GPUs; 4 x 1,000, just under the device cap).
- **scrape**: filters over HTTPS with all node names while nothing else runs, and while a
  Prometheus scrape of ``/metrics`` and a rendering of the ledger's series run on the same event
  loop (per node and product, the default; per GPU, ``--metrics-per-gpu``), interleaved request by
  request; with the size of each exposition and its render time (in one piece, and in slices as served).
- **memory**: in a fresh interpreter, the process's resident memory (``VmRSS``, the figure that
  counts) and, from a second run with ``tracemalloc`` on (its timings discarded), the Python heap
  held by the cluster state after the informers' lists of 5,000 Nodes and 50,000 Pods were fed
  to it and dropped, and the peak (``VmHWM``) while they were.
- **tls**: the extender's CPU per TLS handshake (each new connection from kube-scheduler costs one),
  through the extender's own server context (``load_server_tls``), with the client certificate
  required (mutual TLS, as shipped) and, alternated handshake by handshake, without: what the
  throughput part's new connections per filter cost the extender, and how much of it is the client
  certificate's verification.
- **verbs**: the extender's own work per pod of a scheduling wave, without HTTP, TLS or the API
  server: 1,000 pods onto 500 single-GPU nodes, each filtered over 230 names (what the scheduler
  sends at that size), prioritized over those that pass, bound to the best (the API answered by a
  stand-in) and its watch event decoded and fed to the state; CPU time per pod for each step. Set
  against the throughput part's CPU per pod for the extender process, it tells the verbs' logic
  from the serving around it.
- **throughput**: on the local control plane (``e2e.cluster``, the second-scheduler layout), the
  stock kube-scheduler and one with the extender wired in, both with the shipped client settings,
  alternated on one cluster (``--repeats`` waves each, 3 by default; which goes first alternates):
  each wave creates 1,000 GPU pods for one of them while its kube-scheduler is paused, on 500
  schedulable time-sliced nodes, then resumes it (``--wave-start uncordon``: the nodes cordoned
  instead, then uncordoned; see :class:`WaveGate`); pods bound per second from the first binding to
  the last. ``--extender-verbs`` configures the extender's scheduler with only some of its verbs:
  what each costs a wave. Each wave also reports the CPU time every component used per pod (from
  ``/proc``): from the start to the last binding, and to :data:`SETTLE_SECONDS` after it
  (``settled``: the Events and watch traffic a fast wave leaves behind are counted too, the same
  tail for both), and the idle control plane's CPU per second beforehand (a slower wave accrues
  more of that background). The final placement is checked against the ledger's invariants (no
  GPU above budget whatever the device plugin picked). ``--extender`` names what serves the
  verbs, comma-separated, each on a cluster of its own against that cluster's stock scheduler
  (default ``vramguard,floor-h2,hami``), then a ``side-by-side`` record sets them against each other.
  ``floor`` puts the floor
  extender (``bench/floor``, Go) in the extender's place: the same wire (mutual TLS, HTTP/1.1,
  JSON, the same verbs and scheduler configuration) with nothing behind it (every node passes,
  every score is 0, bind only creates the Binding): what the extender protocol alone costs a wave,
  the most any extender could keep of the stock rate on the machine (``floor-h2``: the same,
  offering HTTP/2, which kube-scheduler's extender client then uses: one connection for every call;
  vramguard serves HTTP/2 too, so ``floor-h2`` is its floor). ``hami`` puts HAMi's scheduler
  extender (``bench/hami``: Project-HAMi/HAMi's
  ``cmd/scheduler``, Go, built from the source tree ``--hami-source`` names, or cloned from GitHub
  into ``~/.cache/vramguard-bench``; skipped with the reason when neither works) in the extender's place,
  wired as HAMi's chart wires it (filter and bind, its resources ``ignoredByScheduler``), on nodes
  annotated as its device plugin registers them (one GPU shared by the 4 replicas the node
  advertises); the pods of its waves ask for ``nvidia.com/gpumem``, the MiB vLLM reserves: the
  packing problem vramguard's waves face. HAMi exports no per-verb timings (no ``extender-verbs``
  record): its filter's share shows in the scheduler's cycle figures; its log's counts of filters,
  binds and failed node locks are reported (``hami-log``). HAMi is given the schedulers' API rate
  limit (its own default, 5 requests/s, is client-go's) and a node lock that counts as expired at
  once: its device plugin releases the lock on the node, and no kubelet runs here
  (:data:`bench.hami.peer.KUBE_QPS`, :data:`bench.hami.peer.NODE_LOCK_TIMEOUT`). Every run reports
  the extender process's resident memory after the waves (``extender-memory``).

- **hami-filter** (only when ``--only`` names it; needs HAMi's source tree like ``--extender hami``):
  HAMi's filter over its HTTPS, on the local control plane with 5,000 nodes annotated as the
  throughput part annotates them, with 500 and with 5,000 ``NodeNames`` alternated request by
  request, each for a pending pod of its own; then HAMi's resident memory (:func:`bench_hami_filter`).

``--quick`` shrinks everything (1,000 nodes, 10,000 pods; 100 nodes and 400 pods on the control
plane; 1,000 nodes, 500 and 1,000 names, for hami-filter) for a smoke run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import os
import platform
import random
import resource
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry

from bench.cluster_model import NEW_POD_SHAPES, ClusterModel, Shape, gpu_node, gpu_pod, new_pod, node_name
from bench.report import refuse_if_traced
from bench.restart import MIB, proc_status
from extender.app import LEDGER_EXPOSITION_KEY, build_app
from extender.main import freeze_collector
from extender.metrics import render_ledger_now
from extender.verbs import SLICE_NODES, SLICE_SECONDS, Slicer, Verbs
from vramguard.cluster import ClusterState, slim_node, slim_pod
from vramguard.io.certs import create_ca, issue_client_certificate, issue_serving_certificate, write_serving_files
from vramguard.io.http import Readiness
from vramguard.io.kube import ApiError
from vramguard.io.server import serve
from vramguard.io.tls import load_server_tls
from vramguard.placement import FilterMemo, Groups, NodeVerdict, PodClaims, filter_nodes
from vramguard.policy import ClassChoice, default_policy

JSON = dict[str, Any]
PARTS = ("latency", "lag", "scrape", "memory", "tls", "verbs", "throughput")
OPTIONAL_PARTS = ("hami-filter",)
"""Parts run only when ``--only`` names them (they need HAMi's source tree)."""
SCHEDULER = "vramguard"
"""The scheduler name of the pods the benchmark schedules (the default policy's)."""
IDLE_SAMPLE_SECONDS = 5.0
"""How long the throughput benchmark samples the idle control plane's CPU use."""
SETTLE_SECONDS = 4.0
"""How long after a wave's last binding its CPU is still counted (``cpu_ms_per_pod_settled``)."""
FLOOR_SOURCE = Path(__file__).resolve().parent / "floor"
"""The floor extender (Go): the extender wire with no checks behind it (``--extender floor``)."""
EXTENDERS = ("vramguard", "floor", "floor-h2", "hami")
HAMI_LAUNCHER = Path(__file__).resolve().parent / "hami" / "launch.py"
HAMI_CACHE = Path.home() / ".cache" / "vramguard-bench"
"""Where HAMi's source is cloned when ``--hami-source`` names none."""
DEFAULT_EXTENDERS = "vramguard,floor-h2,hami"
"""What the throughput part measures by default, each against the stock kube-scheduler on a cluster
of its own: vramguard, the floor over the transport vramguard serves, and the peer."""
"""Starts HAMi's scheduler with the harness's extender command line (``--extender hami``)."""
WAVE_UTILIZATION = "0.20"
"""The ``--gpu-memory-utilization`` of the throughput waves' vLLM pods."""
WAVE_GPU_MODEL = "H100-80GB"
"""The GPU of the throughput benchmark's nodes (``e2e.gpu_nodes``), time-sliced 4 ways."""
WAVE_REPLICAS = 4
EXTENDER_ONLY = (
    "import sys\n"
    "from vramguard.cli import main\n"
    "if sys.argv[1:2] == ['webhook']:\n"
    "    sys.exit('the webhook is left out of this benchmark run')\n"
    "sys.exit(main(sys.argv[1:]))\n"
)
"""``vramguard`` offering only the extender: the e2e harness starts each service whose ``--help`` works."""


def emit(record: Mapping[str, Any]) -> None:
    """One JSON line on stdout."""
    print(json.dumps(record, separators=(",", ":")), flush=True)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by the nearest-rank method."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q * len(ordered) + 0.5) - 1))
    return ordered[rank]


def latency_stats(values_s: list[float]) -> dict[str, float | int]:
    """Count, p50, p99 and max in milliseconds; refused when taken under a profiler or tracemalloc."""
    refuse_if_traced()
    if not values_s:
        return {"n": 0}
    ms = [v * 1000 for v in values_s]
    return {
        "n": len(ms),
        "p50_ms": round(statistics.median(ms), 2),
        "p99_ms": round(percentile(ms, 0.99), 2),
        "max_ms": round(max(ms), 2),
    }


def rss_bytes() -> int:
    """Resident set size of this process now (``VmRSS``)."""
    return _status_field("VmRSS")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (``VmHWM``; ``ru_maxrss`` where /proc is missing)."""
    try:
        return _status_field("VmHWM")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_field(name: str) -> int:
    with Path("/proc/self/status").open() as status:
        for line in status:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{name} not in /proc/self/status")


# --------------------------------------------------------------------------- the cluster state


def loaded_state(
    model: ClusterModel, clock: Callable[[], float] = time.time
) -> tuple[ClusterState, list[str], dict[str, list[JSON]]]:
    """A cluster state fed as the informers would, the node names, and the running pods per node."""
    state = ClusterState(default_policy(), clock=clock)
    state.namespaces.replace(model.namespaces())
    state.nodes.replace(model.node_objects())
    pods = list(model.pod_objects())
    state.pods.replace(pods)
    on_node: dict[str, list[JSON]] = {}
    for pod in pods:
        # What a DELETED event needs; the full objects are dropped, as the informer drops them.
        metadata = pod["metadata"]
        stub = {"metadata": {k: metadata[k] for k in ("name", "namespace", "uid")}}
        on_node.setdefault(pod["spec"]["nodeName"], []).append(stub)
    del pods
    gc.collect()
    return state, list(state.node_names()), on_node


class StubApi:
    """The two API calls bind makes, answered at once; the bench delivers the watch events itself."""

    def __init__(self) -> None:
        self.bindings: list[tuple[str, str]] = []
        self.pods: dict[str, JSON] = {}

    async def get(self, path: str, params: Any = None) -> JSON:
        return self.pods[path.rsplit("/", 1)[-1]]

    async def patch(self, path: str, body: Any, patch_type: str = "merge") -> JSON:
        return {}

    async def create(self, path: str, body: Any) -> JSON:
        self.bindings.append((body["metadata"]["name"], body["target"]["name"]))
        return {}


@dataclass
class Wave:
    """One scheduling wave's timings."""

    filter_s: list[float]
    prioritize_s: list[float]
    passing: list[int]
    failed: list[int]




async def run_waves(
    state: ClusterState,
    verbs: Verbs,
    names: list[str],
    on_node: dict[str, list[JSON]],
    shapes: tuple[Shape, ...],
    requests: int,
    ask_filter: Callable[[JSON, list[str]], Any],
    ask_prioritize: Callable[[JSON, list[str]], Any],
    serial_base: int,
    rng: random.Random,
) -> dict[str, Wave]:
    """Schedule ``requests`` pods of each shape as kube-scheduler would, timing filter and prioritize.

    After each pod: bind it to the best-scored node (the extender's bind, with the API stubbed),
    deliver the binding's watch event, and delete one running pod elsewhere (its watch event too).
    """
    waves: dict[str, Wave] = {}
    for number, shape in enumerate(shapes):
        wave = waves[shape.name] = Wave([], [], [], [])
        for i in range(requests):
            pod = new_pod(shape, serial_base + number * requests + i)
            pod["spec"]["schedulerName"] = SCHEDULER
            api = verbs.client
            assert isinstance(api, StubApi)
            api.pods[pod["metadata"]["name"]] = pod  # what bind reads back from the API
            start = time.perf_counter()
            passing = await ask_filter(pod, names)
            middle = time.perf_counter()
            scores = await ask_prioritize(pod, passing) if passing else {}
            end = time.perf_counter()
            wave.filter_s.append(middle - start)
            wave.prioritize_s.append(end - middle)
            wave.passing.append(len(passing))
            wave.failed.append(len(names) - len(passing))
            if passing:
                best = max(passing, key=lambda n: scores.get(n, 0))
                metadata = pod["metadata"]
                error = await verbs.bind(metadata["name"], metadata["namespace"], metadata["uid"], best)
                # Read once by bind; kept, 600 full pod objects would weigh on every full collection
                # as no part of the extender's own state does.
                api.pods.pop(metadata["name"], None)
                if not error:
                    pod["spec"]["nodeName"] = best
                    pod["status"]["phase"] = "Running"
                    state.pods.upsert(pod)
                    on_node.setdefault(best, []).append({"metadata": dict(pod["metadata"])})
            victim_node = names[rng.randrange(len(names))]
            if on_node.get(victim_node):
                victim = on_node[victim_node].pop(rng.randrange(len(on_node[victim_node])))
                state.pods.delete(victim)
    return waves


def summarize_waves(mode: str, waves: dict[str, Wave], nodes: int) -> list[JSON]:
    """Per mode: the steady requests (all but each shape's first) of both verbs as percentiles, and
    the first request of each wave shape as its values (too few for a percentile: the cold figure
    is the ``cold-shapes`` phase's, 120 shapes)."""
    steady_f = [v for w in waves.values() for v in w.filter_s[1:]]
    steady_p = [v for w in waves.values() for v in w.prioritize_s[1:]]
    records: list[JSON] = [
        {"bench": "latency", "mode": mode, "phase": "steady", "nodes": nodes,
         "filter": latency_stats(steady_f), "prioritize": latency_stats(steady_p)},
        {"bench": "latency", "mode": mode, "phase": "first-of-wave", "nodes": nodes,
         "filter_ms": {name: round(w.filter_s[0] * 1000, 2) for name, w in waves.items()},
         "prioritize_ms": {name: round(w.prioritize_s[0] * 1000, 2) for name, w in waves.items()}},
    ]
    records.append({
        "bench": "latency", "mode": mode, "phase": "shapes", "nodes": nodes,
        "shapes": {name: {"passing_nodes_median": statistics.median(w.passing),
                          "failing_nodes_median": statistics.median(w.failed)} for name, w in waves.items()},
    })
    return records


DEFAULT_SCORED_NODES = 500
"""What kube-scheduler sends an extender from 5,000 nodes by default (``percentageOfNodesToScore``
adapts to 10% there)."""


class CollectorPauses:
    """The garbage collector's pauses while a measurement runs, per generation (a source of p99s)."""

    def __init__(self) -> None:
        self.during = ""
        """What runs now: the pauses are counted against it."""
        self.pauses: dict[tuple[str, int], list[float]] = {}
        self._started = 0.0

    def __call__(self, phase: str, info: Mapping[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.setdefault((self.during, info["generation"]), []).append(time.perf_counter() - self._started)

    def summary(self) -> dict[str, JSON]:
        """Per generation and what ran: how many collections, the longest and the total, in ms."""
        return {f"{during or 'all'} gen{g}": {"n": len(p), "max_ms": round(max(p) * 1000, 1),
                                             "total_ms": round(sum(p) * 1000, 1)}
                for (during, g), p in sorted(self.pauses.items())}


@contextlib.contextmanager
def collector_pauses() -> Iterator[CollectorPauses]:
    """Record the collector's pauses during the ``with`` body."""
    pauses = CollectorPauses()
    gc.callbacks.append(pauses)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(pauses)


def _load() -> list[float]:
    return [round(v, 1) for v in os.getloadavg()]


def cold_pods(count: int, serial: int, offset: float = 0.0) -> list[JSON]:
    """``count`` pending pods, each of a shape of its own (its utilization; 1, 2 or 4 GPUs); another
    ``offset`` in [0, 1) gives shapes none of which the first call gave."""
    pods = []
    for i in range(count):
        shape = Shape(f"cold-{serial + i}", f"{0.05 + 0.6 * (i + offset) / count:.5f}", gpus=(1, 1, 2, 4)[i % 4])
        pod = new_pod(shape, serial + i)
        pod["spec"]["schedulerName"] = SCHEDULER
        pods.append(pod)
    return pods


@contextlib.contextmanager
def one_by_one(verbs: Verbs) -> Iterator[None]:
    """The baseline for cold filters: every node judged one by one, as before the bound index (the
    same cluster state, process and server; the index's verdicts are the same, property-tested)."""

    async def judged(cache: dict[str, Any], nodes: list[str], claims: PodClaims, choice: ClassChoice,
                     own: str | None, slicer: Slicer) -> tuple[Groups, dict[str, NodeVerdict]]:
        generation = verbs.state.ledger.generation
        fresh: dict[str, NodeVerdict] = {}
        memo = FilterMemo()
        for start in range(0, len(nodes), SLICE_NODES):
            await slicer.pause()
            part = nodes[start:start + SLICE_NODES]
            for node, verdict in zip(part, filter_nodes(verbs.state.ledger, part, claims, choice, memo), strict=True):
                fresh[node] = verdict
                if node != own:
                    cache[node] = (generation(node), verdict.verdict.value, verdict.message)
        return [], fresh

    verbs._verdicts_for = judged  # type: ignore[method-assign]
    try:
        yield
    finally:
        del verbs._verdicts_for


async def bench_latency(model: ClusterModel, requests: int, cold_requests: int = 120) -> list[JSON]:
    """Filter and prioritize latency in-process and over HTTPS; see the module docstring."""
    started = time.perf_counter()
    state, names, on_node = loaded_state(model)
    load_s = time.perf_counter() - started
    records: list[JSON] = [{
        "bench": "latency", "phase": "load", "nodes": len(names), "pods": state.ledger.pod_count(),
        "seconds": round(load_s, 1),
    }]
    rng = random.Random(7)

    # The first filter after a sync: the extender computes every node's summary once synced (as
    # extender/main.py does before it reports ready), so that time is reported on its own.
    start = time.perf_counter()
    state.ledger.warm()
    warm_ms = round((time.perf_counter() - start) * 1000, 1)
    freeze_collector()  # as the extender does once synced: a full collection no longer walks the state
    verbs = Verbs(state, StubApi())  # type: ignore[arg-type]
    start = time.perf_counter()
    await verbs.filter(new_pod(Shape("first", "0.05"), 0), names)
    records.append({"bench": "latency", "mode": "in-process", "phase": "first-after-sync",
                    "filter_ms": round((time.perf_counter() - start) * 1000, 1), "nodes": len(names),
                    "warm_ms": warm_ms, "load_average": _load()})

    async def filter_direct(pod: JSON, nodes: list[str]) -> list[str]:
        return (await verbs.filter(pod, nodes)).passing

    async def prioritize_direct(pod: JSON, nodes: list[str]) -> dict[str, int]:
        return await verbs.prioritize(pod, nodes)

    waves = await run_waves(state, verbs, names, on_node, NEW_POD_SHAPES, requests,
                            filter_direct, prioritize_direct, 100_000, rng)
    records += summarize_waves("in-process", waves, len(names))

    # Over HTTPS: a fresh Verbs (no cached verdict for any shape), the real app, TLS on loopback.
    verbs = Verbs(state, StubApi())  # type: ignore[arg-type]
    synced = asyncio.Event()
    synced.set()
    app = build_app(verbs, synced, Readiness(), CollectorRegistry())
    with tempfile.TemporaryDirectory(prefix="vramguard-bench-") as tmp:
        ca = create_ca("vramguard bench CA")
        files = write_serving_files(tmp, issue_serving_certificate(ca, dns_names=["localhost"],
                                                                     ip_addresses=["127.0.0.1"]))
        tls = load_server_tls(files.tls_cert, files.tls_key)
        client_tls = ssl.create_default_context(cafile=str(files.ca_cert))
        async with serve(app.operational, "127.0.0.1", 0, tls, operational=("127.0.0.1", 0),
                         native=app.verbs) as server, aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=client_tls, limit=1)
        ) as session:
            async def call(verb: str, pod: JSON, nodes: list[str]) -> Any:
                # What kube-scheduler sends with nodeCacheCapable: the Pod and the candidates' names.
                body = json.dumps({"Pod": pod, "Nodes": None, "NodeNames": nodes})
                async with session.post(f"{server.url}/{verb}", data=body,
                                        headers={"Content-Type": "application/json"}) as response:
                    response.raise_for_status()
                    return await response.json()

            async def filter_https(pod: JSON, nodes: list[str]) -> list[str]:
                result = await call("filter", pod, nodes)
                passing: list[str] = result["NodeNames"]
                return passing

            async def prioritize_https(pod: JSON, nodes: list[str]) -> dict[str, int]:
                return {entry["Host"]: entry["Score"] for entry in await call("prioritize", pod, nodes)}

            # The first filter this server answers, the first of its shape: what the scheduler's
            # first pod after the extender synced meets (its TLS session and connection are new).
            started = time.perf_counter()
            await filter_https(new_pod(Shape("first-https", "0.07"), 1), names)
            records.append({"bench": "latency", "mode": "https", "phase": "first-after-sync",
                            "filter_ms": round((time.perf_counter() - started) * 1000, 1), "nodes": len(names),
                            "load_average": _load()})
            waves = await run_waves(state, verbs, names, on_node, NEW_POD_SHAPES, requests,
                                    filter_https, prioritize_https, 200_000, rng)
            records += summarize_waves("https", waves, len(names))
            # Cold filters: each of these pods is the first of its shape, so no verdict is cached;
            # request by request, the served code and the baseline (every node judged one by one).
            for offset, (count, label) in enumerate(
                ((len(names), "all"), (min(len(names), DEFAULT_SCORED_NODES), "default"))
            ):
                cold: dict[str, list[float]] = {"indexed": [], "one-by-one": []}
                sizes: list[int] = []
                reasons: list[int] = []
                pods = cold_pods(2 * cold_requests, 600_000 + 10_000 * offset, offset / 2)
                with collector_pauses() as pauses:
                    for i, pod in enumerate(pods):
                        asked = names if count == len(names) else rng.sample(names, count)
                        mode = pauses.during = "indexed" if i % 2 == 0 else "one-by-one"
                        with contextlib.nullcontext() if mode == "indexed" else one_by_one(verbs):
                            started = time.perf_counter()
                            body = await call("filter", pod, asked)
                            cold[mode].append(time.perf_counter() - started)
                        if mode == "indexed":
                            sizes.append(len(json.dumps(body)))
                            reasons.append(len({*body["FailedNodes"].values(),
                                                *body["FailedAndUnresolvableNodes"].values()}))
                records.append({"bench": "latency", "mode": "https", "phase": "cold-shapes", "names": label,
                                "nodes": count, "filter": latency_stats(cold["indexed"]),
                                "baseline": latency_stats(cold["one-by-one"]),
                                "answer_bytes_median": statistics.median(sizes),
                                "distinct_reasons_median": statistics.median(reasons),
                                "distinct_reasons_max": max(reasons), "gc": pauses.summary(),
                                "load_average": _load()})
    problems = state.ledger.check_invariants()
    records.append({"bench": "latency", "phase": "invariants", "violations": len(problems),
                    "pods": state.ledger.pod_count()})
    return records


# --------------------------------------------------------------------------- event-loop lag

LAG_TICK_SECONDS = 0.001
LAG_ROUNDS = 12
"""Rounds of the 40 shapes per mode: the unsliced baseline's probe wakes only between requests
(about one wake-up in three), and its percentiles need 100 samples too."""


class LagProbe:
    """A task that sleeps 1 ms in a loop and records how late it wakes: the event loop's lag, as
    every other request, probe and watch on the loop feels it."""

    def __init__(self) -> None:
        self.overshoot_s: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(LAG_TICK_SECONDS)
            self.overshoot_s.append(max(0.0, time.perf_counter() - start - LAG_TICK_SECONDS))

    async def __aenter__(self) -> LagProbe:
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def lag_pods(count: int) -> list[JSON]:
    """Pods of ``count`` distinct shapes (utilization, GPU count), so each filter computes afresh."""
    rng = random.Random(11)
    pods = []
    for i in range(count):
        shape = Shape(f"lag-{i}", f"{rng.randrange(5, 70) / 100:.2f}", gpus=rng.choice((1, 1, 1, 2, 4)))
        pod = new_pod(shape, 300_000 + i)
        pod["spec"]["schedulerName"] = SCHEDULER
        pods.append(pod)
    return pods


async def bench_lag(model: ClusterModel, requests: int, rounds: int) -> list[JSON]:
    """Event-loop lag while filters (and prioritizes of the passing nodes) of new pod shapes run
    over every node: sliced (as served) against unsliced (the work in one piece), interleaved
    round by round so that both see the same machine load. Then the pathological pods."""
    state, names, _ = loaded_state(model)
    freeze_collector()  # as the extender does once its caches are synced
    await Verbs(state, None).filter(new_pod(Shape("warm", "0.05"), 0), names)  # node summaries
    pods = lag_pods(requests)
    lags: dict[str, list[float]] = {"sliced": [], "unsliced": []}
    filters: dict[str, list[float]] = {"sliced": [], "unsliced": []}
    for number in range(rounds):
        modes = ("sliced", "unsliced") if number % 2 == 0 else ("unsliced", "sliced")
        for mode in modes:
            verbs = Verbs(state, None, slice_seconds=SLICE_SECONDS if mode == "sliced" else None)
            async with LagProbe() as probe:
                for pod in pods:
                    start = time.perf_counter()
                    passing = (await verbs.filter(pod, names)).passing
                    filters[mode].append(time.perf_counter() - start)
                    await verbs.prioritize(pod, passing)
                    await asyncio.sleep(0)  # between two requests the server reads the next one
            lags[mode] += probe.overshoot_s
    records: list[JSON] = [
        {"bench": "lag", "mode": mode, "nodes": len(names), "requests": len(filters[mode]),
         "slice_ms": SLICE_SECONDS * 1000 if mode == "sliced" else None,
         "lag": latency_stats(lags[mode]), "filter": latency_stats(filters[mode])}
        for mode in ("sliced", "unsliced")
    ]
    verbs = Verbs(state, None)
    for name, containers, gpus in (("200x1000", 200, 1000), ("4x1000", 4, 1000)):
        pod = new_pod(Shape(f"huge-{name}", "0.10"), 400_000)
        template = pod["spec"]["containers"][0]
        pod["spec"]["containers"] = [
            {**template, "name": f"c{i}", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}
            for i in range(containers)
        ]
        start = time.perf_counter()
        outcome = await verbs.filter(pod, names)
        records.append({"bench": "lag", "phase": "pathological", "pod": name, "nodes": len(names),
                        "filter_ms": round((time.perf_counter() - start) * 1000, 1),
                        "unresolvable": len(outcome.unresolvable), "passing": len(outcome.passing)})
    return records


# --------------------------------------------------------------------------- scrapes

SCRAPE_MODES = ("quiet", "scrape-per-node", "scrape-per-gpu")


async def bench_scrape(model: ClusterModel, requests: int) -> list[JSON]:
    """Filter latency over HTTPS without and during a scrape (per node, per GPU), interleaved."""
    state, names, _ = loaded_state(model)
    freeze_collector()  # as the extender does once its caches are synced
    records: list[JSON] = []
    for per_gpu in (False, True):
        start_cpu = time.process_time()
        text = render_ledger_now(state, per_gpu=per_gpu)
        records.append({"bench": "scrape", "phase": "exposition", "per_gpu": per_gpu, "nodes": len(names),
                        "bytes": len(text), "series": sum(1 for line in text.splitlines() if not line.startswith(b"#")),
                        "render_cpu_ms": round((time.process_time() - start_cpu) * 1000, 1)})
    apps = {}
    for mode in SCRAPE_MODES:
        synced = asyncio.Event()
        synced.set()
        apps[mode] = build_app(Verbs(state, StubApi()), synced, Readiness(),  # type: ignore[arg-type]
                               CollectorRegistry(), per_gpu_metrics=mode == "scrape-per-gpu")
    timings: dict[str, list[float]] = {mode: [] for mode in SCRAPE_MODES}
    render_wall: dict[str, list[float]] = {"scrape-per-node": [], "scrape-per-gpu": []}
    with tempfile.TemporaryDirectory(prefix="vramguard-bench-") as tmp:
        ca = create_ca("vramguard bench CA")
        files = write_serving_files(tmp, issue_serving_certificate(ca, dns_names=["localhost"],
                                                                     ip_addresses=["127.0.0.1"]))
        tls = load_server_tls(files.tls_cert, files.tls_key)
        client_tls = ssl.create_default_context(cafile=str(files.ca_cert))
        async with contextlib.AsyncExitStack() as stack:
            servers = {mode: await stack.enter_async_context(
                serve(app.operational, "127.0.0.1", 0, tls, operational=("127.0.0.1", 0), native=app.verbs))
                for mode, app in apps.items()}
            verbs_session = await stack.enter_async_context(
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=client_tls, limit=1)))
            scrape_session = await stack.enter_async_context(
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=client_tls, limit=1)))

            async def filter_once(mode: str, serial: int) -> float:
                shape = NEW_POD_SHAPES[serial % len(NEW_POD_SHAPES)]
                pod = new_pod(shape, 500_000 + serial)
                pod["spec"]["schedulerName"] = SCHEDULER
                body = json.dumps({"Pod": pod, "Nodes": None, "NodeNames": names})
                started = time.perf_counter()
                async with verbs_session.post(f"{servers[mode].url}/filter", data=body,
                                              headers={"Content-Type": "application/json"}) as response:
                    response.raise_for_status()
                    await response.read()
                return time.perf_counter() - started

            async def scrape(mode: str) -> None:
                ops = servers[mode].operational
                assert ops is not None
                async with scrape_session.get(f"{ops.url}/metrics") as response:
                    response.raise_for_status()
                    await response.read()

            async def render(mode: str) -> None:
                started = time.perf_counter()
                await apps[mode].operational[LEDGER_EXPOSITION_KEY].render()
                render_wall[mode].append(time.perf_counter() - started)

            for mode in SCRAPE_MODES:  # a first rendering and the per-shape caches, untimed
                if mode != "quiet":
                    await render(mode)
                for serial in range(len(NEW_POD_SHAPES)):
                    await filter_once(mode, serial)
            render_wall = {mode: [] for mode in render_wall}
            for number in range(requests):
                order = SCRAPE_MODES if number % 2 == 0 else tuple(reversed(SCRAPE_MODES))
                for mode in order:
                    if mode == "quiet":
                        timings[mode].append(await filter_once(mode, number))
                        continue
                    # The scrape and the periodic rendering both under way when the filter arrives.
                    background = [asyncio.create_task(scrape(mode)), asyncio.create_task(render(mode))]
                    await asyncio.sleep(0)
                    timings[mode].append(await filter_once(mode, number))
                    await asyncio.gather(*background)
    quiet = latency_stats(timings["quiet"])
    for mode in SCRAPE_MODES:
        stats = latency_stats(timings[mode])
        record: JSON = {"bench": "scrape", "mode": mode, "nodes": len(names), "filter": stats}
        if mode != "quiet":
            record["p99_ratio_to_quiet"] = round(float(stats["p99_ms"]) / float(quiet["p99_ms"]), 2)
            record["render_sliced"] = latency_stats(render_wall[mode])
        records.append(record)
    return records


# --------------------------------------------------------------------------- memory


def memory_child(nodes: int, pods: int, traced: bool) -> JSON:
    """In a fresh interpreter: what the cluster state holds after the informers' lists are dropped."""
    model = ClusterModel(nodes, pods)
    gc.collect()
    if traced:
        tracemalloc.start()
    before = rss_bytes()
    state = ClusterState(default_policy())
    state.namespaces.replace(model.namespaces())
    node_list = model.node_objects()
    state.nodes.replace(node_list)
    del node_list
    pod_list = list(model.pod_objects())
    listed = rss_bytes()
    started = time.perf_counter()
    state.pods.replace(pod_list)
    relist_s = time.perf_counter() - started
    del pod_list
    gc.collect()
    result: JSON = {"nodes": len(list(state.node_names())), "pods": state.ledger.pod_count(),
                    "relist_pods_s": round(relist_s, 2)}
    if traced:
        held, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        result |= {"tracemalloc_held_bytes": held, "tracemalloc_peak_bytes": peak}
    else:
        result |= {"rss_delta_bytes": rss_bytes() - before, "list_rss_bytes": listed - before,
                   "peak_rss_bytes": peak_rss_bytes(), "rss_bytes": rss_bytes()}
    assert state.ledger.check_invariants() == [], "the model's pods overcommit a GPU"
    return result


def bench_memory(nodes: int, pods: int) -> list[JSON]:
    """Run :func:`memory_child` twice in fresh interpreters: RSS, then tracemalloc (which costs memory)."""
    merged: JSON = {"bench": "memory"}
    for traced in (False, True):
        out = subprocess.run(
            [sys.executable, "-m", "bench.extender", "--memory-child", f"{nodes},{pods},{int(traced)}"],
            check=True, capture_output=True, text=True, timeout=1800,
        )
        run = json.loads(out.stdout.strip().splitlines()[-1])
        if traced:
            # tracemalloc slows every allocation down: only its heap figures are kept, no timing.
            run = {k: v for k, v in run.items() if k.startswith("tracemalloc_")}
        merged |= run
    mib = 1 << 20
    merged["rss_delta_mib"] = round(merged["rss_delta_bytes"] / mib, 1)
    merged["tracemalloc_held_mib"] = round(merged["tracemalloc_held_bytes"] / mib, 1)
    merged["peak_rss_mib"] = round(merged["peak_rss_bytes"] / mib, 1)
    merged["rss_mib"] = round(merged["rss_bytes"] / mib, 1)
    merged["bytes_per_pod"] = round(merged["tracemalloc_held_bytes"] / max(1, merged["pods"]))
    return [merged]


# --------------------------------------------------------------------------- tls


def bench_handshakes(rounds: int) -> list[JSON]:
    """Server-side CPU per TLS handshake, with and without a client certificate required,
    alternated handshake by handshake over loopback (a client thread, the server in this one)."""
    import socket  # noqa: PLC0415
    import threading  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="vramguard-bench-tls-") as tmp:
        directory = Path(tmp)
        ca = create_ca("vramguard bench CA")
        files = write_serving_files(directory, issue_serving_certificate(ca, dns_names=["localhost"]))
        client = issue_client_certificate(ca, "kube-scheduler")
        (directory / "client.crt").write_bytes(client.cert_pem())
        (directory / "client.key").write_bytes(client.key_pem())
        servers = {
            "mutual": load_server_tls(files.tls_cert, files.tls_key, files.ca_cert).context,
            "server-only": load_server_tls(files.tls_cert, files.tls_key).context,
        }
        context = ssl.create_default_context(cafile=str(files.ca_cert))
        context.load_cert_chain(directory / "client.crt", directory / "client.key")
        order = [mode for _ in range(rounds) for mode in servers]
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(30.0)  # a client thread that died never connects: fail, do not wait forever

        def connect() -> None:
            for _ in order:
                with socket.create_connection(listener.getsockname()) as raw, context.wrap_socket(
                    raw, server_hostname="localhost"
                ) as conn:
                    conn.sendall(b"x")
                    conn.recv(1)

        cpu: dict[str, list[float]] = {mode: [] for mode in servers}
        thread = threading.Thread(target=connect, daemon=True)
        thread.start()
        with listener:
            for mode in order:
                raw, _ = listener.accept()
                started = time.thread_time()
                with servers[mode].wrap_socket(raw, server_side=True) as conn:
                    conn.recv(1)
                    conn.sendall(b"x")
                    cpu[mode].append(time.thread_time() - started)
        thread.join()
    return [{"bench": "tls", "phase": "handshake", "mode": mode, "server_cpu": latency_stats(values),
             "openssl": ssl.OPENSSL_VERSION} for mode, values in cpu.items()]


# --------------------------------------------------------------------------- verbs


async def bench_verbs(nodes: int = 500, pods: int = 1000, names: int = 230) -> list[JSON]:
    """:func:`Verbs.filter`, ``prioritize`` and ``bind`` and the bound pod's watch event, per pod of a
    wave, in this process (see the module docstring)."""
    import orjson  # noqa: PLC0415

    state = ClusterState(default_policy())
    state.nodes.replace([slim_node(gpu_node(i, 1)) for i in range(nodes)])
    state.namespaces.replace([{"metadata": {"name": "bench"}}])
    state.pods.replace([])
    state.ledger.warm()
    node_names = [node_name(i) for i in range(nodes)]
    api = StubApi()
    verbs = Verbs(state, api)  # type: ignore[arg-type]
    cpu: dict[str, list[float]] = {"filter": [], "prioritize": [], "bind": [], "watch_event": []}
    for i in range(pods):
        pod = gpu_pod(f"wave-{i:05d}", "bench", f"wave-uid-{i}", "0.20")
        pod["spec"]["schedulerName"] = SCHEDULER
        api.pods[pod["metadata"]["name"]] = pod
        asked = [node_names[(i * 7 + k) % nodes] for k in range(names)]  # the scheduler's rotating start
        started = time.process_time()
        outcome = await verbs.filter(pod, asked)
        cpu["filter"].append(time.process_time() - started)
        started = time.process_time()
        scores = await verbs.prioritize(pod, outcome.passing)
        cpu["prioritize"].append(time.process_time() - started)
        best = max(scores, key=lambda node: scores[node])
        started = time.process_time()
        error = await verbs.bind(pod["metadata"]["name"], "bench", pod["metadata"]["uid"], best)
        cpu["bind"].append(time.process_time() - started)
        if error:
            raise RuntimeError(f"bind refused in the verbs benchmark: {error}")
        event = orjson.dumps({"type": "ADDED", "object": {**pod, "spec": {**pod["spec"], "nodeName": best}}})
        started = time.process_time()
        state.pods.upsert(slim_pod(orjson.loads(event)["object"]))
        cpu["watch_event"].append(time.process_time() - started)
    if state.ledger.check_invariants():
        raise RuntimeError("the verbs benchmark overcommitted a GPU")
    return [{"bench": "verbs", "nodes": nodes, "pods": pods, "names": names,
             **{step: latency_stats(values) for step, values in cpu.items()},
             "mean_ms_per_pod": round(1000 * sum(map(sum, cpu.values())) / pods, 3)}]


# --------------------------------------------------------------------------- throughput


def build_floor(out_dir: Path) -> Path:
    """Build the floor extender (:data:`FLOOR_SOURCE`) into ``out_dir``; return the executable."""
    binary = out_dir / "floor-extender"
    subprocess.run(["go", "build", "-o", str(binary), "."], cwd=FLOOR_SOURCE, check=True)
    return binary


def hami_wiring(work_dir: Path, source: Path | None, extra: Sequence[str] = ()) -> tuple[list[str], Path, JSON]:
    """What ``--extender hami`` starts the cluster with: the extender command (the launcher and HAMi's
    flags, the harness appending its own), a manifests tree whose second scheduler is wired to HAMi,
    and the figures every record of the run carries (HAMi's release and flags)."""
    from bench.hami import peer  # noqa: PLC0415
    from e2e import services as e2e_services  # noqa: PLC0415

    if source is None:
        source = peer.fetch_source(HAMI_CACHE)
    binary, version = peer.build_hami(source.resolve(), work_dir / "hami-build")
    device_config = work_dir / "hami-device-config.yaml"
    device_config.write_text(peer.device_config())
    flags = [f"--kube-qps={peer.KUBE_QPS}", f"--kube-burst={peer.KUBE_BURST}",
             f"--node-lock-timeout={peer.NODE_LOCK_TIMEOUT}", *extra]
    command = [sys.executable, str(HAMI_LAUNCHER), "--binary", str(binary), "--device-config", str(device_config),
               *(f"--hami-arg={flag}" for flag in flags)]
    like = e2e_services.load_yaml(e2e_services.SECOND_SCHEDULER_CONFIG)
    manifests = peer.write_manifests(work_dir / "hami-manifests", like)
    return command, manifests, {"hami_version": version, "hami_flags": flags}


def _hami_nodes_and_pods() -> tuple[Callable[[str], dict[str, str]], dict[str, str]]:
    """HAMi's node annotations for a throughput node (its one GPU shared by the replicas the node
    advertises), and the extended resources of a wave's pod (the VRAM vLLM reserves on it)."""
    from bench.hami import peer  # noqa: PLC0415
    from e2e import gpu_nodes  # noqa: PLC0415

    model = gpu_nodes.gpu_model(WAVE_GPU_MODEL)

    def annotate(name: str) -> dict[str, str]:
        return peer.node_annotations(name, gpus=1, count=WAVE_REPLICAS, devmem_mib=model.memory_mib,
                                     product=model.nvml_name)

    return annotate, peer.pod_resources(WAVE_UTILIZATION, model.memory_mib)


HAMI_REGISTER_SECONDS = 900.0
"""How long HAMi may take to register the devices of new nodes (it does on node events and every
15 s; 1,000 nodes took half a minute on 2 cores: a first pass patches every node)."""


def _hami_pid(ops_url: str) -> int:
    """HAMi's process id, from the launcher's ops listener."""
    with urllib.request.urlopen(f"{ops_url}/pid", timeout=10) as response:
        return int(response.read().decode())


async def _hami_registered(ops_url: str, names: list[str], *, timeout_s: float) -> None:
    """Wait until HAMi has registered the devices of every node of ``names`` (it does on node events
    and every 15 s): a wave must not start while some nodes are still unknown to it."""
    from bench.hami import peer  # noqa: PLC0415

    def fetch() -> str:
        # HAMi answers /metrics from the state its registration pass updates: slow while it runs.
        try:
            with urllib.request.urlopen(f"{ops_url}/metrics", timeout=150) as response:
                return str(response.read().decode())
        except (OSError, TimeoutError):
            return ""

    wanted, deadline = set(names), time.monotonic() + timeout_s
    while True:
        missing = wanted - peer.registered_nodes(await asyncio.to_thread(fetch))
        if not missing:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"HAMi registered no devices on {len(missing)} of {len(wanted)} nodes "
                               f"in {timeout_s:.0f} s (e.g. {sorted(missing)[:3]})")
        await asyncio.sleep(1.0)


def process_memory(pid: int) -> JSON:
    """A process's resident memory now and at its peak (``VmRSS``, ``VmHWM``), in MiB."""
    try:
        fields = proc_status(pid)
    except OSError:
        fields = {}
    mib = {name: round(value / MIB, 1) for name, value in fields.items()}
    return {"rss_mib": mib.get("VmRSS"), "peak_rss_mib": mib.get("VmHWM")}


HAMI_LOG_LINES = {
    "filters": '"Starting schedule filter process"',
    "filters_without_fit": '"No available nodes meet the required scores"',
    "binds": '"Attempting to bind pod to node"',
    "binds_done": '"Successfully bound pod to node"',
    "node_lock_failures": '"Failed to lock node"',
    "bind_failures": '"Failed to bind pod"',
}
"""HAMi's log lines (``pkg/scheduler/scheduler.go``, at its default verbosity) counted after a run."""


def hami_log_counts(path: Path) -> JSON:
    """How often each of :data:`HAMI_LOG_LINES` appears in HAMi's log: the filters and binds it
    served, and the binds it failed (a node lock held by another pod: the pod is scheduled again)."""
    counts = dict.fromkeys(HAMI_LOG_LINES, 0)
    with contextlib.suppress(OSError), path.open(errors="replace") as log:
        for line in log:
            for key, marker in HAMI_LOG_LINES.items():
                if marker in line:
                    counts[key] += 1
    return counts


def bench_throughput(nodes: int, pods: int, repeats: int, work_dir: Path, timeout_s: float, *,
                     webhook: bool, verbs: list[str] | None = None, start: str = "pause",
                     extender: str = "vramguard", hami_source: Path | None = None,
                     hami_args: Sequence[str] = ()) -> list[JSON]:
    """Pods/s onto the real control plane, the stock scheduler and the extender's alternated on one
    cluster; see the module docstring.

    Both schedulers run side by side with the same client settings (``e2e.services``'s second
    scheduler layout): ``default-scheduler`` without the extender, ``vramguard`` with it. Waves
    alternate (stock first in even repeats, the extender's first in odd ones), so both see the same
    machine load. ``webhook``: start the admission webhook too; by default the extender runs alone.
    ``verbs``: configure the extender's scheduler to call only these (what each verb costs a wave);
    ``None``: as shipped. ``start``: how each wave starts (:class:`WaveGate`). ``extender``:
    ``floor`` runs the floor extender in the extender's place (no webhook), ``floor-h2`` the same
    offering HTTP/2; ``hami`` HAMi's scheduler extender (no webhook), built from ``hami_source``
    and given ``hami_args`` as extra flags (see :mod:`bench.hami`).
    """
    # Imported here: the e2e harness is only needed for this part.
    from e2e import services as e2e_services  # noqa: PLC0415
    from e2e.cluster import Cluster, ClusterConfig  # noqa: PLC0415

    work_dir.mkdir(parents=True, exist_ok=True)
    manifests = e2e_services.MANIFESTS
    peer: JSON = {}
    if extender.startswith("floor"):
        command: list[str] | None = [str(build_floor(work_dir)), *(["--http2"] if extender == "floor-h2" else [])]
    elif extender == "hami":
        command, manifests, peer = hami_wiring(work_dir, hami_source, hami_args)
    else:
        command = None if webhook else [sys.executable, "-c", EXTENDER_ONLY]
    records: list[JSON] = []
    cluster = Cluster(ClusterConfig(directory=work_dir / "throughput", second_scheduler=True, vramguard="auto",
                                    vramguard_command=command, extender_verbs=verbs, manifests=manifests))
    cluster.start()
    with cluster:
        services = sorted((cluster.state.vramguard if cluster.state else {}).keys())
        if "extender" not in services:
            raise RuntimeError("the extender did not start (`vramguard extender --help` failed)")
        pids = {proc.record.name: proc.record.pid for proc in cluster.processes} | {"bench client": os.getpid()}
        extender_pid = pids.get("vramguard-extender")
        nodes_ready: Callable[[list[str]], Awaitable[None]] | None = None
        annotate: Callable[[str], dict[str, str]] | None = None
        resources: dict[str, str] | None = None
        if extender == "hami":
            # The launcher only translates the command line: HAMi's own process is measured.
            pids.pop("vramguard-extender", None)
            extender_pid = pids["hami-scheduler"] = _hami_pid(cluster.ops_url("extender"))
            nodes_ready = functools.partial(_hami_registered, cluster.ops_url("extender"),
                                            timeout_s=HAMI_REGISTER_SECONDS)
            annotate, resources = _hami_nodes_and_pods()
        schedulers = {
            "kube-scheduler": ("default-scheduler", pids.get("kube-scheduler")),
            "kube-scheduler + extender": (e2e_services.SECOND_SCHEDULER_NAME, pids.get("vramguard-scheduler")),
        }
        if start == "pause" and not all(pid for _, pid in schedulers.values()):
            raise RuntimeError("a kube-scheduler process to pause is missing; no wave would start all at once")
        runs = asyncio.run(_alternate(cluster.kubeconfig, nodes, pods, repeats, timeout_s, schedulers,
                                      lambda: cpu_seconds(pids), start, annotate=annotate,
                                      nodes_ready=nodes_ready, extender_resources=resources))
        shipped = "shipped" if verbs is None else ",".join(verbs)
        for run in runs:
            records.append({"bench": "throughput", "extender": extender, "vramguard_services": services,
                            "extender_verbs": shipped, **peer, **run})
        if extender_pid is not None:
            records.append({"bench": "throughput", "phase": "extender-memory", "extender": extender, "nodes": nodes,
                            "pods": pods, "pid": extender_pid, **process_memory(extender_pid)})
        # The extender's own view of its verbs, over every wave it served, and the schedulers' view
        # of their cycles: where the extender's share of a scheduling cycle goes.
        verb_ms: dict[str, float] = {}
        if extender == "hami":
            records.append({"bench": "throughput", "phase": "hami-log", "extender": extender, "nodes": nodes,
                            "pods": pods, **peer, **hami_log_counts(cluster.logs / "vramguard-extender.log")})
        else:
            figures = _verb_figures(cluster.ops_url("extender"), cluster.ssl_context())
            verb_ms = figures["mean_ms"]
            records.append({"bench": "throughput", "phase": "extender-verbs", "extender": extender, "nodes": nodes,
                            "pods": pods, "extender_verbs": shipped, **figures})
        state = cluster.state
        assert state is not None
        for process, label in (("kube-scheduler", "kube-scheduler"),
                               ("vramguard-scheduler", "kube-scheduler + extender")):
            cycle = _scheduling_cycle(state.scheduler_ports[process], state.admin_token)
            if label.endswith("extender") and cycle.get("algorithm_ms"):
                # What the scheduler's own filter and score plugins do not account for is the
                # extender's filter and prioritize round trips (prioritize overlaps the score plugins).
                cycle["extender_round_trips_ms"] = round(
                    cycle["algorithm_ms"] - cycle.get("filter_plugins_ms", 0.0) - cycle.get("score_plugins_ms", 0.0), 2)
                if verb_ms:
                    cycle["extender_handlers_ms"] = round(
                        verb_ms.get("filter", 0.0) + verb_ms.get("prioritize", 0.0), 2)
            records.append({"bench": "throughput", "phase": "cycle", "extender": extender, "scheduler": label,
                            "nodes": nodes, "pods": pods, "extender_verbs": shipped, **cycle})
    rates = {name: [r["pods_per_s"] for r in runs if r["scheduler"] == name and r.get("pods_per_s")]
             for name in schedulers}
    if all(rates.values()):
        stock = statistics.median(rates["kube-scheduler"])
        extended = statistics.median(rates["kube-scheduler + extender"])
        per_repeat = [round(e / s, 2) for s, e in zip(rates["kube-scheduler"], rates["kube-scheduler + extender"],
                                                      strict=False)]
        records.append({"bench": "throughput", "phase": "ratio", "extender": extender, "nodes": nodes, "pods": pods,
                        "extender_verbs": shipped, **peer, "wave_start": start, "repeats": repeats,
                        "stock_pods_per_s_median": stock,
                        "extender_pods_per_s_median": extended, "ratio": round(extended / stock, 2),
                        "ratio_median_of_repeats": statistics.median(per_repeat), "ratios_per_repeat": per_repeat})
    return records


def side_by_side(records: list[JSON]) -> JSON:
    """The extenders of one throughput run side by side: each one's rate against the stock
    kube-scheduler of its own cluster (the median of the repeats' ratios, each wave alternated with
    a stock one), and vramguard's over each other's: the share of the floor's rate it keeps on the
    same transport, and against the peer."""
    ratios = {r["extender"]: r["ratio_median_of_repeats"] for r in records
              if r.get("bench") == "throughput" and r.get("phase") == "ratio"}
    record: JSON = {"bench": "throughput", "phase": "side-by-side", "ratio_to_stock": ratios,
                    "skipped": [r["extender"] for r in records if r.get("phase") == "skipped"]}
    if "vramguard" in ratios:
        record["vramguard_over"] = {name: round(ratios["vramguard"] / ratio, 2)
                                    for name, ratio in ratios.items() if name != "vramguard" and ratio}
    return record


HAMI_FILTER_SIZES = (500, 5000)
"""The node-name counts HAMi's filter is timed with (``--only hami-filter``)."""


def bench_hami_filter(work_dir: Path, hami_source: Path | None, hami_args: Sequence[str] = (), *,
                      nodes: int = 5000, sizes: Sequence[int] = HAMI_FILTER_SIZES, requests: int = 60,
                      timeout_s: float = 240.0) -> list[JSON]:
    """HAMi's filter latency over its HTTPS, for ``sizes`` node names out of ``nodes`` annotated
    nodes (as the throughput part annotates them), alternated request by request; then HAMi's
    resident memory.

    HAMi runs as in the throughput part (:func:`hami_wiring`) on the same local control plane,
    with no wave: the requests come from this process over one kept-alive connection with
    kube-scheduler's client certificate, each for a pending pod of its own (HAMi's filter writes
    its choice to the pod's annotations through the API server, so the pod must exist, and records
    the pod's GPU memory, so the nodes fill as the requests go). The body is what kube-scheduler
    sends a ``nodeCacheCapable`` extender: the pod and ``NodeNames``. The first request of each size
    is reported apart (``first_ms``). No pod runs on the nodes beforehand: what HAMi's filter costs
    with the nodes alone, unlike the latency part's 50,000 running pods."""
    from e2e.cluster import Cluster, ClusterConfig  # noqa: PLC0415

    work_dir.mkdir(parents=True, exist_ok=True)
    command, manifests, peer = hami_wiring(work_dir, hami_source, hami_args)
    cluster = Cluster(ClusterConfig(directory=work_dir / "hami-filter", second_scheduler=True, vramguard="auto",
                                    vramguard_command=command, manifests=manifests, timeout=timeout_s))
    cluster.start()
    with cluster:
        state = cluster.state
        assert state is not None
        ops = cluster.ops_url("extender")
        pid = _hami_pid(ops)
        records = asyncio.run(_hami_filter_requests(cluster.kubeconfig, state.vramguard["extender"],
                                                    cluster.client_ssl_context(), ops, nodes, sizes, requests))
        records.append({"bench": "hami-filter", "phase": "memory", "nodes": nodes, "pid": pid,
                        **process_memory(pid)})
    return [{**record, **peer} for record in records]


async def _hami_filter_requests(kubeconfig: Path, url: str, context: ssl.SSLContext, ops: str, nodes: int,
                                sizes: Sequence[int], requests: int) -> list[JSON]:
    """:func:`bench_hami_filter` once the cluster is up."""
    from vramguard.io.kube import KubeClient, load_connection  # noqa: PLC0415

    client = KubeClient(load_connection(str(kubeconfig)))
    namespace = "bench"
    names = [f"bench-gpu-{i:04d}" for i in range(nodes)]
    annotate, resources = _hami_nodes_and_pods()
    limit = asyncio.Semaphore(32)

    async def bounded(call: Awaitable[Any]) -> Any:
        async with limit:
            return await call

    try:
        await client.create("/api/v1/namespaces", {"metadata": {"name": namespace}})
        started = time.monotonic()
        await asyncio.gather(*(bounded(_create_node(client, n, False, annotate)) for n in names))
        created_s = time.monotonic() - started
        await _hami_registered(ops, names, timeout_s=HAMI_REGISTER_SECONDS)
        registered_s = time.monotonic() - started - created_s
        # Pending pods of a scheduler that does not exist: nothing but these requests touches them.
        text = json.dumps(wave_pod(namespace, "hami-filter-bench", resources))

        async def create_pod(i: int) -> JSON:
            body = json.loads(text)
            body["metadata"]["name"] = f"filter-{i:05d}"
            created: JSON = await client.create(f"/api/v1/namespaces/{namespace}/pods", body)
            return created

        pods = await asyncio.gather(*(bounded(create_pod(i)) for i in range(requests * len(sizes))))
        times: dict[int, list[float]] = {size: [] for size in sizes}
        errors: dict[int, list[str]] = {size: [] for size in sizes}
        answer_bytes: dict[int, list[int]] = {size: [] for size in sizes}
        connector = aiohttp.TCPConnector(ssl=context, limit=1)
        async with aiohttp.ClientSession(connector=connector) as session:
            for i, pod in enumerate(pods):
                size = sizes[i % len(sizes)]
                body = json.dumps({"Pod": pod, "NodeNames": names[:size]}).encode()
                begun = time.perf_counter()
                async with session.post(f"{url}/filter", data=body,
                                        headers={"Content-Type": "application/json"}) as response:
                    raw = await response.read()
                times[size].append(time.perf_counter() - begun)
                answer_bytes[size].append(len(raw))
                answer = json.loads(raw)
                chosen = answer.get("NodeNames") or answer.get("nodenames") or []
                if response.status != 200 or answer.get("Error") or len(chosen) != 1 or chosen[0] not in names[:size]:
                    errors[size].append(f"{response.status} {raw[:200]!r}")
        records: list[JSON] = [{"bench": "hami-filter", "phase": "setup", "nodes": nodes, "create_nodes_s":
                                round(created_s, 1), "registered_after_s": round(registered_s, 1)}]
        for size in sizes:
            first, *steady = times[size]
            records.append({"bench": "hami-filter", "phase": "filter", "nodes": nodes, "names": size,
                            "first_ms": round(first * 1000, 2), "filter": latency_stats(steady),
                            "answer_bytes_median": statistics.median(answer_bytes[size]),
                            "errors": len(errors[size]), "error_examples": errors[size][:3]})
        return records
    finally:
        await client.close()


def cpu_seconds(pids: Mapping[str, int]) -> dict[str, float]:
    """CPU time (user + system) each process has used so far, from ``/proc/<pid>/stat``."""
    tick = os.sysconf("SC_CLK_TCK")
    used = {}
    for name, pid in pids.items():
        with contextlib.suppress(OSError):
            raw = Path(f"/proc/{pid}/stat").read_text()
            fields = raw[raw.rfind(")") + 2:].split()
            used[name] = (int(fields[11]) + int(fields[12])) / tick
    return used


@dataclass
class WaveGate:
    """How a wave's pods are kept from the scheduler until all of them exist, then let through.

    ``pause`` (the default) stops the wave's kube-scheduler process (``SIGSTOP``) while its pods
    are created on schedulable nodes and resumes it (``SIGCONT``): every node is a candidate from
    the first pod on. ``uncordon`` creates the pods while every node is cordoned and uncordons them
    (one PATCH per node): nodes become candidates over the seconds the PATCHes take, so a fast wave
    sees fewer candidates per pod than a slow one, which favours the faster scheduler."""

    mode: str
    nodes: list[str]
    patch: Callable[[str, bool], Any]
    pid: int | None = None

    async def hold(self) -> None:
        if self.mode == "pause" and self.pid is not None:
            os.kill(self.pid, signal.SIGSTOP)

    async def open(self) -> None:
        if self.mode == "pause":
            if self.pid is not None:
                os.kill(self.pid, signal.SIGCONT)
        else:
            await asyncio.gather(*(self.patch(n, False) for n in self.nodes))

    async def close(self) -> None:
        if self.mode == "pause":
            if self.pid is not None:
                os.kill(self.pid, signal.SIGCONT)  # never left stopped, whatever happened
        else:
            await asyncio.gather(*(self.patch(n, True) for n in self.nodes))


WAVE_STARTS = ("pause", "uncordon")


async def _alternate(kubeconfig: Path, nodes: int, pods: int, repeats: int, timeout_s: float,
                     schedulers: Mapping[str, tuple[str, int | None]], cpu: Callable[[], dict[str, float]],
                     start: str = "pause", *, annotate: Callable[[str], dict[str, str]] | None = None,
                     nodes_ready: Callable[[list[str]], Awaitable[None]] | None = None,
                     extender_resources: Mapping[str, str] | None = None) -> list[JSON]:
    """Create the nodes once, then ``repeats`` waves per scheduler, alternating which goes first.
    ``schedulers``: label -> (scheduler name, the pid of the kube-scheduler serving it);
    ``start``: how a wave starts (:class:`WaveGate`). ``annotate``: more annotations for a node by
    name; ``nodes_ready``: awaited with the node names once they exist, before anything is measured;
    ``extender_resources``: more extended resources for each pod of the extender's waves."""
    from vramguard.io.kube import KubeClient, load_connection  # noqa: PLC0415

    client = KubeClient(load_connection(str(kubeconfig)))
    namespace = "bench"
    names = [f"bench-gpu-{i:04d}" for i in range(nodes)]
    limit = asyncio.Semaphore(32)

    async def bounded(call: Any) -> Any:
        async with limit:
            return await call

    async def patch(name: str, unschedulable: bool) -> None:
        await bounded(client.patch(f"/api/v1/nodes/{name}", {"spec": {"unschedulable": unschedulable}}))

    try:
        await client.create("/api/v1/namespaces", {"metadata": {"name": namespace}})

        # Uncordon waves: cordoned nodes, so every pod of a wave is created and pending before any
        # can be scheduled. Pause waves: schedulable nodes, the wave's scheduler stopped instead.
        await asyncio.gather(*(bounded(_create_node(client, n, start == "uncordon", annotate)) for n in names))
        if nodes_ready is not None:
            await nodes_ready(names)
        # What the control plane burns with nothing to schedule (watches, leases, housekeeping):
        # a slower wave accrues more of it, so it is reported to read the per-pod figures against.
        idle_before, idle_started = cpu(), time.monotonic()
        await asyncio.sleep(IDLE_SAMPLE_SECONDS)
        idle_after, idle_s = cpu(), time.monotonic() - idle_started
        runs: list[JSON] = [{"scheduler": "idle", "seconds": round(idle_s, 1), "cpu_ms_per_s": {
            name: round(1000 * (idle_after[name] - idle_before[name]) / idle_s, 2)
            for name in idle_after if name in idle_before}}]
        for repeat in range(repeats):
            order = list(schedulers.items())
            if repeat % 2:
                order.reverse()
            for label, (scheduler_name, pid) in order:
                gate = WaveGate(start, names, patch, pid)
                extended = label != "kube-scheduler"
                result = await _wave(client, namespace, pods, scheduler_name, timeout_s, gate, bounded,
                                     cpu, prefix=f"chat-{repeat}{'se'[extended]}",
                                     resources=extender_resources if extended else None)
                runs.append({"scheduler": label, "repeat": repeat, "wave_start": start, **result})
                print(f"throughput {label} repeat {repeat}: {result.get('pods_per_s')} pods/s "
                      f"({result['bound']}/{pods} bound)", file=sys.stderr, flush=True)
        return runs
    finally:
        await client.close()


async def _create_node(client: Any, name: str, unschedulable: bool,
                       annotate: Callable[[str], dict[str, str]] | None = None) -> None:
    """One throughput node (a time-sliced H100, :data:`WAVE_REPLICAS` replicas) with its status, as a
    kubelet and the device plugin would report it; ``annotate``: more annotations by node name."""
    from e2e import gpu_nodes  # noqa: PLC0415

    spec = gpu_nodes.time_sliced(name, WAVE_GPU_MODEL, gpus=1, replicas=WAVE_REPLICAS)
    manifest = gpu_nodes.node_manifest(spec)
    manifest.setdefault("spec", {})["unschedulable"] = unschedulable
    if annotate is not None:
        manifest["metadata"].setdefault("annotations", {}).update(annotate(name))
    await client.create("/api/v1/nodes", manifest)
    await client.request("PUT", f"/api/v1/nodes/{name}/status", {**manifest, "status": gpu_nodes.node_status(spec)})


async def _wave(client: Any, namespace: str, pods: int, scheduler_name: str,
                timeout_s: float, gate: WaveGate, bounded: Callable[[Any], Any],
                cpu: Callable[[], dict[str, float]], prefix: str = "chat",
                resources: Mapping[str, str] | None = None) -> JSON:
    """One wave: ``pods`` pending pods of ``scheduler_name`` let through at once (``gate``), pods/s
    from the first binding to the last; then the placement checked, the gate closed and the pods
    deleted. ``cpu_ms_per_pod``: each component's CPU time from the start to the last binding, per pod.
    ``resources``: extended resources each pod's container asks for besides its GPU (limits and requests)."""
    template = wave_pod(namespace, scheduler_name, resources)
    text = json.dumps(template)

    async def create_pod(i: int) -> None:
        body = json.loads(text)
        body["metadata"]["name"] = f"{prefix}-{i:05d}"
        await client.create(f"/api/v1/namespaces/{namespace}/pods", body)

    await gate.hold()
    try:
        return await _gated_wave(client, namespace, pods, timeout_s, gate, bounded, cpu, prefix, create_pod)
    finally:
        await gate.close()


def wave_pod(namespace: str, scheduler_name: str, resources: Mapping[str, str] | None = None) -> JSON:
    """The pod every wave creates (named per wave): a vLLM pod of :data:`WAVE_UTILIZATION` on one GPU,
    for ``scheduler_name``, its container asking for ``resources`` too (limits and requests)."""
    template = gpu_pod("x", namespace, "x", WAVE_UTILIZATION)
    for key in ("uid", "resourceVersion", "creationTimestamp", "ownerReferences", "managedFields"):
        template["metadata"].pop(key, None)
    template.pop("status", None)
    template["spec"]["schedulerName"] = scheduler_name
    for container in template["spec"]["containers"]:
        if "nvidia.com/gpu" in (container.get("resources") or {}).get("limits", {}):
            container["resources"]["limits"].update(resources or {})
            container["resources"]["requests"].update(resources or {})
    return template


async def _gated_wave(client: Any, namespace: str, pods: int, timeout_s: float, gate: WaveGate,
                      bounded: Callable[[Any], Any], cpu: Callable[[], dict[str, float]], prefix: str,
                      create_pod: Callable[[int], Awaitable[None]]) -> JSON:
    """:func:`_wave` once the gate holds the pods back."""
    created = time.monotonic()
    await asyncio.gather(*(bounded(create_pod(i)) for i in range(pods)))
    create_s = time.monotonic() - created
    listed = await client.get(f"/api/v1/namespaces/{namespace}/pods", {"limit": "1"})
    version = str(listed["metadata"]["resourceVersion"])

    bound_at: dict[str, float] = {}
    done = asyncio.Event()

    path = f"/api/v1/namespaces/{namespace}/pods"

    def seen(pod: JSON) -> None:
        # Named per wave: a pod of an earlier wave still being deleted is not counted.
        name = pod["metadata"]["name"]
        if name.startswith(prefix + "-") and (pod.get("spec") or {}).get("nodeName"):
            bound_at.setdefault(name, time.monotonic())
        if len(bound_at) >= pods:
            done.set()

    async def watch() -> None:
        since = version
        while not done.is_set():
            with contextlib.suppress(ApiError, aiohttp.ClientError, TimeoutError):
                async for kind, pod in client.watch(path, since):
                    if kind == "ERROR":  # expired: list again
                        break
                    since = str((pod.get("metadata") or {}).get("resourceVersion") or since)
                    if kind != "BOOKMARK":
                        seen(pod)
                    if done.is_set():
                        return
            # The watch ended: closed by the API server (a client that falls behind thousands of
            # events is cut off), expired, or timed out. Catch up with a list and watch from there.
            items, since = await client.list_all(path)
            for pod in items:
                seen(pod)

    watcher = asyncio.create_task(watch())
    started = time.monotonic()
    cpu_before = cpu()
    await gate.open()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), timeout_s)
    cpu_after = cpu()
    # Work a wave leaves behind (the scheduler's Events, the watches' fan-out of the last bindings)
    # lands after its last binding, most of it for a fast wave: counted over a fixed tail, the same
    # for both schedulers, so the two totals compare.
    await asyncio.sleep(SETTLE_SECONDS)
    cpu_settled = cpu()
    watcher.cancel()
    times = sorted(bound_at.values())

    def per_pod(until: Mapping[str, float]) -> dict[str, float]:
        return {name: round(1000 * (until[name] - cpu_before[name]) / max(1, len(times)), 2)
                for name in until if name in cpu_before}

    result: JSON = {"nodes": len(gate.nodes), "pods": pods, "bound": len(times), "create_s": round(create_s, 1),
                    "cpu_ms_per_pod": per_pod(cpu_after), "cpu_ms_per_pod_settled": per_pod(cpu_settled),
                    "settle_s": SETTLE_SECONDS}
    if len(times) >= 2:
        result["first_to_last_s"] = round(times[-1] - times[0], 2)
        result["pods_per_s"] = round((len(times) - 1) / (times[-1] - times[0]), 1)
        result["start_to_last_s"] = round(times[-1] - started, 2)
    result["violations"] = await _invariants(client, namespace)
    # Thousands of pods outlast the client's request timeout, and the API server stops deleting
    # when the client hangs up: the collection is deleted again until it is empty.
    path = f"/api/v1/namespaces/{namespace}/pods"
    for _ in range(100):
        if not (await client.get(path, {"limit": "1"})).get("items"):
            break
        with contextlib.suppress(TimeoutError):
            await client.request("DELETE", path, {"gracePeriodSeconds": 0})
    await asyncio.sleep(2.0)  # the watches deliver the deletions; the machine settles
    return result


def _scheduling_cycle(port: int, token: str) -> dict[str, float]:
    """Mean milliseconds per scheduling attempt from a kube-scheduler's ``/metrics``: the serial
    algorithm (filter and score plugins, extenders), its filter and score plugins alone, and the
    whole attempt up to the end of binding."""
    # The scheduler serves a self-signed certificate from memory, on loopback.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    request = urllib.request.Request(f"https://127.0.0.1:{port}/metrics",
                                     headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, context=context, timeout=10) as response:
        return cycle_figures(response.read().decode())


def cycle_figures(text: str) -> dict[str, float]:
    """:func:`_scheduling_cycle`'s figures from a kube-scheduler's exposition text."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    wanted = {
        "scheduler_scheduling_algorithm_duration_seconds": ("algorithm_ms", None),
        "scheduler_framework_extension_point_duration_seconds": ("", "extension_point"),
        "scheduler_scheduling_attempt_duration_seconds": ("attempt_scheduled_ms", "result"),
    }
    for line in text.splitlines():
        if line.startswith("#") or not ("_sum" in line or "_count" in line):
            continue
        name, _, value = line.rpartition(" ")
        base, _, labels = name.partition("{")
        metric = base.removesuffix("_sum").removesuffix("_count")
        if metric not in wanted:
            continue
        key, label = wanted[metric]
        if label == "extension_point":
            point = labels.split('extension_point="', 1)[1].split('"', 1)[0] if "extension_point" in labels else ""
            if point not in ("Filter", "Score"):
                continue
            key = f"{point.lower()}_plugins_ms"
        elif label == "result" and 'result="scheduled"' not in labels:
            continue
        target = sums if base.endswith("_sum") else counts
        target[key] = target.get(key, 0.0) + float(value)
    return {key: round(1000 * sums[key] / counts[key], 2) for key in sums if counts.get(key)}


def _verb_figures(url: str, context: ssl.SSLContext) -> JSON:
    """From the extender's ``/metrics``: the mean time it took to answer each verb, how many
    requests of each it answered, and how many TLS connections each opened (their first request's
    route): every connection beyond the first few costs a handshake in both processes."""
    with urllib.request.urlopen(f"{url}/metrics", context=context, timeout=10) as response:
        return verb_figures(response.read().decode())


def verb_figures(text: str) -> JSON:
    """:func:`_verb_figures`'s figures from the extender's exposition text."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    connections: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or 'route="' not in line:
            continue
        name, _, value = line.rpartition(" ")
        route = name.split('route="', 1)[1].split('"', 1)[0]
        if "_http_request_duration_seconds_sum{" in name:
            sums[route] = sums.get(route, 0.0) + float(value)
        elif "_http_request_duration_seconds_count{" in name:
            counts[route] = counts.get(route, 0.0) + float(value)
        elif "_http_connections_total{" in name:
            connections[route] = connections.get(route, 0.0) + float(value)
    # The nodes the scheduler asked about per filter: the candidates its own plugins left.
    judged = sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                 if line.startswith("vramguard_extender_decisions_total{") and 'verb="filter"' in line)
    verbs = ("/filter", "/prioritize", "/bind")
    return {
        "mean_ms": {route.lstrip("/"): round(1000 * sums[route] / counts[route], 2)
                    for route in sums if counts.get(route) and route in verbs},
        "requests": {route.lstrip("/"): int(counts[route]) for route in verbs if route in counts},
        "tls_connections": {route.lstrip("/"): int(connections[route]) for route in verbs if route in connections},
        "nodes_per_filter": round(judged / counts["/filter"], 1) if counts.get("/filter") and judged else None,
    }


async def _invariants(client: Any, namespace: str) -> list[str]:
    """Recompute every GPU's holdings from the final Nodes and Pods: the ledger's invariant check."""
    state = ClusterState(default_policy())
    nodes, _ = await client.list_all("/api/v1/nodes")
    pods, _ = await client.list_all(f"/api/v1/namespaces/{namespace}/pods")
    state.namespaces.replace([{"metadata": {"name": namespace}}])
    state.nodes.replace(nodes)
    state.pods.replace([p for p in pods if (p.get("spec") or {}).get("nodeName")])
    violations: list[str] = state.ledger.check_invariants()
    return violations


# --------------------------------------------------------------------------- main


def summary_table(records: list[JSON]) -> str:
    """The README's table."""
    lines = ["| Measurement | Result |", "|---|---|"]
    for r in records:
        if r.get("bench") == "latency" and r.get("phase") == "steady":
            f, p = r["filter"], r["prioritize"]
            lines.append(f"| {r['mode']}, steady, {r['nodes']:,} nodes: filter p50 / p99 | "
                         f"{f['p50_ms']} / {f['p99_ms']} ms (n={f['n']}) |")
            lines.append(f"| {r['mode']}, steady, {r['nodes']:,} nodes: prioritize p50 / p99 | "
                         f"{p['p50_ms']} / {p['p99_ms']} ms (n={p['n']}) |")
        elif r.get("bench") == "verbs":
            p50 = " / ".join(str(r[step]["p50_ms"]) for step in ("filter", "prioritize", "bind", "watch_event"))
            lines.append(f"| the verbs' own CPU per pod of a wave ({r['pods']:,} pods, {r['nodes']} nodes, "
                         f"{r['names']} names), filter / prioritize / bind / watch event p50 | {p50} ms "
                         f"(mean per pod, all four: {r['mean_ms_per_pod']} ms) |")
        elif r.get("bench") == "tls":
            c = r["server_cpu"]
            lines.append(f"| TLS handshake, {r['mode']}: the extender's CPU p50 / p99 | "
                         f"{c['p50_ms']} / {c['p99_ms']} ms (n={c['n']}) |")
        elif r.get("bench") == "latency" and r.get("phase") == "first-of-wave":
            lines.append(f"| {r['mode']}, first pod of each wave shape, {r['nodes']:,} nodes: filter / prioritize "
                         f"(n={len(r['filter_ms'])} values) | {list(r['filter_ms'].values())} / "
                         f"{list(r['prioritize_ms'].values())} ms |")
        elif r.get("bench") == "latency" and r.get("phase") == "cold-shapes":
            f, b = r["filter"], r["baseline"]
            lines.append(f"| https filter, first pod of a new shape, {r['nodes']:,} names: p50 / p99 | "
                         f"{f['p50_ms']} / {f['p99_ms']} ms (n={f['n']}); every node judged one by one, "
                         f"interleaved: {b['p50_ms']} / {b['p99_ms']} ms (n={b['n']}); answer "
                         f"{r['answer_bytes_median'] / 1024:.0f} KiB, {r['distinct_reasons_median']} distinct reasons "
                         f"(max {r['distinct_reasons_max']}); full collections "
                         f"{ {k: v for k, v in r['gc'].items() if k.endswith('gen2')} }; load {r['load_average']} |")
        elif r.get("bench") == "latency" and r.get("phase") == "first-after-sync":
            lines.append(f"| first filter after a full sync ({r['nodes']:,} nodes), {r['mode']} | {r['filter_ms']} ms "
                         f"(index built at sync: {r.get('warm_ms', '-')} ms; load {r['load_average']}) |")
        elif r.get("bench") == "lag" and "lag" in r:
            lag, f = r["lag"], r["filter"]
            lines.append(
                f"| event-loop lag, {r['mode']} filters of {r['nodes']:,} nodes: p50 / p99 / max | "
                f"{lag['p50_ms']} / {lag['p99_ms']} / {lag['max_ms']} ms (filter p50 {f['p50_ms']} ms, n={f['n']}) |"
            )
        elif r.get("bench") == "lag":
            lines.append(f"| filter of the {r['pod']} GPU pod, {r['nodes']:,} nodes | {r['filter_ms']} ms |")
        elif r.get("bench") == "scrape" and r.get("phase") == "exposition":
            lines.append(
                f"| /metrics ledger series, {r['nodes']:,} nodes, {'per GPU' if r['per_gpu'] else 'per node'}: "
                f"size / render CPU | {r['bytes'] / (1 << 20):.2f} MiB ({r['series']:,} series) / "
                f"{r['render_cpu_ms']} ms |"
            )
        elif r.get("bench") == "scrape":
            f = r["filter"]
            extra = (f", {r['p99_ratio_to_quiet']}x quiet p99; render in slices p50 {r['render_sliced']['p50_ms']} ms"
                     if "p99_ratio_to_quiet" in r else "")
            lines.append(
                f"| https filter, {r['nodes']:,} names, {r['mode']}: p50 / p99 | "
                f"{f['p50_ms']} / {f['p99_ms']} ms (n={f['n']}{extra}) |"
            )
        elif r.get("bench") == "memory":
            lines.append(
                f"| memory, {r['nodes']:,} nodes + {r['pods']:,} pods, lists dropped: process RSS / peak RSS | "
                f"{r['rss_mib']} / {r['peak_rss_mib']} MiB (growth {r['rss_delta_mib']} MiB; Python heap "
                f"{r['tracemalloc_held_mib']} MiB, {r['bytes_per_pod']} B per pod) |"
            )
            lines.append(f"| re-list of {r['pods']:,} pods fed to the state | {r['relist_pods_s']} s |")
        elif r.get("bench") == "throughput" and r.get("phase") == "cycle":
            shown = {k: v for k, v in r.items() if k.endswith("_ms")}
            lines.append(f"| {r['scheduler']} ({r.get('extender')} run): mean per scheduling attempt | {shown} |")
        elif r.get("bench") == "throughput" and r.get("scheduler") == "idle":
            lines.append(f"| control plane idle ({r.get('extender')} run), CPU ms per second | {r['cpu_ms_per_s']} |")
        elif r.get("bench") == "throughput" and "scheduler" in r:
            lines.append(
                f"| {r['pods']:,} pods onto {r['nodes']} nodes, {r['scheduler']} ({r.get('extender')} run), "
                f"repeat {r['repeat']} | "
                f"{r.get('pods_per_s', '-')} pods/s ({r['bound']} bound, {len(r['violations'])} violations; "
                f"CPU ms per pod {r['cpu_ms_per_pod']}, in all {round(sum(r['cpu_ms_per_pod'].values()), 1)}; "
                f"with the {r.get('settle_s')} s after the last binding, in all "
                f"{round(sum(r.get('cpu_ms_per_pod_settled', {}).values()), 1)}) |"
            )
        elif r.get("bench") == "hami-filter" and r.get("phase") == "filter":
            f = r["filter"]
            lines.append(f"| HAMi {r.get('hami_version')} https filter, {r['names']:,} names of {r['nodes']:,} "
                         f"nodes: p50 / p99 | {f.get('p50_ms')} / {f.get('p99_ms')} ms (n={f['n']}; first "
                         f"{r['first_ms']} ms; {r['errors']} errors) |")
        elif r.get("bench") == "hami-filter" and r.get("phase") == "memory":
            lines.append(f"| HAMi after registering {r['nodes']:,} nodes: RSS / peak RSS | "
                         f"{r['rss_mib']} / {r['peak_rss_mib']} MiB |")
        elif r.get("bench") == "throughput" and r.get("phase") == "extender-memory":
            lines.append(f"| the extender process ({r['extender']}) after the waves: RSS / peak RSS | "
                         f"{r['rss_mib']} / {r['peak_rss_mib']} MiB |")
        elif r.get("bench") == "throughput" and r.get("phase") == "hami-log":
            shown = {k: r[k] for k in HAMI_LOG_LINES}
            lines.append(f"| HAMi {r.get('hami_version')}: filters and binds in its log | {shown} |")
        elif r.get("bench") == "throughput" and r.get("phase") == "extender-verbs":
            lines.append(f"| extender's mean time per verb | {r['mean_ms']} ms (requests {r.get('requests')}, "
                         f"new TLS connections {r.get('tls_connections')}) |")
        elif r.get("bench") == "throughput" and r.get("phase") == "side-by-side":
            lines.append(f"| side by side: rate with each extender / the stock kube-scheduler of its cluster | "
                         f"{r['ratio_to_stock']}; vramguard over each: {r.get('vramguard_over')}"
                         f"{'; skipped: ' + ', '.join(r['skipped']) if r['skipped'] else ''} |")
        elif r.get("bench") == "throughput" and r.get("phase") == "skipped":
            lines.append(f"| {r['extender']}: not measured | {r['reason']} |")
        elif r.get("bench") == "throughput" and "ratio" in r:
            lines.append(f"| throughput with / without the extender ({r.get('extender', 'vramguard')}, verbs: "
                         f"{r.get('extender_verbs')}), median of "
                         f"{r['repeats']} | {r['ratio']} "
                         f"(per repeat {r['ratios_per_repeat']}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m bench.extender", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller cluster, for a smoke run")
    parser.add_argument("--only", default=",".join(PARTS),
                        help=f"comma-separated parts of {', '.join(PARTS + OPTIONAL_PARTS)} (default: all but "
                             f"{', '.join(OPTIONAL_PARTS)})")
    parser.add_argument("--requests", type=int, default=None, help="requests per pod shape (latency)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where the control planes run, kept afterwards (default: a temporary directory)")
    parser.add_argument("--throughput-timeout", type=float, default=240.0, help="seconds each run may take")
    parser.add_argument("--throughput-nodes", type=int, default=500, help="nodes (throughput)")
    parser.add_argument("--throughput-pods", type=int, default=1000, help="pods per wave (throughput)")
    parser.add_argument("--repeats", type=int, default=3, help="waves per scheduler, alternated (throughput)")
    parser.add_argument("--with-webhook", action="store_true", help="start the admission webhook too (throughput)")
    parser.add_argument("--wave-start", choices=WAVE_STARTS, default="pause",
                        help="how a wave's pods reach the scheduler (throughput): its process paused while they are "
                             "created (default), or every node cordoned and then uncordoned")
    parser.add_argument("--extender-verbs", default=None,
                        help="comma-separated verbs the extender's scheduler calls, of filter, prioritize, bind, "
                             "preempt (throughput; default: as shipped)")
    parser.add_argument("--extender", default=DEFAULT_EXTENDERS,
                        help="comma-separated, what serves the extender's verbs (throughput), each on a cluster of "
                             "its own against the stock kube-scheduler: vramguard, the floor extender (bench/floor, "
                             "Go): the same wire with no checks behind it, over HTTP/1.1 (floor) or offering HTTP/2 "
                             "as vramguard does (floor-h2), HAMi's scheduler extender (hami: needs go, cgo, and "
                             f"--hami-source or git access to GitHub). Default: {DEFAULT_EXTENDERS}")
    parser.add_argument("--hami-source", type=Path, default=os.environ.get("HAMI_SOURCE") or None,
                        help="a source tree of Project-HAMi/HAMi to build its scheduler from (--extender hami; "
                             "default: $HAMI_SOURCE)")
    parser.add_argument("--hami-arg", action="append", default=[],
                        help="one more flag for HAMi's scheduler, e.g. --hami-arg=-v=4 (repeatable)")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        nodes, pods, traced = (int(v) for v in args.memory_child.split(","))
        emit(memory_child(nodes, pods, bool(traced)))
        return 0
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS) - set(OPTIONAL_PARTS))
    if unknown:
        parser.error(f"unknown parts: {', '.join(unknown)}")
    extenders = [e.strip() for e in args.extender.split(",") if e.strip()]
    if not extenders or not set(extenders) <= set(EXTENDERS) or len(set(extenders)) != len(extenders):
        parser.error(f"--extender takes distinct names of {', '.join(EXTENDERS)}")
    verb_names = {"filter", "prioritize", "bind", "preempt"}
    if args.extender_verbs and not {v.strip() for v in args.extender_verbs.split(",") if v.strip()} <= verb_names:
        parser.error(f"--extender-verbs takes some of {', '.join(sorted(verb_names))}")
    big = ClusterModel(1000, 10000) if args.quick else ClusterModel()
    requests = args.requests or (20 if args.quick else 75)
    machine = {"bench": "machine", "cpus": os.cpu_count(), "python": platform.python_version(),
               "load_average": [round(v, 1) for v in os.getloadavg()]}
    emit(machine)
    records: list[JSON] = []
    if "latency" in parts:
        for record in asyncio.run(bench_latency(big, requests, 24 if args.quick else 120)):
            emit(record)
            records.append(record)
    if "lag" in parts:
        for record in asyncio.run(bench_lag(big, 12 if args.quick else 40, 2 if args.quick else LAG_ROUNDS)):
            emit(record)
            records.append(record)
    if "scrape" in parts:
        for record in asyncio.run(bench_scrape(big, 100)):
            emit(record)
            records.append(record)
    if "memory" in parts:
        for record in bench_memory(big.nodes, big.pods):
            emit(record)
            records.append(record)
    if "tls" in parts:
        for record in bench_handshakes(100 if args.quick else 300):
            emit(record)
            records.append(record)
    if "verbs" in parts:
        for record in asyncio.run(bench_verbs()):
            emit(record)
            records.append(record)
    if "throughput" in parts:
        nodes, pods = (100, 400) if args.quick else (args.throughput_nodes, args.throughput_pods)
        with tempfile.TemporaryDirectory(prefix="vramguard-bench-") as tmp:
            work = args.work_dir or Path(tmp)
            verbs = [v.strip() for v in args.extender_verbs.split(",") if v.strip()] if args.extender_verbs else None
            for extender in extenders:
                try:
                    measured = bench_throughput(nodes, pods, args.repeats, work / extender, args.throughput_timeout,
                                                webhook=args.with_webhook, verbs=verbs, start=args.wave_start,
                                                extender=extender, hami_source=args.hami_source,
                                                hami_args=args.hami_arg)
                except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
                    if len(extenders) == 1:
                        raise
                    # One extender that cannot run (HAMi without its source) leaves the others' figures.
                    measured = [{"bench": "throughput", "phase": "skipped", "extender": extender,
                                 "reason": str(exc)[:500]}]
                    print(f"throughput {extender}: skipped: {exc}", file=sys.stderr, flush=True)
                for record in measured:
                    emit(record)
                    records.append(record)
            if len(extenders) > 1:
                record = side_by_side(records)
                emit(record)
                records.append(record)
    if "hami-filter" in parts:
        with tempfile.TemporaryDirectory(prefix="vramguard-bench-") as tmp:
            work = args.work_dir or Path(tmp)
            nodes, sizes, requests = (1000, (500, 1000), 20) if args.quick else (5000, HAMI_FILTER_SIZES, 60)
            for record in bench_hami_filter(work, args.hami_source, args.hami_arg, nodes=nodes, sizes=sizes,
                                            requests=requests, timeout_s=args.throughput_timeout):
                emit(record)
                records.append(record)
    emit({"bench": "machine", "load_average_after": [round(v, 1) for v in os.getloadavg()]})
    print(summary_table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
