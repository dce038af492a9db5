"""The shadow state: every replica one scheduler sees, and the hooks that keep it current.

``ReplicaSet`` is what the gateway and the simulator code against (``scheduling.contract``
shows who calls what): membership, health and draining, the hooks (``on_dispatch``,
``on_first_token``, ``on_tokens``, ``on_complete``) and the scrapes (``apply_scrape``,
``apply_scrapes``). It composes one object per idea, each owning its per-slot arrays
(``scheduling.slots``): the ``SlotStore`` (replicas by id and slot, their specs and
status), ``LocalLoad`` (below), ``ScrapeMerge`` (``scheduling.scrapes``: foreign load from
engine scrapes), ``Calibration`` (``scheduling.calibration``: the learned TTFT and ITL
factors) and ``PrefillDuty`` (``scheduling.duty``). Policies read them through
``replicas.slots``, ``.local``, ``.scrapes``, ``.calibration`` and ``.duty``.

Shadow state. Per replica the set keeps what this caller sent and has seen streamed
(exact and instant: requests waiting for their first token with their uncached prompt
tokens, running requests with their context, expected remaining output), plus the latest
engine scrape (``EngineMetrics``) which reveals traffic from other gateways; the effective
load (``load``) is the two blended.
The prefix index remembers what was routed, not what the engine holds: a replica's
entries are forgotten when it comes back healthy and when a scrape's cumulative
prefix-cache counters go backwards (the engine restarted with an empty cache).
Expected output lengths come from an online estimator per (model, route class), fed by
``on_complete``. The prefix index (``isocost.prefix.index``) receives each dispatched
request's block hashes.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt

from isocost.prefix.index import PrefixIndex
from isocost.scheduling.calibration import Calibration
from isocost.scheduling.contract import (
    DEFAULT_CLASS,
    EngineMetrics,
    InFlight,
    ReplicaSpec,
    RequestView,
    ShadowListener,
)
from isocost.scheduling.duty import PrefillDuty
from isocost.scheduling.estimate import OutputLengthEstimator
from isocost.scheduling.predict import IndexArray, Load, RawTimes, SlotKey
from isocost.scheduling.predict import predict_one as _predict_one
from isocost.scheduling.prefillfit import PrefillFit, features
from isocost.scheduling.scrapes import NUMPY_OPS, PYTHON_OPS, Ops, ScrapeMerge
from isocost.scheduling.slots import SlotArrays, SlotStore
from isocost.scheduling.timing import FloatArray, StepCoefficients

if TYPE_CHECKING:
    from isocost.scheduling.decision import Decision

__all__ = ["LocalLoad", "ReplicaSet", "ReplicaState"]


class ReplicaState:
    """Read view of one replica: its spec, in-flight requests and shadow numbers."""

    __slots__ = (
        "_set",
        "analytic",
        "awaiting",
        "coefficients",
        "in_flight",
        "slot",
        "spec",
        "unseen",
    )

    def __init__(
        self, replica_set: ReplicaSet, spec: ReplicaSpec, slot: int, coefficients: StepCoefficients
    ) -> None:
        self._set = replica_set
        self.spec = spec
        self.slot = slot
        self.analytic = coefficients  # its timing, fitted once to its cost model
        self.coefficients = coefficients  # what it is priced with (``set_prefill_fit``)
        self.in_flight: dict[str, InFlight] = {}
        self.awaiting: dict[str, InFlight] = {}  # no first token yet, in dispatch order
        # not streamed and still taken to be waiting, in dispatch order
        self.unseen: dict[str, InFlight] = {}

    @property
    def replica_id(self) -> str:
        return self.spec.replica_id

    @property
    def healthy(self) -> bool:
        return bool(self._set.slots.healthy[self.slot])

    @property
    def draining(self) -> bool:
        return bool(self._set.slots.draining[self.slot])

    @property
    def num_waiting(self) -> int:
        """Local requests dispatched here still waiting for their first token (as of the
        latest hook or read: one not streamed leaves at its predicted prefill end)."""
        return int(self._set.local.waiting[self.slot])

    @property
    def num_running(self) -> int:
        """Local requests streaming output here."""
        return int(self._set.local.running[self.slot])

    @property
    def ttft_factor(self) -> float:
        return float(self._set.calibration.ttft_factor[self.slot])

    @property
    def prefill_terms_s(self) -> dict[str, float]:
        """The prefill terms it is priced with, in seconds per chunk, per 1k tokens, per
        1M attention pairs, per request and per running sequence (fitted with
        ``set_prefill_fit``, else the analytic ones)."""
        c = self.coefficients
        return {
            "chunk": c.prefill_per_chunk_s,
            "1k_tokens": c.prefill_per_token_s * 1e3,
            "1m_pairs": c.prefill_per_pair_s * 1e6,
            "request": c.prefill_per_request_s,
            "running": c.prefill_per_running_s,
        }

    @property
    def itl_factor(self) -> float:
        return float(self._set.calibration.itl_factor[self.slot])

    @property
    def ttft_error(self) -> float:
        """Recent mean absolute percentage error of its predicted TTFT (0.1: 10%)."""
        return float(self._set.calibration.ttft_error[self.slot])

    @property
    def itl_error(self) -> float:
        """Recent mean absolute percentage error of its predicted inter-token time."""
        return float(self._set.calibration.itl_error[self.slot])

    @property
    def scrape_s(self) -> float | None:
        """When the latest scrape was taken, None before the first one."""
        taken = float(self._set.scrapes.taken_s[self.slot])
        return None if taken == -np.inf else taken

    def prefill_duty(self, now: float) -> float:
        """Share of its time prefill chunks recently dispatched here will take (0..)."""
        return float(self._set.duty.at(now, self.slot))


class LocalLoad(SlotArrays):
    """What this caller sent and has seen streamed, per slot: exact and instant.

    ``waiting``: requests dispatched, not started yet (no first token; one not streamed:
    before its predicted prefill end), with their uncached prompt tokens
    (``queued_prefill_tokens``); ``running``: requests started, with their context
    (``context_tokens``); ``kv_tokens``: the KV tokens of both; ``remaining_tokens``: the
    output still expected of both. The hooks move a record through them.
    """

    FRESH: ClassVar[Mapping[str, float]] = dict.fromkeys(
        (
            "waiting",
            "running",
            "queued_prefill_tokens",
            "context_tokens",
            "kv_tokens",
            "remaining_tokens",
        ),
        0.0,
    )

    waiting: FloatArray
    running: FloatArray
    queued_prefill_tokens: FloatArray
    context_tokens: FloatArray
    kv_tokens: FloatArray
    remaining_tokens: FloatArray

    def dispatched(self, record: InFlight) -> None:
        slot = record.slot
        self.waiting[slot] += 1
        self.queued_prefill_tokens[slot] += record.prompt_tokens - record.cached_tokens
        self.kv_tokens[slot] += record.prompt_tokens
        self.remaining_tokens[slot] += record.remaining_tokens

    def started(self, record: InFlight, now: float) -> None:
        """``record`` started at ``now`` (its first token): it moves from waiting to running."""
        record.started_s = now
        slot = record.slot
        self.waiting[slot] -= 1
        self.queued_prefill_tokens[slot] -= record.prompt_tokens - record.cached_tokens
        self.running[slot] += 1
        self.context_tokens[slot] += record.prompt_tokens + record.generated_tokens

    def advance(self, record: InFlight, num_tokens: int, now: float) -> None:
        """``num_tokens`` more output tokens of ``record`` came at ``now``."""
        slot = record.slot
        before = record.remaining_tokens
        record.generated_tokens += num_tokens
        record.last_token_s = now
        self.remaining_tokens[slot] += record.remaining_tokens - before
        self.context_tokens[slot] += num_tokens
        self.kv_tokens[slot] += num_tokens

    def completed(self, record: InFlight) -> None:
        slot = record.slot
        self.remaining_tokens[slot] -= record.remaining_tokens
        self.kv_tokens[slot] -= record.prompt_tokens + record.generated_tokens
        if record.started_s is None:
            self.waiting[slot] -= 1
            self.queued_prefill_tokens[slot] -= record.prompt_tokens - record.cached_tokens
        else:
            self.running[slot] -= 1
            self.context_tokens[slot] -= record.prompt_tokens + record.generated_tokens


class ReplicaSet:
    """All replicas one scheduler sees, with their shadow state (see the module docstring).

    Parameters: ``block_tokens`` (>= 1) tokens per hashed prompt block; ``staleness_tau_s``
    (> 0, default 2 s) how fast a scrape's foreign load fades; ``factor_alpha`` (0..1,
    default 0.1) EWMA weight of a new TTFT/ITL observation; ``estimator`` the output-length
    estimator; ``prior_prompt_tokens`` the mean prompt assumed for foreign requests until
    prompts have been seen.
    """

    def __init__(
        self,
        *,
        block_tokens: int = 16,
        staleness_tau_s: float = 2.0,
        factor_alpha: float = 0.1,
        estimator: OutputLengthEstimator | None = None,
        prior_prompt_tokens: float = 1024.0,
    ) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.block_tokens = block_tokens
        self.estimator = estimator or OutputLengthEstimator()
        self.scrapes = ScrapeMerge(
            staleness_tau_s,
            prior_prompt_tokens=prior_prompt_tokens,
            prior_output_tokens=self.estimator.prior_tokens,
        )
        self.calibration = Calibration(factor_alpha)
        self.prefill_fit: PrefillFit | None = None  # ``set_prefill_fit``
        self.local = LocalLoad()
        self.duty = PrefillDuty()
        self.slots: SlotStore[ReplicaState] = SlotStore(
            (self.local, self.scrapes, self.calibration, self.duty)
        )
        self.prefix = PrefixIndex()
        self._requests: dict[str, InFlight] = {}
        self._listeners: list[ShadowListener] = []
        # (predicted start, tie-break, record) of the requests not streamed; entries of
        # records already started or gone are dropped when they come up
        self._unseen_starts: list[tuple[float, int, InFlight]] = []
        self._unseen_order = itertools.count()

    # -- membership ------------------------------------------------------------------

    def add(self, spec: ReplicaSpec) -> ReplicaState:
        """Add a replica (healthy, not draining, empty); its id must be new."""
        coefficients = StepCoefficients.fit(spec.cost_model)
        state = self.slots.add(
            spec, coefficients, lambda slot: ReplicaState(self, spec, slot, coefficients)
        )
        self.calibration.join(state.slot, spec.hardware_class)
        if self.prefill_fit is not None:
            self._join_fit(self.prefill_fit, state)
        self.prefix.add_replica(state.slot, spec.cost_model.kv_capacity_tokens // self.block_tokens)
        return state

    def remove(self, replica_id: str) -> None:
        """Remove a replica; its in-flight requests are forgotten (their hooks become no-ops)."""
        state = self.slots.get(replica_id)
        for request_id in list(state.in_flight):
            del self._requests[request_id]
        self.slots.remove(replica_id, state.slot)
        self.prefix.remove_replica(state.slot)
        if self.prefill_fit is not None:
            self.prefill_fit.leave(state.slot)

    def set_prefill_fit(self, on: bool) -> None:
        """Fit each replica's prefill terms to its TTFTs (``scheduling.prefillfit``) instead
        of learning one TTFT factor; off: back to the analytic terms and the factor."""
        if on == (self.prefill_fit is not None):
            return
        self.calibration.learn_ttft_factor = not on
        fit = self.prefill_fit = PrefillFit() if on else None
        for state in self.slots:
            if fit is None:
                self._price(state, state.analytic)
            else:
                self._join_fit(fit, state)

    def _join_fit(self, fit: PrefillFit, state: ReplicaState) -> None:
        fit.join(state.slot, state.spec.hardware_class, state.analytic)
        self._price(state, fit.coefficients(state.slot, 0.0) or state.analytic)

    def _price(self, state: ReplicaState, coefficients: StepCoefficients) -> None:
        state.coefficients = coefficients
        self.slots.coef.set(state.slot, coefficients)

    def get(self, replica_id: str) -> ReplicaState:
        return self.slots.get(replica_id)

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self.slots

    def __iter__(self) -> Iterator[ReplicaState]:
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def set_health(self, replica_id: str, healthy: bool) -> None:
        """Mark a replica (un)healthy. One that comes back may have restarted with an empty
        cache: its prefix entries are forgotten rather than claimed as hits that are gone."""
        slots = self.slots
        slot = slots.get(replica_id).slot
        if healthy and not slots.healthy[slot]:
            self._forget_prefixes(slot)
        slots.healthy[slot] = healthy

    def set_draining(self, replica_id: str, draining: bool) -> None:
        self.slots.draining[self.slots.get(replica_id).slot] = draining

    def add_listener(self, listener: ShadowListener) -> None:
        self._listeners.append(listener)

    # -- hooks -----------------------------------------------------------------------

    def on_dispatch(
        self,
        request: RequestView,
        replica_id: str,
        now: float,
        *,
        decision: Decision | None = None,
    ) -> InFlight:
        """``request`` was sent to ``replica_id`` at ``now``.

        ``decision``: the ADMIT decision that chose ``replica_id`` for ``request`` at this
        same ``now``; its route class (as the policy's route table classified the request)
        keys the output-length estimator, and its cached tokens and predicted times are
        reused instead of computed again. Without it the class is ``request.route_class``,
        else ``DEFAULT_CLASS``.
        """
        state = self.slots.get(replica_id)
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already in flight")
        slot = state.slot
        # The class the policy classified it as: the estimator learns what schedule reads.
        route_class = (
            decision.route_class if decision is not None else request.route_class or DEFAULT_CLASS
        )
        expected = self.estimator.expected_tokens(request.model, route_class, request.max_tokens)
        known = decision.raw_times if decision and decision.replica_id == replica_id else None
        if decision is not None and known is not None:
            cached = decision.cached_tokens
        else:
            matched = self.prefix.match_replica(slot, request.block_hashes) * self.block_tokens
            cached = min(max(matched, request.kv_ready_tokens), request.prompt_tokens)
        if known is None or known.output_tokens != expected:
            known = self.predict_one(slot, now, request.prompt_tokens, cached, expected)
        waiting, running, queued, *_ = (
            self._effective(now, slot, max) if self.prefill_fit is not None else (0.0, 0.0, 0.0)
        )
        record = InFlight(
            request_id=request.request_id,
            replica_id=replica_id,
            slot=slot,
            model=request.model,
            route_class=route_class,
            prompt_tokens=request.prompt_tokens,
            cached_tokens=cached,
            expected_output_tokens=expected,
            dispatch_s=now,
            predicted_ttft_s=known.ttft_s,
            predicted_step_s=known.step_s,
            max_tokens=request.max_tokens,
            predicted_wait_s=known.wait_s,
            stream=request.stream,
            queued_prefill_tokens=float(queued),
            queued_requests=float(waiting),
            running_sequences=float(running),
        )
        self._requests[request.request_id] = record
        state.in_flight[request.request_id] = record
        if request.stream:
            state.awaiting[request.request_id] = record
            if len(state.awaiting) == 1:
                self.calibration.awaiting(slot, record)
        else:
            # No first token will show when it starts: take it to start at its predicted end of
            # prefill (scrapes may show it sooner), and never as late-first-token evidence.
            start = now + known.ttft_s * float(self.calibration.ttft_factor[slot])
            record.predicted_start_s = start
            state.unseen[request.request_id] = record
            heapq.heappush(self._unseen_starts, (start, next(self._unseen_order), record))
        self.local.dispatched(record)
        self.calibration.dispatched_s[slot] = now
        if not request.decode_only:  # its one token rides in a decode step: no prefill duty
            self.duty.add(slot, now, known.prefill_s * float(self.calibration.ttft_factor[slot]))
        self.prefix.insert(slot, request.block_hashes)
        self.scrapes.observe_prompt(request.prompt_tokens)
        for listener in self._listeners:
            listener.on_dispatch(record, now)
        return record

    def on_first_token(self, request_id: str, now: float) -> bool:
        """The first output token of ``request_id`` arrived (learns the TTFT factor)."""
        record = self._requests.get(request_id)
        if record is None or record.first_token_s is not None:
            return False
        record.first_token_s = now
        if record.started_s is None:
            self._stop_awaiting(record)
            self._start(record, now)
        self.calibration.observe_first_token(record, now)
        if self.prefill_fit is not None:
            self._fit_prefill(self.prefill_fit, record, now)
        self.local.advance(record, 1, now)
        for listener in self._listeners:
            listener.on_first_token(record, now)
        return True

    def on_tokens(self, request_id: str, num_tokens: int, now: float) -> bool:
        """``num_tokens`` more output tokens of ``request_id`` arrived (learns the ITL factor)."""
        record = self._requests.get(request_id)
        if record is None or num_tokens <= 0:
            return False
        if record.first_token_s is None:
            self.on_first_token(request_id, now)
            num_tokens -= 1
            if num_tokens == 0:
                return True
        self.calibration.observe_tokens(record, num_tokens, now, self._step_now)
        self.local.advance(record, num_tokens, now)
        return True

    def on_complete(
        self, request_id: str, now: float, *, ok: bool = True, output_tokens: int | None = None
    ) -> bool:
        """``request_id`` finished (``ok``) or failed; ``output_tokens`` from the usage."""
        self._start_unseen(now)
        record = self._requests.pop(request_id, None)
        if record is None:
            return False
        state = self.slots.state_at(record.slot)
        del state.in_flight[request_id]
        generated = output_tokens if output_tokens is not None else record.generated_tokens
        if ok and generated > 0:
            self.calibration.observe_completion(record, generated, now, self._step_now)
            self.estimator.observe(record.model, record.route_class, generated)
            self.scrapes.observe_output(generated)
        if record.started_s is None:
            self._stop_awaiting(record)
        self.local.completed(record)
        for listener in self._listeners:
            listener.on_complete(record, now, ok)
        return True

    def apply_scrape(self, replica_id: str, metrics: EngineMetrics, now: float) -> None:
        """Engine truth for ``replica_id`` at ``now``: load beyond ours is other gateways'."""
        self._scrape(
            self.slots.get(replica_id).slot,
            (metrics.num_running, metrics.num_waiting, metrics.kv_usage),
            (metrics.prefix_cache_queries, metrics.prefix_cache_hits),
            now,
            PYTHON_OPS,
        )

    def apply_scrapes(
        self,
        slots: IndexArray,
        num_running: npt.ArrayLike,
        num_waiting: npt.ArrayLike,
        kv_usage: npt.ArrayLike,
        prefix_cache_queries: npt.ArrayLike,
        prefix_cache_hits: npt.ArrayLike,
        now: float,
    ) -> None:
        """``apply_scrape`` for many replicas at once, all scraped at ``now``: ``slots``
        (distinct, of replicas in the set) and the ``EngineMetrics`` fields aligned with it.
        The same state results as from one ``apply_scrape`` per replica."""
        slots = np.asarray(slots, dtype=np.int64)
        if not self.slots.active[slots].all():
            raise ValueError("apply_scrapes: every slot must hold a replica of this set")

        def floats(values: npt.ArrayLike) -> FloatArray:
            return np.asarray(values, dtype=np.float64)

        load = (floats(num_running), floats(num_waiting), floats(kv_usage))
        counters = (floats(prefix_cache_queries), floats(prefix_cache_hits))
        self._scrape(slots, load, counters, now, NUMPY_OPS)

    def _scrape(
        self,
        key: IndexArray | int,
        load: tuple[Any, Any, Any],
        counters: tuple[Any, Any],
        now: float,
        ops: Ops,
    ) -> None:
        """Merge a scrape of one slot or of the slots ``key`` (``ScrapeMerge.merge``) and
        forget the prefix entries of the engines it shows restarted. An engine that shows
        fewer waiting than this caller counts there has started that many of them: its
        oldest requests not streamed are taken to have started."""
        self._start_unseen(now)
        if self._unseen_starts:  # only the slots holding requests not streamed need a look
            pending = list({record.slot for _, _, record in self._unseen_starts})
            slots, waiting = np.atleast_1d(key), np.atleast_1d(load[1])
            for i in np.flatnonzero(np.isin(slots, pending)).tolist():
                self._start_shown_running(int(slots[i]), float(waiting[i]), now)
        local = (self.local.waiting[key], self.local.running[key])
        for slot in self.scrapes.merge(key, local, load, counters, now, ops):
            self._forget_prefixes(slot)

    # -- derived load ----------------------------------------------------------------

    def waiting(self, now: float, key: SlotKey) -> FloatArray:
        """Effective waiting requests of the slots ``key`` (the queue-cap test)."""
        self._start_unseen(now)
        scrapes = self.scrapes
        fresh = scrapes.freshness(now, key)
        return np.asarray(self.local.waiting[key] + fresh * scrapes.foreign_waiting[key])

    def load(self, now: float, key: SlotKey) -> Load:
        """Effective load of the slots ``key`` at ``now`` (local state plus fresh scrapes)."""
        return Load(*self._effective(now, key, np.maximum))

    def predict_one(
        self, slot: int, now: float, prompt_tokens: int, cached_tokens: int, output_tokens: float
    ) -> RawTimes:
        """Uncorrected predicted times of one request on the replica in ``slot`` at ``now``
        (``predict`` for one replica, in Python floats: no numpy overhead per call)."""
        waiting, running, queued, context, remaining, kv_used, kv_capacity, duty = self._effective(
            now, slot, max
        )
        load = (waiting, running, context, queued, remaining, kv_used, kv_capacity, duty)
        coefficients = self.slots.state_at(slot).coefficients
        return _predict_one(coefficients, load, prompt_tokens, cached_tokens, output_tokens)

    def _effective(
        self, now: float, key: SlotKey | int, maximum: Callable[[Any, Any], Any]
    ) -> tuple[Any, Any, Any, Any, Any, Any, Any, Any]:
        """``Load``'s fields for the slots ``key`` (arrays) or one slot (floats)."""
        self._start_unseen(now)
        local, scrapes = self.local, self.scrapes
        fresh = scrapes.freshness(now, key)
        foreign_waiting = fresh * scrapes.foreign_waiting[key]
        foreign_running = fresh * scrapes.foreign_running[key]
        capacity = self.slots.kv_capacity_tokens[key]
        mean_prompt, mean_out = scrapes.mean_prompt_tokens, scrapes.mean_output_tokens
        running, context = self._batch(key, foreign_running)
        return (
            local.waiting[key] + foreign_waiting,
            running,
            local.queued_prefill_tokens[key] + foreign_waiting * mean_prompt,
            context,
            local.remaining_tokens[key] + (foreign_running + foreign_waiting) * mean_out / 2.0,
            maximum(local.kv_tokens[key], fresh * scrapes.kv_usage[key] * capacity),
            capacity,
            self.duty.at(now, key),
        )

    # -- internals -------------------------------------------------------------------

    def _forget_prefixes(self, slot: int) -> None:
        self.prefix.evict(slot, self.prefix.num_blocks(slot))

    def _start(self, record: InFlight, now: float) -> None:
        """``record`` left the engine's waiting queue at ``now``: it runs, and its prefill
        is done (the stall its neighbours' streams saw)."""
        self.local.started(record, now)
        self.calibration.prefill_done(record, self.slots.state_at(record.slot).coefficients)

    def _start_unseen(self, now: float) -> None:
        """Start the requests not streamed whose predicted prefill end is past at ``now``."""
        starts = self._unseen_starts
        while starts and starts[0][0] <= now:
            start, _, record = heapq.heappop(starts)
            if record.started_s is None and self._requests.get(record.request_id) is record:
                del self.slots.state_at(record.slot).unseen[record.request_id]
                self._start(record, start)

    def _start_shown_running(self, slot: int, engine_waiting: float, now: float) -> None:
        """A scrape shows ``engine_waiting`` at ``slot``: of this caller's requests counted
        waiting there, all beyond that number have started; its oldest not streamed first
        (the ones streamed show their own first token)."""
        unseen = self.slots.state_at(slot).unseen
        excess = int(self.local.waiting[slot] - engine_waiting)
        for record in list(itertools.islice(unseen.values(), max(excess, 0))):
            del unseen[record.request_id]
            self._start(record, now)

    def _stop_awaiting(self, record: InFlight) -> None:
        state = self.slots.state_at(record.slot)
        if record.request_id not in state.awaiting:  # not streamed: it never awaited
            state.unseen.pop(record.request_id, None)
            return
        head = next(iter(state.awaiting))
        del state.awaiting[record.request_id]
        if head == record.request_id:
            self.calibration.awaiting(state.slot, next(iter(state.awaiting.values()), None))

    def _fit_prefill(self, fit: PrefillFit, record: InFlight, now: float) -> None:
        """Teach ``record``'s TTFT to the prefill fit; price with what it learnt."""
        cached = min(record.cached_tokens, max(record.prompt_tokens - 1, 0))
        x = features(
            self.slots.state_at(record.slot).analytic,
            record.queued_requests,
            record.queued_prefill_tokens,
            record.prompt_tokens - cached,
            cached,
            record.running_sequences,
        )
        for slot, coefficients in fit.observe(record.slot, x, now - record.dispatch_s, now):
            self._price(self.slots.state_at(slot), coefficients)

    def _batch(self, key: SlotKey | int, foreign_running: Any) -> tuple[Any, Any]:
        """The running sequences of the slots ``key`` and their context tokens, with
        ``foreign_running`` (the fresh scrapes' others) priced at the mean request."""
        local, scrapes = self.local, self.scrapes
        per_foreign = scrapes.mean_prompt_tokens + scrapes.mean_output_tokens / 2.0
        return (
            local.running[key] + foreign_running,
            local.context_tokens[key] + foreign_running * per_foreign,
        )

    def _step_now(self, slot: int, now: float) -> float:
        """Uncorrected decode step of the slot's current batch (what its streams now see):
        asked for every streamed chunk, so it reads the batch alone."""
        self._start_unseen(now)
        scrapes = self.scrapes
        foreign_running = scrapes.freshness(now, slot) * float(scrapes.foreign_running[slot])
        running, context = self._batch(slot, foreign_running)
        return self.slots.state_at(slot).coefficients.decode_step_s(
            max(float(running), 1.0), float(context)
        )
