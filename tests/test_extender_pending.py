"""GPU pods the filter found no node for are counted by why, until a node passes, they are bound,
or they are forgotten (the series behind the alert on GPU pods Pending on VRAM)."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest

from extender.app import build_app
from extender.pending import FORGET_SECONDS, PendingPods
from tests.builders import gpu_node, vllm_pod
from tests.served_extender import served
from tests.test_extender import make
from vramguard.io.http import Readiness

SHORT = "GPU (NVIDIA H100 80GB HBM3): VRAM budget free below the pod's 71.7 GiB per GPU"


def test_counted_by_reason_until_a_node_passes_or_the_pod_is_bound() -> None:
    clock = [0.0]
    pending = PendingPods(timer=lambda: clock[0])
    pending.filtered("a", [], {"n1": SHORT}, {"n2": "node offers no nvidia.com/gpu (it has nvidia.com/mig-1g.10gb)"})
    pending.filtered("b", [], {"n1": "node n1 is not known to vramguard yet"})
    pending.filtered("c", [], {}, {"n1": "container vllm: VRAM unknown and class strict does not place such pods"})
    pending.filtered("", [], {"n1": SHORT})  # no uid: not counted
    assert pending.counts() == {"vram": 2, "other": 1}
    pending.filtered("a", ["n3"], {"n1": SHORT})
    pending.bound("c")
    assert pending.counts() == {"vram": 0, "other": 1}
    clock[0] += FORGET_SECONDS + 1  # b was deleted, or scheduled elsewhere
    assert pending.counts() == {"vram": 0, "other": 0}


async def test_the_filter_endpoint_counts_a_pod_that_fits_nowhere() -> None:
    _, verbs, _ = make([gpu_node("h100")], [vllm_pod("big", "0.95", node="h100")])
    synced = asyncio.Event()
    synced.set()
    registry = CollectorRegistry()
    app = build_app(verbs, synced, Readiness(), registry)
    async with served(app) as client:
        response = await client.post("/filter", json={"Pod": vllm_pod("new", "0.5"), "NodeNames": ["h100"]})
        body = await response.json()
        assert response.status == 200 and not body["NodeNames"], body
    text = generate_latest(registry).decode()
    assert 'vramguard_extender_unschedulable_pods{reason="vram"} 1.0' in text
    assert 'vramguard_extender_unschedulable_pods{reason="other"} 0.0' in text
