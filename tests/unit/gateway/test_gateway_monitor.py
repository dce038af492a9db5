"""The replica monitor survives anything one round raises, and its tasks are supervised.

A ``Gateway`` runs in this process against a small upstream on 127.0.0.1 whose ``/health``
status the test sets; the fault is injected into the gateway's own code (the parser, the
gauge publishing, the monitor task itself, the config watcher), since no replica input is
meant to reach an exception any more. In every case the replica stays probed: ejected when
``/health`` fails, readmitted when it passes; the failure is logged and counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from isocost.core.catalog import Catalog
from isocost.gateway import monitor
from isocost.gateway.lifecycle import Gateway
from isocost.gateway.monitor import Monitor
from isocost.gateway.routing import Router
from isocost.runtime.config import parse_config

METRICS = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"


class Upstream:
    """An upstream whose ``/health`` answers ``health``."""

    def __init__(self) -> None:
        self.health = 200
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def health(_: web.Request) -> web.Response:
            return web.Response(status=self.health)

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=METRICS)

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def config_text(url: str, open_ms: int = 300) -> str:
    return f"""
scrape_interval_ms: 50
pools:
  - model: llama-3.1-8b
    replicas:
      - {{url: '{url}', gpu: a100-80g}}
health: {{interval_ms: 50, timeout_ms: 500, open_ms: {open_ms}, failure_threshold: 2}}
"""


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def failures(gateway: Gateway, task: str) -> float:
    value = gateway.metrics.registry.get_sample_value("isocost_task_failures_total", {"task": task})
    return 0.0 if value is None else value


def events(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == event]


async def still_probed(gateway: Gateway, upstream: Upstream) -> None:
    """``/health`` failing ejects the replica; passing again readmits it."""
    (replica,) = gateway.replicas.values()
    now = time.monotonic
    upstream.health = 500
    await until(lambda: replica.health_state(now()) == "ejected", "ejection")
    upstream.health = 200
    await until(lambda: replica.health_state(now()) == "healthy", "readmission")


def run(
    tmp_path: Path, scenario: Callable[[Gateway, Upstream], Awaitable[None]], **config: Any
) -> None:
    async def main() -> None:
        upstream = Upstream()
        await upstream.start()
        path = tmp_path / "gateway.yaml"
        path.write_text(config_text(upstream.url, **config))
        gateway = Gateway(parse_config(path.read_text(), str(path)), Catalog.builtin(), path)
        await gateway.start()
        try:
            await scenario(gateway, upstream)
        finally:
            await gateway.stop()
            await upstream.stop()

    asyncio.run(main())


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO, logger="isocost.gateway"):
        yield caplog


def broken(*_: object, **__: object) -> Any:
    raise RuntimeError("injected fault")


@pytest.mark.parametrize("where", ["parse", "publish", "sync_health"])
def test_a_round_that_raises_is_logged_once_counted_and_the_next_round_comes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture, where: str
) -> None:
    if where == "parse":
        monkeypatch.setattr(monitor, "parse_engine_metrics", broken)
    elif where == "publish":
        monkeypatch.setattr(Monitor, "_publish", broken)
    else:
        monkeypatch.setattr(Router, "sync_health", broken)

    async def scenario(gateway: Gateway, upstream: Upstream) -> None:
        (replica,) = gateway.replicas.values()
        await until(lambda: failures(gateway, "monitor") >= 5, "several failed rounds")
        assert replica.scrape_error == "monitor round failed: RuntimeError: injected fault"
        failed = events(logs, "monitor_round_failed")
        assert len(failed) == 1  # the same failure, round after round: one line
        assert vars(failed[0])["error"] == "RuntimeError: injected fault"
        await still_probed(gateway, upstream)

    run(tmp_path, scenario)
    assert not events(logs, "task_failed")  # the rounds failed, the task never did


def test_a_monitor_task_that_dies_is_restarted_by_its_supervisor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    starts: list[int] = []
    run_rounds = Monitor._run

    async def dies_once(self: Monitor, *args: Any) -> None:
        starts.append(1)
        if len(starts) == 1:
            raise RuntimeError("monitor task crashed")
        await run_rounds(self, *args)

    monkeypatch.setattr(Monitor, "_run", dies_once)

    async def scenario(gateway: Gateway, upstream: Upstream) -> None:
        (replica,) = gateway.replicas.values()
        await until(lambda: replica.scraped_at is not None, "a scrape after the restart")
        assert failures(gateway, "monitor") == 1
        await still_probed(gateway, upstream)

    run(tmp_path, scenario)
    (failed,) = events(logs, "task_failed")
    assert vars(failed)["task"].startswith("monitor ") and len(starts) == 2


def test_a_config_watcher_that_dies_is_restarted_and_applies_later_edits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    starts: list[int] = []
    watch = Gateway._watch_config

    async def dies_once(self: Gateway) -> None:
        starts.append(1)
        if len(starts) == 1:
            raise RuntimeError("watcher crashed")
        await watch(self)

    monkeypatch.setattr(Gateway, "_watch_config", dies_once)

    async def scenario(gateway: Gateway, upstream: Upstream) -> None:
        await until(lambda: len(starts) == 2, "the watcher's restart")
        assert gateway.config_path is not None
        gateway.config_path.write_text(config_text(upstream.url, open_ms=400))
        await until(lambda: gateway.config.health.open_ms == 400, "the edit applied")

    run(tmp_path, scenario)
    assert [vars(r)["task"] for r in events(logs, "task_failed")] == ["config_watcher"]
