"""Which devices each container holds, from the kubelet's PodResources API (gRPC v1 ``List``).

The kubelet serves ``v1.PodResourcesLister`` on a unix socket, by default
``/var/lib/kubelet/pod-resources/kubelet.sock``. Its ``List`` answers, per pod (namespace and
name, not UID) and per container, the device IDs the device plugins allocated: for the NVIDIA
plugin a GPU UUID, a MIG UUID, or either with a ``::<n>`` replica suffix under time-slicing or MPS
(with ``--device-id-strategy=index``: ``0``, ``0::1``, or ``<gpu>:<mig>`` for a MIG device).

The stubs in ``agent/podresources_pb2*.py`` are generated from the upstream proto
(``agent/proto/``); this module keeps them and ``grpc`` behind :class:`PodResourcesSource`.
"""

from __future__ import annotations

import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "DEFAULT_SOCKET",
    "ContainerDevices",
    "GrpcPodResources",
    "PodDevices",
    "PodResourcesSource",
    "PodResourcesUnavailable",
]

DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
# The kubelet's own server limit (podresources.DefaultMaxMsgSize); gRPC's 4 MiB default is too
# small for a node with hundreds of pods and CPU and memory assignments.
MAX_MESSAGE_BYTES = 16 << 20
LIST_METHOD = "/v1.PodResourcesLister/List"


class PodResourcesUnavailable(Exception):
    """The kubelet could not be asked: no socket, connection refused, timeout, unimplemented."""


@dataclass(frozen=True, slots=True)
class ContainerDevices:
    """The devices of one container, per extended resource, in the kubelet's order."""

    name: str
    devices: tuple[tuple[str, tuple[str, ...]], ...]
    """``(resource name, device ids)`` pairs."""


@dataclass(frozen=True, slots=True)
class PodDevices:
    """One pod the kubelet runs, with its containers' devices."""

    namespace: str
    name: str
    containers: tuple[ContainerDevices, ...]


class PodResourcesSource(Protocol):
    """Where the agent learns which container holds which device."""

    def list(self) -> Sequence[PodDevices]:
        """Every pod of the node; raise :class:`PodResourcesUnavailable` when it cannot be known."""


class GrpcPodResources:
    """:class:`PodResourcesSource` over the kubelet's unix socket (a blocking call; run it in a thread)."""

    def __init__(self, socket: Path = DEFAULT_SOCKET, timeout: float = 5.0) -> None:
        """Ask the kubelet at ``socket``, waiting at most ``timeout`` seconds per call."""
        self.socket = socket
        self.timeout = timeout

    def list(self) -> list[PodDevices]:
        """Call ``List`` on a fresh channel.

        A channel per call: the kubelet recreates the socket when it restarts, and a long-lived
        channel would keep backing off against the old one.
        """
        try:
            if not stat.S_ISSOCK(self.socket.stat().st_mode):
                raise PodResourcesUnavailable(f"{self.socket} is not a socket")
        except OSError as exc:
            raise PodResourcesUnavailable(f"no kubelet PodResources socket at {self.socket}: {exc.strerror}") from None
        import grpc  # noqa: PLC0415 - loaded on first use, so the CLI starts without it

        from agent import podresources_pb2 as pb  # noqa: PLC0415

        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        try:
            with grpc.insecure_channel(f"unix://{self.socket}", options=options) as channel:
                call = channel.unary_unary(
                    LIST_METHOD,
                    request_serializer=pb.ListPodResourcesRequest.SerializeToString,
                    response_deserializer=pb.ListPodResourcesResponse.FromString,
                )
                response = call(pb.ListPodResourcesRequest(), timeout=self.timeout)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            raise PodResourcesUnavailable(f"PodResources List failed: {code}: {details}") from None
        return pods_from_response(response)


def pods_from_response(response: Any) -> list[PodDevices]:
    """Plain dataclasses from a ``v1.ListPodResourcesResponse``; containers without devices are kept."""
    pods = []
    for pod in response.pod_resources:
        containers = tuple(
            ContainerDevices(
                str(container.name),
                tuple((str(d.resource_name), tuple(str(i) for i in d.device_ids)) for d in container.devices),
            )
            for container in pod.containers
        )
        pods.append(PodDevices(str(pod.namespace), str(pod.name), containers))
    return pods
