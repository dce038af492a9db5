"""The live loop: read the gateway, let ``control`` decide, apply through an actuator.

The gateway is one ``FleetGateway``: an ``AdminClient``, or a ``GatewaySet`` of several
read and acted on as one (merged, summed, each action on all). Every ``interval_s`` one
``tick``:

1. reads ``/admin/snapshot`` (replicas, their GPU type, state and in-flight requests, the
   gateway's queue) and ``/metrics`` (``isocost_requests_total``: its growth is the
   interval's arrivals, its status-200 growth per replica the completions per GPU type);
   replicas on a GPU type no pool names are not the autoscaler's and are left alone, and
   one being stopped is already gone (it must not be undrained half-way through); an
   answer of the wrong shape, a missing key or a count that is no count fails the round
   (reported, the next one as scheduled), as an unreachable gateway does; of several
   gateways, one that cannot be read is reported and the round goes on with the others;
2. turns them into a ``control.Observation`` (a drained or removing replica, or one this
   loop is draining, is ``draining``; one the gateway's breaker has held out for
   ``replace_ejected_after_s`` after it served is ``ejected``, and replaced; one held out
   for less, or that never served, is ``pending``; a start not yet seen in the gateway is
   ``pending``,
   and the first new replica of its GPU type that appears resolves it: that wait is the
   measured warm-up lead, fed back to the scaler) and asks the scaler, with ``now`` from
   the injected clock;
3. applies the decision unless it is a dry run: starts and drains run as tasks of their
   own, so a slow engine or a long drain never stalls the next decision;
4. posts its status to ``/admin/autoscaler`` (desired, ready, pending, draining, the
   forecast, the instance its drains name) for the gateway's dashboard; a gateway that
   refuses it is reported once per tick, the loop goes on.

A scale-in tells the actuator (``draining``: the ``kubernetes`` one marks the Pod),
drains its victim through the gateway (no new work), waits until nothing is in flight
there or ``drain_deadline_s`` has passed, stops it through the actuator, then removes it
from the gateway: no request is killed by the autoscaler unless the deadline ends its
drain. With several gateways the drain is on each, and idle means idle on each: one that
cannot be read (or a ``serve --workers`` worker that did not answer) holds the stop.
Every action is retried with exponential backoff; each failure is a log line and
``isocost_autoscale_failures_total``. A stop that fails for good undrains the replica,
so none is left half-drained; what still fails after the retries (an undrain, a removal,
a drain whose answer was lost) is tried again once a round until the gateway shows it
done. A gateway that cannot be read during a drain is waited out, past the deadline too:
its end, and the stop, need a reading that shows the drain still this loop's. A start
whose replica never shows up is given up after a few cold starts (it would otherwise
count as capacity for good).

What an earlier autoscaler left of the replicas it started or drained is taken over: a
drain it left is finished, a start it cut short is stopped. Each drain names its
autoscaler in the gateway (``drained_by``: ``autoscale:<instance>``), and a drain whose
instance no longer posts its status (not in the snapshot's ``live_instances``, for
``_OWNER_QUIET_INTERVALS`` intervals since this loop started) was left by one that is
gone, whatever the actuator; the actuators know more of their own (``Actuator.inherited``:
the ``local`` actuator's engines outlive a SIGKILL, the ``kubernetes`` actuator's marks on
Pods too). A drain named by a live instance is never taken (a rolling update runs two
autoscalers for a while), nor one that names none (an operator's). A drain that someone
else undrains while it waits (an operator taking the replica back) is given up there:
the replica serves, so it is neither stopped nor drained again by that drain (taken back
through one of several gateways, it is undrained on the others next round). So is one
drained again in another name while it waits (an operator's drain, or a successor that
took this autoscaler for gone because its status posts failed): the other stops it.

GPU-hours and $ count every managed replica, pending ones included (their GPUs are held
while they warm up), between ticks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, get_args

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge

from isocost.autoscale._actuators import Actuator, ActuatorError
from isocost.autoscale._admin import (
    SERVING_STATES,
    FleetGateway,
    FleetSnapshot,
    GatewayCounters,
    GatewayError,
    ReplicaRow,
    read_snapshot,
)
from isocost.control import (
    AutoscaleConfig,
    Observation,
    PoolOffer,
    ReplicaState,
    ReplicaStatus,
    ScaleDecision,
    Scaler,
)

__all__ = ["AutoscaleLoop", "LoopMetrics", "Tick"]

log = logging.getLogger("isocost.autoscale")

_STATES: dict[str, ReplicaState] = {"drained": "draining", "removing": "draining"}
_FAILURES = (ActuatorError, GatewayError)
# A start still not seen in the gateway this many cold starts (or intervals, if more) after
# its actuator finished is given up: a platform that never delivers must not hold the pool.
_ROUTABLE_WAITS = 3
# A drain is taken over from an instance only once this loop has run this many intervals:
# a live one posts its status each interval, so the gateway would have shown it.
_OWNER_QUIET_INTERVALS = 3
_DRAIN_MARK = "autoscale:"  # + the instance: a drain's ``by``
# How a scale-in's wait for its victim ended (``isocost_autoscale_drains_total{outcome}``).
_DrainEnd = Literal["idle", "deadline", "undrained", "taken", "shutdown"]
_GIVEN_UP: dict[_DrainEnd, str] = {  # ends that leave the replica to someone else
    "undrained": "drain given up: the replica was undrained",
    "taken": "drain given up: the replica was drained again by someone else",
}


def _drain_owner(row: ReplicaRow) -> str | None:
    """The autoscaler instance whose drain ``row`` is in (None: no autoscaler's, or a
    gateway too old to say)."""
    by = row.drained_by or ""
    return by.removeprefix(_DRAIN_MARK) if by.startswith(_DRAIN_MARK) else None


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
        self.drains = Counter(
            "isocost_autoscale_drains",
            "Scale-in drains by how their wait ended: idle (stopped), deadline (stopped with"
            " requests in flight), undrained (taken back by someone else), taken (drained"
            " again in someone else's name), shutdown (undrained as the autoscaler"
            " stopped).",
            ["outcome"],
            registry=r,
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
        self._ejected_since: dict[str, float] = {}  # held out by the gateway's breaker
        self._served: set[str] = set()  # seen serving: an ejection of these is a failure
        self._unlisted_stops: list[asyncio.Task[None]] = []  # its starts cut short
        self._draining: dict[str, asyncio.Task[None]] = {}
        self._stopping: set[str] = set()  # drained and idle: leaving, not to be undrained
        self._gone: set[str] = set()  # stopped: out of the fleet until the gateway drops it
        self._rows: Sequence[ReplicaRow] = ()  # the gateway's replicas at the last look
        self._undrain_owed: set[str] = set()  # a drain given up: undrained once seen drained
        self._shutdown = asyncio.Event()  # set as ``run`` ends: drains still waiting undrain
        self._cold_start_s = {p.gpu: p.cold_start_s for p in config.pools}
        self._counters: GatewayCounters | None = None  # at the last tick
        self._last_s: float | None = None
        self._gpu_hours = 0.0
        self._usd = 0.0
        self._ids = itertools.count(1)
        self.instance = secrets.token_hex(6)  # names this loop's drains and status
        self._mark = _DRAIN_MARK + self.instance  # its drains' ``by``
        self._started_s: float | None = None  # the first round's clock (None: none yet)

    # -- reading the fleet -------------------------------------------------------------

    async def _observe(self) -> Observation:
        now = self.clock()
        snapshot = read_snapshot(await self.gateway.snapshot())
        counters = await self.gateway.counters()
        for where, why in snapshot.gaps().items():
            self._failed("observe", "gateway unreadable", gateway=where, error=why)
        self._rows = snapshot.replicas
        await self._reconcile(snapshot)
        if not self.dry_run:
            await self._take_over(snapshot, now)
        growth = counters.since(self._counters or counters)
        self._counters = counters
        leaving = self._stopping | self._gone
        rows = [r for r in snapshot.replicas if r.gpu in self.offers and r.name not in leaving]
        for row in rows:
            if row.name not in self._first_seen:
                self._first_seen[row.name] = now
                self._resolve_pending(row.gpu, now)
        self._expire_pending(now)
        self._track_ejections(rows, counters.answered, now)
        replicas = [
            ReplicaStatus(
                row.name, row.gpu, self._state(row, now), self._first_seen[row.name], row.in_flight
            )
            for row in rows
        ]
        replicas += [
            ReplicaStatus(p.replica_id, p.gpu, "pending", p.started_s) for p in self._pending
        ]
        gpu_of = {row.name: row.gpu for row in rows}
        arrivals = 0
        completions: dict[str, int] = {}
        for name, (total, ok) in growth.answered.items():
            arrivals += total
            if (gpu := gpu_of.get(name)) is not None:
                completions[gpu] = completions.get(gpu, 0) + ok
        met, judged = growth.verdicts
        queued = sum(pool.queue_depth for pool in snapshot.pools) + sum(
            row.engine_waiting or 0 for row in rows
        )
        self._account(now, replicas)
        return Observation(
            now=now,
            interval_s=self.config.interval_s,
            arrivals=arrivals,
            queued=queued,
            attainment=met / judged if judged > 0 else None,
            settled=judged,
            completions=completions,
            replicas=replicas,
        )

    def _track_ejections(
        self, rows: Sequence[ReplicaRow], answered: Mapping[str, tuple[int, int]], now: float
    ) -> None:
        """Since when each replica has been ejected, and which have ever served (seen
        healthy by this loop, or answered a request with 200 at the gateway: a restarted
        autoscaler knows those too)."""
        self._served |= {row.name for row in rows if row.state == "healthy"}
        self._served |= {name for name, (_, ok) in answered.items() if ok > 0}
        self._served &= {row.name for row in rows}
        self._ejected_since = {
            row.name: self._ejected_since.get(row.name, now)
            for row in rows
            if row.state == "ejected"
        }

    async def _take_over(self, snapshot: FleetSnapshot, now: float) -> None:
        """Finish what an earlier autoscaler (SIGKILLed, say) left of the replicas it
        started or drained (its drains named in the gateway, ``Actuator.inherited``): one
        left drained has its drain resumed, to its stop; one never listed in the gateway
        (its start was cut short) is stopped, on the first round only (later, one of this
        loop's own starts may be on its way). An actuator that cannot tell now is asked
        again next round."""
        first = self._started_s is None
        if self._started_s is None:
            self._started_s = now
        rows = snapshot.replicas
        try:
            inherited = await self.actuator.inherited(rows)
        except ActuatorError as exc:
            self._failed("inherit", "an earlier autoscaler's replicas unknown", error=str(exc))
            inherited = set()
        live = set(snapshot.autoscaler.live_instances) if snapshot.autoscaler else set()
        quiet = now - self._started_s >= _OWNER_QUIET_INTERVALS * self.config.interval_s
        for marked in rows:
            owner = _drain_owner(marked)
            if owner is None or owner == self.instance:
                continue
            if owner in live:
                inherited.discard(marked.name)  # still its own
            elif quiet and marked.state == "drained":
                inherited.add(marked.name)
        if not inherited:
            return
        listed = {row.name: row for row in rows}
        busy = self._draining.keys() | self._stopping | self._gone | self._undrain_owed
        for name in sorted(inherited - busy):
            row = listed.get(name)
            if row is not None and row.state == "drained" and row.gpu in self.offers:
                log.info(
                    "drain taken over", extra={"event": "autoscale_drain_adopted", "replica": name}
                )
                self._draining[name] = asyncio.create_task(self._drain_and_stop(name, row.gpu))
            elif row is None and first:
                stop = partial(self.actuator.stop, name, "", 0)
                self._unlisted_stops.append(asyncio.create_task(self._attempt("stop", stop)))

    def _state(self, row: ReplicaRow, now: float) -> ReplicaState:
        """The scaler's view of a gateway replica. One ejected for less than
        ``replace_ejected_after_s``, or that never served, is ``pending``: no capacity
        now, expected back (a breaker's blip, a replica still warming), so none is
        started for it; a broken start must not make the pool grow to its max. One
        ejected for longer after serving is ``ejected``: replaced."""
        if row.name in self._draining:
            return "draining"
        if row.state != "ejected":
            return _STATES.get(row.state, "ready")
        held_out_s = now - self._ejected_since[row.name]
        if row.name in self._served and held_out_s >= self.config.replace_ejected_after_s:
            return "ejected"
        return "pending"

    async def _reconcile(self, snapshot: FleetSnapshot) -> None:
        """Finish what a drain left after its retries, one try each per round: a stopped
        replica the gateway still lists is removed, one left drained (on any of several
        gateways) is undrained; a name the gateway no longer lists (or shows done) needs
        nothing more, unless one of several gateways could not be read: it may still
        list it."""
        state = {row.name: row.state for row in snapshot.replicas}
        partly = {row.name for row in snapshot.replicas if row.partly_drained}
        if not snapshot.gaps():
            self._gone &= state.keys()
            self._undrain_owed = {
                n for n in self._undrain_owed if state.get(n) == "drained" or n in partly
            }
        for name in sorted(self._gone):
            if state.get(name) != "removing":
                with contextlib.suppress(*_FAILURES):
                    await self._attempt("remove", partial(self.gateway.remove, name), tries=1)
        for name in sorted(self._undrain_owed - self._draining.keys()):
            with contextlib.suppress(*_FAILURES):
                await self._attempt("undrain", partial(self.gateway.undrain, name), tries=1)
                self._undrain_owed.discard(name)

    def _expire_pending(self, now: float) -> None:
        """Give up the starts whose actuator finished long ago but whose replica never
        showed up: counted as pending for good, they would keep the pool from growing."""
        for pending in list(self._pending):
            wait_s = _ROUTABLE_WAITS * max(self._cold_start_s[pending.gpu], self.config.interval_s)
            done = pending.task is None or pending.task.done()
            if done and now - pending.started_s > wait_s:
                self._pending.remove(pending)
                self._failed(
                    "routable",
                    "started replica never became routable",
                    gpu=pending.gpu,
                    waited_s=round(now - pending.started_s, 2),
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
            "ejected": states.count("ejected"),
            "forecast_rps": round(decision.forecast_rps, 4),
            "interval_s": self.config.interval_s,
            "dry_run": self.dry_run,
            "instance": self.instance,
        }
        try:
            await self.gateway.post_status(status)
        except GatewayError as exc:
            self._failed("status", "autoscaler status not posted", error=str(exc))

    def _report(self, decision: ScaleDecision, observation: Observation) -> None:
        m = self.metrics
        m.forecast.set(decision.forecast_rps)
        m.need.set(decision.need_rps)
        m.events.inc(decision.changes)
        for gpu, target in decision.targets.items():
            m.desired.labels(gpu).set(target)
            for state in get_args(ReplicaState):
                count = sum(r.gpu == gpu and r.state == state for r in observation.replicas)
                m.replicas.labels(gpu, state).set(count)

    async def _apply(self, decision: ScaleDecision, observation: Observation) -> None:
        gpu_of = {r.replica_id: r.gpu for r in observation.replicas}
        for gpu, count in decision.start.items():
            for _ in range(count):
                pending = _Pending(f"pending-{gpu}-{next(self._ids)}", gpu, self.clock())
                self._pending.append(pending)
                pending.task = asyncio.create_task(self._start(pending))
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
                self._draining[name] = asyncio.create_task(self._drain_and_stop(name, gpu))

    async def _undrain(self, name: str) -> None:
        """Take a draining replica back (it is warm): its drain ends where it stands."""
        task = self._draining.pop(name, None)
        if task is not None:
            task.cancel()
        with contextlib.suppress(*_FAILURES):  # reported; the next tick sees it drained
            await self._attempt("undrain", lambda: self.gateway.undrain(name))

    # -- actions -------------------------------------------------------------------------

    def _failed(self, action: str, message: str, *, warn: bool = True, **fields: Any) -> None:
        """One failure of ``action``: counted in ``isocost_autoscale_failures_total``, and
        a warning unless ``warn`` is False (a repeat the first one already told)."""
        self.metrics.failures.labels(action).inc()
        if warn:
            log.warning(message, extra={"event": "autoscale_failure", "action": action, **fields})

    async def _attempt(
        self, action: str, call: Callable[[], Awaitable[None]], tries: int | None = None
    ) -> None:
        """``call`` until it succeeds, ``tries`` (default ``attempts``) times with doubling
        waits; the last failure is raised."""
        tries = tries or self.attempts
        for attempt in range(1, tries + 1):
            try:
                await call()
                return
            except _FAILURES as exc:
                self._failed(action, "autoscale action failed", attempt=attempt, error=str(exc))
                if attempt == tries:
                    raise
                await self.sleep(self.backoff_s * 2 ** (attempt - 1))

    def _holding(self, gpu: str, leaving: str | None = None) -> int:
        """The replicas of ``gpu`` holding a machine as far as this loop knows, now: each
        the gateway listed at the last look, ejected and drained ones too (their machines
        run), but those stopped since and ``leaving``; and the starts on their way. This
        is the count an actuator that sets one (a Deployment's) is given. The decision's
        target is not: it leaves out ejected and drained replicas, and a drain's stop
        comes minutes after it, so that a count set from it would stop replicas started
        since, or the one ejected whose replacement is starting, beside the victim."""
        listed = sum(
            row.gpu == gpu and row.name not in self._gone and row.name != leaving
            for row in self._rows
        )
        return listed + sum(p.gpu == gpu for p in self._pending)

    async def _start(self, pending: _Pending) -> None:
        async def start() -> None:
            await self.actuator.start(pending.gpu, self._holding(pending.gpu))

        try:
            await self._attempt("start", start)
        except _FAILURES:
            if pending in self._pending:
                self._pending.remove(pending)  # given up: it will not come

    async def _drain_and_stop(self, name: str, gpu: str) -> None:
        """Drain, wait until idle, stop, remove. What fails for good is left to
        ``_reconcile``, so the replica ends serving or gone, never half-drained."""
        try:
            with contextlib.suppress(*_FAILURES):  # reported; then only this loop knows it
                await self._attempt("draining", partial(self.actuator.draining, name, gpu), 1)
            try:
                drain = partial(self.gateway.drain, name, self._mark)
                await self._attempt("drain", drain)
            except _FAILURES:
                self._undrain_owed.add(name)  # its answer may be what was lost, not the drain
                raise
            ended = await self._wait_idle(name)
            self.metrics.drains.labels(ended).inc()
            if ended == "deadline":
                log.warning(
                    "drain deadline passed: stopping the replica with requests in flight",
                    extra={
                        "event": "autoscale_drain_deadline",
                        "replica": name,
                        "deadline_s": self.config.drain_deadline_s,
                    },
                )
            if ended == "shutdown":  # serve again, not left drained
                await self._serve_again(name)
                return
            if ended in _GIVEN_UP:
                log.info(
                    _GIVEN_UP[ended],
                    extra={
                        "event": "autoscale_drain_taken_back",
                        "replica": name,
                        "outcome": ended,
                    },
                )
                return
            self._stopping.add(name)
            try:
                await self._attempt("stop", partial(self._stop, name, gpu))
            except _FAILURES:
                await self._serve_again(name)
                return
            self._gone.add(name)  # stopped: never undrained, removed until the gateway agrees
            self._first_seen.pop(name, None)
            await self._attempt("remove", partial(self.gateway.remove, name))
        except _FAILURES:
            pass  # reported by each attempt; ``_reconcile`` tries again each round
        finally:
            self._draining.pop(name, None)
            self._stopping.discard(name)

    async def _stop(self, name: str, gpu: str) -> None:
        await self.actuator.stop(name, gpu, self._holding(gpu, leaving=name))

    async def _serve_again(self, name: str) -> None:
        """Undrain a replica whose drain is given up; owed to ``_reconcile`` until done."""
        self._undrain_owed.add(name)
        await self._attempt("undrain", partial(self.gateway.undrain, name))
        self._undrain_owed.discard(name)

    async def _wait_idle(self, name: str) -> _DrainEnd:
        """Until nothing is in flight on ``name`` (``idle``) or the drain deadline
        (``deadline``): stop it; until someone else undrains it (``undrained``: it serves,
        theirs now; stopped once idle, it would cut the requests sent to it since) or
        drains it again in their own name (``taken``: an operator's now, or another
        autoscaler's that took this one for gone, as one whose status posts fail looks;
        both stopping it would set a count twice); or until the loop shuts down first.
        A gateway that cannot be read meanwhile is waited out (each failed read counted,
        the first of an outage logged), the deadline too: unknown is not idle, no reason
        to abandon the drain, and no leave to stop a replica that may be someone else's
        by now. A shutdown is: a drain can take ``drain_deadline_s`` (10 minutes by
        default), far past the grace a process manager gives before SIGKILL, which would
        leave the replica drained for good."""
        deadline = self.clock() + self.config.drain_deadline_s
        unreadable = False
        while True:
            if self._shutdown.is_set():
                return "shutdown"
            try:
                snapshot = read_snapshot(await self.gateway.snapshot())
                if gaps := snapshot.gaps():  # idle needs every gateway's (worker's) reading
                    raise GatewayError("; ".join(f"{where}: {why}" for where, why in gaps.items()))
                row = next((r for r in snapshot.replicas if r.name == name), None)
                if row is not None and row.state in SERVING_STATES:
                    if row.partly_drained:  # serving through one gateway: through all
                        self._undrain_owed.add(name)
                    return "undrained"
                if row is not None and row.drained_by not in (self._mark, msgspec.UNSET):
                    return "taken"
                if row is None or row.in_flight == 0:
                    return "idle"
                if self.clock() >= deadline:
                    return "deadline"
                unreadable = False
            except GatewayError as exc:
                self._failed(
                    "drain_poll",
                    "gateway unreadable during a drain",
                    warn=not unreadable,  # the first failed read of an outage
                    replica=name,
                    error=str(exc),
                )
                unreadable = True
            await self.sleep(self.poll_s)

    # -- running -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, on_tick: Callable[[Tick], None]) -> None:
        """A tick every ``interval_s`` until ``stop``; a gateway that cannot be read skips
        the tick (reported), it does not end the loop."""
        try:
            while not stop.is_set():
                try:
                    on_tick(await self.tick())
                except GatewayError as exc:
                    self._failed("observe", "gateway unreadable", error=str(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.config.interval_s)
        finally:
            self._shutdown.set()
            await self.settle()

    async def settle(self) -> None:
        """Wait for the starts and drains under way (a drain that is still waiting for its
        replica to go idle undrains it once the loop shuts down; one that reached the stop
        finishes), then one last try at what they left undone."""
        tasks = [p.task for p in self._pending if p.task is not None]
        await asyncio.gather(
            *tasks, *self._draining.values(), *self._unlisted_stops, return_exceptions=True
        )
        if self._gone or self._undrain_owed:
            with contextlib.suppress(*_FAILURES):
                await self._reconcile(read_snapshot(await self.gateway.snapshot()))
