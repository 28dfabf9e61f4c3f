"""Running a server with the background tasks it depends on, and stopping when one of them dies.

The extender and the webhook serve from caches that informers keep in step with the API server.
If such a task ended (a bug: informers retry every failure themselves), the process would go on
serving ever staler state while looking alive. :func:`supervise` turns that into a clean exit with
an error, so that Kubernetes restarts the container and the caches are rebuilt from scratch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Coroutine, Mapping
from typing import Any

__all__ = ["TaskDied", "supervise"]

logger = logging.getLogger(__name__)


class TaskDied(Exception):
    """A supervised background task ended while the server was running."""

    def __init__(self, name: str, how: str) -> None:
        super().__init__(f"background task {name!r} {how}; exiting so that the service restarts")
        self.name = name
        self.how = how


async def supervise(
    server: Coroutine[Any, Any, None],
    background: Mapping[str, Coroutine[Any, Any, object]],
    *,
    may_finish: Collection[str] = (),
) -> None:
    """Run ``server`` and the ``background`` tasks (name -> coroutine) until ``server`` returns.

    Every background task must run as long as the server does, except those named in
    ``may_finish``, which may return (not raise) early. When a task ends otherwise, its error is
    logged with its traceback, the server is cancelled (it shuts down as on SIGTERM, readiness
    first), and :class:`TaskDied` is raised. When the server returns or raises, the background
    tasks are cancelled and awaited, and its outcome is this function's.
    """
    unknown = set(may_finish) - set(background)
    if unknown:
        raise ValueError(f"may_finish names no background task: {sorted(unknown)}")
    tasks = {asyncio.create_task(coro, name=name): name for name, coro in background.items()}
    serving = asyncio.create_task(server, name="server")
    watched: set[asyncio.Task[Any]] = {serving, *tasks}
    try:
        while True:
            done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            if serving in done:
                await serving  # its result, or its exception
                return
            for task in done:
                watched.discard(task)
                died = _how_it_ended(task, tasks[task], may_finish)
                if died is not None:
                    raise died
    finally:
        await _cancel_all([serving, *tasks])


def _how_it_ended(task: asyncio.Task[Any], name: str, may_finish: Collection[str]) -> TaskDied | None:
    if task.cancelled():
        logger.error("background task %r was cancelled while the server runs", name)
        return TaskDied(name, "was cancelled")
    error = task.exception()
    if error is not None:
        logger.error("background task %r failed", name, exc_info=error)
        return TaskDied(name, f"failed: {type(error).__name__}: {error}")
    if name in may_finish:
        return None
    logger.error("background task %r returned while the server runs", name)
    return TaskDied(name, "returned")


async def _cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel the tasks still running and wait for them; log (do not raise) errors they end with."""
    running = [task for task in tasks if not task.done()]
    for task in running:
        task.cancel()
    results = await asyncio.gather(*running, return_exceptions=True)
    for task, result in zip(running, results, strict=True):
        if isinstance(result, Exception):
            logger.error("task %r failed while stopping", task.get_name(), exc_info=result)
