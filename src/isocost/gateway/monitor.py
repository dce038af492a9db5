"""The replica monitor: per upstream one task that probes, scrapes and publishes.

Each task scrapes ``/metrics`` every ``scrape_interval_ms`` and probes ``/health`` every
``health.interval_ms`` (a real one-token completion instead when live requests opened the
breaker), mirrors the breaker into the router's health, wakes the queue, and publishes the
upstream's gauges, until the upstream is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import msgspec

from isocost.gateway.health import BreakerState
from isocost.gateway.metrics import GatewayMetrics
from isocost.gateway.routing import Router
from isocost.gateway.scrape import ScrapeError, parse_engine_metrics
from isocost.gateway.upstreams import Upstream
from isocost.runtime.config import GatewayConfig, HealthConfig

__all__ = ["Monitor"]


class Monitor:
    """The probe and scrape loops of every upstream, one task each."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        router: Router,
        metrics: GatewayMetrics,
        config: GatewayConfig,
    ) -> None:
        self.session = session
        self.router = router
        self.metrics = metrics
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.configure(config)

    def configure(self, config: GatewayConfig) -> None:
        """Take the health settings for new upstreams and the scrape interval for all."""
        self._health = config.health
        self._scrape_interval_s = config.scrape_interval_ms / 1000

    def watch(self, upstream: Upstream) -> None:
        self._tasks[upstream.url] = asyncio.create_task(self._run(upstream, self._health))

    def unwatch(self, upstream: Upstream) -> None:
        """Stop watching ``upstream`` and withdraw the gauges published for it."""
        task = self._tasks.pop(upstream.url, None)
        if task is not None:
            task.cancel()
        for gauge in (
            self.metrics.replica_healthy,
            self.metrics.in_flight,
            self.metrics.scrape_age,
        ):
            with contextlib.suppress(KeyError):  # never published
                gauge.remove(upstream.pool, upstream.name)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    async def _run(self, upstream: Upstream, health: HealthConfig) -> None:
        """Scrape ``/metrics`` and probe ``/health`` until the upstream is removed."""
        timeout = aiohttp.ClientTimeout(total=health.timeout_ms / 1000)
        next_probe = 0.0
        while True:
            now = time.monotonic()
            if now >= next_probe:
                next_probe = now + health.interval_ms / 1000
                await self._probe(upstream, timeout)
            await self._scrape(upstream, timeout)
            self.router.sync_health(upstream, time.monotonic())
            self.router.wake_all()
            self._publish(upstream)
            await asyncio.sleep(self._scrape_interval_s)

    async def _probe(self, upstream: Upstream, timeout: aiohttp.ClientTimeout) -> None:
        """``GET /health``, or a one-token completion when live requests opened the breaker."""
        breaker = upstream.breaker
        started_at = time.monotonic()
        state = breaker.state(started_at)
        if state is BreakerState.OPEN:
            return  # cooling down: nothing a probe could change
        live = breaker.needs_live_probe and state is BreakerState.HALF_OPEN
        try:
            if live:
                body = msgspec.json.encode(
                    {"model": upstream.pool, "prompt": "ping", "max_tokens": 1}
                )
                request = self.session.post(
                    upstream.url + "/v1/completions",
                    data=body,
                    headers={"Content-Type": "application/json", **upstream.upstream_headers},
                    timeout=timeout,
                )
            else:
                request = self.session.get(upstream.url + "/health", timeout=timeout)
            async with request as resp:
                await resp.read()
                ok = resp.status == 200
                reason = f"probe status {resp.status}"
        except aiohttp.ClientConnectorError:
            breaker.record_failure(time.monotonic(), "probe refused", hard=True, probe=True)
            return
        except (TimeoutError, aiohttp.ClientError) as exc:
            ok, reason = False, f"probe {type(exc).__name__}"
        if ok:
            breaker.record_success(time.monotonic(), probe_started_at=started_at)
        else:
            breaker.record_failure(time.monotonic(), reason, probe=True)

    async def _scrape(self, upstream: Upstream, timeout: aiohttp.ClientTimeout) -> None:
        try:
            async with self.session.get(upstream.url + "/metrics", timeout=timeout) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise ScrapeError(f"/metrics status {resp.status}")
            scraped = parse_engine_metrics(text)
        except aiohttp.ClientConnectorError:
            upstream.scrape_error = "refused"
            upstream.breaker.record_failure(
                time.monotonic(), "/metrics refused", hard=True, probe=True
            )
            return
        except (TimeoutError, aiohttp.ClientError, ScrapeError, UnicodeDecodeError) as exc:
            upstream.scrape_error = str(exc) or type(exc).__name__
            return
        now = time.monotonic()
        upstream.last_scrape = scraped
        upstream.scraped_at = now
        upstream.scrape_error = None
        self.router.apply_scrape(upstream, scraped, now)

    def _publish(self, upstream: Upstream) -> None:
        if self._tasks.get(upstream.url) is not asyncio.current_task():
            return  # removed meanwhile: its gauges are gone and stay gone
        now = time.monotonic()
        labels = (upstream.pool, upstream.name)
        self.metrics.replica_healthy.labels(*labels).set(1 if upstream.routable(now) else 0)
        self.metrics.in_flight.labels(*labels).set(upstream.num_in_flight)
        age = upstream.scrape_age_s(now)
        if age is not None:
            self.metrics.scrape_age.labels(*labels).set(age)
        if upstream.name in self.router.replicas:
            state = self.router.replicas.get(upstream.name)
            self.metrics.ttft_factor.labels(*labels).set(state.ttft_factor)
            self.metrics.itl_factor.labels(*labels).set(state.itl_factor)
            self.metrics.prefill_duty.labels(*labels).set(state.prefill_duty(now))
