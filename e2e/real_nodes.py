"""Real nodes for the local control plane: a kubelet with its own containerd that runs the pods, and
the harness's device plugin advertising the node's GPUs (``e2e.device_plugin``).

Each node lives in a mount namespace of its own (``unshare -m --propagation private``), so that
several nodes on one machine do not share the paths the kubelet and containerd hard-code: private
directories are bind-mounted over ``/var/lib/kubelet/device-plugins`` (fixed by the device-plugin
API), ``/run/containerd``, ``/var/log/containers`` and ``/var/lib/cni``. Inside it run containerd
(Debian's 1.6, its own config, root, state and socket; runc with the cgroupfs driver; a CNI bridge
with one /24 per node), the kubelet built with the control plane, and the device plugin. Pod
containers are processes of this machine under the node's cgroup root ``/vramguard-e2e/<node>``.

What it changes on the host, and restores: the sysctls the kubelet and the bridge plugin set
(``vm.overcommit_memory``, ``kernel.panic``, ``kernel.panic_on_oops``, ``net.ipv4.ip_forward``),
one bridge ``vge2e<n>`` per node, the cgroup directories, and the empty mount points it had to make.
Nothing is mounted on the host itself. Teardown goes pods, kubelet, containerd; a run that died
without one is cleaned up by the next (:func:`clean_leftovers`).

Needs root on Linux, and from Debian: ``containerd runc containernetworking-plugins busybox-static``
(what :func:`missing` reports).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e import build, device_plugin, gpu_nodes, images
from e2e.procs import (
    ManagedProcess,
    free_ports,
    group_members,
    http_status,
    is_running,
    process_start_time,
    processes_mentioning,
    wait_until,
)

CGROUP_ROOT = "vramguard-e2e"
CGROUP_FS = Path("/sys/fs/cgroup")
CNI_BIN = Path("/usr/lib/cni")
BRIDGE_PREFIX = "vge2e"
RUN_ROOT = Path("/run/vramguard-e2e")
"""Each node's sockets, containerd state and kubelet root, under a path short enough for a unix
socket (108 bytes); every shim's command line names it, so leftovers can be found."""
SOCKET_NAME = "containerd.sock"
NAMESPACE_PATHS = ("/var/lib/kubelet/device-plugins", "/run/containerd", "/var/log/containers", "/var/lib/cni")
POD_RESOURCES = "/var/lib/kubelet/pod-resources"
"""Where a DaemonSet (the node agent's) finds the kubelet's PodResources socket: the node's own, from
its kubelet root, mounted there in the node's namespace."""
MOUNT_POINTS = (*NAMESPACE_PATHS, POD_RESOURCES)
SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops", "net/ipv4/ip_forward")
TOOLS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "unshare", "nsenter", "ip")
PODS_PER_NODE = 110
CLUSTER_CIDR = "10.244.0.0/16"
"""Every node's pod subnet is a /24 of it."""
REPOSITORY = Path(__file__).resolve().parent.parent


def _log(message: str) -> None:
    print(f"e2e.real_nodes: {message}", file=sys.stderr, flush=True)


def missing() -> list[str]:
    """Why real nodes cannot run here (empty when they can)."""
    reasons = []
    if platform.system() != "Linux":
        reasons.append("not Linux")
    elif os.geteuid() != 0:
        reasons.append("not root")
    reasons += [f"no {tool} on PATH" for tool in TOOLS if shutil.which(tool) is None]
    if not (CNI_BIN / "bridge").is_file():
        reasons.append(f"no CNI plugins in {CNI_BIN} (containernetworking-plugins)")
    if not images.BUSYBOX.is_file():
        reasons.append(f"no {images.BUSYBOX} (busybox-static)")
    if shutil.which("gcc") is None:
        reasons.append("no gcc (for the pause image)")
    return reasons


# --------------------------------------------------------------------------- host state


def _cgroup_v2() -> bool:
    return (CGROUP_FS / "cgroup.controllers").is_file()


def cgroup_dirs(relative: str) -> list[Path]:
    """``relative`` in every hierarchy (v1), or in the unified one (v2)."""
    if _cgroup_v2():
        return [CGROUP_FS / relative]
    return [h / relative for h in sorted(CGROUP_FS.iterdir()) if h.is_dir() and not h.is_symlink()
            and (h / "cgroup.procs").is_file()]


def make_cgroup(relative: str) -> None:
    """Create ``relative`` (and its parents) in every hierarchy, cpusets filled from the parent."""
    if _cgroup_v2():
        parent = CGROUP_FS
        for part in Path(relative).parts:
            with contextlib.suppress(OSError):
                (parent / "cgroup.subtree_control").write_text("+cpu +cpuset +memory +pids +io")
            parent = parent / part
            parent.mkdir(exist_ok=True)
        return
    for top in cgroup_dirs(""):
        path = top
        for part in Path(relative).parts:
            child = path / part
            child.mkdir(exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):
                if (child / name).is_file() and not (child / name).read_text().strip():
                    (child / name).write_text((path / name).read_text())
            path = child


def cgroup_pids(relative: str) -> set[int]:
    """Every process in ``relative``'s subtree, in any hierarchy."""
    found: set[int] = set()
    for top in cgroup_dirs(relative):
        if not top.is_dir():
            continue
        for procs in top.rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                found.update(int(line) for line in procs.read_text().split())
    return found


def remove_cgroup(relative: str) -> None:
    """Remove ``relative``'s subtree (empty of processes) from every hierarchy, deepest first."""
    for top in cgroup_dirs(relative):
        if not top.is_dir():
            continue
        for directory in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                directory.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


def _kill_all(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _bridges() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=False).stdout
    names = [line.split(":", 2)[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2]
    return [name for name in names if name.startswith(BRIDGE_PREFIX)]


def _delete_bridge(name: str) -> None:
    subprocess.run(["ip", "link", "delete", name], capture_output=True, check=False)


def _veths_of(bridge: str) -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show", "master", bridge], capture_output=True, text=True,
                         check=False).stdout
    return [line.split(":", 2)[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2]


OWNER_FILE = "owner.json"
"""In each node's run directory: the node's name and the process that started it."""


def _owner(run: Path) -> dict[str, Any]:
    try:
        data = json.loads((run / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _owner_alive(owner: Mapping[str, Any]) -> bool:
    pid, start = owner.get("pid"), owner.get("start_time")
    return isinstance(pid, int) and is_running(pid, start if isinstance(start, int) else None)


def clean_leftovers() -> None:
    """What runs that died without their teardown left (their owner process is gone): containers
    and shims, cgroups, bridges, run directories. Nodes of a live run, in this process or another,
    are left alone."""
    if not RUN_ROOT.is_dir():
        return
    for run in sorted(RUN_ROOT.iterdir()):
        owner = _owner(run)
        if _owner_alive(owner):
            continue
        node = str(owner.get("node") or "")
        cgroup = f"{CGROUP_ROOT}/{node}" if node else None
        stale = set(processes_mentioning(f"{run}/")) | (cgroup_pids(cgroup) if cgroup else set())
        if stale:
            _log(f"killing {len(stale)} processes a previous run of node {node or run.name} left")
            _kill_all(stale)
            time.sleep(0.5)
        if cgroup:
            remove_cgroup(cgroup)
        for veth in _veths_of(run.name):
            _delete_bridge(veth)
        _delete_bridge(run.name)
        shutil.rmtree(run, ignore_errors=True)


def reserve_run_directory(node: str) -> Path:
    """A run directory ``RUN_ROOT/vge2e<n>`` of this process's own (``n`` also names the node's bridge
    and subnet): made with ``mkdir``, so concurrent runs never share one."""
    RUN_ROOT.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    for n in range(1, 250):
        run = RUN_ROOT / f"{BRIDGE_PREFIX}{n}"
        try:
            run.mkdir()
        except FileExistsError:
            continue
        (run / OWNER_FILE).write_text(json.dumps({"node": node, "pid": pid, "start_time": process_start_time(pid)}))
        return run
    raise RuntimeError(f"no free run directory under {RUN_ROOT}")


@dataclass
class HostChanges:
    """The host settings real nodes change, recorded before the first node and restored after the last."""

    sysctls: dict[str, str] = field(default_factory=dict)
    made_dirs: list[Path] = field(default_factory=list)

    def record(self) -> None:
        """Remember the sysctls and which namespace mount points already exist; make the missing ones."""
        for name in SYSCTLS:
            with contextlib.suppress(OSError):
                self.sysctls[name] = (Path("/proc/sys") / name).read_text().strip()
        for path in map(Path, MOUNT_POINTS):
            missing_parts = [p for p in (path, *path.parents) if not p.exists()]
            path.mkdir(parents=True, exist_ok=True)
            self.made_dirs.extend(sorted(missing_parts, key=lambda p: -len(p.parts)))

    def restore(self) -> None:
        """Put the sysctls back and remove the mount points made (when still empty)."""
        for name, value in self.sysctls.items():
            with contextlib.suppress(OSError):
                if (Path("/proc/sys") / name).read_text().strip() != value:
                    (Path("/proc/sys") / name).write_text(value)
        for path in self.made_dirs:
            with contextlib.suppress(OSError):
                path.rmdir()
        self.sysctls.clear()
        self.made_dirs.clear()


# --------------------------------------------------------------------------- configuration


def containerd_config(directory: Path, run: Path, cni_conf: Path) -> str:
    """containerd 1.6's configuration (version 2) for one node."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return "\n".join([
        "version = 2",
        f'root = "{directory / "containerd" / "root"}"',
        f'state = "{run / "state"}"',
        'disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.btrfs", '
        '"io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", '
        '"io.containerd.snapshotter.v1.aufs"]',
        "[grpc]",
        f'  address = "{run / SOCKET_NAME}"',
        "[ttrpc]",
        f'  address = "{run / (SOCKET_NAME + ".ttrpc")}"',
        f"[{cri}]",
        f'  sandbox_image = "{images.PAUSE_IMAGE}"',
        # Root here may lack CAP_SYS_RESOURCE; the kubelet asks oom_score_adj -998 for sandboxes.
        "  restrict_oom_score_adj = true",
        '  stream_server_address = "127.0.0.1"',
        '  stream_server_port = "0"',
        f"[{cri}.containerd]",
        '  snapshotter = "overlayfs"',
        '  default_runtime_name = "runc"',
        f"[{cri}.containerd.runtimes.runc]",
        '  runtime_type = "io.containerd.runc.v2"',
        f"[{cri}.containerd.runtimes.runc.options]",
        "  SystemdCgroup = false",
        f"[{cri}.cni]",
        f'  bin_dir = "{CNI_BIN}"',
        f'  conf_dir = "{cni_conf}"',
        "",
    ])


def cni_config(name: str, bridge: str, subnet: int) -> dict[str, Any]:
    """A bridge network with one /24 of its own, no masquerading (nothing leaves the machine)."""
    return {
        "cniVersion": "1.0.0",
        "name": f"e2e-{name}",
        "plugins": [{
            "type": "bridge", "bridge": bridge, "isGateway": True, "ipMasq": False,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": f"10.244.{subnet}.0/24"}]],
                     "routes": [{"dst": "0.0.0.0/0"}]},
        }],
    }


def kubelet_config(
    spec: gpu_nodes.GPUNodeSpec, directory: Path, run: Path, ca: Path, ports: tuple[int, int],
    taints: Sequence[Mapping[str, str]],
) -> dict[str, Any]:
    """The KubeletConfiguration of one node."""
    port, healthz = ports
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # This machine's cgroups may be v1, which 1.36 still runs when told to.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{CGROUP_ROOT}/{spec.name}",
        "failSwapOn": False,
        # The API server reaches it at the node's address for logs; only clients of the cluster's CA
        # are let in.
        "address": "0.0.0.0",
        "port": port,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz,
        "readOnlyPort": 0,
        "authentication": {"x509": {"clientCAFile": str(ca)}, "anonymous": {"enabled": False},
                           "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{run / SOCKET_NAME}",
        "podLogsDir": str(directory / "pod-logs"),
        "volumePluginDir": str(directory / "volume-plugins"),
        "makeIPTablesUtilChains": False,
        "nodeStatusUpdateFrequency": "2s",
        "nodeStatusReportFrequency": "10s",
        "syncFrequency": "10s",
        "serializeImagePulls": False,
        "maxPods": PODS_PER_NODE,
        # A test machine's disk may be fuller than production thresholds allow.
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "registerWithTaints": [dict(taint) for taint in taints],
    }


def registration_labels(spec: gpu_nodes.GPUNodeSpec) -> dict[str, str]:
    """The labels the node registers with: GFD's (or the platform's) and the test's; the kubelet sets
    the well-known ``kubernetes.io`` ones itself."""
    return {key: value for key, value in gpu_nodes.node_labels(spec).items()
            if not key.split("/")[0].endswith(("kubernetes.io", "k8s.io"))}


# --------------------------------------------------------------------------- a node


@dataclass
class RealNode:
    """One running node; made by :meth:`RealNodes.start`."""

    spec: gpu_nodes.GPUNodeSpec
    directory: Path
    bridge: str
    processes: dict[str, ManagedProcess] = field(default_factory=dict)
    kubelet_argv: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The Node's name."""
        return self.spec.name

    @property
    def run(self) -> Path:
        """Sockets, containerd's state and the kubelet's root: a short path (see :data:`RUN_ROOT`)."""
        return RUN_ROOT / self.bridge

    @property
    def podresources_socket(self) -> Path:
        """The kubelet's PodResources socket."""
        return self.run / "kubelet" / "pod-resources" / "kubelet.sock"

    @property
    def cgroup(self) -> str:
        """The node's cgroup root, relative to each hierarchy."""
        return f"{CGROUP_ROOT}/{self.name}"

    @property
    def containerd_socket(self) -> Path:
        """containerd's socket."""
        return self.run / SOCKET_NAME

    def in_namespace(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run in the node's mount namespace."""
        return ["nsenter", "-m", "-t", str(self.processes["namespace"].record.pid), "--", *argv]

    def container_pids(self, pod_uid: str) -> list[int]:
        """The processes of pod ``pod_uid``'s containers (its sandbox's pause included)."""
        marker = "pod" + pod_uid
        return sorted(pid for pid in cgroup_pids(self.cgroup) if marker in _cgroup_text(pid))


def _cgroup_text(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cgroup").read_text(errors="replace")
    except OSError:
        return ""


class RealNodes:
    """The real nodes of one cluster; :meth:`stop` removes them all."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.nodes: dict[str, RealNode] = {}
        self.host = HostChanges()
        self._binaries: build.Binaries | None = None
        self._proxy: ManagedProcess | None = None

    def start(self, spec: gpu_nodes.GPUNodeSpec, timeout: float = 90.0) -> RealNode:
        """Start a node for ``spec`` and return once it is Ready with its GPUs in its allocatable."""
        reasons = missing()
        if reasons:
            raise RuntimeError(f"real nodes cannot run here: {'; '.join(reasons)}")
        clean_leftovers()
        if not self.nodes:
            self.host.record()
        self._binaries = self._binaries or build.ensure_built(self.cluster.version)
        run = reserve_run_directory(spec.name)
        subnet = int(run.name.removeprefix(BRIDGE_PREFIX))
        directory = self.cluster.directory / "nodes" / spec.name
        shutil.rmtree(directory, ignore_errors=True)
        node = RealNode(spec, directory, f"{BRIDGE_PREFIX}{subnet}")
        self.nodes[spec.name] = node
        try:
            self._start(node, subnet, timeout)
        except BaseException:
            self._stop_node(node)
            del self.nodes[spec.name]
            raise
        return node

    def _spawn(self, node: RealNode, name: str, argv: Sequence[str]) -> ManagedProcess:
        # The device plugin is this repository's module, run from the node's directory.
        path = os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        proc = ManagedProcess.start(
            f"{node.name}-{name}", argv, log_path=node.directory / "logs" / f"{name}.log",
            pid_dir=node.directory / "pids", cwd=node.directory, env=env,
            die_with_parent=not self.cluster.config.detach)
        node.processes[name] = proc
        return proc

    def _start(self, node: RealNode, subnet: int, timeout: float) -> None:
        spec, directory = node.spec, node.directory
        assert self._binaries is not None
        for sub in ("logs", "pids", "pki", "cni", "pod-logs", "volume-plugins",
                    *(f"mounts/{i}" for i in range(len(NAMESPACE_PATHS)))):
            (directory / sub).mkdir(parents=True, exist_ok=True)
        make_cgroup(node.cgroup)

        # The mount namespace: held by a process that bind-mounts the private directories, then waits.
        ready = directory / "namespace-ready"
        (node.podresources_socket.parent).mkdir(parents=True)
        sources = [*(directory / "mounts" / str(i) for i in range(len(NAMESPACE_PATHS))),
                   node.podresources_socket.parent]
        mounts = "; ".join(f"mount --bind {src} {path}" for src, path in zip(sources, MOUNT_POINTS, strict=True))
        holder = self._spawn(node, "namespace", [
            "unshare", "-m", "--propagation", "private", "--",
            "sh", "-c", f"set -e; {mounts}; touch {ready}; exec sleep 2147483647"])
        wait_until(f"{node.name} mount namespace", ready.exists, timeout=20, process=holder)

        cni_conf = directory / "cni"
        (cni_conf / "10-bridge.conflist").write_text(json.dumps(cni_config(node.name, node.bridge, subnet)))
        (directory / "containerd.toml").write_text(containerd_config(directory, node.run, cni_conf))
        containerd = self._spawn(node, "containerd", node.in_namespace(
            ["containerd", "--config", str(directory / "containerd.toml"), "--log-level", "warn"]))
        wait_until(f"{node.name} containerd", node.containerd_socket.exists, timeout=timeout, process=containerd)
        for name, archive in images.archives(self._binaries).items():
            subprocess.run(["ctr", "--address", str(node.containerd_socket), "-n", "k8s.io", "images", "import",
                            "--all-platforms", str(archive)],
                           check=True, capture_output=True, timeout=120)
            _log(f"{node.name}: imported {name}")

        spec_file = directory / "node.json"
        spec_file.write_text(json.dumps(device_plugin.spec_to_json(spec)))
        self._spawn(node, "device-plugin", node.in_namespace(
            [sys.executable, "-m", "e2e.device_plugin", "--node", str(spec_file)]))

        ca = self.cluster.pki / "ca.crt"
        self.cluster.ca.issue(f"system:node:{node.name}", organizations=["system:nodes"], server=False,
                              client=True).write(directory / "pki" / "node.crt", directory / "pki" / "node.key")
        kubeconfig = directory / "kubelet.kubeconfig"
        # JSON, which is YAML: Go's YAML reads a plain 9983e149 (a test's id) as a number, PyYAML writes it bare.
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "e2e", "cluster": {"server": self.cluster.server,
                                                     "certificate-authority": str(ca)}}],
            "users": [{"name": "node", "user": {"client-certificate": str(directory / "pki" / "node.crt"),
                                                "client-key": str(directory / "pki" / "node.key")}}],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "node"}}],
            "current-context": "e2e",
        }))
        port, healthz = free_ports(2)
        config = directory / "kubelet.yaml"
        config.write_text(json.dumps(kubelet_config(spec, directory, node.run, ca, (port, healthz), spec.taints)))
        labels = ",".join(f"{key}={value}" for key, value in sorted(registration_labels(spec).items()))
        node.kubelet_argv = node.in_namespace([
            str(self._binaries.directory / "kubelet"), f"--config={config}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={node.run / 'kubelet'}", f"--cert-dir={directory / 'kubelet-pki'}",
            f"--hostname-override={node.name}", f"--node-labels={labels}", "--oom-score-adj=0", "--v=1"])
        started = time.monotonic()
        self.start_kubelet(node)
        self.wait_ready(node, timeout)
        _log(f"{node.name}: Ready with its GPUs in {time.monotonic() - started:.1f}s")
        if self.cluster.config.pod_network and self._proxy is None:
            self._start_kube_proxy(node)

    def _start_kube_proxy(self, node: RealNode) -> None:
        """kube-proxy (iptables) for every node of a cluster with ``pod_network``: the nodes share this
        machine's network namespace, so one proxy, started with the first node, routes ClusterIPs for
        all their pods. Host sysctls stay as they are (conntrack limits and timeouts 0, no localhost
        NodePorts); its iptables rules are removed when the last node stops."""
        assert self._binaries is not None
        healthz, metrics = free_ports(2)
        proc = ManagedProcess.start(
            "kube-proxy", [
                str(self._binaries.directory / "kube-proxy"), f"--kubeconfig={self.cluster.kubeconfig}",
                "--proxy-mode=iptables", f"--cluster-cidr={CLUSTER_CIDR}", f"--hostname-override={node.name}",
                "--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0s",
                "--conntrack-tcp-timeout-close-wait=0s", "--iptables-localhost-nodeports=false",
                "--nodeport-addresses=primary", f"--healthz-bind-address=127.0.0.1:{healthz}",
                f"--metrics-bind-address=127.0.0.1:{metrics}", "--v=1"],
            log_path=self.cluster.logs / "kube-proxy.log", pid_dir=self.cluster.directory / "pids",
            cwd=self.cluster.directory, die_with_parent=not self.cluster.config.detach)
        self._proxy = proc
        waited = wait_until("kube-proxy /healthz", lambda: http_status(f"http://127.0.0.1:{healthz}/healthz") == 200,
                            timeout=60, process=proc)
        _log(f"kube-proxy ready ({waited:.1f}s)")

    def _stop_kube_proxy(self) -> None:
        if self._proxy is None:
            return
        binary = self._proxy.record.argv[0]
        try:
            self._proxy.stop(timeout=10)
        finally:
            self._proxy = None
            # Its iptables chains outlive it.
            subprocess.run([binary, "--cleanup"], capture_output=True, check=False, timeout=60)

    def start_agent(self, node: RealNode, recording: Path, port: int) -> ManagedProcess:
        """``vramguard agent`` for ``node`` as the DaemonSet runs it (host PIDs, the kubelet's
        PodResources socket), NVML replayed from ``recording`` (re-read every cycle, so it may be
        rewritten), serving its metrics on ``127.0.0.1:port``; it stops with the node."""
        return self._spawn(node, "agent", [
            sys.executable, "-m", "vramguard", "agent", "--node-name", node.name, "--listen", f"127.0.0.1:{port}",
            "--kubeconfig", str(self.cluster.kubeconfig), "--nvml-recording", str(recording),
            "--podresources-socket", str(node.podresources_socket), "--host-pid", "--proc-root", "/proc",
            "--interval", "0.5", "--min-write-interval", "1", "--lease-duration", "10"])

    def load_image(self, node: RealNode, archive: Path, *names: str) -> None:
        """Import an OCI or docker archive into the node's containerd, tagged also as ``names``."""
        ctr = ["ctr", "--address", str(node.containerd_socket), "-n", "k8s.io", "images"]
        done = subprocess.run([*ctr, "import", "--all-platforms", str(archive)], check=True, capture_output=True,
                              text=True, timeout=300)
        imported = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("unpacking ")]
        for name in names:
            if imported and name not in imported:
                subprocess.run([*ctr, "tag", "--force", imported[0], name], check=True, capture_output=True,
                               timeout=60)
        _log(f"{node.name}: imported {', '.join(imported or [str(archive)])} {' '.join(names)}")

    def start_kubelet(self, node: RealNode) -> ManagedProcess:
        """(Re)start the node's kubelet."""
        return self._spawn(node, "kubelet", node.kubelet_argv)

    def stop_kubelet(self, node: RealNode) -> None:
        """Stop the kubelet; the pods' containers keep running, as they do when a kubelet restarts."""
        node.processes.pop("kubelet").stop()

    def wait_ready(self, node: RealNode, timeout: float = 90.0) -> None:
        """Until the Node is Ready and its allocatable shows every GPU resource the plugin serves."""
        wanted = {resource.name: str(len(resource.ids)) for resource in device_plugin.resources(node.spec)}

        def ready() -> bool:
            try:
                status = self.cluster.request("GET", f"/api/v1/nodes/{node.name}")["status"]
            except Exception:
                return False
            conditions = {c["type"]: c["status"] for c in status.get("conditions") or ()}
            allocatable = status.get("allocatable") or {}
            return conditions.get("Ready") == "True" and all(allocatable.get(k) == v for k, v in wanted.items())

        wait_until(f"{node.name} Ready with {wanted}", ready, timeout=timeout, process=node.processes["kubelet"])

    # ------------------------------------------------------------------ teardown

    def _stop_node(self, node: RealNode) -> None:
        errors = []
        if "agent" in node.processes:
            with contextlib.suppress(RuntimeError):
                node.processes.pop("agent").stop(timeout=10)
        # Pods first: with the kubelet gone nothing restarts them; then containerd and its shims.
        if "kubelet" in node.processes:
            with contextlib.suppress(RuntimeError):
                node.processes.pop("kubelet").stop(timeout=10)
        for _ in range(3):
            pids = cgroup_pids(node.cgroup)
            if not pids:
                break
            _kill_all(pids)
            time.sleep(0.3)
        for name in ("device-plugin", "containerd", "namespace"):
            proc = node.processes.pop(name, None)
            if proc is not None:
                try:
                    proc.stop(timeout=10)
                except RuntimeError as error:
                    errors.append(str(error))
        _kill_all(set(processes_mentioning(str(node.containerd_socket))))
        deadline = time.monotonic() + 10
        while (processes_mentioning(str(node.containerd_socket)) or cgroup_pids(node.cgroup)) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        remove_cgroup(node.cgroup)
        shutil.rmtree(node.run, ignore_errors=True)
        for veth in _veths_of(node.bridge):
            _delete_bridge(veth)
        _delete_bridge(node.bridge)
        with contextlib.suppress(Exception):
            self.cluster.request("DELETE", f"/api/v1/nodes/{node.name}")
        left = group_members([proc.record.pid for proc in node.processes.values()])
        if errors or left:
            raise RuntimeError(f"{node.name}: processes left behind: {left} {errors}")

    def stop(self, name: str | None = None) -> None:
        """Stop node ``name``, or every node; the host is restored once none is left."""
        for node in [self.nodes[name]] if name else list(self.nodes.values()):
            try:
                self._stop_node(node)
            finally:
                del self.nodes[node.name]
        if not self.nodes:
            self._stop_kube_proxy()
            # Empty unless another run's nodes are there.
            for directory in (*cgroup_dirs(CGROUP_ROOT), RUN_ROOT):
                with contextlib.suppress(OSError):
                    directory.rmdir()
            self.host.restore()

    @contextlib.contextmanager
    def running(self, *specs: gpu_nodes.GPUNodeSpec) -> Iterator[list[RealNode]]:
        """Nodes for ``specs`` for the length of a ``with`` block."""
        try:
            yield [self.start(spec) for spec in specs]
        finally:
            self.stop()
