"""An aiohttp app served on its own event loop, so that synchronous hypothesis tests can call it."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

Client = TestClient[web.Request, web.Application]


class SyncApp:
    """``app`` behind a test server on a loop of its own; :meth:`post` answers (status, JSON body)."""

    def __init__(self, app: web.Application) -> None:
        self.loop = asyncio.new_event_loop()

        async def start() -> Client:
            client: Client = TestClient(TestServer(app))
            await client.start_server()
            return client

        self.client = self.loop.run_until_complete(start())

    def post(self, path: str, **kwargs: Any) -> tuple[int, Any]:
        async def call() -> tuple[int, Any]:
            response = await self.client.post(path, **kwargs)
            return response.status, await response.json()

        return self.loop.run_until_complete(call())

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()
