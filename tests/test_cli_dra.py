"""The CLI on DRA objects: explain (claim memory next to the engine), plan (allocation), audit."""

from __future__ import annotations

import copy
import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.dra_objects import (
    allocated,
    claim,
    claim_template,
    device_class,
    extended_resource_claim,
    gpu_device,
    resource_slice,
    result,
    vllm_claim_pod,
    vllm_extended_resource_pod,
)
from vramguard.cli import main
from vramguard.cli.audit import audit_snapshot
from vramguard.cli.kubectl_vram import ClusterSnapshot
from vramguard.codecs import ENFORCE_LABEL
from vramguard.dra import ClaimRequest, DeviceRequest, read_device_class, read_resource_slices
from vramguard.dra.allocate import DraBook
from vramguard.dra.fields import memory_text
from vramguard.policy import default_policy
from vramguard.quantity import GiB, MiB

NS = "gpu-share-memory"
H100 = 81559 * MiB
VLLM_ALLOWANCES = 512 * MiB + GiB
"""What the pods' vLLM (v0.10.1) holds on its GPU beside its share: its CUDA context, and its CUDA
graphs (outside the share before v0.20.0)."""
PLUS = f" + {memory_text(VLLM_ALLOWANCES)}"


def reserved(utilization: str, device: int) -> int:
    """What the pods' vLLM reserves at ``utilization`` on a device of ``device`` bytes."""
    return int(Fraction(utilization) * device) + VLLM_ALLOWANCES


CLAIM_03 = memory_text(reserved("0.30", H100))
"""The memory admission requires of a claim of a 0.30 vLLM on an H100 (rounded up to a MiB)."""
CLAIM_03_BYTES = int(CLAIM_03.removesuffix("Mi")) * MiB


def write(tmp_path: Path, *objects: dict[str, Any]) -> str:
    path = tmp_path / "input.yaml"
    path.write_text(yaml.safe_dump_all(objects))
    return str(path)


def namespace(mode: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS, "labels": {ENFORCE_LABEL: mode}}}


H100_SLICE = resource_slice(devices=[gpu_device(mode="memory")])


def deployment(replicas: int, utilization: str, template_name: str) -> dict[str, Any]:
    pod = vllm_claim_pod(utilization=utilization, template=template_name)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "vllm", "namespace": NS},
        "spec": {"replicas": replicas, "template": {"metadata": {}, "spec": pod["spec"]}},
    }


# ----------------------------------------------------------------------------------------- explain


def test_explain_shows_claim_memory_next_to_the_reservation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(
        tmp_path, namespace("enforce"), H100_SLICE, claim_template(namespace=NS, memory="8Gi"), vllm_claim_pod()
    )
    assert main(["explain", "-o", "json", path]) == 1  # refused in an enforce namespace
    (report,) = json.loads(capsys.readouterr().out)
    (entry,) = report["claims"]
    assert entry["memory_request_bytes"] == 8 * GiB
    assert entry["consumed_bytes"] == 8 * GiB
    need = reserved("0.9", H100)
    assert entry["reserved_bytes"] == need
    assert entry["device"] == "gpu-0 (NVIDIA H100 80GB HBM3)"
    assert report["refusals"] == [
        {
            "rule": "claim-memory",
            "message": f"claim gpu requests 8Gi of memory but vLLM will reserve 0.90 x 81559Mi{PLUS} = "
            f"{memory_text(need)}; set capacity.requests.memory: {memory_text(need)}",
            "enforced": True,
        }
    ]
    assert main(["explain", path]) == 1
    text = capsys.readouterr().out
    assert (
        "claim gpu: requests 8Gi, consumes 8Gi of 81559Mi on gpu-0 (NVIDIA H100 80GB HBM3); "
        f"vllm reserves {memory_text(need)}" in text
    )


def test_explain_with_gpu_memory_stand_in(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    need = reserved("0.9", 80 * GiB)
    path = write(tmp_path, claim_template(namespace=NS, memory=memory_text(need)), vllm_claim_pod())
    assert main(["explain", "-o", "json", "--gpu-memory", "80Gi", path]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["refusals"] == [] and report["claims"][0]["reserved_bytes"] == need
    # Without devices nothing can be sized: a warning, not a refusal.
    assert main(["explain", "-o", "json", path]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert any("no known device matches" in w for w in report["warnings"])


# -------------------------------------------------------------------------------------------- plan

def test_explain_ties_every_claim_container_to_its_claim_known_engine_or_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer = copy.deepcopy(vllm_claim_pod())
    trainer["metadata"]["name"] = "trainer"
    trainer["spec"]["containers"][0].update(command=["python", "train.py"], args=[])
    path = write(tmp_path, H100_SLICE, claim_template(namespace=NS), vllm_claim_pod(), trainer)
    main(["explain", "-o", "json", path])
    served, trained = json.loads(capsys.readouterr().out)
    for report, engine in ((served, "vllm"), (trained, None)):
        assert report["templates"] == [{"name": "pod", "pods": 1, "gpu": True}]
        [container] = report["containers"]
        assert (container["name"], container["engine"], container["claims"]) == ("vllm", engine, ["gpu/gpu"])
        assert report["claims"][0]["containers"] == ["vllm"]
    assert trained["containers"][0]["vram_bytes_per_gpu"] is None



def test_plan_four_pods_on_one_h100_three_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Claims as admission requires them (0.30 x 81559Mi and vLLM's allowances, rounded up): three
    allocated, the fourth pending."""
    path = write(
        tmp_path, H100_SLICE, claim_template("gpu-26g", NS, memory=CLAIM_03), deployment(4, "0.30", "gpu-26g")
    )
    assert main(["plan", "-o", "json", path]) == 1
    plan = json.loads(capsys.readouterr().out)
    assert [p["pod"] for p in plan["placed"]] == [f"{NS}/vllm-{i}" for i in range(3)]
    assert all(p["claims"] == {"gpu/gpu": ["gpu-0"]} and p["findings"] == [] for p in plan["placed"])
    (pending,) = plan["pending"]
    assert pending["pod"] == f"{NS}/vllm-3"
    assert f"not free (most free: {memory_text(H100 - 3 * CLAIM_03_BYTES)})" in pending["reasons"]["node-a"]["message"]
    (gpu,) = plan["gpus"]
    assert gpu["reserved"] == 3 * CLAIM_03_BYTES and gpu["dra"] is True


def test_plan_under_requested_claims_overcommit_and_say_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, H100_SLICE, claim_template("gpu-8g", NS, memory="8Gi"), deployment(4, "0.30", "gpu-8g"))
    assert main(["plan", "-o", "json", path]) == 0  # the allocator counts 8Gi each: all four fit...
    plan = json.loads(capsys.readouterr().out)
    assert len(plan["placed"]) == 4
    # ...and each pod carries admission's finding (the namespace's default mode is audit).
    assert plan["placed"][0]["findings"][0]["rule"] == "claim-memory"
    enforcing = write(
        tmp_path,
        namespace("enforce"),
        H100_SLICE,
        claim_template("gpu-8g", NS, memory="8Gi"),
        deployment(4, "0.30", "gpu-8g"),
    )
    assert main(["plan", "-o", "json", enforcing]) == 1
    plan = json.loads(capsys.readouterr().out)
    assert plan["placed"] == [] and len(plan["pending"]) == 4
    assert plan["pending"][0]["reasons"]["-"]["rule"] == "admission"


def test_plan_shared_claim_is_allocated_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pods = [vllm_claim_pod(f"p{i}", "0.2", claim_name="shared") for i in range(3)]
    path = write(tmp_path, H100_SLICE, claim("shared", NS, memory="70Gi"), *pods)
    assert main(["plan", "-o", "json", path]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [p["node"] for p in plan["placed"]] == ["node-a"] * 3
    assert plan["gpus"][0]["reserved"] == 70 * GiB


def test_plan_extended_resource_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    unlimited = resource_slice(devices=[gpu_device(mode="unlimited")])
    pods = [vllm_extended_resource_pod(f"p{i}", "0.5", NS) for i in range(3)]
    path = write(tmp_path, unlimited, device_class(), *pods)
    assert main(["plan", "-o", "json", path]) == 0
    plan = json.loads(capsys.readouterr().out)
    # The scheduler's claims consume 0 in unlimited mode: all three land on one GPU, each flagged.
    assert len(plan["placed"]) == 3 and plan["gpus"][0]["reserved"] == 0
    assert plan["placed"][0]["findings"][0]["rule"] == "extended-resource-memory"


def test_plan_existing_allocation_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    taken = allocated(claim("old", NS, memory="70Gi"), [result(memory="70Gi", share="s1")], pods=("old",))
    path = write(
        tmp_path, H100_SLICE, taken, claim_template("gpu-26g", NS, memory=CLAIM_03), deployment(1, "0.30", "gpu-26g")
    )
    assert main(["plan", "-o", "json", path]) == 1
    plan = json.loads(capsys.readouterr().out)
    assert plan["placed"] == [] and plan["gpus"][0]["pods"] == ["old"]


# ----------------------------------------------------------------------------------- the allocator


def _book(*devices: dict[str, Any]) -> DraBook:
    return DraBook(read_resource_slices([resource_slice(devices=list(devices))]).devices)


CLASSES = {"gpu.nvidia.com": read_device_class(device_class())}


@pytest.mark.parametrize(
    ("devices", "requests", "placed"),
    [
        pytest.param([gpu_device(mode="disabled")], [8 * GiB, 8 * GiB], [("gpu-0",), None], id="exclusive-one-holder"),
        pytest.param(
            [gpu_device(mode="memory", memory="80Gi")],
            [40 * GiB, 40 * GiB, GiB],
            [("gpu-0",), ("gpu-0",), None],
            id="memory-fills-to-100-percent",
        ),
        pytest.param(
            [gpu_device(mode="unlimited", memory="80Gi")], [None] * 5, [("gpu-0",)] * 5, id="unlimited-never-full"
        ),
        pytest.param(
            [gpu_device(mode="memory", memory="80Gi"), gpu_device("gpu-1", uuid="u1", mode="memory", memory="80Gi")],
            [60 * GiB, 60 * GiB],
            [("gpu-0",), ("gpu-1",)],
            id="first-device-with-room",
        ),
    ],
)
def test_allocator(
    devices: list[dict[str, Any]], requests: list[int | None], placed: list[tuple[str, ...] | None]
) -> None:
    book = _book(*devices)
    got = []
    for index, memory in enumerate(requests):
        request = ClaimRequest("gpu", (DeviceRequest("gpu", "gpu.nvidia.com", memory=memory),))
        allocation, _ = book.allocate(f"p{index}", [request], CLASSES, "node-a")  # type: ignore[arg-type]
        got.append(allocation.devices["gpu"] if allocation else None)
    assert got == placed


def test_allocator_two_devices_and_first_available() -> None:
    book = _book(gpu_device(mode="memory", memory="80Gi"), gpu_device("gpu-1", uuid="u1", mode="memory", memory="80Gi"))
    two = ClaimRequest("gpu", (DeviceRequest("gpu", "gpu.nvidia.com", count=2, memory=50 * GiB),))
    allocation, _ = book.allocate("a", [two], CLASSES, "node-a")  # type: ignore[arg-type]
    assert allocation is not None and allocation.devices["gpu"] == ("gpu-0", "gpu-1")
    fallback = ClaimRequest(
        "gpu",
        (
            DeviceRequest("gpu/big", "gpu.nvidia.com", memory=40 * GiB),
            DeviceRequest("gpu/small", "gpu.nvidia.com", memory=20 * GiB),
        ),
    )
    allocation, _ = book.allocate("b", [fallback], CLASSES, "node-a")  # type: ignore[arg-type]
    assert allocation is not None and allocation.devices["gpu"] == ("gpu-0",)
    # All or nothing: a second request that does not fit leaves the first unallocated.
    before = [b.consumed for b in book.rows()]
    failing = [
        ClaimRequest("x", (DeviceRequest("x", "gpu.nvidia.com", memory=GiB),)),
        ClaimRequest("y", (DeviceRequest("y", "gpu.nvidia.com", memory=70 * GiB),)),
    ]
    allocation, why = book.allocate("c", failing, CLASSES, "node-a")  # type: ignore[arg-type]
    assert allocation is None and "request y" in why
    assert [b.consumed for b in book.rows()] == before


# ------------------------------------------------------------------------------------------- audit


def live(pod: dict[str, Any], node: str = "node-a", **status: Any) -> dict[str, Any]:
    pod = copy.deepcopy(pod)
    pod["spec"]["nodeName"] = node
    pod["status"] = {"phase": "Running", **status}
    return pod


def test_audit_lists_claims_short_of_their_workload() -> None:
    short = allocated(claim("vllm-0-gpu-x7k9m", NS, memory="8Gi"), [result(memory="8Gi", share="s1")], pods=("vllm-0",))
    need = reserved("0.9", 80 * GiB)
    enough = allocated(
        claim("vllm-1-gpu-abcde", NS, memory=memory_text(need)),
        [result(memory=memory_text(need), share="s2")],
        pods=("vllm-1",),
    )
    erc = extended_resource_claim("vllm-2", NS, memory="0", share="s3")
    pods = [
        live(
            vllm_claim_pod("vllm-0"), resourceClaimStatuses=[{"name": "gpu", "resourceClaimName": "vllm-0-gpu-x7k9m"}]
        ),
        live(
            vllm_claim_pod("vllm-1"), resourceClaimStatuses=[{"name": "gpu", "resourceClaimName": "vllm-1-gpu-abcde"}]
        ),
        live(
            vllm_extended_resource_pod("vllm-2", namespace=NS),
            extendedResourceClaimStatus={
                "resourceClaimName": "vllm-2-extended-resources-abcde",
                "requestMappings": [
                    {"containerName": "vllm", "resourceName": "nvidia.com/gpu", "requestName": "container-0-request-0"}
                ],
            },
        ),
    ]
    snapshot = ClusterSnapshot(
        namespaces=[namespace("warn")],
        pods=pods,
        dra={
            "resourceslices": [resource_slice(devices=[gpu_device(memory="80Gi", mode="memory")])],
            "deviceclasses": [device_class()],
            "resourceclaims": [short, enough, erc],
            "resourceclaimtemplates": [claim_template(namespace=NS, memory="8Gi")],
        },
    )
    report = audit_snapshot(snapshot, default_policy())
    assert [(c.claim, c.consumed, c.pods) for c in report.claims] == [
        ("vllm-0-gpu-x7k9m", 8 * GiB, ("vllm-0",)),
        ("vllm-2-extended-resources-abcde", 0, ("vllm-2",)),
    ]
    assert report.claims[0].message() == (
        f"claim {NS}/vllm-0-gpu-x7k9m consumes 8Gi of gpu-0 (NVIDIA H100 80GB HBM3) on node node-a "
        f"but vLLM will reserve 0.90 x 80Gi{PLUS} = {memory_text(need)}"
    )
    assert not report.clean
    assert "Allocated DRA claims short of their workload's memory: 2" in report.to_text()
    assert report.to_json()["claims"][0]["reserved_bytes"] == need
    # The pods themselves are reviewed as admission would: vllm-0's template asks 8Gi.
    assert any(f.name == "vllm-0" and f.outcome == "warned" for f in report.objects)


def test_plan_extended_resource_without_dra_devices_takes_the_device_plugin_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from e2e import gpu_nodes  # noqa: PLC0415

    spec = gpu_nodes.exclusive("ex", "H100-80GB", gpus=1)
    node = {**gpu_nodes.node_manifest(spec), "status": gpu_nodes.node_status(spec)}
    pod = vllm_extended_resource_pod("p", "0.5", NS)
    pod["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/mig-1g.10gb": "1"}
    mig_class = device_class(
        "mig-1g.10gb", "device.attributes['gpu.nvidia.com'].type == 'mig'", "nvidia.com/mig-1g.10gb"
    )
    assert main(["plan", "-o", "json", write(tmp_path, node, mig_class, pod)]) == 1
    (pending,) = json.loads(capsys.readouterr().out)["pending"]
    assert list(pending["reasons"]) == ["ex"]  # judged by the node's device plugin, not by absent DRA devices


def test_plan_of_a_claim_pod_without_resource_slices_says_so_not_that_there_are_no_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}, "status": {"allocatable": {"cpu": "8"}}}
    path = write(tmp_path, node, device_class(), claim_template(namespace=NS), vllm_claim_pod())
    assert main(["plan", path]) == 1
    out = capsys.readouterr().out
    assert "no nodes in the input" not in out
    assert "no ResourceSlice in the input publishes a device for its claims" in out
