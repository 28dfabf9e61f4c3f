"""`helm upgrade` from the previous chart release (0.1.0, packaged in tests/data/charts) to this one,
with the real helm against the real API server.

The cluster runs the control plane only: the release's own webhook configurations are the ones
installed (the harness registers none), and no kubelet runs its pods. Checked: the upgrade goes
through (no immutable field changes, no object another owns), the validating webhook configuration
is there at every moment of it, the GPU workloads are untouched (same pods, same nodes), no GPU is
over its VRAM budget before or after (`vramguard audit`), and the new release's objects are there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e import gpu_nodes, kube
from e2e.cluster import Cluster, ClusterConfig
from tests.test_manifests import CHART, NAMESPACE, ROOT, helm_command

PREVIOUS = ROOT / "tests" / "data" / "charts" / "vramguard-0.1.0.tgz"
ADMISSION = "/apis/admissionregistration.k8s.io/v1"


@pytest.fixture(scope="module")
def bare(local_control_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(ClusterConfig(
        directory=tmp_path_factory.mktemp("upgrade-cluster"),
        kube_version=local_control_plane.version,
        vramguard="off",
    ))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.down()


def helm(cluster: Cluster, *args: str) -> str:
    command = helm_command()
    if command is None:
        pytest.skip("helm is not installed")
    completed = subprocess.run(
        [command, *args, "--namespace", NAMESPACE, "--kubeconfig", str(cluster.kubeconfig)],
        capture_output=True, text=True, timeout=180, check=False,
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


def audit_overcommitted(cluster: Cluster) -> list[Any]:
    completed = subprocess.run(
        [sys.executable, "-m", "vramguard", "audit", "--kubeconfig", str(cluster.kubeconfig), "-o", "json"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert completed.returncode in (0, 1), completed.stderr
    return list(json.loads(completed.stdout)["overcommitted_gpus"])


class Watcher:
    """Polls an object every few milliseconds from another thread; records when it was missing."""

    def __init__(self, cluster: Cluster, path: str) -> None:
        self.cluster, self.path = cluster, path
        self.polls = 0
        self.missing: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.cluster.request("GET", self.path)
            except urllib.error.HTTPError as error:
                if error.code == 404:
                    self.missing.append(time.monotonic())
            self.polls += 1
            time.sleep(0.02)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def test_helm_upgrade_from_the_previous_release(bare: Cluster, unique: str, tmp_path: Path) -> None:
    assert PREVIOUS.is_file()
    helm(bare, "install", "vramguard", str(PREVIOUS), "--create-namespace")
    assert "0.1.0" in helm(bare, "list", "-o", "json")
    # GPU workloads running under the previous release.
    core = kube.kubernetes_module().client.CoreV1Api(bare.api_client())
    spec = gpu_nodes.time_sliced(f"h100-{unique}", "H100-80GB", replicas=4)
    gpu_nodes.create_gpu_node(core, spec)
    namespace = f"upgrade-{unique}"
    core.create_namespace({"metadata": {"name": namespace}})
    for i in range(2):
        core.create_namespaced_pod(namespace, {"metadata": {"name": f"chat-{i}"}, "spec": {
            "nodeName": spec.name,
            "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.21.0",
                            "args": ["--model", "m", "--gpu-memory-utilization", "0.40"],
                            "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
        }})
    before = {p.metadata.name: (p.metadata.uid, p.spec.node_name) for p in core.list_namespaced_pod(namespace).items}
    assert len(before) == 2
    assert audit_overcommitted(bare) == []

    with Watcher(bare, f"{ADMISSION}/validatingwebhookconfigurations/vramguard") as watcher:
        helm(bare, "upgrade", "vramguard", str(CHART))
    assert watcher.polls > 10 and watcher.missing == [], f"missing {len(watcher.missing)} of {watcher.polls} polls"

    release = json.loads(helm(bare, "list", "-o", "json"))
    assert [(r["chart"], r["revision"], r["status"]) for r in release] == [("vramguard-0.2.0", "2", "deployed")]
    after = {p.metadata.name: (p.metadata.uid, p.spec.node_name) for p in core.list_namespaced_pod(namespace).items}
    assert after == before, "the upgrade touched the workloads"
    assert audit_overcommitted(bare) == []
    # What 0.2.0 adds: the mutating webhook and the certificate keeper.
    bare.request("GET", f"{ADMISSION}/mutatingwebhookconfigurations/vramguard")
    bare.request("GET", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/vramguard-certificates")
    # And back: a rollback to the previous release goes through too.
    helm(bare, "rollback", "vramguard", "1")
    with pytest.raises(urllib.error.HTTPError):
        bare.request("GET", f"{ADMISSION}/mutatingwebhookconfigurations/vramguard")
    helm(bare, "uninstall", "vramguard")
    for pod in core.list_namespaced_pod(namespace).items:
        core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
    core.delete_node(spec.name)
