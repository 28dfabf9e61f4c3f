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
    page_size: int | None = None
    """Items per page (else the request's ``limit``); pages after the first carry a continue token."""
    page_gates: dict[tuple[int, int], asyncio.Event] = field(default_factory=dict)
    """(list call number, page number) -> gate that page's answer waits for."""
    page_failures: dict[tuple[int, int], int] = field(default_factory=dict)
    """(list call number, page number) -> status that page answers with (410: the token expired)."""
    pages_served: list[tuple[int, int]] = field(default_factory=list)
    """(list call number, page number) of every page answered."""
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
                return await self._list(resource, request)
            queue: asyncio.Queue[bytes | None] = asyncio.Queue()
            await resource.watches.put(queue)
            response = web.StreamResponse()
            await response.prepare(request)
            while (data := await queue.get()) is not None:
                await response.write(data)
            return response

        return handler

    @staticmethod
    async def _list(resource: FakeResource, request: web.Request) -> web.Response:
        """One page of a list: a new list (``list_calls`` counts them) or a continued one."""
        token = request.query.get("continue")
        if token is None:
            number, offset = resource.list_calls, 0
            resource.list_calls += 1
            gate = resource.list_gates.get(number)
            if gate is not None:
                await gate.wait()
        else:
            number, offset = (int(part) for part in token.split(":"))
        items = resource.lists[min(number, len(resource.lists) - 1)]
        size = resource.page_size or int(request.query.get("limit") or len(items) or 1)
        page = (number, offset // size)
        page_gate = resource.page_gates.get(page)
        if page_gate is not None:
            await page_gate.wait()
        status = resource.page_failures.pop(page, None)
        if status is not None:
            return web.json_response({"reason": "Expired" if status == 410 else "InternalError",
                                      "message": f"page {page[1]} of list {number} fails"}, status=status)
        resource.pages_served.append(page)
        metadata: dict[str, Any] = {"resourceVersion": str(100 + number)}
        if offset + size < len(items):
            metadata["continue"] = f"{number}:{offset + size}"
        return web.json_response({"metadata": metadata, "items": items[offset : offset + size]})

    async def _namespace(self, request: web.Request) -> web.Response:
        for obj in self.resources["namespaces"].lists[0]:
            if obj["metadata"]["name"] == request.match_info["name"]:
                return web.json_response(obj)
        return web.json_response({"reason": "NotFound", "message": "not found"}, status=404)


def event(kind: str, obj: dict[str, Any]) -> bytes:
    """One watch line as the API server writes it (Go escapes ``<``, ``>`` and ``&``)."""
    text = json.dumps({"type": kind, "object": obj}, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode() + b"\n"
