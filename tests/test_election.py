"""Leader election: the pure decisions (fake clock) and the Lease loop against a fake API server over HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from vramguard.election import (
    Action,
    ElectionTimings,
    LeaderRecord,
    decide,
    parse_record,
    serve_after,
    still_leading,
)
from vramguard.io.kube import Connection, KubeClient
from vramguard.io.leader import LeaderElector, LeaseFollower

T = ElectionTimings()  # 15 / 10 / 2
ME = "me"


def record(holder: str, duration: float | None = 15.0, transitions: int = 0, version: str = "1") -> LeaderRecord:
    return LeaderRecord(holder, duration, transitions, version)


@pytest.mark.parametrize(
    ("rec", "observed_at", "now", "action"),
    [
        pytest.param(record(ME), 0.0, 100.0, Action.RENEW, id="mine-renews-even-if-long-unseen"),
        pytest.param(record(""), 100.0, 100.0, Action.TAKE, id="released-taken-at-once"),
        pytest.param(record("other"), 100.0, 100.0, Action.WAIT, id="other-just-seen"),
        pytest.param(record("other"), 100.0, 114.9, Action.WAIT, id="other-valid-until-duration"),
        pytest.param(record("other"), 100.0, 115.0, Action.TAKE_OVER, id="other-expired-at-duration"),
        pytest.param(record("other", duration=1.0), 100.0, 101.0, Action.TAKE_OVER, id="record-duration-counts"),
        pytest.param(record("other", duration=60.0), 100.0, 115.0, Action.WAIT, id="longer-record-duration-counts"),
        pytest.param(record("other", duration=None), 100.0, 115.0, Action.TAKE_OVER, id="no-duration-uses-default"),
    ],
)
def test_decide(rec: LeaderRecord, observed_at: float, now: float, action: Action) -> None:
    assert decide(rec, ME, observed_at, now, T) is action


@pytest.mark.parametrize(
    ("last", "now", "leading"),
    [
        pytest.param(None, 0.0, False, id="never-renewed"),
        pytest.param(100.0, 100.0, True, id="just-renewed"),
        pytest.param(100.0, 109.9, True, id="within-deadline"),
        pytest.param(100.0, 110.0, False, id="deadline-reached"),
    ],
)
def test_still_leading(last: float | None, now: float, leading: bool) -> None:
    assert still_leading(last, now, T) is leading


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        pytest.param(Action.TAKE, 100.0, id="released-serves-at-once"),
        pytest.param(Action.RENEW, 100.0, id="renewal-serves"),
        pytest.param(Action.TAKE_OVER, 115.0, id="takeover-waits-a-lease-duration"),
    ],
)
def test_serve_after(action: Action, expected: float) -> None:
    assert serve_after(action, 100.0, T) == expected


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        pytest.param({"renew_deadline": 15.0}, "renew deadline < lease duration", id="deadline-not-below-duration"),
        pytest.param({"retry_period": 10.0}, "retry period < renew deadline", id="retry-not-below-deadline"),
        pytest.param({"retry_period": 0.0}, "0 < retry period", id="retry-zero"),
        pytest.param({"takeover_grace": -1.0}, "grace must not be negative", id="negative-grace"),
    ],
)
def test_timings_are_validated(kwargs: dict[str, float], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        ElectionTimings(**kwargs)


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        pytest.param({"metadata": {"resourceVersion": "7"},
                      "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15, "leaseTransitions": 3}},
                     record("a", 15.0, 3, "7"), id="full"),
        pytest.param({}, record("", None, 0, ""), id="empty"),
        pytest.param({"metadata": [], "spec": {"holderIdentity": 5, "leaseDurationSeconds": True,
                                               "leaseTransitions": -1}},
                     record("", None, 0, ""), id="junk-types"),
    ],
)
def test_parse_record(obj: dict[str, Any], expected: LeaderRecord) -> None:
    assert parse_record(obj) == expected


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class LeaseApi:
    """One Lease over real HTTP: GET, POST (409 if it exists), PUT with a resourceVersion precondition."""

    PATH = "/apis/coordination.k8s.io/v1/namespaces/ns/leases"

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.writes = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get(self.PATH + "/vg", self.get)
        app.router.add_put(self.PATH + "/vg", self.put)
        app.router.add_post(self.PATH, self.post)
        return app

    def _store(self, body: dict[str, Any]) -> web.Response:
        self.version += 1
        self.writes += 1
        body["metadata"]["resourceVersion"] = str(self.version)
        self.lease = body
        return web.json_response(body)

    async def get(self, request: web.Request) -> web.Response:
        if self.lease is None:
            return web.json_response({"reason": "NotFound", "message": "no lease"}, status=404)
        return web.json_response(self.lease)

    async def post(self, request: web.Request) -> web.Response:
        if self.lease is not None:
            return web.json_response({"reason": "AlreadyExists", "message": "exists"}, status=409)
        return self._store(await request.json())

    async def put(self, request: web.Request) -> web.Response:
        body = await request.json()
        assert self.lease is not None
        if body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            return web.json_response({"reason": "Conflict", "message": "modified"}, status=409)
        return self._store(body)


@pytest.fixture
async def api() -> AsyncIterator[tuple[LeaseApi, KubeClient]]:
    fake = LeaseApi()
    server = TestServer(fake.app())
    await server.start_server()
    client = KubeClient(Connection(str(server.make_url("")).rstrip("/"), False, lambda: None))
    try:
        yield fake, client
    finally:
        await client.close()
        await server.close()


def elector(client: KubeClient, identity: str, clock: Clock) -> LeaderElector:
    return LeaderElector(client, "ns", "vg", identity, T, registry=CollectorRegistry(), clock=clock)


async def test_only_one_of_two_candidates_leads_and_the_other_takes_over_after_expiry(
    api: tuple[LeaseApi, KubeClient],
) -> None:
    fake, client = api
    clock = Clock()
    a, b = elector(client, "a", clock), elector(client, "b", clock)
    assert await a.try_acquire_or_renew()  # created
    assert a.serving()
    assert not await b.try_acquire_or_renew()  # first sight of a's record
    assert not b.serving()
    clock.now += 9.0
    assert await a.try_acquire_or_renew()  # renewed: a new record for b
    assert not await b.try_acquire_or_renew()  # seen now
    clock.now += 14.0  # a stops renewing (SIGKILL): 14 s after b saw its last renewal
    assert not a.leading()  # past the renew deadline: a stopped serving before b may take over
    assert not await b.try_acquire_or_renew()
    clock.now += 1.0
    assert await b.try_acquire_or_renew()  # 15 s unchanged: taken over
    assert fake.lease is not None and fake.lease["spec"]["holderIdentity"] == "b"
    assert fake.lease["spec"]["leaseTransitions"] == 1
    assert b.leading() and not b.serving()  # the takeover grace: a's last Bindings may be on their way
    clock.now += T.lease_duration
    assert await b.try_acquire_or_renew()
    assert b.serving()
    assert not await a.try_acquire_or_renew()  # a comes back: b's Lease is valid
    assert not a.serving()


async def test_a_stale_write_loses_on_the_resource_version(api: tuple[LeaseApi, KubeClient]) -> None:
    fake, client = api
    clock = Clock()
    a, b = elector(client, "a", clock), elector(client, "b", clock)
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    clock.now += 20.0
    # a renews between b's read and b's write: b's PUT carries the old resourceVersion.
    real_get = client.get

    async def get_then_a_renews(path: str, params: Any = None) -> dict[str, Any]:
        obj = await real_get(path, params)
        client.get = real_get  # type: ignore[method-assign]
        await a.try_acquire_or_renew()
        return obj

    client.get = get_then_a_renews  # type: ignore[method-assign]
    assert not await b.try_acquire_or_renew()
    assert fake.lease is not None and fake.lease["spec"]["holderIdentity"] == "a"
    assert not b.leading()


async def test_release_hands_over_without_grace(api: tuple[LeaseApi, KubeClient]) -> None:
    fake, client = api
    clock = Clock()
    a, b = elector(client, "a", clock), elector(client, "b", clock)
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    await a.release()
    assert not a.serving()
    assert fake.lease is not None and fake.lease["spec"]["holderIdentity"] == ""
    assert await b.try_acquire_or_renew()
    assert b.serving()


async def test_a_leader_whose_renewals_fail_stops_serving_at_the_deadline(api: tuple[LeaseApi, KubeClient]) -> None:
    fake, client = api
    clock = Clock()
    a = elector(client, "a", clock)
    assert await a.try_acquire_or_renew()
    fake.lease = {"metadata": {"resourceVersion": "x"}, "spec": {"holderIdentity": "intruder"}}
    clock.now += 5.0
    assert not await a.try_acquire_or_renew()
    assert a.serving()  # still within the renew deadline of its last renewal
    clock.now += 5.0
    assert not a.serving()


async def test_the_loop_acquires_and_counts_the_transition(api: tuple[LeaseApi, KubeClient]) -> None:
    _, client = api
    registry = CollectorRegistry()
    a = LeaderElector(client, "ns", "vg", "a", ElectionTimings(3, 2, 0.05), registry=registry)
    task = asyncio.create_task(a.run())
    try:
        for _ in range(200):
            if registry.get_sample_value("vramguard_extender_leader") == 1.0:
                break
            await asyncio.sleep(0.01)
        assert registry.get_sample_value("vramguard_extender_leader") == 1.0
        assert registry.get_sample_value("vramguard_extender_lease_transitions_total", {"direction": "acquired"}) == 1
    finally:
        task.cancel()


def follower(client: KubeClient, hostname: str, clock: Clock) -> LeaseFollower:
    return LeaseFollower(client, "ns", "vg", hostname, registry=CollectorRegistry(), clock=clock)


async def test_a_sidecar_follows_its_own_schedulers_lease(api: tuple[LeaseApi, KubeClient]) -> None:
    # Two scheduler pods (hostnames pod-a, pod-b) elect with kube-scheduler's identities <hostname>_<uuid>;
    # each sidecar serves only while its own pod's scheduler holds the Lease, seen renewed.
    _, client = api
    clock = Clock()
    scheduler_a, scheduler_b = elector(client, "pod-a_6f1c", clock), elector(client, "pod-b_93de", clock)
    sidecar_a, sidecar_b = follower(client, "pod-a", clock), follower(client, "pod-b", clock)
    await sidecar_a.observe()
    assert not sidecar_a.serving()  # no Lease yet
    assert await scheduler_a.try_acquire_or_renew()
    assert not await scheduler_b.try_acquire_or_renew()
    for sidecar in (sidecar_a, sidecar_b):
        await sidecar.observe()
    assert sidecar_a.serving() and not sidecar_b.serving()
    # Renewals keep it serving; a Lease that stops changing stops it at the Lease's duration.
    for _ in range(5):
        clock.now += 2.0
        assert await scheduler_a.try_acquire_or_renew()
        await sidecar_a.observe()
        assert sidecar_a.serving()
    clock.now += 14.0  # scheduler A killed: no renewal since
    await sidecar_a.observe()
    assert sidecar_a.serving()
    clock.now += 1.0
    await sidecar_a.observe()
    assert not sidecar_a.serving()  # before scheduler B may take over (it waits the same 15 s)
    assert not await scheduler_b.try_acquire_or_renew()  # first sight of the stale record
    clock.now += 15.0
    assert await scheduler_b.try_acquire_or_renew()
    await sidecar_b.observe()
    await sidecar_a.observe()
    assert sidecar_b.serving() and not sidecar_a.serving()


async def test_a_sidecar_does_not_follow_a_lease_that_is_not_its_pods(api: tuple[LeaseApi, KubeClient]) -> None:
    fake, client = api
    clock = Clock()
    # A holder that only starts with the hostname's letters (pod-ab_...), an empty uuid, junk: not this pod.
    for holder in ("pod-ab_1", "pod-a_", "pod-a", "", "x_pod-a_1"):
        fake.lease = {"metadata": {"name": "vg", "resourceVersion": holder or "0"},
                      "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15}}
        sidecar = follower(client, "pod-a", clock)
        await sidecar.observe()
        assert not sidecar.serving(), holder
    fake.lease = {"metadata": {"name": "vg", "resourceVersion": "9"},
                  "spec": {"holderIdentity": "pod-a_1", "leaseDurationSeconds": "15"}}  # no duration: no trust
    sidecar = follower(client, "pod-a", clock)
    await sidecar.observe()
    assert not sidecar.serving()
