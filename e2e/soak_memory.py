"""Resident memory of the extender, the webhook and the agent at a given cluster size, from /proc.

Command line (starts its own cluster; loopback only)::

    python -m e2e.soak_memory --nodes 1000 --pods 10000 --out memory.json

Creates ``--nodes`` GPU nodes and ``--pods`` GPU pods bound to them (directly with ``nodeName``, in
a namespace the webhook audits, so every pod is still reviewed), waits until the extender counts
them all, and samples each process's ``VmRSS`` (resident memory, not the Python heap): idle before
the load, steady with it, and the peak while a restarted process lists everything again (the
moment a memory limit has to cover). The agent runs against one node with NVML replayed from a
recording; its memory follows the pods on its node, not the cluster's size.

The resource requests and limits (docs/benchmarks.md, "Resources") come from this command's figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from e2e import gpu_nodes
from e2e.cluster import Cluster
from e2e.procs import group_members
from e2e.soak import Api

NAMESPACE = "memory"
RECORDING = Path(__file__).resolve().parent.parent / "tests" / "data" / "agent" / "nvml_h100_time_sliced.json"
PODS_METRIC = re.compile(r"^vramguard_node_pods\{[^}]*\} ([0-9.e+]+)$", re.MULTILINE)


def _log(message: str) -> None:
    print(f"e2e.soak_memory: {message}", file=sys.stderr, flush=True)


def rss_mib(pids: Iterable[int]) -> float:
    """The summed ``VmRSS`` of ``pids`` in MiB (a process gone counts nothing)."""
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        match = re.search(r"^VmRSS:\s+(\d+) kB$", status, re.MULTILINE)
        total += int(match[1]) if match else 0
    return round(total / 1024, 1)


def component_pids(cluster: Cluster, name: str) -> list[int]:
    """Every process of the component's process group."""
    return [pid for proc in cluster.processes if proc.name == name for pid in group_members([proc.record.pid])]


def service_rss(cluster: Cluster, service: str) -> float:
    """RSS of a vramguard service's processes (MiB)."""
    return rss_mib(component_pids(cluster, f"vramguard-{service}"))


def sample(read: Callable[[], float], seconds: float, interval: float = 0.2) -> float:
    """The highest of ``read()`` over ``seconds``."""
    peak = 0.0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        peak = max(peak, read())
        time.sleep(interval)
    return peak


def node_spec(index: int) -> gpu_nodes.GPUNodeSpec:
    """An 8-GPU time-sliced H100 node (32 replicas), as large GPU nodes are."""
    return gpu_nodes.time_sliced(f"mem-{index:05d}", "H100-80GB", gpus=8, replicas=4)


def pod(name: str, node: str) -> dict[str, Any]:
    """A small vLLM pod bound to ``node``."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "memory"}},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.21.0",
                    "args": ["--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu-memory-utilization", "0.05"],
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }
            ],
        },
    }


def extender_pods(cluster: Cluster) -> int:
    """How many pods the extender's ledger holds (``sum(vramguard_node_pods)``)."""
    try:
        with urllib.request.urlopen(f"{cluster.ops_url('extender')}/metrics", timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return -1
    return int(sum(float(value) for value in PODS_METRIC.findall(text)))


def load(cluster: Cluster, nodes: int, pods: int) -> float:
    """Create the nodes and the pods; returns the seconds it took."""
    api = Api(cluster)
    started = time.monotonic()
    cluster.create(
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": NAMESPACE, "labels": {"vramguard.io/enforce": "audit"}},
        }
    )

    def create_node(index: int) -> None:
        spec = node_spec(index)
        api.call("POST", "/api/v1/nodes", gpu_nodes.node_manifest(spec))
        api.call(
            "PATCH",
            f"/api/v1/nodes/{spec.name}/status",
            {"status": gpu_nodes.node_status(spec)},
            content_type="application/merge-patch+json",
        )

    def create_pod(index: int) -> None:
        api.call("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", pod(f"p-{index:06d}", node_spec(index % nodes).name))

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(create_node, range(nodes)))
        _log(f"{nodes} nodes created")
        list(pool.map(create_pod, range(pods)))
    _log(f"{pods} pods created in {time.monotonic() - started:.0f}s")
    return time.monotonic() - started


def restart_peak(cluster: Cluster, service: str, seconds: float) -> tuple[float, float]:
    """Restart a vramguard service (SIGTERM) and return (peak RSS while it re-lists, seconds to ready)."""
    peak = 0.0
    done = False

    def watch() -> None:
        nonlocal peak
        while not done:
            peak = max(peak, rss_mib(component_pids(cluster, f"vramguard-{service}")))
            time.sleep(0.05)

    with ThreadPoolExecutor(max_workers=1) as pool:
        watcher = pool.submit(watch)
        started = time.monotonic()
        cluster.restart_vramguard(service, signal.SIGTERM)  # type: ignore[arg-type]
        ready = time.monotonic() - started
        time.sleep(seconds)
        done = True
        watcher.result()
    return peak, round(ready, 1)


def agent_rss(cluster: Cluster, node: str, seconds: float, workdir: Path) -> float:
    """Peak RSS of one ``vramguard agent`` reporting for ``node`` with NVML replayed from a recording."""
    from tests.agent_support import kubelet_server  # noqa: PLC0415 - needs grpc

    socket = workdir / "kubelet.sock"
    with kubelet_server(socket), (workdir / "agent.log").open("ab") as log:
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vramguard",
                "agent",
                "--node-name",
                node,
                "--listen",
                "127.0.0.1:0",
                "--kubeconfig",
                str(cluster.kubeconfig),
                "--nvml-recording",
                str(RECORDING),
                "--podresources-socket",
                str(socket),
                "--interval",
                "0.5",
                "--min-write-interval",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            peak = sample(lambda: rss_mib([agent.pid]), seconds)
            if agent.poll() is not None:
                raise RuntimeError(f"the agent exited: {(workdir / 'agent.log').read_text()[-2000:]}")
            return peak
        finally:
            agent.terminate()
            agent.wait(15)


def measure(directory: Path, nodes: int, pods: int, kube_version: str | None = None) -> dict[str, Any]:
    """Every figure, in a fresh cluster in ``directory``."""
    cluster = Cluster.up(directory, kube_version=kube_version, vramguard="on")
    try:
        result: dict[str, Any] = {"nodes": nodes, "pods": pods}
        time.sleep(3)
        for service in ("extender", "webhook"):
            result[f"{service}_idle_mib"] = sample(functools.partial(service_rss, cluster, service), 3)
        result["load_seconds"] = round(load(cluster, nodes, pods), 1)
        deadline = time.monotonic() + 300
        while extender_pods(cluster) < pods:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the extender counts {extender_pods(cluster)} of {pods} pods after 300s")
            time.sleep(1)
        for service in ("extender", "webhook"):
            result[f"{service}_steady_mib"] = sample(functools.partial(service_rss, cluster, service), 10)
        for service in ("extender", "webhook"):
            peak, ready = restart_peak(cluster, service, 10)
            result[f"{service}_restart_peak_mib"] = peak
            result[f"{service}_restart_ready_seconds"] = ready
        with tempfile.TemporaryDirectory(prefix="vramguard-agent-") as workdir:
            result["agent_mib"] = agent_rss(cluster, node_spec(0).name, 20, Path(workdir))
        result["apiserver_mib"] = rss_mib(component_pids(cluster, "kube-apiserver"))
        return result
    finally:
        cluster.down()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m e2e.soak_memory``: see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m e2e.soak_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=10000)
    parser.add_argument("--dir", type=Path, help="cluster directory (default: a temporary one)")
    parser.add_argument("--kube-version")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    if args.nodes <= 0 or args.pods < 0:
        parser.error("--nodes must be positive and --pods not negative")
    directory = args.dir or Path(tempfile.mkdtemp(prefix="vramguard-memory-"))
    result = measure(directory, args.nodes, args.pods, args.kube_version)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
