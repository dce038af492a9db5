"""The background-task supervisor: restarts, backoff, the failure counter, clean cancel."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from isocost.gateway.supervise import supervise


def failures_counter() -> tuple[CollectorRegistry, Counter]:
    registry = CollectorRegistry()
    return registry, Counter("isocost_task_failures", "test", ["task"], registry=registry)


def failed(registry: CollectorRegistry, task: str) -> float:
    value = registry.get_sample_value("isocost_task_failures_total", {"task": task})
    return 0.0 if value is None else value


def restarts_logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == "task_failed"]


def test_a_failing_task_is_logged_counted_and_restarted_with_growing_capped_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry, counter = failures_counter()
    calls: list[int] = []
    running = asyncio.Event()

    async def flaky() -> None:
        calls.append(len(calls))
        if len(calls) <= 4:
            raise RuntimeError(f"boom {len(calls)}")
        running.set()
        await asyncio.Event().wait()  # healthy from the fifth start on

    async def scenario() -> None:
        task = supervise("flaky loop", flaky, counter, initial_backoff_s=0.1, max_backoff_s=0.4)
        await asyncio.wait_for(running.wait(), timeout=30)
        assert not task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger="isocost.gateway"):
        asyncio.run(scenario())
    assert len(calls) == 5
    assert failed(registry, "flaky loop") == 4
    records = restarts_logged(caplog)
    assert [vars(r)["error"] for r in records] == [f"RuntimeError: boom {i}" for i in (1, 2, 3, 4)]
    assert {vars(r)["task"] for r in records} == {"flaky loop"}
    assert [vars(r)["restart_in_s"] for r in records] == [0.1, 0.2, 0.4, 0.4]
    assert all(r.levelno == logging.ERROR and r.exc_info for r in records)


def test_a_long_healthy_run_resets_the_backoff(caplog: pytest.LogCaptureFixture) -> None:
    registry, counter = failures_counter()
    calls: list[int] = []
    done = asyncio.Event()

    async def fails_late_once() -> None:
        calls.append(len(calls))
        if len(calls) in (1, 2):
            raise ValueError("early")
        if len(calls) == 3:
            await asyncio.sleep(1.0)  # longer than max_backoff_s: a healthy run
            raise ValueError("late")
        done.set()
        await asyncio.Event().wait()

    async def scenario() -> None:
        task = supervise(
            "resets",
            fails_late_once,
            counter,
            kind="kind",
            initial_backoff_s=0.1,
            max_backoff_s=0.4,
        )
        await asyncio.wait_for(done.wait(), timeout=30)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger="isocost.gateway"):
        asyncio.run(scenario())
    assert [vars(r)["restart_in_s"] for r in restarts_logged(caplog)] == [0.1, 0.2, 0.1]
    assert failed(registry, "kind") == 3  # ``kind`` labels the counter, ``name`` the log
    assert failed(registry, "resets") == 0


@pytest.mark.parametrize("when", ["running", "backing_off"])
def test_cancelling_stops_it_cleanly_without_a_restart(
    when: str, caplog: pytest.LogCaptureFixture
) -> None:
    registry, counter = failures_counter()
    calls: list[int] = []
    started = asyncio.Event()

    async def loop() -> None:
        calls.append(len(calls))
        started.set()
        if when == "backing_off":
            raise RuntimeError("fails at once")
        await asyncio.Event().wait()

    async def scenario() -> asyncio.Task[None]:
        task = supervise("loop", loop, counter, initial_backoff_s=60, max_backoff_s=60)
        await asyncio.wait_for(started.wait(), timeout=30)  # and, failing, backing off
        task.cancel()
        results = await asyncio.gather(task, return_exceptions=True)
        assert isinstance(results[0], asyncio.CancelledError)
        return task

    with caplog.at_level(logging.INFO, logger="isocost.gateway"):
        task = asyncio.run(scenario())
    assert task.cancelled()
    assert calls == [0]  # never started again
    assert failed(registry, "loop") == (1 if when == "backing_off" else 0)
    assert len(restarts_logged(caplog)) == (1 if when == "backing_off" else 0)


def test_a_task_that_returns_is_done_not_restarted() -> None:
    _, counter = failures_counter()
    calls: list[int] = []

    async def once() -> None:
        calls.append(1)

    async def scenario() -> None:
        await supervise("once", once, counter)

    asyncio.run(scenario())
    assert calls == [1]


def test_a_factory_that_raises_before_its_coroutine_is_a_failure_too() -> None:
    registry, counter = failures_counter()
    calls: list[int] = []
    running = asyncio.Event()

    async def healthy() -> None:
        running.set()
        await asyncio.Event().wait()

    def factory() -> Coroutine[Any, Any, None]:
        calls.append(1)
        if len(calls) == 1:
            raise KeyError("no such replica")
        return healthy()

    async def scenario() -> None:
        task = supervise("factory", factory, counter, initial_backoff_s=0.01)
        await asyncio.wait_for(running.wait(), timeout=30)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert len(calls) == 2 and failed(registry, "factory") == 1
