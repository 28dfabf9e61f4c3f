"""The extender's applications served as in production, on loopback over plain HTTP: the verbs by the
native server, the probes and metrics by aiohttp; one client posts to the first and gets from the second."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from extender.app import ExtenderApp
from vramguard.io.server import serve


class ServedClient:
    """``post`` goes to the verbs' listener, ``get`` to the operational one."""

    def __init__(self, session: aiohttp.ClientSession, verbs_url: str, operational_url: str) -> None:
        self._session = session
        self._verbs = verbs_url
        self._operational = operational_url

    def post(self, path: str, **kwargs: Any) -> Any:
        return self._session.post(self._verbs + path, **kwargs)

    def get(self, path: str, **kwargs: Any) -> Any:
        return self._session.get(self._operational + path, **kwargs)


@contextlib.asynccontextmanager
async def served(app: ExtenderApp) -> AsyncIterator[ServedClient]:
    async with serve(app.operational, "127.0.0.1", 0, None, operational=("127.0.0.1", 0), native=app.verbs) as server:
        assert server.operational is not None
        async with aiohttp.ClientSession() as session:
            yield ServedClient(session, server.url, server.operational.url)
