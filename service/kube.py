"""The one module that talks to the Kubernetes API server: a small async client and an informer.

Objects stay plain JSON dicts (no client model classes): the extender keeps tens of thousands of
pods and needs only a few fields of each. Credentials come from a kubeconfig or the in-cluster
service account, through the official client's loader (which also refreshes projected tokens).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp
from kubernetes import config as _kube_config
from kubernetes.client import Configuration

# The official client is used only for its loaders (kubeconfig files, exec plugins, in-cluster
# tokens that rotate); it ships no type information.
kube_config: Any = _kube_config

logger = logging.getLogger(__name__)

JSON = dict[str, Any]
LIST_PAGE_SIZE = 500
WATCH_TIMEOUT_SECONDS = 290
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=30, sock_connect=5)
# A watch streams for minutes; only the gap between two events is bounded (bookmarks keep it alive).
WATCH_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=WATCH_TIMEOUT_SECONDS + 30)
MAX_EVENT_BYTES = 4 << 20


class ApiError(Exception):
    """The API server answered with an error status."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Connection:
    """Where the API server is and how to authenticate to it."""

    server: str
    ssl_context: ssl.SSLContext | bool
    authorization: Callable[[], str | None]


def load_connection(kubeconfig: str | None = None, context: str | None = None) -> Connection:
    """Read a kubeconfig file (or, with none given, the in-cluster service account, then ~/.kube/config)."""
    configuration = Configuration()
    if kubeconfig is not None:
        kube_config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)
    else:
        try:
            kube_config.load_incluster_config(client_configuration=configuration)
        except kube_config.ConfigException:
            kube_config.load_kube_config(context=context, client_configuration=configuration)
    ssl_context: ssl.SSLContext | bool
    if configuration.verify_ssl:
        ssl_context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
        if configuration.cert_file:
            ssl_context.load_cert_chain(configuration.cert_file, configuration.key_file)
    else:
        ssl_context = False

    def authorization() -> str | None:
        # The client's loaders store the token under "BearerToken" (older releases: "authorization").
        token: str | None = configuration.get_api_key_with_prefix("BearerToken", alias="authorization")
        return token

    return Connection(configuration.host.rstrip("/"), ssl_context, authorization)


class KubeClient:
    """A minimal async client for the few calls vramguard makes."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the underlying HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._connection.ssl_context, limit=32)
            self._session = aiohttp.ClientSession(connector=connector, read_bufsize=1 << 20)
        return self._session

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        token = self._connection.authorization()
        if token:
            headers["Authorization"] = token
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> JSON:
        """One API call; returns the decoded body or raises :class:`ApiError`."""
        data = json.dumps(body) if body is not None else None
        async with self._http().request(
            method,
            self._connection.server + path,
            data=data,
            params=params,
            headers=self._headers(content_type if data is not None else None),
            timeout=REQUEST_TIMEOUT,
        ) as response:
            payload = await response.read()
            if response.status >= 400:
                raise _api_error(response.status, payload)
            decoded: JSON = json.loads(payload) if payload else {}
            return decoded

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> JSON:
        """GET an object or a list."""
        return await self.request("GET", path, params=params)

    async def create(self, path: str, body: Any) -> JSON:
        """POST (create) an object."""
        return await self.request("POST", path, body)

    async def patch(self, path: str, body: Any, patch_type: str = "merge") -> JSON:
        """PATCH an object (``merge``, ``strategic`` or ``json``)."""
        types = {
            "merge": "application/merge-patch+json",
            "strategic": "application/strategic-merge-patch+json",
            "json": "application/json-patch+json",
        }
        return await self.request("PATCH", path, body, content_type=types[patch_type])

    async def delete(self, path: str) -> JSON:
        """DELETE an object at once (grace period 0)."""
        return await self.request("DELETE", path, {"gracePeriodSeconds": 0})

    async def list_all(
        self, path: str, params: Mapping[str, str] | None = None, slim: Callable[[JSON], JSON] | None = None
    ) -> tuple[list[JSON], str]:
        """Every item of a collection, paginated; returns ``(items, resourceVersion)``.

        ``slim`` is applied to each item as its page arrives, so a list of 50,000 pods never holds
        more than one page of full objects (managedFields, status, volumes, ...) at a time.
        """
        items: list[JSON] = []
        query = {"limit": str(LIST_PAGE_SIZE), **(params or {})}
        while True:
            page = await self.get(path, query)
            page_items = page.get("items") or []
            items.extend(map(slim, page_items) if slim is not None else page_items)
            metadata = page.get("metadata") or {}
            token = metadata.get("continue")
            if not token:
                return items, str(metadata.get("resourceVersion", ""))
            query["continue"] = token

    async def watch(
        self, path: str, resource_version: str, params: Mapping[str, str] | None = None
    ) -> AsyncIterator[tuple[str, JSON]]:
        """Stream ``(type, object)`` watch events from ``resource_version`` until the server closes."""
        query = {
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_SECONDS),
            **(params or {}),
        }
        async with self._http().get(
            self._connection.server + path, params=query, headers=self._headers(), timeout=WATCH_TIMEOUT
        ) as response:
            if response.status >= 400:
                raise _api_error(response.status, await response.read())
            while True:
                line = await response.content.readline()
                if not line:
                    return
                if len(line) > MAX_EVENT_BYTES:
                    raise ApiError(500, "EventTooLarge", f"watch event of {len(line)} bytes")
                if not line.strip():
                    continue
                event = json.loads(line)
                yield str(event.get("type", "")), event.get("object") or {}


def _api_error(status: int, payload: bytes) -> ApiError:
    try:
        body = json.loads(payload)
        return ApiError(status, str(body.get("reason", "")), str(body.get("message", "")))
    except (ValueError, AttributeError):
        return ApiError(status, "", payload[:200].decode("utf-8", "replace"))


def object_path(kind_path: str, namespace: str | None, name: str) -> str:
    """``/api/v1/namespaces/ns/pods/name`` from ``/api/v1`` + ``pods`` style pieces."""
    base, _, resource = kind_path.rpartition("/")
    prefix = f"{base}/namespaces/{quote(namespace, safe='')}" if namespace else base
    return f"{prefix}/{resource}/{quote(name, safe='')}"


class Store(Protocol):
    """Where an :class:`Informer` delivers what it sees."""

    def replace(self, objects: list[JSON]) -> None:
        """The full state after a (re-)list."""

    def upsert(self, obj: JSON) -> None:
        """An object was added or modified."""

    def delete(self, obj: JSON) -> None:
        """An object was deleted."""


class Informer:
    """List, then watch from the list's resourceVersion; re-list when the version expires (410).

    ``synced`` is set after the first complete list, and stays set across re-lists: the store is
    replaced atomically, so it never shows a half-listed state.
    """

    def __init__(
        self,
        client: KubeClient,
        path: str,
        store: Store,
        params: Mapping[str, str] | None = None,
        slim: Callable[[JSON], JSON] | None = None,
    ) -> None:
        self.client = client
        self.path = path
        self.store = store
        self.params = dict(params or {})
        self.slim = slim
        """Keeps only the fields the store reads, for listed and watched objects alike."""
        self.synced = asyncio.Event()
        self.resource_version = ""

    async def run(self) -> None:
        """Keep the store in step with the API server until cancelled."""
        backoff = 0.2
        while True:
            try:
                if not self.resource_version:
                    objects, self.resource_version = await self.client.list_all(self.path, self.params, self.slim)
                    self.store.replace(objects)
                    self.synced.set()
                await self._watch()
                backoff = 0.2
            except asyncio.CancelledError:
                raise
            except ApiError as exc:
                if exc.status == 410:
                    logger.info("watch of %s expired (%s); re-listing", self.path, exc.message)
                    self.resource_version = ""
                    continue
                logger.warning("watch of %s failed: %s", self.path, exc)
            except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as exc:
                logger.warning("watch of %s interrupted: %s", self.path, exc)
            await asyncio.sleep(backoff * (1 + random.random()))
            backoff = min(backoff * 2, 10.0)

    async def _watch(self) -> None:
        async for kind, raw in self.client.watch(self.path, self.resource_version, self.params):
            if kind == "ERROR":
                raise ApiError(int(raw.get("code", 500)), str(raw.get("reason", "")), str(raw.get("message", "")))
            version = (raw.get("metadata") or {}).get("resourceVersion")
            obj = self.slim(raw) if self.slim is not None and kind != "BOOKMARK" else raw
            if kind in ("ADDED", "MODIFIED"):
                self.store.upsert(obj)
            elif kind == "DELETED":
                self.store.delete(obj)
            if version:
                self.resource_version = str(version)
