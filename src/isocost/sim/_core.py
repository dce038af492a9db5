"""The discrete-event cluster simulator: engine models behind the real scheduling brain.

Algorithm. One heap of events ordered by ``(time, phase, sequence)``; ``sequence`` is this
simulator's own counter, so same-time ties resolve the same way in every run. Handlers
push new events; the loop only pops and dispatches. Phases at one instant, in order:

0. ``FAULT``: a replica fails, recovers, changes slowdown, or becomes ready after its
   cold start.
1. ``ENGINE``: a replica's engine model is advanced to now; its first tokens and
   completions travel back to the gateway, arriving ``network_delay_s`` later.
2. ``HOOK``: the gateway sees a first token (``on_first_token``), a completion
   (``on_complete(ok=True, output_tokens=...)``) or a failed connection
   (``on_complete(ok=False)``, then a retry); a completion lets the most urgent queued request
   try again (late binding).
3. ``SCRAPE``: the gateway reads every engine's metrics (``apply_scrapes``); between
   scrapes the shadow state knows engines only through its own hooks, as in the gateway.
   An engine is read in place (``EngineModel.observe``) unless its wake is due, and only
   engines that had work since they were last idle are read again.
4. ``ARRIVAL``: a request reaches the gateway; ``policy.schedule(request, replicas, now)``
   is called exactly as the gateway calls it (a retry excludes the replicas that failed
   it), through the gateway's own late-binding ``dispatch.Dispatcher``. ADMIT:
   ``on_dispatch(decision=...)`` and the request reaches the replica ``network_delay_s``
   later; QUEUE: it waits in the dispatcher's queue until a completion, a failure, a
   replica ready or a scrape frees room, its deadline, or the queue timeout; REJECT: it
   ends rejected.
5. ``DELIVER``: the request enters the replica's engine (advanced to now first).
6. ``SAMPLE``: per-replica load is recorded for plots.
7. ``CONTROL``: an autoscaling ``controller`` (``sim._autoscale``) looks at the fleet and
   starts (``start_replica``: routable after a cold start), drains (``set_draining``) or
   stops (``stop_replica``; a drain waits until nothing is in flight there) replicas.
   Its ``dormant`` replicas wait for a start.

Engines are advanced lazily: only when a request is delivered, or at
``EngineModel.quiet_until()``, the earliest time they could emit an event.
A replica decoding a steady batch is therefore woken around its completions, and the
decode run between them is applied as one jump; the cost of a run grows with events
(requests, completions, scrapes), not with decode steps.

An ``audit`` hook (``sim._audit``, ``--audit-admission``) is asked at each SLO-admission
rejection (REJECT ``deadline`` from the policy) whether to admit the request after all;
the audit's forked replays say yes and run until it and the requests running beside it
settle.

Prefill/decode disaggregation (a fleet with replica roles, or ``disaggregation`` set in
the cluster): the gateway asks ``scheduling.disagg.choose_pair`` instead of the policy
alone. A split request's two legs enter the shadow state at once; the prefill leg (one
output token) runs on P, whose prefix cache serves and keeps its prompt; its reply
reaches the gateway, which relays the request to D (two network legs) while D pulls the
KV of the tokens it lacks over the cluster's link (``core.links.kv_transfer_s``); D admits
it with that KV present (``RequestSpec.kv_ready_tokens``: it needs the KV room, computes
only the last prompt token, and caches the blocks), and decodes every output token. The
user's first token is D's, so TTFT includes P's queue, the prefill and the transfer. P
frees the prompt's KV when its leg finishes (it stays in P's prefix cache), not when D
has pulled it: P's KV pressure is understated by the transfer time. A fleet without
roles runs exactly as before.

Invariant: every arrival ends exactly once, completed or rejected (a failed attempt is
retried up to ``max_retries`` times, then rejected as ``failed``).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import numpy as np

from isocost.core.links import Link, link
from isocost.core.slo import SloTargets
from isocost.engine.model import EngineModel
from isocost.engine.records import EngineEvent, Finished, FirstToken, RequestSpec
from isocost.engine.records import RequestState as EngineRequest
from isocost.prefix.hashing import BLOCK_TOKENS, ROOT_HASH
from isocost.scheduling.contract import ReplicaSpec, RequestView
from isocost.scheduling.decision import Decision, RejectReason
from isocost.scheduling.disagg import DisaggMode, PairDecision, choose_pair
from isocost.scheduling.dispatch import Dispatcher
from isocost.scheduling.framework import Policy
from isocost.scheduling.state import ReplicaSet
from isocost.sim._cluster import ClusterConfig, SimReplica
from isocost.workload import WorkloadRequest, prefix_block_hashes

__all__ = ["AdmissionHook", "Controller", "SimRecord", "SimResult", "Simulator", "block_hashes"]

FAULT, ENGINE, HOOK, SCRAPE, ARRIVAL, DELIVER, SAMPLE, CONTROL = range(8)
_FIRST, _DONE, _FAILED, _TIMEOUT, _LEG_DONE = range(5)  # hook kinds


def block_hashes(request: WorkloadRequest, block_tokens: int = BLOCK_TOKENS) -> tuple[int, ...]:
    """Chained hashes of the prompt's full blocks, from its segments (no text rendered):
    equal hashes exactly where two prompts share the whole prefix, as token hashes would."""
    return prefix_block_hashes(request.segments, block_tokens, ROOT_HASH)


@dataclass(slots=True)
class SimRecord:
    """What happened to one arrival (times are the simulator's, seen at the gateway)."""

    request: WorkloadRequest
    replica_id: str | None = None  # the replica of the last attempt
    attempts: int = 0
    first_token_s: float | None = None
    finished_s: float | None = None
    output_tokens: int = 0
    prefix_hit_tokens: int = 0  # engine prefix-cache hit at the last admission
    preemptions: int = 0
    rejected: str | None = None  # reason, when rejected
    failed_on: tuple[str, ...] = ()  # replicas whose attempt broke: retries avoid them
    hashes: tuple[int, ...] | None = None  # the prompt's block hashes, while it is unsettled
    counterfactual: tuple[float, float] | None = None  # audited rejection: TTFT, E2E admitted
    held_s: float | None = None  # when SLO admission held it first (``dispatch``)
    disaggregated: bool = False  # the last attempt was split into prefill and decode legs
    prefill_replica_id: str | None = None  # its prefill replica, when split
    transfer_s: float = 0.0  # its KV transfer, when split
    prefill_queue: int = 0  # requests waiting at P, and at D, when it was split
    decode_queue: int = 0

    @property
    def settled(self) -> bool:
        return self.finished_s is not None or self.rejected is not None


@dataclass(slots=True)
class SimResult:
    """One policy's run over one request list."""

    policy: str
    records: list[SimRecord]
    replica_ids: list[str]
    busy_s: list[float]  # per replica, engine busy time over the run
    prefix_queries: int  # tokens looked up in engine prefix caches
    prefix_hits: int
    preemptions: int
    end_s: float  # simulated time of the last event
    wall_s: float
    num_events: int
    sample_s: list[float] = field(default_factory=list)
    load_samples: list[list[int]] = field(default_factory=list)  # [sample][replica]


@dataclass(slots=True)
class _SimulatedReplica:
    """A replica while the run goes: its engine model (built from its ``SimReplica``) and
    what is in flight there."""

    config: SimReplica
    index: int  # position in the simulator's replica order (its column in the readings)
    engine: EngineModel | None = None  # None: not started, failed or cold-starting
    in_flight: dict[str, tuple[SimRecord, EngineRequest]] = field(default_factory=dict)
    wake_s: float = math.inf  # the pending ENGINE event's time; others are stale
    epoch: int = 0  # bumped on failure, so deliveries to the old engine fail
    starts: int = 0  # controller starts; a stop bumps it, so a cancelled start never readies
    busy_s: float = 0.0  # totals of retired engines (failed ones, and all at the end)
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0


class AdmissionHook(Protocol):
    """What the simulator asks at each SLO-admission rejection, and when SLO admission
    holds a request for the first time (``sim._audit``)."""

    def admit_instead(
        self, simulator: Simulator, record: SimRecord, view: RequestView
    ) -> Decision | None:
        """The decision to admit ``record`` with after all, or None to reject it."""
        ...

    def settled(self, record: SimRecord) -> None:
        """In a replay (``Simulator.replaying``): ``record`` settled."""
        ...

    def abandon(self) -> None:
        """A replay's run ended before the hook ended it."""
        ...


_Event = tuple[float, int, int, object]  # (time, phase, sequence, payload)
_Hook = tuple[int, str, int | str]  # (kind, attempt id, output tokens | failure reason)
_Delivery = tuple[_SimulatedReplica, RequestView, SimRecord, int]  # (..., replica epoch)
_Fault = tuple[str, _SimulatedReplica, float]  # (action, replica, factor | start number)


@dataclass(frozen=True, slots=True)
class _PrefillLeg:
    """A split request's prefill leg in flight, and where its decode leg goes next."""

    record: SimRecord
    decode_view: RequestView
    decode: _SimulatedReplica
    epoch: int  # the decode replica's at the split
    transfer_s: float


class Controller(Protocol):
    """An autoscaler driving the simulator (``sim._autoscale``)."""

    interval_s: float

    def tick(self, simulator: Simulator) -> None:
        """One control interval ends now."""
        ...

    def arrived(self, record: SimRecord) -> None: ...

    def settled(self, record: SimRecord) -> None: ...

    def ready(self, replica_id: str, now: float) -> None:
        """A replica it started is routable."""
        ...


class Simulator:
    """One run: a cluster, a policy and a request list (see the module docstring)."""

    def __init__(
        self,
        cluster: ClusterConfig,
        replicas: Sequence[SimReplica],
        policy: Policy,
        requests: Sequence[WorkloadRequest],
        *,
        model: str,
        slo: SloTargets | None = None,
        sample_interval_s: float | None = None,
        on_progress: Callable[[float], None] | None = None,
        audit: AdmissionHook | None = None,
        controller: Controller | None = None,
        dormant: Collection[str] = (),
    ) -> None:
        self.policy = policy
        self.controller = controller
        self.model = model
        self.slo = slo  # when set, each request carries its TTFT target as a deadline
        self.delay_s = cluster.network_delay_ms / 1000.0
        self.scrape_s = cluster.scrape_interval_ms / 1000.0
        self.max_retries = cluster.max_retries
        self.sample_interval_s = sample_interval_s
        self.on_progress = on_progress
        self.audit = audit  # asked at each SLO-admission rejection and first hold
        self.replaying = False  # a forked replay: settles go to the audit, which ends it
        self.shadow = ReplicaSet(block_tokens=BLOCK_TOKENS)
        self.shadow.set_prefill_fit(cluster.prefill_fit)
        self.shadow.add_listener(policy)
        self.disaggregation = _disaggregation(cluster, replicas)  # None: plain scheduling
        self.link: Link = link(cluster.link)
        self._pairs: dict[str, PairDecision] = {}  # the latest pair chosen, by attempt id
        self._legs: dict[str, _PrefillLeg] = {}  # by prefill leg id
        self.dispatcher: Dispatcher[SimRecord] = Dispatcher(
            cluster.queue_size,
            cluster.queue_timeout_ms / 1000.0,
            schedule=self._schedule,
            bind=self._bind,
            reject=self._refuse,
        )
        self.replicas = {r.replica_id: _SimulatedReplica(r, i) for i, r in enumerate(replicas)}
        # Engine readings, a column per replica (running, waiting, KV usage, prefix-cache
        # queries and hits), refreshed only for the replicas in ``_live``: an idle engine's
        # reading cannot change until a request reaches it.
        self._readings = np.zeros((5, len(self.replicas)))
        self._up = np.zeros(len(self.replicas), dtype=bool)  # engine running, in the shadow
        self._slots = np.zeros(len(self.replicas), dtype=np.int64)  # shadow slot of each
        self._live: dict[int, _SimulatedReplica] = {}
        self.records = [SimRecord(r) for r in requests]
        self._heap: list[_Event] = []
        self._seq = 0
        self._now = 0.0
        self._num_events = 0
        self._unsettled = len(self.records)
        self._attempts: dict[str, SimRecord] = {}  # live attempt id -> record
        self._waiting: dict[str, SimRecord] = {}  # attempt id -> record, while scheduled
        self._sessions: dict[str, list[SimRecord]] = {}  # turns held behind their previous
        self._session_busy: set[str] = set()
        self._samples_s: list[float] = []
        self._samples: list[list[int]] = []
        for replica in self.replicas.values():  # those starting at 0 run already
            if replica.config.replica_id in dormant:
                continue
            start = replica.config.start_s
            ready_s = start + replica.config.cold_start_s if start > 0 else 0.0
            self._push(ready_s, FAULT, ("ready", replica, 0.0))
        for event in cluster.events:
            self._push(
                event.at_s, FAULT, (event.action, self.replicas[event.replica], event.factor)
            )
        for record in self.records:
            self._push(record.request.arrival_s, ARRIVAL, record)
        if self.scrape_s > 0:
            self._push(self.scrape_s, SCRAPE, None)
        if sample_interval_s:
            self._push(0.0, SAMPLE, None)
        if controller is not None:
            self._push(controller.interval_s, CONTROL, None)

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> SimResult:
        started = time.perf_counter()
        heap = self._heap
        handlers: tuple[Callable[[object], None], ...] = (
            self._on_fault,
            self._on_engine,
            self._on_hook,
            self._on_scrape,
            self._on_arrival,
            self._on_deliver,
            self._on_sample,
            self._on_control,
        )
        try:
            while heap and self._unsettled:
                now, phase, _, payload = heapq.heappop(heap)
                self._now = now
                self._num_events += 1
                handlers[phase](payload)
                if not self._num_events & 0xFFF and self.on_progress is not None:
                    self.on_progress(now)
        finally:
            if self.replaying:  # a replay never returns into its parent's callers
                assert self.audit is not None
                self.audit.abandon()
        if self.on_progress is not None:
            self.on_progress(self._now)
        return self._result(time.perf_counter() - started)

    @property
    def now(self) -> float:
        return self._now

    def in_flight_on(self, replica_id: str) -> list[SimRecord]:
        """The requests dispatched to ``replica_id`` and not yet back, in dispatch order."""
        return [r for r in self._attempts.values() if r.replica_id == replica_id]

    def queued(self) -> int:
        """Requests waiting: in the gateway's queue, and in the engines as last scraped."""
        waiting = self._readings[1][self._up]
        return len(self.dispatcher) + int(waiting.sum())

    def start_replica(self, replica_id: str, cold_start_s: float) -> None:
        """Start a stopped (or dormant) replica: routable ``cold_start_s`` from now."""
        replica = self.replicas[replica_id]
        assert replica.engine is None, f"{replica_id} is running"
        replica.starts += 1
        if replica_id in self.shadow:
            self.shadow.set_draining(replica_id, False)
        self._push(self._now + cold_start_s, FAULT, ("started", replica, float(replica.starts)))

    def set_draining(self, replica_id: str, draining: bool) -> None:
        """Draining: the brain sends no new work there; what is in flight finishes."""
        self.shadow.set_draining(replica_id, draining)

    def stop_replica(self, replica_id: str) -> None:
        """Stop a replica, or cancel its pending start; what is still in flight there
        fails over to others (a drain waits until nothing is)."""
        replica = self.replicas[replica_id]
        replica.starts += 1
        self._on_fault(("fail", replica, 0.0))

    def in_flight_counts(self) -> dict[str, int]:
        """Per replica, the requests dispatched there and not yet back."""
        counts: dict[str, int] = {}
        for record in self._attempts.values():
            if record.replica_id is not None:
                counts[record.replica_id] = counts.get(record.replica_id, 0) + 1
        return counts

    def _on_control(self, _: object) -> None:
        assert self.controller is not None
        self.controller.tick(self)
        self._push(self._now + self.controller.interval_s, CONTROL, None)

    def _push(self, at_s: float, phase: int, payload: object) -> None:
        heapq.heappush(self._heap, (at_s, phase, self._seq, payload))
        self._seq += 1

    # -- gateway side ------------------------------------------------------------------

    def _on_arrival(self, payload: object) -> None:
        record = cast(SimRecord, payload)
        session = record.request.session_id
        if session in self._session_busy and record.request.turn_index > 0:
            # the user has not seen the previous reply yet: the turn waits for it
            self._sessions.setdefault(session, []).append(record)
            return
        if session is not None:
            self._session_busy.add(session)
        if self.controller is not None:
            self.controller.arrived(record)
        self._try_schedule(record)

    def _view(self, record: SimRecord) -> RequestView:
        """The request as the gateway sees it: no ``max_tokens`` (the brain estimates output
        lengths online), the TTFT target as its deadline when an SLO is set."""
        request = record.request
        attempt = (
            request.request_id if not record.attempts else f"{request.request_id}.{record.attempts}"
        )
        slo = self.slo
        if record.hashes is None:
            record.hashes = block_hashes(request)
        return RequestView(
            request_id=str(attempt),
            model=self.model,
            prompt_tokens=request.prompt_tokens,
            block_hashes=record.hashes,
            session_key=request.session_id,
            deadline_s=None
            if slo is None
            else request.arrival_s + slo.ttft_target_s(request.prompt_tokens),
            tpot_target_s=None if slo is None else slo.tpot_s,
            arrival_s=request.arrival_s,
            stream=True,
        )

    def _try_schedule(self, record: SimRecord) -> None:
        """Schedule a new attempt of ``record``: dispatch, reject, or queue it."""
        view = self._view(record)
        self._waiting[view.request_id] = record
        limit = self.dispatcher.submit(record, view, self._now, record.failed_on)
        if limit is not None:
            self._push(limit, HOOK, (_TIMEOUT, view.request_id, 0))

    def _schedule(self, view: RequestView, exclude: Collection[str], now: float) -> Decision:
        decision = self._decide(view, exclude, now)
        if not decision.held:
            return decision
        record = self._waiting[view.request_id]
        if record.held_s is None:
            record.held_s = now
        if self.audit is not None and record.counterfactual is None:
            admitted = self.audit.admit_instead(self, record, view)  # as if refused now
            if admitted is not None:  # the audit's replay admits it instead
                return admitted
        return decision

    def _decide(self, view: RequestView, exclude: Collection[str], now: float) -> Decision:
        if self.disaggregation is None:
            return self.policy.schedule(view, self.shadow, now, exclude=exclude)
        pair = choose_pair(
            self.policy,
            view,
            self.shadow,
            now,
            mode=self.disaggregation,
            link=self.link,
            exclude=exclude,
        )
        self._pairs[view.request_id] = pair
        return pair.decision

    def _bind(self, record: SimRecord, view: RequestView, decision: Decision, now: float) -> None:
        """An ADMIT: dispatch, the request reaches the replica later."""
        replica_id = decision.replica_id
        assert replica_id is not None
        del self._waiting[view.request_id]
        record.counterfactual = None  # held, then admitted after all: no rejection
        pair = self._pairs.pop(view.request_id, None)
        if pair is not None and pair.disaggregated and pair.decision is decision:
            self._bind_split(record, pair, now)
            return
        self.shadow.on_dispatch(view, replica_id, now, decision=decision)
        record.replica_id = replica_id
        record.attempts += 1
        record.disaggregated = False
        self._attempts[view.request_id] = record
        replica = self.replicas[replica_id]
        self._push(now + self.delay_s, DELIVER, (replica, view, record, replica.epoch))

    def _bind_split(self, record: SimRecord, pair: PairDecision, now: float) -> None:
        """A split ADMIT: both legs into the shadow, the prefill leg on its way to P."""
        leg, leg_view = pair.prefill, pair.prefill_request
        decode_id = pair.decision.replica_id
        assert leg is not None and leg_view is not None and leg.replica_id and decode_id
        view = pair.decode_request
        self.shadow.on_dispatch(leg_view, leg.replica_id, now, decision=leg)
        self.shadow.on_dispatch(view, decode_id, now, decision=pair.decision)
        record.replica_id = decode_id
        record.prefill_replica_id = leg.replica_id
        record.attempts += 1
        record.disaggregated = True
        record.transfer_s = pair.transfer_s
        record.prefill_queue, record.decode_queue = pair.prefill_queue, pair.decode_queue
        self._attempts[view.request_id] = record
        decode = self.replicas[decode_id]
        self._legs[leg_view.request_id] = _PrefillLeg(
            record, view, decode, decode.epoch, pair.transfer_s
        )
        prefill = self.replicas[leg.replica_id]
        self._push(now + self.delay_s, DELIVER, (prefill, leg_view, record, prefill.epoch))

    def _refuse(
        self,
        record: SimRecord,
        view: RequestView,
        reason: RejectReason,
        decision: Decision | None,
    ) -> None:
        held_before = record.counterfactual is not None  # audited when it was held first
        slo_refusal = decision is not None and reason is RejectReason.DEADLINE
        if self.audit is not None and slo_refusal and not held_before:
            admitted = self.audit.admit_instead(self, record, view)
            if admitted is not None:
                self._bind(record, view, admitted, self._now)
                return
        del self._waiting[view.request_id]
        self._reject(record, str(reason))

    def _on_hook(self, payload: object) -> None:
        kind, attempt_id, value = cast(_Hook, payload)
        now = self._now
        if kind == _FIRST:
            if self.shadow.on_first_token(attempt_id, now) and attempt_id not in self._legs:
                self._attempts[attempt_id].first_token_s = now
        elif kind == _LEG_DONE:  # the prefill leg's reply reached the gateway
            del self._legs[attempt_id]
            self.shadow.on_complete(attempt_id, now, ok=True, output_tokens=1)
            self.dispatcher.wake(self._now)
        elif kind == _DONE:
            record = self._attempts.pop(attempt_id)
            self.shadow.on_complete(attempt_id, now, ok=True, output_tokens=int(value))
            record.finished_s = now
            record.output_tokens = int(value)
            self._settle(record)
            self.dispatcher.wake(self._now)
        elif kind == _TIMEOUT:
            self.dispatcher.time_out(attempt_id)
        else:  # _FAILED: the attempt's connection broke, or the engine refused it
            leg = self._legs.pop(attempt_id, None)
            if leg is not None:  # the prefill leg failed: so did its decode leg
                self.shadow.on_complete(attempt_id, now, ok=False)
                attempt_id = leg.decode_view.request_id
            record = self._attempts.pop(attempt_id)
            self.shadow.on_complete(attempt_id, now, ok=False)
            record.first_token_s = None
            failed_on = record.prefill_replica_id if leg is not None else record.replica_id
            if failed_on is not None:
                record.failed_on = (*record.failed_on, failed_on)
            if value == "too_long" or record.attempts > self.max_retries:
                self._reject(record, str(value))
            else:
                self._try_schedule(record)
            self.dispatcher.wake(self._now)

    def _reject(self, record: SimRecord, reason: str) -> None:
        record.rejected = reason
        self._settle(record)

    def _settle(self, record: SimRecord) -> None:
        record.hashes = None  # no attempt follows; a day's worth would hold gigabytes
        if self.replaying:
            assert self.audit is not None
            self.audit.settled(record)
        if self.controller is not None:
            self.controller.settled(record)
        self._unsettled -= 1
        session = record.request.session_id
        if session is None:
            return
        self._session_busy.discard(session)
        held = self._sessions.get(session)
        if held:
            self._push(self._now, ARRIVAL, held.pop(0))

    def _on_scrape(self, _: object) -> None:
        now = self._now
        self._refresh_readings()
        up = self._up
        running, waiting, kv_usage, queries, hits = self._readings[:, up]
        self.shadow.apply_scrapes(self._slots[up], running, waiting, kv_usage, queries, hits, now)
        self.dispatcher.wake(self._now)
        self._push(now + self.scrape_s, SCRAPE, None)

    def _on_sample(self, _: object) -> None:
        self._refresh_readings()
        running, waiting = self._readings[0], self._readings[1]
        loads = np.where(self._up, running + waiting, 0.0).astype(np.int64)
        self._samples_s.append(self._now)
        self._samples.append(loads.tolist())
        assert self.sample_interval_s is not None
        self._push(self._now + self.sample_interval_s, SAMPLE, None)

    # -- replica side ------------------------------------------------------------------

    def _on_deliver(self, payload: object) -> None:
        replica, view, record, epoch = cast(_Delivery, payload)
        attempt_id = view.request_id
        engine = self._advance(replica)
        back = self._now + self.delay_s
        if engine is None or epoch != replica.epoch:
            self._push(back, HOOK, (_FAILED, attempt_id, "failed"))
            return
        request = record.request
        if request.prompt_tokens + request.output_tokens > engine.max_request_tokens:
            self._push(back, HOOK, (_FAILED, attempt_id, "too_long"))
            return
        output_tokens = 1 if attempt_id in self._legs else request.output_tokens
        spec = RequestSpec(
            attempt_id,
            request.prompt_tokens,
            output_tokens,
            view.block_hashes,
            view.kv_ready_tokens,
        )
        replica.in_flight[attempt_id] = (record, engine.submit(spec, self._now))
        self._live[replica.index] = replica
        self._schedule_wake(replica, engine)

    def _on_engine(self, payload: object) -> None:
        replica = cast(_SimulatedReplica, payload)
        if self._now != replica.wake_s:
            return  # superseded by an earlier wake
        replica.wake_s = math.inf
        self._advance(replica)

    def _advance(self, replica: _SimulatedReplica) -> EngineModel | None:
        """Bring the replica's engine to now, forward its events, re-arm its wake."""
        engine = replica.engine
        if engine is None:
            return None
        events = engine.advance_to(self._now)  # also starts a step for work just queued
        if events:
            self._forward(replica, events)
        self._schedule_wake(replica, engine)
        return engine

    def _forward(self, replica: _SimulatedReplica, events: list[EngineEvent]) -> None:
        delay = self.delay_s
        for event in events:
            if isinstance(event, FirstToken):
                self._push(event.time_s + delay, HOOK, (_FIRST, event.request_id, 0))
            elif isinstance(event, Finished):
                record, state = replica.in_flight.pop(event.request_id)
                leg = self._legs.get(event.request_id)
                if leg is None and record.disaggregated:  # D's hits: the KV it was sent
                    record.preemptions += state.num_preemptions
                else:
                    record.prefix_hit_tokens = state.num_prefix_hit_tokens
                    record.preemptions = state.num_preemptions
                if leg is None:
                    self._push(
                        event.time_s + delay,
                        HOOK,
                        (_DONE, event.request_id, event.num_output_tokens),
                    )
                    continue
                # P's reply reaches the gateway, which relays the request to D; D pulls the KV
                self._push(event.time_s + delay, HOOK, (_LEG_DONE, event.request_id, 1))
                payload = (leg.decode, leg.decode_view, leg.record, leg.epoch)
                self._push(event.time_s + 2 * delay + leg.transfer_s, DELIVER, payload)

    def _refresh_readings(self) -> None:
        """Read every live engine as a scrape would now. Before its wake an engine emits
        nothing, so it is read in place (``observe``); at its wake it is advanced first.
        Engines found idle leave ``_live`` until a request reaches them."""
        readings = self._readings
        now = self._now
        for index, replica in list(self._live.items()):
            engine = replica.engine
            if engine is None:
                del self._live[index]
                continue
            if now >= replica.wake_s:
                self._advance(replica)
            seen = engine.observe(now)
            readings[:, index] = (
                seen.num_running,
                seen.num_waiting,
                seen.kv_usage,
                seen.prefix_cache_queries,
                seen.prefix_cache_hits,
            )
            if engine.next_event_time() is None:
                del self._live[index]

    def _schedule_wake(self, replica: _SimulatedReplica, engine: EngineModel) -> None:
        at = engine.quiet_until()
        if at is not None and at < replica.wake_s:
            replica.wake_s = at
            self._push(at, ENGINE, replica)

    # -- faults ------------------------------------------------------------------------

    def _on_fault(self, payload: object) -> None:
        action, replica, factor = cast(_Fault, payload)
        config: SimReplica = replica.config
        now = self._now
        if action == "started":
            if int(factor) != replica.starts:
                return  # stopped while it was starting
            action = "ready"
            if self.controller is not None:
                self.controller.ready(config.replica_id, now)
        if action == "ready":
            replica.engine = EngineModel(config.cost_model)
            replica.engine.slowdown = config.slowdown
            replica.engine.advance_to(now)
            if config.replica_id in self.shadow:
                self.shadow.set_health(config.replica_id, True)
            else:
                self.shadow.add(
                    ReplicaSpec(
                        replica_id=config.replica_id,
                        model=self.model,
                        cost_model=config.cost_model,
                        weight=config.weight,
                        usd_per_hour=config.usd_per_hour,
                        max_queue=config.max_queue,
                        groups=config.groups,
                        role=config.role,
                    )
                )
            self._slots[replica.index] = self.shadow.get(config.replica_id).slot
            self._up[replica.index] = True
            self._live[replica.index] = replica  # a fresh engine: its counters start at 0
            self.dispatcher.wake(self._now)
        elif action == "fail":
            engine = self._advance(replica)
            if engine is None:
                return
            back = now + self.delay_s
            for attempt_id in sorted(replica.in_flight, key=_attempt_order):
                self._push(back, HOOK, (_FAILED, attempt_id, "failed"))
            replica.in_flight.clear()
            self._take_down(replica, engine)
        elif action == "recover":
            if replica.engine is None:
                self._push(now + config.cold_start_s, FAULT, ("ready", replica, 0.0))
        elif action == "slowdown":
            engine = self._advance(replica)
            if engine is not None:
                engine.set_slowdown(factor, now)  # the step in flight re-timed, as live
                replica.wake_s = math.inf
                self._schedule_wake(replica, engine)

    def _take_down(self, replica: _SimulatedReplica, engine: EngineModel) -> None:
        """The engine is gone: deliveries to it fail, the brain stops routing there."""
        self._retire(replica, engine)
        replica.engine = None
        replica.epoch += 1
        replica.wake_s = math.inf
        self.shadow.set_health(replica.config.replica_id, False)
        self._up[replica.index] = False
        self._live.pop(replica.index, None)

    @staticmethod
    def _retire(replica: _SimulatedReplica, engine: EngineModel) -> None:
        counters = engine.counters
        replica.busy_s += counters.busy_s
        replica.prefix_queries += counters.prefix_cache_queries
        replica.prefix_hits += counters.prefix_cache_hits
        replica.preemptions += counters.num_preemptions

    def _result(self, wall_s: float) -> SimResult:
        for replica in self.replicas.values():
            if replica.engine is not None:
                self._retire(replica, replica.engine)
                replica.engine = None
        replicas = list(self.replicas.values())
        return SimResult(
            policy=self.policy.name,
            records=self.records,
            replica_ids=[r.config.replica_id for r in replicas],
            busy_s=[r.busy_s for r in replicas],
            prefix_queries=sum(r.prefix_queries for r in replicas),
            prefix_hits=sum(r.prefix_hits for r in replicas),
            preemptions=sum(r.preemptions for r in replicas),
            end_s=self._now,
            wall_s=wall_s,
            num_events=self._num_events,
            sample_s=self._samples_s,
            load_samples=self._samples,
        )


def _attempt_order(attempt_id: str) -> tuple[int, ...]:
    """Attempts by request, then retry; a prefill leg (``<attempt>:prefill``) after its own."""
    attempt, _, leg = attempt_id.partition(":")
    return (*(int(part) for part in attempt.split(".")), len(leg))


def _disaggregation(cluster: ClusterConfig, replicas: Sequence[SimReplica]) -> DisaggMode | None:
    """The cluster's P/D mode: as set, else conditional where some replica has a role;
    None (plain scheduling, as before roles) for a colocated fleet of ``both``."""
    split_roles = any(r.role != "both" for r in replicas)
    if cluster.disaggregation is not None:
        mode = DisaggMode(cluster.disaggregation)
        return None if mode is DisaggMode.COLOCATED and not split_roles else mode
    return DisaggMode.CONDITIONAL if split_roles else None
