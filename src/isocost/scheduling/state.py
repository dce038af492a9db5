"""The scheduling contract: request view, replica view, shadow state and its hooks.

Who calls what (the gateway and the cluster simulator do exactly the same)::

    replicas = ReplicaSet(block_tokens=16)          # one per gateway / simulated cluster
    replicas.add(ReplicaSpec("r0", "llama-3.1-8b", CostModel(...), groups={"a100"}))
    policy = build_policy("equal_cost", rng=random.Random(seed))   # scheduling.policies
    replicas.add_listener(policy)                   # stateful plugins see every hook

    request = RequestView("req-1", "llama-3.1-8b", prompt_tokens=812,
                          block_hashes=token_block_hashes(ids, 16), max_tokens=256,
                          session_key="user-7", deadline_s=now + 2.0, arrival_s=now)
    decision = policy.schedule(request, replicas, now)     # a value, never raises
    if decision.outcome is Outcome.ADMIT:
        replicas.on_dispatch(request, decision.replica_id, now, decision=decision)
        ...  replicas.on_first_token("req-1", t1)           # first streamed token
        ...  replicas.on_tokens("req-1", 8, t2)             # optional: progress while streaming
        ...  replicas.on_complete("req-1", t3, ok=True, output_tokens=201)
    elif decision.outcome is Outcome.QUEUE:   # every eligible replica is at its queue cap
        ...  keep it in an admission.RequestQueue, schedule again when a replica frees
    else:                                     # Outcome.REJECT: decision.reason, .retry_after_s

    replicas.apply_scrape("r0", EngineMetrics(num_running=12, num_waiting=3, kv_usage=0.41), now)
    replicas.apply_scrapes(slots, num_running, num_waiting, kv_usage, queries, hits, now)  # many
    replicas.set_health("r0", False); replicas.set_draining("r0", True); replicas.remove("r0")

Time is the caller's clock in seconds (``now``; the simulator's virtual time, the gateway's
monotonic clock); deadlines are absolute on the same clock. Hooks for an unknown request
id (already completed, or its replica removed) are ignored and return ``False``.

Shadow state. Per replica the set keeps what this caller sent and has seen streamed
(exact and instant: requests waiting for their first token with their uncached prompt
tokens, running requests with their context, expected remaining output), plus the latest
engine scrape (``EngineMetrics``) which reveals traffic from other gateways: the engine's
counts above the local ones at scrape time are "foreign" load, weighted by freshness
``exp(-age / staleness_tau_s)`` so that a stale scrape fades out. Learned per replica:
``ttft_factor`` and ``itl_factor``, geometric EWMAs of observed / predicted TTFT and
inter-token time (1.0 = the cost model is right; 2.0 = this replica is twice as slow as
its spec; geometric, so an outlier cannot make a replica look slower than its twin).
A TTFT observation weighs by the prefill's share of its prediction (time queued says more
about the queue model than about the replica); a stream's inter-token time is compared
with its decode steps plus the prefills of the requests that started streaming meanwhile
(each prefill stalls every running stream). Waiting is evidence too: ``ttft_factor_at``
raises a replica's TTFT factor to (elapsed / predicted) of its oldest request still
awaiting a first token, so a replica that slowed down is priced before it answers.
Prefill duty (``scheduling.predict``): the predicted prefill seconds dispatched to each
replica, decayed over ``DUTY_TAU_S``, per second: the share of its time that prefill
chunks will take from the streams decoding there.
The prefix index remembers what was routed, not what the engine holds: a replica's
entries are forgotten when it comes back healthy and when a scrape's cumulative
prefix-cache counters go backwards (the engine restarted with an empty cache).
Expected output lengths come from an online estimator per (model, route class), fed by
``on_complete``.

Dynamic per-replica quantities live in numpy arrays indexed by a dense *slot* and are
updated incrementally by the hooks, so that a policy can price a thousand replicas with a
few vector operations; ``ReplicaState`` is a per-replica read view over them. The prefix
index (``isocost.prefix.index``) receives each dispatched request's block hashes.

Block hashes: every ``RequestView.block_hashes`` must be chained hashes of blocks of
``ReplicaSet.block_tokens`` tokens (``token_block_hashes(ids, block_tokens)``), or of text
blocks of about that many tokens when no tokenizer is at hand (``text_block_hashes(text,
4 * block_tokens)``); a trace's ``hash_ids`` work as they are with ``block_tokens`` equal to
the trace's block size (Mooncake: 512).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from isocost.core.costmodel import CostModel
from isocost.core.errors import UnknownEntryError
from isocost.prefix.index import PrefixIndex
from isocost.scheduling.estimate import OutputLengthEstimator
from isocost.scheduling.predict import DUTY_TAU_S, IndexArray, Load, RawTimes, SlotKey
from isocost.scheduling.predict import predict_one as _predict_one
from isocost.scheduling.timing import CoefficientArrays, FloatArray, StepCoefficients

if TYPE_CHECKING:
    from isocost.scheduling.decision import Decision

__all__ = [
    "DEFAULT_CLASS",
    "EngineMetrics",
    "InFlight",
    "ReplicaSet",
    "ReplicaSpec",
    "ReplicaState",
    "RequestView",
    "ShadowListener",
    "stable_hash64",
]

DEFAULT_CLASS = "default"  # the route class of a request no route rule claims
_FACTOR_MIN, _FACTOR_MAX = 0.05, 20.0  # bounds of one observed/predicted ratio
_BoolArray = npt.NDArray[np.bool_]
# (maximum, minimum, any) for formulas written once for one slot and for many
_Ops = tuple[Callable[[Any, Any], Any], Callable[[Any, Any], Any], Callable[[Any], Any]]
_PYTHON_OPS: _Ops = (max, min, bool)
_NUMPY_OPS: _Ops = (np.maximum, np.minimum, np.any)


def stable_hash64(text: str) -> int:
    """A 64-bit hash of ``text`` that is the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True, slots=True)
class RequestView:
    """What the scheduler knows about one request."""

    request_id: str
    model: str  # the model name the client asked for
    prompt_tokens: int  # exact count, or an estimate (prompt_tokens_exact=False)
    block_hashes: tuple[int, ...] = ()  # chained prompt block hashes (see module docstring)
    max_tokens: int | None = None
    session_key: str | None = None  # affinity key: x-session-id, else the user field
    priority: int = 0  # higher is served first
    deadline_s: float | None = None  # absolute, caller's clock: first token wanted by then
    tpot_target_s: float | None = None  # mean time per output token wanted after the first
    route_class: str | None = None  # None: classified by the policy's route table
    stream: bool = False
    arrival_s: float = 0.0
    prompt_tokens_exact: bool = True


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """Static description of one replica."""

    replica_id: str
    model: str  # the model name it serves
    cost_model: CostModel  # its model on its GPUs with its tensor parallelism
    weight: float = 1.0  # static preference / traffic share (> 0)
    usd_per_hour: float | None = None  # None: GPU list price times tensor parallelism
    max_queue: int = 128  # waiting requests beyond which it takes no new work
    groups: frozenset[str] = frozenset()  # route groups it belongs to
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.weight <= 0:
            raise ValueError(f"replica {self.replica_id}: weight must be > 0")
        if self.max_queue < 0:
            raise ValueError(f"replica {self.replica_id}: max_queue must be >= 0")

    @property
    def price_usd_per_hour(self) -> float:
        if self.usd_per_hour is not None:
            return self.usd_per_hour
        return self.cost_model.gpu.usd_per_hour * self.cost_model.tensor_parallel


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """Engine-neutral scrape of one replica (the gateway maps vLLM/SGLang names into it)."""

    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of the KV pool in use, 0..1
    prefix_cache_queries: int = 0  # cumulative counters, tokens
    prefix_cache_hits: int = 0
    num_preemptions: int = 0  # cumulative


@dataclass(slots=True)
class InFlight:
    """One dispatched, unfinished request on a replica (mutable: it advances as it streams)."""

    request_id: str
    replica_id: str
    slot: int
    model: str
    route_class: str
    prompt_tokens: int
    cached_tokens: int  # predicted prefix-cache hit at dispatch
    expected_output_tokens: int
    dispatch_s: float
    predicted_ttft_s: float  # uncorrected cost-model prediction at dispatch
    predicted_step_s: float  # uncorrected decode step with it in the batch, at dispatch
    generated_tokens: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    max_tokens: int | None = None
    predicted_wait_s: float = 0.0  # uncorrected: the part of predicted_ttft_s spent queued
    prefill_mark: float = 0.0  # the replica's prefill_done_tokens at its last observed token

    @property
    def remaining_tokens(self) -> int:
        """Expected output still to come. A request past its estimate is assumed to have a
        quarter of the estimate left (it is evidently a long one), within ``max_tokens``."""
        expected, generated = self.expected_output_tokens, self.generated_tokens
        remaining = expected - generated if generated < expected else max(expected // 4, 1)
        if self.max_tokens is not None:
            remaining = min(remaining, max(self.max_tokens - generated, 0))
        return remaining


class ShadowListener(Protocol):
    """Receives every shadow-state hook after the set has applied it (stateful plugins)."""

    def on_dispatch(self, record: InFlight, now: float) -> None: ...

    def on_first_token(self, record: InFlight, now: float) -> None: ...

    def on_complete(self, record: InFlight, now: float, ok: bool) -> None: ...


class ReplicaState:
    """Read view of one replica: its spec, in-flight requests and shadow numbers."""

    __slots__ = (
        "_set",
        "awaiting",
        "coefficients",
        "in_flight",
        "slot",
        "spec",
    )

    def __init__(self, replica_set: ReplicaSet, spec: ReplicaSpec, slot: int) -> None:
        self._set = replica_set
        self.spec = spec
        self.slot = slot
        self.coefficients = StepCoefficients.fit(spec.cost_model)  # its timing, fitted once
        self.in_flight: dict[str, InFlight] = {}
        self.awaiting: dict[str, InFlight] = {}  # no first token yet, in dispatch order

    @property
    def replica_id(self) -> str:
        return self.spec.replica_id

    @property
    def healthy(self) -> bool:
        return bool(self._set.healthy[self.slot])

    @property
    def draining(self) -> bool:
        return bool(self._set.draining[self.slot])

    @property
    def num_waiting(self) -> int:
        """Local requests dispatched here still waiting for their first token."""
        return int(self._set.local_waiting[self.slot])

    @property
    def num_running(self) -> int:
        """Local requests streaming output here."""
        return int(self._set.local_running[self.slot])

    @property
    def ttft_factor(self) -> float:
        return float(self._set.ttft_factor[self.slot])

    @property
    def itl_factor(self) -> float:
        return float(self._set.itl_factor[self.slot])

    @property
    def scrape_s(self) -> float | None:
        """When the latest scrape was taken, None before the first one."""
        taken = float(self._set.scrape_s[self.slot])
        return None if taken == -math.inf else taken

    def prefill_duty(self, now: float) -> float:
        """Share of its time prefill chunks recently dispatched here will take (0..)."""
        return float(self._set.prefill_duty(now, self.slot))

    def staleness_s(self, now: float) -> float | None:
        """Age of the latest scrape, None before the first one."""
        return None if self.scrape_s is None else now - self.scrape_s


_ARRAYS_FLOAT = (
    "weight",
    "usd_per_hour",
    "num_gpus",
    "kv_capacity_tokens",
    "max_queue",
    "max_num_seqs",
    "local_waiting",
    "local_running",
    "local_queued_prefill_tokens",
    "local_context_tokens",
    "local_kv_tokens",
    "local_remaining_tokens",
    "foreign_waiting",
    "foreign_running",
    "scraped_kv_usage",
    "scraped_prefix_queries",
    "scraped_prefix_hits",
    "scrape_s",
    "ttft_factor",
    "itl_factor",
    "prefill_done_tokens",
    "awaiting_since_s",
    "awaiting_ttft_s",
    "prefill_busy_s",
    "prefill_busy_at_s",
)
_ARRAYS_BOOL = ("active", "healthy", "draining")


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
        if staleness_tau_s <= 0:
            raise ValueError("staleness_tau_s must be > 0")
        if not 0.0 <= factor_alpha <= 1.0:
            raise ValueError("factor_alpha must be in [0, 1]")
        self.block_tokens = block_tokens
        self.staleness_tau_s = staleness_tau_s
        self.factor_alpha = factor_alpha
        self.estimator = estimator or OutputLengthEstimator()
        self.prefix = PrefixIndex()
        self.mean_prompt_tokens = prior_prompt_tokens
        self.mean_output_tokens = self.estimator.prior_tokens
        self.version = 0  # bumped on membership, health and draining changes
        self._capacity = 0
        self._states: list[ReplicaState | None] = []
        self._by_id: dict[str, ReplicaState] = {}
        self._free_slots: list[int] = []
        self._requests: dict[str, InFlight] = {}
        self._listeners: list[ShadowListener] = []
        self._model_masks: dict[str, _BoolArray] = {}
        self._group_masks: dict[str, _BoolArray] = {}
        self.salt = np.zeros(0, dtype=np.uint64)
        self.coef = CoefficientArrays.zeros(0)
        self.ids = np.zeros(0, dtype=object)
        for name in _ARRAYS_FLOAT:
            setattr(self, name, np.zeros(0))
        for name in _ARRAYS_BOOL:
            setattr(self, name, np.zeros(0, dtype=bool))
        self._grow(8)

    # The arrays, declared for the type checker (set in _grow).
    weight: FloatArray
    usd_per_hour: FloatArray
    num_gpus: FloatArray
    kv_capacity_tokens: FloatArray
    max_queue: FloatArray
    max_num_seqs: FloatArray
    local_waiting: FloatArray
    local_running: FloatArray
    local_queued_prefill_tokens: FloatArray
    local_context_tokens: FloatArray
    local_kv_tokens: FloatArray
    local_remaining_tokens: FloatArray
    foreign_waiting: FloatArray
    foreign_running: FloatArray
    scraped_kv_usage: FloatArray
    scraped_prefix_queries: FloatArray  # the latest scrape's cumulative counters, -inf before
    scraped_prefix_hits: FloatArray
    scrape_s: FloatArray  # when the latest scrape was taken, -inf before the first
    ttft_factor: FloatArray
    itl_factor: FloatArray
    prefill_done_tokens: FloatArray  # cumulative uncached prompt tokens whose first token came
    awaiting_since_s: FloatArray  # dispatch of the oldest request awaiting its first token
    awaiting_ttft_s: FloatArray  # its uncorrected predicted TTFT
    prefill_busy_s: FloatArray  # predicted prefill seconds dispatched, decayed to ...
    prefill_busy_at_s: FloatArray  # ... this time (see ``prefill_duty``)
    active: _BoolArray
    healthy: _BoolArray
    draining: _BoolArray

    # -- membership ------------------------------------------------------------------

    def add(self, spec: ReplicaSpec) -> ReplicaState:
        """Add a replica (healthy, not draining, empty); its id must be new."""
        if spec.replica_id in self._by_id:
            raise ValueError(f"replica {spec.replica_id!r} already exists")
        if not self._free_slots:
            self._grow(2 * self._capacity)
        slot = min(self._free_slots)
        self._free_slots.remove(slot)
        state = ReplicaState(self, spec, slot)
        self._states[slot] = state
        self._by_id[spec.replica_id] = state
        cm = spec.cost_model
        self.coef.set(slot, state.coefficients)
        self.salt[slot] = np.uint64(stable_hash64(spec.replica_id))
        self.ids[slot] = spec.replica_id
        for name in _ARRAYS_FLOAT:
            getattr(self, name)[slot] = 0.0
        self.weight[slot] = spec.weight
        self.usd_per_hour[slot] = spec.price_usd_per_hour
        self.num_gpus[slot] = cm.tensor_parallel
        self.kv_capacity_tokens[slot] = cm.kv_capacity_tokens
        self.max_queue[slot] = spec.max_queue
        self.max_num_seqs[slot] = cm.limits.max_num_seqs
        self.scrape_s[slot] = -math.inf
        self.scraped_prefix_queries[slot] = self.scraped_prefix_hits[slot] = -math.inf
        self.awaiting_since_s[slot] = math.inf
        self.awaiting_ttft_s[slot] = 1.0
        self.ttft_factor[slot] = 1.0
        self.itl_factor[slot] = 1.0
        self.active[slot] = True
        self.healthy[slot] = True
        self.draining[slot] = False
        self._mask(self._model_masks, spec.model)[slot] = True
        for group in spec.groups:
            self._mask(self._group_masks, group)[slot] = True
        self.prefix.add_replica(slot, cm.kv_capacity_tokens // self.block_tokens)
        self.version += 1
        return state

    def remove(self, replica_id: str) -> None:
        """Remove a replica; its in-flight requests are forgotten (their hooks become no-ops)."""
        state = self.get(replica_id)
        slot = state.slot
        for request_id in list(state.in_flight):
            del self._requests[request_id]
        self.active[slot] = self.healthy[slot] = self.draining[slot] = False
        for masks in (self._model_masks, self._group_masks):
            for mask in masks.values():
                mask[slot] = False
        self.ids[slot] = None
        self.prefix.remove_replica(slot)
        self._states[slot] = None
        del self._by_id[replica_id]
        self._free_slots.append(slot)
        self.version += 1

    def get(self, replica_id: str) -> ReplicaState:
        state = self._by_id.get(replica_id)
        if state is None:
            raise UnknownEntryError("replica", replica_id, self._by_id)
        return state

    def state_at(self, slot: int) -> ReplicaState:
        state = self._states[slot]
        if state is None:
            raise KeyError(f"slot {slot} is empty")
        return state

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._by_id

    def __iter__(self) -> Iterator[ReplicaState]:
        return (s for s in self._states if s is not None)

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def capacity(self) -> int:
        """Length of every per-slot array."""
        return self._capacity

    def set_health(self, replica_id: str, healthy: bool) -> None:
        """Mark a replica (un)healthy. One that comes back may have restarted with an empty
        cache: its prefix entries are forgotten rather than claimed as hits that are gone."""
        slot = self.get(replica_id).slot
        if healthy and not self.healthy[slot]:
            self._forget_prefixes(slot)
        self.healthy[slot] = healthy
        self.version += 1

    def set_draining(self, replica_id: str, draining: bool) -> None:
        self.draining[self.get(replica_id).slot] = draining
        self.version += 1

    def add_listener(self, listener: ShadowListener) -> None:
        self._listeners.append(listener)

    def model_mask(self, model: str) -> _BoolArray:
        """Slots serving ``model`` (all False for an unknown model); do not modify."""
        mask = self._model_masks.get(model)
        return mask if mask is not None else np.zeros(self._capacity, dtype=bool)

    def group_mask(self, groups: frozenset[str]) -> _BoolArray:
        """Slots in any of ``groups``."""
        out = np.zeros(self._capacity, dtype=bool)
        for group in groups:
            mask = self._group_masks.get(group)
            if mask is not None:
                out |= mask
        return out

    @property
    def models(self) -> list[str]:
        return sorted(m for m, mask in self._model_masks.items() if mask.any())

    def request(self, request_id: str) -> InFlight | None:
        return self._requests.get(request_id)

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
        state = self.get(replica_id)
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
            cached = min(
                self.prefix.match_replica(slot, request.block_hashes) * self.block_tokens,
                request.prompt_tokens,
            )
        if known is None or known.output_tokens != expected:
            known = self.predict_one(slot, now, request.prompt_tokens, cached, expected)
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
        )
        self._requests[request.request_id] = record
        state.in_flight[request.request_id] = record
        state.awaiting[request.request_id] = record
        if len(state.awaiting) == 1:
            self._awaiting_head(state)
        self.local_waiting[slot] += 1
        self.local_queued_prefill_tokens[slot] += request.prompt_tokens - cached
        self.local_kv_tokens[slot] += request.prompt_tokens
        self.local_remaining_tokens[slot] += record.remaining_tokens
        decay = math.exp((self.prefill_busy_at_s[slot] - now) / DUTY_TAU_S)
        self.prefill_busy_s[slot] = self.prefill_busy_s[slot] * decay + known.prefill_s * float(
            self.ttft_factor[slot]
        )
        self.prefill_busy_at_s[slot] = now
        self.prefix.insert(slot, request.block_hashes)
        self.mean_prompt_tokens += 0.05 * (request.prompt_tokens - self.mean_prompt_tokens)
        for listener in self._listeners:
            listener.on_dispatch(record, now)
        return record

    def on_first_token(self, request_id: str, now: float) -> bool:
        """The first output token of ``request_id`` arrived (learns the TTFT factor)."""
        record = self._requests.get(request_id)
        if record is None or record.first_token_s is not None:
            return False
        self._start_running(record, now)
        # A TTFT spent mostly queued says more about the queue model than about the
        # replica's speed: weigh the observation by the prefill's share of the prediction.
        prefill_share = 1.0 - record.predicted_wait_s / max(record.predicted_ttft_s, 1e-9)
        self._learn(
            self.ttft_factor,
            record.slot,
            now - record.dispatch_s,
            record.predicted_ttft_s,
            weight=prefill_share,
        )
        self._advance(record, 1, now)
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
        if record.last_token_s is not None and now > record.last_token_s:
            step = self._step_now(record.slot, now)
            predicted = num_tokens * step + self._prefill_stall_s(record)
            self._learn(self.itl_factor, record.slot, now - record.last_token_s, predicted)
        self._advance(record, num_tokens, now)
        return True

    def on_complete(
        self, request_id: str, now: float, *, ok: bool = True, output_tokens: int | None = None
    ) -> bool:
        """``request_id`` finished (``ok``) or failed; ``output_tokens`` from the usage."""
        record = self._requests.pop(request_id, None)
        if record is None:
            return False
        slot = record.slot
        state = self.state_at(slot)
        del state.in_flight[request_id]
        generated = output_tokens if output_tokens is not None else record.generated_tokens
        if ok and generated > 0:
            self._learn_from_completion(record, generated, now)
            self.estimator.observe(record.model, record.route_class, generated)
            self.mean_output_tokens += 0.05 * (generated - self.mean_output_tokens)
        self.local_remaining_tokens[slot] -= record.remaining_tokens
        self.local_kv_tokens[slot] -= record.prompt_tokens + record.generated_tokens
        if record.first_token_s is None:
            self._stop_awaiting(record)
            self.local_waiting[slot] -= 1
            self.local_queued_prefill_tokens[slot] -= record.prompt_tokens - record.cached_tokens
        else:
            self.local_running[slot] -= 1
            self.local_context_tokens[slot] -= record.prompt_tokens + record.generated_tokens
        for listener in self._listeners:
            listener.on_complete(record, now, ok)
        return True

    def apply_scrape(self, replica_id: str, metrics: EngineMetrics, now: float) -> None:
        """Engine truth for ``replica_id`` at ``now``: load beyond ours is other gateways'."""
        self._scrape(
            self.get(replica_id).slot,
            (metrics.num_running, metrics.num_waiting, metrics.kv_usage),
            (metrics.prefix_cache_queries, metrics.prefix_cache_hits),
            now,
            _PYTHON_OPS,
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
        if not self.active[slots].all():
            raise ValueError("apply_scrapes: every slot must hold a replica of this set")

        def floats(values: npt.ArrayLike) -> FloatArray:
            return np.asarray(values, dtype=np.float64)

        load = (floats(num_running), floats(num_waiting), floats(kv_usage))
        counters = (floats(prefix_cache_queries), floats(prefix_cache_hits))
        self._scrape(slots, load, counters, now, _NUMPY_OPS)

    # -- derived load ----------------------------------------------------------------

    def freshness(self, now: float, key: SlotKey | int) -> FloatArray:
        """Weight of each slot's latest scrape: ``exp(-age / staleness_tau_s)``, 0 if none."""
        age = np.maximum(now - self.scrape_s[key], 0.0)
        return np.asarray(np.exp(-age / self.staleness_tau_s), dtype=np.float64)

    def waiting(self, now: float, key: SlotKey) -> FloatArray:
        """Effective waiting requests of the slots ``key`` (the queue-cap test)."""
        fresh = self.freshness(now, key)
        return np.asarray(self.local_waiting[key] + fresh * self.foreign_waiting[key])

    def load(self, now: float, key: SlotKey) -> Load:
        """Effective load of the slots ``key`` at ``now`` (local state plus fresh scrapes)."""
        return Load(*self._effective(now, key, np.maximum))

    def ttft_factor_at(self, now: float, key: SlotKey) -> FloatArray:
        """``ttft_factor`` of the slots ``key``, raised to what waiting already proves: the
        oldest request still awaiting its first token has taken (now - dispatch) / predicted
        times its uncorrected prediction at least. A replica that slowed down is seen before
        it answers, instead of looking cheap (and collecting a burst) until it does."""
        overdue = (now - self.awaiting_since_s[key]) / self.awaiting_ttft_s[key]
        return np.asarray(
            np.maximum(self.ttft_factor[key], np.minimum(overdue, _FACTOR_MAX)), dtype=np.float64
        )

    def predict_one(
        self, slot: int, now: float, prompt_tokens: int, cached_tokens: int, output_tokens: float
    ) -> RawTimes:
        """Uncorrected predicted times of one request on the replica in ``slot`` at ``now``
        (``predict`` for one replica, in Python floats: no numpy overhead per call)."""
        _, running, queued, context, remaining, kv_used, kv_capacity, duty = self._effective(
            now, slot, max
        )
        load = (running, context, queued, remaining, kv_used, kv_capacity, duty)
        coefficients = self.state_at(slot).coefficients
        return _predict_one(coefficients, load, prompt_tokens, cached_tokens, output_tokens)

    def _effective(
        self, now: float, key: SlotKey | int, maximum: Callable[[Any, Any], Any]
    ) -> tuple[Any, Any, Any, Any, Any, Any, Any, Any]:
        """``Load``'s fields for the slots ``key`` (arrays) or one slot (floats)."""
        fresh = self.freshness(now, key)
        foreign_waiting = fresh * self.foreign_waiting[key]
        foreign_running = fresh * self.foreign_running[key]
        capacity = self.kv_capacity_tokens[key]
        mean_out = self.mean_output_tokens
        return (
            self.local_waiting[key] + foreign_waiting,
            self.local_running[key] + foreign_running,
            self.local_queued_prefill_tokens[key] + foreign_waiting * self.mean_prompt_tokens,
            self.local_context_tokens[key]
            + foreign_running * (self.mean_prompt_tokens + mean_out / 2.0),
            self.local_remaining_tokens[key] + (foreign_running + foreign_waiting) * mean_out / 2.0,
            maximum(self.local_kv_tokens[key], fresh * self.scraped_kv_usage[key] * capacity),
            capacity,
            self.prefill_duty(now, key),
        )

    def prefill_duty(self, now: float, key: SlotKey | int) -> Any:
        """Share of time the slots ``key`` will spend prefilling, from what was recently
        dispatched to them: predicted prefill seconds, decayed over ``DUTY_TAU_S``."""
        age = now - self.prefill_busy_at_s[key]
        return self.prefill_busy_s[key] * np.exp(-age / DUTY_TAU_S) / DUTY_TAU_S

    # -- internals -------------------------------------------------------------------

    def _start_running(self, record: InFlight, now: float) -> None:
        slot = record.slot
        record.first_token_s = now
        self._stop_awaiting(record)
        self.local_waiting[slot] -= 1
        self.local_queued_prefill_tokens[slot] -= record.prompt_tokens - record.cached_tokens
        self.local_running[slot] += 1
        self.local_context_tokens[slot] += record.prompt_tokens + record.generated_tokens
        self.prefill_done_tokens[slot] += record.prompt_tokens - record.cached_tokens
        record.prefill_mark = self.prefill_done_tokens[slot]

    def _scrape(
        self,
        key: IndexArray | int,
        load: tuple[Any, Any, Any],
        counters: tuple[Any, Any],
        now: float,
        ops: _Ops,
    ) -> None:
        """A scrape of one slot (Python numbers, ``_PYTHON_OPS``) or of the slots ``key``
        (aligned arrays, ``_NUMPY_OPS``): one formula for both, as in ``_effective``.
        ``load`` is (running, waiting, KV usage); ``counters`` the cumulative prefix-cache
        (queries, hits): when they go back the engine restarted with an empty cache, and
        the slot's prefix entries are forgotten."""
        maximum, minimum, any_true = ops
        running, waiting, kv_usage = load
        queries, hits = counters
        restarted = (queries < self.scraped_prefix_queries[key]) | (
            hits < self.scraped_prefix_hits[key]
        )
        if any_true(restarted):
            for slot in np.extract(restarted, key).tolist():
                self._forget_prefixes(slot)
        local_waiting = self.local_waiting[key]
        local_total = local_waiting + self.local_running[key]
        foreign_waiting = maximum(waiting - local_waiting, 0.0)
        self.foreign_waiting[key] = foreign_waiting
        self.foreign_running[key] = maximum(running + waiting - local_total - foreign_waiting, 0.0)
        self.scraped_kv_usage[key] = minimum(maximum(kv_usage, 0.0), 1.0)
        self.scraped_prefix_queries[key] = queries
        self.scraped_prefix_hits[key] = hits
        self.scrape_s[key] = now

    def _forget_prefixes(self, slot: int) -> None:
        self.prefix.evict(slot, self.prefix.num_blocks(slot))

    def _stop_awaiting(self, record: InFlight) -> None:
        state = self.state_at(record.slot)
        head = next(iter(state.awaiting))
        del state.awaiting[record.request_id]
        if head == record.request_id:
            self._awaiting_head(state)

    def _awaiting_head(self, state: ReplicaState) -> None:
        """Track the oldest request awaiting its first token (``ttft_factor_at``'s evidence)."""
        head = next(iter(state.awaiting.values()), None)
        self.awaiting_since_s[state.slot] = math.inf if head is None else head.dispatch_s
        self.awaiting_ttft_s[state.slot] = 1.0 if head is None else max(head.predicted_ttft_s, 1e-9)

    def _advance(self, record: InFlight, num_tokens: int, now: float) -> None:
        slot = record.slot
        before = record.remaining_tokens
        record.generated_tokens += num_tokens
        record.last_token_s = now
        self.local_remaining_tokens[slot] += record.remaining_tokens - before
        self.local_context_tokens[slot] += num_tokens
        self.local_kv_tokens[slot] += num_tokens

    def _learn(
        self,
        factors: FloatArray,
        slot: int,
        observed_s: float,
        predicted_s: float,
        weight: float = 1.0,
    ) -> None:
        if predicted_s <= 0.0 or observed_s < 0.0:
            return
        # In log space (a geometric EWMA): factors multiply, and one observation 20x off
        # (a stall the model did not foresee) moves the factor by 20**alpha, not by +19*alpha.
        ratio = min(max(observed_s / predicted_s, _FACTOR_MIN), _FACTOR_MAX)
        step = self.factor_alpha * min(max(weight, 0.0), 1.0)
        factors[slot] *= (ratio / factors[slot]) ** step

    def _step_now(self, slot: int, now: float) -> float:
        """Uncorrected decode step of the slot's current batch (what its streams now see)."""
        _, running, _, context, *_ = self._effective(now, slot, max)
        return self.state_at(slot).coefficients.decode_step_s(max(running, 1.0), context)

    def _prefill_stall_s(self, record: InFlight) -> float:
        """Time the record's stream stalled for other requests' prefills since its last
        observed token (those whose first token arrived meanwhile); moves the mark."""
        slot = record.slot
        done = float(self.prefill_done_tokens[slot])
        stall = self.state_at(slot).coefficients.prefill_s(done - record.prefill_mark, 0.0)
        record.prefill_mark = done
        return stall

    def _learn_from_completion(self, record: InFlight, generated: int, now: float) -> None:
        slot = record.slot
        if record.first_token_s is None:
            # Not streamed: only the end-to-end time is known; it informs both factors.
            predicted = record.predicted_ttft_s + generated * record.predicted_step_s
            self._learn(self.ttft_factor, slot, now - record.dispatch_s, predicted)
            self._learn(self.itl_factor, slot, now - record.dispatch_s, predicted)
        elif record.last_token_s == record.first_token_s and generated > 1:
            # Streamed without progress hooks: the mean inter-token time since the first.
            step = (record.predicted_step_s + self._step_now(slot, now)) / 2.0
            predicted = (generated - 1) * step + self._prefill_stall_s(record)
            self._learn(self.itl_factor, slot, now - record.first_token_s, predicted)

    def _mask(self, masks: dict[str, _BoolArray], key: str) -> _BoolArray:
        mask = masks.get(key)
        if mask is None:
            mask = masks[key] = np.zeros(self._capacity, dtype=bool)
        return mask

    def _grow(self, size: int) -> None:
        old = self._capacity
        size = max(size, 8)

        def grown(a: npt.NDArray[np.generic]) -> npt.NDArray[np.generic]:
            out = np.zeros(size, dtype=a.dtype)
            out[:old] = a
            return out

        for name in (*_ARRAYS_FLOAT, *_ARRAYS_BOOL):
            setattr(self, name, grown(getattr(self, name)))
        self.salt = np.asarray(grown(self.salt), dtype=np.uint64)
        self.ids = grown(self.ids)
        self.coef = self.coef.grown(size)
        for masks in (self._model_masks, self._group_masks):
            for key in masks:
                masks[key] = np.asarray(grown(masks[key]), dtype=bool)
        self._states.extend([None] * (size - old))
        self._free_slots.extend(range(old, size))
        self._capacity = size
