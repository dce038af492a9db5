"""The live loop: read the gateway, let ``control`` decide, apply through an actuator.

Every ``interval_s`` one ``tick``:

1. reads ``/admin/snapshot`` (replicas, their GPU type, state and in-flight requests, the
   gateway's queue) and ``/metrics`` (``isocost_requests_total``: its growth is the
   interval's arrivals, its status-200 growth per replica the completions per GPU type);
   replicas on a GPU type no pool names are not the autoscaler's and are left alone, and
   one being stopped is already gone (it must not be undrained half-way through);
2. turns them into a ``control.Observation`` (a drained or removing replica, or one this
   loop is draining, is ``draining``; a start not yet seen in the gateway is ``pending``,
   and the first new replica of its GPU type that appears resolves it: that wait is the
   measured warm-up lead, fed back to the scaler) and asks the scaler, with ``now`` from
   the injected clock;
3. applies the decision unless it is a dry run: starts and drains run as tasks of their
   own, so a slow engine or a long drain never stalls the next decision;
4. posts its status to ``/admin/autoscaler`` (desired, ready, pending, draining, the
   forecast) for the gateway's dashboard; a gateway that refuses it is reported once per
   tick, the loop goes on.

A scale-in drains its victim through the gateway (no new work), waits until nothing is
in flight there or ``drain_deadline_s`` has passed, stops it through the actuator, then
removes it from the gateway: no request is killed by the autoscaler unless the deadline
ends its drain. Every action is retried with exponential backoff; each failure is a log
line and ``isocost_autoscale_failures_total``. A stop that fails for good undrains the
replica, so none is left half-drained.

GPU-hours and $ count every managed replica, pending ones included (their GPUs are held
while they warm up), between ticks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from isocost.autoscale._actuators import Actuator, ActuatorError
from isocost.autoscale._admin import GatewayError, answered_by_replica, slo_verdicts
from isocost.control import (
    AutoscaleConfig,
    Observation,
    PoolOffer,
    ReplicaState,
    ReplicaStatus,
    ScaleDecision,
    Scaler,
)

__all__ = ["AutoscaleLoop", "FleetGateway", "LoopMetrics", "Tick"]

log = logging.getLogger("isocost.autoscale")

_STATES: dict[str, ReplicaState] = {"drained": "draining", "removing": "draining"}
_FAILURES = (ActuatorError, GatewayError)


class FleetGateway(Protocol):
    """What the loop needs of the gateway (``AdminClient``; a fake in unit tests)."""

    async def snapshot(self) -> dict[str, Any]: ...
    async def metrics(self) -> str: ...
    async def drain(self, name: str) -> None: ...
    async def undrain(self, name: str) -> None: ...
    async def remove(self, name: str) -> None: ...
    async def post_status(self, status: Mapping[str, Any]) -> None: ...


class LoopMetrics:
    """The autoscaler's own Prometheus metrics, in a registry of their own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.desired = Gauge(
            "isocost_autoscale_desired_replicas", "Target, per GPU.", ["gpu"], registry=r
        )
        self.replicas = Gauge(
            "isocost_autoscale_replicas", "Replicas by state.", ["gpu", "state"], registry=r
        )
        self.forecast = Gauge(
            "isocost_autoscale_forecast_rps", "Peak arrivals over the lead.", registry=r
        )
        self.need = Gauge("isocost_autoscale_need_rps", "Forecast plus headroom.", registry=r)
        self.lead = Gauge(
            "isocost_autoscale_lead_seconds", "Last start-to-routable time.", ["gpu"], registry=r
        )
        self.gpu_hours = Counter("isocost_autoscale_gpu_hours", "GPU-hours held.", registry=r)
        self.usd = Counter("isocost_autoscale_usd", "Dollars spent on replicas.", registry=r)
        self.events = Counter(
            "isocost_autoscale_scale_events", "Decisions that changed the fleet.", registry=r
        )
        self.failures = Counter(
            "isocost_autoscale_failures",
            "Failed actuator or gateway actions (each retry counts).",
            ["action"],
            registry=r,
        )


@dataclass(frozen=True, slots=True)
class Tick:
    """One decision and the fleet it was made for."""

    decision: ScaleDecision
    observation: Observation
    gpu_hours: float  # since the loop started
    usd: float

    def count(self, state: ReplicaState) -> int:
        return sum(r.state == state for r in self.observation.replicas)


@dataclass(slots=True)
class _Pending:
    replica_id: str
    gpu: str
    started_s: float
    task: asyncio.Task[None] | None = None


class AutoscaleLoop:
    def __init__(
        self,
        scaler: Scaler,
        config: AutoscaleConfig,
        offers: Sequence[PoolOffer],
        gateway: FleetGateway,
        actuator: Actuator,
        *,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        metrics: LoopMetrics | None = None,
        dry_run: bool = False,
        attempts: int = 4,
        backoff_s: float = 0.5,
        poll_s: float = 0.25,
    ) -> None:
        self.scaler = scaler
        self.config = config
        self.offers = {o.gpu: o for o in offers}
        self.gateway = gateway
        self.actuator = actuator
        self.clock = clock
        self.sleep = sleep
        self.metrics = metrics or LoopMetrics()
        self.dry_run = dry_run
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.poll_s = poll_s
        self.leads: list[tuple[str, float]] = []  # (gpu, start -> routable seconds)
        self._pending: deque[_Pending] = deque()
        self._first_seen: dict[str, float] = {}
        self._draining: dict[str, asyncio.Task[None]] = {}
        self._stopping: set[str] = set()  # drained and idle: leaving, not to be undrained
        self._answered: dict[str, tuple[int, int]] | None = None
        self._verdicts: tuple[int, int] | None = None  # (met, judged) at the last tick
        self._last_s: float | None = None
        self._gpu_hours = 0.0
        self._usd = 0.0
        self._ids = itertools.count(1)

    # -- reading the fleet -------------------------------------------------------------

    async def _observe(self) -> Observation:
        now = self.clock()
        snapshot = await self.gateway.snapshot()
        metrics_text = await self.gateway.metrics()
        answered = answered_by_replica(metrics_text)
        verdicts = slo_verdicts(metrics_text)
        last_met, last_judged = self._verdicts or verdicts
        met, judged = verdicts[0] - last_met, verdicts[1] - last_judged  # < 0: it restarted
        self._verdicts = verdicts
        rows = [
            row
            for row in snapshot["replicas"]
            if row.get("gpu") in self.offers and row["name"] not in self._stopping
        ]
        for row in rows:
            if row["name"] not in self._first_seen:
                self._first_seen[row["name"]] = now
                self._resolve_pending(row["gpu"], now)
        replicas = [
            ReplicaStatus(
                row["name"],
                row["gpu"],
                "draining" if row["name"] in self._draining else _STATES.get(row["state"], "ready"),
                self._first_seen[row["name"]],
                int(row["in_flight"]),
            )
            for row in rows
        ]
        replicas += [
            ReplicaStatus(p.replica_id, p.gpu, "pending", p.started_s) for p in self._pending
        ]
        previous = self._answered if self._answered is not None else answered
        self._answered = answered
        gpu_of = {row["name"]: row["gpu"] for row in rows}
        completions: dict[str, int] = {}
        for name, (_, ok) in answered.items():
            if name in gpu_of:
                gained = max(0, ok - previous.get(name, (0, 0))[1])  # 0 after a restart
                completions[gpu_of[name]] = completions.get(gpu_of[name], 0) + gained
        arrivals = sum(t for t, _ in answered.values()) - sum(t for t, _ in previous.values())
        queued = sum(int(pool["queue_depth"]) for pool in snapshot["pools"]) + sum(
            int(row["engine_waiting"] or 0) for row in rows
        )
        self._account(now, replicas)
        return Observation(
            now=now,
            interval_s=self.config.interval_s,
            arrivals=max(arrivals, 0),
            queued=queued,
            attainment=met / judged if judged > 0 else None,
            settled=max(judged, 0),
            completions=completions,
            replicas=replicas,
        )

    def _resolve_pending(self, gpu: str, now: float) -> None:
        """A new replica of ``gpu`` is routable: the oldest start of that type led to it."""
        for pending in self._pending:
            if pending.gpu == gpu:
                self._pending.remove(pending)
                lead = now - pending.started_s
                self.leads.append((gpu, lead))
                self.scaler.replica_ready(gpu, lead)
                self.metrics.lead.labels(gpu).set(lead)
                log.info(
                    "replica routable",
                    extra={"event": "replica_routable", "gpu": gpu, "lead_s": round(lead, 2)},
                )
                return

    def _account(self, now: float, replicas: Sequence[ReplicaStatus]) -> None:
        if self._last_s is not None:
            hours = (now - self._last_s) / 3600
            gpus = sum(self.offers[r.gpu].gpus_per_replica for r in replicas) * hours
            usd = sum(self.offers[r.gpu].usd_per_hour for r in replicas) * hours
            self._gpu_hours += gpus
            self._usd += usd
            self.metrics.gpu_hours.inc(gpus)
            self.metrics.usd.inc(usd)
        self._last_s = now

    # -- one decision --------------------------------------------------------------------

    async def tick(self) -> Tick:
        observation = await self._observe()
        decision = self.scaler.decide(observation)
        if not self.dry_run:
            await self._apply(decision, observation)
        self._report(decision, observation)
        await self._publish(decision, observation)
        return Tick(decision, observation, self._gpu_hours, self._usd)

    async def _publish(self, decision: ScaleDecision, observation: Observation) -> None:
        """The tick's figures on the gateway's dashboard (best effort: one try)."""
        states = [r.state for r in observation.replicas]
        status = {
            "desired": sum(decision.targets.values()),
            "ready": states.count("ready"),
            "pending": states.count("pending"),
            "draining": states.count("draining"),
            "forecast_rps": round(decision.forecast_rps, 4),
            "interval_s": self.config.interval_s,
            "dry_run": self.dry_run,
        }
        try:
            await self.gateway.post_status(status)
        except GatewayError as exc:
            self.metrics.failures.labels("status").inc()
            log.warning(
                "autoscaler status not posted",
                extra={"event": "autoscale_failure", "action": "status", "error": str(exc)},
            )

    def _report(self, decision: ScaleDecision, observation: Observation) -> None:
        m = self.metrics
        m.forecast.set(decision.forecast_rps)
        m.need.set(decision.need_rps)
        m.events.inc(decision.changes)
        for gpu, target in decision.targets.items():
            m.desired.labels(gpu).set(target)
            for state in ("ready", "pending", "draining"):
                count = sum(r.gpu == gpu and r.state == state for r in observation.replicas)
                m.replicas.labels(gpu, state).set(count)

    async def _apply(self, decision: ScaleDecision, observation: Observation) -> None:
        gpu_of = {r.replica_id: r.gpu for r in observation.replicas}
        for gpu, count in decision.start.items():
            for _ in range(count):
                pending = _Pending(f"pending-{gpu}-{next(self._ids)}", gpu, self.clock())
                self._pending.append(pending)
                pending.task = asyncio.create_task(self._start(pending, decision.targets[gpu]))
        for name in decision.undrain:
            await self._undrain(name)
        for name in decision.drain:
            cancelled = [p for p in self._pending if p.replica_id == name]
            for start in cancelled:  # a start not yet routable serves nothing: cancel it
                self._pending.remove(start)
                if start.task is not None:
                    start.task.cancel()
            if not cancelled:
                gpu = gpu_of[name]
                self._draining[name] = asyncio.create_task(
                    self._drain_and_stop(name, gpu, decision.targets[gpu])
                )

    async def _undrain(self, name: str) -> None:
        """Take a draining replica back (it is warm): its drain ends where it stands."""
        task = self._draining.pop(name, None)
        if task is not None:
            task.cancel()
        with contextlib.suppress(*_FAILURES):  # reported; the next tick sees it drained
            await self._attempt("undrain", lambda: self.gateway.undrain(name))

    # -- actions -------------------------------------------------------------------------

    async def _attempt(self, action: str, call: Callable[[], Awaitable[None]]) -> None:
        """``call`` until it succeeds, ``attempts`` times with doubling waits; the last
        failure is raised."""
        for attempt in range(1, self.attempts + 1):
            try:
                await call()
                return
            except _FAILURES as exc:
                self.metrics.failures.labels(action).inc()
                log.warning(
                    "autoscale action failed",
                    extra={
                        "event": "autoscale_failure",
                        "action": action,
                        "attempt": attempt,
                        "error": str(exc),
                    },
                )
                if attempt == self.attempts:
                    raise
                await self.sleep(self.backoff_s * 2 ** (attempt - 1))

    async def _start(self, pending: _Pending, desired: int) -> None:
        try:
            await self._attempt("start", lambda: self.actuator.start(pending.gpu, desired))
        except _FAILURES:
            if pending in self._pending:
                self._pending.remove(pending)  # given up: it will not come

    async def _drain_and_stop(self, name: str, gpu: str, desired: int) -> None:
        try:
            await self._attempt("drain", lambda: self.gateway.drain(name))
            deadline = self.clock() + self.config.drain_deadline_s
            while self.clock() < deadline and await self._in_flight(name) > 0:
                await self.sleep(self.poll_s)
            self._stopping.add(name)
            try:
                await self._attempt("stop", lambda: self.actuator.stop(name, gpu, desired))
            except _FAILURES:
                await self._attempt("undrain", lambda: self.gateway.undrain(name))
                return
            await self._attempt("remove", lambda: self.gateway.remove(name))
            self._first_seen.pop(name, None)
        except _FAILURES:
            pass  # reported by each attempt; the next decision sees the fleet as it is
        finally:
            self._draining.pop(name, None)
            self._stopping.discard(name)

    async def _in_flight(self, name: str) -> int:
        rows: list[Mapping[str, Any]] = (await self.gateway.snapshot())["replicas"]
        return sum(int(row["in_flight"]) for row in rows if row["name"] == name)

    # -- running -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, on_tick: Callable[[Tick], None]) -> None:
        """A tick every ``interval_s`` until ``stop``; a gateway that cannot be read skips
        the tick (reported), it does not end the loop."""
        try:
            while not stop.is_set():
                try:
                    on_tick(await self.tick())
                except GatewayError as exc:
                    self.metrics.failures.labels("observe").inc()
                    log.warning(
                        "gateway unreadable",
                        extra={
                            "event": "autoscale_failure",
                            "action": "observe",
                            "error": str(exc),
                        },
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.config.interval_s)
        finally:
            await self.settle()

    async def settle(self) -> None:
        """Wait for the starts and drains under way (a drain is never abandoned half-way)."""
        tasks = [p.task for p in self._pending if p.task is not None]
        await asyncio.gather(*tasks, *self._draining.values(), return_exceptions=True)
