"""Micro-benchmark: demand derivation, pods per second on one core.

    python -m bench.demand [--seconds 3] [--against OTHER_CHECKOUT [--rounds 5]]

The extender derives demand on every pod event; at 50,000 pods a re-list must not stall it.
Figures are pods per second of this process's CPU time, so that other work on the machine does not
count against them. ``--against`` runs this checkout's benchmark and another's (an older commit,
a worktree of ``main``) in fresh interpreters, alternated round by round, which goes first
alternating, and prints each case's median per side and their ratio.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.report import refuse_if_traced, untraced_environment
from vramguard.demand import derive_pod_demand

TYPICAL_VLLM_POD: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {
        "name": "chat-7d9f8-abcde",
        "namespace": "team-a",
        "labels": {"app": "chat", "pod-template-hash": "7d9f8", "vramguard.io/qos-class": "best-effort"},
        "annotations": {"prometheus.io/scrape": "true"},
    },
    "spec": {
        "containers": [
            {
                "name": "vllm",
                "image": "vllm/vllm-openai:v0.21.0",
                "args": ["--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu-memory-utilization", "0.30",
                         "--max-model-len", "8192", "--port", "8000", "--served-model-name", "chat"],
                "env": [{"name": "HF_HOME", "value": "/cache"},
                        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
                "ports": [{"containerPort": 8000, "name": "http"}],
                "resources": {"limits": {"nvidia.com/gpu": "1", "memory": "32Gi"},
                              "requests": {"cpu": "4", "memory": "32Gi"}},
                "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}},
                "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
            }
        ],
        "volumes": [{"name": "cache", "emptyDir": {}}],
    },
}


def ten_container_pod() -> dict[str, Any]:
    """A pod with ten GPU containers written in different styles (args, sh -c, env, MPS)."""
    pod = copy.deepcopy(TYPICAL_VLLM_POD)
    base = pod["spec"]["containers"][0]
    containers = []
    for i in range(10):
        c = copy.deepcopy(base)
        c["name"] = f"c{i}"
        if i % 3 == 1:
            c["command"] = ["sh", "-c", f"pip install -q x && exec vllm serve m --gpu-memory-utilization 0.0{i + 1}"]
            c.pop("args")
        elif i % 3 == 2:
            c["env"].append({"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=4G"})
        containers.append(c)
    pod["spec"]["containers"] = containers
    return pod


def measure(name: str, make: Callable[[], dict[str, Any]], seconds: float) -> dict[str, Any]:
    """Derive demand from fresh copies of a pod for ``seconds``; report pods per second."""
    # Fresh dicts each time, as from a JSON decoder: no cache can help.
    text = json.dumps(make())
    pods = [json.loads(text) for _ in range(2000)]
    count = 0
    refuse_if_traced()  # a profiler or tracemalloc would make the figure meaningless
    # CPU time of this process: "per second on one core" even when other work shares the machine.
    start = time.process_time()
    deadline = start + seconds
    while time.process_time() < deadline:
        for pod in pods:
            derive_pod_demand(pod)
        count += len(pods)
    elapsed = time.process_time() - start
    return {
        "case": name,
        "pods": count,
        "cpu_seconds": round(elapsed, 3),
        "pods_per_cpu_second": round(count / elapsed),
    }


CASES: tuple[tuple[str, Callable[[], dict[str, Any]]], ...] = (
    ("typical vLLM pod", lambda: TYPICAL_VLLM_POD),
    ("10-container pod", ten_container_pod),
)
HERE = Path(__file__).resolve().parent.parent


def against(other: Path, rounds: int, seconds: float) -> list[dict[str, Any]]:
    """This checkout's figures and ``other``'s, alternated in fresh interpreters; medians and ratios."""
    sides = {"this": HERE, "baseline": other.resolve()}
    found: dict[tuple[str, str], list[int]] = {}
    for round_index in range(rounds):
        order = list(sides.items()) if round_index % 2 == 0 else list(sides.items())[::-1]
        for side, root in order:
            # Run from the checkout's root: ``-m`` puts it first on sys.path, so its vramguard is imported.
            done = subprocess.run([sys.executable, "-m", "bench.demand", "--seconds", str(seconds)], cwd=root,
                                  capture_output=True, text=True, check=True, env=untraced_environment())
            for line in done.stdout.splitlines():
                record = json.loads(line)
                found.setdefault((side, record["case"]), []).append(record["pods_per_cpu_second"])
    records = []
    for case, _ in CASES:
        this, baseline = statistics.median(found[("this", case)]), statistics.median(found[("baseline", case)])
        records.append({"case": case, "pods_per_cpu_second": round(this), "baseline_pods_per_cpu_second":
                        round(baseline), "ratio": round(this / baseline, 2), "rounds": rounds})
    return records


def main() -> None:
    """Run both cases and print one JSON line each."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="CPU seconds per case (default 3)")
    parser.add_argument("--against", type=Path, help="another checkout: alternate with it, print ratios")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per side with --against (default 5)")
    args = parser.parse_args()
    if args.against is not None:
        for record in against(args.against, args.rounds, args.seconds):
            print(json.dumps(record))
        return
    for name, make in CASES:
        print(json.dumps(measure(name, make, args.seconds)))


if __name__ == "__main__":
    main()
