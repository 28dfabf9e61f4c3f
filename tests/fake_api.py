"""A fake API server for informer tests: scripted lists and watches over real HTTP (aiohttp).

Each resource answers its lists from a script (the last answer repeats), optionally held back by a
gate, and hands every watch connection to the test as a queue of raw bytes to stream (``None``
ends the response), so tests control framing down to the byte.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class FakeResource:
    """One collection, e.g. ``pods``."""

    lists: list[list[dict[str, Any]]]
    """Successive list answers; the last one repeats."""
    list_calls: int = 0
    list_gates: dict[int, asyncio.Event] = field(default_factory=dict)
    """List call number (0 = the first) -> gate the answer waits for."""
    fail_status: int | None = None
    """While set, lists and watches answer this status."""
    watches: asyncio.Queue[asyncio.Queue[bytes | None]] = field(default_factory=asyncio.Queue)
    """One queue per watch connection, in the order they arrive."""


class FakeApi:
    """``GET /api/v1/<resource>`` (list or ``watch=1``) and ``GET /api/v1/namespaces/<name>``."""

    def __init__(self, resources: dict[str, list[list[dict[str, Any]]]]) -> None:
        self.resources = {name: FakeResource(lists) for name, lists in resources.items()}

    def __getitem__(self, resource: str) -> FakeResource:
        return self.resources[resource]

    def app(self) -> web.Application:
        app = web.Application()
        for name in self.resources:
            # A name is a core resource ("pods"), or the whole path of a collection of another group.
            app.router.add_get(name if name.startswith("/") else f"/api/v1/{name}", self._collection(name))
        app.router.add_get("/api/v1/namespaces/{name}", self._namespace)
        return app

    def _collection(self, name: str) -> Any:
        resource = self.resources[name]

        async def handler(request: web.Request) -> web.StreamResponse:
            if resource.fail_status is not None:
                return web.json_response({"reason": "InternalError", "message": "failing"},
                                         status=resource.fail_status)
            if request.query.get("watch") != "1":
                number = resource.list_calls
                resource.list_calls += 1
                gate = resource.list_gates.get(number)
                if gate is not None:
                    await gate.wait()
                items = resource.lists[min(number, len(resource.lists) - 1)]
                return web.json_response({"metadata": {"resourceVersion": str(100 + number)}, "items": items})
            queue: asyncio.Queue[bytes | None] = asyncio.Queue()
            await resource.watches.put(queue)
            response = web.StreamResponse()
            await response.prepare(request)
            while (data := await queue.get()) is not None:
                await response.write(data)
            return response

        return handler

    async def _namespace(self, request: web.Request) -> web.Response:
        for obj in self.resources["namespaces"].lists[0]:
            if obj["metadata"]["name"] == request.match_info["name"]:
                return web.json_response(obj)
        return web.json_response({"reason": "NotFound", "message": "not found"}, status=404)


def event(kind: str, obj: dict[str, Any]) -> bytes:
    """One watch line as the API server writes it (Go escapes ``<``, ``>`` and ``&``)."""
    text = json.dumps({"type": kind, "object": obj}, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode() + b"\n"
