"""The one cluster model, as admission reads it: namespaces, node offers, the namespaces' live GPU
pods (either feed: every live pod, or the bound ones), pending admissions, shared templates."""

from __future__ import annotations

import copy
import gc
import json
from typing import Any

import pytest

from tests.podspecs import container, pod
from vramguard.admission import NamespaceUsage, quota_claims
from vramguard.cluster import PENDING_TTL, ClusterState, PodKey, is_live, pod_template_key
from vramguard.demand import derive_pod_demand
from vramguard.ledger import PodRef
from vramguard.policy import Policy, default_policy

GiB = 1 << 30


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def node(name: str, memory_mib: int, *, replicas: int = 4, sharing: str = "time-slicing",
         labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {
            "nvidia.com/gpu.count": "1", "nvidia.com/gpu.memory": str(memory_mib),
            "nvidia.com/gpu.replicas": str(replicas), "nvidia.com/gpu.sharing-strategy": sharing,
            **(labels or {})}},
        "status": {"allocatable": {"nvidia.com/gpu": str(replicas)}},
    }


def gpu_pod(uid: str, *, namespace: str = "team-a", vram: str = "0.5", node_name: str = "",
            phase: str | None = None) -> dict[str, Any]:
    obj = pod(container("train"), annotations={"vramguard.io/vram": vram})
    obj["metadata"].update(uid=uid, name=uid, namespace=namespace)
    if node_name:
        obj["spec"]["nodeName"] = node_name
    if phase:
        obj["status"] = {"phase": phase}
    return obj


class Pods:
    """The model's pod feed with the quota's questions, named as the tests read them."""

    def __init__(self, model: ClusterState) -> None:
        self.model = model
        self.replace = model.pods.replace
        self.upsert = model.pods.upsert
        self.delete = model.pods.delete
        self.usage = model.usage
        self.hold = model.hold_admission
        self.pending = model.pending_admissions

    def __len__(self) -> int:
        return len(self.model.records)


def stores(clock: Clock | None = None, policy: Policy | None = None) -> tuple[ClusterState, Pods]:
    model = ClusterState(policy or default_policy(), monotonic=clock or Clock())
    model.nodes.replace([node("small", 40 * 1024), node("big", 80 * 1024, labels={"pool": "big"})])
    return model, Pods(model)


def test_namespace_labels_follow_the_watch() -> None:
    model = ClusterState(default_policy())
    model.namespaces.replace([{"metadata": {"name": "a", "labels": {"x": "1", "bad": 2}}}])
    assert model.namespace_labels == {"a": {"x": "1"}}
    model.namespaces.upsert({"metadata": {"name": "b"}})
    assert model.namespace_labels.get("b") == {}
    model.namespaces.delete({"metadata": {"name": "a"}})
    assert model.namespace_labels.get("a") is None
    model.upsert_namespace({"metadata": {"name": "looked-up", "labels": {"y": "2"}}})
    assert model.namespace_labels.get("looked-up") == {"y": "2"}


def test_offers_name_the_largest_and_smallest_gpu() -> None:
    nodes, _ = stores()
    offer = nodes.offers()["nvidia.com/gpu"]
    assert (offer.smallest_bytes, offer.largest_bytes) == (40 * GiB, 80 * GiB)
    assert {"pool": "big"}.items() <= offer.node_labels[1].items()
    assert nodes.node_offers("small") is not None
    assert nodes.node_offers("small")["nvidia.com/gpu"].largest_bytes == 40 * GiB  # type: ignore[index]
    assert nodes.node_offers("nowhere") is None
    nodes.nodes.delete({"metadata": {"name": "big"}})
    assert nodes.offers()["nvidia.com/gpu"].largest_bytes == 40 * GiB


def test_offers_follow_a_label_change_that_moves_no_device() -> None:
    nodes, _ = stores()
    assert {"pool": "big"}.items() <= nodes.offers()["nvidia.com/gpu"].node_labels[1].items()
    nodes.nodes.upsert(node("big", 80 * 1024, labels={"pool": "huge"}))
    assert {"pool": "huge"}.items() <= nodes.offers()["nvidia.com/gpu"].node_labels[1].items()


def test_usage_sizes_bound_pods_on_their_node_and_others_on_the_largest_gpu() -> None:
    _, pods = stores()
    pods.replace([gpu_pod("a", node_name="small"), gpu_pod("b"), gpu_pod("c", namespace="team-b")])
    assert pods.usage("team-a") == NamespaceUsage(20 * GiB + 40 * GiB, 2)
    assert pods.usage("team-a", exclude="b") == NamespaceUsage(20 * GiB, 1)
    assert pods.usage("team-c") == NamespaceUsage()


def test_finished_and_gpu_less_pods_hold_nothing() -> None:
    _, pods = stores()
    pods.replace([gpu_pod("done", phase="Succeeded"), gpu_pod("failed", phase="Failed")])
    web = pod(container("web", gpus=None))
    web["metadata"].update(uid="web", namespace="team-a")
    pods.upsert(web)
    pods.upsert({"metadata": {"name": "no-uid"}})
    assert (len(pods), pods.usage("team-a")) == (0, NamespaceUsage())
    running = gpu_pod("r")
    pods.upsert(running)
    assert len(pods) == 1
    pods.upsert(gpu_pod("r", phase="Succeeded"))  # the pod finished: its VRAM is free
    assert len(pods) == 0


def test_pending_admissions_count_until_the_watch_shows_them_or_they_expire() -> None:
    clock = Clock()
    _, pods = stores(clock)
    claims = quota_claims(derive_pod_demand(gpu_pod("x")))
    pods.hold("x", "team-a", "x", claims)
    pods.hold("y", "team-a", "y", claims, node="small")
    assert pods.usage("team-a") == NamespaceUsage(40 * GiB + 20 * GiB, 2)
    pods.upsert(gpu_pod("x", node_name="small"))  # the watch caught up with x
    assert pods.pending() == 1
    assert pods.usage("team-a") == NamespaceUsage(20 * GiB + 20 * GiB, 2)
    clock.now += PENDING_TTL + 1
    assert pods.usage("team-a") == NamespaceUsage(20 * GiB, 1)
    assert pods.pending() == 0


def test_pending_admissions_are_settled_by_what_the_api_server_shows() -> None:
    clock = Clock()
    model, pods = stores(clock)
    claims = quota_claims(derive_pod_demand(gpu_pod("x")))
    for uid in ("real", "forged", "renamed", "cpu-only", "self"):
        pods.hold(uid, "team-a", uid, claims)
    pods.hold("elsewhere", "team-b", "elsewhere", claims)
    clock.now += 2
    assert {(h.uid, h.age) for h in model.unconfirmed_holds("team-a", exclude="self")} == {
        (uid, 2.0) for uid in ("real", "forged", "renamed", "cpu-only")}
    cpu_only = gpu_pod("cpu-only")
    cpu_only["spec"]["containers"][0]["resources"] = {}
    answers = {"real": gpu_pod("real"), "forged": None, "renamed": gpu_pod("another-uid"), "cpu-only": cpu_only}
    dropped = {uid for uid, pod in answers.items() if model.settle_hold(uid, pod)}
    assert dropped == {"forged", "renamed", "cpu-only"}
    # The real one still counts, and is not asked about again.
    assert [h.uid for h in model.unconfirmed_holds("team-a", exclude="self")] == []
    assert pods.usage("team-a", exclude="self") == NamespaceUsage(40 * GiB, 1)
    assert model.settle_hold("gone", None) is False


def test_holding_a_pod_the_watch_already_shows_changes_nothing() -> None:
    _, pods = stores()
    pods.upsert(gpu_pod("x"))
    pods.hold("x", "team-a", "x", ())
    assert pods.pending() == 0


def test_a_deleted_pod_is_forgotten_even_while_pending() -> None:
    _, pods = stores()
    pods.hold("x", "team-a", "x", ())
    pods.delete(gpu_pod("x"))
    assert pods.pending() == 0
    pods.upsert(gpu_pod("y"))
    pods.delete(gpu_pod("y"))
    assert pods.usage("team-a") == NamespaceUsage()


def test_unsized_pods_are_reported_not_counted() -> None:
    pods = Pods(ClusterState(default_policy()))
    pods.upsert(gpu_pod("frac"))
    pods.upsert(gpu_pod("bytes", vram="10Gi"))
    usage = pods.usage("team-a")
    assert (usage.bytes, usage.pods, usage.unsized) == (10 * GiB, 2, ("frac",))


def test_relist_replaces_everything() -> None:
    _, pods = stores()
    pods.replace([gpu_pod("a"), gpu_pod("b")])
    pods.replace([gpu_pod("c", namespace="team-b")])
    assert (pods.usage("team-a"), len(pods)) == (NamespaceUsage(), 1)


def test_a_pod_asking_for_absurdly_many_gpus_is_read_cheaply() -> None:
    _, pods = stores()
    huge = gpu_pod("huge", vram="1Gi")
    huge["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "1e21"
    huge["spec"]["containers"][0]["env"] = [{"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=16G"}]
    pods.upsert(huge)
    assert pods.usage("team-a").bytes <= 1024 * GiB


@pytest.mark.parametrize(
    ("phase", "live"),
    [
        pytest.param(None, True, id="no-status"),
        pytest.param("Pending", True, id="pending"),
        pytest.param("Running", True, id="running"),
        pytest.param("Unknown", True, id="unknown"),
        pytest.param("Succeeded", False, id="succeeded"),
        pytest.param("Failed", False, id="failed"),
    ],
)
def test_one_terminal_phase_rule_for_both_feeds(phase: str | None, live: bool) -> None:
    obj = gpu_pod("p", node_name="small", phase=phase)
    assert is_live(obj) is live
    model, pods = stores()
    pods.upsert(obj)
    # The quota's records and the ledger agree, whichever feed delivered the pod.
    assert (len(pods) == 1, model.ledger.holding("p") is not None) == (live, live)


def test_either_feed_fills_the_same_ledger() -> None:
    everything, pods = stores()
    pods.replace([gpu_pod("bound", node_name="small"), gpu_pod("unbound")])
    bound_only, _ = stores()
    bound_only.pods.replace([gpu_pod("bound", node_name="small")])
    assert everything.ledger.holding("bound") == bound_only.ledger.holding("bound")
    assert everything.ledger.holding("unbound") is None
    assert everything.ledger.pod_count() == bound_only.ledger.pod_count() == 1
    assert everything.usage("team-a") == NamespaceUsage(20 * GiB + 40 * GiB, 2)


def test_replicas_share_one_template_and_it_goes_with_the_last_of_them() -> None:
    model, pods = stores()
    replicas = [gpu_pod(f"r{i}") for i in range(50)]
    for replica in replicas:  # an unslimmed feed: the model keeps no more than a slim one
        replica["spec"]["containers"][0]["volumeMounts"] = [{"name": "cache", "mountPath": "/cache"}]
    pods.replace(replicas)
    templates = {id(record.template) for record in model.records.values()}
    assert len(templates) == 1
    (template,) = {record.template for record in model.records.values()}
    assert set(template.pod["spec"]) == {"containers"}  # only what demand reads
    assert set(template.pod["metadata"]) == {"annotations"}
    assert set(template.pod["spec"]["containers"][0]) <= {"name", "image", "command", "args", "env", "resources"}
    pods.replace([])
    del template
    gc.collect()
    assert len(model._templates) == 0


def test_a_policy_change_re_derives_the_quota_per_template() -> None:
    clock = Clock()
    model, pods = stores(clock)
    jax = pod(container("jax", env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.01"}))
    jax["metadata"].update(uid="j", name="j", namespace="team-a")
    pods.upsert(jax)
    before = model.usage("team-a").bytes
    model.set_policy(default_policy().model_copy(update={"gpu_resources": ["example.com/gpu"]}))
    # The pod's resource is no GPU under the new policy: its template's claims are derived again.
    assert model.usage("team-a").bytes != before


def test_the_all_pods_feed_showing_a_pod_unbound_keeps_its_bind_in_flight() -> None:
    model, pods = stores()
    unbound = gpu_pod("x")
    claims = model.claims_for(unbound, model.choose_class(unbound))
    model.ledger.hold("small", PodRef("x", "team-a", "x"), claims.claims)
    model.begin_bind("small", PodKey("x", "team-a", "x"), claims)
    pods.upsert(unbound)  # the webhook's feed sees the pod before the Binding
    assert model.ledger.holding("x") is not None and model.is_bound("x") is None
    pods.upsert(gpu_pod("x", node_name="small"))
    assert model.is_bound("x") == "small" and "x" not in model.in_flight
    pods.delete(gpu_pod("x", node_name="small"))
    assert model.ledger.holding("x") is None and model.is_bound("x") is None


def test_a_pod_list_read_page_by_page_changes_the_quota_only_when_complete() -> None:
    model, pods = stores()
    pods.replace([gpu_pod("old", node_name="small")])
    claims = quota_claims(derive_pod_demand(gpu_pod("admitted")))
    pods.hold("admitted", "team-a", "admitted", claims, node="small")
    before = pods.usage("team-a")
    assert before == NamespaceUsage(20 * GiB + 20 * GiB, 2)
    relist = model.pods.begin_replace()
    relist.add([gpu_pod("admitted", node_name="small")])
    relist.add([gpu_pod("new", namespace="team-b", node_name="big")])
    # Two pages in, nothing shows: the old pod still counts, the admission is still pending.
    assert pods.usage("team-a") == before
    assert pods.pending() == 1
    assert set(model.records) == {"old"} and model.ledger.holding("new") is None
    relist.commit()
    assert set(model.records) == {"admitted", "new"}
    assert pods.pending() == 0, "the list showed the admitted pod"
    assert pods.usage("team-a") == NamespaceUsage(20 * GiB, 1)
    assert model.ledger.holding("old") is None and model.ledger.holding("new") is not None


def test_a_relist_keeps_the_records_of_unchanged_pods() -> None:
    # While a re-list is built the old state serves; sharing unchanged records (and the ledger's pod
    # references) keeps the two from doubling the memory of every pod.
    model, pods = stores()
    pods.replace([gpu_pod("same", node_name="small"), gpu_pod("moved", node_name="small")])
    same, moved = model.records["same"], model.records["moved"]
    ref = model.ledger.holding("same")[0]  # type: ignore[index]
    pods.replace([gpu_pod("same", node_name="small"), gpu_pod("moved", node_name="big")])
    assert model.records["same"] is same
    assert model.ledger.holding("same")[0] is ref  # type: ignore[index]
    assert model.records["moved"] is not moved and model.records["moved"].node == "big"


def test_pods_share_one_copy_of_their_node_and_namespace_names() -> None:
    # Each decoded object brings its own copies of the names; tens of thousands of records keep one.
    model, pods = stores()
    page = json.loads(json.dumps([gpu_pod("a", node_name="small"), gpu_pod("b", node_name="small")]))
    assert page[0]["spec"]["nodeName"] is not page[1]["spec"]["nodeName"]
    relist = model.pods.begin_replace()
    relist.add(page)
    relist.commit()
    a, b = model.records["a"], model.records["b"]
    assert a.node is b.node and a.namespace is b.namespace
    pods.upsert(json.loads(json.dumps(gpu_pod("c", node_name="small"))))
    assert model.records["c"].node is a.node
    assert model.ledger.holding("c")[0].namespace is a.namespace  # type: ignore[index]


def test_a_relist_rebuilds_nothing_for_the_pods_it_finds_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    model, pods = stores()
    pods.replace([gpu_pod("same", node_name="small"), gpu_pod("moved", node_name="small"),
                  gpu_pod("gone", node_name="big")])
    held: list[str] = []
    hold = model.ledger._hold

    def spy(node: str, pod: PodRef, claims: Any) -> None:
        held.append(pod.uid)
        hold(node, pod, claims)

    monkeypatch.setattr(model.ledger, "_hold", spy)
    pods.replace([gpu_pod("same", node_name="small"), gpu_pod("moved", node_name="big"),
                  gpu_pod("new", node_name="big")])
    assert sorted(held) == ["moved", "new"], "the unchanged pod keeps its holding"
    assert {uid: model.is_bound(uid) for uid in ("same", "moved", "gone", "new")} == {
        "same": "small", "moved": "big", "gone": None, "new": "big"}
    assert model.ledger.holding("gone") is None
    assert pods.usage("team-a") == NamespaceUsage(20 * GiB + 40 * GiB + 40 * GiB, 3)


def test_nodes_share_one_copy_of_their_label_keys_and_values() -> None:
    model = ClusterState(default_policy())
    # Decoded apart, as two pages or two watch events are.
    listed = [json.loads(json.dumps(node(name, 40 * 1024))) for name in ("a", "b")]
    model.nodes.replace(listed)
    a, b = model.node_selection("a"), model.node_selection("b")
    assert a is not None and b is not None and a.labels == listed[0]["metadata"]["labels"]
    key = "nvidia.com/gpu.memory"
    (key_a, value_a), (key_b, value_b) = ((k, v) for s in (a, b) for k, v in s.labels.items() if k == key)
    assert value_a == "40960"
    assert key_a is key_b and value_a is value_b


def test_template_key_tells_demands_apart_and_survives_what_orjson_cannot_encode() -> None:
    pod = gpu_pod("a")
    same = copy.deepcopy(pod)
    same["metadata"]["name"] = "b"
    same["metadata"]["labels"] = {"app": "other"}  # not part of the demand
    assert pod_template_key(pod) == pod_template_key(same)
    changed = copy.deepcopy(pod)
    changed["spec"]["containers"][0]["args"] = ["--gpu-memory-utilization", "0.5"]
    assert pod_template_key(changed) != pod_template_key(pod)
    annotated = copy.deepcopy(pod)
    annotated["metadata"]["annotations"]["vramguard.io/vram"] = "20Gi"
    assert pod_template_key(annotated) != pod_template_key(pod)
    # Never in an object from the API server, but from a file: the standard library's encoding.
    odd = copy.deepcopy(pod)
    odd["spec"]["containers"][0]["resources"] = {"limits": {1: 2**70}}
    assert pod_template_key(odd) != pod_template_key(pod)
    assert pod_template_key(odd) == pod_template_key(copy.deepcopy(odd))
