"""Scale-up with a real autoscaler: Karpenter (sigs.k8s.io/karpenter v1.15.0, its kwok provider) on
the real control plane, with the policy's ``scale_up: {autoscaler: karpenter}`` (docs/autoscaling.md).

What Karpenter does is its own: it provisions only for pods whose ``PodScheduled`` reason is
``Unschedulable`` and fits them on existing nodes first by resource counts, node affinity and
taints (``pkg/controllers/provisioning/scheduling/scheduler.go``, ``existingnode.go``); it
consolidates nodes whose pods fit elsewhere, and never a node running a pod annotated
``karpenter.sh/do-not-disrupt`` (``pkg/controllers/disruption``). So:

- a GPU pod no GPU has the VRAM for, excluded from the full node by ``vramguard.io/node NotIn``,
  makes Karpenter launch a node, and binds there through vramguard's extender;
- a pod larger than any GPU stays gated: Karpenter never sees it and launches nothing;
- the new node, holding the pod, is not consolidated (the webhook gave the pod
  ``karpenter.sh/do-not-disrupt``) even though by GPU count its pod would fit the old node's free
  replica; once empty, it is removed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e import build, gpu_nodes, karpenter, kube
from e2e.cluster import Cluster
from e2e.scenario import TEST_LABEL, private_node, wait_for
from e2e.test_scale_up import create_deployment, deployment, fill, scheduled_condition, the_pod
from vramguard.policy import SCALE_UP_LABEL
from vramguard.scale_up import GATE

pytestmark = pytest.mark.timeout(420)

H100 = gpu_nodes.gpu_model("H100-80GB")


class Scene:
    def __init__(self, cluster: Cluster, provider: karpenter.Karpenter, unique: str) -> None:
        self.cluster = cluster
        self.karpenter = provider
        self.unique = unique


@pytest.fixture(scope="module")
def scene(local_control_plane: build.Binaries, karpenter_build: karpenter.KarpenterBuild,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    directory = tmp_path_factory.mktemp("karpenter")
    policy = yaml.safe_load((Path(__file__).resolve().parent.parent / "vramguard" / "default_policy.yaml").read_text())
    # The node group's GPU is an H100: a pod no H100 holds must make no node, even before any node exists.
    policy["scale_up"] = {"autoscaler": "karpenter", "release_timeout_seconds": 30,
                          "largest_gpu_memory": f"{H100.memory_mib}Mi"}
    policy_file = directory / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(policy))
    cluster = Cluster.up(directory / "cluster", kube_version=local_control_plane.version, second_scheduler=True,
                         vramguard="on", policy=policy_file)
    unique = f"k{int(time.time()) % 100000}"
    # The new nodes carry the test's label and taint, as the private fake nodes do.
    instance = karpenter.gpu_instance_type("h100x1", gpus=1, replicas=4, product="NVIDIA-H100-80GB-HBM3",
                                           memory_mib=H100.memory_mib)
    pool = karpenter.node_pool("gpu", "h100x1", labels={TEST_LABEL: unique},
                               taints=[{"key": TEST_LABEL, "value": unique, "effect": "NoSchedule"}])
    try:
        with karpenter.running(cluster, karpenter_build, directory / "karpenter", [instance], [pool]) as provider:
            yield Scene(cluster, provider, unique)
            assert provider.errors == [], provider.errors
    finally:
        cluster.down()


@pytest.fixture
def namespace(scene: Scene, unique: str) -> Iterator[str]:
    name = f"karpenter-{unique}"
    scene.cluster.core_v1().create_namespace({"metadata": {"name": name}})
    yield name
    scene.cluster.core_v1().delete_namespace(name)


def full_node(scene: Scene, namespace: str) -> str:
    """A GPU node outside Karpenter, its H100 holding three pods at 0.30: one replica left, 24 GiB."""
    spec = private_node(gpu_nodes.time_sliced("full", "H100-80GB", gpus=1, replicas=4), scene.unique)
    gpu_nodes.create_gpu_node(scene.cluster.core_v1(), spec)
    fill(scene.cluster, namespace, scene.unique, spec.name)
    return spec.name


def test_a_pod_too_big_for_any_gpu_makes_karpenter_launch_nothing(scene: Scene, namespace: str) -> None:
    before = len(scene.karpenter.nodeclaims())
    create_deployment(scene.cluster, namespace, deployment(
        "huge", scene.unique, annotations={"vramguard.io/vram": "120Gi"}, image="registry.example/ml/server:1.0"))
    core = scene.cluster.core_v1()

    def held() -> Any:
        pod = the_pod(scene.cluster, namespace, "huge")
        if pod is None:
            return None
        events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod.metadata.name}")
        return pod if "VRAMScaleUpHeld" in {e.reason for e in events.items} else None

    pod = wait_for("the held pod's warning", held, 60)
    time.sleep(10)  # Karpenter's batch window is 2 s here: time for it to act, were the pod visible
    pod = core.read_namespaced_pod(pod.metadata.name, namespace)
    assert [g.name for g in pod.spec.scheduling_gates] == [GATE]
    assert len(scene.karpenter.nodeclaims()) == before, scene.karpenter.log_tail()


def test_a_pod_pending_for_vram_gets_a_karpenter_node_which_is_kept_while_it_runs(scene: Scene, namespace: str) -> None:
    full = full_node(scene, namespace)
    before = {n["metadata"]["name"] for n in scene.karpenter.nodes()}
    started = time.monotonic()
    create_deployment(scene.cluster, namespace, deployment("fourth", scene.unique))
    core = scene.cluster.core_v1()

    def bound() -> Any:
        pod = the_pod(scene.cluster, namespace, "fourth")
        return pod if pod is not None and pod.spec.node_name else None

    try:
        pod = wait_for("the pod bound on a new node", bound, 120)
    except AssertionError as error:
        pod = the_pod(scene.cluster, namespace, "fourth")
        raise AssertionError(f"{error}: {scheduled_condition(pod) if pod else None}\n"
                             f"{scene.karpenter.log_tail()}") from None
    print(f"pod created to bound on Karpenter's new node: {time.monotonic() - started:.1f}s")
    made = {n["metadata"]["name"] for n in scene.karpenter.nodes()} - before
    assert pod.spec.node_name in made, (pod.spec.node_name, made)
    assert len(made) == 1
    # The full node was excluded by vramguard's label, which the extender gave it.
    full_labels = core.read_node(full).metadata.labels
    terms = pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
    assert [(e.key, e.operator, e.values) for e in terms[0].match_expressions] == [
        (SCALE_UP_LABEL, "NotIn", [full_labels[SCALE_UP_LABEL]])]
    assert pod.metadata.annotations.get("karpenter.sh/do-not-disrupt") == "true"

    # Consolidation runs 5 s after a node is underused. By GPU count this pod would fit the full
    # node's free replica, but it runs with karpenter.sh/do-not-disrupt: its node stays.
    new = pod.spec.node_name
    time.sleep(30)
    assert new in {n["metadata"]["name"] for n in scene.karpenter.nodes()}, scene.karpenter.log_tail()
    assert core.read_namespaced_pod(pod.metadata.name, namespace).spec.node_name == new

    # Once empty, Karpenter removes it: consolidation was on all along.
    scale = {"spec": {"replicas": 0}}
    karpenter_apps(scene).patch_namespaced_deployment_scale("fourth", namespace, scale)
    emptied = time.monotonic()
    wait_for("the empty node removed", lambda: new not in {n["metadata"]["name"] for n in scene.karpenter.nodes()},
             120)
    print(f"empty node removed after {time.monotonic() - emptied:.1f}s")


def karpenter_apps(scene: Scene) -> Any:
    return kube.kubernetes_module().client.AppsV1Api(scene.cluster.api_client())
