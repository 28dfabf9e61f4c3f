"""The node agent's report on the real control plane: the extender places what the truth allows.

A multi-GPU time-sliced node: until the extender knows which GPU each pod got, it must assume the
device plugin stacked them on one GPU, so two H100s with 4 replicas take three pods at 0.30. Once
the report says where they really run (two on GPU 0, one on GPU 1), a fourth fits, and a fifth
still does not, because GPU 0 is known to hold 0.60 and the fourth's GPU is not known yet.

Two ways to produce the report: written by the test (the annotation format alone, with a Lease),
and written by the real ``vramguard agent`` process, reading a recorded NVML snapshot and a local
kubelet PodResources server, and listing the node's pods through the API server.

A report counts only while the agent's Lease is fresh: once it expires the extender falls back to
the conservative rule and says so. And what the agent measures counts: a pod declaring 1 MiB and
using 40 GiB holds 40 GiB, so a later pod that fits by declarations stays Pending.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e import gpu_nodes
from e2e.kube import api_exception, kubernetes_module
from e2e.scenario import (
    AGENT_LEASES,
    pinned_vllm_pod,
    private_node,
    require_extender,
    violations_on_own_nodes,
)
from e2e.test_manifests import FIELD_MANAGER, REAL_KINDS, _as_agent
from tests.test_manifests import BASE, render_kustomization
from vramguard.codecs import AGENT_REPORT_ANNOTATION, agent_lease_name
from vramguard.lease import DEFAULT_AGENT_NAMESPACE, lease_body

pytestmark = pytest.mark.timeout(240)

H100_BYTES = 81559 * 2**20
H100_USABLE = H100_BYTES - 580 * 2**20
"""What the recording's H100s let processes allocate (NVML's total less the driver's reserve): the
size the agent reports."""
RECORDING = Path(__file__).resolve().parent.parent / "tests" / "data" / "agent" / "nvml_h100_time_sliced.json"


def quad_node(core_v1: Any, unique: str) -> str:
    """Two H100s, 4 time-slicing replicas each, usable only by this test's pods."""
    spec = private_node(gpu_nodes.time_sliced("quad", "H100-80GB", gpus=2, replicas=4), unique)
    gpu_nodes.create_gpu_node(core_v1, spec)
    return spec.name


def refusal(core_v1: Any, namespace: str, name: str) -> str:
    """The scheduler's message for a pod it could not place."""
    for condition in core_v1.read_namespaced_pod(name, namespace).status.conditions or ():
        if condition.type == "PodScheduled" and condition.status == "False":
            return str(condition.message)
    raise AssertionError(f"pod {name} was not refused")


def scheduled(core_v1: Any, namespace: str, name: str, timeout: float = 60.0) -> str | None:
    """The pod's node once bound, or ``None`` once the scheduler has said it cannot place it."""
    deadline = time.monotonic() + timeout
    while True:
        pod = core_v1.read_namespaced_pod(name, namespace)
        if pod.spec.node_name:
            return str(pod.spec.node_name)
        for condition in pod.status.conditions or ():
            if condition.type == "PodScheduled" and condition.status == "False" and condition.message:
                return None
        if time.monotonic() > deadline:
            raise AssertionError(f"pod {name} got no scheduling verdict in {timeout:g} s")
        time.sleep(0.25)


def place(
    core_v1: Any, namespace: str, name: str, unique: str, annotations: dict[str, str] | None = None
) -> str | None:
    core_v1.create_namespaced_pod(namespace, pinned_vllm_pod(name, unique, annotations=annotations))
    return scheduled(core_v1, namespace, name)


def write_lease(cluster: Any, node: str, duration: int = 600) -> None:
    """What a live agent does every cycle: (re)new its node's Lease, renewed now."""
    body = lease_body(DEFAULT_AGENT_NAMESPACE, node, "e2e-test", duration, time.time())
    cluster.request("POST", AGENT_LEASES, body)


def uid_of(core_v1: Any, namespace: str, name: str) -> str:
    return str(core_v1.read_namespaced_pod(name, namespace).metadata.uid)


def annotation(core_v1: Any, node: str) -> str | None:
    annotations = core_v1.read_node(node).metadata.annotations or {}
    value = annotations.get(AGENT_REPORT_ANNOTATION)
    return str(value) if value is not None else None


def wait_for_extender(
    core_v1: Any, namespace: str, name: str, unique: str, timeout: float = 30.0,
    annotations: dict[str, str] | None = None,
) -> str | None:
    """Create pod ``name`` until it binds: the extender sees the node's new annotation through a watch."""
    deadline = time.monotonic() + timeout
    while True:
        node = place(core_v1, namespace, name, unique, annotations)
        if node is not None or time.monotonic() > deadline:
            return node
        core_v1.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        while core_v1.list_namespaced_pod(namespace, field_selector=f"metadata.name={name}").items:
            time.sleep(0.1)
        time.sleep(0.5)


def ledger_violations(cluster: Any, unique: str) -> list[str]:
    """The ledger rebuilt from the API server alone (annotation included), checked against the rule,
    on this test's nodes."""
    return violations_on_own_nodes(cluster, unique)


def fill_conservatively(core_v1: Any, namespace: str, unique: str, node: str) -> None:
    for i in range(3):
        assert place(core_v1, namespace, f"p{i}", unique) == node
    # The plugin might have stacked p0..p2 on one GPU: a fourth 0.30 could overcommit it.
    assert place(core_v1, namespace, "probe", unique) is None
    core_v1.delete_namespaced_pod("probe", namespace, grace_period_seconds=0)


def test_a_report_lets_the_extender_place_more_without_overcommitting(
    cluster: Any, core_v1: Any, namespace: str, unique: str
) -> None:
    require_extender(cluster)
    node = quad_node(core_v1, unique)
    fill_conservatively(core_v1, namespace, unique, node)

    uids = {name: uid_of(core_v1, namespace, name) for name in ("p0", "p1", "p2")}
    report = {
        "version": 1,
        "gpus": [{"id": "0", "memory_bytes": H100_BYTES, "foreign_bytes": 0},
                 {"id": "1", "memory_bytes": H100_BYTES, "foreign_bytes": 0}],
        "pods": {uids["p0"]: {"vllm": ["0"]}, uids["p1"]: {"vllm": ["0"]}, uids["p2"]: {"vllm": ["1"]}},
    }
    core_v1.patch_node(node, {"metadata": {"annotations": {AGENT_REPORT_ANNOTATION: json.dumps(report)}}})
    # Without its agent's Lease the report is not trusted: p3 still does not fit.
    assert place(core_v1, namespace, "unleased", unique) is None
    assert "agent report not trusted: no agent lease" in refusal(core_v1, namespace, "unleased")
    write_lease(cluster, node)

    assert wait_for_extender(core_v1, namespace, "p3", unique) == node
    # p3's GPU is not reported: it may be GPU 0 (0.60 known), so a fifth could overcommit GPU 0.
    assert place(core_v1, namespace, "p4", unique) is None
    assert ledger_violations(cluster, unique) == []


def test_the_agent_process_reports_and_the_extender_uses_it(
    cluster: Any, core_v1: Any, namespace: str, unique: str, tmp_path: Path
) -> None:
    require_extender(cluster)
    from tests.agent_support import H100_UUIDS, kubelet_server, list_response  # noqa: PLC0415 - needs grpc

    node = quad_node(core_v1, unique)
    fill_conservatively(core_v1, namespace, unique, node)

    socket = tmp_path / "kubelet.sock"
    with kubelet_server(socket) as kubelet:
        kubelet.response = list_response({
            (namespace, "p0"): {"vllm": {"nvidia.com/gpu": [f"{H100_UUIDS[0]}::0"]}},
            (namespace, "p1"): {"vllm": {"nvidia.com/gpu": [f"{H100_UUIDS[0]}::1"]}},
            (namespace, "p2"): {"vllm": {"nvidia.com/gpu": [f"{H100_UUIDS[1]}::0"]}},
        })
        log = (tmp_path / "agent.log").open("w")
        agent = subprocess.Popen(
            [sys.executable, "-m", "vramguard", "agent", "--node-name", node, "--listen", "127.0.0.1:0",
             "--kubeconfig", str(cluster.kubeconfig), "--nvml-recording", str(RECORDING),
             "--podresources-socket", str(socket), "--interval", "0.5", "--min-write-interval", "1"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                text = annotation(core_v1, node)
                report = json.loads(text) if text else {}
                if len(report.get("pods", {})) == 3:
                    break
                assert agent.poll() is None, (tmp_path / "agent.log").read_text()
                assert time.monotonic() < deadline, f"no report from the agent: {text}"
                time.sleep(0.25)
            uids = {name: uid_of(core_v1, namespace, name) for name in ("p0", "p1", "p2")}
            assert report == {
                "version": 1,
                "gpus": [{"id": "0", "memory_bytes": H100_USABLE, "foreign_bytes": 0},
                         {"id": "1", "memory_bytes": H100_USABLE, "foreign_bytes": 0}],
                "pods": {uids["p0"]: {"vllm": ["0"]}, uids["p1"]: {"vllm": ["0"]}, uids["p2"]: {"vllm": ["1"]}},
            }
            # The agent stays up while the extender uses its report: it renews its Lease only after
            # the annotation is written, so stopping it the moment the annotation appears could
            # leave no Lease at all, and the report rightly untrusted.
            assert wait_for_extender(core_v1, namespace, "p3", unique) == node
            # The kubelet does not list p3: its GPU stays unknown, so a fifth could overcommit GPU 0.
            assert place(core_v1, namespace, "p4", unique) is None
            assert ledger_violations(cluster, unique) == []
        finally:
            agent.terminate()
            agent.wait(15)
            log.close()


def start_agent(cluster: Any, node: str, tmp_path: Path, recording: Path, socket: Path,
                *extra: str) -> subprocess.Popen[bytes]:
    """The real ``vramguard agent`` process against the API server, NVML replayed from ``recording``."""
    log = (tmp_path / "agent.log").open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "vramguard", "agent", "--node-name", node, "--listen", "127.0.0.1:0",
         "--kubeconfig", str(cluster.kubeconfig), "--nvml-recording", str(recording),
         "--podresources-socket", str(socket), "--interval", "0.5", "--min-write-interval", "1", *extra],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def stop_agent(agent: subprocess.Popen[bytes]) -> None:
    agent.terminate()
    agent.wait(15)


def wait_until_extender_reserves(cluster: Any, node: str, at_least: int, timeout: float = 30.0) -> None:
    """Until the extender's ledger series (rendered every 10 s) show ``at_least`` bytes held on ``node``."""
    pattern = re.compile(r'^vramguard_node_reserved_bytes\{[^}]*node="' + re.escape(node) + r'"[^}]*\} (\S+)$', re.M)
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(cluster.ops_url("extender") + "/metrics", timeout=10) as response:
            held = sum(float(value) for value in pattern.findall(response.read().decode()))
        if held >= at_least:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the extender holds {held:.0f} bytes on {node} after {timeout:g} s")
        time.sleep(0.5)


def wait_for_report(core_v1: Any, node: str, agent: subprocess.Popen[bytes], tmp_path: Path,
                    done: Any, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        text = annotation(core_v1, node)
        report: dict[str, Any] = json.loads(text) if text else {}
        if done(report):
            return report
        assert agent.poll() is None, (tmp_path / "agent.log").read_text()
        assert time.monotonic() < deadline, f"no such report from the agent: {text}"
        time.sleep(0.25)


def test_measured_use_above_the_declaration_keeps_a_later_pod_pending(
    cluster: Any, core_v1: Any, namespace: str, unique: str, tmp_path: Path
) -> None:
    """A pod declaring 1 MiB that uses 40 GiB on GPU 1: a 40 GiB pod fits by declarations (each H100's
    budget is 71.7 GiB), but not once the agent has measured the first, and it gets one Event."""
    require_extender(cluster)
    from tests.agent_support import H100_UUIDS, kubelet_server, list_response  # noqa: PLC0415 - needs grpc

    node = quad_node(core_v1, unique)
    declared = {"vramguard.io/vram": "1Mi"}
    assert place(core_v1, namespace, "liar", unique, declared) == node
    uid = uid_of(core_v1, namespace, "liar")

    # GPU 0 idle; on GPU 1 host PID 51002 uses 40 GiB, and its cgroup names the liar's pod.
    data = json.loads(RECORDING.read_text())
    data["gpus"][0]["memory"]["used"] = 0
    data["gpus"][0]["processes"] = []
    data["gpus"][1]["memory"]["used"] = 40 * 2**30
    data["gpus"][1]["processes"] = [{"pid": 51002, "used_bytes": 40 * 2**30}]
    recording = tmp_path / "nvml.json"
    recording.write_text(json.dumps(data))
    proc = tmp_path / "proc"
    (proc / "51002").mkdir(parents=True)
    (proc / "51002" / "cgroup").write_text(f"0::/kubepods/besteffort/pod{uid}/{'c' * 64}\n")

    socket = tmp_path / "kubelet.sock"
    with kubelet_server(socket) as kubelet:
        kubelet.response = list_response({(namespace, "liar"): {"vllm": {"nvidia.com/gpu": [f"{H100_UUIDS[1]}::0"]}}})
        agent = start_agent(cluster, node, tmp_path, recording, socket, "--host-pid", "--proc-root", str(proc))
        try:
            report = wait_for_report(core_v1, node, agent, tmp_path, lambda r: "used" in r)
            assert report["used"] == {uid: {"1": 40 * 2**30}}
            # The report is on the Node; the extender learns it through its watch, a moment later.
            wait_until_extender_reserves(cluster, node, 40 * 2**30)
            big = {"vramguard.io/vram": "40Gi"}
            assert place(core_v1, namespace, "big", unique, big) is None
            # The filter's line for the kind of device (each GPU's room: kubectl vram nodes).
            assert "GPU (NVIDIA H100 80GB HBM3): VRAM budget free below the pod's 40.0 GiB per GPU" in (
                refusal(core_v1, namespace, "big")
            )
            time.sleep(2)  # four more cycles: still one Event
            events = [e for e in core_v1.list_namespaced_event(namespace).items if e.reason == "VRAMOverUse"]
            assert len(events) == 1 and events[0].involved_object.uid == uid and events[0].type == "Warning"
        finally:
            stop_agent(agent)
    core_v1.delete_namespaced_pod("big", namespace, grace_period_seconds=0)

    # The same report without the measurement (the Lease is still fresh): the 40 GiB pod now binds,
    # so the refusal above came from the measured use alone.
    del report["used"]
    core_v1.patch_node(node, {"metadata": {"annotations": {AGENT_REPORT_ANNOTATION: json.dumps(report)}}})
    assert wait_for_extender(core_v1, namespace, "big", unique, annotations=big) == node
    assert ledger_violations(cluster, unique) == []


def test_an_expired_lease_falls_back_to_the_conservative_rule(
    cluster: Any, core_v1: Any, namespace: str, unique: str, tmp_path: Path
) -> None:
    """The agent reports where p0..p2 run and a fourth fits; the agent stops, its Lease (3 s) expires,
    and the extender forgets the placements: the same fourth pod is refused, and the refusal says why."""
    require_extender(cluster)
    from tests.agent_support import H100_UUIDS, kubelet_server, list_response  # noqa: PLC0415 - needs grpc

    node = quad_node(core_v1, unique)
    fill_conservatively(core_v1, namespace, unique, node)
    socket = tmp_path / "kubelet.sock"
    with kubelet_server(socket) as kubelet:
        kubelet.response = list_response({
            (namespace, "p0"): {"vllm": {"nvidia.com/gpu": [f"{H100_UUIDS[0]}::0"]}},
            (namespace, "p1"): {"vllm": {"nvidia.com/gpu": [f"{H100_UUIDS[1]}::0"]}},
            (namespace, "p2"): {"vllm": {"nvidia.com/gpu": [f"{H100_UUIDS[1]}::1"]}},
        })
        agent = start_agent(cluster, node, tmp_path, RECORDING, socket, "--lease-duration", "3")
        try:
            wait_for_report(core_v1, node, agent, tmp_path, lambda r: len(r.get("pods", {})) == 3)
            lease = cluster.request("GET", f"{AGENT_LEASES}/{agent_lease_name(node)}")
            assert lease["spec"]["leaseDurationSeconds"] == 3
            assert wait_for_extender(core_v1, namespace, "p3", unique) == node
        finally:
            stop_agent(agent)
    core_v1.delete_namespaced_pod("p3", namespace, grace_period_seconds=0)
    # The annotation still says where p0..p2 run, but nobody vouches for it any more.
    time.sleep(3 + 2.5)  # the Lease's duration, and the extender's expiry check
    assert place(core_v1, namespace, "p4", unique) is None
    message = refusal(core_v1, namespace, "p4")
    assert f"agent report stale: lease {DEFAULT_AGENT_NAMESPACE}/{agent_lease_name(node)} expired at" in message
    assert ledger_violations(cluster, unique) == []


@pytest.fixture
def lease_nodes(core_v1: Any, unique: str) -> Iterator[tuple[str, str]]:
    """Two plain nodes, deleted afterwards."""
    names = (f"lease-a-{unique}", f"lease-b-{unique}")
    for name in names:
        gpu_nodes.create_cpu_node(core_v1, name)
    yield names
    gpu_nodes.delete_nodes(core_v1, list(names))


def test_an_agent_may_renew_only_its_own_nodes_lease(cluster: Any, lease_nodes: tuple[str, str]) -> None:
    """RBAC lets every agent write Leases in the vramguard namespace; the admission policy narrows it to
    the Lease of the node its token is bound to, so no agent can keep another node's report trusted."""
    dynamic = kubernetes_module().dynamic.DynamicClient(cluster.api_client())
    for obj in render_kustomization(BASE):
        if obj["kind"] in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding") or (
            obj["kind"] in REAL_KINDS and "agent" in obj["metadata"]["name"]
        ):
            dynamic.resources.get(api_version=obj["apiVersion"], kind=obj["kind"]).server_side_apply(
                body=obj, namespace=obj["metadata"].get("namespace"), field_manager=FIELD_MANAGER, force_conflicts=True
            )
    own, other = lease_nodes
    leases = kubernetes_module().client.CoordinationV1Api(_as_agent(cluster, own).api_client)
    denied = api_exception()
    # The policy reaches the API server's admission within seconds: wait until it denies.
    deadline = time.monotonic() + 30
    while True:
        try:
            leases.create_namespaced_lease(DEFAULT_AGENT_NAMESPACE, lease_body(DEFAULT_AGENT_NAMESPACE, other, "x", 40,
                                                                               time.time()))
        except denied as error:
            assert getattr(error, "status", None) in (403, 422), error
            break
        cluster.request("DELETE", f"{AGENT_LEASES}/{agent_lease_name(other)}")
        assert time.monotonic() < deadline, "the agent could write another node's Lease"
        time.sleep(0.5)
    created = leases.create_namespaced_lease(
        DEFAULT_AGENT_NAMESPACE, lease_body(DEFAULT_AGENT_NAMESPACE, own, "agent-pod", 40, time.time())
    )
    created.spec.holder_identity = "agent-pod-restarted"
    leases.replace_namespaced_lease(agent_lease_name(own), DEFAULT_AGENT_NAMESPACE, created)
    with pytest.raises(denied):
        leases.create_namespaced_lease("kube-node-lease", lease_body("kube-node-lease", own, "x", 40, time.time()))
