"""One ``isocost engine`` replica in real time: the engine model, its metrics and its loop.

Each replica runs exactly one asyncio task, its *loop*, which maps wall time to modelled
time (``modelled = elapsed / time_scale``), advances the pure ``EngineModel`` to now,
feeds the metrics, wakes the request handlers whose request has enough new tokens, and
sleeps until the model's next step ends (at least ``_TICK_S``, so that very fast modelled
GPUs advance in batches of steps instead of spinning). Handlers never step the model;
they tokenize, submit, wait to be woken and write. Token *timing* therefore comes from the
model, not from how punctual the event loop is; the loop only decides when bytes leave.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass

from isocost.core.links import Link, link
from isocost.engine.config import EngineReplicaConfig, Faults
from isocost.engine.faults import FaultInjector
from isocost.engine.handoff import DEFAULT_HOLD_TIMEOUT_S, HeldKv, KvHandoffs
from isocost.engine.kvevents import KvEventPublisher
from isocost.engine.metrics import ReplicaMetrics
from isocost.engine.model import EngineModel
from isocost.engine.records import (
    BlocksEvicted,
    BlocksStored,
    CacheChange,
    Finished,
    FirstToken,
    RequestSpec,
    RequestState,
)
from isocost.engine.tokens import Tokenizer

__all__ = ["OUTPUT_DISTRIBUTIONS", "OutputLengths", "ServeOptions", "ServedReplica", "Waiter"]

_TICK_S = 0.001  # shortest sleep of a replica loop, in wall seconds
OUTPUT_DISTRIBUTIONS = ("exponential", "uniform", "max")


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """Settings shared by every replica of one ``isocost engine`` process."""

    host: str = "127.0.0.1"
    time_scale: float = 1.0  # wall seconds per modelled second
    stream_interval: int = 1  # output tokens per SSE chunk
    output_dist: str = "exponential"
    output_mean_tokens: float = 128.0
    seed: int = 0
    tokenizer_path: str | None = None
    write_timeout_s: float = 30.0  # a stream write blocked this long: the client is gone
    kv_hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S  # a prefill's KV waits this long
    kv_events_port: int | None = None  # replica i publishes KV-cache events on this + i
    prompt_details: bool = False  # usage says the prompt's cached tokens (as vLLM can)
    # a request's head must arrive within this of its connection opening or of the answer
    # before, its body within this of its head (``intake``): nginx's default header and
    # body timeouts, and above the gateway's 30 s upstream keep-alive, so that the engine
    # never closes an idle pooled connection the gateway may be about to reuse
    read_timeout_s: float = 60.0


class OutputLengths:
    """How many tokens a request generates when it does not ``ignore_eos``: drawn from a
    seeded distribution, capped by ``max_tokens``.

    * ``exponential``: ``1 + Exp(mean - 1)`` tokens, the heavy tail of chat answers;
    * ``uniform``: uniform on ``1..max_tokens``;
    * ``max``: always ``max_tokens``.
    """

    def __init__(self, dist: str, mean_tokens: float, rng: random.Random) -> None:
        if dist not in OUTPUT_DISTRIBUTIONS:
            raise ValueError(f"output distribution must be one of {OUTPUT_DISTRIBUTIONS}")
        if mean_tokens < 1:
            raise ValueError("mean output tokens must be >= 1")
        self.dist = dist
        self.mean_tokens = mean_tokens
        self._rng = rng

    def draw(self, max_tokens: int) -> int:
        if self.dist == "max":
            return max_tokens
        if self.dist == "uniform":
            return self._rng.randint(1, max_tokens)
        extra = self._rng.expovariate(1.0 / self.mean_tokens) if self.mean_tokens > 1 else 0.0
        return min(max_tokens, 1 + int(extra))


class Waiter:
    """A handler's claim on one request: woken once ``wake_at`` tokens exist or it ends."""

    __slots__ = ("event", "finish_reason", "state", "wake_at")

    def __init__(self, state: RequestState, wake_at: int, finish_reason: str) -> None:
        self.state = state
        self.wake_at = wake_at
        self.finish_reason = finish_reason
        self.event = asyncio.Event()

    async def wait(self) -> None:
        await self.event.wait()
        self.event.clear()


class ServedReplica:
    """One engine model served in real time: its metrics, faults and loop; see the module
    docstring."""

    def __init__(
        self,
        index: int,
        spec: EngineReplicaConfig,
        model: EngineModel,
        tokenizer: Tokenizer,
        options: ServeOptions,
        kv_events: KvEventPublisher | None = None,
    ) -> None:
        self.index = index
        self.kv_events = kv_events  # where its prefix cache's changes go, if anywhere
        self.spec = spec
        self.model = model
        self.tokenizer = tokenizer
        self.options = options
        self.metrics = ReplicaMetrics(model, spec.served_model_name)
        self.created = int(time.time())
        rng = random.Random(f"{options.seed}/{index}")
        self.faults = FaultInjector(model, rng)
        self.output_lengths = OutputLengths(options.output_dist, options.output_mean_tokens, rng)
        self.handoffs = KvHandoffs(model, options.kv_hold_timeout_s)
        self.link: Link = link(spec.link)  # what this replica's KV pulls travel over
        self.engine_id = f"isocost-{uuid.uuid4().hex[:12]}-{index}"
        self.port = 0  # the HTTP port, once bound (where decode replicas pull from)
        self._expiry: asyncio.TimerHandle | None = None
        self._waiters: dict[str, Waiter] = {}
        self._wakeup: asyncio.Future[None] | None = None
        self._origin = asyncio.get_running_loop().time()
        self.closing = False
        self.set_faults(spec.faults)

    @property
    def served_model_name(self) -> str:
        return self.spec.served_model_name

    def describe(self) -> str:
        cost = self.model.cost
        return (
            f"replica {self.index} {self.served_model_name} ({cost.model.id} on "
            f"{cost.tensor_parallel}x {cost.gpu.id}, {self.model.pool.num_blocks} KV blocks)"
        )

    def model_now(self) -> float:
        return (asyncio.get_running_loop().time() - self._origin) / self.options.time_scale

    # -- the loop ----------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._advance(self.model_now())
            self._wakeup = wakeup = loop.create_future()
            due = self.model.next_event_time()
            timer = None
            if due is not None:
                when = self._origin + due * self.options.time_scale
                timer = loop.call_at(max(when, loop.time() + _TICK_S), _resolve, wakeup)
            await wakeup
            if timer is not None:
                timer.cancel()

    def _advance(self, now: float) -> None:
        """Advance the model to ``now``: metrics from its events, wake-ups for handlers."""
        model, metrics, scale = self.model, self.metrics, self.options.time_scale
        steps_before = model.counters.num_steps
        changes: list[CacheChange] = []
        for event in model.advance_to(now):
            if isinstance(event, BlocksStored | BlocksEvicted):
                changes.append(event)
            elif isinstance(event, FirstToken):
                metrics.ttft.observe(event.ttft_s * scale)
            elif isinstance(event, Finished):
                metrics.e2e.observe(event.e2e_s * scale)
                waiter = self._waiters.get(event.request_id)
                if waiter is not None:
                    metrics.finished[waiter.finish_reason] += 1
        if self.kv_events is not None:
            self.kv_events.publish(changes)
        gaps = model.counters.inter_token_gaps
        for gap_s, times in gaps:
            metrics.inter_token.observe(gap_s * scale, times)
        gaps.clear()
        if model.counters.num_steps != steps_before:
            for waiter in self._waiters.values():
                state = waiter.state
                if state.num_output_tokens >= waiter.wake_at or state.finished_s is not None:
                    waiter.event.set()

    # -- requests ----------------------------------------------------------------------

    def submit(self, spec: RequestSpec, wake_every: int, finish_reason: str) -> Waiter:
        now = self.model_now()
        self._advance(now)  # collect events due before now, as the model's contract asks
        state = self.model.submit(spec, now)
        waiter = Waiter(state, wake_every, finish_reason)
        self._waiters[spec.request_id] = waiter
        self._wake_loop()
        return waiter

    def set_faults(self, faults: Faults) -> None:
        """Apply a fault set now. A new ``slowdown`` re-times the step in flight
        (``EngineModel.set_slowdown``) and the loop, asleep until that step's old end,
        looks again: a fault cleared mid-step is cleared at once."""
        now = self.model_now()
        self._advance(now)
        self.model.set_slowdown(faults.slowdown, now)
        self.faults.set(faults)
        self._wake_loop()

    # -- KV hand-offs (disaggregated serving) ---------------------------------------

    def hold_kv(self, request_id: str, num_tokens: int) -> HeldKv | None:
        """Keep a finished prefill's KV for a decode replica to pull (None: no room)."""
        self._advance(self.model_now())  # the model changes now, not at its last step
        held = self.handoffs.hold(request_id, num_tokens, self._wall_s())
        self._arm_expiry()
        self._wake_loop()
        return held

    def pull_kv(self, request_id: str) -> HeldKv | None:
        """Give a held prefill's KV to the decode replica that pulls it (None: unknown,
        pulled already or expired); its blocks are free again."""
        self._advance(self.model_now())
        held = self.handoffs.pull(request_id, self._wall_s())
        self._wake_loop()  # freed blocks may admit a waiting request
        return held

    def _wall_s(self) -> float:
        return asyncio.get_running_loop().time()

    def _arm_expiry(self) -> None:
        """One timer at the earliest hold's expiry, so held KV is freed on time even when
        nobody pulls or holds anything."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        due = self.handoffs.next_expiry_s()
        if due is not None:
            self._expiry = asyncio.get_running_loop().call_at(due, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        self._advance(self.model_now())
        self.handoffs.expire(self._wall_s())
        self._wake_loop()
        self._arm_expiry()

    def _wake_loop(self) -> None:
        """The model changed outside a step (a submit, held or freed blocks): the loop
        must look again at when its next step is due."""
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    def close(self) -> None:
        """Shutdown: wake every held request and handler so each ends at once."""
        self.closing = True
        if self._expiry is not None:
            self._expiry.cancel()
        self.faults.unhung.set()
        for waiter in self._waiters.values():
            waiter.event.set()

    def release(self, waiter: Waiter) -> None:
        """Forget a handler's request; an unfinished one (client gone) is aborted."""
        request_id = waiter.state.spec.request_id
        self._waiters.pop(request_id, None)
        if waiter.state.finished_s is None:
            self.model.abort(request_id)
            self.metrics.finished["abort"] += 1


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
