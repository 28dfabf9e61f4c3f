"""One way to wire an aiohttp service that serves from watch-fed state (the extender, the webhook).

A service names its watches (:class:`Watch`: a path, the cluster model's store, a selector, a slim
function) and gets from :class:`ServiceRuntime` the informers, one metrics registry with their
watch metrics, readiness with one check per watch (``watch-<resource>``), and supervision of the
watches and its other background tasks beside the server (:func:`vramguard.io.supervise.supervise`).
:func:`reload_every` is the policy reload loop both services run: an unexpected error in one
reload is logged and the next reload still comes, with the last good policy in force.

Serving itself stays in :mod:`vramguard.io.server` (HTTPS, the operational listener, shutdown).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import uvloop
from prometheus_client import CollectorRegistry

from vramguard.io.http import Readiness
from vramguard.io.kube import JSON, Informer, KubeClient, Store, WatchMetrics
from vramguard.io.supervise import supervise

__all__ = ["ServiceRuntime", "Watch", "reload_every", "run"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on uvloop's event loop: a service's sockets, TLS and HTTP parsing cost a
    fraction of the CPU they take on asyncio's own loop, on the path of every scheduler call."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


@dataclass(frozen=True)
class Watch:
    """One collection a service keeps in step with the API server."""

    path: str
    store: Store
    params: Mapping[str, str] | None = None
    slim: Callable[[JSON], JSON] | None = None
    """Keeps only what the store reads (see :class:`vramguard.io.kube.Informer`)."""
    may_be_absent: bool = False
    """The API server may not serve it (404): an empty store, not an unhealthy watch."""
    name: str | None = None
    """Tells apart a second watch of the same collection (readiness and task names); default the resource."""


class ServiceRuntime:
    """The informers, registry and readiness of a service, and its supervised background tasks."""

    def __init__(
        self, client: KubeClient, watches: Sequence[Watch], *, registry: CollectorRegistry | None = None
    ) -> None:
        """Informers for ``watches`` (in order: the cluster model wants nodes and namespaces before pods)."""
        self.registry = registry if registry is not None else CollectorRegistry()
        metrics = WatchMetrics(self.registry)
        self.informers = [
            Informer(
                client, watch.path, watch.store, watch.params, watch.slim, metrics=metrics,
                may_be_absent=watch.may_be_absent,
            )
            for watch in watches
        ]
        self._names = [watch.name or informer.resource for watch, informer in zip(watches, self.informers, strict=True)]
        self.readiness = Readiness(
            {f"watch-{name}": informer.healthy for name, informer in zip(self._names, self.informers, strict=True)}
        )
        """Fails while any watch is unhealthy (not synced, or no progress for a while)."""
        self.tasks: dict[str, Coroutine[Any, Any, object]] = {}
        """Background tasks to supervise beside the watches (name -> coroutine)."""

    def synced(self) -> bool:
        """Whether every watch has listed once."""
        return all(informer.synced.is_set() for informer in self.informers)

    async def wait_synced(self) -> None:
        """Return once every watch has listed once."""
        for informer in self.informers:
            await informer.synced.wait()

    async def serve(self, server: Coroutine[Any, Any, None], *, may_finish: Collection[str] = ()) -> None:
        """Run ``server`` with the watches and :attr:`tasks`; a task that dies ends it (see ``supervise``)."""
        background: dict[str, Coroutine[Any, Any, object]] = {
            f"watch {informer.path}" + ("" if name == informer.resource else f" ({name})"): informer.run()
            for name, informer in zip(self._names, self.informers, strict=True)
        }
        background.update(self.tasks)
        await supervise(server, background, may_finish=may_finish)


async def reload_every(interval: float, reload: Callable[[], object], what: str = "the policy") -> NoReturn:
    """Call ``reload`` every ``interval`` seconds, forever; an exception is logged, not raised, so a
    bug in one reload neither stops later reloads nor (through supervision) the service."""
    while True:
        await asyncio.sleep(interval)
        try:
            reload()
        except Exception:
            logger.exception("unexpected error while reloading %s; the last good one stays in force", what)
