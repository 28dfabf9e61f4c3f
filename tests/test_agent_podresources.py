"""The kubelet PodResources client against a local gRPC server speaking the real v1 proto."""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path

import grpc
import pytest

from agent.podresources import ContainerDevices, GrpcPodResources, PodDevices, PodResourcesUnavailable
from agent.processes import ProcessOwner, container_id_of_status, parse_cgroup
from tests.agent_support import H100_UUIDS, kubelet_server, list_response

UID = "6f1c1a52-3b0e-4d7f-9c55-0a8b6c2d4e10"
CID = "4b5c" * 16


def test_list_reads_pods_containers_and_device_ids(tmp_path: Path) -> None:
    path = tmp_path / "kubelet.sock"
    with kubelet_server(path) as kubelet:
        kubelet.response = list_response({
            ("ml", "vllm-a"): {"server": {"nvidia.com/gpu": [f"{H100_UUIDS[0]}::0"]}, "sidecar": {}},
            ("ml", "trainer"): {"main": {"nvidia.com/gpu": [f"{H100_UUIDS[0]}::3", f"{H100_UUIDS[1]}::1"],
                                         "example.com/nic": ["eth1"]}},
        })
        pods = GrpcPodResources(path, timeout=5).list()
    assert pods == [
        PodDevices("ml", "vllm-a", (
            ContainerDevices("server", (("nvidia.com/gpu", (f"{H100_UUIDS[0]}::0",)),)),
            ContainerDevices("sidecar", ()),
        )),
        PodDevices("ml", "trainer", (
            ContainerDevices("main", (
                ("nvidia.com/gpu", (f"{H100_UUIDS[0]}::3", f"{H100_UUIDS[1]}::1")),
                ("example.com/nic", ("eth1",)),
            )),
        )),
    ]


def test_an_empty_node_lists_no_pods(tmp_path: Path) -> None:
    path = tmp_path / "kubelet.sock"
    with kubelet_server(path) as kubelet:
        assert GrpcPodResources(path).list() == []
        assert kubelet.calls == 1


def test_a_missing_socket_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(PodResourcesUnavailable, match="no kubelet PodResources socket"):
        GrpcPodResources(tmp_path / "absent.sock").list()


def test_a_file_that_is_not_a_socket_is_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "kubelet.sock"
    path.write_text("")
    with pytest.raises(PodResourcesUnavailable, match="not a socket"):
        GrpcPodResources(path).list()


def test_a_socket_nobody_serves_is_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "kubelet.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))  # bound, never listening: what a crashed kubelet leaves behind
    try:
        with pytest.raises(PodResourcesUnavailable, match="UNAVAILABLE"):
            GrpcPodResources(path, timeout=2).list()
    finally:
        stale.close()


def test_a_failing_kubelet_is_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "kubelet.sock"
    with kubelet_server(path) as kubelet:
        kubelet.fail = grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(PodResourcesUnavailable, match="UNIMPLEMENTED"):
            GrpcPodResources(path).list()


@pytest.mark.parametrize(
    ("text", "owner"),
    [
        pytest.param(
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
            f"cri-containerd-{CID}.scope\n",
            ProcessOwner(UID, CID), id="cgroup-v2-systemd-containerd",
        ),
        pytest.param(
            f"12:memory:/kubepods/besteffort/pod{UID}/{CID}\n11:devices:/kubepods/besteffort/pod{UID}/{CID}\n",
            ProcessOwner(UID, CID), id="cgroup-v1-cgroupfs",
        ),
        pytest.param(
            f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope\n",
            ProcessOwner(UID, CID), id="guaranteed-crio",
        ),
        pytest.param(f"0::/kubepods/pod{UID}\n", ProcessOwner(UID, None), id="pod-level-only"),
        pytest.param("0::/system.slice/ollama.service\n", None, id="host-service"),
        pytest.param("0::/user.slice/user-1000.slice/session-3.scope\n", None, id="login-session"),
        pytest.param("", None, id="empty"),
    ],
)
def test_parse_cgroup(text: str, owner: ProcessOwner | None) -> None:
    assert parse_cgroup(text) == owner


def test_container_id_of_status() -> None:
    assert container_id_of_status(f"containerd://{CID}") == CID
    assert container_id_of_status(CID) == CID


# -- the vendored proto and the generated stubs ----------------------------------------------------

PROTO_DIR = Path(__file__).resolve().parent.parent / "agent" / "proto"
UPSTREAM_SHA256 = "f65bc77eb41334effc87fdd8c234bdcdbf01a64122010dca50a6fecfaed9390c"


def test_the_proto_below_its_header_is_the_upstream_file() -> None:
    text = (PROTO_DIR / "podresources.proto").read_bytes()
    upstream = text[text.index(b"// To regenerate api.pb.go"):]
    assert hashlib.sha256(upstream).hexdigest() == UPSTREAM_SHA256


def test_the_generated_stubs_match_the_proto(tmp_path: Path) -> None:
    protoc = pytest.importorskip("grpc_tools.protoc")
    root = PROTO_DIR.parent.parent
    argv = ["protoc", f"-Iagent={PROTO_DIR}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
            "agent/podresources.proto"]
    assert protoc.main(argv) == 0
    for name in ("podresources_pb2.py", "podresources_pb2_grpc.py"):
        assert (tmp_path / "agent" / name).read_text() == (root / "agent" / name).read_text(), name
