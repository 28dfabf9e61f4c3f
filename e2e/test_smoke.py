"""Smoke tests: the control plane is real, schedules GPU pods, and leaves nothing behind.

They run on ``control_plane``, a cluster without vramguard: what is checked here is the control
plane and the fake GPU nodes, not vramguard's decisions.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e import gpu_nodes, kube, procs
from e2e.cluster import Cluster
from e2e.procs import group_members, processes_mentioning
from vramguard.inventory import read_inventory

NAMESPACE = "default"
BIND_TIMEOUT = 30.0


def gpu_pod(name: str, requests: dict[str, str], *, selector: dict[str, str], scheduler: str | None = None) -> Any:
    """A pause Pod with the given extended-resource limits, restricted to nodes with ``selector``."""
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "main",
                "image": "registry.k8s.io/pause:3.10",
                "resources": {"limits": dict(requests)},
            }
        ],
        "nodeSelector": selector,
        # Fake nodes have no kubelet; on clusters with a controller-manager (kind) they may be
        # tainted not-ready or unreachable while a test runs.
        "tolerations": [{"operator": "Exists"}],
        "terminationGracePeriodSeconds": 0,
    }
    if scheduler:
        spec["schedulerName"] = scheduler
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def wait_for(what: str, probe: Callable[[], Any], timeout: float = BIND_TIMEOUT) -> Any:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = probe()
        if result:
            return result
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture(scope="module")
def core(control_plane: Any) -> Any:
    """``kubernetes.client.CoreV1Api`` on the control plane, as the admin."""
    return control_plane.core_v1()


@pytest.fixture
def node_names(core: Any) -> Iterator[list[str]]:
    """Names of Nodes a test creates; deleted afterwards."""
    names: list[str] = []
    yield names
    gpu_nodes.delete_nodes(core, names)


@pytest.fixture
def pods(core: Any) -> Iterator[list[str]]:
    """Names of Pods a test creates in ``default``; deleted (grace period 0) afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        try:
            core.delete_namespaced_pod(name=name, namespace=NAMESPACE, grace_period_seconds=0)
        except kube.api_exception() as error:
            if getattr(error, "status", None) != 404:
                raise


def bound_node(core: Any, name: str) -> str | None:
    """The node a Pod is bound to, or None while it is pending."""
    pod = core.read_namespaced_pod(name=name, namespace=NAMESPACE)
    node: str | None = pod.spec.node_name
    return node


def test_api_server_reports_the_pinned_version(control_plane: Any) -> None:
    if control_plane.version is None:
        pytest.skip("no expected version for an existing cluster (pass --e2e-kube-version)")
    info = kube.version_api(control_plane.api_client()).get_code()
    assert info.git_version == control_plane.version
    assert (info.major, info.minor.rstrip("+")) == tuple(control_plane.version.lstrip("v").split(".")[:2])


@pytest.mark.parametrize(
    ("shape", "resource"),
    [
        pytest.param(lambda name: gpu_nodes.exclusive(name, "A100-80GB", gpus=8), "nvidia.com/gpu", id="exclusive"),
        pytest.param(
            lambda name: gpu_nodes.time_sliced(name, "H100-80GB", gpus=2, replicas=4),
            "nvidia.com/gpu",
            id="time-slicing",
        ),
        pytest.param(
            lambda name: gpu_nodes.time_sliced(name, "L40S", gpus=1, replicas=4, renamed=True),
            "nvidia.com/gpu.shared",
            id="time-slicing-renamed",
        ),
        pytest.param(lambda name: gpu_nodes.mps(name, "H200", gpus=1, replicas=2), "nvidia.com/gpu", id="mps"),
        pytest.param(
            lambda name: gpu_nodes.mig_mixed(name, "H100-80GB", ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]),
            "nvidia.com/mig-1g.10gb",
            id="mig-mixed",
        ),
    ],
)
def test_gpu_pod_is_bound_to_a_fake_gpu_node(
    core: Any,
    node_names: list[str],
    pods: list[str],
    unique: str,
    shape: Callable[[str], gpu_nodes.GPUNodeSpec],
    resource: str,
) -> None:
    pool = {"e2e.vramguard.io/pool": unique}
    spec = shape(f"gpu-{unique}")
    created = gpu_nodes.create_gpu_node(core, dataclasses.replace(spec, extra_labels=pool))
    node_names.append(created.metadata.name)
    # A Ready node without GPUs in the same pool: the scheduler must pick by resource.
    gpu_nodes.create_cpu_node(core, f"cpu-{unique}", labels=pool)
    node_names.append(f"cpu-{unique}")

    stored = core.read_node(name=created.metadata.name)
    assert stored.status.allocatable[resource] == gpu_nodes.gpu_resources(spec)[resource]
    assert stored.metadata.labels["nvidia.com/gpu.product"].startswith(spec.model.product_label)
    assert [c.status for c in stored.status.conditions if c.type == "Ready"] == ["True"]

    core.create_namespaced_pod(namespace=NAMESPACE, body=gpu_pod(f"p-{unique}", {resource: "1"}, selector=pool))
    pods.append(f"p-{unique}")
    assert wait_for("the pod to be bound", lambda: bound_node(core, f"p-{unique}")) == created.metadata.name


def test_pod_asking_for_more_gpus_than_exist_stays_pending(
    core: Any, node_names: list[str], pods: list[str], unique: str
) -> None:
    pool = {"e2e.vramguard.io/pool": unique}
    spec = gpu_nodes.exclusive(f"gpu-{unique}", "H100-80GB", gpus=2, extra_labels=pool)
    gpu_nodes.create_gpu_node(core, spec)
    node_names.append(spec.name)
    core.create_namespaced_pod(namespace=NAMESPACE, body=gpu_pod(f"p-{unique}", {"nvidia.com/gpu": "3"}, selector=pool))
    pods.append(f"p-{unique}")

    def unschedulable() -> bool:
        pod = core.read_namespaced_pod(name=f"p-{unique}", namespace=NAMESPACE)
        conditions = pod.status.conditions or []
        return any(c.type == "PodScheduled" and c.reason == "Unschedulable" for c in conditions)

    wait_for("the scheduler to mark the pod Unschedulable", unschedulable)
    assert bound_node(core, f"p-{unique}") is None


def test_second_cluster_with_second_scheduler_leaves_no_process(
    local_control_plane: Any, control_plane: Any, tmp_path: Path, unique: str
) -> None:
    directory = tmp_path / "second"
    second = Cluster.up(directory, kube_version=local_control_plane.version, second_scheduler=True)
    try:
        assert {"kube-scheduler", "vramguard-scheduler"} <= {proc.name for proc in second.processes}
        if isinstance(control_plane, Cluster):
            assert second.server != control_plane.server, "two clusters run side by side"
        core = second.core_v1()
        pool = {"e2e.vramguard.io/pool": unique}
        gpu_nodes.create_gpu_node(core, gpu_nodes.exclusive(f"gpu-{unique}", "T4", extra_labels=pool))
        # No GPU request: the extender (when present) is not consulted, so this only checks that
        # the second scheduler is live and owns pods that name it.
        core.create_namespaced_pod(
            namespace=NAMESPACE, body=gpu_pod(f"p-{unique}", {}, selector=pool, scheduler="vramguard")
        )
        assert wait_for("the second scheduler to bind", lambda: bound_node(core, f"p-{unique}")) == f"gpu-{unique}"
    finally:
        pgids = second.pgids()
        second.down()
    assert group_members(pgids) == []
    assert processes_mentioning(str(directory)) == []
    assert not list((directory / "pids").glob("*.pid"))


def test_a_port_taken_before_start_is_retried_with_new_ports(
    local_control_plane: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_free_ports = procs.free_ports
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        calls: list[int] = []

        def first_etcd_port_taken(count: int) -> list[int]:
            ports = real_free_ports(count)
            calls.append(count)
            return [taken.getsockname()[1], *ports[1:]] if len(calls) == 1 else ports

        monkeypatch.setattr("e2e.cluster.free_ports", first_etcd_port_taken)
        cluster = Cluster.up(tmp_path / "c", kube_version=local_control_plane.version, vramguard="off")
        try:
            assert len(calls) == 2
            assert cluster.state is not None
            assert cluster.state.etcd_url != f"http://127.0.0.1:{taken.getsockname()[1]}"
        finally:
            cluster.down()


def test_controller_manager_runs_deployments_and_claims_from_templates(
    control_plane: Any, core: Any, node_names: list[str], unique: str
) -> None:
    """The controllers the harness runs: Deployments get their pods, templates their claims."""
    k8s = kube.kubernetes_module()
    apps = k8s.client.AppsV1Api(control_plane.api_client())
    resource = k8s.client.ResourceV1Api(control_plane.api_client())
    pool = {"e2e.vramguard.io/pool": unique}
    gpu_nodes.create_cpu_node(core, f"cpu-{unique}", labels=pool)
    node_names.append(f"cpu-{unique}")
    labels = {"app": f"d-{unique}"}
    template = {"metadata": {"labels": labels}, "spec": gpu_pod("ignored", {}, selector=pool)["spec"]}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"d-{unique}"},
        "spec": {"replicas": 2, "selector": {"matchLabels": labels}, "template": template},
    }
    claim_template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": f"t-{unique}"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "none"}}]}}},
    }
    claimed = gpu_pod(f"c-{unique}", {}, selector=pool)
    claimed["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": f"t-{unique}"}]
    apps.create_namespaced_deployment(namespace=NAMESPACE, body=deployment)
    resource.create_namespaced_resource_claim_template(namespace=NAMESPACE, body=claim_template)
    core.create_namespaced_pod(namespace=NAMESPACE, body=claimed)
    try:
        selector = f"app=d-{unique}"

        def bound_replicas() -> bool:
            listed = core.list_namespaced_pod(namespace=NAMESPACE, label_selector=selector).items
            return len(listed) == 2 and all(pod.spec.node_name == f"cpu-{unique}" for pod in listed)

        wait_for("the Deployment's two pods to be created and bound", bound_replicas)

        def claim_name() -> str | None:
            statuses = core.read_namespaced_pod(name=f"c-{unique}", namespace=NAMESPACE).status.resource_claim_statuses
            return statuses[0].resource_claim_name if statuses else None

        name = wait_for("the claim made from the template", claim_name)
        assert resource.read_namespaced_resource_claim(name=name, namespace=NAMESPACE).metadata.owner_references
    finally:
        apps.delete_namespaced_deployment(name=f"d-{unique}", namespace=NAMESPACE, propagation_policy="Foreground")
        core.delete_namespaced_pod(name=f"c-{unique}", namespace=NAMESPACE, grace_period_seconds=0)
        resource.delete_namespaced_resource_claim_template(name=f"t-{unique}", namespace=NAMESPACE)
    wait_for(
        "the garbage collector to delete the Deployment's pods",
        lambda: not core.list_namespaced_pod(namespace=NAMESPACE, label_selector=f"app=d-{unique}").items,
    )


def test_a_nodes_file_becomes_ready_gpu_nodes_vramguard_reads(
    control_plane: Any, core: Any, tmp_path: Path, unique: str
) -> None:
    # What `python -m e2e.cluster up --nodes examples/nodes.yaml` does, with names of this test's own.
    if not isinstance(control_plane, Cluster):
        pytest.skip("creates Nodes through the local cluster's handle")
    text = (Path(__file__).parent.parent / "examples" / "nodes.yaml").read_text()
    path = tmp_path / "nodes.yaml"
    path.write_text(text.replace("name: h", f"name: {unique}-h"))
    names = control_plane.create_nodes(path)
    try:
        assert len(names) == 4 and all(name.startswith(f"{unique}-h") for name in names)
        for name in names:
            node = control_plane.request("GET", f"/api/v1/nodes/{name}")
            ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
            assert ready and ready[0]["status"] == "True"
            assert read_inventory(node).devices, name
        exclusive = read_inventory(control_plane.request("GET", f"/api/v1/nodes/{unique}-h100-exclusive"))
        assert len(exclusive.devices) == 8
    finally:
        for name in names:
            core.delete_node(name)
