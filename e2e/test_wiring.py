"""The harness wires vramguard in for real: kube-scheduler calls the extender over HTTPS with the
shipped configuration, and the API server calls the webhook with the registered caBundle.

The services here are e2e/fake_vramguard.py, which speaks the same command line and wire formats
as ``vramguard extender`` / ``vramguard webhook``; the suites for the real services build on this.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from e2e import gpu_nodes, kube
from e2e.cluster import Cluster
from e2e.procs import group_members

FAKE = [sys.executable, str(Path(__file__).resolve().parent / "fake_vramguard.py")]


def _calls(record: Path) -> list[dict[str, Any]]:
    if not record.is_file():
        return []
    return [json.loads(line) for line in record.read_text().splitlines() if line]


def _bound(core: Any, name: str) -> str | None:
    node: str | None = core.read_namespaced_pod(name=name, namespace="default").spec.node_name
    return node


def _wait_bound(core: Any, name: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        node = _bound(core, name)
        if node:
            return node
        time.sleep(0.2)
    pytest.fail(f"pod {name} was not bound within {timeout:.0f}s")


def _pod(name: str, limits: dict[str, str], scheduler: str | None, annotations: dict[str, str] | None = None) -> Any:
    spec: dict[str, Any] = {
        "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10", "resources": {"limits": limits}}]
    }
    if scheduler:
        spec["schedulerName"] = scheduler
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": spec,
    }


@pytest.mark.parametrize("second_scheduler", [False, True], ids=["default-profile", "second-scheduler"])
def test_extender_and_webhook_are_wired_in(
    local_control_plane: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, second_scheduler: bool
) -> None:
    record = tmp_path / "calls.jsonl"
    monkeypatch.setenv("VRAMGUARD_FAKE_RECORD", str(record))
    cluster = Cluster.up(
        tmp_path / "cluster",
        kube_version=local_control_plane.version,
        second_scheduler=second_scheduler,
        vramguard="on",
        vramguard_command=FAKE,
    )
    try:
        assert set(cluster.state.vramguard if cluster.state else {}) == {"extender", "webhook"}
        core = cluster.core_v1()
        gpu_nodes.create_gpu_node(core, gpu_nodes.time_sliced("gpu-a", "H100-80GB", gpus=1, replicas=4))
        gpu_nodes.create_gpu_node(core, gpu_nodes.time_sliced("gpu-b", "H100-80GB", gpus=1, replicas=4))
        scheduler = "vramguard" if second_scheduler else None

        core.create_namespaced_pod(namespace="default", body=_pod("gpu", {"nvidia.com/gpu": "1"}, scheduler))
        node = _wait_bound(core, "gpu")
        calls = _calls(record)
        verbs = [(call["service"], call["path"].rsplit("/", 1)[-1]) for call in calls]
        assert ("extender", "filter") in verbs
        assert ("extender", "prioritize") in verbs
        binds = [call["body"] for call in calls if call["path"].endswith("/bind")]
        assert [(bind["PodName"], bind["Node"]) for bind in binds] == [("gpu", node)], "the extender binds"
        filters = [call["body"] for call in calls if call["path"].endswith("/filter")]
        assert sorted(filters[0]["NodeNames"]) == ["gpu-a", "gpu-b"], "nodeCacheCapable: names only"
        reviews = [call["body"]["request"] for call in calls if call["service"] == "webhook"]
        assert any(review["kind"]["kind"] == "Pod" and review["name"] == "gpu" for review in reviews)

        # Under the default profile (managedResources) a pod without GPU requests never reaches the
        # extender; the second scheduler lists none, so each of its pods does (claim pods among them).
        core.create_namespaced_pod(namespace="default", body=_pod("plain", {}, scheduler))
        _wait_bound(core, "plain")
        plain = [c for c in _calls(record) if c["service"] == "extender" and "plain" in json.dumps(c["body"])]
        assert bool(plain) is second_scheduler

        # The webhook's denial reaches the client.
        denied = _pod("denied", {"nvidia.com/gpu": "1"}, scheduler, {"e2e.vramguard.io/deny": "yes"})
        with pytest.raises(kube.api_exception()) as raised:
            core.create_namespaced_pod(namespace="default", body=denied)
        assert "fake vramguard: denied by annotation" in str(raised.value)

        # A crashed extender comes back on the same port and keeps serving the scheduler.
        before = {proc.name: proc.record.pid for proc in cluster.processes}
        cluster.restart_vramguard("extender", signal.SIGKILL)
        after = {proc.name: proc.record.pid for proc in cluster.processes}
        assert after["vramguard-extender"] != before["vramguard-extender"]
        assert group_members([before["vramguard-extender"]]) == []
        core.create_namespaced_pod(namespace="default", body=_pod("gpu2", {"nvidia.com/gpu": "1"}, scheduler))
        _wait_bound(core, "gpu2")
        assert any(c["path"].endswith("/bind") and c["body"]["PodName"] == "gpu2" for c in _calls(record))
    finally:
        pgids = cluster.pgids()
        cluster.down()
    assert group_members(pgids) == []
