"""Demo: start a control plane, add one Node per GPU sharing shape, schedule pods, show the decisions.

    python -m e2e.demo [--dir DIR] [--keep] [--second-scheduler]

With ``--keep`` the cluster stays up (``python -m e2e.cluster down --dir DIR`` stops it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from e2e import gpu_nodes
from e2e.cluster import Cluster

NODES = [
    gpu_nodes.exclusive("a100-exclusive", "A100-80GB", gpus=8),
    gpu_nodes.time_sliced("h100-timesliced", "H100-80GB", gpus=2, replicas=4),
    gpu_nodes.time_sliced("l40s-shared", "L40S", gpus=4, replicas=2, renamed=True),
    gpu_nodes.mps("h200-mps", "H200", gpus=1, replicas=4),
    gpu_nodes.mig_mixed("h100-mig", "H100-80GB", ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"], gpus=2),
]
REQUESTS = {
    "wants-gpu": {"nvidia.com/gpu": "1"},
    "wants-shared": {"nvidia.com/gpu.shared": "1"},
    "wants-mig": {"nvidia.com/mig-3g.40gb": "1"},
}


def _pod(name: str, limits: dict[str, str], scheduler: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10", "resources": {"limits": limits}}]
    }
    if scheduler:
        spec["schedulerName"] = scheduler
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns a process exit code."""
    parser = argparse.ArgumentParser(prog="python -m e2e.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="cluster directory (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="leave the cluster running")
    parser.add_argument("--second-scheduler", action="store_true")
    args = parser.parse_args(argv)
    directory = args.dir or Path(tempfile.mkdtemp(prefix="vramguard-demo-"))

    cluster = Cluster.up(directory, second_scheduler=args.second_scheduler, detach=args.keep)
    try:
        core = cluster.core_v1()
        for spec in NODES:
            gpu_nodes.create_gpu_node(core, spec)
            resources = ", ".join(f"{k}={v}" for k, v in gpu_nodes.gpu_resources(spec).items())
            print(f"node {spec.name:16} {gpu_nodes.gfd_labels(spec)['nvidia.com/gpu.product']:32} {resources}")
        scheduler = "vramguard" if args.second_scheduler else None
        for name, limits in REQUESTS.items():
            core.create_namespaced_pod(namespace="default", body=_pod(name, limits, scheduler))
        # Wait until each pod is bound or the scheduler has said why it is not.
        deadline = time.monotonic() + 30
        outcome: dict[str, str] = {}
        while time.monotonic() < deadline and len(outcome) < len(REQUESTS):
            for name in REQUESTS:
                pod = core.read_namespaced_pod(name=name, namespace="default")
                reasons = [c.message for c in pod.status.conditions or [] if c.reason == "Unschedulable"]
                if pod.spec.node_name:
                    outcome[name] = f"-> {pod.spec.node_name}"
                elif reasons:
                    outcome[name] = f"pending: {reasons[0]}"
            time.sleep(0.2)
        for name in REQUESTS:
            print(f"pod  {name:16} {outcome.get(name, 'no decision within 30s')}")
        if args.keep:
            print(f"export KUBECONFIG={cluster.kubeconfig}")
    finally:
        if not args.keep:
            cluster.down()
    return 0 if len(outcome) == len(REQUESTS) else 1


if __name__ == "__main__":
    sys.exit(main())
