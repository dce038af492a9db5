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

Jumps. When a step is pure decode (every running request decodes, and the waiting head
cannot be admitted), the following steps keep the same batch until a request emits its
last token, the free blocks run out, or ``t`` is reached. ``advance_to`` applies such runs
in bulk: it still prices every step (so times are bit-identical to stepping one by one,
which ``jump=False`` does and a test compares) but touches no request until the run
ends. Bulk steps emit no events, since no request starts, finishes or is preempted in them.

Why admission stays impossible during a run: decode steps only take blocks (free blocks
and cached prefixes shrink), the running count and token budget do not change, so a head
that did not fit at the run's first step does not fit at any later one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from isocost.core.costmodel import CostModel
from isocost.engine.kvcache import BlockPool

__all__ = [
    "EngineCounters",
    "EngineEvent",
    "EngineModel",
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


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class EngineModel:
    """One replica's scheduler and KV cache over a cost model; see the module docstring."""

    __slots__ = (
        "_batch",
        "_jump",
        "_now_s",
        "_record_gaps",
        "_running",
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

        At least the step in flight's end. When that step is pure decode of every running
        request and the waiting head cannot be admitted (the condition of a jump), the run
        that follows only grows contexts, so each later step lasts at least as long as this
        one; no event comes before the first request's last token or the first step that
        could lack a block (each request needs at most one new block per ``block_size``
        steps). One step is left as margin for rounding.
        """
        end = self.next_event_time()
        batch = self._batch
        if batch is None or end is None or len(batch) != len(self._running):
            return end
        room = self.max_num_batched_tokens - len(batch)
        if (
            self._waiting
            and len(batch) < self.max_num_seqs
            and room > 0
            and self._admission(self._waiting[0], room) is not None
        ):
            return end  # the next step may admit the head
        steps = None
        for state, n in batch:
            if n != 1 or not state.num_output_tokens:
                return end
            left = state.spec.max_output_tokens - state.num_output_tokens - 1
            steps = left if steps is None or left < steps else steps
        if not steps:
            return end
        steps = min(steps, self.pool.num_free // len(batch) * self.block_size) - 1
        return end + max(steps, 0) * (end - self._step_start_s)

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
        self._waiting.append(state)
        return state

    def abort(self, request_id: str) -> None:
        """Drop an unfinished request (client gone) and free its blocks; no event."""
        state = self._states.pop(request_id, None)
        if state is None:
            return
        state.aborted = True
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
            self._finish_step(events)
            if self._jump:
                self._bulk_decode(t)
        self._now_s = t
        return events

    # -- one step ----------------------------------------------------------------------

    def _start_step(self, events: list[EngineEvent]) -> None:
        """Fix the next batch at the current clock, allocating its blocks."""
        budget = self.max_num_batched_tokens
        batch: list[tuple[RequestState, int]] = []
        preempted = False
        running = self._running
        i = 0
        while i < len(running) and budget > 0:
            state = running[i]
            n = min(state.num_tokens - state.num_computed_tokens, budget)
            need = _blocks_for(state.num_computed_tokens + n, self.block_size) - state.num_blocks
            while need > 0 and not self.pool.allocate(need):
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
        while not preempted and self._waiting and budget > 0 and len(running) < self.max_num_seqs:
            state = self._waiting[0]
            plan = self._admission(state, budget)
            if plan is None:
                break
            hits, n, need = plan
            self.pool.acquire(state.spec.block_hashes[:hits])
            self.pool.allocate(need)
            state.num_cached_blocks = hits
            state.num_blocks = hits + need
            state.num_computed_tokens = hits * self.block_size
            state.num_prefix_hit_tokens = state.num_computed_tokens
            self.counters.prefix_cache_queries += state.num_tokens
            self.counters.prefix_cache_hits += state.num_computed_tokens
            self._waiting.popleft()
            running.append(state)
            batch.append((state, n))
            budget -= n
        if not batch:
            raise RuntimeError("engine model scheduled an empty step with work queued")
        self._batch = batch
        self._step_start_s = self._now_s
        self._step_end_s = self._now_s + self._step_time_s(batch)

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

    def _step_time_s(self, batch: list[tuple[RequestState, int]]) -> float:
        prefill = prefill_context = decode_seqs = decode_context = 0
        for state, n in batch:
            if n == 1 and state.num_output_tokens and state.num_computed_tokens:
                decode_seqs += 1
                decode_context += state.num_computed_tokens
            else:
                prefill += n
                prefill_context += n * state.num_computed_tokens
        cached = prefill_context // prefill if prefill else 0
        return self.cost.step_time_s(prefill, cached, decode_seqs, decode_context) * self.slowdown

    def _finish_step(self, events: list[EngineEvent]) -> None:
        """Apply the step in flight at its end time: tokens, cached blocks, finishes."""
        assert self._batch is not None
        t = self._step_end_s
        block_size = self.block_size
        counters = self.counters
        counters.num_steps += 1
        counters.busy_s += t - self._step_start_s
        finished = False
        gaps: dict[float, int] = {}
        for state, n in self._batch:
            if state.aborted:
                continue
            state.num_computed_tokens += n
            hashes = state.spec.block_hashes
            full = min(state.num_computed_tokens // block_size, len(hashes))
            while state.num_cached_blocks < full:
                self.pool.commit(hashes[state.num_cached_blocks])
                state.num_cached_blocks += 1
            if state.num_computed_tokens < state.num_tokens:
                continue  # a prefill chunk that did not reach the end
            state.num_output_tokens += 1
            counters.num_generation_tokens += 1
            if state.first_token_s is None:
                state.first_token_s = t
                counters.num_prompt_tokens += state.spec.prompt_tokens
                events.append(FirstToken(state.spec.request_id, t, t - state.arrival_s))
            elif self._record_gaps and state.last_token_s is not None:
                gap = t - state.last_token_s
                gaps[gap] = gaps.get(gap, 0) + 1
            state.last_token_s = t
            if state.num_output_tokens >= state.spec.max_output_tokens:
                state.finished_s = t
                finished = True
                self._release(state)
                del self._states[state.spec.request_id]
                events.append(
                    Finished(
                        state.spec.request_id,
                        t,
                        state.spec.prompt_tokens,
                        state.num_output_tokens,
                        state.first_token_s - state.arrival_s,
                        t - state.arrival_s,
                    )
                )
        if finished:
            self._running = [s for s in self._running if s.finished_s is None]
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

    def _bulk_decode(self, t: float) -> None:
        """Apply, without events, the run of identical pure-decode steps that ends
        before any request's last token, before the blocks run out, and by ``t``."""
        running = self._running
        batch_size = len(running)
        if not batch_size or batch_size > self.max_num_batched_tokens:
            return
        steps = None
        for state in running:
            if state.num_tokens - state.num_computed_tokens != 1 or not state.num_output_tokens:
                return  # someone is prefilling
            left = state.spec.max_output_tokens - state.num_output_tokens - 1
            steps = left if steps is None or left < steps else steps
        if not steps:
            return
        if (
            self._waiting
            and batch_size < self.max_num_seqs
            and self.max_num_batched_tokens > batch_size
            and self._admission(self._waiting[0], self.max_num_batched_tokens - batch_size)
            is not None
        ):
            return  # the next step admits someone
        steps = self._steps_within_free_blocks(steps)
        # price each step exactly as single steps would, stopping at t
        start = self._now_s
        context = sum(s.num_computed_tokens for s in running)
        step_time_s = self.cost.step_time_s
        slowdown = self.slowdown
        record = self._record_gaps
        gaps = self.counters.inter_token_gaps
        done = 0
        while done < steps:
            end = start + step_time_s(0, 0, batch_size, context) * slowdown
            if end > t:
                break
            if record:
                gaps.append((end - start, batch_size))
            start = end
            context += batch_size
            done += 1
        if not done:
            return
        new_blocks = 0
        for state in running:
            state.num_computed_tokens += done
            state.num_output_tokens += done
            state.last_token_s = start
            blocks = _blocks_for(state.num_computed_tokens, self.block_size)
            if blocks > state.num_blocks:
                new_blocks += blocks - state.num_blocks
                state.num_blocks = blocks
        allocated = self.pool.allocate(new_blocks)
        assert allocated, "bulk decode outgrew the free blocks it was sized for"
        counters = self.counters
        counters.num_generation_tokens += done * batch_size
        counters.num_steps += done
        counters.busy_s += start - self._now_s
        self._now_s = start

    def _steps_within_free_blocks(self, max_steps: int) -> int:
        """The most decode steps (<= ``max_steps``) whose new blocks all fit."""

        def blocks_needed(steps: int) -> int:
            return sum(
                max(
                    _blocks_for(s.num_computed_tokens + steps, self.block_size) - s.num_blocks,
                    0,
                )
                for s in self._running
            )

        free = self.pool.num_free
        if blocks_needed(max_steps) <= free:
            return max_steps
        lo, hi = 0, max_steps  # blocks_needed(lo) fits, blocks_needed(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if blocks_needed(mid) <= free:
                lo = mid
            else:
                hi = mid
        return lo
