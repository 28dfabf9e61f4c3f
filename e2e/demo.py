"""The seed's scenario on a real control plane: vLLM pods sharing one time-sliced 80 GB H100.

    python -m e2e.demo [--dir DIR] [--keep] [--dra]

Starts etcd, kube-apiserver and kube-scheduler (built from source on first use) with the vramguard
extender and webhook wired in, adds one H100 node that the NVIDIA device plugin advertises as four
``nvidia.com/gpu`` replicas, then:

1. four vLLM pods at ``--gpu-memory-utilization 0.20`` (4 x 0.20 = 0.80 of the GPU): all bound;
2. four at 0.30 (1.20 of the GPU): three bound, the fourth stays Pending with the reason.

Without vramguard the scheduler would bind all four: four replicas are free. The fourth would then
die with CUDA OOM at start-up and crash-loop. A per-GPU table closes each act, then everything stops.

Where the machine allows it (root on Linux, Debian's containerd; see ``e2e.real_nodes``) the node is
real: a kubelet runs the pods (a stand-in for vLLM that prints what it was given, then sleeps), the
harness's device plugin gives each its GPU, and the node agent reports where each pod runs (the
table's AGENT column is ``fresh``). Elsewhere, with ``--fake-node`` or ``--keep``, the node is an API
object only: pods are bound and never start; the demo says why.

``--dra`` plays the same pods on a node of the DRA stack instead: no device plugin, the H100
published by the NVIDIA DRA driver in a ResourceSlice with ``--consumable-shares=unlimited``, and
the driver's DeviceClass mapping ``nvidia.com/gpu`` to it. The scheduler allocates each pod a share
of the GPU that consumes 0 bytes, so it alone would again place all four; vramguard holds what vLLM
reserves on the device DRA chose.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from e2e import device_plugin, dra_objects, gpu_nodes, real_nodes
from e2e.cluster import Cluster
from e2e.procs import free_port, wait_until
from vramguard.cli.kubectl_vram import ledger_rows
from vramguard.cluster import ClusterState
from vramguard.codecs import AGENT_REPORT_ANNOTATION
from vramguard.lease import DEFAULT_AGENT_NAMESPACE
from vramguard.policy import default_policy
from vramguard.report import gpu_table

NAMESPACE = "default"
NODE = gpu_nodes.time_sliced("gpu-node-1", "H100-80GB", gpus=1, replicas=4)
DRA_NODE = dra_objects.dra_node("gpu-node-1", "H100-80GB", gpus=1, shares="unlimited")
RESOURCE_API = dra_objects.RESOURCE_API
AGENT_LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{DEFAULT_AGENT_NAMESPACE}/leases"


def vllm_pod(name: str, utilization: str) -> dict[str, Any]:
    """A vLLM server as people write it: the image's entrypoint, flags in ``args``."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "chat"}},
        "spec": {
            "containers": [{
                "name": "vllm",
                "image": "vllm/vllm-openai:v0.21.0",
                "args": ["--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu-memory-utilization", utilization],
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
            }]
        },
    }


def wait_for_verdicts(
    core: Any, names: Sequence[str], *, running: bool = False, timeout: float = 60.0
) -> dict[str, tuple[str | None, str]]:
    """Each pod's node (with ``running``: once its container runs), or its Pending reason, once the
    scheduler has decided on all of them."""
    deadline = time.monotonic() + timeout
    while True:
        result: dict[str, tuple[str | None, str]] = {}
        started = True
        for name in names:
            pod = core.read_namespaced_pod(name, NAMESPACE)
            reason = next((c.message or "" for c in pod.status.conditions or ()
                           if c.type == "PodScheduled" and c.status == "False"), "")
            result[name] = (pod.spec.node_name, reason)
            if pod.spec.node_name and running and pod.status.phase != "Running":
                started = False
        if (started and all(node or reason for node, reason in result.values())) or time.monotonic() > deadline:
            return result
        time.sleep(0.3)


def gpu_report(cluster: Cluster) -> str:
    """The per-GPU table, rebuilt from the API server the way the extender builds its ledger."""
    state = ClusterState(default_policy())
    state.leases.replace(cluster.request("GET", AGENT_LEASES)["items"])
    state.nodes.replace(cluster.request("GET", "/api/v1/nodes")["items"])
    state.namespaces.replace(cluster.request("GET", "/api/v1/namespaces")["items"])
    state.pods.replace([p for p in cluster.request("GET", "/api/v1/pods")["items"] if p["spec"].get("nodeName")])
    # DRA devices and the claims the scheduler allocated on them (the extended-resource path).
    state.dra.slices.replace(cluster.request("GET", f"{RESOURCE_API}/resourceslices")["items"])
    state.dra.classes.replace(cluster.request("GET", f"{RESOURCE_API}/deviceclasses")["items"])
    state.dra.claims.replace(cluster.request("GET", f"{RESOURCE_API}/resourceclaims")["items"])
    state.sync_dra()
    return gpu_table(ledger_rows(state))


def act(cluster: Cluster, title: str, utilization: str, count: int = 4, *, real: bool = False) -> int:
    """Create ``count`` pods at ``utilization``, print where they went (on a real node: once they
    run) and the GPU table."""
    core = cluster.core_v1()
    print(f"\n== {title}: {count} vLLM pods at --gpu-memory-utilization {utilization} "
          f"({count} x {utilization} = {count * float(utilization):.2f} of the GPU)")
    names = [f"chat-{utilization.replace('.', '')}-{i}" for i in range(count)]
    for name in names:
        core.create_namespaced_pod(NAMESPACE, vllm_pod(name, utilization))
    verdicts = wait_for_verdicts(core, names, running=real)
    for name, (node, reason) in verdicts.items():
        phase = f" ({core.read_namespaced_pod(name, NAMESPACE).status.phase})" if node and real else ""
        print(f"  {name:14} -> {node}{phase}" if node else f"  {name:14} -> Pending: {reason}")
    if real:
        wait_for_report(cluster, sum(1 for node, _ in verdicts.values() if node))
    print()
    print(gpu_report(cluster), end="")
    for name in names:
        core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)
    if real:  # until the kubelet has stopped them and the pods are gone
        wait_until("the pods' removal", lambda: not core.list_namespaced_pod(NAMESPACE).items, timeout=60)
    return sum(1 for node, _ in verdicts.values() if node)


def wait_for_report(cluster: Cluster, pods: int) -> None:
    """Until the node's agent reports where ``pods`` pods run (the table's placements are then known)."""
    def reported() -> bool:
        annotations = cluster.core_v1().read_node(NODE.name).metadata.annotations or {}
        return len(json.loads(annotations.get(AGENT_REPORT_ANNOTATION) or "{}").get("pods") or {}) == pods
    wait_until("the agent's report", reported, timeout=30)


def real_node_problem(args: argparse.Namespace) -> str | None:
    """Why the node cannot be real on this machine or in this run (``None``: it can)."""
    if args.dra:
        return "the DRA act's GPU comes from a ResourceSlice with no driver on a kubelet behind it"
    if args.fake_node:
        return "--fake-node"
    if args.keep:
        return "--keep (a real node stops with this command)"
    reasons = real_nodes.missing()
    return "; ".join(reasons) if reasons else None


def main(argv: Sequence[str] | None = None) -> int:
    """Run both acts; exit 0 when vramguard placed exactly what fits."""
    parser = argparse.ArgumentParser(prog="python -m e2e.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="cluster directory (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="leave the cluster running afterwards")
    parser.add_argument("--dra", action="store_true",
                        help="the GPU comes from the NVIDIA DRA driver (a ResourceSlice, unlimited sharing)")
    parser.add_argument("--fake-node", action="store_true",
                        help="the node is an API object only, even where a real kubelet could run")
    args = parser.parse_args(argv)
    directory = args.dir or Path(tempfile.mkdtemp(prefix="vramguard-demo-"))
    problem = real_node_problem(args)
    real = problem is None
    cluster = Cluster.up(directory, vramguard="on", detach=args.keep)
    nodes = real_nodes.RealNodes(cluster)
    try:
        if args.dra:
            dra_objects.ensure_device_class(cluster.request)
            dra_objects.create_dra_node(cluster.request, DRA_NODE)
            print(f"node {DRA_NODE.name}: 1 x NVIDIA H100 80GB HBM3 ({DRA_NODE.model.memory_mib} MiB) in a "
                  "ResourceSlice of the NVIDIA DRA driver (gpu.nvidia.com, --consumable-shares=unlimited: a claim "
                  "without capacity.requests consumes 0), nvidia.com/gpu mapped to it by the DeviceClass "
                  "gpu.nvidia.com; vramguard keeps 3% of a shared GPU free and counts each engine's CUDA context")
        elif real:
            node = nodes.start(NODE)
            recording = directory / "nvml.json"
            recording.write_text(json.dumps(device_plugin.nvml_recording(NODE)))
            nodes.start_agent(node, recording, free_port())
            wait_for_report(cluster, 0)
            print(f"node {NODE.name}: a real kubelet (containerd) whose device plugin advertises 1 x NVIDIA H100 "
                  f"80GB HBM3 as nvidia.com/gpu: {NODE.replicas} (time-slicing), with the vramguard agent reading "
                  "the kubelet and a recorded NVML; the pods run a stand-in for vLLM. vramguard keeps 3% of a "
                  "shared GPU free and counts each engine's CUDA context")
        else:
            gpu_nodes.create_gpu_node(cluster.core_v1(), NODE)
            print(f"node {NODE.name}: 1 x NVIDIA H100 80GB HBM3 ({NODE.model.memory_mib} MiB), time-sliced, "
                  f"advertised as nvidia.com/gpu: {NODE.replicas}; vramguard keeps 3% of a shared GPU free "
                  "and counts each engine's CUDA context")
            print(f"(the node is an API object only, pods are bound but never start: {problem})")
        first = act(cluster, "Act 1", "0.20", real=real)
        time.sleep(1.0)  # let the deletions reach the extender's watch
        second = act(cluster, "Act 2", "0.30", real=real)
        ok = first == 4 and second == 3
        print("\nvramguard bound the pods that fit and kept the one that would crash-loop Pending."
              if ok else "\nunexpected placement; see the logs in " + str(cluster.logs))
        if args.keep:
            print(f"export KUBECONFIG={cluster.kubeconfig}")
    finally:
        nodes.stop()
        if not args.keep:
            cluster.down()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
