"""The scheduler extender on the real control plane: kube-apiserver, kube-scheduler, vramguard.

Every test gets its own namespace and its own GPU nodes, tainted so that only its pods (which
tolerate the taint and select the nodes) can land there: the session cluster is shared.
"""

from __future__ import annotations

import json
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from e2e import gpu_nodes
from e2e.scenario import ledger_from_api, pin_to_test, private_node, require_extender, violations_on_own_nodes

pytestmark = pytest.mark.timeout(240)

def add_nodes(core_v1: Any, unique: str, *specs: gpu_nodes.GPUNodeSpec) -> list[str]:
    """Create GPU nodes only this test's pods can use."""
    names = []
    for template in specs:
        spec = private_node(template, unique)
        gpu_nodes.create_gpu_node(core_v1, spec)
        names.append(spec.name)
    return names


def vllm_pod(name: str, utilization: str, unique: str, *, gpus: int = 1, qos: str | None = None,
             resource: str = "nvidia.com/gpu") -> dict[str, Any]:
    """A vLLM pod as people write them, pinned to this test's nodes."""
    args = ["--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu-memory-utilization", utilization]
    if gpus > 1:
        args += ["--tensor-parallel-size", str(gpus)]
    labels = {"vramguard.io/qos-class": qos} if qos else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": pin_to_test({
            "containers": [{
                "name": "vllm",
                "image": "vllm/vllm-openai:v0.21.0",
                "args": args,
                "resources": {"limits": {resource: str(gpus)}},
            }],
        }, unique),
    }


def create_all(core_v1: Any, namespace: str, pods: list[dict[str, Any]]) -> None:
    """Create pods concurrently, as a Deployment scale-up would."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda pod: core_v1.create_namespaced_pod(namespace, pod), pods))


def placements(core_v1: Any, namespace: str) -> dict[str, str | None]:
    """Pod name -> node (``None`` while pending)."""
    return {p.metadata.name: p.spec.node_name for p in core_v1.list_namespaced_pod(namespace).items}


def settle(core_v1: Any, namespace: str, expected_bound: int, timeout: float = 60.0) -> dict[str, str | None]:
    """Wait until ``expected_bound`` pods are bound and every other pod has a scheduling verdict."""
    deadline = time.monotonic() + timeout
    while True:
        pods = core_v1.list_namespaced_pod(namespace).items
        bound = [p for p in pods if p.spec.node_name]
        judged = [p for p in pods if not p.spec.node_name and scheduling_message(p)]
        if len(bound) >= expected_bound and len(bound) + len(judged) == len(pods):
            return {p.metadata.name: p.spec.node_name for p in pods}
        if time.monotonic() > deadline:
            state = {p.metadata.name: (p.spec.node_name, scheduling_message(p)) for p in pods}
            raise AssertionError(f"pods did not settle: {json.dumps(state, indent=1)}")
        time.sleep(0.25)


def scheduling_message(pod: Any) -> str:
    """The PodScheduled=False message the scheduler wrote, or ``""``."""
    for condition in pod.status.conditions or ():
        if condition.type == "PodScheduled" and condition.status == "False":
            return str(condition.message or "")
    return ""


def failed_scheduling_events(core_v1: Any, namespace: str, pod: str) -> list[str]:
    """Messages of the pod's FailedScheduling events."""
    events = core_v1.list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod}").items
    return [e.message for e in events if e.reason == "FailedScheduling"]


def test_seed_four_pods_at_020_all_run(cluster: Any, core_v1: Any, namespace: str, unique: str) -> None:
    require_extender(cluster)
    [node] = add_nodes(core_v1, unique, gpu_nodes.time_sliced("h100", "H100-80GB", gpus=1, replicas=4))
    create_all(core_v1, namespace, [vllm_pod(f"chat-{i}", "0.20", unique) for i in range(4)])
    assert settle(core_v1, namespace, 4) == {f"chat-{i}": node for i in range(4)}
    # The decision travels in the Binding; the API server records it on the pod.
    pod = core_v1.read_namespaced_pod("chat-0", namespace)
    placement = json.loads(pod.metadata.annotations["vramguard.io/placement"])
    assert placement == {"node": node, "containers": {"vllm": ["0"]}}


def test_seed_fourth_pod_at_030_stays_pending_naming_vram(
    cluster: Any, core_v1: Any, namespace: str, unique: str
) -> None:
    require_extender(cluster)
    [node] = add_nodes(core_v1, unique, gpu_nodes.time_sliced("h100", "H100-80GB", gpus=1, replicas=4))
    create_all(core_v1, namespace, [vllm_pod(f"chat-{i}", "0.30", unique) for i in range(4)])
    placed = settle(core_v1, namespace, 3)
    assert sorted(n for n in placed.values() if n) == [node] * 3
    [pending] = [name for name, n in placed.items() if n is None]
    pod = core_v1.read_namespaced_pod(pending, namespace)
    message = scheduling_message(pod)
    # The filter's line for the kind of device, or bind's numbers for the device, whichever refused last.
    assert "VRAM budget free" in message and re.search(r"GPU (\d )?\(NVIDIA H100 80GB HBM3\)", message), message
    deadline = time.monotonic() + 20
    while not failed_scheduling_events(core_v1, namespace, pending) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert any("VRAM" in m for m in failed_scheduling_events(core_v1, namespace, pending))


def test_heterogeneous_gpus_fractions_are_of_the_gpu_they_land_on(
    cluster: Any, core_v1: Any, namespace: str, unique: str
) -> None:
    require_extender(cluster)
    h100, h200 = add_nodes(core_v1, unique, gpu_nodes.time_sliced("h100", "H100-80GB", replicas=4),
                           gpu_nodes.time_sliced("h200", "H200", replicas=4))
    create_all(core_v1, namespace, [vllm_pod(f"big-{i}", "0.5", unique) for i in range(3)])
    placed = settle(core_v1, namespace, 2)
    assert sorted(n for n in placed.values() if n) == sorted([h100, h200])


def test_class_steering(cluster: Any, core_v1: Any, namespace: str, unique: str) -> None:
    require_extender(cluster)
    shared, whole = add_nodes(core_v1, unique, gpu_nodes.time_sliced("shared", "H100-80GB", replicas=4),
                              gpu_nodes.exclusive("whole", "H100-80GB", gpus=1))
    create_all(core_v1, namespace, [
        vllm_pod("tenant", "0.9", unique, qos="guaranteed"),
        vllm_pod("burst", "0.2", unique, qos="best-effort"),
    ])
    assert settle(core_v1, namespace, 2) == {"tenant": whole, "burst": shared}


def test_multi_gpu_time_sliced_node_is_never_overcommitted(
    cluster: Any, core_v1: Any, namespace: str, unique: str
) -> None:
    require_extender(cluster)
    [node] = add_nodes(core_v1, unique, gpu_nodes.time_sliced("quad", "H100-80GB", gpus=2, replicas=4))
    create_all(core_v1, namespace, [vllm_pod(f"p{i}", "0.30", unique) for i in range(5)])
    placed = settle(core_v1, namespace, 3)
    # The device plugin may stack four replicas on one GPU: until the agent reports where the pods
    # really run, three pods at 0.30 is what no choice of the plugin can overcommit.
    assert sum(1 for n in placed.values() if n == node) == 3
    pending = [name for name, n in placed.items() if n is None]
    message = scheduling_message(core_v1.read_namespaced_pod(pending[0], namespace))
    assert "whose GPU is not known yet" in message, message
    assert violations_on_own_nodes(cluster, unique) == []


def test_two_hundred_pods_at_once_onto_twenty_nodes(
    cluster: Any, core_v1: Any, namespace: str, unique: str
) -> None:
    require_extender(cluster)
    add_nodes(core_v1, unique, *[gpu_nodes.time_sliced(f"n{i:02}", "H100-80GB", replicas=4) for i in range(20)])
    sizes = ["0.20", "0.30", "0.45"]
    create_all(core_v1, namespace, [vllm_pod(f"p{i:03}", sizes[i % 3], unique) for i in range(200)])
    # 20 GPUs x 4 replicas = 80 replica slots; the bytes, not the slots, decide.
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        placed = placements(core_v1, namespace)
        pods = core_v1.list_namespaced_pod(namespace).items
        if all(p.spec.node_name or scheduling_message(p) for p in pods) and len(pods) == 200:
            break
        time.sleep(1)
    placed = placements(core_v1, namespace)
    bound = [n for n in placed.values() if n]
    assert len(bound) >= 40, f"only {len(bound)} pods bound"
    state = ledger_from_api(cluster)
    assert violations_on_own_nodes(cluster, unique) == []  # other tests' nodes have their own states
    for node in set(bound):
        for row in state.ledger.usage(node):
            assert row.worst_bytes <= row.budget


def test_extender_killed_and_restarted_while_scheduling(
    cluster: Any, core_v1: Any, namespace: str, unique: str
) -> None:
    require_extender(cluster)
    add_nodes(core_v1, unique, *[gpu_nodes.time_sliced(f"r{i}", "H100-80GB", replicas=4) for i in range(4)])
    pods = [vllm_pod(f"p{i:02}", "0.30", unique) for i in range(16)]
    create_all(core_v1, namespace, pods[:8])
    time.sleep(1.0)
    cluster.restart_vramguard("extender", signal.SIGKILL)  # mid-wave: some bound, some not
    create_all(core_v1, namespace, pods[8:])
    placed = settle(core_v1, namespace, 12, timeout=120)
    # 4 GPUs x 3 pods at 0.30 (0.90 of each) = 12; the other 4 stay pending, none is lost.
    assert len(placed) == 16
    assert sum(1 for n in placed.values() if n) == 12
    assert violations_on_own_nodes(cluster, unique) == []
