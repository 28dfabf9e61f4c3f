"""JSON on the wire, in one place: the services' request and answer bodies, the API client's
bodies and watch events.

orjson, several times faster than the standard library at both ends, is what every body goes
through (the extender answers filter and prioritize on the scheduler's serial path). Its output is
compact UTF-8; its input must be UTF-8 JSON (RFC 8259): no ``NaN`` or ``Infinity``, no unpaired
surrogates, at most 1,024 levels of nesting. Integers beyond 64 bits are read as floats.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

__all__ = ["JSONDecodeError", "dumps", "json_response", "loads"]

JSONDecodeError = orjson.JSONDecodeError
"""What :func:`loads` raises on invalid input: a ``ValueError`` (and ``json.JSONDecodeError``),
with ``msg``, ``lineno`` and ``colno``."""


def dumps(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON."""
    return orjson.dumps(value)


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """The value of one JSON document; raises :data:`JSONDecodeError`."""
    return orjson.loads(data)


def json_response(data: Any, *, status: int = 200) -> web.Response:
    """An ``application/json`` response of ``data`` (``aiohttp.web.json_response``, encoded here)."""
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")
