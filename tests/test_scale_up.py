"""Scale-up gates: the pure decision and patches (vramguard.scale_up), the webhook's gate, and the
extender's gate keeper against a fake API.

The patches are applied here as the API server applies a JSON Patch (RFC 6902), and the result is
checked against the rules the API server enforces on a gated pod
(``pkg/apis/core/validation/validation.go`` v1.36.3: ``validateOnlyDeletedSchedulingGates``, and
``validateNodeAffinityMutation``: the same number of required terms, each keeping its expressions
and fields as a prefix)."""

from __future__ import annotations

import asyncio
import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from extender.scale_up import GateKeeper
from extender.verbs import Verbs
from tests.builders import gpu_node, vllm_pod
from vramguard.cluster import ClusterState
from vramguard.io.kube import ApiError
from vramguard.policy import Policy, PolicyError, ScaleUp, default_policy
from vramguard.scale_up import (
    GATE,
    HOSTNAME_LABEL,
    MAX_EXCLUDED,
    RELEASED_ANNOTATION,
    Hold,
    Release,
    add_gate_patch,
    decide,
    label_value_for,
    overdue,
    release_patch,
)

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)


def apply_patch(document: dict[str, Any], operations: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 add / remove / test, as the API server applies a JSON Patch (a failed test raises)."""
    result = copy.deepcopy(document)
    for operation in operations:
        *parents, last = [t.replace("~1", "/").replace("~0", "~") for t in operation["path"].split("/")[1:]]
        target: Any = result
        for token in parents:
            target = target[int(token)] if isinstance(target, list) else target[token]
        if operation["op"] == "test":
            value = target[int(last)] if isinstance(target, list) else target[last]
            if value != operation["value"]:
                raise ValueError(f"test failed at {operation['path']}")
        elif operation["op"] == "remove":
            del target[int(last) if isinstance(target, list) else last]
        elif isinstance(target, list):
            target.insert(len(target) if last == "-" else int(last), operation["value"])
        else:
            if last in target and operation["path"].count("/") > 1 and not isinstance(target[last], (str, int)):
                raise ValueError(f"add over an existing object at {operation['path']}")
            target[last] = operation["value"]
    return result


def allowed_update(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """The API server's rules for an update of a gated pod's gates and node affinity."""
    old_gates = [g["name"] for g in old["spec"].get("schedulingGates", [])]
    new_gates = [g["name"] for g in new["spec"].get("schedulingGates", [])]
    if not old_gates or any(g not in old_gates for g in new_gates):
        return False
    old_required = (old["spec"].get("affinity") or {}).get("nodeAffinity", {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    new_required = (new["spec"].get("affinity") or {}).get("nodeAffinity", {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    if old_required is None:
        return True
    old_terms, new_terms = old_required["nodeSelectorTerms"], new_required["nodeSelectorTerms"]
    if len(old_terms) != len(new_terms):
        return False
    for before, after in zip(old_terms, new_terms, strict=True):
        for field in ("matchExpressions", "matchFields"):
            kept = before.get(field) or []
            if (after.get(field) or [])[:len(kept)] != kept:
                return False
        if not before.get("matchExpressions") and not before.get("matchFields") and after != before:
            return False
    return True


def gated(pod: dict[str, Any]) -> dict[str, Any]:
    return apply_patch(pod, add_gate_patch(pod["spec"]))


def test_the_gate_is_added_once_beside_other_gates() -> None:
    pod = vllm_pod("p", "0.30")
    assert gated(pod)["spec"]["schedulingGates"] == [{"name": GATE}]
    pod["spec"]["schedulingGates"] = [{"name": "example.com/quota"}]
    assert gated(pod)["spec"]["schedulingGates"] == [{"name": "example.com/quota"}, {"name": GATE}]
    assert add_gate_patch(gated(pod)["spec"]) == []


def test_release_without_exclusion_removes_only_the_gate_and_stamps_the_time() -> None:
    pod = gated(vllm_pod("p", "0.30"))
    pod["spec"]["schedulingGates"].insert(0, {"name": "example.com/quota"})
    released = apply_patch(pod, release_patch(pod, 1, HOSTNAME_LABEL, (), NOW))
    assert released["spec"]["schedulingGates"] == [{"name": "example.com/quota"}]
    assert released["metadata"]["annotations"][RELEASED_ANNOTATION] == "2026-12-07T12:00:00Z"
    assert "affinity" not in released["spec"] and allowed_update(pod, released)


def test_release_tests_the_gate_so_a_changed_gate_list_fails_the_patch() -> None:
    pod = gated(vllm_pod("p", "0.30"))
    operations = release_patch(pod, 0, HOSTNAME_LABEL, (), NOW)
    pod["spec"]["schedulingGates"].insert(0, {"name": "example.com/quota"})  # changed meanwhile
    with pytest.raises(ValueError, match="test failed"):
        apply_patch(pod, operations)


EXCLUDE = {"key": HOSTNAME_LABEL, "operator": "NotIn", "values": ["a", "b"]}


@pytest.mark.parametrize("affinity, expected_terms", [
    (None, [{"matchExpressions": [EXCLUDE]}]),
    ({"podAntiAffinity": {}}, [{"matchExpressions": [EXCLUDE]}]),
    ({"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}, [{"matchExpressions": [EXCLUDE]}]),
    ({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}]},
        {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["x"]}]},
        {},
    ]}}}, [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}, EXCLUDE]},
        {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["x"]}],
         "matchExpressions": [EXCLUDE]},
        {},
    ]),
], ids=["none", "other-affinity", "preferred-only", "every-term-grows"])
def test_narrowing_appends_to_every_required_term_as_a_gated_pod_may(
    affinity: dict[str, Any] | None, expected_terms: list[dict[str, Any]]
) -> None:
    pod = gated(vllm_pod("p", "0.30"))
    if affinity is not None:
        pod["spec"]["affinity"] = copy.deepcopy(affinity)
    released = apply_patch(pod, release_patch(pod, 0, HOSTNAME_LABEL, ("a", "b"), NOW))
    required = released["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required["nodeSelectorTerms"] == expected_terms
    assert released["metadata"]["annotations"][RELEASED_ANNOTATION] == "2026-12-07T12:00:00Z narrowed"
    assert allowed_update(pod, released)


def test_decide() -> None:
    key = HOSTNAME_LABEL
    assert decide(["n1"], {"n2": "n2"}, False, "80 GiB", key) == Release()
    assert decide([], {"n2": "n2", "n1": "n1"}, True, "80 GiB", key) == Release(("n1", "n2"))
    assert decide([], {}, None, "none known", key) == Release()
    held = decide([], {"n1": "n1"}, False, "80 GiB", key)
    assert isinstance(held, Hold) and "80 GiB" in held.reason
    unlabelled = decide([], {"n1": "n1", "n3": None}, True, "80 GiB", key)
    assert isinstance(unlabelled, Hold) and "(n3)" in unlabelled.reason


def test_label_values_are_valid_for_any_node_name() -> None:
    assert label_value_for("gpu-node-1.example.com") == "gpu-node-1.example.com"
    long = "ip-10-0-0-1." + "x" * 80 + ".compute.internal"
    value = label_value_for(long)
    assert len(value) <= 63 and value != label_value_for(long + "2")


def unschedulable(pod: dict[str, Any], released: datetime) -> dict[str, Any]:
    pod = copy.deepcopy(pod)
    pod["metadata"].setdefault("annotations", {})[RELEASED_ANNOTATION] = released.strftime("%Y-%m-%dT%H:%M:%SZ")
    pod["status"] = {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}
    return pod


def test_overdue_only_after_the_timeout_and_only_while_unschedulable() -> None:
    pod = unschedulable(vllm_pod("p", "0.30"), NOW - timedelta(seconds=700))
    assert overdue(pod, NOW, 600)
    assert not overdue(pod, NOW, 800)
    pod["status"]["conditions"][0]["reason"] = "SchedulingGated"
    assert not overdue(pod, NOW, 600)
    assert not overdue(vllm_pod("q", "0.30"), NOW, 0)


def test_policy_names_only_existing_classes_and_gates_nothing_by_default() -> None:
    policy = default_policy()
    assert not policy.scale_up.gates(policy.default_class)
    with pytest.raises(PolicyError, match=r"scale_up\.classes"):
        Policy.from_yaml("classes: {a: {sharing: [time-slicing]}}\ndefault_class: a\n"
                         "scale_up: {autoscaler: karpenter, classes: [b]}\n")
    assert ScaleUp(autoscaler="karpenter", classes=("a",)).gates("a")
    assert not ScaleUp(autoscaler="karpenter", classes=("a",)).gates("b")


# -- the gate keeper -------------------------------------------------------------------------


class FakeApi:
    """The API server as the gate keeper uses it: JSON Patch a pod, merge-patch a node, evict, Events."""

    def __init__(self, pods: dict[str, dict[str, Any]]) -> None:
        self.pods = pods
        self.patches: list[tuple[str, Any]] = []
        self.evictions: list[str] = []
        self.events: list[dict[str, Any]] = []
        self.refuse_node_patch = False
        self.refuse_pod_patch = False

    async def patch(self, path: str, body: Any, patch_type: str = "merge") -> dict[str, Any]:
        await asyncio.sleep(0)
        self.patches.append((path, body))
        if path.startswith("/api/v1/nodes/"):
            if self.refuse_node_patch:
                raise ApiError(403, "Forbidden", "nodes is forbidden")
            return {}
        assert patch_type == "json"
        if self.refuse_pod_patch:
            raise ApiError(403, "Forbidden", "pods is forbidden")
        name = path.rsplit("/", 1)[-1]
        old = self.pods[name]
        try:
            new = apply_patch(old, body)
        except ValueError as exc:
            raise ApiError(422, "Invalid", str(exc)) from None
        assert allowed_update(old, new), "the API server would refuse this update of a gated pod"
        self.pods[name] = new
        return new

    async def create(self, path: str, body: Any) -> dict[str, Any]:
        if path.endswith("/eviction"):
            self.evictions.append(body["metadata"]["name"])
        else:
            self.events.append(body)
        return {}


def keeper(nodes: list[dict[str, Any]], bound: list[dict[str, Any]], pending: list[dict[str, Any]],
           autoscaler: str = "cluster-autoscaler", largest: str | None = None) -> tuple[GateKeeper, FakeApi]:
    settings = ScaleUp(autoscaler=autoscaler, largest_gpu_memory=largest)  # type: ignore[arg-type]
    policy = default_policy().model_copy(update={"scale_up": settings})
    state = ClusterState(policy)
    state.nodes.replace(nodes)
    state.namespaces.replace([{"metadata": {"name": "default"}}])
    state.pods.replace(bound)
    api = FakeApi({p["metadata"]["name"]: p for p in pending})
    synced = asyncio.Event()
    synced.set()
    gates = GateKeeper(state, Verbs(state, None), api, CollectorRegistry(),  # type: ignore[arg-type]
                       serving=lambda: True, synced=synced, wall_clock=lambda: NOW)
    gates.replace(pending)
    return gates, api


def full_h100(name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A time-sliced H100 (four replicas) holding three vLLM pods at 0.30: 24 GiB left of 80."""
    node = gpu_node(name, labels={HOSTNAME_LABEL: name})
    return node, [vllm_pod(f"{name}-{i}", "0.30", node=name) for i in range(3)]


async def test_a_pod_no_gpu_has_room_for_is_narrowed_away_from_the_full_nodes() -> None:
    # The seed scenario: a fourth 0.30 pod fits no H100 holding three, but an empty H100 would hold it.
    (a, on_a), (b, on_b) = full_h100("a"), full_h100("b")
    gates, api = keeper([a, b], on_a + on_b, [gated(vllm_pod("fourth", "0.30"))])
    await gates.round()
    pod = api.pods["fourth"]
    assert "schedulingGates" not in pod["spec"] or pod["spec"]["schedulingGates"] == []
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [{"matchExpressions": [
        {"key": HOSTNAME_LABEL, "operator": "NotIn", "values": ["a", "b"]}]}]
    assert [e["reason"] for e in api.events] == ["VRAMScaleUp"]


async def test_a_pod_that_fits_an_existing_gpu_is_released_unchanged() -> None:
    (a, on_a), b = full_h100("a"), gpu_node("b", labels={HOSTNAME_LABEL: "b"})
    gates, api = keeper([a, b], on_a, [gated(vllm_pod("fourth", "0.30"))])
    await gates.round()
    pod = api.pods["fourth"]
    assert not pod["spec"].get("schedulingGates") and "affinity" not in pod["spec"]
    assert api.events == []


async def test_a_wave_decided_at_once_counts_the_room_the_first_pods_take() -> None:
    # Node b has room for two more pods at 0.30 (one pod on it): of four replicas decided in one
    # round, two are released as they are and two are narrowed away from both nodes.
    (a, on_a), b = full_h100("a"), gpu_node("b", labels={HOSTNAME_LABEL: "b"})
    wave = [gated(vllm_pod(f"r{i}", "0.30")) for i in range(4)]
    gates, api = keeper([a, b], [*on_a, vllm_pod("b-0", "0.30", node="b")], wave)
    await gates.round()
    narrowed = sorted(name for name, pod in api.pods.items() if "affinity" in pod["spec"])
    assert narrowed == ["r2", "r3"]
    terms = api.pods["r3"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["a", "b"]
    assert all(not pod["spec"].get("schedulingGates") for pod in api.pods.values())


async def test_nodes_the_pod_may_not_use_are_neither_counted_nor_excluded() -> None:
    # Node b has room but a taint the pod does not tolerate: the pod cannot use it, so it is narrowed
    # away from a only (kube-scheduler and the autoscalers keep it off b themselves).
    (a, on_a), b = full_h100("a"), gpu_node("b", labels={HOSTNAME_LABEL: "b"})
    b["spec"] = {"taints": [{"key": "dedicated", "value": "training", "effect": "NoSchedule"}]}
    gates, api = keeper([a, b], on_a, [gated(vllm_pod("fourth", "0.30"))])
    await gates.round()
    terms = api.pods["fourth"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["a"]


async def test_a_pod_larger_than_any_gpu_stays_gated_with_one_warning() -> None:
    (a, on_a) = full_h100("a")
    gates, api = keeper([a], on_a, [declaring("big", "120Gi")])
    await gates.round()
    gates._held["uid-big"] -= 3600  # the recheck is due: decided again, warned about once
    await gates.round()
    assert api.pods["big"]["spec"]["schedulingGates"] == [{"name": GATE}]
    assert [p for p, _ in api.patches] == []
    assert [(e["reason"], e["type"]) for e in api.events] == [("VRAMScaleUpHeld", "Warning")]
    assert gates.decisions.labels("held")._value.get() == 1


def declaring(name: str, amount: str) -> dict[str, Any]:
    """A gated pod of a server vramguard knows no engine of, declaring ``amount`` of VRAM."""
    pod = gated(vllm_pod(name, "0.30"))
    pod["metadata"]["annotations"] = {"vramguard.io/vram": amount}
    pod["spec"]["containers"][0]["image"] = "registry.example/ml/server:1.0"
    return pod


@pytest.mark.parametrize(("largest", "amount", "released"), [
    (None, "120Gi", True),  # no GPU node to compare with, no size given: the autoscaler's templates decide
    ("80Gi", "120Gi", False),
    ("80Gi", "60Gi", True),
    ("160Gi", "120Gi", True),
])
async def test_with_no_gpu_node_the_largest_gpu_of_the_policy_decides(
    largest: str | None, amount: str, released: bool
) -> None:
    gates, api = keeper([], [], [declaring("p", amount)], largest=largest)
    await gates.round()
    assert (not api.pods["p"]["spec"].get("schedulingGates")) is released
    assert "affinity" not in api.pods["p"]["spec"]


async def test_a_larger_gpu_the_autoscaler_may_add_releases_a_pod_no_node_shape_holds() -> None:
    # The cluster has 40 GiB GPUs only; the node groups may add 80 GiB ones: a 60 GiB pod is narrowed, not held.
    small = gpu_node("a", memory_mib=40960, product="NVIDIA-A100-SXM4-40GB", labels={HOSTNAME_LABEL: "a"})
    gates, api = keeper([small], [], [declaring("p", "60Gi")], largest="80Gi")
    await gates.round()
    terms = api.pods["p"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["a"]
    held, held_api = keeper([small], [], [declaring("p", "60Gi")])
    await held.round()
    assert held_api.pods["p"]["spec"]["schedulingGates"] == [{"name": GATE}]


async def test_karpenter_mode_labels_the_nodes_it_excludes_by_its_own_label() -> None:
    (a, on_a) = full_h100("a")
    gates, api = keeper([a], on_a, [gated(vllm_pod("fourth", "0.30"))], autoscaler="karpenter")
    await gates.round()
    assert api.patches[0] == ("/api/v1/nodes/a", {"metadata": {"labels": {"vramguard.io/node": "a"}}})
    terms = api.pods["fourth"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"] == [
        {"key": "vramguard.io/node", "operator": "NotIn", "values": ["a"]}]


async def test_a_pod_is_held_while_a_node_it_must_exclude_cannot_be_labelled() -> None:
    (a, on_a) = full_h100("a")
    gates, api = keeper([a], on_a, [gated(vllm_pod("fourth", "0.30"))], autoscaler="karpenter")
    api.refuse_node_patch = True
    await gates.round()
    assert api.pods["fourth"]["spec"]["schedulingGates"] == [{"name": GATE}]
    assert "no vramguard.io/node label" in api.events[0]["message"]
    api.refuse_node_patch = False
    gates._held["uid-fourth"] -= 3600
    await gates.round()
    assert not api.pods["fourth"]["spec"].get("schedulingGates")


async def test_gated_pods_are_released_unchanged_when_scale_up_is_turned_off() -> None:
    (a, on_a) = full_h100("a")
    gates, api = keeper([a], on_a, [gated(vllm_pod("fourth", "0.30"))], autoscaler="none")
    await gates.round()
    assert not api.pods["fourth"]["spec"].get("schedulingGates") and "affinity" not in api.pods["fourth"]["spec"]


async def test_a_released_pod_is_decided_once() -> None:
    (a, on_a) = full_h100("a")
    gates, api = keeper([a], on_a, [gated(vllm_pod("fourth", "0.30"))])
    await gates.round()
    await gates.round()  # the watch has not brought the released pod back yet: nothing to do
    gates.upsert(api.pods["fourth"])
    await gates.round()
    assert len(api.patches) == 1


REPLICA_SET = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs", "uid": "u", "controller": True}]


async def test_a_released_pod_stuck_past_the_timeout_is_evicted_when_a_controller_owns_it() -> None:
    (a, on_a) = full_h100("a")
    owned = unschedulable(vllm_pod("owned", "0.30"), NOW - timedelta(seconds=601))
    owned["metadata"]["ownerReferences"] = REPLICA_SET
    bare = unschedulable(vllm_pod("bare", "0.30"), NOW - timedelta(seconds=601))
    young = unschedulable(vllm_pod("young", "0.30"), NOW - timedelta(seconds=30))
    young["metadata"]["ownerReferences"] = REPLICA_SET
    # A stamp anyone may write: on a pod another scheduler places, it evicts nothing.
    forged = unschedulable(vllm_pod("forged", "0.30"), NOW - timedelta(seconds=601))
    forged["metadata"]["ownerReferences"] = REPLICA_SET
    forged["spec"]["schedulerName"] = "default-scheduler"
    # A Job counts a deleted pod as failed: its pods are warned about, never evicted.
    job = unschedulable(vllm_pod("job", "0.30"), NOW - timedelta(seconds=601))
    job["metadata"]["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": "j", "uid": "j",
                                           "controller": True}]
    gates, api = keeper([a], on_a, [owned, bare, young, forged, job])
    await gates.round()
    await gates.round()
    assert api.evictions == ["owned"]
    assert sorted(e["reason"] for e in api.events) == ["VRAMScaleUpRetry", "VRAMScaleUpStuck", "VRAMScaleUpStuck"]


async def test_each_further_stuck_pod_of_an_owner_waits_twice_as_long() -> None:
    # An autoscaler that cannot add a node (its group at its maximum): the ReplicaSet's next pod is
    # not evicted at the same timeout, so the owner is not churned every five minutes.
    (a, on_a) = full_h100("a")
    first = unschedulable(vllm_pod("first", "0.30"), NOW - timedelta(seconds=301))
    first["metadata"]["ownerReferences"] = REPLICA_SET
    gates, api = keeper([a], on_a, [first])
    await gates.round()
    assert api.evictions == ["first"]
    second = unschedulable(vllm_pod("second", "0.30"), NOW - timedelta(seconds=301))
    second["metadata"]["ownerReferences"] = REPLICA_SET
    api.pods["second"] = second
    gates.upsert(second)
    await gates.round()
    assert api.evictions == ["first"]
    gates.wall_clock = lambda: NOW + timedelta(seconds=300)  # 601 s after its release: past 2 x 300 s
    await gates.round()
    assert api.evictions == ["first", "second"]


def test_a_release_stamp_older_than_the_pod_was_copied_not_written_on_it() -> None:
    pod = unschedulable(vllm_pod("p", "0.30"), NOW - timedelta(seconds=3600))
    pod["metadata"]["creationTimestamp"] = (NOW - timedelta(seconds=60)).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert not overdue(pod, NOW, 300)
    pod["metadata"]["creationTimestamp"] = (NOW - timedelta(seconds=3630)).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert overdue(pod, NOW, 300)  # released 30 s after its creation


async def test_a_pod_is_decided_only_once_its_other_gates_are_gone() -> None:
    (a, on_a) = full_h100("a")
    queued = gated(vllm_pod("queued", "0.30"))
    queued["spec"]["schedulingGates"].insert(0, {"name": "kueue.x-k8s.io/admission"})
    gates, api = keeper([a], on_a, [queued])
    await gates.round()
    assert api.patches == [] and api.events == []
    admitted = copy.deepcopy(queued)
    admitted["spec"]["schedulingGates"] = [{"name": GATE}]
    api.pods["queued"] = admitted
    gates.upsert(admitted)
    await gates.round()
    assert not api.pods["queued"]["spec"].get("schedulingGates") and "affinity" in api.pods["queued"]["spec"]


async def test_replicas_decided_one_by_one_count_the_room_the_earlier_ones_take() -> None:
    # As a ReplicaSet creates them: one pod a pass. Node b has room for two of the four.
    (a, on_a), b = full_h100("a"), gpu_node("b", labels={HOSTNAME_LABEL: "b"})
    gates, api = keeper([a, b], [*on_a, vllm_pod("b-0", "0.30", node="b")], [])
    for i in range(4):
        replica = gated(vllm_pod(f"r{i}", "0.30"))
        api.pods[replica["metadata"]["name"]] = replica
        gates.upsert(replica)
        await gates.round()
        gates.upsert(api.pods[f"r{i}"])  # the watch brings it back released
    narrowed = sorted(name for name, pod in api.pods.items() if "affinity" in pod["spec"])
    assert narrowed == ["r2", "r3"]
    # r0 binds on b: the ledger counts it, the keeper forgets its own count; r1 leaves the watch too.
    gates.state.pods.upsert(vllm_pod("r0", "0.30", node="b"))
    gates.delete(api.pods["r0"])
    gates.state.pods.upsert(vllm_pod("r1", "0.30", node="b"))
    gates.delete(api.pods["r1"])
    assert gates._released == {}


async def test_the_new_node_check_uses_only_the_pools_the_pod_selects() -> None:
    # 40 GiB pool "small" and an 80 GiB pool "big": a 60 GiB pod selecting "small" is held (a new
    # small node would not hold it either), not narrowed toward a node the autoscaler adds in vain.
    small = gpu_node("a", memory_mib=40960, product="NVIDIA-A100-SXM4-40GB",
                     labels={HOSTNAME_LABEL: "a", "pool": "small"})
    big = gpu_node("b", labels={HOSTNAME_LABEL: "b", "pool": "big"})
    busy = declaring("busy", "60Gi")
    del busy["spec"]["schedulingGates"]
    busy["spec"]["nodeName"] = "b"
    pod = declaring("p", "60Gi")
    pod["spec"]["nodeSelector"] = {"pool": "small"}
    gates, api = keeper([small, big], [busy], [pod])
    await gates.round()
    assert api.pods["p"]["spec"]["schedulingGates"] == [{"name": GATE}]
    assert "40.0 GiB" in api.events[0]["message"]
    # Selecting a pool with no node at all (scaled to zero), no largest GPU given: the autoscaler decides.
    pod = declaring("q", "60Gi")
    pod["spec"]["nodeSelector"] = {"pool": "zero"}
    gates, api = keeper([small, big], [busy], [pod])
    await gates.round()
    assert not api.pods["q"]["spec"].get("schedulingGates") and "affinity" not in api.pods["q"]["spec"]


@pytest.mark.parametrize("pin", ["fields", "hostname"])
async def test_a_pod_pinned_to_a_full_node_is_released_as_it_is(pin: str) -> None:
    # No new node could match its selection: narrowing would leave it no node at all.
    (a, on_a) = full_h100("a")
    pinned = gated(vllm_pod("pinned", "0.30"))
    if pin == "fields":
        pinned["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["a"]}]}]}}}
    else:
        pinned["spec"]["nodeSelector"] = {HOSTNAME_LABEL: "a"}
    before = copy.deepcopy(pinned["spec"].get("affinity"))
    gates, api = keeper([a], on_a, [pinned])
    await gates.round()
    assert not api.pods["pinned"]["spec"].get("schedulingGates")
    assert api.pods["pinned"]["spec"].get("affinity") == before


async def test_no_decision_while_a_node_the_pod_may_use_is_being_re_read() -> None:
    (a, on_a), b = full_h100("a"), gpu_node("b", labels={HOSTNAME_LABEL: "b"})
    gates, api = keeper([a, b], on_a, [gated(vllm_pod("fourth", "0.30"))])
    gates.state.suspects.add("b")  # its pods unknown for a moment: it must not be excluded for good
    await gates.round()
    assert api.patches == []
    gates.state.suspects.clear()
    await gates.round()
    assert not api.pods["fourth"]["spec"].get("schedulingGates") and "affinity" not in api.pods["fourth"]["spec"]


async def test_a_gated_pod_of_a_scheduler_without_the_extender_is_released_as_it_is() -> None:
    (a, on_a) = full_h100("a")
    other = gated(vllm_pod("other", "0.30"))
    other["spec"]["schedulerName"] = "default-scheduler"
    gates, api = keeper([a], on_a, [other])
    await gates.round()
    assert not api.pods["other"]["spec"].get("schedulingGates") and "affinity" not in api.pods["other"]["spec"]


async def test_a_refused_patch_backs_off_and_is_reported_once() -> None:
    (a, on_a) = full_h100("a")
    gates, api = keeper([a], on_a, [gated(vllm_pod("fourth", "0.30"))])
    now = [1000.0]
    gates.clock = lambda: now[0]
    api.refuse_pod_patch = True
    for _ in range(8):
        await gates.round()
        now[0] += 0.5
    # 1000 (fail), 1001 (fail), 1003 (fail: warned): three tries in eight rounds.
    assert len(api.patches) == 3
    assert [(e["reason"], e["type"]) for e in api.events] == [("VRAMScaleUpFailed", "Warning")]
    assert "403" in api.events[0]["message"] or "forbidden" in api.events[0]["message"]


async def test_a_failure_deciding_one_pod_does_not_stop_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    (a, on_a), b = full_h100("a"), gpu_node("b", labels={HOSTNAME_LABEL: "b"})
    gates, api = keeper([a, b], on_a, [gated(vllm_pod("bad", "0.30")), gated(vllm_pod("good", "0.30"))])
    real = gates.verbs.filter

    async def filter_failing_for_bad(pod: dict[str, Any], nodes: list[str]) -> Any:
        if pod["metadata"]["name"] == "bad":
            raise RuntimeError("boom")
        return await real(pod, nodes)

    monkeypatch.setattr(gates.verbs, "filter", filter_failing_for_bad)
    await gates.round()
    assert not api.pods["good"]["spec"].get("schedulingGates")
    assert api.pods["bad"]["spec"]["schedulingGates"] == [{"name": GATE}]
    assert "uid-bad" in gates._failures


async def test_a_node_label_set_by_someone_else_is_replaced_before_it_excludes() -> None:
    # A NodePool giving every node vramguard.io/node=gpu would exclude the new nodes too.
    (a, on_a) = full_h100("a")
    a["metadata"]["labels"]["vramguard.io/node"] = "gpu"
    gates, api = keeper([a], on_a, [gated(vllm_pod("fourth", "0.30"))], autoscaler="karpenter")
    await gates.round()
    assert api.patches[0] == ("/api/v1/nodes/a", {"metadata": {"labels": {"vramguard.io/node": "a"}}})
    terms = api.pods["fourth"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["a"]


def test_a_pod_that_would_exclude_too_many_nodes_is_held() -> None:
    refused = {f"n{i}": f"n{i}" for i in range(MAX_EXCLUDED + 1)}
    decision = decide([], refused, True, "80 GiB", HOSTNAME_LABEL)
    assert isinstance(decision, Hold) and "node pool" in decision.reason
    assert decide([], dict(list(refused.items())[:MAX_EXCLUDED]), True, "80 GiB", HOSTNAME_LABEL) == Release(
        tuple(sorted(list(refused)[:MAX_EXCLUDED])))


def test_a_release_creating_the_annotations_tests_the_version_read() -> None:
    pod = gated(vllm_pod("p", "0.30"))
    operations = release_patch(pod, 0, HOSTNAME_LABEL, (), NOW)
    assert operations[0] == {"op": "test", "path": "/metadata/resourceVersion", "value": "1"}
    changed = copy.deepcopy(pod)
    changed["metadata"]["resourceVersion"] = "2"
    changed["metadata"]["annotations"] = {"example.com/owner": "team"}
    with pytest.raises(ValueError, match="test failed"):
        apply_patch(changed, operations)


def test_the_store_keeps_only_gated_and_released_pods() -> None:
    gates, _ = keeper([], [], [])
    gates.upsert(vllm_pod("plain", "0.30"))
    gates.upsert(gated(vllm_pod("gated", "0.30")))
    deleting = gated(vllm_pod("deleting", "0.30"))
    deleting["metadata"]["deletionTimestamp"] = "2026-12-07T12:00:00Z"
    gates.upsert(deleting)
    assert sorted(gates.pods) == ["uid-gated"]
    gates.delete(gated(vllm_pod("gated", "0.30")))
    assert gates.pods == {}
