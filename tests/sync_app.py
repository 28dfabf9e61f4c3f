"""A service's app served on its own event loop, so that synchronous hypothesis tests can call it."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from extender.app import ExtenderApp
from tests.served_extender import served


class SyncApp:
    """``app`` served on a loop of its own (an aiohttp app behind a test server, the extender's as
    in production); :meth:`post` answers (status, JSON body)."""

    def __init__(self, app: web.Application | ExtenderApp) -> None:
        self.loop = asyncio.new_event_loop()
        self._stack = contextlib.AsyncExitStack()

        async def start() -> Any:
            client = TestClient(TestServer(app)) if isinstance(app, web.Application) else served(app)
            return await self._stack.enter_async_context(client)

        self.client = self.loop.run_until_complete(start())

    def post(self, path: str, **kwargs: Any) -> tuple[int, Any]:
        async def call() -> tuple[int, Any]:
            response = await self.client.post(path, **kwargs)
            return response.status, await response.json()

        return self.loop.run_until_complete(call())

    def close(self) -> None:
        self.loop.run_until_complete(self._stack.aclose())
        self.loop.close()
