"""The webhook's watch-fed stores: namespaces, GPU nodes and the namespaces' live GPU pods."""

from __future__ import annotations

from typing import Any

from tests.builders import gpu_node
from tests.podspecs import container, pod
from vramguard.admission import NamespaceUsage, quota_claims
from vramguard.demand import DEFAULT_OPTIONS, derive_pod_demand
from webhook.state import PENDING_TTL, NamespaceStore, NodeStore, PodStore

GiB = 1 << 30


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def node(name: str, memory_mib: int, *, replicas: int = 4, sharing: str = "time-slicing",
         labels: dict[str, str] | None = None) -> dict[str, Any]:
    return gpu_node(name, 1, replicas, memory_mib, sharing=sharing, labels=labels)


def gpu_pod(uid: str, *, namespace: str = "team-a", vram: str = "0.5", node_name: str = "",
            phase: str | None = None) -> dict[str, Any]:
    obj = pod(container("train"), annotations={"vramguard.io/vram": vram})
    obj["metadata"].update(uid=uid, name=uid, namespace=namespace)
    if node_name:
        obj["spec"]["nodeName"] = node_name
    if phase:
        obj["status"] = {"phase": phase}
    return obj


def stores(clock: Clock | None = None) -> tuple[NodeStore, PodStore]:
    nodes = NodeStore(("nvidia.com/gpu", "nvidia.com/gpu.shared"), ("nvidia.com/mig-",))
    nodes.replace([node("small", 40 * 1024), node("big", 80 * 1024, labels={"pool": "big"})])
    return nodes, PodStore(DEFAULT_OPTIONS, nodes, clock=clock or Clock())


def test_namespace_store_follows_the_watch() -> None:
    namespaces = NamespaceStore()
    namespaces.replace([{"metadata": {"name": "a", "labels": {"x": "1", "bad": 2}}}, {"metadata": {}}])
    assert (namespaces.labels("a"), len(namespaces)) == ({"x": "1"}, 1)
    namespaces.upsert({"metadata": {"name": "b"}})
    assert namespaces.labels("b") == {}
    namespaces.delete({"metadata": {"name": "a"}})
    assert namespaces.labels("a") is None


def test_node_store_offers_the_largest_and_smallest_gpu() -> None:
    nodes, _ = stores()
    offer = nodes.offers()["nvidia.com/gpu"]
    assert (offer.smallest_bytes, offer.largest_bytes) == (40 * GiB, 80 * GiB)
    assert {"pool": "big"}.items() <= offer.node_labels[1].items()
    assert nodes.node_offers("small") is not None
    assert nodes.node_offers("small")["nvidia.com/gpu"].largest_bytes == 40 * GiB  # type: ignore[index]
    assert nodes.node_offers("nowhere") is None
    nodes.delete({"metadata": {"name": "big"}})
    assert nodes.offers()["nvidia.com/gpu"].largest_bytes == 40 * GiB
    nodes.upsert({"metadata": {"name": "cpu"}})
    assert len(nodes) == 2


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
    pods.hold("x", "team-a", claims)
    pods.hold("y", "team-a", claims, node="small")
    assert pods.usage("team-a") == NamespaceUsage(40 * GiB + 20 * GiB, 2)
    pods.upsert(gpu_pod("x", node_name="small"))  # the watch caught up with x
    assert pods.pending() == 1
    assert pods.usage("team-a") == NamespaceUsage(20 * GiB + 20 * GiB, 2)
    clock.now += PENDING_TTL + 1
    assert pods.usage("team-a") == NamespaceUsage(20 * GiB, 1)
    assert pods.pending() == 0


def test_holding_a_pod_the_watch_already_shows_changes_nothing() -> None:
    _, pods = stores()
    pods.upsert(gpu_pod("x"))
    pods.hold("x", "team-a", ())
    assert pods.pending() == 0


def test_a_deleted_pod_is_forgotten_even_while_pending() -> None:
    _, pods = stores()
    pods.hold("x", "team-a", ())
    pods.delete(gpu_pod("x"))
    assert pods.pending() == 0
    pods.upsert(gpu_pod("y"))
    pods.delete(gpu_pod("y"))
    assert pods.usage("team-a") == NamespaceUsage()


def test_unsized_pods_are_reported_not_counted() -> None:
    nodes = NodeStore(("nvidia.com/gpu",), ("nvidia.com/mig-",))
    pods = PodStore(DEFAULT_OPTIONS, nodes)
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
