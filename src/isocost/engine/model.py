"""The engine model: one replica's continuous batching, paged KV cache and prefix cache.

Pure and clock-driven: no asyncio, no wall clock, no randomness. The caller owns time and
passes it in; the HTTP server drives it in real time, the cluster simulator in simulated
time. The model is vLLM V1's scheduler in miniature:

* **Steps.** The engine runs one step at a time. A step's batch is fixed when it starts and
  its tokens appear when it ends, ``cost.step_time_s(...) * slowdown`` seconds later.
  Requests submitted during a step wait for the next one.
* **Batch.** Each step has a token budget (``max_num_batched_tokens``). Running requests
  go first, in admission order: a decoding request takes 1 token, a prefilling one the
  rest of its prompt up to the budget (chunked prefill). Then waiting requests are
  admitted first-come-first-served while budget, ``max_num_seqs`` and free KV blocks
  allow; the first that does not fit stops admission (no overtaking).
* **KV cache.** A request holds ``ceil(tokens computed / block_size)`` blocks of a
  ``BlockPool``. On admission its prompt's chained block hashes are matched against the
  cache; hit blocks are shared and their tokens skip prefill (at least one prompt token is
  always computed). Each full prompt block is cached as soon as it is computed.
* **Preemption.** When a running request needs a block and none is free, the newest
  running request is preempted by recompute: its blocks are released, its progress
  reset, and it goes to the front of the waiting queue (it keeps its generated tokens and
  later recomputes prompt + output). A step that preempted admits no one.
* **Step price.** The step's prefill chunks are priced as one chunk of their summed size
  (attending to their token-weighted mean cached context); decodes by batch size and total
  context. With one prefill chunk this is exactly ``CostModel.step_time_s``.

Driving contract::

    model = EngineModel(cost)
    state = model.submit(RequestSpec("r1", prompt_tokens=900, max_output_tokens=64), now)
    while (t := model.next_event_time()) is not None:
        for event in model.advance_to(t):   # FirstToken | Finished | Preempted
            ...

* ``submit(spec, now)`` queues a request at ``now`` and returns its live ``RequestState``
  (read it, never write it). ``now`` must not be earlier than the model's clock, nor later
  than ``next_event_time()``: advance first, so no event is skipped.
* ``advance_to(t)`` runs every step that ends at or before ``t`` and returns their events
  in time order; a step ending after ``t`` stays in flight. The clock becomes ``t``.
* ``next_event_time()`` is the end of the step in flight, the clock itself when the
  engine is idle but has work (call ``advance_to`` to start the step), or ``None``.
* ``quiet_until()`` is a time before which the model emits no event unless a request is
  submitted or aborted: the end of the decode run ahead (see Jumps) or of the step that
  closes it, else ``next_event_time()``. A simulator wakes the model there, not at every
  step.
* ``observe(t)`` reads, without changing the model, what ``advance_to(t)`` would leave in
  the scrape-visible gauges and counters (``EngineObservation``), for ``t`` from the clock
  up to ``quiet_until()``: a scraper calls it instead of advancing every replica.

Jumps. When a step is pure decode (every running request decodes, and the waiting head
cannot be admitted), the following steps keep the same batch until a request emits its
last token, the free blocks run out, or ``t`` is reached. ``advance_to`` applies such a
run in bulk, in one pass over the batch however many steps it spans, and emits no events
for it, since no request starts, finishes or is preempted in it. With a fixed batch of
``B`` the total context grows by ``B`` a step, so a step costs ``max(F + f*C, M + m*C) +
K`` (``CostModel.decode_lines``) and ``k`` steps cost two arithmetic series: the end of
step ``k`` is O(1), the number of steps ending by ``t`` a short search on it, and the
blocks taken in ``k`` steps O(1) from a histogram of each request's free slots in its last
block. The run's step that ends after ``t`` is started by the run itself, at the closed
form's time, and the rest of the run is kept (moved past the steps done in O(1)) until
the model changes, so ``quiet_until`` is O(1) and ``observe`` O(log steps) and both say
exactly where ``advance_to`` will stand. When the run ends because a request is one token
from its last, with blocks to spare, the step after it is known too (the same batch, no
preemption, no admission) and the quiet time reaches its end, where that request
finishes: a simulator wakes the model once per run, not twice.

Times inside runs are the closed form's, so they agree with stepping one by one
(``jump=False``) to about 1e-12 relative rather than bit for bit; tokens, events and their
order, blocks and counters are identical, which tests compare.

Why admission stays impossible during a run: decode steps only take blocks (free blocks
and cached prefixes shrink), the running count and token budget do not change, so a head
that did not fit at the run's first step does not fit at any later one.
"""

from __future__ import annotations

import math
import sys
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate

from isocost.core.costmodel import CostModel, DecodeLines
from isocost.engine.kvcache import BlockPool

__all__ = [
    "EngineCounters",
    "EngineEvent",
    "EngineModel",
    "EngineObservation",
    "Finished",
    "FirstToken",
    "Preempted",
    "RequestSpec",
    "RequestState",
]


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """What the engine needs to know about a request: lengths and prompt block hashes."""

    request_id: str
    prompt_tokens: int
    max_output_tokens: int  # the engine generates exactly this many tokens
    block_hashes: tuple[int, ...] = ()  # chained hashes of the prompt's full blocks


@dataclass(slots=True)
class RequestState:
    """A request's progress inside the engine. Owned by the model; callers only read it."""

    spec: RequestSpec
    arrival_s: float
    num_computed_tokens: int = 0  # tokens whose KV is in cache (prompt, then output)
    num_output_tokens: int = 0
    num_blocks: int = 0  # KV blocks held; the first ``num_cached_blocks`` are cached
    num_cached_blocks: int = 0
    num_prefix_hit_tokens: int = 0  # cached prompt tokens found at the last admission
    num_preemptions: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None
    aborted: bool = False

    @property
    def num_tokens(self) -> int:
        return self.spec.prompt_tokens + self.num_output_tokens

    @property
    def done(self) -> bool:
        return self.finished_s is not None or self.aborted


@dataclass(frozen=True, slots=True)
class FirstToken:
    request_id: str
    time_s: float
    ttft_s: float


@dataclass(frozen=True, slots=True)
class Finished:
    request_id: str
    time_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    ttft_s: float
    e2e_s: float


@dataclass(frozen=True, slots=True)
class Preempted:
    request_id: str
    time_s: float


EngineEvent = FirstToken | Finished | Preempted


@dataclass(slots=True)
class EngineCounters:
    """Monotonic totals behind the ``vllm:*_total`` metrics (tokens, not requests)."""

    num_prompt_tokens: int = 0  # counted when a request's first token appears
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up at admission
    prefix_cache_hits: int = 0  # of which found cached
    num_steps: int = 0
    busy_s: float = 0.0
    # (gap_s, tokens) inter-token gaps, kept only when the model records them
    inter_token_gaps: list[tuple[float, int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class EngineObservation:
    """What a metrics scrape reads from the model at one time (``EngineModel.observe``)."""

    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class _DecodeRun:
    """The run of identical pure-decode steps that starts at ``start_s``: step ``k`` of
    it (from 1) ends at ``end_s(k)``; at most ``max_steps`` steps, the last one before a
    request's last token or a step that would lack a block.

    Mutable and private to one model: ``advance`` moves its start past the steps applied,
    in O(1), so that its times are always the closed form's from its latest start.
    """

    __slots__ = (
        "_below",
        "_closing_cost",
        "_closing_s",
        "_last_end_s",
        "_quiet_end_s",
        "_series",
        "_skipped",
        "_taken",
        "context_tokens",
        "lines",
        "max_steps",
        "slowdown",
        "start_s",
    )

    def __init__(
        self,
        start_s: float,
        context_tokens: int,
        max_steps: int,
        lines: DecodeLines,
        slowdown: float,
        below: tuple[int, ...],
        closing_cost: CostModel | None,
    ) -> None:
        self.start_s = start_s
        self.context_tokens = context_tokens
        self.max_steps = max_steps
        self.lines = lines
        self.slowdown = slowdown
        # [p]: requests with fewer than p free slots in their last block at the first step
        # (of the run as found, before any ``advance``; ``_skipped`` steps ago)
        self._below = below
        self._skipped = self._taken = 0  # steps advanced past, blocks they took
        self._series = lines.series(context_tokens)
        # prices the step after the run when that step surely starts (None: it may not)
        self._closing_cost = closing_cost
        self._closing_s: float | None = None  # its price, the same after any ``advance``
        self._last_end_s: float | None = None
        self._quiet_end_s: float | None = None

    def end_s(self, steps: int) -> float:
        return self.start_s + self._series.time_s(steps) * self.slowdown

    @property
    def last_end_s(self) -> float:
        """``end_s(max_steps)``, computed once."""
        end = self._last_end_s
        if end is None:
            end = self._last_end_s = self.end_s(self.max_steps)
        return end

    @property
    def closes(self) -> bool:
        """Whether the step after the run surely starts as the same batch's decode (no
        preemption, no admission): the run ends a token before a request's last."""
        return self._closing_cost is not None

    @property
    def quiet_end_s(self) -> float:
        """Where the model's next event may be: the end of the step after the run when
        it is the step in which a request emits its last token and nothing else can
        happen (enough blocks, no admission), else the end of the run. Computed once."""
        end = self._quiet_end_s
        if end is None:
            end = self.last_end_s
            cost = self._closing_cost
            if cost is not None:
                closing = self._closing_s
                if closing is None:
                    batch = self.lines.batch_size
                    context = self.context_tokens + self.max_steps * batch
                    closing = cost.step_time_s(0, 0, batch, context) * self.slowdown
                    self._closing_s = closing
                end += closing
            self._quiet_end_s = end
        return end

    def new_blocks(self, steps: int) -> int:
        """Blocks the batch takes in its next ``steps`` steps: those it takes in its
        first ``_skipped + steps`` steps as found, less those already taken. In the run as
        found, a request with ``r`` free slots takes one at step ``r + 1``, then one every
        ``block_size`` steps."""
        below = self._below
        rounds, rest = divmod(self._skipped + steps, len(below))
        return rounds * self.lines.batch_size + below[rest] - self._taken

    def advance(self, steps: int, end_s: float) -> bool:
        """Start the run after its first ``steps`` steps, which end at ``end_s``; False
        when none is left."""
        if steps >= self.max_steps:
            return False
        self.start_s = end_s
        self.context_tokens += steps * self.lines.batch_size
        self.max_steps -= steps
        self._taken += self.new_blocks(steps)
        self._skipped += steps
        self._series = self.lines.series(self.context_tokens)
        self._last_end_s = self._quiet_end_s = None
        return True

    def steps_by(self, t: float) -> tuple[int, float, float]:
        """``(k, end_s(k), end_s(k + 1))`` for the most steps ``k`` (<= ``max_steps``)
        that end by ``t`` (``t >= start_s``); the last is inf when ``k == max_steps``.

        ``end_s`` grows with ``k``, nearly in a straight line (steps of one batch cost
        almost the same), so the search interpolates between two steps that bracket
        ``t``: the first guess is usually the answer or one off, and bisection takes over
        should interpolation be slow. The answer is exact for the closed form.
        """
        start, slowdown, time_s = self.start_s, self.slowdown, self._series.time_s
        if t <= start:
            return 0, start, start + time_s(1) * slowdown
        last, end_last = self.max_steps, self.last_end_s
        if end_last <= t:
            return last, end_last, math.inf
        low, end_low, high, end_high = 0, start, last, end_last
        tries = 0
        while high - low > 1:  # end_s(low) <= t < end_s(high)
            if tries < 3:
                guess = low + int((t - end_low) / (end_high - end_low) * (high - low))
                guess = low + 1 if guess <= low else high - 1 if guess >= high else guess
            else:
                guess = (low + high) // 2
            tries += 1
            end_guess = start + time_s(guess) * slowdown
            if end_guess <= t:
                low, end_low = guess, end_guess
            else:
                high, end_high = guess, end_guess
        return low, end_low, end_high


class EngineModel:
    """One replica's scheduler and KV cache over a cost model; see the module docstring."""

    __slots__ = (
        "_ahead",
        "_ahead_known",
        "_batch",
        "_jump",
        "_lines",
        "_now_s",
        "_record_gaps",
        "_running",
        "_seen",
        "_states",
        "_step_end_s",
        "_step_start_s",
        "_waiting",
        "block_size",
        "cost",
        "counters",
        "max_num_batched_tokens",
        "max_num_seqs",
        "pool",
        "slowdown",
    )

    def __init__(
        self,
        cost: CostModel,
        *,
        num_blocks: int | None = None,
        jump: bool = True,
        record_inter_token_gaps: bool = False,
    ) -> None:
        limits = cost.limits
        self.cost = cost
        self.block_size = limits.block_size
        self.max_num_batched_tokens = limits.max_num_batched_tokens
        self.max_num_seqs = limits.max_num_seqs
        blocks = cost.kv_capacity_blocks if num_blocks is None else num_blocks
        if blocks < 1:
            raise ValueError(
                f"{cost.model.id} on {cost.tensor_parallel}x {cost.gpu.id} leaves no KV cache"
            )
        self.pool = BlockPool(blocks)
        self.slowdown = 1.0  # step times are multiplied by this (fault injection)
        self.counters = EngineCounters()
        self._jump = jump
        self._record_gaps = record_inter_token_gaps
        self._now_s = 0.0
        self._running: list[RequestState] = []
        self._waiting: deque[RequestState] = deque()
        self._states: dict[str, RequestState] = {}
        self._batch: list[tuple[RequestState, int]] | None = None  # the step in flight
        self._step_start_s = self._step_end_s = 0.0
        self._lines: dict[int, DecodeLines] = {}  # decode lines by batch size
        # the decode run after the step in flight (or, inside advance_to, after now)
        self._ahead: _DecodeRun | None = None
        self._ahead_known = False
        self._seen: EngineObservation | None = None  # observe() until the model changes

    # -- observation -------------------------------------------------------------------

    @property
    def now_s(self) -> float:
        return self._now_s

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        return self.pool.usage

    @property
    def max_request_tokens(self) -> int:
        """Prompt plus output tokens one request may hold: its model's context, or the
        whole KV cache when that is smaller."""
        return min(self.cost.model.max_context_tokens, self.pool.num_blocks * self.block_size)

    def request(self, request_id: str) -> RequestState | None:
        """The live state of an unfinished request."""
        return self._states.get(request_id)

    def next_event_time(self) -> float | None:
        if self._batch is not None:
            return self._step_end_s
        return self._now_s if self._waiting else None

    def quiet_until(self) -> float | None:
        """A time before which, unless a request is submitted or aborted, the model emits
        no event (None when idle): a simulator wakes the model there, not at every step.

        The step in flight's end; with jumps, when a pure-decode run follows that step,
        the end of the run's last step (the step after it may preempt at its start), or
        of the step after it when that one surely starts and emits the run's first last
        token (the run ran out of tokens with blocks to spare).
        """
        if self._batch is None:
            return self._now_s if self._waiting else None
        run = self._run_ahead() if self._jump else None
        return self._step_end_s if run is None else run.quiet_end_s

    def observe(self, t: float) -> EngineObservation:
        """What a scrape at ``t`` would read after ``advance_to(t)``, leaving the model as
        it is: for ``now_s <= t < quiet_until()``, or any ``t >= now_s`` when the model is
        idle. Outside that window it raises ``ValueError`` (advance the model instead).

        O(1) plus a short search: steps of a decode run change only the blocks in use,
        which the run's histogram gives for its step in flight at ``t``.
        """
        if t < self._now_s:
            raise ValueError(f"observe({t}) is before the model clock {self._now_s}")
        if self._batch is None:
            if self._waiting:
                raise ValueError(f"advance_to({t}) first: a step starts at {self._now_s}")
        elif t >= self._step_end_s:
            run = self._run_ahead() if self._jump else None
            if run is None or t >= run.quiet_end_s:
                raise ValueError(
                    f"advance_to({t}) first: the model is quiet only until {self.quiet_until()}"
                )
            return self._reading(run.new_blocks(run.steps_by(t)[0] + 1))  # the step at t
        seen = self._seen
        if seen is None:
            seen = self._seen = self._reading(0)
        return seen

    def _reading(self, extra_blocks: int) -> EngineObservation:
        """The gauges and counters as they are, with ``extra_blocks`` more in use."""
        pool, counters = self.pool, self.counters
        return EngineObservation(
            len(self._running),
            len(self._waiting),
            (pool.num_used + extra_blocks) / pool.num_blocks,
            counters.prefix_cache_queries,
            counters.prefix_cache_hits,
            counters.num_preemptions,
        )

    # -- driving -----------------------------------------------------------------------

    def submit(self, spec: RequestSpec, now: float) -> RequestState:
        """Queue ``spec`` at ``now``; see the module docstring for the timing contract."""
        if now < self._now_s:
            raise ValueError(f"submit at {now} is before the model clock {self._now_s}")
        pending = self.next_event_time()
        if pending is not None and pending < now:
            raise ValueError(f"advance_to({now}) first: an event is due at {pending}")
        if spec.prompt_tokens < 1 or spec.max_output_tokens < 1:
            raise ValueError("a request needs at least one prompt and one output token")
        if spec.prompt_tokens + spec.max_output_tokens > self.max_request_tokens:
            raise ValueError(
                f"request of {spec.prompt_tokens}+{spec.max_output_tokens} tokens exceeds "
                f"{self.max_request_tokens}"
            )
        if spec.request_id in self._states:
            raise ValueError(f"duplicate request id {spec.request_id!r}")
        self._now_s = now
        state = RequestState(spec, now)
        self._states[spec.request_id] = state
        heads = not self._waiting
        self._waiting.append(state)
        self._seen = None
        if heads and self._ahead is not None and self._head_fits(len(self._running)):
            self._ahead = None  # the next step admits it: no run (behind a head: no change)
        return state

    def abort(self, request_id: str) -> None:
        """Drop an unfinished request (client gone) and free its blocks; no event."""
        state = self._states.pop(request_id, None)
        if state is None:
            return
        state.aborted = True
        self._ahead_known = False
        self._seen = None
        if state in self._running:
            self._running.remove(state)
            self._release(state)
        else:
            self._waiting.remove(state)

    def advance_to(self, t: float) -> list[EngineEvent]:
        """Run every step ending at or before ``t``; return their events in order."""
        if t < self._now_s:
            raise ValueError(f"advance_to({t}) is before the model clock {self._now_s}")
        events: list[EngineEvent] = []
        while True:
            if self._batch is None:
                if not self._running and not self._waiting:
                    break
                self._start_step(events)
            if self._step_end_s > t:
                break
            run = self._ahead if self._ahead_known and not self._record_gaps else None
            if run is not None and run.slowdown == self.slowdown:
                self._decode(run, t, in_flight=True)  # the step in flight is a run's too
                continue
            self._finish_step(events)
            if self._jump and self._running and (run := self._run_ahead()) is not None:
                self._decode(run, t, in_flight=False)
        self._now_s = t
        return events

    # -- one step ----------------------------------------------------------------------

    def _start_step(self, events: list[EngineEvent]) -> None:
        """Fix the next batch at the current clock, allocating its blocks."""
        self._ahead_known = False
        self._seen = None
        block_size = self.block_size
        pool = self.pool
        budget = self.max_num_batched_tokens
        batch: list[tuple[RequestState, int]] = []
        preempted = False
        running = self._running
        i = 0
        while i < len(running) and budget > 0:
            state = running[i]
            computed = state.num_computed_tokens
            n = state.spec.prompt_tokens + state.num_output_tokens - computed
            if n > budget:
                n = budget
            need = -(-(computed + n) // block_size) - state.num_blocks
            while need > 0 and not pool.allocate(need):
                victim = running.pop()  # the newest running request
                self._preempt(victim, events)
                preempted = True
                if victim is state:
                    break
            if preempted and state.num_blocks == 0:
                break  # it preempted itself: no one is left to schedule
            if need > 0:
                state.num_blocks += need
            batch.append((state, n))
            budget -= n
            i += 1
        waiting = self._waiting
        counters = self.counters
        while not preempted and waiting and budget > 0 and len(running) < self.max_num_seqs:
            state = waiting[0]
            plan = self._admission(state, budget)
            if plan is None:
                break
            hits, n, need = plan
            pool.acquire(state.spec.block_hashes[:hits])
            pool.allocate(need)
            computed = hits * block_size
            state.num_cached_blocks = hits
            state.num_blocks = hits + need
            state.num_computed_tokens = state.num_prefix_hit_tokens = computed
            counters.prefix_cache_queries += state.num_tokens
            counters.prefix_cache_hits += computed
            waiting.popleft()
            running.append(state)
            batch.append((state, n))
            budget -= n
        if not batch:
            raise RuntimeError("engine model scheduled an empty step with work queued")
        self._batch = batch
        self._step_start_s = self._now_s
        self._step_end_s = self._now_s + self._step_time_s(batch) * self.slowdown

    def _admission(self, state: RequestState, budget: int) -> tuple[int, int, int] | None:
        """``(prefix hit blocks, tokens to compute now, new blocks)`` to admit ``state``
        within ``budget``, or None when the free blocks do not suffice."""
        max_hit_blocks = (state.num_tokens - 1) // self.block_size
        hits, free_hits = self.pool.match(state.spec.block_hashes, max_hit_blocks)
        computed = hits * self.block_size
        n = min(state.num_tokens - computed, budget)
        need = _blocks_for(computed + n, self.block_size) - hits
        if need > self.pool.num_free - free_hits:
            return None
        return hits, n, need

    def _head_fits(self, batch_size: int) -> bool:
        """Whether a step of ``batch_size`` decodes would admit the waiting head."""
        budget = self.max_num_batched_tokens - batch_size
        return (
            batch_size < self.max_num_seqs
            and budget > 0
            and self._admission(self._waiting[0], budget) is not None
        )

    def _step_time_s(self, batch: list[tuple[RequestState, int]]) -> float:
        """Prefill chunks priced as one chunk of their summed size, decodes by batch and
        context."""
        prefill = prefill_context = decode_seqs = decode_context = 0
        for state, n in batch:
            computed = state.num_computed_tokens
            if n == 1 and state.num_output_tokens and computed:
                decode_seqs += 1
                decode_context += computed
            else:
                prefill += n
                prefill_context += n * computed
        cached = prefill_context // prefill if prefill else 0
        return self.cost.step_time_s(prefill, cached, decode_seqs, decode_context)

    def _finish_step(self, events: list[EngineEvent]) -> None:
        """Apply the step in flight at its end time: tokens, cached blocks, finishes."""
        assert self._batch is not None
        if self._ahead is None:
            self._ahead_known = False  # a run computed for this step still holds after it
        self._seen = None
        t = self._step_end_s
        block_size = self.block_size
        counters = self.counters
        counters.num_steps += 1
        counters.busy_s += t - self._step_start_s
        finished = False
        gaps: dict[float, int] | None = {} if self._record_gaps else None
        generated = 0
        for state, n in self._batch:
            if state.aborted:
                continue
            spec = state.spec
            computed = state.num_computed_tokens + n
            state.num_computed_tokens = computed
            hashes = spec.block_hashes
            cached = state.num_cached_blocks
            if cached < len(hashes):
                full = min(computed // block_size, len(hashes))
                if full > cached:
                    self.pool.commit(hashes[cached:full])
                    state.num_cached_blocks = full
            if computed < spec.prompt_tokens + state.num_output_tokens:
                continue  # a prefill chunk that did not reach the end
            state.num_output_tokens += 1
            generated += 1
            if state.first_token_s is None:
                state.first_token_s = t
                counters.num_prompt_tokens += spec.prompt_tokens
                events.append(FirstToken(spec.request_id, t, t - state.arrival_s))
            elif gaps is not None and state.last_token_s is not None:
                gap = t - state.last_token_s
                gaps[gap] = gaps.get(gap, 0) + 1
            state.last_token_s = t
            if state.num_output_tokens >= spec.max_output_tokens:
                state.finished_s = t
                finished = True
                self._release(state)
                del self._states[spec.request_id]
                events.append(
                    Finished(
                        spec.request_id,
                        t,
                        spec.prompt_tokens,
                        state.num_output_tokens,
                        state.first_token_s - state.arrival_s,
                        t - state.arrival_s,
                    )
                )
        counters.num_generation_tokens += generated
        if finished:
            self._running = [s for s in self._running if s.finished_s is None]
        if gaps:
            counters.inter_token_gaps.extend(gaps.items())
        self._batch = None
        self._now_s = t

    def _preempt(self, state: RequestState, events: list[EngineEvent]) -> None:
        self._release(state)
        state.num_computed_tokens = 0
        state.num_preemptions += 1
        self.counters.num_preemptions += 1
        self._waiting.appendleft(state)
        events.append(Preempted(state.spec.request_id, self._now_s))

    def _release(self, state: RequestState) -> None:
        cached = state.spec.block_hashes[: state.num_cached_blocks]
        self.pool.release(cached, state.num_blocks - state.num_cached_blocks)
        state.num_blocks = state.num_cached_blocks = 0

    # -- jumps -------------------------------------------------------------------------

    def _run_ahead(self) -> _DecodeRun | None:
        """The decode run after the step in flight (after now when none is), cached until
        the model changes."""
        run = self._ahead
        if not self._ahead_known or (run is not None and run.slowdown != self.slowdown):
            run = self._ahead = self._decode_run()
            self._ahead_known = True
        return run

    def _decode_run(self) -> _DecodeRun | None:
        """The run of pure-decode steps that would follow, or None when the next step is
        not one: someone prefills, is about to finish, or could be admitted."""
        running = self._running
        batch_size = len(running)
        if not batch_size or batch_size > self.max_num_batched_tokens:
            return None
        batch = self._batch
        if batch is not None:
            # the step in flight is the run's step 0: every running request decodes in it
            # (the checks below find any that prefills in it)
            if len(batch) != batch_size:
                return None
            pending, start_s = 1, self._step_end_s
        else:
            pending, start_s = 0, self._now_s
        block_size = self.block_size
        rooms = [0] * block_size
        context = 0
        max_steps = sys.maxsize
        for state in running:
            spec = state.spec
            computed = state.num_computed_tokens
            outputs = state.num_output_tokens
            if (
                spec.prompt_tokens + outputs - computed != 1
                or not outputs
                or state.num_cached_blocks < len(spec.block_hashes)
            ):
                return None  # prefilling, or a prompt block still to cache
            computed += pending
            left = spec.max_output_tokens - outputs - pending - 1
            if left < max_steps:
                max_steps = left
            context += computed
            rooms[state.num_blocks * block_size - computed] += 1
        if max_steps < 1:
            return None  # a request emits its last token in the next step
        if self._waiting and self._head_fits(batch_size):
            return None  # the next step admits someone
        below = tuple(accumulate(rooms[:-1], initial=0))
        # the most steps whose blocks fit: q full rounds of one block each, then p steps
        free = self.pool.num_free
        rounds = free // batch_size
        block_steps = rounds * block_size + bisect_right(below, free - rounds * batch_size) - 1
        if block_steps < 1:
            return None
        return _DecodeRun(
            start_s,
            context,
            min(max_steps, block_steps),
            self._decode_lines(batch_size),
            self.slowdown,
            below,
            self.cost if block_steps > max_steps else None,
        )

    def _decode_lines(self, batch_size: int) -> DecodeLines:
        lines = self._lines.get(batch_size)
        if lines is None:
            lines = self._lines[batch_size] = self.cost.decode_lines(batch_size)
        return lines

    def _decode(self, run: _DecodeRun, t: float, in_flight: bool) -> None:
        """Apply, without events, the steps of ``run`` that end by ``t`` (after the step in
        flight when ``in_flight``: a step of the same batch that ends where ``run``
        starts); start the run's next step when it ends after ``t``, or the step after
        the run when the run ``closes``."""
        self._seen = None
        counters = self.counters
        if in_flight:
            counters.num_steps += 1
            counters.busy_s += self._step_end_s - self._step_start_s
            self._now_s = self._step_end_s
        steps, now, next_end = run.steps_by(t)
        start_next = steps < run.max_steps
        if not start_next and run.closes:
            start_next, next_end = True, run.quiet_end_s  # the step after the run
        done = steps + in_flight  # tokens each request gains
        block_size = self.block_size
        running = self._running
        for state in running:
            computed = state.num_computed_tokens + done
            state.num_computed_tokens = computed
            state.num_output_tokens += done
            if done:
                state.last_token_s = now
            state.num_blocks = -(-(computed + start_next) // block_size)
        allocated = self.pool.allocate(run.new_blocks(steps + start_next))
        assert allocated, "a decode run outgrew the free blocks it was sized for"
        batch_size = run.lines.batch_size
        if self._record_gaps:
            step_time_s, context = run.lines.step_time_s, run.context_tokens
            counters.inter_token_gaps.extend(
                (step_time_s(context + i * batch_size) * run.slowdown, batch_size)
                for i in range(steps)
            )
        counters.num_generation_tokens += done * batch_size
        counters.num_steps += steps
        counters.busy_s += now - self._now_s
        self._now_s = now
        if start_next:
            self._batch = [(state, 1) for state in running]
            self._step_start_s = now
            self._step_end_s = next_end
            # what _decode_run would find after that step, in O(1) (none after the
            # step after the run: a request emits its last token in it)
            self._ahead = run if run.advance(steps + 1, next_end) else None
            self._ahead_known = True
        else:
            self._batch = None
            self._ahead_known = False
