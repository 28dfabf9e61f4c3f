"""The API connection: the bearer token read from the official client's loader and reused for seconds,
and requests in flight at once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from vramguard.io import kube
from vramguard.io.kube import MAX_CONNECTIONS, TOKEN_REUSE_SECONDS, Connection, KubeClient, load_connection, reused_for


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("elapsed", "reads"),
    [(0.0, 1), (9.9, 1), (10.0, 2), (60.0, 2)],
    ids=["same-instant", "within-the-period", "period-over", "long-after"],
)
def test_reused_for_reads_once_per_period(elapsed: float, reads: int) -> None:
    clock = Clock()
    tokens = iter(["Bearer a", "Bearer b"])
    calls: list[int] = []

    def read() -> str | None:
        calls.append(1)
        return next(tokens)

    token = reused_for(10.0, read, clock)
    assert token() == "Bearer a"
    clock.now += elapsed
    assert token() == ("Bearer a" if reads == 1 else "Bearer b")
    assert len(calls) == reads


class FakeLoader:
    """The official loader's in-cluster path: a refresh hook that re-applies the configuration on
    every token read (as the real one does, reading the environment's proxies each time)."""

    ConfigException = Exception

    def __init__(self) -> None:
        self.refreshes = 0

    def load_incluster_config(self, client_configuration: Any) -> None:
        client_configuration.host = "https://10.0.0.1:443"
        client_configuration.api_key["BearerToken"] = "Bearer t"

        def refresh(configuration: Any) -> None:
            self.refreshes += 1

        client_configuration.refresh_api_key_hook = refresh


def test_load_connection_does_not_refresh_the_token_on_every_request(monkeypatch: pytest.MonkeyPatch) -> None:
    loader = FakeLoader()
    monkeypatch.setattr(kube, "kube_config", loader)
    connection = load_connection()
    assert [connection.authorization() for _ in range(50)] == ["Bearer t"] * 50
    assert loader.refreshes == 1
    assert TOKEN_REUSE_SECONDS <= 60, "tokens are renewed minutes before expiry; reuse must stay far shorter"


async def test_requests_in_flight_are_not_queued_behind_a_small_pool() -> None:
    # Bindings wait on etcd commits; the client must not hold them back behind a few connections.
    # The API answers only once this many requests are in flight at the same time.
    in_flight = 100
    arrived = 0
    all_there = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        nonlocal arrived
        arrived += 1
        if arrived >= in_flight:
            all_there.set()
        await all_there.wait()
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/api/v1/namespaces/ns/pods/{name}/binding", handler)
    server = TestServer(app)
    await server.start_server()
    try:
        async with KubeClient(Connection(str(server.make_url("")).rstrip("/"), False, lambda: None)) as client:
            calls = [client.create(f"/api/v1/namespaces/ns/pods/p{i}/binding", {}) for i in range(in_flight)]
            await asyncio.wait_for(asyncio.gather(*calls), 10)
    finally:
        await server.close()
    assert in_flight <= MAX_CONNECTIONS
