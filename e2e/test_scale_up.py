"""Scale-up gates on the real control plane (docs/autoscaling.md): the webhook creates GPU pods
gated, the extender's leader lifts the gate, and what the API server and kube-scheduler then do.

The policy here turns scale-up on for Cluster Autoscaler (``kubernetes.io/hostname NotIn``) with
the shortest release timeout. A node added by the test plays the autoscaler's new node; the same
flow with a real autoscaler adding it is in ``e2e/test_karpenter.py``. Expected behaviour comes from
the API server and the scheduler: a gated pod's ``PodScheduled`` reason is ``SchedulingGated``
(``pkg/registry/core/pod/strategy.go``), gates may only be removed and a gated pod's required node
affinity may only grow (``pkg/apis/core/validation/validation.go``, v1.36.3), and kube-scheduler's
NodeAffinity plugin refuses a node a required term does not match.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e import build, gpu_nodes, kube
from e2e.cluster import Cluster
from e2e.scenario import pinned_vllm_pod, private_node, wait_for
from vramguard.scale_up import GATE, HOSTNAME_LABEL, RELEASED_ANNOTATION

pytestmark = pytest.mark.timeout(300)

TIMEOUT_SECONDS = 30
"""The policy's release timeout here (its minimum)."""


@pytest.fixture(scope="module")
def scaling(local_control_plane: build.Binaries, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    directory = tmp_path_factory.mktemp("scale-up")
    policy = yaml.safe_load((Path(__file__).resolve().parent.parent / "vramguard" / "default_policy.yaml").read_text())
    policy["scale_up"] = {"autoscaler": "cluster-autoscaler", "release_timeout_seconds": TIMEOUT_SECONDS}
    policy_file = directory / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(policy))
    cluster = Cluster.up(directory / "cluster", kube_version=local_control_plane.version, second_scheduler=True,
                         vramguard="on", policy=policy_file)
    try:
        yield cluster
    finally:
        cluster.down()


@pytest.fixture
def namespace(scaling: Cluster, unique: str) -> Iterator[str]:
    name = f"scale-{unique}"
    scaling.core_v1().create_namespace({"metadata": {"name": name}})
    yield name
    scaling.core_v1().delete_namespace(name)


def add_node(cluster: Cluster, unique: str, name: str = "h100") -> str:
    spec = private_node(gpu_nodes.time_sliced(name, "H100-80GB", gpus=1, replicas=4), unique)
    gpu_nodes.create_gpu_node(cluster.core_v1(), spec)
    return spec.name


def deployment(name: str, unique: str, utilization: str = "0.30", *, annotations: dict[str, str] | None = None,
               image: str = "vllm/vllm-openai:v0.21.0") -> dict[str, Any]:
    pod = pinned_vllm_pod(name, unique, utilization, annotations)
    pod["spec"]["containers"][0]["image"] = image
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}}, "template": {
            "metadata": {"labels": {"app": name}, "annotations": annotations or {}}, "spec": pod["spec"]}},
    }


def create_deployment(cluster: Cluster, namespace: str, body: dict[str, Any]) -> None:
    kube.kubernetes_module().client.AppsV1Api(cluster.api_client()).create_namespaced_deployment(namespace, body)


def the_pod(cluster: Cluster, namespace: str, app: str) -> Any:
    pods = cluster.core_v1().list_namespaced_pod(namespace, label_selector=f"app={app}").items
    live = [p for p in pods if not p.metadata.deletion_timestamp]
    return live[0] if len(live) == 1 else None


def scheduled_condition(pod: Any) -> tuple[str, str]:
    for condition in pod.status.conditions or ():
        if condition.type == "PodScheduled":
            return condition.reason or "", condition.message or ""
    return "", ""


def fill(cluster: Cluster, namespace: str, unique: str, node: str) -> None:
    """Three vLLM pods at 0.30 on ``node``'s H100: 24 GiB left, less than a fourth needs."""
    core = cluster.core_v1()
    for index in range(3):
        pod = pinned_vllm_pod(f"fill-{index}", unique)
        pod["spec"]["nodeSelector"][HOSTNAME_LABEL] = node
        core.create_namespaced_pod(namespace, pod)
    wait_for("the three pods bound", lambda: all(
        core.read_namespaced_pod(f"fill-{i}", namespace).spec.node_name == node for i in range(3)))


def test_a_pod_that_fits_an_existing_gpu_is_released_unchanged(scaling: Cluster, namespace: str,
                                                                 unique: str) -> None:
    node = add_node(scaling, unique)
    create_deployment(scaling, namespace, deployment("fits", unique))
    pod = wait_for("the pod bound", lambda: (p := the_pod(scaling, namespace, "fits")) and p.spec.node_name and p)
    assert pod.spec.node_name == node
    assert RELEASED_ANNOTATION in pod.metadata.annotations
    assert not pod.spec.affinity and not pod.spec.scheduling_gates


def test_a_pod_no_gpu_has_room_for_is_narrowed_then_binds_on_the_new_node(scaling: Cluster, namespace: str,
                                                                           unique: str) -> None:
    full = add_node(scaling, unique)
    fill(scaling, namespace, unique, full)
    create_deployment(scaling, namespace, deployment("fourth", unique))

    def narrowed() -> Any:
        pod = the_pod(scaling, namespace, "fourth")
        return pod if pod and scheduled_condition(pod)[0] == "Unschedulable" else None

    pod = wait_for("the fourth pod released and refused", narrowed)
    assert pod.metadata.annotations[RELEASED_ANNOTATION].endswith(" narrowed")
    terms = pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
    assert [(e.key, e.operator, e.values) for e in terms[0].match_expressions] == [(HOSTNAME_LABEL, "NotIn", [full])]
    # Refused by node affinity on the full node, the way an autoscaler's simulation refuses it too.
    assert "affinity" in scheduled_condition(pod)[1].lower()
    events = scaling.core_v1().list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={pod.metadata.name}")
    assert "VRAMScaleUp" in {e.reason for e in events.items}
    # What the autoscaler would do: a node comes. The pod binds there without being recreated.
    new = add_node(scaling, unique, "h100-new")
    bound = wait_for("the pod bound on the new node", lambda: (
        (p := scaling.core_v1().read_namespaced_pod(pod.metadata.name, namespace)).spec.node_name and p), 90)
    assert bound.spec.node_name == new


def test_a_pod_larger_than_any_gpu_stays_gated(scaling: Cluster, namespace: str, unique: str) -> None:
    add_node(scaling, unique)
    # 120 GiB declared for a server vramguard knows no engine of: more than an H100 has, empty.
    create_deployment(scaling, namespace, deployment(
        "huge", unique, annotations={"vramguard.io/vram": "120Gi"}, image="registry.example/ml/server:1.0"))
    core = scaling.core_v1()

    def warned() -> Any:
        pod = the_pod(scaling, namespace, "huge")
        if pod is None:
            return None
        events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod.metadata.name}")
        return pod if "VRAMScaleUpHeld" in {e.reason for e in events.items} else None

    pod = wait_for("the held pod's warning", warned)
    pod = core.read_namespaced_pod(pod.metadata.name, namespace)
    assert [g.name for g in pod.spec.scheduling_gates] == [GATE]
    assert scheduled_condition(pod)[0] == "SchedulingGated"  # what autoscalers skip

    # Removing vramguard with this pod left: `vramguard ungate` lifts the gate, unchanged, through
    # the API server's own validation of a gated pod's update.
    done = subprocess.run(
        [sys.executable, "-m", "vramguard", "ungate", "-n", namespace, "--kubeconfig", str(scaling.kubeconfig)],
        capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert f"{namespace}/{pod.metadata.name}: released" in done.stdout
    pod = core.read_namespaced_pod(pod.metadata.name, namespace)
    assert not pod.spec.scheduling_gates and pod.metadata.annotations[RELEASED_ANNOTATION]
    assert pod.spec.affinity is None or pod.spec.affinity.node_affinity is None
    # kube-scheduler now tries it, and the extender refuses it on every GPU.
    wait_for("the ungated pod refused", lambda: scheduled_condition(
        core.read_namespaced_pod(pod.metadata.name, namespace))[0] == "Unschedulable")


def test_a_released_pod_still_unschedulable_after_the_timeout_is_recreated(scaling: Cluster, namespace: str,
                                                                           unique: str) -> None:
    full = add_node(scaling, unique)
    fill(scaling, namespace, unique, full)
    create_deployment(scaling, namespace, deployment("stuck", unique))
    first = wait_for("the pod released", lambda: (p := the_pod(scaling, namespace, "stuck")) and
                     RELEASED_ANNOTATION in (p.metadata.annotations or {}) and p)
    # No node comes: past the timeout the pod is evicted, its ReplicaSet makes a new one, and that
    # one passes the gate again (narrowed anew).
    second = wait_for("a new pod, released again", lambda: (
        (p := the_pod(scaling, namespace, "stuck")) and p.metadata.uid != first.metadata.uid
        and RELEASED_ANNOTATION in (p.metadata.annotations or {}) and p), TIMEOUT_SECONDS + 60)
    assert second.spec.affinity.node_affinity is not None
    events = scaling.core_v1().list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={first.metadata.name}")
    assert "VRAMScaleUpRetry" in {e.reason for e in events.items}
