"""The evictor: preemption for VRAM where kube-scheduler's dry run needs no victim (a time-sliced GPU
with replicas left), through the Eviction API, after the scheduler had its chance."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from extender.app import build_app
from extender.evictor import GRACE_SECONDS, Evictor
from extender.verbs import Verbs
from tests.builders import gpu_node
from tests.served_extender import served
from tests.test_extender import make
from tests.test_preemption import FOO, prioritized
from vramguard.cluster import ClusterState
from vramguard.io.http import Readiness
from vramguard.io.kube import ApiError

URGENT_UID = "uid-urgent"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeApi:
    """The API server as the evictor uses it: GET a pod, POST an Eviction or an Event."""

    def __init__(self, pods: dict[str, dict[str, Any]]) -> None:
        self.pods = pods
        self.evictions: list[str] = []
        self.events: list[dict[str, Any]] = []
        self.refuse: dict[str, ApiError] = {}

    async def get(self, path: str, params: Any = None) -> dict[str, Any]:
        name = path.rsplit("/", 1)[-1]
        if name not in self.pods:
            raise ApiError(404, "NotFound", name)
        return self.pods[name]

    async def create(self, path: str, body: Any) -> dict[str, Any]:
        await asyncio.sleep(0)
        if path.endswith("/eviction"):
            name = body["metadata"]["name"]
            if name in self.refuse:
                raise self.refuse[name]
            assert body["deleteOptions"]["preconditions"]["uid"] == f"uid-{name}"
            self.evictions.append(name)
        else:
            self.events.append(body)
        return {}


def replicas_left(*, budgets: bool = False) -> ClusterState:
    """One H100 time-sliced 8 ways, three replicas held by pods of priority 1 whose VRAM (0.3 each,
    with vLLM's context) leaves less than 0.5 of it: kube-scheduler sees five free replicas."""
    pods = [prioritized("low-1", "0.3", 1, labels=FOO if budgets else None), prioritized("low-2", "0.3", 1),
            prioritized("low-3", "0.35", 1)]
    state, _, _ = make([gpu_node("ts", replicas=8)], pods)
    if budgets:
        state.disruption_budgets.replace([{
            "metadata": {"name": "protect", "namespace": "default"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": FOO}}, "status": {"disruptionsAllowed": 0}}])
    return state


def urgent(utilization: str = "0.5", priority: int = 1000, **spec: Any) -> dict[str, Any]:
    pod = prioritized("urgent", utilization, priority, node=None)
    pod["spec"].update(spec)
    return pod


async def refused_and_due(state: ClusterState, pod: dict[str, Any], api: FakeApi, clock: Clock,
                          evictor: Evictor) -> int:
    """Filter the pod as the scheduler would, let the grace pass, run the evictor once."""
    outcome = await Verbs(state, None).filter(pod, ["ts"])
    evictor.refused(pod, outcome.passing, outcome.failed)
    api.pods.setdefault("urgent", pod)
    clock.now += GRACE_SECONDS
    return await evictor.run_once()


def evictor_for(state: ClusterState, api: FakeApi, clock: Clock, **kwargs: Any) -> Evictor:
    return Evictor(state, api, CollectorRegistry(), clock=clock, **kwargs)  # type: ignore[arg-type]


async def test_the_larger_victims_are_evicted_and_told_why() -> None:
    state, api, clock = replicas_left(), FakeApi({}), Clock()
    evictor = evictor_for(state, api, clock)
    assert await refused_and_due(state, urgent(), api, clock, evictor) == 2
    # Equal priorities: the largest holders go first, as the preempt verb chooses.
    assert "low-3" in api.evictions and len(api.evictions) == 2
    assert [e["reason"] for e in api.events] == ["Preempted", "Preempted"]
    assert "Preempted by pod default/urgent on node ts" in api.events[0]["message"]
    assert {e["involvedObject"]["name"] for e in api.events} == set(api.evictions)


async def test_nothing_is_evicted_before_the_grace_or_when_the_scheduler_preempts() -> None:
    state, api, clock = replicas_left(), FakeApi({}), Clock()
    evictor = evictor_for(state, api, clock)
    pod = urgent()
    outcome = await Verbs(state, None).filter(pod, ["ts"])
    evictor.refused(pod, outcome.passing, outcome.failed)
    api.pods["urgent"] = pod
    clock.now += GRACE_SECONDS / 2
    assert await evictor.run_once() == 0 and evictor.waiting() == 1
    evictor.preempting(pod)  # kube-scheduler's /preempt accepted a node for it
    clock.now += GRACE_SECONDS
    assert await evictor.run_once() == 0 and api.evictions == []


@pytest.mark.parametrize("pod_change", [
    {"spec": {"nodeName": "ts"}}, {"status": {"nominatedNodeName": "ts"}},
    {"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}, {"metadata": {"uid": "uid-other"}},
    {"spec": {"preemptionPolicy": "Never"}}, None,
], ids=["bound", "nominated", "deleted", "replaced", "never-preempts", "gone"])
async def test_a_pod_no_longer_waiting_evicts_nobody(pod_change: dict[str, Any] | None) -> None:
    state, api, clock = replicas_left(), FakeApi({}), Clock()
    evictor = evictor_for(state, api, clock)
    pod = urgent()
    if pod_change is not None:  # else the API server has no such pod any more
        api.pods["urgent"] = {key: {**value, **pod_change.get(key, {})} for key, value in pod.items()}
    outcome = await Verbs(state, None).filter(pod, ["ts"])
    evictor.refused(pod, outcome.passing, outcome.failed)
    clock.now += GRACE_SECONDS
    assert await evictor.run_once() == 0 and api.evictions == []


async def test_a_pod_that_may_not_preempt_or_of_equal_priority_is_not_remembered() -> None:
    state, api, clock = replicas_left(), FakeApi({}), Clock()
    evictor = evictor_for(state, api, clock)
    assert await refused_and_due(state, urgent(preemptionPolicy="Never"), api, clock, evictor) == 0
    assert await refused_and_due(state, urgent(priority=1), api, clock, evictor) == 0
    assert api.evictions == [] and evictor.waiting() == 0


async def test_a_standby_replica_evicts_nobody() -> None:
    state, api, clock = replicas_left(), FakeApi({}), Clock()
    evictor = evictor_for(state, api, clock, serving=lambda: False)
    assert await refused_and_due(state, urgent(), api, clock, evictor) == 0 and api.evictions == []


async def test_pods_already_leaving_count_as_gone_so_a_second_refusal_evicts_nobody_else() -> None:
    state, api, clock = replicas_left(), FakeApi({}), Clock()
    evictor = evictor_for(state, api, clock)
    assert await refused_and_due(state, urgent(), api, clock, evictor) == 2
    # The victims terminate (still bound, still holding): the pod is refused again meanwhile.
    assert await refused_and_due(state, urgent(), api, clock, evictor) == 0
    assert len(api.evictions) == 2


async def test_a_node_whose_victims_a_budget_protects_is_not_used() -> None:
    state, api, clock = replicas_left(budgets=True), FakeApi({}), Clock()
    evictor = evictor_for(state, api, clock)
    # 0.3 + 0.35 of the unprotected ones make the room for 0.3: the protected pod stays.
    assert await refused_and_due(state, urgent("0.3"), api, clock, evictor) == 1
    assert api.evictions == ["low-3"]
    # For 0.7 the protected pod would have to go too (0.3 + 0.7 is over the 0.97 budget): nobody is evicted.
    state, api = replicas_left(budgets=True), FakeApi({})
    evictor = evictor_for(state, api, clock)
    assert await refused_and_due(state, urgent("0.7"), api, clock, evictor) == 0 and api.evictions == []


async def test_an_eviction_the_api_server_refuses_stops_the_round() -> None:
    state, api, clock = replicas_left(), FakeApi({}), Clock()
    api.refuse = {name: ApiError(429, "TooManyRequests", "Cannot evict pod as it would violate the pod's "
                                 "disruption budget.") for name in ("low-1", "low-2", "low-3")}
    registry = CollectorRegistry()
    evictor = Evictor(state, api, registry, clock=clock)  # type: ignore[arg-type]
    assert await refused_and_due(state, urgent(), api, clock, evictor) == 0
    assert api.evictions == [] and api.events == []
    assert registry.get_sample_value("vramguard_extender_vram_evictions_total", {"outcome": "budget"}) == 1


async def test_a_failing_round_is_logged_and_the_loop_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    state, api, clock = replicas_left(), FakeApi({}), Clock()
    evictor = evictor_for(state, api, clock)
    rounds = 0

    async def broken() -> int:
        nonlocal rounds
        rounds += 1
        if rounds >= 3:
            raise asyncio.CancelledError
        raise RuntimeError("boom")

    monkeypatch.setattr(evictor, "run_once", broken)
    monkeypatch.setattr("extender.evictor.PERIOD_SECONDS", 0)
    with pytest.raises(asyncio.CancelledError):
        await evictor.run()
    assert rounds == 3


async def test_the_app_tells_the_evictor_of_refusals_and_of_the_schedulers_preemption() -> None:
    state = replicas_left()
    synced = asyncio.Event()
    synced.set()
    evictor = Evictor(state, None, CollectorRegistry())
    app = build_app(Verbs(state, None), synced, Readiness(), CollectorRegistry(), evictor=evictor)
    pod = urgent()
    async with served(app) as client:
        response = await client.post("/filter", json={"Pod": pod, "NodeNames": ["ts"]})
        assert (await response.json())["FailedNodes"] and evictor.waiting() == 1
        victims = {"ts": {"Pods": [{"metadata": {"uid": "uid-low-1"}}], "NumPDBViolations": 0}}
        response = await client.post("/preempt", json={"Pod": pod, "NodeNameToVictims": victims})
        assert response.status == 200 and evictor.waiting() == 0
