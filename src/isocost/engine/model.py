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
  always computed). Each full prompt block is cached as soon as it is computed. A request
  whose KV arrived from a prefill replica (``RequestSpec.kv_ready_tokens``) is admitted
  with those tokens computed, in new blocks, so only its last prompt token is prefilled;
  a preemption drops them (it recomputes like any other). With ``cache_events`` the blocks
  cached and evicted come out of ``advance_to`` too (``BlocksStored``, ``BlocksEvicted``),
  in the order they happened: what the engine publishes as vLLM's KV-cache events.
* **Preemption.** When a running request needs a block and none is free, the newest
  running request is preempted by recompute: its blocks are released, its progress
  reset, and it goes to the front of the waiting queue (it keeps its generated tokens and
  later recomputes prompt + output). A step that preempted admits no one.
* **Step price.** The step's prefill chunks are priced as one chunk of their summed size
  (attending to their token-weighted mean cached context); decodes by batch size and total
  context. With one prefill chunk this is exactly ``CostModel.step_time_s``. The mean
  context makes a memory-bound chunk with a long cached context cheaper beside fresh
  chunks than alone (less KV is priced as read); ``prefill_floor_s`` is the least a
  prefill can cost in any company, which the simulator's isolated-service bound uses.

Driving contract::

    model = EngineModel(cost)
    state = model.submit(RequestSpec("r1", prompt_tokens=900, max_output_tokens=64), now)
    while (t := model.next_event_time()) is not None:
        for event in model.advance_to(t):   # FirstToken | Finished | Preempted | ...
            ...

* ``submit(spec, now)`` queues a request at ``now`` and returns its live ``RequestState``
  (read it, never write it). ``now`` must not be earlier than the model's clock, nor later
  than ``next_event_time()``: advance first, so no event is skipped.
* ``advance_to(t)`` runs every step that ends at or before ``t`` and returns their events
  in time order; a step ending after ``t`` stays in flight. The clock becomes ``t``.
* ``next_event_time()`` is the end of the step in flight, the clock itself when the
  engine is idle but has work (call ``advance_to`` to start the step), or ``None``.
* ``set_slowdown(factor, now)`` changes the step-time factor at ``now`` (advance first):
  the step in flight runs the rest of its work at the new factor.
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
for it, since no request starts, finishes or is preempted in it;
``isocost.engine.decoderun`` prices and counts its steps in closed form. The run's step
that ends after ``t`` is started by the run itself, at the closed form's time, and the
rest of the run is kept (moved past the steps done in O(1)) until the model changes, so
``quiet_until`` is O(1) and ``observe`` O(log steps) and both say exactly where
``advance_to`` will stand. When the run ends because a request is one token from its last,
with blocks to spare, the step after it is known too (the same batch, no preemption, no
admission) and the quiet time reaches its end, where that request finishes: a simulator
wakes the model once per run, not twice.

Times inside runs are the closed form's, so they agree with stepping one by one
(``jump=False``) to about 1e-12 relative rather than bit for bit; tokens, events and their
order, blocks and counters are identical, which tests compare.

Why admission stays impossible during a run: decode steps only take blocks (free blocks
and cached prefixes shrink), the running count and token budget do not change, so a head
that did not fit at the run's first step does not fit at any later one.
"""

from __future__ import annotations

import heapq
import sys
from collections import deque

from isocost.core.costmodel import CostModel, DecodeLines
from isocost.engine.decoderun import DecodeRun, decode_run
from isocost.engine.kvcache import BlockPool
from isocost.engine.records import (
    EngineCounters,
    EngineEvent,
    EngineObservation,
    Finished,
    FirstToken,
    Preempted,
    RequestSpec,
    RequestState,
)

__all__ = ["EngineModel", "prefill_floor_s"]


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def prefill_floor_s(cost: CostModel, new_tokens: int, cached_tokens: int = 0) -> float:
    """The least time the engine model can take to prefill ``new_tokens`` after
    ``cached_tokens`` from the prefix cache, in any company, at slowdown 1.

    In chunks of ``max_num_batched_tokens``, as alone (``CostModel.prefill_time_s``), each
    at its cheapest step (``_cheapest_prefill_step_s``).
    """
    budget = cost.limits.max_num_batched_tokens
    total, done = 0.0, 0
    while done < new_tokens:
        size = min(budget, new_tokens - done)
        total += _cheapest_prefill_step_s(cost, size, cached_tokens + done, budget)
        done += size
    return total


def _cheapest_prefill_step_s(cost: CostModel, size: int, context: int, budget: int) -> float:
    """The cheapest step holding a prefill chunk of ``size`` tokens after ``context``.

    Fresh prefill chunks (no cached context) joining it, ``p`` tokens in all, price the
    step at ``step_time_s(p, size * context // p)``; anything else a step could hold
    (decodes, cached contexts) only adds. The minimum over ``p`` up to the budget is found
    exactly by best-first branch and bound: ``step_time_s`` grows with both arguments, so
    ``step_time_s(lo, size * context // hi)`` bounds every ``p`` in ``lo..hi`` from below.
    """
    pairs = size * context  # the chunk's tokens times its context

    def step(tokens: int) -> float:
        return cost.step_time_s(tokens, pairs // tokens)

    best = step(size)
    ranges = [(0.0, size + 1, budget)]  # (lower bound, lo, hi)
    while ranges:
        bound, lo, hi = heapq.heappop(ranges)
        if bound >= best:
            break
        if hi - lo < 4:
            best = min([best, *map(step, range(lo, hi + 1))])
            continue
        mid = (lo + hi) // 2
        best = min(best, step(mid))
        for a, b in ((lo, mid - 1), (mid + 1, hi)):
            bound = cost.step_time_s(a, pairs // b)
            if bound < best:
                heapq.heappush(ranges, (bound, a, b))
    return best


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
        cache_events: bool = False,
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
        self.pool = BlockPool(blocks, log_changes=cache_events)
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
        self._ahead: DecodeRun | None = None
        self._ahead_known = False
        self._seen: EngineObservation | None = None  # observe() until the model changes

    # -- observation -------------------------------------------------------------------

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
        it is: for ``t`` from the model's clock up to ``quiet_until()`` (exclusive), or any
        ``t`` from the clock when the model is idle. Outside that window it raises
        ``ValueError`` (advance the model instead).

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
        state = RequestState(spec, now, num_kv_ready_tokens=spec.kv_ready_tokens)
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

    def set_slowdown(self, slowdown: float, now: float) -> None:
        """Stretch steps by ``slowdown`` from ``now`` on (advance to ``now`` first). The
        step in flight keeps the share of its work done and runs the rest at the new
        factor, so a fault cleared mid-step ends that step at once rather than when the
        old factor said: a step started under a large factor would else hold the replica
        (every later request queues behind it) long after the fault is gone."""
        if now < self._now_s:
            raise ValueError(f"set_slowdown at {now} is before the model clock {self._now_s}")
        pending = self.next_event_time()
        if pending is not None and pending < now:
            raise ValueError(f"advance_to({now}) first: an event is due at {pending}")
        if self._batch is not None:
            left_s = (self._step_end_s - now) / self.slowdown * slowdown
            self._step_end_s = now + left_s
        self.slowdown = slowdown
        self._ahead_known = False  # a decode run ahead was timed at the old factor
        self._seen = None

    def hold_blocks(self, num_blocks: int) -> bool:
        """Take ``num_blocks`` private blocks for no request: a prefill replica's KV kept
        for a decode replica to pull. Refused (False, nothing taken) unless the blocks
        left could still admit the largest request, so that held KV never leaves a
        waiting request unable to start on an otherwise idle engine."""
        largest = _blocks_for(self.max_request_tokens, self.block_size)
        if self.pool.num_free - num_blocks < largest or not self.pool.allocate(num_blocks):
            return False
        self._ahead_known = False
        self._seen = None
        return True

    def free_held_blocks(self, num_blocks: int) -> None:
        """Return blocks taken by ``hold_blocks`` (pulled, or held too long)."""
        self.pool.release((), num_blocks)
        self._ahead_known = False
        self._seen = None

    def cached_prefix_tokens(self, block_hashes: tuple[int, ...]) -> int:
        """Prompt tokens of ``block_hashes`` this replica's prefix cache holds now."""
        hits, _ = self.pool.match(block_hashes, len(block_hashes))
        return hits * self.block_size

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
        changes = self.pool.changes
        if changes:  # blocks cached and evicted (``cache_events``), since the last call
            events.extend(changes)
            changes.clear()
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
            hits, computed, n, need = plan
            pool.acquire(state.spec.block_hashes[:hits])
            pool.allocate(need)
            state.num_cached_blocks = hits
            state.num_blocks = hits + need
            state.num_computed_tokens = computed
            state.num_prefix_hit_tokens = hits * block_size
            counters.prefix_cache_queries += state.num_tokens
            counters.prefix_cache_hits += state.num_prefix_hit_tokens
            waiting.popleft()
            running.append(state)
            batch.append((state, n))
            budget -= n
        if not batch:
            raise RuntimeError("engine model scheduled an empty step with work queued")
        self._batch = batch
        self._step_start_s = self._now_s
        self._step_end_s = self._now_s + self._step_time_s(batch) * self.slowdown

    def _admission(self, state: RequestState, budget: int) -> tuple[int, int, int, int] | None:
        """``(prefix hit blocks, tokens computed already, tokens to compute now, new
        blocks)`` to admit ``state`` within ``budget``, or None when the free blocks do not
        suffice. Tokens whose KV arrived with it count as computed (in new blocks)."""
        max_hit_blocks = (state.num_tokens - 1) // self.block_size
        hits, free_hits = self.pool.match(state.spec.block_hashes, max_hit_blocks)
        computed = hits * self.block_size
        if state.num_kv_ready_tokens > computed:
            computed = min(state.num_kv_ready_tokens, state.num_tokens - 1)
        n = min(state.num_tokens - computed, budget)
        need = _blocks_for(computed + n, self.block_size) - hits
        if need > self.pool.num_free - free_hits:
            return None
        return hits, computed, n, need

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
                    self.pool.commit(
                        hashes[cached:full],
                        hashes[cached - 1] if cached else None,
                        spec.token_ids[cached * block_size : full * block_size],
                    )
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
        state.num_computed_tokens = state.num_kv_ready_tokens = 0  # recomputed from here
        state.num_preemptions += 1
        self.counters.num_preemptions += 1
        self._waiting.appendleft(state)
        events.append(Preempted(state.spec.request_id, self._now_s))

    def _release(self, state: RequestState) -> None:
        cached = state.spec.block_hashes[: state.num_cached_blocks]
        self.pool.release(cached, state.num_blocks - state.num_cached_blocks)
        state.num_blocks = state.num_cached_blocks = 0

    # -- jumps -------------------------------------------------------------------------

    def _run_ahead(self) -> DecodeRun | None:
        """The decode run after the step in flight (after now when none is), cached until
        the model changes."""
        run = self._ahead
        if not self._ahead_known or (run is not None and run.slowdown != self.slowdown):
            run = self._ahead = self._decode_run()
            self._ahead_known = True
        return run

    def _decode_run(self) -> DecodeRun | None:
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
        return decode_run(
            start_s,
            context,
            max_steps,
            rooms,
            self.pool.num_free,
            self._decode_lines(batch_size),
            self.slowdown,
            self.cost,
        )

    def _decode_lines(self, batch_size: int) -> DecodeLines:
        lines = self._lines.get(batch_size)
        if lines is None:
            lines = self._lines[batch_size] = self.cost.decode_lines(batch_size)
        return lines

    def _decode(self, run: DecodeRun, t: float, in_flight: bool) -> None:
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
