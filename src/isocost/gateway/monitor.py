"""The replica monitor: per upstream one supervised task that probes, scrapes and publishes
(and a second that follows its engine's KV-cache events, when it has ``kv_events``).

While an upstream's breaker is closed its task scrapes ``/metrics`` every
``scrape_interval_ms`` and probes ``/health`` every ``health.interval_ms``. While it is
open the task sends nothing and sleeps until the cool-down ends (``Breaker.probe_due_at``:
``open_ms``, doubled per failed probe, at most 30 s), then probes once (with a real
one-token completion when live requests opened the breaker): a dead replica costs one
connection attempt per cool-down, not two per interval. After each round the task mirrors
the breaker into the router's health, wakes the queue after a fresh scrape, and publishes
the upstream's gauges, until the upstream is removed.

Nothing a replica sends may stop its monitor: a round that raises is logged (once while
the same failure repeats), counted in ``isocost_task_failures_total{task="monitor"}`` and
recorded as the upstream's ``scrape_error``, and the next round comes as scheduled; the
task runs under ``supervise`` for anything outside a round. A change of an upstream's
``scrape_error`` is logged too (``scrape_error``, ``scrape_recovered``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import aiohttp
import msgspec

from isocost.gateway.health import BreakerState
from isocost.gateway.kvevents import follow_kv_events
from isocost.gateway.metrics import GatewayMetrics
from isocost.gateway.routing import Router
from isocost.gateway.supervise import describe, supervise
from isocost.gateway.upstreams import Upstream, connect_failure
from isocost.openai.http import read_capped
from isocost.runtime.config import GatewayConfig, HealthConfig
from isocost.runtime.scrape import (
    MAX_BODY_BYTES,
    ScrapeError,
    decode_exposition,
    parse_engine_metrics,
)

__all__ = ["Monitor"]

log = logging.getLogger("isocost.gateway")

# the session does not decompress (the forwarder relays bytes as sent), so ask for none
_IDENTITY = {"Accept-Encoding": "identity"}


@dataclass(slots=True)
class _Watch:
    """One upstream's monitor state: when checks are due, what was last logged."""

    probe_at: float = 0.0
    scrape_at: float = 0.0
    logged_scrape_error: str | None = None
    logged_failure: str | None = None
    ejections: int = 0  # the breaker's, as last logged
    ejected: bool = False  # logged ejected, not yet logged back


class Monitor:
    """The probe and scrape loops of every upstream, one supervised task each."""

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
        self._event_tasks: dict[str, asyncio.Task[None]] = {}
        self.configure(config)

    def configure(self, config: GatewayConfig) -> None:
        """Take the health settings for new upstreams and the scrape interval for all."""
        self._health = config.health
        self._scrape_interval_s = config.scrape_interval_ms / 1000

    def watch(self, upstream: Upstream) -> None:
        """Start the upstream's checks; its in-flight gauge reads the live count at each
        scrape (a value mirrored once per round would lag a request's start and end)."""
        health = self._health
        self.metrics.in_flight.labels(upstream.pool, upstream.name).set_function(
            lambda: upstream.num_in_flight
        )
        self._tasks[upstream.url] = supervise(
            f"monitor {upstream.name}",
            lambda: self._run(upstream, health),
            self.metrics.task_failures,
            kind="monitor",
        )
        endpoint = upstream.config.kv_events
        if endpoint is not None:
            self._event_tasks[upstream.url] = supervise(
                f"kv events {upstream.name}",
                lambda: follow_kv_events(upstream, endpoint, self.router, self.metrics),
                self.metrics.task_failures,
                kind="kv_events",
            )

    def unwatch(self, upstream: Upstream) -> None:
        """Stop watching ``upstream`` and withdraw the gauges published for it."""
        for tasks in (self._tasks, self._event_tasks):
            task = tasks.pop(upstream.url, None)
            if task is not None:
                task.cancel()
        for gauge in (
            self.metrics.replica_healthy,
            self.metrics.in_flight,
            self.metrics.scrape_age,
            self.metrics.view_divergence,
            self.metrics.ejections,
        ):
            with contextlib.suppress(KeyError):  # never published
                gauge.remove(upstream.pool, upstream.name)

    async def stop(self) -> None:
        tasks = [*self._tasks.values(), *self._event_tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._event_tasks.clear()

    async def _run(self, upstream: Upstream, health: HealthConfig) -> None:
        """Rounds of checks, each when due, until the upstream is removed."""
        timeout = aiohttp.ClientTimeout(total=health.timeout_ms / 1000)
        watch = _Watch()
        while True:
            try:
                wake_at = await self._round(upstream, timeout, health.interval_ms / 1000, watch)
                watch.logged_failure = None
            except Exception as exc:  # whatever the replica sent: this round only
                self._round_failed(upstream, watch, exc)
                wake_at = time.monotonic() + self._scrape_interval_s
            await asyncio.sleep(max(0.0, wake_at - time.monotonic()))

    async def _round(
        self,
        upstream: Upstream,
        timeout: aiohttp.ClientTimeout,
        probe_every_s: float,
        watch: _Watch,
    ) -> float:
        """The checks now due (none while the breaker is open); when the next are due."""
        breaker = upstream.breaker
        now = time.monotonic()
        state = breaker.state(now)
        if state is not BreakerState.OPEN:
            if state is BreakerState.HALF_OPEN or now >= watch.probe_at:
                watch.probe_at = now + probe_every_s
                await self._probe(upstream, timeout)
            now = time.monotonic()
            if breaker.allows_traffic(now) and now >= watch.scrape_at:
                watch.scrape_at = now + self._scrape_interval_s
                fresh = await self._scrape(upstream, timeout)
                _log_scrape_change(upstream, watch)
                if fresh:
                    self.router.wake_all()
        now = time.monotonic()
        self.router.sync_health(upstream, now)
        self._log_ejection(upstream, watch, now)
        self._publish(upstream)
        cooled_at = breaker.probe_due_at(now)
        return cooled_at if cooled_at is not None else min(watch.probe_at, watch.scrape_at)

    def _log_ejection(self, upstream: Upstream, watch: _Watch, now: float) -> None:
        """Log and count each time the breaker opened since the last round (by live traffic
        or a check), with why, and its closing again: the one place an operator reads
        why a replica stopped taking work."""
        breaker = upstream.breaker
        opened = breaker.ejections - watch.ejections
        if opened > 0:
            watch.ejections, watch.ejected = breaker.ejections, True
            self.metrics.ejections.labels(upstream.pool, upstream.name).inc(opened)
            log.warning(
                "replica ejected",
                extra={"event": "replica_ejected", "replica": upstream.name,
                       "error": breaker.last_error},
            )  # fmt: skip
        elif watch.ejected and breaker.state(now) is BreakerState.CLOSED:
            watch.ejected = False
            log.info(
                "replica healthy again",
                extra={"event": "replica_restored", "replica": upstream.name},
            )

    def _round_failed(self, upstream: Upstream, watch: _Watch, exc: Exception) -> None:
        """Count the failed round, record it as the scrape error, log it unless repeated."""
        failure = describe(exc)
        self.metrics.task_failures.labels("monitor").inc()
        upstream.scrape_error = f"monitor round failed: {failure}"
        if failure != watch.logged_failure:
            watch.logged_failure = failure
            log.error(
                "replica monitor round failed",
                exc_info=exc,
                extra={"event": "monitor_round_failed", "replica": upstream.name, "error": failure},
            )

    async def _probe(self, upstream: Upstream, timeout: aiohttp.ClientTimeout) -> None:
        """``GET /health``, or a one-token completion when live requests opened the breaker."""
        breaker = upstream.breaker
        started_at = time.monotonic()
        live = breaker.needs_live_probe and breaker.state(started_at) is BreakerState.HALF_OPEN
        self.metrics.replica_checks.labels(upstream.pool, "live_probe" if live else "probe").inc()
        try:
            if live:
                body = msgspec.json.encode(
                    {"model": upstream.pool, "prompt": "ping", "max_tokens": 1}
                )
                request = self.session.post(
                    upstream.url + "/v1/completions",
                    data=body,
                    headers={
                        "Content-Type": "application/json",
                        **_IDENTITY,
                        **upstream.upstream_headers,
                    },
                    timeout=timeout,
                )
            else:
                request = self.session.get(
                    upstream.url + "/health", headers=_IDENTITY, timeout=timeout
                )
            async with request as resp:
                await resp.read()
                ok = resp.status == 200
                reason = f"probe status {resp.status}"
        except aiohttp.ClientConnectorError as exc:
            failure = f"probe {connect_failure(exc)}"
            breaker.record_failure(time.monotonic(), failure, hard=True, probe=True)
            return
        except (TimeoutError, aiohttp.ClientError) as exc:
            ok, reason = False, f"probe {type(exc).__name__}"
        if ok:
            breaker.record_success(time.monotonic(), probe_started_at=started_at)
        else:
            breaker.record_failure(time.monotonic(), reason, probe=True)

    async def _scrape(self, upstream: Upstream, timeout: aiohttp.ClientTimeout) -> bool:
        """Read and apply ``/metrics``, its problems as ``scrape_error``; whether figures came."""
        self.metrics.replica_checks.labels(upstream.pool, "scrape").inc()
        try:
            async with self.session.get(
                upstream.url + "/metrics", headers=_IDENTITY, timeout=timeout
            ) as resp:
                if resp.status != 200:
                    raise ScrapeError(f"/metrics status {resp.status}")
                text = decode_exposition(await _read_capped(resp), resp.charset)
            scrape = parse_engine_metrics(text)
        except aiohttp.ClientConnectorError as exc:
            upstream.scrape_error = connect_failure(exc)
            upstream.breaker.record_failure(
                time.monotonic(), f"/metrics {upstream.scrape_error}", hard=True, probe=True
            )
            return False
        except (TimeoutError, aiohttp.ClientError, ScrapeError) as exc:
            upstream.scrape_error = str(exc) or type(exc).__name__
            return False
        now = time.monotonic()
        upstream.last_scrape = scrape.metrics
        upstream.scraped_at = now
        upstream.scrape_error = "; ".join(scrape.problems) or None
        self.router.apply_scrape(upstream, scrape.metrics, now)
        return True

    def _publish(self, upstream: Upstream) -> None:
        if self._tasks.get(upstream.url) is not asyncio.current_task():
            return  # removed meanwhile: its gauges are gone and stay gone
        now = time.monotonic()
        labels = (upstream.pool, upstream.name)
        self.metrics.replica_healthy.labels(*labels).set(1 if upstream.routable(now) else 0)
        age = upstream.scrape_age_s(now)
        if age is not None:
            self.metrics.scrape_age.labels(*labels).set(age)
        if upstream.name in self.router.replicas:
            state = self.router.replicas.get(upstream.name)
            self.metrics.ttft_factor.labels(*labels).set(state.ttft_factor)
            self.metrics.itl_factor.labels(*labels).set(state.itl_factor)
            self.metrics.ttft_error.labels(*labels).set(state.ttft_error)
            for term, seconds in state.prefill_terms_s.items():
                self.metrics.prefill_term.labels(*labels, term).set(seconds)
            self.metrics.itl_error.labels(*labels).set(state.itl_error)
            self.metrics.prefill_duty.labels(*labels).set(state.prefill_duty(now))


def _log_scrape_change(upstream: Upstream, watch: _Watch) -> None:
    """Log the upstream's scrape problem when it appears or changes, and when it clears."""
    error = upstream.scrape_error
    if error == watch.logged_scrape_error:
        return
    watch.logged_scrape_error = error
    if error is None:
        log.info(
            "replica scrape recovered",
            extra={"event": "scrape_recovered", "replica": upstream.name},
        )
    else:
        log.warning(
            "replica scrape problem",
            extra={"event": "scrape_error", "replica": upstream.name, "error": error},
        )


async def _read_capped(resp: aiohttp.ClientResponse) -> bytes:
    """The body of a ``/metrics`` answer, refused past ``MAX_BODY_BYTES`` or compressed."""
    encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding != "identity":
        raise ScrapeError(f"/metrics sent {encoding[:40]!r}-encoded, not plain text")
    body = await read_capped(resp, MAX_BODY_BYTES)
    if body is None:
        raise ScrapeError(f"/metrics body over {MAX_BODY_BYTES} bytes")
    return body
