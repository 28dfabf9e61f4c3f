"""The one module that talks to the Kubernetes API server: a small async client and an informer.

Objects stay plain JSON dicts (no client model classes): the extender keeps tens of thousands of
pods and needs only a few fields of each. Credentials come from a kubeconfig or the in-cluster
service account (see :func:`load_connection`).
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import gc
import logging
import math
import os
import random
import re
import ssl
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol, runtime_checkable
from urllib.parse import quote

import aiohttp
import yaml
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from vramguard.io import jsoncodec

logger = logging.getLogger(__name__)

JSON = dict[str, Any]
LIST_PAGE_SIZE = 200
"""Items a list page holds: a page is decoded whole, so its size bounds what a list holds at once."""
WATCH_TIMEOUT_SECONDS = 290
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=30, sock_connect=5)
# A watch streams for minutes; only the gap between two events is bounded (bookmarks keep it alive).
WATCH_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=WATCH_TIMEOUT_SECONDS + 30)
MAX_EVENT_BYTES = 16 << 20
"""Default limit of one watch event (one JSON line). etcd takes objects up to 1.5 MiB by default,
and JSON escaping can grow one about six-fold (``<`` becomes ``\\u003c``): 16 MiB holds any such
object. Larger events are not decoded; they force a re-list (see :class:`OversizedEvent`)."""
READ_BUFFER_BYTES = 1 << 20
"""aiohttp's read buffer: flow control only (it pauses the socket at twice this much unread). Watch
lines are framed by :func:`event_lines`, never by aiohttp's ``readline``, whose own limit is that
high-water mark: so the event limit is :data:`MAX_EVENT_BYTES` (or the one configured), not aiohttp's."""
MAX_CONNECTIONS = 256
"""Requests in flight at once (each on a kept-alive connection of its own: HTTP/1.1). Watches hold
one each for minutes, and binds wait on etcd commits (hundreds of milliseconds when the disk is
busy): a small pool queued the extender's Bindings behind each other, a client-side limit the
scheduler's own HTTP/2 client does not have. The API server bounds its own concurrency
(max-requests-inflight, API Priority and Fairness)."""
TOKEN_REUSE_SECONDS = 10.0
"""How long a bearer token from the official client's loader is reused. Its refresh hook applies the
whole configuration again on every call (reading the proxy settings from the environment: about a
millisecond per API call); the loaders renew tokens minutes before they expire, so seconds-old
tokens are always valid."""
STALE_AFTER_SECONDS = 2.0 * WATCH_TIMEOUT_SECONDS
"""An informer with no successful list or watch progress for this long is unhealthy: a healthy
watch ends (and counts as progress) every :data:`WATCH_TIMEOUT_SECONDS` at the latest."""


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
    """The one kubeconfig loader of the services and the CLI.

    With neither ``kubeconfig`` nor ``context``: the in-cluster service account, else the default
    kubeconfig (``$KUBECONFIG``, ``~/.kube/config``). Otherwise that kubeconfig file (default: the
    default one) and that context (default: its current one).

    The service account, and kubeconfigs whose credentials are certificates or bearer tokens, are
    read here; anything else (exec plugins, auth providers, merged ``$KUBECONFIG`` lists, proxies)
    goes to the official client's loader, so the OIDC and exec credentials of managed clusters keep
    working. That loader imports the whole generated client (about 8 MiB resident, for good):
    services that need none of it do not pay for it.
    """
    if kubeconfig is None and context is None:
        connection = _service_account()
        if connection is not None:
            return connection
    connection = _plain_kubeconfig(kubeconfig, context)
    return connection if connection is not None else _official_connection(kubeconfig, context)


SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where the kubelet mounts a pod's service account token and the cluster's CA."""


def _service_account() -> Connection | None:
    """The in-cluster connection, as the official loader makes it (None outside a pod). The token
    is read again every :data:`TOKEN_REUSE_SECONDS`: the kubelet rotates it in place."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    token_file, ca_file = SERVICE_ACCOUNT / "token", SERVICE_ACCOUNT / "ca.crt"
    if not host or not port or not token_file.is_file() or not ca_file.is_file():
        return None
    if ":" in host:
        host = f"[{host}]"
    return Connection(
        f"https://{host}:{port}",
        ssl.create_default_context(cafile=str(ca_file)),
        reused_for(TOKEN_REUSE_SECONDS, lambda: _bearer(token_file.read_text())),
    )


_PLAIN_CLUSTER = frozenset(
    {"server", "certificate-authority", "certificate-authority-data", "insecure-skip-tls-verify"}
)
_PLAIN_USER = frozenset(
    {"client-certificate", "client-certificate-data", "client-key", "client-key-data", "token", "tokenFile"}
)


def _plain_kubeconfig(path: str | None, context: str | None) -> Connection | None:
    """The connection of a kubeconfig file whose context's cluster and user use only the fields
    of :data:`_PLAIN_CLUSTER` and :data:`_PLAIN_USER`; None for any other (the official loader's)."""
    if path is None:
        path = os.environ.get("KUBECONFIG") or str(Path("~/.kube/config").expanduser())
        if os.pathsep in path:
            return None  # a list of files, merged
    file = Path(path)
    try:
        document = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError):
        return None  # the official loader says what is wrong
    if not isinstance(document, dict):
        return None
    name = context or document.get("current-context")
    entry = _named(document, "contexts", name, "context")
    if entry is None:
        return None
    cluster = _named(document, "clusters", entry.get("cluster"), "cluster")
    user = _named(document, "users", entry.get("user"), "user") if entry.get("user") else {}
    if cluster is None or user is None or not set(cluster) <= _PLAIN_CLUSTER or not set(user) <= _PLAIN_USER:
        return None
    server = cluster.get("server")
    if not isinstance(server, str) or not server:
        return None
    base = file.parent
    ssl_context: ssl.SSLContext | bool = False
    if not cluster.get("insecure-skip-tls-verify"):
        if "certificate-authority-data" in cluster:
            ssl_context = ssl.create_default_context(cadata=_decoded(cluster["certificate-authority-data"]).decode())
        elif "certificate-authority" in cluster:
            ssl_context = ssl.create_default_context(cafile=str(base / cluster["certificate-authority"]))
        else:
            ssl_context = ssl.create_default_context()
        if "client-certificate" in user or "client-certificate-data" in user:
            _load_client_certificate(ssl_context, user, base)
    authorization: Callable[[], str | None] = lambda: None  # noqa: E731
    if "token" in user:
        token = _bearer(str(user["token"]))
        authorization = lambda: token  # noqa: E731
    elif "tokenFile" in user:
        token_file = base / str(user["tokenFile"])
        authorization = reused_for(TOKEN_REUSE_SECONDS, lambda: _bearer(token_file.read_text()))
    return Connection(server.rstrip("/"), ssl_context, authorization)


def _named(document: JSON, section: str, name: Any, field: str) -> JSON | None:
    """The ``field`` of the entry called ``name`` in a kubeconfig's ``section``."""
    for item in document.get(section) or ():
        if isinstance(item, dict) and item.get("name") == name:
            value = item.get(field)
            return value if isinstance(value, dict) else None
    return None


def _decoded(data: Any) -> bytes:
    return base64.b64decode(str(data), validate=True)


def _load_client_certificate(context: ssl.SSLContext, user: JSON, base: Path) -> None:
    """The client certificate and key, from files or inline (base64: written to private temporary
    files for as long as OpenSSL reads them)."""
    with tempfile.TemporaryDirectory() as scratch:
        paths = []
        for name in ("client-certificate", "client-key"):
            if f"{name}-data" in user:
                path = Path(scratch) / name
                path.touch(0o600)
                path.write_bytes(_decoded(user[f"{name}-data"]))
                paths.append(str(path))
            else:
                paths.append(str(base / str(user.get(name, ""))))
        context.load_cert_chain(paths[0], paths[1])


def _bearer(token: str) -> str | None:
    token = token.strip()
    return f"Bearer {token}" if token else None


def _official_loader() -> Any:
    """The official client's loaders (``kubernetes.config``, untyped), imported on first use."""
    from kubernetes import config  # noqa: PLC0415

    return config


def _official_connection(kubeconfig: str | None, context: str | None) -> Connection:
    """The connection the official client's loaders make (see :func:`load_connection`)."""
    from kubernetes.client import Configuration  # noqa: PLC0415

    kube_config = _official_loader()
    configuration = Configuration()
    if kubeconfig is None and context is None:
        try:
            kube_config.load_incluster_config(client_configuration=configuration)
        except kube_config.ConfigException:
            kube_config.load_kube_config(client_configuration=configuration)
    else:
        kube_config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)
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

    return Connection(configuration.host.rstrip("/"), ssl_context, reused_for(TOKEN_REUSE_SECONDS, authorization))


def reused_for(
    seconds: float, read: Callable[[], str | None], clock: Callable[[], float] = time.monotonic
) -> Callable[[], str | None]:
    """``read``, called at most once per ``seconds``: its last answer is returned in between."""
    last: str | None = None
    until = -math.inf

    def reuse() -> str | None:
        nonlocal last, until
        now = clock()
        if now >= until:
            last, until = read(), now + seconds
        return last

    return reuse


class KubeClient:
    """A minimal async client for the few calls vramguard makes."""

    def __init__(self, connection: Connection, *, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        if max_event_bytes < 1:
            raise ValueError(f"max_event_bytes must be positive, got {max_event_bytes}")
        self._connection = connection
        self._session: aiohttp.ClientSession | None = None
        self.max_event_bytes = max_event_bytes
        """Longest watch event decoded; a longer one raises :class:`OversizedEvent`."""

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
            connector = aiohttp.TCPConnector(ssl=self._connection.ssl_context, limit=MAX_CONNECTIONS)
            self._session = aiohttp.ClientSession(connector=connector, read_bufsize=READ_BUFFER_BYTES)
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
        data = jsoncodec.dumps(body) if body is not None else None
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
            decoded: JSON = jsoncodec.loads(payload) if payload else {}
            return decoded

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> JSON:
        """GET an object or a list."""
        return await self.request("GET", path, params=params)

    async def create(self, path: str, body: Any) -> JSON:
        """POST (create) an object."""
        return await self.request("POST", path, body)

    async def replace(self, path: str, body: Any) -> JSON:
        """PUT (replace) an object; its ``metadata.resourceVersion`` makes it conditional (409 if changed)."""
        return await self.request("PUT", path, body)

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

    async def list_pages(
        self, path: str, params: Mapping[str, str] | None = None, slim: Callable[[JSON], JSON] | None = None
    ) -> AsyncGenerator[ListPage, None]:
        """A collection, page by page (``limit``/``continue``, :data:`LIST_PAGE_SIZE` items a page).

        ``slim`` is applied to each item as its page arrives, and a page is handed out as soon as it
        is read: a caller that keeps only what it needs of each page never holds the whole list of
        full (or slimmed) objects. The next page is requested before this one is slimmed, so the API
        server prepares it while the caller reads this one (at most two pages are held at once). A
        ``410 Gone`` on a continued page (the API server compacted the snapshot the list reads)
        raises :class:`ContinueExpired`: start again.
        """
        query = {"limit": str(LIST_PAGE_SIZE), **(params or {})}
        pending = asyncio.ensure_future(self._list_page(path, dict(query)))
        try:
            while True:
                page = await pending
                page_items = page.get("items") or []
                metadata = page.get("metadata") or {}
                token = metadata.get("continue")
                if token:
                    query["continue"] = str(token)
                    pending = asyncio.ensure_future(self._list_page(path, dict(query)))
                    await asyncio.sleep(0)  # sends the request, then reads this page meanwhile
                items = list(map(slim, page_items) if slim is not None else page_items)
                del page, page_items  # the full objects go before the caller keeps its part of the page
                yield ListPage(items, str(metadata.get("resourceVersion", "")), last=not token)
                if not token:
                    return
        finally:
            if not pending.done():
                pending.cancel()
            elif not pending.cancelled():
                pending.exception()  # a page never read (the caller stopped): its failure is not news

    async def _list_page(self, path: str, query: Mapping[str, str]) -> JSON:
        try:
            return await self.get(path, query)
        except ApiError as exc:
            if exc.status == 410 and "continue" in query:
                raise ContinueExpired(exc.status, exc.reason, exc.message) from exc
            raise

    async def list_all(
        self, path: str, params: Mapping[str, str] | None = None, slim: Callable[[JSON], JSON] | None = None
    ) -> tuple[list[JSON], str]:
        """Every item of a collection (see :meth:`list_pages`); returns ``(items, resourceVersion)``."""
        items: list[JSON] = []
        version = ""
        async for page in self.list_pages(path, params, slim):
            items.extend(page.items)
            version = page.resource_version
        return items, version

    async def watch(
        self, path: str, resource_version: str, params: Mapping[str, str] | None = None
    ) -> AsyncIterator[tuple[str, JSON]]:
        """Stream ``(type, object)`` watch events from ``resource_version`` until the server closes.

        An event longer than :attr:`max_event_bytes` is read to its end without being kept, and
        raises :class:`OversizedEvent` naming the nodes it mentions: the caller must re-list.
        """
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
            async for line in event_lines(response.content, self.max_event_bytes):
                if not line.strip():
                    continue
                event = jsoncodec.loads(line)
                if not isinstance(event, dict):
                    raise ValueError(f"watch event is not a JSON object: {line[:80]!r}")
                obj = event.get("object")
                yield str(event.get("type", "")), obj if isinstance(obj, dict) else {}


@dataclass(frozen=True, slots=True)
class ListPage:
    """One page of a list: its (slimmed) items and the list's resourceVersion."""

    items: list[JSON]
    resource_version: str
    last: bool
    """No page follows: the list is complete."""


class ContinueExpired(ApiError):
    """A list's continue token expired (410 on a continued page): the list must start again."""


class OversizedEvent(Exception):
    """A watch event longer than the limit: it was not decoded, so the watch must re-list.

    ``nodes`` are the node names found in it as ``"nodeName":"<name>"`` (any such pair, whatever
    object it belongs to: every one is suspect), so the pods of those nodes can be held back.
    """

    def __init__(self, size: int, limit: int, nodes: frozenset[str], complete: bool) -> None:
        ending = "" if complete else " (the stream ended inside it)"
        super().__init__(f"watch event of {size} bytes or more exceeds the limit of {limit} bytes{ending}")
        self.size = size
        self.limit = limit
        self.nodes = nodes
        self.complete = complete


_NODE_NAME = re.compile(rb'"nodeName":"([^"\\]{1,253})"')
# A match spans at most this many bytes; keeping that much of each chunk finds matches cut in two.
_NODE_NAME_SPAN = len(b'"nodeName":""') + 253


class _NodeNameScanner:
    """Finds ``"nodeName":"<name>"`` in a byte stream fed in pieces, keeping only a short tail.

    Inside a JSON string a ``"`` is always escaped, so the pattern matches only a key and its value:
    ``spec.nodeName``, or a label/annotation key of that name (suspect too: conservative).
    """

    def __init__(self) -> None:
        self.nodes: set[str] = set()
        self.size = 0
        self._tail = b""

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self.size += len(data)
        window = self._tail + bytes(data)
        self.nodes.update(m.group(1).decode("ascii", "replace") for m in _NODE_NAME.finditer(window))
        self._tail = window[-_NODE_NAME_SPAN:]


async def event_lines(content: aiohttp.StreamReader, limit: int) -> AsyncIterator[bytes]:
    """Newline-separated lines of ``content``, each at most ``limit`` bytes.

    A longer line is not buffered: it is scanned for node names as it streams past, read to its
    end, and reported by raising :class:`OversizedEvent` (so it is never silently skipped).
    """
    pending = bytearray()
    while True:
        chunk = await content.readany()
        if not chunk:
            if pending:
                # The server closed in the middle of an event: nothing of it is applied.
                raise aiohttp.ClientPayloadError(f"watch stream ended inside an event of {len(pending)} bytes")
            return
        start = 0
        while start < len(chunk):
            end = chunk.find(b"\n", start)
            stop = len(chunk) if end == -1 else end
            if len(pending) + stop - start > limit:
                scanner = _NodeNameScanner()
                scanner.feed(pending)
                del pending[:]
                await _drain_line(content, chunk, start, scanner, limit)
            if end == -1:
                pending += chunk[start:]
                break
            if pending:
                pending += chunk[start:end]
                line = bytes(pending)
                del pending[:]
            else:
                line = chunk[start:end]
            start = end + 1
            yield line


async def _drain_line(
    content: aiohttp.StreamReader, chunk: bytes, start: int, scanner: _NodeNameScanner, limit: int
) -> NoReturn:
    """Read an oversized line to its end, scanning it; always raises :class:`OversizedEvent`."""
    while True:
        end = chunk.find(b"\n", start)
        scanner.feed(memoryview(chunk)[start : len(chunk) if end == -1 else end])
        if end != -1:
            raise OversizedEvent(scanner.size, limit, frozenset(scanner.nodes), complete=True)
        chunk, start = await content.readany(), 0
        if not chunk:
            raise OversizedEvent(scanner.size, limit, frozenset(scanner.nodes), complete=False)


def _api_error(status: int, payload: bytes) -> ApiError:
    try:
        body = jsoncodec.loads(payload)
        return ApiError(status, str(body.get("reason", "")), str(body.get("message", "")))
    except (ValueError, AttributeError):
        return ApiError(status, "", payload[:200].decode("utf-8", "replace"))


LEASES = "/apis/coordination.k8s.io/v1/leases"
"""The Lease collection (agents' liveness, the extenders' leader election), for the path helpers."""
PODDISRUPTIONBUDGETS = "/apis/policy/v1/poddisruptionbudgets"
"""The PodDisruptionBudget collection (the extender's preemption honours them)."""


def collection_path(kind_path: str, namespace: str | None) -> str:
    """``/apis/coordination.k8s.io/v1/namespaces/ns/leases`` from the cluster-wide collection path."""
    base, _, resource = kind_path.rpartition("/")
    return f"{base}/namespaces/{quote(namespace, safe='')}/{resource}" if namespace else kind_path


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


class Replacement(Protocol):
    """A new state being built from a list, page by page, while the old one keeps serving."""

    def add(self, objects: list[JSON]) -> None:
        """One page of the list."""

    def commit(self) -> None:
        """The list is complete: swap the new state in, at once."""


@runtime_checkable
class PagedStore(Protocol):
    """A store that builds its new state page by page (optional, beside :class:`Store`): it keeps
    only what it needs of each page, so a re-list never holds the whole list of objects."""

    def begin_replace(self) -> Replacement:
        """Start a new state; nothing changes until its :meth:`Replacement.commit`."""


class _Collected:
    """The :class:`Replacement` of a plain :class:`Store`: the pages gathered, replaced at commit."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._objects: list[JSON] = []

    def add(self, objects: list[JSON]) -> None:
        self._objects.extend(objects)

    def commit(self) -> None:
        self._store.replace(self._objects)


@runtime_checkable
class SuspectingStore(Protocol):
    """A store that can hold nodes back while it re-reads them (optional, beside :class:`Store`)."""

    def suspect(self, nodes: frozenset[str]) -> None:
        """An event about these nodes could not be read: treat them conservatively until the next
        :meth:`Store.replace`, which clears the mark."""


class WatchMetrics:
    """``vramguard_watch_healthy{resource}``, ``vramguard_watch_restarts_total{resource,reason}``,
    ``vramguard_watch_lists_total{resource}`` and ``vramguard_watch_oversized_events_total{resource}``
    for the informers given to it."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.restarts = Counter(
            "vramguard_watch_restarts",
            "Watches restarted, by resource and reason (expired, oversized, api, connection, decode, store, "
            "unexpected).",
            labelnames=("resource", "reason"),
            registry=registry,
        )
        self.lists = Counter(
            "vramguard_watch_lists",
            "Complete lists read, by resource (the first, and each re-list after a restart).",
            labelnames=("resource",),
            registry=registry,
        )
        self.oversized = Counter(
            "vramguard_watch_oversized_events",
            "Watch events over the size limit; each forces a re-list.",
            labelnames=("resource",),
            registry=registry,
        )
        self._informers: list[Informer] = []
        registry.register(_HealthCollector(self._informers))

    def track(self, informer: Informer) -> None:
        """Report ``informer`` in ``vramguard_watch_healthy``."""
        self._informers.append(informer)


class _HealthCollector(Collector):
    def __init__(self, informers: list[Informer]) -> None:
        self._informers = informers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        healthy = GaugeMetricFamily(
            "vramguard_watch_healthy",
            "1 while a watch is synced and has listed or made progress recently, else 0.",
            labels=["resource"],
        )
        for informer in self._informers:
            healthy.add_metric([informer.resource], 1.0 if informer.healthy() else 0.0)
        yield healthy


def return_freed_memory() -> bool:
    """Collect what a list left behind and hand the C heap's free pages back to the system: the
    pages of a list are freed, but without this the process keeps their memory resident. Returns
    whether the C library offered it (see :func:`trim_c_heap`)."""
    gc.collect()
    return trim_c_heap()


def trim_c_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; a few
    milliseconds). Returns whether the C library offers it (glibc does; musl does not)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


class _GcPause:
    """The cyclic garbage collector switched off while any list is read, and run once after the
    last: a list allocates tens of thousands of long-lived objects, and each few hundred of them
    would start a collection that walks every object the process holds (about half a list's CPU
    time). A page's objects hold no cycles: they are freed as each page is done with."""

    def __init__(self) -> None:
        self._lists = 0
        self._disabled = False

    def __enter__(self) -> None:
        if self._lists == 0 and gc.isenabled():
            gc.disable()
            self._disabled = True
        self._lists += 1

    def __exit__(self, *exc: object) -> None:
        self._lists -= 1
        if self._lists == 0 and self._disabled:
            self._disabled = False
            gc.enable()


gc_paused_for_lists = _GcPause()
"""One for the process: the informers list concurrently at start."""


class _StoreError(Exception):
    """The store raised while applying what the API server sent (a bug): re-list to recover."""


class Informer:
    """List, then watch from the list's resourceVersion, forever: every failure is logged, counted
    and followed by a watch from the last version seen (connection errors) or a re-list (anything
    else), with backoff. Only cancellation ends :meth:`run`.

    ``synced`` is set after the first complete list, and stays set across re-lists: the store is
    replaced atomically, so it never shows a half-listed state. :meth:`healthy` says whether the
    store can be trusted now (synced and recently in step with the API server).
    """

    INITIAL_BACKOFF = 0.2
    MAX_BACKOFF = 30.0
    RESET_BACKOFF_AFTER = 60.0
    """An attempt that ran this long before failing starts the backoff again from the beginning."""
    STALE_AFTER = STALE_AFTER_SECONDS
    """The default of ``stale_after``."""

    def __init__(
        self,
        client: KubeClient,
        path: str,
        store: Store,
        params: Mapping[str, str] | None = None,
        slim: Callable[[JSON], JSON] | None = None,
        *,
        metrics: WatchMetrics | None = None,
        stale_after: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        may_be_absent: bool = False,
    ) -> None:
        self.client = client
        self.may_be_absent = may_be_absent
        """A 404 means the API server does not serve this resource (an API group switched off): the
        store stays empty and counts as synced, one log line says so, and the list is retried."""
        self.absent = False
        self.path = path
        self.store = store
        self.params = dict(params or {})
        self.slim = slim
        """Keeps only the fields the store reads, for listed and watched objects alike."""
        self.synced = asyncio.Event()
        self.resource_version = ""
        self.resource = path.rstrip("/").rpartition("/")[2]
        """The resource's plural name (``pods``), the metrics' label."""
        self.stale_after = self.STALE_AFTER if stale_after is None else stale_after
        """Seconds without a successful list or watch progress after which :meth:`healthy` is False."""
        self._metrics = metrics
        self._clock = clock
        self._running = False
        self._last_progress = clock()
        if metrics is not None:
            metrics.track(self)

    def healthy(self) -> bool:
        """Synced, running, and listed or made watch progress within :attr:`stale_after` seconds."""
        if self.absent:
            return self._running  # not served: an empty store is the truth, until a list finds it served
        return self._running and self.synced.is_set() and self._clock() - self._last_progress <= self.stale_after

    async def run(self) -> None:
        """Keep the store in step with the API server until cancelled."""
        self._running = True
        try:
            await self._run()
        finally:
            self._running = False

    async def _run(self) -> None:
        backoff = self.INITIAL_BACKOFF
        while True:
            started = self._clock()
            try:
                if not self.resource_version:
                    await self._list()
                await self._watch()
                self._progress()  # the server ended the watch at its timeout
                backoff = self.INITIAL_BACKOFF
                continue
            except asyncio.CancelledError:
                raise
            except ContinueExpired as exc:
                # The snapshot the list was reading is gone: what was built is dropped unapplied.
                logger.info("list of %s expired between pages (%s); listing again", self.path, exc.message)
                self._restart("expired")
            except ApiError as exc:
                if exc.status == 404 and self.may_be_absent:
                    self._absent(exc)
                    await asyncio.sleep(self.MAX_BACKOFF * (1 + random.random()))
                    continue
                if exc.status == 410:
                    logger.info("watch of %s expired (%s); re-listing", self.path, exc.message)
                    self._restart("expired")
                    continue
                logger.warning("watch of %s failed: %s", self.path, exc)
                self._restart("api")
            except OversizedEvent as exc:
                self._oversized(exc)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                # The connection broke: the store is intact, so watch again from the last version.
                logger.warning("watch of %s interrupted: %s", self.path, exc or type(exc).__name__)
                self._count("connection")
            except ValueError as exc:
                # Undecodable JSON from the API server: what was applied before it may be incomplete.
                logger.warning("watch of %s sent an undecodable event (%s); re-listing", self.path, exc)
                self._restart("decode")
            except _StoreError as exc:
                logger.error("store of %s failed on a watch event; re-listing", self.path, exc_info=exc.__cause__)
                self._restart("store")
            except Exception:
                # Whatever else: never end silently; start again from a fresh list.
                logger.exception("watch of %s failed unexpectedly; re-listing", self.path)
                self._restart("unexpected")
            if self._clock() - started >= self.RESET_BACKOFF_AFTER:
                backoff = self.INITIAL_BACKOFF
            await asyncio.sleep(backoff * (1 + random.random()))
            backoff = min(backoff * 2, self.MAX_BACKOFF)

    def _absent(self, exc: ApiError) -> None:
        """The resource is not served: an empty store, synced, logged once until it is served."""
        if not self.absent:
            logger.warning("%s is not served by the API server (%s); watching it again when it is", self.path, exc)
            try:
                self.store.replace([])
            except Exception:
                logger.exception("store of %s failed to clear", self.path)
        self.absent = True
        self.resource_version = ""
        self.synced.set()
        self._progress()

    async def _list(self) -> None:
        """List page by page into a new state, swapped in only when the list is complete: until then
        (and for good, if a page fails) the old state keeps serving, so the ledger is never half-listed."""
        with gc_paused_for_lists:
            version = await self._read_list()
        return_freed_memory()
        self.resource_version = version
        self.synced.set()
        self._progress()
        if self._metrics is not None:
            self._metrics.lists.labels(self.resource).inc()

    async def _read_list(self) -> str:
        """Read and commit a list; returns its resourceVersion."""
        replacement = self.store.begin_replace() if isinstance(self.store, PagedStore) else _Collected(self.store)
        version = ""
        async for page in self.client.list_pages(self.path, self.params, self.slim):
            if self.absent:
                logger.info("%s is served now", self.path)
                self.absent = False
            try:
                replacement.add(page.items)
            except Exception as exc:
                raise _StoreError(f"page of the list of {self.path}") from exc
            version = page.resource_version
            self._progress()  # a long list is progress, page by page
        try:
            replacement.commit()
        except Exception as exc:
            raise _StoreError(f"replace of {self.path}") from exc
        return version

    async def _watch(self) -> None:
        async for kind, raw in self.client.watch(self.path, self.resource_version, self.params):
            if kind == "ERROR":
                raise ApiError(int(raw.get("code", 500)), str(raw.get("reason", "")), str(raw.get("message", "")))
            version = (raw.get("metadata") or {}).get("resourceVersion")
            try:
                obj = self.slim(raw) if self.slim is not None and kind != "BOOKMARK" else raw
                if kind in ("ADDED", "MODIFIED"):
                    self.store.upsert(obj)
                elif kind == "DELETED":
                    self.store.delete(obj)
            except Exception as exc:
                raise _StoreError(f"{kind} of {self.path}") from exc
            if version:
                self.resource_version = str(version)
            self._progress()

    def _progress(self) -> None:
        self._last_progress = self._clock()

    def _oversized(self, exc: OversizedEvent) -> None:
        if self._metrics is not None:
            self._metrics.oversized.labels(self.resource).inc()
        if exc.nodes and isinstance(self.store, SuspectingStore):
            try:
                self.store.suspect(exc.nodes)
            except Exception:
                logger.exception("store of %s failed to hold back nodes %s", self.path, sorted(exc.nodes))
        logger.warning(
            "watch of %s: %s; re-listing%s", self.path, exc,
            f" (nodes held back until then: {', '.join(sorted(exc.nodes))})" if exc.nodes else "",
        )
        self._restart("oversized")

    def _restart(self, reason: str) -> None:
        """Count a restart and forget the version, so the next attempt re-lists."""
        self.resource_version = ""
        self._count(reason)

    def _count(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.restarts.labels(self.resource, reason).inc()
