"""Benchmark: AdmissionReviews per second on one core for a typical GPU pod.

    python -m bench.webhook [--requests 20000] [--connections 16] [--mode both|inprocess|https]

Two measurements, each with a bounded number of reviews. Each reports reviews per second of wall
time and per second of CPU time of the process that serves them: on a busy machine the second is
the one that says what one core does.

- ``inprocess``: the ``/validate`` handler called directly, without sockets: read the body, decode
  and validate the AdmissionReview, build the cluster view (namespace labels, GPU offers, the
  namespace's quota usage over 40 live GPU pods), apply the rules, encode the answer.
- ``https``: the real server (TLS, keep-alive, the same handler) in a process pinned to one CPU,
  driven by a client process pinned to another CPU over loopback with ``--connections`` concurrent
  connections, as the API server's connection pool would.

The review is the pod of ``bench.demand`` (vLLM, ``--gpu-memory-utilization 0.30``) in a namespace
with a VRAM quota, enforcement ``enforce``: every rule runs, quota included.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import multiprocessing
import os
import ssl
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

from aiohttp import web
from prometheus_client import CollectorRegistry

from bench.demand import TYPICAL_VLLM_POD
from vramguard.policy import Policy
from webhook.app import PolicySource, WebhookState, create_webhook_app, validate

NAMESPACE = "team-a"
POLICY = Policy.from_yaml(
    """
default_class: best-effort
enforcement: enforce
classes:
  guaranteed: {sharing: [none, mig], allow_implicit_defaults: false}
  best-effort: {sharing: [time-slicing]}
quotas:
  team-a: 2000Gi
"""
)


def review_body(index: int = 0) -> bytes:
    """The AdmissionReview the API server sends for the typical pod (CREATE)."""
    obj = copy.deepcopy(TYPICAL_VLLM_POD)
    obj["metadata"]["uid"] = f"00000000-0000-0000-0000-{index:012d}"
    # The default policy admits GPU pods only for the schedulers that call the extender.
    obj["spec"]["schedulerName"] = "vramguard"
    return json.dumps({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": f"req-{index}",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "name": obj["metadata"]["name"],
            "namespace": NAMESPACE,
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller",
                         "groups": ["system:serviceaccounts", "system:authenticated"]},
            "object": obj,
            "oldObject": None,
            "dryRun": True,  # keeps the quota's pending admissions from growing over the run
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }).encode()


def make_state() -> WebhookState:
    """A cluster of 20 time-sliced 8-GPU nodes and 40 live GPU pods in the quota's namespace."""
    state = WebhookState(PolicySource(POLICY))
    state.cluster.namespaces.replace([{"metadata": {"name": NAMESPACE, "labels": {"vramguard.io/enforce": "enforce"}}}])
    state.cluster.nodes.replace([
        {"metadata": {"name": f"gpu-{i}", "labels": {
            "nvidia.com/gpu.count": "8", "nvidia.com/gpu.memory": "81559", "nvidia.com/gpu.replicas": "4",
            "nvidia.com/gpu.sharing-strategy": "time-slicing", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
         "status": {"allocatable": {"nvidia.com/gpu": "32"}}}
        for i in range(20)
    ])
    pods = []
    for i in range(40):
        obj = copy.deepcopy(TYPICAL_VLLM_POD)
        obj["metadata"].update(name=f"live-{i}", uid=f"live-{i}")
        obj["spec"]["nodeName"] = f"gpu-{i % 20}"
        pods.append(obj)
    state.cluster.pods.replace(pods)
    return state


class _InProcessRequest:
    """Just what the handler reads from a request: the app, the body and its length."""

    def __init__(self, app: web.Application, body: bytes) -> None:
        self.app = app
        self.config_dict = app
        self.content_length = len(body)
        self._body = body

    async def read(self) -> bytes:
        return self._body


async def _in_process(requests: int) -> dict[str, Any]:
    app = create_webhook_app(make_state(), registry=CollectorRegistry())
    bodies = [review_body(i) for i in range(100)]
    first = await validate(cast(web.Request, _InProcessRequest(app, bodies[0])))
    answer = json.loads(first.text or "")
    assert answer["response"]["allowed"] is True, answer
    start, cpu_start = time.perf_counter(), time.process_time()
    for i in range(requests):
        await validate(cast(web.Request, _InProcessRequest(app, bodies[i % len(bodies)])))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return {"case": "in-process handler, typical GPU pod", "reviews": requests, "seconds": round(elapsed, 3),
            "cpu_seconds": round(cpu, 3), "reviews_per_second": round(requests / elapsed),
            "reviews_per_cpu_second": round(requests / cpu)}


def _serve(directory: str, cpu: int, ready: Connection, begin: Any, end: Any, stop: Any) -> None:
    """Server process: one CPU, the real HTTPS server and handler; reports its CPU seconds from begin to end."""
    from vramguard.io.server import ServerSettings, serve  # noqa: PLC0415
    from vramguard.io.tls import load_server_tls  # noqa: PLC0415

    os.sched_setaffinity(0, {cpu})

    async def main() -> None:
        tls = load_server_tls(Path(directory) / "tls.crt", Path(directory) / "tls.key")
        app = create_webhook_app(make_state(), registry=CollectorRegistry())
        async with serve(app, "127.0.0.1", 0, tls, settings=ServerSettings()) as server:
            ready.send(server.port)
            cpu_begin = cpu_end = 0.0
            while not stop.is_set():
                await asyncio.sleep(0.01)
                if begin.is_set() and not cpu_begin:
                    cpu_begin = time.process_time()
                if end.is_set() and not cpu_end:
                    cpu_end = time.process_time()
                    ready.send(cpu_end - cpu_begin)

    asyncio.run(main())


def _drive(
    directory: str, cpu: int, port: int, requests: int, connections: int, begin: Any, end: Any, result: Connection
) -> None:
    """Client process: ``connections`` keep-alive HTTPS connections, ``requests`` reviews in all."""
    import aiohttp  # noqa: PLC0415

    os.sched_setaffinity(0, {cpu})

    async def main() -> None:
        context = ssl.create_default_context(cafile=str(Path(directory) / "ca.crt"))
        bodies = [review_body(i) for i in range(100)]
        url = f"https://127.0.0.1:{port}/validate"
        connector = aiohttp.TCPConnector(ssl=context, limit=connections)
        remaining = requests
        async with aiohttp.ClientSession(connector=connector) as session:

            async def worker(index: int) -> int:
                nonlocal remaining
                done = 0
                while remaining > 0:
                    remaining -= 1
                    body = bodies[(index + done) % len(bodies)]
                    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                        await resp.read()
                        assert resp.status == 200
                    done += 1
                return done

            await asyncio.gather(*(worker(i) for i in range(connections)))  # warm-up: handshakes, caches
            remaining = requests
            begin.set()
            await asyncio.sleep(0.05)  # the server notices begin within 10 ms
            start = time.perf_counter()
            counts = await asyncio.gather(*(worker(i) for i in range(connections)))
            elapsed = time.perf_counter() - start
            end.set()
        result.send((sum(counts), elapsed))

    asyncio.run(main())


def _https(requests: int, connections: int) -> dict[str, Any]:
    from vramguard.io import certs  # noqa: PLC0415

    cpus = sorted(os.sched_getaffinity(0))
    server_cpu, client_cpu = cpus[0], cpus[-1]
    with tempfile.TemporaryDirectory() as directory:
        ca = certs.create_ca()
        leaf = certs.issue_serving_certificate(ca, dns_names=["localhost"], ip_addresses=["127.0.0.1"])
        certs.write_serving_files(directory, leaf)
        context = multiprocessing.get_context("spawn")
        ready_recv, ready_send = context.Pipe(duplex=False)
        result_recv, result_send = context.Pipe(duplex=False)
        begin, end, stop = context.Event(), context.Event(), context.Event()
        server = context.Process(target=_serve, args=(directory, server_cpu, ready_send, begin, end, stop))
        server.start()
        try:
            port = ready_recv.recv()
            client = context.Process(
                target=_drive, args=(directory, client_cpu, port, requests, connections, begin, end, result_send)
            )
            client.start()
            count, elapsed = result_recv.recv()
            server_cpu_seconds = ready_recv.recv()
            client.join()
        finally:
            stop.set()
            server.join(10)
    shared = " (client shares the CPU)" if server_cpu == client_cpu else ""
    return {"case": f"HTTPS on loopback, server on one CPU{shared}, {connections} connections",
            "reviews": count, "seconds": round(elapsed, 3), "server_cpu_seconds": round(server_cpu_seconds, 3),
            "reviews_per_second": round(count / elapsed),
            "reviews_per_server_cpu_second": round(count / server_cpu_seconds)}


def main() -> None:
    """Run the chosen measurements and print one JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000, help="reviews per measurement")
    parser.add_argument("--connections", type=int, default=16, help="concurrent HTTPS connections")
    parser.add_argument("--mode", choices=("both", "inprocess", "https"), default="both")
    args = parser.parse_args()
    if args.mode in ("both", "inprocess"):
        print(json.dumps(asyncio.run(_in_process(args.requests))), flush=True)
    if args.mode in ("both", "https"):
        print(json.dumps(_https(args.requests, args.connections)), flush=True)


if __name__ == "__main__":
    main()
