"""The learning round beside the hot path: how long a round takes, how long it holds the event loop,
and what it does to the filters served meanwhile.

    python -m bench.learning [--nodes 5000] [--pods 50000] [--rounds 20] [--requests 400]

The cluster of ``bench.cluster_model`` (time-sliced H100 nodes, 50,000 bound pods of 1,009
templates), every node with a fresh agent Lease and an agent report that places each pod on a GPU
and measures it 1 to 4 GiB above its prediction, so that every vLLM pod is a learning sample (the
declared ones are not: a declaration is learned from nothing). The extender's :class:`Learner` runs
its rounds against an API stub that answers at once (the ConfigMap write and the Events cost what
encoding them costs, no network).

Measured, with no profiler, in one process:

- ``round``: the wall time of whole rounds (a round reads every node's measured pods, moves the table,
  applies it and writes it), and the event loop's lag meanwhile (a 1 ms ticker's overshoot, as every
  request on the loop feels it);
- ``filter``: the latency of filters of new pod shapes over every node, ``quiet`` (no round running) and
  ``during`` (rounds back to back beside them, the worst case: the extender runs one a minute), in
  alternated blocks in the same process, so that both see the same machine and the same ledger;
- ``rss``: the process's resident memory (``VmRSS``) before the first round and after the last.

Prints one JSON line per figure.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import time
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from bench.cluster_model import REPLICAS, ClusterModel, Shape, new_pod
from bench.extender import LagProbe, latency_stats, loaded_state, rss_bytes
from extender.learning import Learner
from extender.main import freeze_collector
from extender.verbs import Verbs
from vramguard.codecs import AGENT_REPORT_ANNOTATION, AgentReport
from vramguard.demand.derive import derive_pod_demand
from vramguard.lease import DEFAULT_AGENT_NAMESPACE, lease_body
from vramguard.policy import default_policy
from vramguard.quantity import GiB

JSON = dict[str, Any]
NOW = time.time()


class StubApi:
    """ConfigMaps kept in memory with resourceVersions, Events counted: answers at once."""

    def __init__(self) -> None:
        self.objects: dict[str, JSON] = {}
        self.events = 0
        self.version = 0

    async def get(self, path: str, params: Any = None) -> JSON:
        if path not in self.objects:
            from vramguard.io.kube import ApiError  # noqa: PLC0415 - the one error the learner expects

            raise ApiError(404, "NotFound", path)
        return self.objects[path]

    async def create(self, path: str, body: JSON) -> JSON:
        if body.get("kind") == "Event":
            self.events += 1
            return body
        return self._store(f"{path}/{body['metadata']['name']}", body)

    async def replace(self, path: str, body: JSON) -> JSON:
        return self._store(path, body)

    def _store(self, path: str, body: JSON) -> JSON:
        self.version += 1
        stored = {**body, "metadata": {**body.get("metadata", {}), "resourceVersion": str(self.version)}}
        self.objects[path] = stored
        return stored


def reports(model: ClusterModel, pods: Mapping[str, list[JSON]]) -> dict[str, str]:
    """Per node, an agent report: each pod on a GPU (REPLICAS a GPU), measured above its prediction."""
    rng = random.Random(7)
    options = default_policy().demand_options()
    gpus = model.node_gpus()
    out: dict[str, str] = {}
    for index, (node, on_node) in enumerate(sorted(pods.items())):
        placements: dict[str, dict[str, tuple[str, ...]]] = {}
        used: dict[str, dict[str, int]] = {}
        device = 0
        for pod in on_node:
            demand = derive_pod_demand(pod, options)
            [container] = demand.containers
            ids = tuple(str((device + i) % gpus[index]) for i in range(container.gpus))
            device += container.gpus
            uid = pod["metadata"]["uid"]
            placements[uid] = {container.name: ids}
            reservation = container.reservation
            if reservation is not None:
                held = reservation.on_device(81559 * 2**20) + rng.randint(1, 4) * GiB
                used[uid] = dict.fromkeys(ids, held)
        out[node] = AgentReport(placements=placements, used=used).encode()
    return out


async def rounds_until(learner: Learner, stop: asyncio.Event) -> None:
    """Learning rounds back to back until ``stop``: the worst case of a round beside every request."""
    while not stop.is_set():
        await learner.round()


async def main_async(args: argparse.Namespace) -> list[JSON]:
    model = ClusterModel(nodes=args.nodes, pods=args.pods)
    full_pods: dict[str, list[JSON]] = {}
    for pod in model.pod_objects():
        full_pods.setdefault(pod["spec"]["nodeName"], []).append(pod)
    annotations = reports(model, full_pods)
    del full_pods
    state, names, _ = loaded_state(model, clock=lambda: NOW)  # the agents' Leases stay fresh
    state.leases.replace([lease_body(DEFAULT_AGENT_NAMESPACE, n, "agent", 40, NOW) for n in names])
    nodes = model.node_objects()
    for node in nodes:
        node["metadata"].setdefault("annotations", {})[AGENT_REPORT_ANNOTATION] = annotations[node["metadata"]["name"]]
    state.nodes.replace(nodes)
    del nodes, annotations
    gc.collect()
    freeze_collector()  # as the extender does once its caches are synced
    verbs = Verbs(state, None)
    await verbs.filter(new_pod(Shape("warm", "0.05"), 0), names)
    api = StubApi()
    learner = Learner(state, api, "vramguard-system", CollectorRegistry(), serving=lambda: True,  # type: ignore[arg-type]
                      clock=lambda: NOW)
    rss_before = rss_bytes()

    rounds: list[float] = []
    lags: list[float] = []
    for _ in range(args.rounds):
        async with LagProbe() as probe:
            start = time.perf_counter()
            await learner.round()
            rounds.append(time.perf_counter() - start)
        lags += probe.overshoot_s

    # Blocks of filters, quiet and during back-to-back rounds, alternated (ABBA), each block its own
    # pod shapes: every filter evaluates the nodes afresh, as the first pod of a new Deployment does.
    timings: dict[str, list[float]] = {"quiet": [], "during": []}
    per_block = max(1, args.requests // (2 * args.blocks))
    serial = 0
    for block in range(args.blocks):
        for mode in ("quiet", "during") if block % 2 == 0 else ("during", "quiet"):
            stop = asyncio.Event()
            background = asyncio.create_task(rounds_until(learner, stop)) if mode == "during" else None
            await asyncio.sleep(0)
            for _ in range(per_block):
                serial += 1
                pod = new_pod(Shape(f"s{serial}", f"0.{10 + serial % 80:02d}", gpus=1 + serial % 2), serial)
                start = time.perf_counter()
                await verbs.filter(pod, names)
                timings[mode].append(time.perf_counter() - start)
            stop.set()
            if background is not None:
                await background

    learned = state.learned
    return [
        {"bench": "learning", "part": "round", "nodes": args.nodes, "pods": args.pods,
         "keys": len(learned), "rounds": latency_stats(rounds), "loop_lag": latency_stats(lags),
         "events": api.events, "table_bytes": len(learner.table.to_json())},
        *({"bench": "learning", "part": "filter", "mode": mode, "nodes": args.nodes,
           "latency": latency_stats(values)} for mode, values in timings.items()),
        {"bench": "learning", "part": "rss", "before_mib": round(rss_before / 2**20, 1),
         "after_mib": round(rss_bytes() / 2**20, 1)},
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.learning", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--pods", type=int, default=50000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--blocks", type=int, default=10, help="quiet and during blocks, alternated")
    args = parser.parse_args(argv)
    if args.pods > args.nodes * 8 * REPLICAS:
        parser.error("more pods than replicas")
    for record in asyncio.run(main_async(args)):
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
