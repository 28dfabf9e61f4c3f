"""The extender on DRA nodes: pods asking ``nvidia.com/gpu`` where a DeviceClass maps it to DRA devices.

The scheduler's DRA allocator is played by hand: it picks a device for the pod's extended-resource
claim (no capacity request: the claim consumes the device's default), writes the claim and the pod's
``status.extendedResourceClaimStatus``, then calls bind, as kube-scheduler's PreBind does.
"""

from __future__ import annotations

import json
from fractions import Fraction
from typing import Any

import pytest

from extender.verbs import Verbs
from tests.dra_objects import (
    allocated,
    claim,
    device_class,
    extended_resource_claim,
    gpu_device,
    resource_slice,
    result,
    vllm_claim_pod,
    vllm_extended_resource_pod,
)
from vramguard import cluster as cluster_module
from vramguard.cluster import ClusterState
from vramguard.codecs import ENFORCE_LABEL, PLACEMENT_ANNOTATION
from vramguard.dra.extended import OPEN_SLOTS
from vramguard.dra.fields import memory_text
from vramguard.io.kube import ApiError
from vramguard.policy import default_policy
from vramguard.quantity import GiB, MiB, format_bytes
from vramguard.report import gpu_rows, gpu_table

NODE = "node-a"
UUIDS = ("GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111")


def dra_node(name: str = NODE, allocatable: dict[str, str] | None = None) -> dict[str, Any]:
    """A Node of the DRA stack: no GPU Feature Discovery labels, no ``nvidia.com/gpu`` allocatable."""
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110", **(allocatable or {})}},
    }


def gpus(mode: str | int, count: int = 1) -> list[dict[str, Any]]:
    return [gpu_device(name=f"gpu-{i}", uuid=UUIDS[i], memory="81559Mi", mode=mode) for i in range(count)]


class FakeKube:
    """Serves the pods and claims bind reads, and records the Bindings."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.pods: dict[str, dict[str, Any]] = {}
        self.claims: dict[str, dict[str, Any]] = {}
        self.bindings: list[dict[str, Any]] = []
        self.watch_cache: dict[str, dict[str, Any]] = {}
        """Pods as the API server's watch cache answers (``resourceVersion=0``) where it lags."""

    async def get(self, path: str, params: Any = None) -> dict[str, Any]:
        name = path.rsplit("/", 1)[-1]
        if params == {"resourceVersion": "0"} and name in self.watch_cache:
            return self.watch_cache[name]
        store = self.claims if "/resourceclaims/" in path else self.pods
        if name not in store:
            raise ApiError(404, "NotFound", f"{name!r} not found")
        return store[name]

    async def create(self, path: str, body: Any) -> dict[str, Any]:
        self.bindings.append(body)
        pod = self.pods[body["metadata"]["name"]]
        pod["spec"]["nodeName"] = body["target"]["name"]
        pod["metadata"].setdefault("annotations", {}).update(body["metadata"].get("annotations", {}))
        return {}


def make(
    devices: list[dict[str, Any]], claims: list[dict[str, Any]] = (), node: dict[str, Any] | None = None
) -> tuple[ClusterState, Verbs, FakeKube]:
    state = ClusterState(default_policy())
    state.nodes.replace([node or dra_node()])
    state.namespaces.replace([{"metadata": {"name": "default"}}])
    state.pods.replace([])
    state.dra.watched = True
    state.dra.slices.replace([resource_slice(NODE, devices)])
    state.dra.classes.replace([device_class()])
    state.dra.claims.replace(list(claims))
    fake = FakeKube(state)
    return state, Verbs(state, fake), fake  # type: ignore[arg-type]


def extended_pod(name: str, utilization: str) -> dict[str, Any]:
    pod = vllm_extended_resource_pod(name, utilization)
    pod["spec"]["schedulerName"] = default_policy().schedulers[0]
    return pod


def allocate(fake: FakeKube, pod: dict[str, Any], device: str, memory: str | None) -> dict[str, Any]:
    """The scheduler's PreBind: the pod's extended-resource claim, allocated on ``device``."""
    name = pod["metadata"]["name"]
    made = extended_resource_claim(name, device=device, memory=memory, share=f"share-{name}")
    fake.claims[made["metadata"]["name"]] = made
    pod["status"] = {
        "extendedResourceClaimStatus": {
            "resourceClaimName": made["metadata"]["name"],
            "requestMappings": [
                {"containerName": "vllm", "resourceName": "nvidia.com/gpu", "requestName": "container-0-request-0"}
            ],
        }
    }
    return made


async def schedule(
    verbs: Verbs, fake: FakeKube, name: str, utilization: str, device: str = "gpu-0", memory: str | None = "0"
) -> str:
    """Filter, then (as the allocator would) allocate ``device``, bind, and deliver the watch events."""
    pod = extended_pod(name, utilization)
    fake.pods[name] = pod
    outcome = await verbs.filter(pod, [NODE])
    if not outcome.passing:
        return "pending: " + json.dumps(outcome.failed | outcome.unresolvable)
    made = allocate(fake, pod, device, memory)
    error = await verbs.bind(name, "default", pod["metadata"]["uid"], NODE)
    if error:
        return "bind error: " + error
    fake.state.pods.upsert(pod)
    fake.state.dra.claims.upsert(made)
    return NODE


async def test_unlimited_mode_three_of_four_pods_at_030_and_the_fourth_pending() -> None:
    state, verbs, fake = make(gpus("unlimited"))
    results = [await schedule(verbs, fake, f"vllm-{i}", "0.30") for i in range(4)]
    # vLLM v0.10.1 holds its CUDA context (512 MiB) and its CUDA graphs (1 GiB) beside its share.
    need = int(Fraction(3, 10) * 81559 * MiB) + 512 * MiB + GiB
    assert results[:3] == [NODE] * 3
    assert results[3].startswith("pending:"), results[3]
    assert f"VRAM budget free below the pod's {format_bytes(need)}" in results[3], results[3]
    # A shareable DRA device is a shared device: it keeps the default margin, so 97% of 81559 MiB is the budget.
    assert [row.budget for row in state.ledger.usage(NODE)] == [81559 * MiB * 97 // 100]
    assert state.ledger.check_invariants() == []


async def test_bind_reads_the_claim_status_the_watch_cache_does_not_show_yet() -> None:
    # The scheduler writes status.extendedResourceClaimStatus right before it calls bind.
    _, verbs, fake = make(gpus("unlimited"))
    pod = extended_pod("vllm-0", "0.30")
    fake.pods["vllm-0"] = pod
    assert (await verbs.filter(pod, [NODE])).passing == [NODE]
    fake.watch_cache["vllm-0"] = json.loads(json.dumps(pod))  # before the allocation
    allocate(fake, pod, "gpu-0", "0")
    assert await verbs.bind("vllm-0", "default", pod["metadata"]["uid"], NODE) == ""
    assert len(fake.bindings) == 1


async def test_bind_records_the_device_dra_allocated() -> None:
    state, verbs, fake = make(gpus("unlimited", 2))
    assert await schedule(verbs, fake, "vllm-0", "0.30", device="gpu-1") == NODE
    placement = json.loads(fake.bindings[0]["metadata"]["annotations"][PLACEMENT_ANNOTATION])
    assert UUIDS[1] in json.dumps(placement)
    state.sync_dra()  # the pod's watch event: its claim places it (readers sync before reading)
    (row,) = [r for r in state.ledger.usage(NODE) if r.device.id == UUIDS[1]]
    assert row.known_bytes > 0 and "default/vllm-0" in row.pods
    (other,) = [r for r in state.ledger.usage(NODE) if r.device.id == UUIDS[0]]
    assert other.known_bytes == 0


async def test_filter_is_conservative_every_device_the_allocator_could_pick_must_have_room() -> None:
    """gpu-0 is full, gpu-1 empty: in unlimited mode the allocator may pick gpu-0 again, so the node
    fails (refusing at bind would loop on the same device)."""
    _, verbs, fake = make(gpus("unlimited", 2))
    for i in range(3):
        assert await schedule(verbs, fake, f"vllm-{i}", "0.30", device="gpu-0") == NODE
    assert (await schedule(verbs, fake, "vllm-3", "0.30", device="gpu-1")).startswith("pending:")


async def test_memory_mode_a_device_taken_whole_is_not_pickable() -> None:
    """memory mode: an extended-resource claim consumes the whole GPU, so the allocator can only pick
    the free device, and the node passes on that one."""
    _, verbs, fake = make(gpus("memory", 2))
    assert await schedule(verbs, fake, "vllm-0", "0.90", device="gpu-0", memory="81559Mi") == NODE
    assert await schedule(verbs, fake, "vllm-1", "0.90", device="gpu-1", memory="81559Mi") == NODE
    assert (await schedule(verbs, fake, "vllm-2", "0.10", device="gpu-1", memory="81559Mi")).startswith("pending:")


async def test_memory_claims_of_pods_with_resource_claims_count_against_the_budget() -> None:
    taken = allocated(claim("big"), [result(device="gpu-0", memory="60Gi", share="s-big")], pods=("other",))
    _, verbs, fake = make(gpus("unlimited"), [taken])
    outcome = await schedule(verbs, fake, "vllm-0", "0.30")
    assert outcome.startswith("pending:") and "GPU 0 (NVIDIA H100 80GB HBM3)" in outcome, outcome
    assert await schedule(verbs, fake, "vllm-1", "0.10") == NODE


async def test_exclusive_device_held_by_a_claim_is_not_pickable() -> None:
    taken = allocated(claim("whole"), [result(device="gpu-0", memory=None, share=None)], pods=("other",))
    state, verbs, fake = make(gpus("disabled", 2), [taken])
    assert await schedule(verbs, fake, "vllm-0", "0.90", device="gpu-1", memory=None) == NODE
    assert (await schedule(verbs, fake, "vllm-1", "0.10", device="gpu-1", memory=None)).startswith("pending:")
    assert [g.sharing for g in state.ledger.inventory(NODE).devices] == ["none", "none"]


@pytest.mark.parametrize(
    ("mode", "allocations", "slots"),
    [
        pytest.param("unlimited", 0, OPEN_SLOTS, id="unlimited-open"),
        pytest.param(2, 0, 2, id="shares-two-free"),
        pytest.param(2, 2, 2, id="shares-all-held-by-extended-pods"),
        pytest.param("memory", 0, 1, id="memory-whole-gpu-once"),
        pytest.param("disabled", 0, 1, id="exclusive-free"),
    ],
)
async def test_device_slots_follow_the_sharing_mode(mode: str | int, allocations: int, slots: int) -> None:
    state, verbs, fake = make(gpus(mode))
    for i in range(allocations):
        assert await schedule(verbs, fake, f"vllm-{i}", "0.10", memory="0") == NODE
    state.sync_dra()
    (gpu,) = state.ledger.inventory(NODE).devices
    assert gpu.replicas == slots
    assert gpu.resource == "nvidia.com/gpu"
    assert gpu.sharing == ("none" if mode == "disabled" else "time-slicing")


async def test_share_count_mode_full_once_every_share_is_taken() -> None:
    _, verbs, fake = make(gpus(2))
    assert await schedule(verbs, fake, "vllm-0", "0.10") == NODE
    assert await schedule(verbs, fake, "vllm-1", "0.10") == NODE
    assert (await schedule(verbs, fake, "vllm-2", "0.10")).startswith("pending:")


async def test_a_device_plugin_on_the_node_takes_the_resource_from_dra() -> None:
    state, _, _ = make(gpus("unlimited"), node=dra_node(allocatable={"nvidia.com/gpu": "4"}))
    state.sync_dra()
    assert state.dra_resources(NODE) == frozenset()
    assert all(g.id not in UUIDS for g in state.ledger.inventory(NODE).devices)


async def test_a_class_without_extended_resource_name_adds_no_ledger_device() -> None:
    state, verbs, fake = make(gpus("unlimited"))
    state.dra.classes.replace([device_class(extended_resource=None)])
    state.sync_dra()
    assert state.ledger.inventory(NODE).devices == ()
    assert (await schedule(verbs, fake, "vllm-0", "0.10")).startswith("pending:")


async def test_restart_counts_bound_pods_on_the_device_their_claim_names() -> None:
    _, verbs, fake = make(gpus("unlimited", 2))
    assert await schedule(verbs, fake, "vllm-0", "0.30", device="gpu-1") == NODE
    fresh, _, _ = make(gpus("unlimited", 2), list(fake.claims.values()))
    fresh.pods.replace(list(fake.pods.values()))
    fresh.sync_dra()
    rows = {r.device.id: r for r in fresh.ledger.usage(NODE)}
    assert rows[UUIDS[1]].known_bytes > 0 and rows[UUIDS[0]].known_bytes == 0
    assert fresh.ledger.check_invariants() == []


@pytest.mark.parametrize(
    ("tamper", "expected"),
    [
        pytest.param(lambda pod, made: pod.pop("status"), "names no allocated claim", id="no-claim-status"),
        pytest.param(
            lambda pod, made: made["status"].update(reservedFor=[{"resource": "pods", "name": "x", "uid": "other"}]),
            "refused: ResourceClaim", id="claim-reserved-for-another-pod",
        ),
        pytest.param(
            lambda pod, made: made["metadata"].pop("annotations"), "refused: ResourceClaim", id="not-extended-claim"
        ),
        pytest.param(
            lambda pod, made: made["status"]["allocation"]["devices"]["results"][0].update(pool="elsewhere"),
            "none of its devices is on", id="device-on-another-node",
        ),
    ],
)
async def test_bind_trusts_only_an_allocated_claim_of_the_pod(tamper: Any, expected: str) -> None:
    state, verbs, fake = make(gpus("unlimited"))
    pod = extended_pod("vllm-0", "0.30")
    fake.pods["vllm-0"] = pod
    assert (await verbs.filter(pod, [NODE])).passing == [NODE]
    made = allocate(fake, pod, "gpu-0", "0")
    tamper(pod, made)
    error = await verbs.bind("vllm-0", "default", pod["metadata"]["uid"], NODE)
    assert expected in error
    assert fake.bindings == [] and state.ledger.holding("uid-vllm-0") is None


async def test_a_missing_claim_is_an_error_the_scheduler_retries() -> None:
    _, verbs, fake = make(gpus("unlimited"))
    pod = extended_pod("vllm-0", "0.30")
    fake.pods["vllm-0"] = pod
    allocate(fake, pod, "gpu-0", "0")
    fake.claims.clear()
    assert "cannot read ResourceClaim" in await verbs.bind("vllm-0", "default", "uid-vllm-0", NODE)


async def test_the_gpu_table_names_dra_sharing_not_replicas() -> None:
    state, verbs, fake = make(gpus("unlimited"))
    assert await schedule(verbs, fake, "vllm-0", "0.30") == NODE
    state.sync_dra()
    (row,) = gpu_rows(state.ledger.usage(NODE))
    assert row.sharing == "dra-unlimited" and row.gpu == UUIDS[0]
    assert "dra-unlimited " in gpu_table([row]) and " x" not in gpu_table([row]).split("dra-unlimited")[1][:3]


def bound_pod(name: str, node: str = NODE) -> dict[str, Any]:
    pod = extended_pod(name, "0.30")
    pod["spec"]["nodeName"] = node
    return pod


def test_a_pod_seen_bound_after_its_claim_is_placed_at_the_next_sync() -> None:
    """The scheduler writes the claim before the pod is bound: the pod's watch event comes second."""
    made = extended_resource_claim("vllm-0", device="gpu-1", memory="0", share="s-0")
    state, _, _ = make(gpus("unlimited", 2), [made])
    state.sync_dra()
    state.pods.upsert(bound_pod("vllm-0"))
    state.sync_dra()
    rows = {r.device.id: r for r in state.ledger.usage(NODE)}
    assert rows[UUIDS[1]].known_bytes > 0 and rows[UUIDS[0]].known_bytes == 0


def test_a_node_seen_after_its_slice_gets_its_dra_devices() -> None:
    state = ClusterState(default_policy())
    state.dra.watched = True
    state.dra.slices.replace([resource_slice(NODE, gpus("unlimited"))])
    state.dra.classes.replace([device_class()])
    state.dra.claims.replace([])
    state.sync_dra()
    assert state.ledger.inventory(NODE) is None
    state.nodes.upsert(dra_node())
    state.sync_dra()
    assert [g.id for g in state.ledger.inventory(NODE).devices] == [UUIDS[0]]
    state.nodes.upsert(dra_node())  # a heartbeat keeps them
    assert [g.id for g in state.ledger.inventory(NODE).devices] == [UUIDS[0]]
    assert state.largest_node_devices() == OPEN_SLOTS


def test_a_claim_event_redoes_only_the_node_it_allocates_on(monkeypatch: pytest.MonkeyPatch) -> None:
    state = ClusterState(default_policy())
    state.nodes.replace([dra_node("node-a"), dra_node("node-b")])
    state.dra.watched = True
    other = gpu_device(uuid="GPU-22222222-2222-2222-2222-222222222222", memory="81559Mi", mode="unlimited")
    state.dra.slices.replace([resource_slice("node-a", gpus("unlimited")), resource_slice("node-b", [other])])
    state.dra.classes.replace([device_class()])
    state.dra.claims.replace([])
    state.sync_dra()
    redone: list[tuple[str, ...]] = []
    original = cluster_module.ledger_part

    def counting(devices: Any, *args: Any) -> Any:
        redone.append(tuple(d.node for d in devices))
        return original(devices, *args)

    monkeypatch.setattr(cluster_module, "ledger_part", counting)
    state.dra.claims.upsert(extended_resource_claim("vllm-0", device="gpu-0", memory="0", share="s-0", pool="node-b"))
    state.sync_dra()
    assert redone == [("node-b",)]
    state.sync_dra()
    assert redone == [("node-b",)]


async def test_a_device_claims_filled_past_its_budget_names_the_claims() -> None:
    """The scheduler allocates claims up to 100% of the memory; the budget keeps the margin (3%)."""
    # 78 GiB: within the device's 79.6 GiB of memory, past its 77.3 GiB budget.
    taken = allocated(claim("big"), [result(device="gpu-0", memory="78Gi", share="s-big")], pods=("other",))
    _, verbs, fake = make(gpus("unlimited", 2), [taken])
    outcome = await schedule(verbs, fake, "vllm-0", "0.05")
    assert "already over its VRAM budget" in outcome and "claims of pods with ResourceClaims" in outcome, outcome


# -- pods with ResourceClaims ------------------------------------------------------------------

H200 = ("GPU-22222222-2222-2222-2222-222222222222", "143771Mi", "NVIDIA H200")
"""NVML's total for an H200 (MiB), as the driver publishes it."""


def claim_pod(
    name: str, utilization: str, *, claim_name: str | None = None, namespace: str = "default"
) -> dict[str, Any]:
    """A vLLM pod using claim ``gpu``: named (``claim_name``) or from template ``gpu-8gi``, whose claim
    the resourceclaim controller has made (``<pod>-gpu``, recorded in the pod's status)."""
    pod = vllm_claim_pod(name, utilization, template="gpu-8gi", claim_name=claim_name, namespace=namespace)
    pod["spec"]["schedulerName"] = default_policy().schedulers[0]
    if claim_name is None:
        pod["status"] = {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": f"{name}-gpu"}]}
    return pod


def made_claim(pod: dict[str, Any], memory: str) -> dict[str, Any]:
    """The claim the resourceclaim controller makes for ``pod`` from its template (not allocated)."""
    name = pod["metadata"]["name"]
    made = claim(f"{name}-gpu", pod["metadata"]["namespace"], memory=memory)
    made["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": "gpu"}
    made["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": f"uid-{name}", "controller": True}
    ]
    return made


def prebind(fake: FakeKube, obj: dict[str, Any], memory: str, pods: tuple[str, ...], device: str = "gpu-0") -> None:
    """The scheduler's PreBind: ``obj`` allocated on ``device`` (a share of ``memory``), reserved for ``pods``."""
    fake.claims[obj["metadata"]["name"]] = allocated(obj, [result(device=device, memory=memory)], pods=pods)


async def schedule_claim_pod(
    verbs: Verbs, fake: FakeKube, pod: dict[str, Any], claim_obj: dict[str, Any], memory: str,
    pods: tuple[str, ...] | None = None, *, filtered: bool = True,
) -> str:
    """Filter (unless the scheduler filtered before the previous bind), allocate the claim on gpu-0,
    bind; the watches deliver nothing (binds come faster than watch events)."""
    name = pod["metadata"]["name"]
    fake.pods[name] = pod
    fake.state.dra.pods.upsert(pod)
    if filtered:
        outcome = await verbs.filter(pod, [NODE])
        if not outcome.passing:
            return "pending: " + json.dumps(outcome.failed | outcome.unresolvable)
    prebind(fake, claim_obj, memory, pods or (name,))
    error = await verbs.bind(name, "default", pod["metadata"]["uid"], NODE)
    return f"bind error: {error}" if error else NODE


# vLLM v0.10.1 (the pods' image): 0.90 of the device plus its CUDA context (512 MiB) and graphs (1 GiB).
VLLM_090_H100 = int(Fraction(9, 10) * 81559 * MiB) + 512 * MiB + GiB


async def test_three_vllm_pods_at_090_claiming_8gi_are_not_put_on_one_gpu() -> None:
    """The allocator counts 3 x 8Gi on an 80 GB GPU; the engines take 3 x 0.90 of it."""
    state, verbs, fake = make(gpus("memory"))
    pods = [claim_pod(f"vllm-{i}", "0.90") for i in range(3)]
    for pod in pods:
        state.dra.claims.upsert(made_claim(pod, "8Gi"))
    assert await schedule_claim_pod(verbs, fake, pods[0], made_claim(pods[0], "8Gi"), "8Gi") == NODE
    # The scheduler filtered the second before the first was bound (a wave): bind is where it is caught.
    error = await schedule_claim_pod(verbs, fake, pods[1], made_claim(pods[1], "8Gi"), "8Gi", filtered=False)
    assert error.startswith(f"bind error: {NODE}: gpu-0 (NVIDIA H100 80GB HBM3) has "), error
    assert (
        f"has {memory_text(81559 * MiB - VLLM_090_H100)} of 81559Mi left beside the engines of the claims there, "
        f"and claim default/vllm-1-gpu of this pod takes {memory_text(VLLM_090_H100)} (vLLM will reserve "
        f"0.90 x 81559Mi + 1536Mi = {memory_text(VLLM_090_H100)})" in error
    ), error
    # Filtered after the first bind, the third finds no room, before any claim event arrives.
    third = await schedule_claim_pod(verbs, fake, pods[2], made_claim(pods[2], "8Gi"), "8Gi")
    assert third.startswith("pending:") and "gpu-0 (NVIDIA H100 80GB HBM3) has" in third, third
    assert [b["metadata"]["name"] for b in fake.bindings] == ["vllm-0"]
    # The first pod's claim reaches the watch: it is counted there, not twice; the others still do not fit.
    state.dra.claims.upsert(fake.claims["vllm-0-gpu"])
    assert (await verbs.filter(pods[2], [NODE])).passing == []
    # The scheduler's Unreserve after the refused bind (kubernetes v1.36.3 dynamicresources.go) takes
    # vllm-1 out of its claim's reservedFor and keeps the allocation: that claim runs no engine.
    leftover = fake.claims["vllm-1-gpu"]
    leftover["status"]["reservedFor"] = []
    state.dra.claims.upsert(leftover)
    # The first goes (the resourceclaim controller deallocates its claim): the third fits beside the leftover.
    state.dra.pods.delete(pods[0])
    state.dra.claims.upsert(made_claim(pods[0], "8Gi"))
    assert (await verbs.filter(pods[2], [NODE])).passing == [NODE]


async def test_pods_sharing_one_claim_add_up_on_its_device() -> None:
    state, verbs, fake = make(gpus("memory"))
    shared = claim("shared-gpu", "default", memory="30Gi")
    state.dra.claims.upsert(shared)
    pods = [claim_pod(f"vllm-{i}", "0.30", claim_name="shared-gpu") for i in range(4)]
    results = []
    for i, pod in enumerate(pods):
        results.append(await schedule_claim_pod(
            verbs, fake, pod, shared, "30Gi", tuple(f"vllm-{j}" for j in range(i + 1)), filtered=False
        ))
        if results[-1] == NODE:
            state.dra.claims.upsert(fake.claims["shared-gpu"])  # the watch shows it reserved for them
    assert results[:3] == [NODE] * 3
    assert results[3].startswith(f"bind error: {NODE}: gpu-0"), results[3]


@pytest.mark.parametrize(("mode", "bound"), [("enforce", False), ("warn", True)])
async def test_a_claim_sized_for_an_h100_on_an_h200_that_joined_later(mode: str, bound: bool) -> None:
    """72Gi covers vLLM at 0.90 of an H100 (admission checked it there); an H200 joins, the allocator
    gives it the claim, and vLLM takes 0.90 of 141 GiB. Where the namespace enforces, not placed."""
    uuid, memory, product = H200
    state, verbs, fake = make([gpu_device(name="gpu-0", uuid=uuid, memory=memory, product=product)])
    state.namespaces.replace([{"metadata": {"name": "default", "labels": {ENFORCE_LABEL: mode}}}])
    pod = claim_pod("vllm-0", "0.90")
    state.dra.claims.upsert(made_claim(pod, "72Gi"))
    need = int(Fraction(9, 10) * 143771 * MiB) + 512 * MiB + GiB
    outcome = await verbs.filter(pod, [NODE])
    assert bool(outcome.passing) is bound
    if not bound:
        assert f"set capacity.requests.memory: {memory_text(need)}" in outcome.unresolvable[NODE]
    error = await schedule_claim_pod(verbs, fake, pod, made_claim(pod, "72Gi"), "72Gi", filtered=False)
    assert (error == NODE) is bound, error
    if not bound:
        assert (
            f"on gpu-0 (NVIDIA H200), claim gpu requests 72Gi of memory but vLLM will reserve 0.90 x "
            f"{memory_text(143771 * MiB)} + 1536Mi = {memory_text(need)}" in error
        ), error


async def test_bind_refuses_a_claim_pod_whose_claim_is_not_allocated_for_it() -> None:
    _, verbs, fake = make(gpus("memory"))
    pod = claim_pod("vllm-0", "0.30")
    fake.pods["vllm-0"] = pod
    fake.claims["vllm-0-gpu"] = made_claim(pod, "30Gi")  # PreBind has not written it
    error = await verbs.bind("vllm-0", "default", "uid-vllm-0", NODE)
    assert error == (
        "pod default/vllm-0: ResourceClaim default/vllm-0-gpu is not allocated and reserved for the pod; retrying"
    )
    assert fake.bindings == []


async def test_of_two_pods_prebound_together_the_first_bind_wins() -> None:
    """The scheduler's PreBind wrote both claims (each reserved for its pod) before either bind: a pod
    not bound yet counts by its claim, so the first bind is not refused for the second's engine."""
    state, verbs, fake = make(gpus("memory"))
    # 0.80: one vLLM beside the other's 8Gi claim fits (0.80 x 81559Mi + 1536Mi + 8Gi), two do not.
    pods = [claim_pod(f"vllm-{i}", "0.80") for i in range(2)]
    for pod in pods:
        fake.pods[pod["metadata"]["name"]] = pod
        state.dra.pods.upsert(pod)
        prebind(fake, made_claim(pod, "8Gi"), "8Gi", (pod["metadata"]["name"],))
        state.dra.claims.upsert(fake.claims[f"{pod['metadata']['name']}-gpu"])
    assert await verbs.bind("vllm-0", "default", "uid-vllm-0", NODE) == ""
    assert "has" in await verbs.bind("vllm-1", "default", "uid-vllm-1", NODE)
    assert [b["metadata"]["name"] for b in fake.bindings] == ["vllm-0"]
    # The scheduler's Unreserve takes vllm-1 out of its claim's reservedFor and keeps the allocation:
    # such a claim runs no engine, and the first pod, once bound, is counted by its engine.
    unreserved = fake.claims["vllm-1-gpu"]
    unreserved["status"]["reservedFor"] = []
    state.dra.claims.upsert(unreserved)
    state.dra.pods.upsert(fake.pods["vllm-0"])
    state.dra.pods.delete(fake.pods["vllm-0"])  # vllm-0 goes: vllm-1 fits beside its own leftover claim
    assert (await verbs.filter(pods[1], [NODE])).passing == [NODE]


@pytest.mark.parametrize("first", [0, 1])
async def test_of_two_pods_at_090_prebound_together_exactly_one_binds_whichever_bind_comes_first(first: int) -> None:
    """Neither vLLM at 0.90 fits beside the other's 8Gi claim. Each bind counts only the unchecked
    claims of the pods created before it, so the two never refuse each other on every retry."""
    state, verbs, fake = make(gpus("memory"))
    pods = [claim_pod(f"vllm-{i}", "0.90") for i in range(2)]
    for i, pod in enumerate(pods):
        pod["metadata"]["creationTimestamp"] = f"2026-12-06T03:04:2{i}Z"
        fake.pods[pod["metadata"]["name"]] = pod
        state.dra.pods.upsert(pod)
        prebind(fake, made_claim(pod, "8Gi"), "8Gi", (pod["metadata"]["name"],))
        state.dra.claims.upsert(fake.claims[f"{pod['metadata']['name']}-gpu"])
    errors = {}
    for i in (first, 1 - first):
        errors[i] = await verbs.bind(f"vllm-{i}", "default", f"uid-vllm-{i}", NODE)
    assert sorted(bool(e) for e in errors.values()) == [False, True], errors
    refused = next(e for e in errors.values() if e)
    assert "gpu-0 (NVIDIA H100 80GB HBM3) has" in refused and "left beside the engines" in refused, refused
    assert len(fake.bindings) == 1
