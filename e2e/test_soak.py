"""The soak, short: a seeded mix with one of each disruption, nothing over budget, lost or left pending.

``python -m e2e.soak`` runs the long one (see docs/benchmarks.md, "Soak"). Here the same code runs about a
hundred operations on a cluster of its own (two extender replicas, the webhook, one scheduler),
and every check the soak makes is shown to fail when its defect is put in on purpose.
"""

from __future__ import annotations

import contextlib
import time
import urllib.error
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from e2e.cluster import Cluster
from e2e.soak import AUDIT_NS, ENFORCE_NS, Api, Checker, Soak, SoakConfig, Tracked, pod_manifest, soak_cluster

pytestmark = pytest.mark.timeout(600)

RUN = "ci"


@pytest.fixture(scope="module")
def soaked(local_control_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Soak]]:
    with soak_cluster(tmp_path_factory.mktemp("soak"), local_control_plane.version) as cluster:
        config = SoakConfig(seed=15, ops=110, duration=150, bind_within=60, max_pods=60)
        yield cluster, Soak(cluster, config, run=RUN)


def test_a_short_soak_keeps_every_gpu_within_budget_and_binds_what_fits(soaked: tuple[Cluster, Soak]) -> None:
    _, soak = soaked
    summary = soak.execute()
    print(summary)
    assert summary["violations"] == 0, summary["violation_messages"]
    # One of each disruption happened, and the run kept going through them.
    for kind in ("extender_kills", "apiserver_restarts", "webhook_restarts"):
        assert summary[kind] == 1, summary
    assert summary["leader_changes"] >= 2, "a SIGKILLed leader and a SIGTERMed one are each replaced"
    assert summary["operations"] == 110
    assert summary["pods_bound_by_scheduler"] > 10, summary
    assert summary["outcomes"]["pods created"] > 20 and summary["outcomes"]["pods deleted"] > 10, summary
    assert summary["checks"] >= summary["operations"], "checked after every step"


@dataclass(frozen=True)
class Injection:
    """A defect put in on purpose, and the words of the check that must catch it."""

    inject: Callable[[Api, Checker, str], None]
    caught_as: str


def _create(api: Api, name: str, shape: str, **options: Any) -> dict[str, Any]:
    pod: dict[str, Any] = api.call(
        "POST", f"/api/v1/namespaces/{AUDIT_NS}/pods", pod_manifest(name, shape, RUN, **options)
    )
    return pod


def _track(checker: Checker, pod: dict[str, Any]) -> Tracked:
    meta = pod["metadata"]
    tracked = Tracked(meta["namespace"], meta["name"], meta["uid"], time.monotonic(), direct=False)
    checker.live[meta["uid"]] = tracked
    return tracked


def _direct_node(api: Api) -> str:
    nodes = api.call("GET", "/api/v1/nodes")["items"]
    return str(next(n["metadata"]["name"] for n in nodes if n["metadata"]["name"].startswith("direct-")))


def overcommit(api: Api, checker: Checker, tag: str) -> None:
    """Two 48 GiB pods placed directly on one node of 71.7 GiB GPUs, in a namespace that only audits:
    the webhook admits them, and nothing says they are on different GPUs."""
    node = _direct_node(api)
    for i in range(2):
        _create(api, f"{tag}-{i}", "declared-48Gi", node=node)


def lose(api: Api, checker: Checker, tag: str) -> None:
    """A pod deleted behind the soak's back."""
    pod = _create(api, tag, "vllm-0.30")
    _track(checker, pod)
    api.call("DELETE", f"/api/v1/namespaces/{AUDIT_NS}/pods/{tag}", {"gracePeriodSeconds": 0})


def never_schedule(api: Api, checker: Checker, tag: str) -> None:
    """A pod that fits but names a scheduler nobody runs: it stays pending."""
    _track(checker, _create(api, tag, "vllm-0.30", scheduler="nobody"))


def rebind(api: Api, checker: Checker, tag: str) -> None:
    """The soak remembers the pod on another node than the API server shows (the API server refuses
    a second Binding, so a pod moved is a model that disagrees with it)."""
    tracked = _track(checker, _create(api, tag, "vllm-0.30", node=_direct_node(api)))
    tracked.node = "some-other-node"


def keep_deleted(api: Api, checker: Checker, tag: str) -> None:
    """A pod the soak counts as deleted that is still on the API server."""
    pod = _create(api, tag, "vllm-0.30", scheduler="nobody")
    checker.deleted[pod["metadata"]["uid"]] = time.monotonic()


INJECTIONS = {
    "overcommit": Injection(overcommit, "over budget:"),
    "lost-pod": Injection(lose, "lost:"),
    "fitting-pod-left-pending": Injection(never_schedule, "not bound in time:"),
    "pod-bound-twice": Injection(rebind, "bound twice:"),
    "deleted-pod-not-released": Injection(keep_deleted, "not released:"),
}


@pytest.fixture(scope="module")
def emptied(soaked: tuple[Cluster, Soak]) -> Api:
    """The soak's cluster with every Deployment and pod of the soak deleted, so each injection starts
    from empty GPUs."""
    api = Api(soaked[0])
    for namespace in (ENFORCE_NS, AUDIT_NS):
        for deployment in api.call("GET", f"/apis/apps/v1/namespaces/{namespace}/deployments")["items"]:
            api.call(
                "DELETE",
                f"/apis/apps/v1/namespaces/{namespace}/deployments/{deployment['metadata']['name']}",
                {"propagationPolicy": "Background"},
            )
    deadline = time.monotonic() + 60
    while left := [p["metadata"] for p in api.pods() if p["metadata"]["namespace"] in (ENFORCE_NS, AUDIT_NS)]:
        assert time.monotonic() < deadline, f"pods left: {[meta['name'] for meta in left]}"
        for meta in left:
            with contextlib.suppress(urllib.error.HTTPError):  # the garbage collector may be first
                api.call(
                    "DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", {"gracePeriodSeconds": 0}
                )
        time.sleep(1)
    return api


@pytest.mark.parametrize("case", list(INJECTIONS), ids=list(INJECTIONS))
def test_every_check_catches_its_defect(emptied: Api, case: str) -> None:
    api = emptied
    checker = Checker(RUN, bind_within=2.0)
    checker.quiet_since = 0.0
    assert checker.check(api) == [], "the soak's cluster is clean before the defect is put in"
    tag = f"inj-{case}"
    injection = INJECTIONS[case]
    try:
        injection.inject(api, checker, tag)
        deadline = time.monotonic() + 20
        found: list[str] = []
        while not found and time.monotonic() < deadline:
            time.sleep(1.0)
            found = [v for v in checker.check(api) if v.startswith(injection.caught_as)]
        assert found, f"{case} was not caught: {checker.violations}"
    finally:
        for pod in api.pods():
            if pod["metadata"]["name"].startswith(tag):
                with contextlib.suppress(urllib.error.HTTPError):
                    api.call(
                        "DELETE",
                        f"/api/v1/namespaces/{AUDIT_NS}/pods/{pod['metadata']['name']}",
                        {"gracePeriodSeconds": 0},
                    )
