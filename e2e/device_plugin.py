"""A device plugin of the harness's own: a node's GPUs advertised to a real kubelet as the NVIDIA
device plugin advertises them, over the kubelet's device-plugin API (``v1beta1``, stubs generated
from ``k8s.io/kubelet``'s proto, see ``e2e/proto/``).

What it copies from NVIDIA/k8s-device-plugin (v0.17, ``internal/plugin/server.go`` and
``internal/rm``), because vramguard depends on it:

* resources and ids: whole GPUs ``GPU-<uuid>`` as ``nvidia.com/gpu``; time-slicing or MPS
  replicas ``GPU-<uuid>::<n>`` (``nvidia.com/gpu.shared`` when renamed); MIG devices
  ``MIG-<uuid>`` as ``nvidia.com/mig-<profile>`` (mixed strategy);
* ``GetPreferredAllocation`` for replicas spreads them over the GPUs, the least used GPU first
  (``distributedAlloc``): so the GPU the kubelet gives a pod is the device plugin's choice, not the
  scheduler's;
* ``Allocate`` answers ``NVIDIA_VISIBLE_DEVICES`` with the GPUs' (or MIG devices') UUIDs, the
  replica suffix dropped (``deviceIDsFromAnnotatedDeviceIDs``);
* when the kubelet restarts it deletes every socket in the plugin directory: the plugin notices
  and registers again.

UUIDs are derived from the node's name and the GPU's index, so the NVML recording the node's agent
replays (:func:`nvml_recording`) names the same devices.

Command line (what the harness runs inside a node's mount namespace)::

    python -m e2e.device_plugin --node FILE.json [--plugin-dir /var/lib/kubelet/device-plugins]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e import gpu_nodes

PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
"""``DevicePluginPath`` of the API (``constants.go``): fixed, it ignores the kubelet's ``--root-dir``."""
KUBELET_SOCKET = "kubelet.sock"
API_VERSION = "v1beta1"
VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
_UUID_NAMESPACE = uuid.UUID("6f1c1b1e-3a52-4d7e-9a38-2f0c6d3b7e11")


def gpu_uuid(node: str, index: int) -> str:
    """The UUID of GPU ``index`` of ``node``, NVML's form (``GPU-…``)."""
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{node}/gpu/{index}')}"


def mig_uuid(node: str, index: int, slot: int) -> str:
    """The UUID of MIG device ``slot`` on GPU ``index`` of ``node`` (``MIG-…``)."""
    return f"MIG-{uuid.uuid5(_UUID_NAMESPACE, f'{node}/gpu/{index}/mig/{slot}')}"


@dataclass(frozen=True)
class Resource:
    """One extended resource of a node: its device ids and the device each id makes visible."""

    name: str
    visible: Mapping[str, str]
    """Device id (as advertised) -> the UUID ``NVIDIA_VISIBLE_DEVICES`` names for it."""
    replicated: bool

    @property
    def ids(self) -> list[str]:
        """The advertised ids, in the order the GPUs are numbered."""
        return list(self.visible)


def resources(spec: gpu_nodes.GPUNodeSpec) -> list[Resource]:
    """The resources the NVIDIA device plugin would advertise for ``spec``."""
    node = spec.name
    if spec.mig_enabled:
        by_profile: dict[str, dict[str, str]] = {}
        for index in range(spec.gpus):
            for slot, profile in enumerate(spec.mig_layout):
                device = mig_uuid(node, index, slot)
                by_profile.setdefault(gpu_nodes.MIG_RESOURCE_PREFIX + profile, {})[device] = device
        return [Resource(name, visible, False) for name, visible in sorted(by_profile.items())]
    gpus = [gpu_uuid(node, index) for index in range(spec.gpus)]
    if spec.sharing is gpu_nodes.Sharing.NONE:
        return [Resource(gpu_nodes.GPU_RESOURCE, {gpu: gpu for gpu in gpus}, False)]
    name = gpu_nodes.SHARED_GPU_RESOURCE if spec.renamed else gpu_nodes.GPU_RESOURCE
    return [Resource(name, {f"{gpu}::{n}": gpu for gpu in gpus for n in range(spec.replicas)}, True)]


def preferred(resource: Resource, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
    """The ids to give a container: ``must_include`` first; then, for replicas, one at a time from
    the GPU with the fewest replicas already taken (ties: the lower GPU), as ``distributedAlloc``
    does; whole devices in order."""
    chosen = [device for device in must_include if device in resource.visible][:size]
    candidates = [device for device in resource.ids if device in set(available) and device not in chosen]
    if not resource.replicated:
        return chosen + candidates[: size - len(chosen)]
    free = set(available)
    taken = Counter(resource.visible[device] for device in resource.ids if device not in free)
    taken.update(resource.visible[device] for device in chosen)
    order = {gpu: position for position, gpu in enumerate(dict.fromkeys(resource.visible.values()))}
    while len(chosen) < size and candidates:
        best = min(candidates, key=lambda device: (taken[resource.visible[device]], order[resource.visible[device]]))
        chosen.append(best)
        candidates.remove(best)
        taken[resource.visible[best]] += 1
    return chosen


def visible_devices(resource: Resource, ids: Sequence[str]) -> str:
    """``NVIDIA_VISIBLE_DEVICES`` for ``ids``: each device once, in the order asked."""
    return ",".join(dict.fromkeys(resource.visible[device] for device in ids))


# --------------------------------------------------------------------------- the recording


def nvml_recording(
    spec: gpu_nodes.GPUNodeSpec,
    processes: Mapping[int, Sequence[tuple[int, int]]] | None = None,
    reserved_mib: int = 580,
) -> dict[str, Any]:
    """What NVML would read on ``spec``'s GPUs, in the agent's recording format (whole GPUs only):
    ``processes`` maps a GPU index to ``(pid, used bytes)`` pairs."""
    if spec.mig_enabled:
        raise ValueError("recordings of MIG nodes are not generated here")
    total = spec.model.memory_mib * 2**20
    gpus = []
    for index in range(spec.gpus):
        running = list((processes or {}).get(index, ()))
        gpus.append({
            "index": index,
            "uuid": gpu_uuid(spec.name, index),
            "name": spec.model.nvml_name,
            # NVML's v2 query: "used" leaves the driver's reserve out.
            "memory": {"total": total, "used": sum(used for _, used in running), "reserved": reserved_mib * 2**20},
            "mig_enabled": False,
            "mig_instances": [],
            "lost": False,
            "processes": [{"pid": pid, "used_bytes": used} for pid, used in running],
        })
    return {"driver_version": gpu_nodes.DRIVER_VERSION, "complete": True, "problems": [], "gpus": gpus}


# --------------------------------------------------------------------------- spec files


def spec_to_json(spec: gpu_nodes.GPUNodeSpec) -> dict[str, Any]:
    """The parts of a node description the plugin needs, as JSON."""
    return {"name": spec.name, "model": spec.model.key, "gpus": spec.gpus, "sharing": spec.sharing.value,
            "replicas": spec.replicas, "renamed": spec.renamed, "mig_layout": list(spec.mig_layout)}


def spec_from_json(data: Mapping[str, Any]) -> gpu_nodes.GPUNodeSpec:
    """The inverse of :func:`spec_to_json`."""
    return gpu_nodes.GPUNodeSpec(
        name=str(data["name"]), model=gpu_nodes.gpu_model(str(data["model"])), gpus=int(data["gpus"]),
        sharing=gpu_nodes.Sharing(data["sharing"]), replicas=int(data["replicas"]), renamed=bool(data["renamed"]),
        mig_layout=tuple(data["mig_layout"]),
    )


# --------------------------------------------------------------------------- gRPC


def _servicer(resource: Resource, stopping: threading.Event) -> Any:
    from e2e import deviceplugin_pb2 as api  # noqa: PLC0415 (generated stubs: only the plugin process needs them)
    from e2e import deviceplugin_pb2_grpc as rpc  # noqa: PLC0415

    class Servicer(rpc.DevicePluginServicer):  # type: ignore[misc]
        def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
            return api.DevicePluginOptions(get_preferred_allocation_available=True)

        def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:
            yield api.ListAndWatchResponse(devices=[api.Device(ID=device, health="Healthy") for device in resource.ids])
            while not stopping.is_set() and context.is_active():
                stopping.wait(1.0)

        def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
            answers = [
                api.ContainerPreferredAllocationResponse(deviceIDs=preferred(
                    resource, list(item.available_deviceIDs), list(item.must_include_deviceIDs), item.allocation_size))
                for item in request.container_requests
            ]
            return api.PreferredAllocationResponse(container_responses=answers)

        def Allocate(self, request: Any, context: Any) -> Any:
            answers = []
            for item in request.container_requests:
                unknown = [device for device in item.devices_ids if device not in resource.visible]
                if unknown:
                    context.abort(_grpc().StatusCode.INVALID_ARGUMENT, f"unknown device: {', '.join(unknown)}")
                answers.append(api.ContainerAllocateResponse(
                    envs={VISIBLE_DEVICES: visible_devices(resource, list(item.devices_ids))}))
            return api.AllocateResponse(container_responses=answers)

        def PreStartContainer(self, request: Any, context: Any) -> Any:
            return api.PreStartContainerResponse()

    return Servicer()


def _grpc() -> Any:
    import grpc  # noqa: PLC0415

    return grpc


def socket_name(resource: Resource) -> str:
    """The plugin's socket file for ``resource`` (one per resource, as the NVIDIA plugin has)."""
    return "vramguard-e2e-" + resource.name.replace("/", "-") + ".sock"


class Plugin:
    """Every resource of one node, served and registered; :meth:`run` re-registers after a kubelet restart."""

    def __init__(self, spec: gpu_nodes.GPUNodeSpec, plugin_dir: Path = PLUGIN_DIR) -> None:
        self.resources = resources(spec)
        self.plugin_dir = plugin_dir
        self._servers: list[Any] = []
        self._stopping = threading.Event()

    def _serve_and_register(self) -> None:
        grpc = _grpc()
        from e2e import deviceplugin_pb2 as api  # noqa: PLC0415
        from e2e import deviceplugin_pb2_grpc as rpc  # noqa: PLC0415

        for resource in self.resources:
            path = self.plugin_dir / socket_name(resource)
            path.unlink(missing_ok=True)
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            rpc.add_DevicePluginServicer_to_server(_servicer(resource, self._stopping), server)
            server.add_insecure_port(f"unix://{path}")
            server.start()
            self._servers.append(server)
            with grpc.insecure_channel(f"unix://{self.plugin_dir / KUBELET_SOCKET}") as channel:
                rpc.RegistrationStub(channel).Register(
                    api.RegisterRequest(
                        version=API_VERSION, endpoint=path.name, resource_name=resource.name,
                        options=api.DevicePluginOptions(get_preferred_allocation_available=True)),
                    timeout=10)
            _log(f"registered {resource.name} ({len(resource.ids)} devices) at {path}")

    def _stop_servers(self) -> None:
        for server in self._servers:
            server.stop(grace=None)
        self._servers.clear()

    def _registered(self) -> bool:
        return all((self.plugin_dir / socket_name(resource)).exists() for resource in self.resources)

    def stop(self) -> None:
        """Make :meth:`run` return."""
        self._stopping.set()

    def run(self) -> None:
        """Serve until :meth:`stop`: register once the kubelet's socket is there, again whenever the
        kubelet has removed the plugin's sockets (it does on restart)."""
        kubelet = self.plugin_dir / KUBELET_SOCKET
        seen: tuple[int, int] | None = None
        while not self._stopping.is_set():
            try:
                info = kubelet.stat()
                current: tuple[int, int] | None = (info.st_ino, info.st_mtime_ns)
            except FileNotFoundError:
                current = None
            if current is not None and (current != seen or not self._registered()):
                self._stop_servers()
                try:
                    self._serve_and_register()
                    seen = current
                except Exception as error:
                    _log(f"registration failed, retrying: {error}")
                    self._stop_servers()
            self._stopping.wait(0.5)
        self._stop_servers()


def _log(message: str) -> None:
    print(f"e2e.device_plugin: {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the node described by ``--node`` until terminated."""
    parser = argparse.ArgumentParser(prog="python -m e2e.device_plugin", description=__doc__.splitlines()[0])
    parser.add_argument("--node", type=Path, required=True, help="the node description (spec_to_json)")
    parser.add_argument("--plugin-dir", type=Path, default=PLUGIN_DIR)
    args = parser.parse_args(argv)
    spec = spec_from_json(json.loads(args.node.read_text(encoding="utf-8")))
    args.plugin_dir.mkdir(parents=True, exist_ok=True)
    plugin = Plugin(spec, args.plugin_dir)
    signal.signal(signal.SIGTERM, lambda *_: plugin.stop())
    plugin.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
