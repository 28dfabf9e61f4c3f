"""The extender's learning rounds (:mod:`extender.learning`): the leader learns and keeps the table in
a ConfigMap, a restarted or standby replica applies it, junk and conflicts lose nothing, Events and
gauges report each change."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from extender.learning import CHANGED_REASON, CONFIGMAP, DATA_KEY, OUTLIER_REASON, Learner
from tests.builders import gpu_node
from tests.test_learning import CONTEXT, H100, KEY, certain, pod
from tests.test_model_accuracy import NOW, cluster, reported
from tests.test_quota_holds import FakeApi
from vramguard.cluster import ClusterState
from vramguard.io.kube import ApiError
from vramguard.learning import LearnedTable
from vramguard.quantity import GiB

PATH = f"/api/v1/namespaces/vramguard-system/configmaps/{CONFIGMAP}"


class Api(FakeApi):
    """ConfigMaps with resourceVersions, and the Events posted."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict[str, Any]] = []

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("kind") == "Event":
            self.events.append(body)
            return body
        return await super().create(path, body)


def measured_state(beyond: int, namespaces: tuple[str, ...] = ("default", "default")) -> ClusterState:
    nodes, pods = [], []
    for i, namespace in enumerate(namespaces):
        nodes.append(reported(gpu_node(f"n{i}"), {f"uid-p{i}": {"0": certain() + beyond}}))
        pods.append(pod(f"p{i}", namespace=namespace, node=f"n{i}"))
    return cluster(nodes, pods)


def learner(state: ClusterState, api: Api, serving: bool = True) -> Learner:
    return Learner(state, api, "vramguard-system", CollectorRegistry(), serving=lambda: serving,  # type: ignore[arg-type]
                   clock=lambda: NOW)


async def test_the_leader_learns_writes_the_table_and_a_restart_applies_it_before_serving() -> None:
    api, state = Api(), measured_state(6 * GiB)
    leader = learner(state, api)
    changes = [c for _ in range(6) for c in await leader.round()]
    assert [(c.before, c.after) for c in changes] == [(None, 2 * GiB), (2 * GiB, 3 * GiB), (3 * GiB, 4 * GiB),
                                                      (4 * GiB, 5 * GiB), (5 * GiB, 6 * GiB)], "1 GiB a round"
    assert state.learned[KEY].bytes == 6 * GiB
    stored = api.objects[PATH]
    assert LearnedTable.from_json(stored["data"][DATA_KEY]).evidence(KEY) == (2, 1)
    assert stored["metadata"]["labels"]["app.kubernetes.io/component"] == "extender"
    events = [e for e in api.events if e["reason"] == CHANGED_REASON]
    assert len(events) == 5 and events[0]["type"] == "Warning", "one namespace alone moved it"
    assert events[0]["involvedObject"] == {"apiVersion": "v1", "kind": "ConfigMap", "name": CONFIGMAP,
                                           "namespace": "vramguard-system"}
    writes = api.writes
    await leader.round()
    assert api.writes == writes, "an unchanged table is not written again"

    # A restarted extender, before any agent report: the stored table sizes the next pod.
    fresh = cluster([gpu_node("n9")], [])
    await learner(fresh, api).load()
    assert fresh.learned == state.learned
    [claim] = fresh.claims_for(pod("next"), fresh.choose_class(pod("next"))).claims
    assert claim.bytes_on(H100, H100, KEY.product) == certain() + 6 * GiB


async def test_a_standby_follows_the_stored_table_and_writes_nothing() -> None:
    api, state = Api(), measured_state(6 * GiB)
    leader = learner(state, api)
    for _ in range(6):
        await leader.round()
    standby_state = cluster([gpu_node("n9")], [])
    standby = learner(standby_state, api, serving=False)
    writes = api.writes
    assert await standby.round() == []
    assert standby_state.learned == state.learned and api.writes == writes


async def test_junk_in_the_configmap_is_replaced_and_a_conflict_is_written_over() -> None:
    api, state = Api(), measured_state(6 * GiB)
    await api.create("/api/v1/namespaces/vramguard-system/configmaps",
                     {"metadata": {"name": CONFIGMAP}, "data": {DATA_KEY: "{not json"}})
    leader = learner(state, api)
    await leader.load()
    assert state.learned == {}
    await leader.round()
    assert LearnedTable.from_json(api.objects[PATH]["data"][DATA_KEY]).evidence(KEY) == (2, 1)
    # Someone else writes meanwhile: the leader's table is written over it.
    api.objects[PATH] = {**api.objects[PATH], "metadata": {**api.objects[PATH]["metadata"], "resourceVersion": "99"}}
    await leader.round()
    assert api.conflicts >= 1
    assert LearnedTable.from_json(api.objects[PATH]["data"][DATA_KEY]).evidence(KEY) == (2, 1)


async def test_an_unreachable_api_server_fails_the_round_and_the_next_one_goes_on() -> None:
    api, state = Api(), measured_state(6 * GiB)
    leader = learner(state, api)
    api.down = True
    await leader.load()  # logged, not raised: the service starts
    with pytest.raises(ApiError, match="down"):  # the run loop logs and counts it
        await leader.round()
    api.down = False
    await leader.round()
    assert PATH in api.objects and KEY in state.learned


async def test_an_outlier_namespace_is_reported_once_and_exported() -> None:
    api = Api()
    beyond = {"a": 2 * GiB, "b": 2 * GiB, "greedy": 40 * GiB}
    nodes, pods = [], []
    for i, (namespace, extra) in enumerate(sorted(beyond.items()) * 2):
        nodes.append(reported(gpu_node(f"n{i}"), {f"uid-p{i}": {"0": certain() + extra}}))
        pods.append(pod(f"p{i}", namespace=namespace, node=f"n{i}"))
    state = cluster(nodes, pods)
    registry = CollectorRegistry()
    leader = Learner(state, api, "vramguard-system", registry, serving=lambda: True, clock=lambda: NOW)  # type: ignore[arg-type]
    for _ in range(3):
        await leader.round()
    outliers = [e for e in api.events if e["reason"] == OUTLIER_REASON]
    assert len(outliers) == 1 and "greedy" in outliers[0]["message"]
    labels = {"engine": "vllm", "version": "0.25.1", "product": KEY.product, "gpus": "1", "layout": ""}
    assert registry.get_sample_value("vramguard_learned_allowance_bytes", labels) == 2 * GiB
    assert registry.get_sample_value("vramguard_learned_allowance_pods", labels) == 6
    assert registry.get_sample_value("vramguard_learned_allowance_namespaces", labels) == 3
    assert registry.get_sample_value("vramguard_learned_allowance_outlier_namespaces", labels) == 1
    assert registry.get_sample_value("vramguard_learned_allowance_changes_total", {"direction": "up"}) == 1
    assert CONTEXT == 512 * 2**20


async def test_a_new_table_applies_without_deriving_the_pods_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each round that moves a value re-applies the table to every template: the derivation itself (the
    # costly part: a shell, engines, parsers) is kept, or a round would re-derive the whole cluster.
    import vramguard.cluster  # noqa: PLC0415 - the module whose derivations are counted

    derived = vramguard.cluster.derive_pod_demand
    calls: list[str] = []

    def counting(pod: Any, options: Any) -> Any:
        calls.append(pod["metadata"]["name"])
        return derived(pod, options)

    monkeypatch.setattr(vramguard.cluster, "derive_pod_demand", counting)
    api, state = Api(), measured_state(6 * GiB)
    leader = learner(state, api)
    for _ in range(4):
        await leader.round()
    first = len(calls)
    assert first <= 2, calls  # one template, derived once (and its pod's claims)
    [claim] = state.claims_for(pod("next"), state.choose_class(pod("next"))).claims
    assert claim.bytes_on(H100, H100, KEY.product) == certain() + 5 * GiB
    assert len(calls) == first
