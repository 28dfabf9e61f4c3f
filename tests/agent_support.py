"""Helpers for the agent's tests: recorded NVML snapshots, and a kubelet PodResources server."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from agent import podresources_pb2 as pb
from agent import podresources_pb2_grpc as pb_grpc
from agent.nvml import Snapshot, take_snapshot
from agent.recorded import RecordedNvml

DATA = Path(__file__).resolve().parent / "data" / "agent"
H100_TIME_SLICED = DATA / "nvml_h100_time_sliced.json"
H200_MIG_LOST = DATA / "nvml_h200_mig_lost.json"

H100_BYTES = 85520809984  # NVIDIA H100 80GB HBM3: 81559 MiB
H100_USABLE = H100_BYTES - 580 * 2**20
"""What the recording's H100s let processes allocate: NVML's total less the driver's 580 MiB (v2
``reserved``), the total CUDA reports and engines take their fractions of."""
H200_BYTES = 143771 * 2**20
MiB = 2**20

# The UUIDs in the recordings, by GPU index.
H100_UUIDS = ("GPU-5f3c2a1e-8b7d-4c6e-9a2b-1d0e3f4a5b6c", "GPU-9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d")

Containers = Mapping[str, Mapping[str, Sequence[str]]]
"""container name -> resource name -> device ids."""


def recording(path: Path) -> dict[str, Any]:
    """A recording as data, to alter in a test."""
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def snapshot_of(path_or_data: Path | Mapping[str, Any]) -> Snapshot:
    """Take a snapshot from a recording."""
    nvml = RecordedNvml(path_or_data if isinstance(path_or_data, Path) else dict(path_or_data))
    nvml.init()
    return take_snapshot(nvml)


def list_response(pods: Mapping[tuple[str, str], Containers]) -> pb.ListPodResourcesResponse:
    """A ``v1.ListPodResourcesResponse`` for ``{(namespace, name): {container: {resource: ids}}}``."""
    response = pb.ListPodResourcesResponse()
    for (namespace, name), containers in pods.items():
        pod = response.pod_resources.add(namespace=namespace, name=name)
        for container_name, resources in containers.items():
            container = pod.containers.add(name=container_name, cpu_ids=[2, 3])
            for resource, ids in resources.items():
                container.devices.add(resource_name=resource, device_ids=list(ids))
    return response


class _Lister(pb_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.response = pb.ListPodResourcesResponse()
        self.fail: grpc.StatusCode | None = None
        self.calls = 0

    def List(self, request: Any, context: Any) -> Any:
        self.calls += 1
        if self.fail is not None:
            context.abort(self.fail, "injected failure")
        return self.response


@contextmanager
def kubelet_server(socket: Path) -> Iterator[_Lister]:
    """A gRPC server on ``socket`` speaking the kubelet's PodResources v1 proto; set ``.response``."""
    lister = _Lister()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PodResourcesListerServicer_to_server(lister, server)
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    try:
        yield lister
    finally:
        server.stop(grace=None)


def pod_object(
    namespace: str,
    name: str,
    uid: str,
    containers: Mapping[str, Mapping[str, Any]],
    *,
    annotations: Mapping[str, str] | None = None,
    container_ids: Mapping[str, str] | None = None,
    image: str = "vllm/vllm-openai:v0.11.0",
) -> dict[str, Any]:
    """A Pod as the API server returns it: ``containers`` maps a name to its ``resources.limits``."""
    return {
        "metadata": {"namespace": namespace, "name": name, "uid": uid, "annotations": dict(annotations or {})},
        "spec": {
            "nodeName": "gpu-1",
            "containers": [
                {"name": c, "image": image, "resources": {"limits": dict(limits)}}
                for c, limits in containers.items()
            ],
        },
        "status": {
            "containerStatuses": [
                {"name": c, "containerID": f"containerd://{cid}"} for c, cid in (container_ids or {}).items()
            ]
        },
    }
