"""Adopting vramguard without breakage, and preemption by VRAM, on the real control plane.

The rollout the README describes, played with the shipped policy: whole-GPU and MIG workloads keep
being placed after installation (only over-budget placements are refused), ``vramguard audit``
shows what the class rules would refuse, then one namespace moves to warn and to enforce.
The preemption test checks that a high-priority pod on a full GPU evicts the pods whose VRAM it
needs, and nothing else.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e import gpu_nodes
from e2e.kube import api_exception
from e2e.scenario import pin_to_test, private_node, require_extender, wait_for
from vramguard.cli import main
from vramguard.cli.audit import audit_snapshot
from vramguard.cli.kubectl_vram import read_cluster
from vramguard.codecs import CLASS_FINDINGS_ANNOTATION as FINDINGS_ANNOTATION
from vramguard.policy import default_policy

pytestmark = pytest.mark.timeout(480)


def add_node(core_v1: Any, unique: str, spec: gpu_nodes.GPUNodeSpec) -> str:
    spec = private_node(spec, unique)
    gpu_nodes.create_gpu_node(core_v1, spec)
    return spec.name


def gpu_pod(name: str, unique: str, resource: str, count: int, *, args: list[str] | None = None,
            image: str = "vllm/vllm-openai:v0.21.0", node: str | None = None, priority_class: str | None = None,
            ) -> dict[str, Any]:
    """A GPU pod pinned to this test's nodes (and to ``node`` when given)."""
    spec: dict[str, Any] = {"containers": [{
        "name": "main", "image": image, "args": args or [],
        "resources": {"limits": {resource: str(count)}},
    }]}
    if node is not None:
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}
    if priority_class is not None:
        spec["priorityClassName"] = priority_class
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": pin_to_test(spec, unique)}


def vllm(utilization: str) -> list[str]:
    return ["--model", "m", "--gpu-memory-utilization", utilization]


def scheduling_message(core_v1: Any, namespace: str, name: str) -> str:
    pod = core_v1.read_namespaced_pod(name, namespace)
    for condition in pod.status.conditions or ():
        if condition.type == "PodScheduled" and condition.status == "False":
            return str(condition.message or "")
    return ""


def bound_to(core_v1: Any, namespace: str, name: str) -> str | None:
    return core_v1.read_namespaced_pod(name, namespace).spec.node_name  # type: ignore[no-any-return]


def delete_now(core_v1: Any, namespace: str, name: str) -> None:
    """Delete with grace period 0 and wait until it is gone, as a kubelet would finish a deletion."""
    core_v1.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
    wait_for(f"{name} gone",
             lambda: name not in {p.metadata.name for p in core_v1.list_namespaced_pod(namespace).items})


def label_namespace(core_v1: Any, namespace: str, labels: dict[str, str | None]) -> None:
    core_v1.patch_namespace(namespace, {"metadata": {"labels": labels}})
    time.sleep(2.0)  # the extender and the webhook follow namespaces by watch


def audit_placements(cluster: Any, namespace: str) -> dict[str, tuple[str, str]]:
    """``vramguard audit``'s placements in ``namespace``: pod -> (rule, outcome)."""
    snapshot, _ = read_cluster(str(cluster.kubeconfig), None, workloads=True)
    report = audit_snapshot(snapshot, default_policy())
    return {f.name: (f.rule, f.outcome) for f in report.placements if f.namespace == namespace}


def cli(cluster: Any, tmp_path: Path, command: str, *objects: dict[str, Any]) -> tuple[int, Any]:
    """``vramguard <command> --cluster -o json`` on ``objects``: its exit code and its JSON answer."""
    path = tmp_path / f"{command}.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([command, "--cluster", "--kubeconfig", str(cluster.kubeconfig), "-o", "json", str(path)])
    return code, json.loads(out.getvalue())


def test_rollout_from_install_to_enforce(
    cluster: Any, core_v1: Any, namespace: str, unique: str, tmp_path: Path
) -> None:
    """Install: nothing that fits is refused; audit; then warn; then enforce refuses what the class forbids."""
    require_extender(cluster)
    eight = add_node(core_v1, unique, gpu_nodes.exclusive("a100-8x", "A100-80GB", gpus=8))
    single = add_node(core_v1, unique, gpu_nodes.exclusive("a100-1x", "A100-80GB", gpus=1))
    mig = add_node(core_v1, unique, gpu_nodes.mig_mixed("a100-mig", "A100-80GB", ["1g.10gb"] * 7))
    shared = add_node(core_v1, unique, gpu_nodes.time_sliced("h100-ts", "H100-80GB", replicas=4))

    # 1. Installed with the shipped policy: the workloads that ran before are placed again (the
    # training pod first, so that the pods preferring time-sliced GPUs meet a full 8-GPU node).
    pods = {
        "train": gpu_pod("train", unique, "nvidia.com/gpu", 8, image="trainer:1"),
        "vllm-whole": gpu_pod("vllm-whole", unique, "nvidia.com/gpu", 1, args=vllm("0.85"), node=single),
        "vllm-mig": gpu_pod("vllm-mig", unique, "nvidia.com/mig-1g.10gb", 1, args=vllm("0.85")),
        "chat": gpu_pod("chat", unique, "nvidia.com/gpu", 1, args=vllm("0.3")),
    }
    expected = {"train": eight, "vllm-whole": single, "vllm-mig": mig, "chat": shared}
    for name, node in expected.items():
        core_v1.create_namespaced_pod(namespace, pods[name])
        assert wait_for(f"{name} bound", lambda name=name: bound_to(core_v1, namespace, name)) == node
        annotations = core_v1.read_namespaced_pod(name, namespace).metadata.annotations or {}
        assert FINDINGS_ANNOTATION not in annotations
    # ...and an over-budget placement is refused: the VRAM arithmetic holds in every mode (0.99 of a
    # MIG instance it owns, plus its CUDA context, is more than the instance).
    core_v1.create_namespaced_pod(namespace, gpu_pod("greedy", unique, "nvidia.com/mig-1g.10gb", 1,
                                                     args=vllm("0.99")))
    message = wait_for("greedy refused", lambda: scheduling_message(core_v1, namespace, "greedy"))
    assert "VRAM budget" in message, message
    assert audit_placements(cluster, namespace) == {}
    # `plan --cluster` answers as the cluster does: on the nodes, with the pods bound there.
    second = {**gpu_pod("chat-2", unique, "nvidia.com/gpu", 1, args=vllm("0.3")), "metadata": {
        "name": "chat-2", "namespace": namespace}}
    code, planned = cli(cluster, tmp_path, "plan", second)
    assert code == 0, planned
    assert [(p["pod"], p["node"]) for p in planned["placed"] if not p["bound"]] == [(f"{namespace}/chat-2", shared)]
    core_v1.create_namespaced_pod(namespace, second)
    assert wait_for("chat-2 bound", lambda: bound_to(core_v1, namespace, "chat-2")) == shared

    # 2. The platform team picks a class for the namespace: audit shows what it would refuse.
    label_namespace(core_v1, namespace, {"vramguard.io/qos-class": "shared"})
    assert audit_placements(cluster, namespace) == {
        "train": ("class-rule", "audited"), "vllm-whole": ("class-rule", "audited"),
        "vllm-mig": ("class-rule", "audited"),
    }
    # A workload rescheduled in audit mode still lands; the finding rides on the Binding.
    delete_now(core_v1, namespace, "vllm-whole")
    core_v1.create_namespaced_pod(namespace, pods["vllm-whole"])
    assert wait_for("vllm-whole bound", lambda: bound_to(core_v1, namespace, "vllm-whole")) == single
    annotations = core_v1.read_namespaced_pod("vllm-whole", namespace).metadata.annotations
    assert json.loads(annotations[FINDINGS_ANNOTATION])[0]["rule"] == "class-rule"
    assert not class_events(core_v1, namespace, "vllm-whole")

    # 3. warn: placed, with one Warning Event on the pod.
    label_namespace(core_v1, namespace, {"vramguard.io/enforce": "warn"})
    delete_now(core_v1, namespace, "vllm-whole")
    core_v1.create_namespaced_pod(namespace, pods["vllm-whole"])
    assert wait_for("vllm-whole bound", lambda: bound_to(core_v1, namespace, "vllm-whole")) == single
    events = wait_for("the warning event", lambda: class_events(core_v1, namespace, "vllm-whole"))
    assert len(events) == 1 and "class shared does not allow unshared GPUs" in events[0].message
    assert audit_placements(cluster, namespace)["vllm-whole"] == ("class-rule", "warned")

    # 4. enforce: the next time the workload is scheduled, the class rule refuses the node.
    label_namespace(core_v1, namespace, {"vramguard.io/enforce": "enforce"})
    assert audit_placements(cluster, namespace)["train"] == ("class-rule", "refused")
    for name in ("vllm-whole", "train"):
        delete_now(core_v1, namespace, name)
        core_v1.create_namespaced_pod(namespace, pods[name])
        message = wait_for(f"{name} refused", lambda name=name: scheduling_message(core_v1, namespace, name))
        assert "class shared does not allow unshared GPUs" in message, message
        assert bound_to(core_v1, namespace, name) is None
    # A MIG pod is refused already at admission: the webhook enforces the same class rule, and
    # `explain` and `plan` with --cluster say so, reading the namespace's labels from the cluster.
    delete_now(core_v1, namespace, "vllm-mig")
    mig_pod = {**pods["vllm-mig"], "metadata": {"name": "vllm-mig", "namespace": namespace}}
    code, [explained] = cli(cluster, tmp_path, "explain", mig_pod)
    assert code == 1
    assert (explained["class"], explained["enforcement"], explained["admission"]["allowed"]) == (
        "shared", "enforce", False)
    assert "class shared does not allow MIG" in explained["admission"]["message"]
    code, planned = cli(cluster, tmp_path, "plan", mig_pod)
    assert code == 1
    assert [p for p in planned["placed"] if not p["bound"]] == []
    [refused] = [p for p in planned["pending"] if p["pod"] == f"{namespace}/vllm-mig"]
    assert refused["reasons"]["-"]["rule"] == "admission"
    with pytest.raises(api_exception()) as denied:
        core_v1.create_namespaced_pod(namespace, pods["vllm-mig"])
    assert "class shared does not allow MIG" in str(getattr(denied.value, "body", denied.value))


def class_events(core_v1: Any, namespace: str, pod: str) -> list[Any]:
    events = core_v1.list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod}").items
    return [e for e in events if e.reason == "ClassRuleNotEnforced"]


@pytest.fixture
def priority_classes(cluster: Any, unique: str) -> Iterator[tuple[str, str]]:
    """A low and a high PriorityClass of this test's own."""
    names = (f"e2e-low-{unique}", f"e2e-high-{unique}")
    for name, value in zip(names, (100, 1_000_000), strict=True):
        cluster.request("POST", "/apis/scheduling.k8s.io/v1/priorityclasses",
                        {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                         "metadata": {"name": name}, "value": value})
    yield names
    for name in names:
        cluster.request("DELETE", f"/apis/scheduling.k8s.io/v1/priorityclasses/{name}")


def bind_urgent_evicting(core_v1: Any, namespace: str) -> tuple[str | None, set[str]]:
    """Wait for pod ``urgent`` to bind, finishing the deletions preemption starts as a kubelet would
    (none runs here); the node it bound to and the pods evicted on the way."""
    evicted: set[str] = set()

    def urgent_bound() -> str | None:
        for pod in core_v1.list_namespaced_pod(namespace).items:
            if pod.metadata.deletion_timestamp is not None and pod.metadata.name not in evicted:
                evicted.add(pod.metadata.name)
                core_v1.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
        return bound_to(core_v1, namespace, "urgent")

    # kube-scheduler does not always retry a pod the extender refused when its victims go: it may wait
    # for another event or its flush of unschedulable pods, which the vramguard scheduler runs every
    # 30 s (--pod-max-in-unschedulable-pods-duration, manifests/base/scheduler.yaml; 5 minutes by
    # default), so the pod binds within that, not always at once.
    return wait_for("urgent bound", urgent_bound, timeout=90), evicted


def fill_then_preempt(core_v1: Any, namespace: str, unique: str, node: str, sizes: dict[str, str], urgent: str,
                      priorities: tuple[str, str], labels: dict[str, dict[str, str]] | None = None,
                      ) -> tuple[str | None, set[str]]:
    """Place the low-priority vLLM pods ``sizes`` (name -> utilization) on ``node``, then a
    high-priority one of ``urgent``; the node it bound to and the pods evicted on the way."""
    low, high = priorities
    for name, size in sizes.items():
        pod = gpu_pod(name, unique, "nvidia.com/gpu", 1, args=vllm(size), priority_class=low)
        if labels is not None:
            pod["metadata"]["labels"] = labels[name]
        core_v1.create_namespaced_pod(namespace, pod)
    for name in sizes:
        assert wait_for(f"{name} bound", lambda name=name: bound_to(core_v1, namespace, name)) == node
    core_v1.create_namespaced_pod(namespace, gpu_pod("urgent", unique, "nvidia.com/gpu", 1, args=vllm(urgent),
                                                     priority_class=high))
    return bind_urgent_evicting(core_v1, namespace)


def test_preemption_evicts_the_pods_that_free_the_vram(
    cluster: Any, core_v1: Any, namespace: str, unique: str, priority_classes: tuple[str, str]
) -> None:
    """A 0.5 pod of high priority on a full GPU evicts the two 0.35 pods, not the 0.1 ones."""
    require_extender(cluster)
    node = add_node(core_v1, unique, gpu_nodes.time_sliced("h100", "H100-80GB", replicas=4))
    sizes = {"small-1": "0.1", "small-2": "0.1", "big-1": "0.35", "big-2": "0.35"}
    bound, evicted = fill_then_preempt(core_v1, namespace, unique, node, sizes, "0.5", priority_classes)
    assert bound == node
    assert evicted == {"big-1", "big-2"}
    survivors = {p.metadata.name: p for p in core_v1.list_namespaced_pod(namespace).items}
    assert set(survivors) == {"small-1", "small-2", "urgent"}
    assert all(p.metadata.deletion_timestamp is None for p in survivors.values())



def test_preemption_spares_the_pod_a_disruption_budget_protects(
    cluster: Any, core_v1: Any, namespace: str, unique: str, priority_classes: tuple[str, str]
) -> None:
    """A 0.4 pod of high priority on a full GPU: evicting the 0.45 pod or the 0.4 pod makes the room.
    A PodDisruptionBudget protects the 0.45 one (minAvailable 1 over its one pod: no disruption
    allowed), so the 0.4 one goes, as kube-scheduler's own preemption would choose."""
    require_extender(cluster)
    node = add_node(core_v1, unique, gpu_nodes.time_sliced("h100", "H100-80GB", replicas=4))
    protected = {"app": f"protected-{unique}"}
    cluster.request("POST", f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets", {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "protect"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": protected}}})
    sizes = {"protected": "0.45", "plain": "0.4", "tiny-1": "0.03", "tiny-2": "0.03"}
    labels = {name: protected if name == "protected" else {"app": f"plain-{unique}"} for name in sizes}
    bound, evicted = fill_then_preempt(core_v1, namespace, unique, node, sizes, "0.4", priority_classes, labels)
    assert bound == node
    assert evicted == {"plain"}


def test_preemption_for_vram_on_a_time_sliced_gpu_with_replicas_left(
    cluster: Any, core_v1: Any, namespace: str, unique: str, priority_classes: tuple[str, str]
) -> None:
    """Eight replicas, three held by low-priority pods whose VRAM leaves less than half the GPU: a
    0.5 pod of high priority. kube-scheduler's dry run needs no victim for a replica ("expected at
    least one victim pod") and never asks /preempt; the extender's evictor evicts the two largest
    through the Eviction API, each with a Preempted Event, and the pod binds."""
    require_extender(cluster)
    node = add_node(core_v1, unique, gpu_nodes.time_sliced("h100", "H100-80GB", replicas=8))
    sizes = {"low-1": "0.3", "low-2": "0.3", "low-big": "0.35"}
    bound, evicted = fill_then_preempt(core_v1, namespace, unique, node, sizes, "0.5", priority_classes)
    assert bound == node
    assert "low-big" in evicted and len(evicted) == 2, evicted
    for name in evicted:
        events = core_v1.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
        assert any(e.reason == "Preempted" and e.source.component == "vramguard-extender" for e in events), name
    survivors = {p.metadata.name for p in core_v1.list_namespaced_pod(namespace).items}
    assert survivors == {*sizes, "urgent"} - evicted
