"""Pods that really run: real kubelets with containerd (``e2e.real_nodes``), the harness's device
plugin giving each container its GPU as the NVIDIA plugin does, and the node agent reading the real
PodResources socket and a recorded NVML whose processes are the containers' real PIDs.

Expected values come from the rules, not from vramguard's output:

- vLLM reserves ``--gpu-memory-utilization`` x the GPU's total memory (vLLM
  ``vllm/v1/worker/gpu_worker.py``, ``requested_memory``), plus one CUDA context per process
  (the policy's ``allowances.cuda_context``, 512 MiB); a time-sliced GPU's budget is its memory
  less the policy's 3 % margin (``vramguard/default_policy.yaml``);
- the NVIDIA device plugin spreads replicas over the GPUs, the least used first, and names the
  GPU in ``NVIDIA_VISIBLE_DEVICES`` (``internal/rm/allocate.go``, ``internal/plugin/server.go``);
- ``vramguard.io/vram`` declares a container's bytes per GPU; a class with
  ``enforce_memory_limits`` writes them, in whole MiB, as ``NVIDIA_GPU_MEMORY_REQUEST`` and
  ``NVIDIA_GPU_MEMORY_LIMIT`` (nvidia-container-toolkit's ``apply-cuda-memory-limits`` hook).

Skipped where real nodes cannot run (not root, not Linux, no containerd); in CI a skip is a failure.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e import build, device_plugin, gpu_nodes, real_nodes
from e2e.cluster import Cluster
from e2e.procs import ManagedProcess, free_port, processes_mentioning
from e2e.scenario import pinned_vllm_pod, private_node, violations_on_own_nodes, wait_for
from vramguard.codecs import AGENT_REPORT_ANNOTATION, QOS_CLASS_LABEL

pytestmark = pytest.mark.timeout(600)

MiB = 2**20
GiB = 2**30
H100 = gpu_nodes.GPU_MODELS["H100-80GB"]
H100_BYTES = H100.memory_mib * MiB
CUDA_CONTEXT = 512 * MiB
RESERVED = 580 * MiB
"""The driver's reserve in the recordings (``device_plugin.nvml_recording``)."""
MARGIN = 0.03
SHARE_030 = int(0.30 * H100_BYTES) + CUDA_CONTEXT
"""A vLLM pod at 0.30 on an H100, with its CUDA context: what the filter's message names."""
OVERUSE_EVENT = "VRAMOverUse"


def _ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@dataclass
class RealCluster:
    """A control plane of this module's own (its policy enforces limits in class ``shared``) with
    real nodes."""

    cluster: Cluster
    nodes: real_nodes.RealNodes
    tmp: Path

    @property
    def core_v1(self) -> Any:
        return self.cluster.core_v1()


@pytest.fixture(scope="module")
def real(request: pytest.FixtureRequest, local_control_plane: build.Binaries,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    reasons = real_nodes.missing()
    if reasons:
        message = f"real nodes cannot run here: {'; '.join(reasons)}"
        if _ci():
            pytest.fail(message)
        pytest.skip(message)
    directory = tmp_path_factory.mktemp("real-nodes")
    policy = yaml.safe_load((Path(__file__).resolve().parent.parent / "vramguard" / "default_policy.yaml").read_text())
    policy["classes"]["shared"]["enforce_memory_limits"] = True
    policy_file = directory / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(policy))
    cluster = Cluster.up(directory / "cluster", kube_version=local_control_plane.version, second_scheduler=True,
                         vramguard="on", policy=policy_file)
    nodes = real_nodes.RealNodes(cluster)
    try:
        yield RealCluster(cluster, nodes, directory)
    finally:
        try:
            nodes.stop()
        finally:
            cluster.down()


@pytest.fixture
def namespace(real: RealCluster, unique: str) -> Iterator[str]:
    name = f"real-{unique}"
    real.core_v1.create_namespace({"metadata": {"name": name}})
    yield name
    real.core_v1.delete_namespace(name)


# --------------------------------------------------------------------------- helpers


def running(core_v1: Any, namespace: str, name: str, timeout: float = 60.0) -> Any:
    """The pod once its container has started (Running)."""
    def check() -> Any:
        pod = core_v1.read_namespaced_pod(name, namespace)
        statuses = pod.status.container_statuses or []
        return pod if pod.status.phase == "Running" and statuses and statuses[0].state.running else None
    try:
        return wait_for(f"pod {namespace}/{name} Running", check, timeout)
    except AssertionError as error:
        status = core_v1.read_namespaced_pod(name, namespace).status
        conditions = [(c.type, c.status, c.message) for c in status.conditions or ()]
        raise AssertionError(f"{error}: {status.phase}, {conditions}") from None


def refusal(core_v1: Any, namespace: str, name: str, timeout: float = 60.0) -> str:
    """The scheduler's message for a pod it could not place."""
    def check() -> str | None:
        pod = core_v1.read_namespaced_pod(name, namespace)
        assert not pod.spec.node_name, f"{name} was bound to {pod.spec.node_name}"
        for condition in pod.status.conditions or ():
            if condition.type == "PodScheduled" and condition.status == "False" and condition.message:
                return str(condition.message)
        return None
    return str(wait_for(f"a scheduling verdict on {name}", check, timeout))


def container_log(core_v1: Any, namespace: str, name: str) -> str:
    """The container's output, through the API server and the node's kubelet."""
    return str(wait_for(f"{name}'s log", lambda: _log_if_ready(core_v1, namespace, name), 30))


def _log_if_ready(core_v1: Any, namespace: str, name: str) -> str | None:
    text = str(core_v1.read_namespaced_pod_log(name, namespace))
    return text if "ready" in text.splitlines() else None


def container_env(core_v1: Any, namespace: str, name: str) -> dict[str, str]:
    """The GPU variables the container printed (the stand-in prints ``NVIDIA_*`` and ``CUDA_MPS_*``)."""
    pairs = (line.split("=", 1) for line in container_log(core_v1, namespace, name).splitlines() if "=" in line)
    return dict(pairs)


def gpu_index(spec: gpu_nodes.GPUNodeSpec, uuid: str) -> str:
    """The NVML index of the GPU named ``uuid`` on ``spec``'s node."""
    return str([device_plugin.gpu_uuid(spec.name, i) for i in range(spec.gpus)].index(uuid))


def report(core_v1: Any, node: str) -> dict[str, Any]:
    annotations = core_v1.read_node(node).metadata.annotations or {}
    text = annotations.get(AGENT_REPORT_ANNOTATION)
    return json.loads(text) if text else {}


@dataclass
class Agent:
    process: ManagedProcess
    recording: Path
    metrics_url: str

    def alive(self) -> None:
        assert self.process.exited() is None, self.process.log_tail()


@pytest.fixture
def start_agent(real: RealCluster, tmp_path: Path) -> Callable[[real_nodes.RealNode], Agent]:
    """``vramguard agent`` for a node, against its kubelet's real PodResources socket and host
    ``/proc``, NVML replayed from a recording the test may rewrite; it stops with the node."""
    def start(node: real_nodes.RealNode) -> Agent:
        recording = tmp_path / f"nvml-{node.name}.json"
        recording.write_text(json.dumps(device_plugin.nvml_recording(node.spec)))
        port = free_port()
        process = real.nodes.start_agent(node, recording, port)
        return Agent(process, recording, f"http://127.0.0.1:{port}/metrics")

    return start


def wait_for_report(core_v1: Any, node: str, agent: Agent, done: Callable[[dict[str, Any]], bool],
                    timeout: float = 30.0) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        agent.alive()
        current = report(core_v1, node)
        return current if done(current) else None
    return dict(wait_for(f"a report from {node}'s agent", check, timeout))


@pytest.fixture
def node_for(real: RealCluster, unique: str) -> Iterator[Callable[[gpu_nodes.GPUNodeSpec], real_nodes.RealNode]]:
    """Start a real node of the test's own; it stops when the test ends."""
    started: list[str] = []

    def start(spec: gpu_nodes.GPUNodeSpec) -> real_nodes.RealNode:
        node = real.nodes.start(private_node(spec, unique))
        started.append(node.name)
        return node

    yield start
    for name in started:
        real.nodes.stop(name)


NodeFor = Callable[[gpu_nodes.GPUNodeSpec], real_nodes.RealNode]


# --------------------------------------------------------------------------- tests


def test_the_seed_scenario_runs_three_pods_and_keeps_the_fourth_pending(
    real: RealCluster, namespace: str, unique: str, node_for: NodeFor
) -> None:
    """Four vLLM pods at 0.30 on one H100 time-sliced four ways: 4 x 24.4 GiB > 77.3 GiB of budget.
    Three run (each container given the GPU by the device plugin); the fourth stays Pending with
    the bytes, instead of crash-looping on CUDA OOM."""
    node = node_for(gpu_nodes.time_sliced("seed", "H100-80GB", gpus=1, replicas=4))
    core = real.core_v1
    assert 3 * SHARE_030 <= (1 - MARGIN) * H100_BYTES < 4 * SHARE_030
    for i in range(4):
        core.create_namespaced_pod(namespace, pinned_vllm_pod(f"vllm-{i}", unique))
        if i < 3:
            pod = running(core, namespace, f"vllm-{i}")
            assert pod.spec.node_name == node.name
            env = container_env(core, namespace, f"vllm-{i}")
            assert env["NVIDIA_VISIBLE_DEVICES"] == device_plugin.gpu_uuid(node.name, 0)
    message = refusal(core, namespace, "vllm-3")
    assert f"VRAM budget free below the pod's {SHARE_030 / GiB:.1f} GiB per GPU" in message, message
    time.sleep(3)
    assert core.read_namespaced_pod("vllm-3", namespace).status.phase == "Pending"
    assert violations_on_own_nodes(real.cluster, unique) == []


def test_the_ledger_follows_the_gpus_the_kubelet_gave(
    real: RealCluster, namespace: str, unique: str, node_for: NodeFor,
    start_agent: Callable[[real_nodes.RealNode], Agent],
) -> None:
    """Two H100s, four replicas each; a 0.30 pod fits a GPU three times, not four. vramguard cannot
    choose the GPU (the device plugin does), so a pod may bind only where every GPU with a free
    replica has room for it. Not knowing where pods run, three fill the node (they might share a
    GPU). Knowing it, through the agent reading the kubelet, it follows the device plugin, which
    spreads pods (GPU 0, 1, 0, 1, 0): five run, and the sixth stays Pending, since GPU 0 holds three
    and still has a replica free. Where vramguard's intended device differs, the kubelet's wins."""
    spec = gpu_nodes.time_sliced("spread", "H100-80GB", gpus=2, replicas=4)
    node = node_for(spec)
    agent = start_agent(node)
    core = real.core_v1
    real_gpu: dict[str, str] = {}
    intended: dict[str, list[str]] = {}
    for i in range(5):
        name = f"vllm-{i}"
        core.create_namespaced_pod(namespace, pinned_vllm_pod(name, unique))
        pod = running(core, namespace, name, timeout=90)
        visible = container_env(core, namespace, name)["NVIDIA_VISIBLE_DEVICES"]
        real_gpu[pod.metadata.uid] = gpu_index(node.spec, visible)
        placement = json.loads(pod.metadata.annotations["vramguard.io/placement"])
        intended[pod.metadata.uid] = placement["containers"]["vllm"]
        # The agent reports what the kubelet says, which is what the container was given.
        wait_for_report(core, node.name, agent, lambda r: {
            uid: containers.get("vllm") for uid, containers in (r.get("pods") or {}).items()
        } == {uid: [gpu] for uid, gpu in real_gpu.items()})
        assert violations_on_own_nodes(real.cluster, unique) == []
    # distributedAlloc: the least used GPU first, ties to the lower index.
    assert list(real_gpu.values()) == ["0", "1", "0", "1", "0"]
    assert any(intended[uid] != [gpu] for uid, gpu in real_gpu.items()), "no intended device was overruled"
    core.create_namespaced_pod(namespace, pinned_vllm_pod("vllm-5", unique))
    assert "VRAM budget free below" in refusal(core, namespace, "vllm-5")
    assert violations_on_own_nodes(real.cluster, unique) == []


def test_a_kubelet_restart_is_conservative_then_recovers(
    real: RealCluster, namespace: str, unique: str, node_for: NodeFor,
    start_agent: Callable[[real_nodes.RealNode], Agent],
) -> None:
    """Two pods known on GPU 0 and 1: a third fits anywhere. While the kubelet is down the agent
    cannot say where pods run, so the extender assumes the worst (both might share a GPU, and the
    third would make three, still within budget, but a fourth...): with placements unknown three
    0.30 pods fill the node, so a third may bind and a fourth may not. Once the kubelet is back, the
    placements are known again and the fourth binds and runs."""
    spec = gpu_nodes.time_sliced("restart", "H100-80GB", gpus=2, replicas=4)
    node = node_for(spec)
    agent = start_agent(node)
    core = real.core_v1
    uids = []
    for i in range(3):
        core.create_namespaced_pod(namespace, pinned_vllm_pod(f"vllm-{i}", unique))
        uids.append(running(core, namespace, f"vllm-{i}", timeout=90).metadata.uid)
        wait_for_report(core, node.name, agent, lambda r: set(r.get("pods") or {}) == set(uids))

    real.nodes.stop_kubelet(node)
    wait_for_report(core, node.name, agent, lambda r: not r.get("pods"))
    core.create_namespaced_pod(namespace, pinned_vllm_pod("vllm-3", unique))
    assert "not known" in refusal(core, namespace, "vllm-3")
    # The containers kept running without their kubelet.
    assert all(node.container_pids(uid) for uid in uids)

    real.nodes.start_kubelet(node)
    real.nodes.wait_ready(node)
    # vllm-3 is tried again by itself: no other node is there for an in-tree plugin to reject, so
    # kube-scheduler retries a pod only the extender refused after its backoff. (Where a plugin also
    # rejected other nodes, it waits for an event that plugin registers, or the five-minute flush.)
    wait_for_report(core, node.name, agent, lambda r: set(r.get("pods") or {}) >= set(uids), timeout=60)
    pod = running(core, namespace, "vllm-3", timeout=120)
    assert pod.spec.node_name == node.name
    assert violations_on_own_nodes(real.cluster, unique) == []


def test_enforced_limits_reach_the_running_container(
    real: RealCluster, namespace: str, unique: str, node_for: NodeFor
) -> None:
    """In a namespace of class ``shared`` (whose policy here enforces limits) a pod declaring 30 GiB
    (above its engine's own 24.4 GiB, which a declaration never counts below) runs with the limit
    variables in its environment, as the container itself prints them."""
    node = node_for(gpu_nodes.time_sliced("limits", "H100-80GB", gpus=1, replicas=4))
    core = real.core_v1
    core.patch_namespace(namespace, {"metadata": {"labels": {QOS_CLASS_LABEL: "shared"}}})
    declared = pinned_vllm_pod("declared", unique, annotations={"vramguard.io/vram": "30Gi"})
    core.create_namespaced_pod(namespace, declared)
    assert running(core, namespace, "declared").spec.node_name == node.name
    env = container_env(core, namespace, "declared")
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == env["NVIDIA_GPU_MEMORY_LIMIT"] == str(30 * 1024)
    assert env["NVIDIA_VISIBLE_DEVICES"] == device_plugin.gpu_uuid(node.name, 0)


def test_a_process_over_its_prediction_raises_the_event_and_metric(
    real: RealCluster, namespace: str, unique: str, node_for: NodeFor,
    start_agent: Callable[[real_nodes.RealNode], Agent],
) -> None:
    """The container's real process, as NVML would list it, uses 40 GiB where its pod declares 1 GiB
    (vLLM's own 0.30 claim, which a declaration never lowers, is what the ledger holds): the agent
    attributes it through the process's cgroup to the pod, publishes the excess over that and raises
    one Warning Event."""
    spec = gpu_nodes.time_sliced("overuse", "H100-80GB", gpus=1, replicas=4)
    node = node_for(spec)
    agent = start_agent(node)
    core = real.core_v1
    core.create_namespaced_pod(namespace, pinned_vllm_pod("liar", unique, annotations={"vramguard.io/vram": "1Gi"}))
    pod = running(core, namespace, "liar")
    container_log(core, namespace, "liar")  # the stand-in has printed its settings and sleeps: one process
    container_id = pod.status.container_statuses[0].container_id.rpartition("://")[2]
    pids = [pid for pid in node.container_pids(pod.metadata.uid) if container_id in real_nodes._cgroup_text(pid)]
    assert len(pids) == 1, f"the container's processes: {pids}"
    # Replaced in one step: the agent re-reads the recording every cycle.
    partial = agent.recording.with_suffix(".partial")
    partial.write_text(json.dumps(device_plugin.nvml_recording(node.spec, {0: [(pids[0], 40 * GiB)]})))
    partial.replace(agent.recording)
    # What the ledger holds for it: its declaration, never below vLLM's own claim on the GPU (0.30 of
    # the memory CUDA sees, NVML's total less the driver's reserve, plus a CUDA context).
    held = max(GiB, int(0.30 * (H100_BYTES - RESERVED)) + CUDA_CONTEXT)
    seen: list[str] = []

    def over_use() -> bool:
        try:
            with urllib.request.urlopen(agent.metrics_url, timeout=10) as response:
                text = response.read().decode()
        except OSError:  # not listening yet
            return False
        pattern = r'^vramguard_pod_vram_overuse_bytes\{[^}]*pod="liar"[^}]*\} (\S+)$'
        seen[:] = re.findall(pattern, text, re.M)
        return any(abs(float(value) - (40 * GiB - held)) <= MiB for value in seen)

    try:
        wait_for("the over-use metric", over_use, 30)
    except AssertionError as error:
        raise AssertionError(f"{error}: series {seen}; agent log:\n{agent.process.log_tail()}") from None
    # The annotation follows the metric within the agent's --min-write-interval.
    used = wait_for_report(core, node.name, agent, lambda r: "used" in r)["used"]
    assert used == {pod.metadata.uid: {"0": 40 * GiB}}
    events = wait_for("the over-use Event", lambda: [
        e for e in core.list_namespaced_event(namespace).items if e.reason == OVERUSE_EVENT], 30)
    assert len(events) == 1 and events[0].involved_object.uid == pod.metadata.uid and events[0].type == "Warning"


def test_mig_and_mps_nodes_run_pods_on_their_devices(
    real: RealCluster, namespace: str, unique: str, node_for: NodeFor
) -> None:
    """The same node descriptions as the fake nodes': a MIG node (mixed strategy) gives a pod one MIG
    device of the profile it asks for; an MPS node gives each pod a replica of its GPU."""
    mig = node_for(gpu_nodes.mig_mixed("mig", "H100-80GB", ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]))
    mps = node_for(gpu_nodes.mps("mps", "L4", gpus=1, replicas=2))
    core = real.core_v1
    on_mig = pinned_vllm_pod("on-mig", unique)
    on_mig["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/mig-3g.40gb": "1"}}
    on_mig["spec"]["nodeSelector"]["kubernetes.io/hostname"] = mig.name
    on_mps = pinned_vllm_pod("on-mps", unique)
    on_mps["spec"]["nodeSelector"]["kubernetes.io/hostname"] = mps.name
    core.create_namespaced_pod(namespace, on_mig)
    core.create_namespaced_pod(namespace, on_mps)
    assert running(core, namespace, "on-mig").spec.node_name == mig.name
    assert running(core, namespace, "on-mps").spec.node_name == mps.name
    # The 3g.40gb instance is the first slot of the layout, on the node's only GPU.
    assert container_env(core, namespace, "on-mig")["NVIDIA_VISIBLE_DEVICES"] == device_plugin.mig_uuid(mig.name, 0, 0)
    assert container_env(core, namespace, "on-mps")["NVIDIA_VISIBLE_DEVICES"] == device_plugin.gpu_uuid(mps.name, 0)
    assert violations_on_own_nodes(real.cluster, unique) == []


def test_teardown_restores_the_host(real: RealCluster, unique: str) -> None:
    """A node started and stopped leaves no process, cgroup, bridge, mount or sysctl changed behind."""
    def host() -> dict[str, Any]:
        return {
            "sysctls": {name: (Path("/proc/sys") / name).read_text().strip() for name in real_nodes.SYSCTLS},
            "bridges": set(real_nodes._bridges()),
            "mounts": [line for line in Path("/proc/self/mounts").read_text().splitlines()
                       if str(real.tmp) in line],
        }

    assert not real.nodes.nodes, "every other test's nodes have stopped"
    own = real_nodes.RealNodes(real.cluster)
    before = host()
    node = own.start(private_node(gpu_nodes.exclusive("teardown", "L4"), unique))
    core = real.core_v1
    name = f"real-{unique}"
    core.create_namespace({"metadata": {"name": name}})
    try:
        core.create_namespaced_pod(name, pinned_vllm_pod("p", unique))
        uid = running(core, name, "p").metadata.uid
        assert node.container_pids(uid)
        assert node.bridge in real_nodes._bridges()  # made by the CNI plugin for the first pod
        own.stop()
        assert not node.container_pids(uid)
        assert not real_nodes.cgroup_pids(node.cgroup)
        assert not any((path).exists() for path in real_nodes.cgroup_dirs(node.cgroup))
        assert not processes_mentioning(str(node.containerd_socket))
        assert host() == before
    finally:
        if own.nodes:
            own.stop()
        core.delete_namespace(name)
