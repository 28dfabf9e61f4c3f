"""The services' shared wiring: the policy reload loop survives a failing reload; one readiness
check per watch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import pytest

from vramguard.io.kube import Connection, KubeClient
from vramguard.io.runtime import ServiceRuntime, Watch, reload_every, run


class Store:
    def replace(self, objects: list[Any]) -> None: ...
    def upsert(self, obj: Any) -> None: ...
    def delete(self, obj: Any) -> None: ...


async def test_a_failing_reload_is_logged_and_the_next_one_still_comes(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    def reload() -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("bug in the reload")

    task = asyncio.create_task(reload_every(0.001, reload))
    with caplog.at_level(logging.ERROR):
        while len(calls) < 3:
            assert not task.done(), "the loop ended on the first error"
            await asyncio.sleep(0.001)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert "unexpected error while reloading the policy" in caplog.text


async def test_readiness_has_one_check_per_watch_and_fails_until_they_list() -> None:
    client = KubeClient(Connection("http://127.0.0.1:9", False, lambda: None))
    runtime = ServiceRuntime(client, [Watch("/api/v1/nodes", Store()), Watch("/api/v1/pods", Store(), {"x": "y"})])
    assert runtime.readiness.names == ["watch-nodes", "watch-pods"]
    assert await runtime.readiness.failing() == ["watch-nodes", "watch-pods"]
    assert not runtime.synced()
    assert runtime.informers[1].params == {"x": "y"}
    await client.close()


def test_services_run_on_uvloop() -> None:
    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run(loop_module()).startswith("uvloop")
