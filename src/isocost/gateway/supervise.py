"""Long-lived background tasks that never die silently.

``supervise`` runs a coroutine in a task; when it raises anything but ``CancelledError``
the failure is logged once (task name, error), counted in
``isocost_task_failures_total{task=kind}``, and the coroutine is started afresh after a
backoff: ``initial_backoff_s``, doubled on each failure in a row, at most ``max_backoff_s``;
a run that lasted longer than ``max_backoff_s`` was healthy, so the next failure starts
over at ``initial_backoff_s``. Cancelling the task stops it, whether it runs or waits; a
coroutine that returns ends it (its work is done).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from prometheus_client import Counter

__all__ = ["supervise"]

log = logging.getLogger("isocost.gateway")

INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0


def supervise(
    name: str,
    factory: Callable[[], Coroutine[Any, Any, None]],
    failures: Counter,
    *,
    kind: str | None = None,
    initial_backoff_s: float = INITIAL_BACKOFF_S,
    max_backoff_s: float = MAX_BACKOFF_S,
) -> asyncio.Task[None]:
    """A task running ``factory()``, restarted after each failure; ``name`` is logged,
    ``kind`` (``name`` by default) labels the counter, so one label covers, say, the
    monitors of every replica."""
    label = failures.labels(kind or name)

    async def run() -> None:
        backoff_s = initial_backoff_s
        while True:
            started_at = time.monotonic()
            try:
                await factory()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if time.monotonic() - started_at > max_backoff_s:
                    backoff_s = initial_backoff_s
                label.inc()
                log.error(
                    "background task failed, restarting",
                    exc_info=exc,
                    extra={
                        "event": "task_failed",
                        "task": name,
                        "error": describe(exc),
                        "restart_in_s": backoff_s,
                    },
                )
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, max_backoff_s)

    return asyncio.create_task(run(), name=name)


def describe(exc: BaseException) -> str:
    """``Type: message`` of ``exc``, short enough for one log field."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
