"""Supervised informers: framing and the event limit, re-lists on any failure, health, metrics.

The API server is faked over real HTTP (tests/fake_api.py), so the bytes go through aiohttp's
client exactly as they would from a kube-apiserver.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from extender.metrics import ExtenderMetrics
from extender.verbs import Verbs
from tests.builders import gpu_node, vllm_pod
from tests.fake_api import FakeApi, event
from tests.test_extender import FakeKube
from vramguard.cluster import ClusterState, slim_pod
from vramguard.io.http import Readiness
from vramguard.io.kube import (
    READ_BUFFER_BYTES,
    Connection,
    Informer,
    KubeClient,
    OversizedEvent,
    WatchMetrics,
    event_lines,
    gc_paused_for_lists,
)
from vramguard.policy import default_policy

SUSPECT = "node n1: vramguard is re-reading its pods after an oversized watch event"


class Chunks:
    """``readany`` over fixed chunks, as aiohttp's StreamReader hands out what has arrived."""

    def __init__(self, data: bytes, size: int) -> None:
        self._chunks = [data[i : i + size] for i in range(0, len(data), size)]

    async def readany(self) -> bytes:
        return self._chunks.pop(0) if self._chunks else b""


async def read_lines(data: bytes, size: int, limit: int) -> list[bytes]:
    return [line async for line in event_lines(Chunks(data, size), limit)]  # type: ignore[arg-type]


def blob_pod(node_json: bytes, blob: int = 200) -> bytes:
    """A pod event whose annotation (escaped ``<``) comes before ``spec.nodeName``, as in real pods."""
    return (b'{"type":"MODIFIED","object":{"metadata":{"annotations":{"x":"' + b"\\u003c" * blob
            + b'"}},"spec":' + node_json + b"}}\n")


@pytest.mark.parametrize(
    ("data", "size", "limit", "lines"),
    [
        pytest.param(b'{"a":1}\n{"b":2}\n', 100, 100, [b'{"a":1}', b'{"b":2}'], id="two lines in one chunk"),
        pytest.param(b'{"a":1}\n{"b":2}\n', 3, 100, [b'{"a":1}', b'{"b":2}'], id="lines cut across chunks"),
        pytest.param(b"x" * 10 + b"\n", 4, 10, [b"x" * 10], id="a line exactly at the limit"),
        pytest.param(b"\n\n", 1, 10, [b"", b""], id="empty lines (the informer skips them)"),
    ],
)
async def test_event_lines_frames_lines_up_to_the_limit(data: bytes, size: int, limit: int, lines: list[bytes]) -> None:
    assert await read_lines(data, size, limit) == lines


@pytest.mark.parametrize(
    ("data", "size", "nodes", "complete"),
    [
        pytest.param(blob_pod(b'{"nodeName":"gpu-1"}'), 4096, {"gpu-1"}, True, id="nodeName after the blob"),
        pytest.param(blob_pod(b'{"nodeName":"gpu-1"}'), 7, {"gpu-1"}, True, id="nodeName cut by chunk boundaries"),
        pytest.param(blob_pod(b'{"nodeName":"gpu-1"}').replace(b'"x"', b'"nodeName":"decoy","x"'), 5,
                     {"gpu-1", "decoy"}, True, id="an annotation key named nodeName is suspect too"),
        pytest.param(blob_pod(b'{"nodeName":"gpu-1"}').replace(b'"x":"', b'"x":"\\"nodeName\\":\\"evil\\"'), 64,
                     {"gpu-1"}, True, id="a quoted nodeName inside a value is not a key"),
        pytest.param(blob_pod(b"{}"), 64, set(), True, id="an unbound pod names no node"),
        pytest.param(blob_pod(b'{"nodeName":"gpu-1"}')[:-30], 64, set(), False, id="the stream ends inside it"),
    ],
)
async def test_an_oversized_line_is_drained_and_names_its_nodes(
    data: bytes, size: int, nodes: set[str], complete: bool
) -> None:
    stream = b'{"before":1}\n' + data + (b'{"after":1}\n' if complete else b"")
    seen: list[bytes] = []
    with pytest.raises(OversizedEvent) as raised:
        async for line in event_lines(Chunks(stream, size), 256):  # type: ignore[arg-type]
            seen.append(line)
    assert seen == [b'{"before":1}'], "nothing of or after the oversized event is delivered"
    assert raised.value.nodes == nodes
    assert raised.value.complete is complete
    assert raised.value.size == len(data) - (1 if complete else 0)


async def test_a_stream_ending_inside_an_ordinary_event_is_a_connection_error() -> None:
    with pytest.raises(aiohttp.ClientPayloadError):
        await read_lines(b'{"a":1}\n{"b"', 3, 100)


# ----------------------------------------------------------------------------- informers on a fake API


@dataclass
class Env:
    api: FakeApi
    url: str

    def client(self, **kwargs: Any) -> KubeClient:
        return KubeClient(Connection(self.url, False, lambda: None), **kwargs)


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    api = FakeApi({"pods": [[]]})
    server = TestServer(api.app())
    await server.start_server()
    try:
        yield Env(api, str(server.make_url("")).rstrip("/"))
    finally:
        # Watch handlers stream until their queue ends; end the open ones before closing.
        for resource in api.resources.values():
            while not resource.watches.empty():
                resource.watches.get_nowait().put_nowait(None)
        await server.close()


async def eventually(probe: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not probe():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running(informer: Informer) -> AsyncIterator[asyncio.Task[None]]:
    """``informer.run()`` as a task for the ``async with`` body; its client closed afterwards."""
    task = asyncio.create_task(informer.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await informer.client.close()


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def cluster_state() -> ClusterState:
    state = ClusterState(default_policy())
    state.nodes.replace([gpu_node("n1"), gpu_node("n2")])
    state.namespaces.replace([{"metadata": {"name": "default"}}])
    return state


async def test_an_oversized_event_forces_a_relist_and_holds_its_node_back_until_then(env: Env) -> None:
    big, small = vllm_pod("big", "0.5", "n1"), vllm_pod("small", "0.2", "n2")
    env.api["pods"].lists = [[big, small], [small]]  # big was deleted; the re-list shows it gone
    relist = env.api["pods"].list_gates[1] = asyncio.Event()
    state, registry = cluster_state(), CollectorRegistry()
    informer = Informer(env.client(max_event_bytes=64 << 10), "/api/v1/pods", state.pods, slim=slim_pod,
                        metrics=WatchMetrics(registry))
    ExtenderMetrics(registry, state)
    async with running(informer) as task:
        await informer.synced.wait()
        watch = await env.api["pods"].watches.get()
        deleted = copy.deepcopy(big)
        deleted["metadata"]["annotations"] = {"note": "<" * 100_000}
        line = event("DELETED", deleted)
        assert len(line) > 6 * 100_000 > 64 << 10
        watch.put_nowait(line)
        await eventually(lambda: state.suspects == {"n1"})
        # Until the re-list answers, n1 is held back: its ledger may keep a deleted pod (as here)
        # or miss a bound one. The other node is unaffected.
        newcomer = vllm_pod("new", "0.3")  # fits n1 even beside big
        verbs = Verbs(state, FakeKube(state, {"new": newcomer}))  # type: ignore[arg-type]
        outcome = await verbs.filter(newcomer, ["n1", "n2"])
        assert outcome.passing == ["n2"]
        assert outcome.failed == {"n1": SUSPECT}
        assert await verbs.bind("new", "default", "uid-new", "n1") == SUSPECT
        assert state.ledger.holding("uid-big") is not None
        assert sample(registry, "vramguard_watch_oversized_events_total", resource="pods") == 1
        assert sample(registry, "vramguard_nodes_held_back") == 1
        assert sample(registry, "vramguard_watch_restarts_total", resource="pods", reason="oversized") == 1
        relist.set()
        await eventually(lambda: not state.suspects)
        assert state.ledger.holding("uid-big") is None, "the re-list released the deleted pod's VRAM"
        assert sample(registry, "vramguard_nodes_held_back") == 0
        assert (await verbs.filter(newcomer, ["n1", "n2"])).passing == ["n1", "n2"]
        assert env.api["pods"].list_calls == 2
        assert not task.done()


async def test_an_event_beyond_aiohttps_own_line_limit_is_read_under_ours(env: Env) -> None:
    # aiohttp's readline stops at twice its read buffer (LineTooLong); the limit must be ours.
    state = cluster_state()
    informer = Informer(env.client(), "/api/v1/pods", state.pods, slim=slim_pod)
    async with running(informer):
        await informer.synced.wait()
        watch = await env.api["pods"].watches.get()
        pod = vllm_pod("wordy", "0.5", "n1")
        pod["metadata"]["annotations"] = {"note": "x" * (3 * READ_BUFFER_BYTES)}
        watch.put_nowait(event("ADDED", pod))
        await eventually(lambda: state.ledger.holding("uid-wordy") is not None)
        assert env.api["pods"].list_calls == 1


def held(state: ClusterState, uids: list[str]) -> set[str]:
    """Which of ``uids`` the ledger holds."""
    return {uid for uid in uids if state.ledger.holding(uid) is not None}


ALL_UIDS = [f"uid-p{i}" for i in range(10)]


@pytest.mark.parametrize(
    ("page", "status", "reason"),
    [
        pytest.param(2, 500, "api", id="page 3 fails: the old pods serve until a list completes"),
        pytest.param(1, 410, "expired", id="the continue token expires: the list starts again from page 1"),
    ],
)
async def test_a_relist_is_read_page_by_page_and_swapped_in_only_when_complete(
    env: Env, page: int, status: int, reason: str
) -> None:
    pods = env.api["pods"]
    old = [vllm_pod(f"p{i}", "0.2", "n1") for i in range(4)]
    new = [old[0], vllm_pod("p8", "0.2", "n2"), vllm_pod("p9", "0.2", "n2")]
    pods.lists = [old, new]  # the re-list: p1..p3 were deleted, p8 and p9 bound meanwhile
    pods.page_size = 1
    pods.page_failures[(1, page)] = status
    retry = pods.list_gates[2] = asyncio.Event()
    state, registry = cluster_state(), CollectorRegistry()
    informer = Informer(env.client(), "/api/v1/pods", state.pods, slim=slim_pod, metrics=WatchMetrics(registry))
    async with running(informer) as task:
        await informer.synced.wait()
        assert pods.pages_served == [(0, 0), (0, 1), (0, 2), (0, 3)]
        assert held(state, ALL_UIDS) == {"uid-p0", "uid-p1", "uid-p2", "uid-p3"}
        (await pods.watches.get()).put_nowait(b"{not json\n")  # forces a re-list
        await eventually(lambda: pods.list_calls == 3)  # the failed list, and the next one (held back)
        assert sample(registry, "vramguard_watch_restarts_total", resource="pods", reason=reason) == 1
        assert (1, 0) in pods.pages_served, "the failed list had read a page before it failed"
        assert held(state, ALL_UIDS) == {"uid-p0", "uid-p1", "uid-p2", "uid-p3"}, "a half list changed nothing"
        assert informer.healthy(), "the old state is whole: it keeps serving"
        retry.set()
        await eventually(lambda: held(state, ALL_UIDS) == {"uid-p0", "uid-p8", "uid-p9"})
        assert pods.pages_served[-3:] == [(2, 0), (2, 1), (2, 2)], "the list started again from its first page"
        assert set(state.records) == {"uid-p0", "uid-p8", "uid-p9"}
        assert not task.done()


async def test_a_list_being_read_changes_nothing_until_its_last_page(env: Env) -> None:
    pods = env.api["pods"]
    pods.lists = [[vllm_pod("p0", "0.2", "n1")], [vllm_pod("p8", "0.2", "n2"), vllm_pod("p9", "0.2", "n2")]]
    pods.page_size = 1
    last_page = pods.page_gates[(1, 1)] = asyncio.Event()
    state = cluster_state()
    informer = Informer(env.client(), "/api/v1/pods", state.pods, slim=slim_pod)
    async with running(informer):
        await informer.synced.wait()
        state.pods.suspect(frozenset({"n1"}))
        (await pods.watches.get()).put_nowait(b"{not json\n")
        await eventually(lambda: (1, 0) in pods.pages_served)
        await asyncio.sleep(0.05)  # the first page is in: nothing of it shows yet
        assert held(state, ALL_UIDS) == {"uid-p0"}
        assert state.suspects == {"n1"}, "nodes stay held back until the list is complete"
        last_page.set()
        await eventually(lambda: held(state, ALL_UIDS) == {"uid-p8", "uid-p9"})
        assert state.suspects == set()


class PagesSeen:
    """A paged store that records, for each page added, whether the cyclic GC was on."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.gc_enabled: list[bool] = []

    def replace(self, objects: list[dict[str, Any]]) -> None:
        self.names = {o["metadata"]["name"] for o in objects}

    def upsert(self, obj: dict[str, Any]) -> None:
        self.names.add(obj["metadata"]["name"])

    def delete(self, obj: dict[str, Any]) -> None:
        self.names.discard(obj["metadata"]["name"])

    def begin_replace(self) -> Any:
        store = self
        names: set[str] = set()

        class Pages:
            def add(self, objects: list[dict[str, Any]]) -> None:
                store.gc_enabled.append(gc.isenabled())
                names.update(o["metadata"]["name"] for o in objects)

            def commit(self) -> None:
                store.names = names

        return Pages()


async def test_a_list_is_read_with_the_cyclic_gc_paused_and_counted_when_complete(env: Env) -> None:
    pods = env.api["pods"]
    pods.lists = [[{"metadata": {"name": n}} for n in "abc"]]
    pods.page_size = 1
    store, registry = PagesSeen(), CollectorRegistry()
    informer = Informer(env.client(), "/api/v1/pods", store, metrics=WatchMetrics(registry))
    assert gc.isenabled()
    async with running(informer):
        await informer.synced.wait()
        assert store.gc_enabled == [False, False, False]
        assert gc.isenabled(), "on again once the list is done"
        assert store.names == {"a", "b", "c"}
        assert sample(registry, "vramguard_watch_lists_total", resource="pods") == 1
        (await pods.watches.get()).put_nowait(b"{not json\n")  # forces a re-list
        await eventually(lambda: sample(registry, "vramguard_watch_lists_total", resource="pods") == 2)
    assert gc.isenabled()


async def test_the_gc_stays_paused_until_the_last_of_concurrent_lists_ends() -> None:
    assert gc.isenabled()
    with gc_paused_for_lists:
        with gc_paused_for_lists:
            assert not gc.isenabled()
        assert not gc.isenabled(), "the other list is still being read"
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused_for_lists:
            pass
        assert not gc.isenabled(), "a GC switched off by someone else stays off"
    finally:
        gc.enable()


async def test_the_next_page_is_requested_while_the_caller_reads_this_one(env: Env) -> None:
    pods = env.api["pods"]
    pods.lists = [[{"metadata": {"name": n}} for n in "abc"]]
    pods.page_size = 1
    client = env.client()
    served_when_handed_out = []
    try:
        async for page in client.list_pages("/api/v1/pods"):
            await asyncio.sleep(0.05)  # the caller works on the page; the server answers meanwhile
            served_when_handed_out.append((page.items[0]["metadata"]["name"], len(pods.pages_served)))
    finally:
        await client.close()
    assert served_when_handed_out == [("a", 2), ("b", 3), ("c", 3)]


async def test_a_list_the_caller_stops_reading_leaves_no_request_behind(env: Env) -> None:
    pods = env.api["pods"]
    pods.lists = [[{"metadata": {"name": n}} for n in "abc"]]
    pods.page_size = 1
    gate = pods.page_gates[(0, 1)] = asyncio.Event()
    client = env.client()
    try:
        pages = client.list_pages("/api/v1/pods")
        first = await anext(pages)
        assert first.items == [{"metadata": {"name": "a"}}]
        requests = [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "_list_page"]  # type: ignore[union-attr]
        assert len(requests) == 1, "page 2 is being requested"
        await pages.aclose()
        await asyncio.sleep(0)
        assert requests[0].cancelled()
        gate.set()
    finally:
        await client.close()


class FlakyStore:
    """A store whose ``fails`` method raises once: a bug in the store, not in the stream."""

    def __init__(self, fails: str) -> None:
        self.fails = fails
        self.names: set[str] = set()

    def _maybe_fail(self, method: str) -> None:
        if method == self.fails:
            self.fails = ""
            raise KeyError(f"bug in {method}")

    def replace(self, objects: list[dict[str, Any]]) -> None:
        self._maybe_fail("replace")
        self.names = {o["metadata"]["name"] for o in objects}

    def upsert(self, obj: dict[str, Any]) -> None:
        self._maybe_fail("upsert")
        self.names.add(obj["metadata"]["name"])

    def delete(self, obj: dict[str, Any]) -> None:
        self._maybe_fail("delete")
        self.names.discard(obj["metadata"]["name"])


@pytest.mark.parametrize(
    ("fails", "first_list", "line", "after"),
    [
        pytest.param("replace", 0, None, {"a", "b"}, id="replace fails on the first list"),
        pytest.param("upsert", 1, event("ADDED", {"metadata": {"name": "b", "resourceVersion": "5"}}),
                     {"a", "b"}, id="upsert fails on a watch event"),
        pytest.param("delete", 1, event("DELETED", {"metadata": {"name": "a", "resourceVersion": "5"}}),
                     {"a", "b"}, id="delete fails on a watch event"),
    ],
)
async def test_a_store_error_is_logged_with_its_traceback_and_relisted(
    env: Env, caplog: pytest.LogCaptureFixture, fails: str, first_list: int, line: bytes | None, after: set[str]
) -> None:
    env.api["pods"].lists = [[{"metadata": {"name": "a"}}], [{"metadata": {"name": "a"}}, {"metadata": {"name": "b"}}]]
    if first_list == 0:
        env.api["pods"].lists = env.api["pods"].lists[1:]
    store, registry = FlakyStore(fails), CollectorRegistry()
    informer = Informer(env.client(), "/api/v1/pods", store, metrics=WatchMetrics(registry))
    with caplog.at_level(logging.ERROR, logger="vramguard.io.kube"):
        async with running(informer) as task:
            if line is not None:
                await informer.synced.wait()
                (await env.api["pods"].watches.get()).put_nowait(line)
            await eventually(lambda: sample(registry, "vramguard_watch_restarts_total",
                                            resource="pods", reason="store") == 1)
            await eventually(lambda: informer.synced.is_set() and store.names == after)
            assert not task.done()
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "re-listing" in record.getMessage()
    assert record.exc_info is not None and isinstance(record.exc_info[1], KeyError)
    assert env.api["pods"].list_calls == 2


@pytest.mark.parametrize(
    ("data", "reason", "relists"),
    [
        pytest.param(b"{not json\n", "decode", True, id="undecodable JSON"),
        pytest.param(b"[1, 2]\n", "decode", True, id="an event that is not an object"),
        pytest.param(b'{"type":"ERROR","object":{"code":410,"message":"too old"}}\n', "expired", True,
                     id="resource version expired"),
        pytest.param(b'{"type":"ERROR","object":{"code":"junk"}}\n', "decode", True, id="a junk error code"),
        pytest.param(b'{"type":"ERROR","object":{"code":500,"message":"etcd"}}\n', "api", True, id="API error"),
        pytest.param(b'{"type":"ADDED","object":{"metadata":{"name":"b"', "connection", False,
                     id="the connection ends inside an event: watch again from the last version"),
    ],
)
async def test_every_watch_failure_is_counted_and_the_watch_goes_on(
    env: Env, data: bytes, reason: str, relists: bool
) -> None:
    env.api["pods"].lists = [[{"metadata": {"name": "a"}}]]
    store, registry = FlakyStore(""), CollectorRegistry()
    informer = Informer(env.client(), "/api/v1/pods", store, metrics=WatchMetrics(registry))
    async with running(informer) as task:
        await informer.synced.wait()
        watch = await env.api["pods"].watches.get()
        watch.put_nowait(data)
        watch.put_nowait(None)
        await env.api["pods"].watches.get()  # the next watch is open: the informer lives on
        assert sample(registry, "vramguard_watch_restarts_total", resource="pods", reason=reason) == 1
        assert env.api["pods"].list_calls == (2 if relists else 1)
        assert not task.done()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_health_follows_progress_and_readiness_fails_while_a_watch_stays_unhealthy(env: Env) -> None:
    clock, registry = Clock(), CollectorRegistry()
    pods = env.api["pods"]
    pods.lists = [[{"metadata": {"name": "a"}}]]
    gate = pods.list_gates[0] = asyncio.Event()
    informer = Informer(env.client(), "/api/v1/pods", FlakyStore(""), metrics=WatchMetrics(registry),
                        stale_after=60, clock=clock)
    readiness = Readiness({"watch-pods": informer.healthy})

    def healthy_gauge() -> float | None:
        return registry.get_sample_value("vramguard_watch_healthy", {"resource": "pods"})

    assert not informer.healthy(), "not running"
    async with running(informer):
        await eventually(lambda: pods.list_calls == 1)
        assert not informer.healthy(), "not synced yet"
        gate.set()
        await informer.synced.wait()
        assert informer.healthy() and await readiness.failing() == [] and healthy_gauge() == 1
        # The API server fails lists and watches alike: the store ages.
        pods.fail_status = 500
        (await pods.watches.get()).put_nowait(None)
        await eventually(lambda: sample(registry, "vramguard_watch_restarts_total", resource="pods", reason="api") >= 1)
        clock.now += 59
        assert informer.healthy(), "failing, but not for long yet"
        clock.now += 2
        assert not informer.healthy()
        assert await readiness.failing() == ["watch-pods"]
        assert healthy_gauge() == 0
        # It recovers with the next successful list.
        pods.fail_status = None
        watch = await pods.watches.get()
        assert informer.healthy() and await readiness.failing() == [] and healthy_gauge() == 1
        # Watch progress (here a bookmark) keeps it healthy without a list.
        clock.now += 50
        watch.put_nowait(b'{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"200"}}}\n')
        await eventually(lambda: informer.resource_version == "200")
        clock.now += 50
        assert informer.healthy()
    assert not informer.healthy(), "a stopped informer is not healthy"


async def test_a_list_that_fails_part_way_switches_the_gc_back_on() -> None:
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused_for_lists:
        assert not gc.isenabled()
        raise RuntimeError("the connection dropped after page 3")
    assert gc.isenabled(), "a failed or cancelled list must not leave the process without its collector"
