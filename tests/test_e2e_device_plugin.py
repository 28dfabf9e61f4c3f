"""The harness's device plugin (``e2e.device_plugin``) and its images: what it advertises matches
the fake nodes' shapes, it spreads replicas as the NVIDIA plugin does, answers ``Allocate`` with the
GPUs' UUIDs, registers with a kubelet over the real gRPC API and registers again after a restart."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest

from agent.recorded import RecordedNvml
from e2e import device_plugin, gpu_nodes, images, real_nodes

PROTO_DIR = Path(__file__).resolve().parent.parent / "e2e" / "proto"
UPSTREAM_SHA256 = "b780bfeac99c93c231dc165ce417f4da88481eececa0c65eeb90f5f2e9b5b65b"
"""``pkg/apis/deviceplugin/v1beta1/api.proto`` of k8s.io/kubelet v0.36.3."""

SPECS = [
    gpu_nodes.exclusive("whole", "H100-80GB", gpus=2),
    gpu_nodes.time_sliced("sliced", "H100-80GB", gpus=2, replicas=4),
    gpu_nodes.time_sliced("renamed", "A100-80GB", gpus=1, replicas=3, renamed=True),
    gpu_nodes.mps("mps", "L4", gpus=1, replicas=2),
    gpu_nodes.mig_mixed("mig", "H100-80GB", ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"], gpus=2),
]


def test_the_proto_below_its_header_is_the_upstream_file() -> None:
    text = (PROTO_DIR / "deviceplugin.proto").read_bytes()
    upstream = text[text.index(b"// To regenerate api.pb.go"):]
    assert hashlib.sha256(upstream).hexdigest() == UPSTREAM_SHA256


def test_the_generated_stubs_match_the_proto(tmp_path: Path) -> None:
    protoc = pytest.importorskip("grpc_tools.protoc")
    import grpc_tools  # noqa: PLC0415

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-Ie2e={PROTO_DIR}", f"-I{include}", f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}", "e2e/deviceplugin.proto"]
    assert protoc.main(args) == 0
    for name in ("deviceplugin_pb2.py", "deviceplugin_pb2_grpc.py"):
        committed = (PROTO_DIR.parent / name).read_text()
        assert (tmp_path / "e2e" / name).read_text() == committed, f"regenerate {name}: e2e/proto/generate.sh"


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
def test_it_advertises_what_the_fake_nodes_show(spec: gpu_nodes.GPUNodeSpec) -> None:
    advertised = {resource.name: str(len(resource.ids)) for resource in device_plugin.resources(spec)}
    assert advertised == gpu_nodes.gpu_resources(spec)


def test_replica_ids_and_visible_devices() -> None:
    spec = gpu_nodes.time_sliced("n", "H100-80GB", gpus=2, replicas=2)
    (resource,) = device_plugin.resources(spec)
    gpu0, gpu1 = device_plugin.gpu_uuid("n", 0), device_plugin.gpu_uuid("n", 1)
    assert resource.ids == [f"{gpu0}::0", f"{gpu0}::1", f"{gpu1}::0", f"{gpu1}::1"]
    assert resource.replicated
    # The replica suffix dropped, each GPU once (deviceIDsFromAnnotatedDeviceIDs).
    assert device_plugin.visible_devices(resource, [f"{gpu1}::1", f"{gpu1}::0", f"{gpu0}::0"]) == f"{gpu1},{gpu0}"
    assert gpu0.startswith("GPU-") and gpu0 != gpu1 and gpu0 == device_plugin.gpu_uuid("n", 0)
    assert device_plugin.gpu_uuid("other", 0) != gpu0


def test_replicas_are_spread_over_the_gpus_least_used_first() -> None:
    spec = gpu_nodes.time_sliced("n", "H100-80GB", gpus=2, replicas=4)
    (resource,) = device_plugin.resources(spec)
    taken: list[str] = []
    order = []
    for _ in range(8):
        available = [device for device in resource.ids if device not in taken]
        (chosen,) = device_plugin.preferred(resource, available, [], 1)
        taken.append(chosen)
        order.append(resource.visible[chosen])
    gpu0, gpu1 = device_plugin.gpu_uuid("n", 0), device_plugin.gpu_uuid("n", 1)
    assert order == [gpu0, gpu1] * 4
    # Two at once land on two GPUs; what the kubelet must include comes first.
    two = device_plugin.preferred(resource, resource.ids, [], 2)
    assert {resource.visible[d] for d in two} == {gpu0, gpu1}
    assert device_plugin.preferred(resource, resource.ids, [f"{gpu1}::3"], 1) == [f"{gpu1}::3"]


def test_whole_gpus_are_given_in_order() -> None:
    (resource,) = device_plugin.resources(gpu_nodes.exclusive("n", "L4", gpus=3))
    assert device_plugin.preferred(resource, resource.ids[1:], [], 2) == resource.ids[1:3]


def test_the_recording_names_the_same_gpus_and_replays() -> None:
    spec = gpu_nodes.time_sliced("n", "H100-80GB", gpus=2, replicas=4)
    data = device_plugin.nvml_recording(spec, {1: [(4242, 3 * 2**30)]})
    assert [gpu["uuid"] for gpu in data["gpus"]] == [device_plugin.gpu_uuid("n", i) for i in range(2)]
    nvml = RecordedNvml(data)
    nvml.init()
    assert nvml.device_count() == 2
    assert data["gpus"][1]["processes"] == [{"pid": 4242, "used_bytes": 3 * 2**30}]
    with pytest.raises(ValueError, match="MIG"):
        device_plugin.nvml_recording(SPECS[-1])


def test_spec_json_round_trips() -> None:
    for spec in SPECS:
        back = device_plugin.spec_from_json(json.loads(json.dumps(device_plugin.spec_to_json(spec))))
        assert device_plugin.resources(back) == device_plugin.resources(spec)


# -- over the kubelet's gRPC API --------------------------------------------------------------------


class FakeKubelet:
    """The kubelet's Registration service on ``kubelet.sock``; it records what registers."""

    def __init__(self, directory: Path) -> None:
        import grpc  # noqa: PLC0415

        from e2e import deviceplugin_pb2 as api  # noqa: PLC0415
        from e2e import deviceplugin_pb2_grpc as rpc  # noqa: PLC0415

        self.requests: list[Any] = []
        outer = self

        class Registration(rpc.RegistrationServicer):  # type: ignore[misc]
            def Register(self, request: Any, context: Any) -> Any:
                outer.requests.append(request)
                return api.Empty()

        self.path = directory / device_plugin.KUBELET_SOCKET
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        rpc.add_RegistrationServicer_to_server(Registration(), self.server)
        self.server.add_insecure_port(f"unix://{self.path}")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=None)


@pytest.fixture
def short_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A directory with a short path (unix sockets are limited to 108 bytes)."""
    import tempfile  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="dp-") as name:
        yield Path(name)


def wait_for(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_it_registers_serves_allocate_and_registers_again_after_a_kubelet_restart(short_dir: Path) -> None:
    pytest.importorskip("grpc")
    import grpc  # noqa: PLC0415

    from e2e import deviceplugin_pb2 as api  # noqa: PLC0415
    from e2e import deviceplugin_pb2_grpc as rpc  # noqa: PLC0415

    spec = gpu_nodes.time_sliced("n", "H100-80GB", gpus=2, replicas=2)
    kubelet = FakeKubelet(short_dir)
    plugin = device_plugin.Plugin(spec, short_dir)
    thread = threading.Thread(target=plugin.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: len(kubelet.requests) == 1)
        request = kubelet.requests[0]
        assert (request.version, request.resource_name) == ("v1beta1", "nvidia.com/gpu")
        assert request.options.get_preferred_allocation_available
        socket = short_dir / request.endpoint
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            stub = rpc.DevicePluginStub(channel)
            devices = next(iter(stub.ListAndWatch(api.Empty(), timeout=5))).devices
            assert [d.ID for d in devices] == device_plugin.resources(spec)[0].ids
            gpu1 = device_plugin.gpu_uuid("n", 1)
            answer = stub.Allocate(api.AllocateRequest(container_requests=[
                api.ContainerAllocateRequest(devices_ids=[f"{gpu1}::1"])]), timeout=5)
            assert dict(answer.container_responses[0].envs) == {"NVIDIA_VISIBLE_DEVICES": gpu1}
            with pytest.raises(grpc.RpcError) as error:
                stub.Allocate(api.AllocateRequest(container_requests=[
                    api.ContainerAllocateRequest(devices_ids=["GPU-forged::0"])]), timeout=5)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        # A restarted kubelet deletes the sockets in the directory and serves a new one.
        kubelet.stop()
        for path in short_dir.iterdir():
            path.unlink()
        kubelet = FakeKubelet(short_dir)
        wait_for(lambda: len(kubelet.requests) == 1)
        assert (short_dir / kubelet.requests[0].endpoint).exists()
    finally:
        plugin.stop()
        thread.join(10)
        kubelet.stop()


# -- images -----------------------------------------------------------------------------------------


def test_an_oci_archive_names_its_image_and_its_layer_digests_hold() -> None:
    files = {"bin/tool": images.FileEntry(b"#!/bin/sh\n", 0o755), "bin/alias": images.FileEntry(link="tool")}
    archive = images.oci_archive("docker.io/example/tool:v1", files, ["tool"])
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    index = json.loads(members["index.json"])
    (entry,) = index["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == "docker.io/example/tool:v1"
    assert entry["platform"] == {"architecture": "amd64", "os": "linux"}
    for name, data in members.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1]
    manifest = json.loads(members["blobs/sha256/" + entry["digest"].split(":")[1]])
    config = json.loads(members["blobs/sha256/" + manifest["config"]["digest"].split(":")[1]])
    assert config["config"]["Entrypoint"] == ["tool"]
    assert images.oci_archive("docker.io/example/tool:v1", files, ["tool"]) == archive  # reproducible


def test_the_registration_labels_leave_the_kubelets_own_to_it() -> None:
    labels = real_nodes.registration_labels(gpu_nodes.time_sliced("n", "H100-80GB", gpus=1, replicas=4))
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3-SHARED"
    assert not [key for key in labels if "kubernetes.io" in key]
