"""The scheduling contract: the request view, the replica spec, engine scrapes, in-flight
records and the shadow-state hooks every stateful party implements.

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
        ...  a dispatch.Dispatcher parks it and schedules it again when a replica frees
    else:                                     # Outcome.REJECT: decision.reason, .retry_after_s

    replicas.apply_scrape("r0", EngineMetrics(num_running=12, num_waiting=3, kv_usage=0.41), now)
    replicas.apply_scrapes(slots, num_running, num_waiting, kv_usage, queries, hits, now)  # many
    replicas.set_health("r0", False); replicas.set_draining("r0", True); replicas.remove("r0")

(``ReplicaSet`` is in ``scheduling.state``, ``build_policy`` in ``scheduling.policies``.)

Time is the caller's clock in seconds (``now``; the simulator's virtual time, the gateway's
monotonic clock); deadlines are absolute on the same clock. Hooks for an unknown request
id (already completed, or its replica removed) are ignored and return ``False``.

A request the caller does not stream (``RequestView(stream=False)``) has no first token to
report: the set takes it to leave the engine's waiting queue at its predicted prefill end,
or sooner when a scrape shows fewer requests waiting than the set counts there. It is never
evidence of a late first token (only seen first tokens calibrate TTFT); its completion
calibrates the ITL factor.

Block hashes: every ``RequestView.block_hashes`` must be chained hashes of blocks of
``ReplicaSet.block_tokens`` tokens (``token_block_hashes(ids, block_tokens)``), or of text
blocks of about that many tokens when no tokenizer is at hand (``text_block_hashes(text,
4 * block_tokens)``); a trace's ``hash_ids`` work as they are with ``block_tokens`` equal to
the trace's block size (Mooncake: 512).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from isocost.core.costmodel import CostModel

__all__ = [
    "DEFAULT_CLASS",
    "REPLICA_ROLES",
    "EngineMetrics",
    "InFlight",
    "ReplicaSpec",
    "RequestView",
    "Role",
    "ShadowListener",
    "stable_hash64",
]

DEFAULT_CLASS = "default"  # the route class of a request no route rule claims

# What a replica does in prefill/decode disaggregation (``scheduling.disagg``): "prefill"
# computes prompts and hands their KV off, never decodes; "decode" decodes hand-offs and
# serves whole requests (prefilling them itself); "both" does all of it (the default).
Role = Literal["prefill", "decode", "both"]
REPLICA_ROLES: tuple[Role, ...] = ("prefill", "decode", "both")


def stable_hash64(text: str) -> int:
    """A 64-bit hash of ``text`` that is the same in every process (unlike ``hash``)."""
    data = text.encode("utf-8", "surrogatepass")  # any str, undecodable header bytes too
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


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
    stream: bool = True  # the caller will see its first token; False: only its completion
    arrival_s: float = 0.0
    prompt_tokens_exact: bool = True
    # Prompt tokens whose KV arrives with the request (a prefill -> decode hand-off,
    # ``scheduling.disagg``): priced as cached on every candidate, never prefilled again.
    kv_ready_tokens: int = 0
    # Who it is queued for fairly against others (``dispatch.RequestQueue``): the gateway's
    # API key, else the x-gateway-inference-fairness-id header; None: no one's in particular.
    flow: str | None = None

    @property
    def decode_only(self) -> bool:
        """Its whole prompt's KV arrives but the last token's, which rides in a decode step:
        its prefill stalls no running stream (a P/D decode leg)."""
        return 0 < self.kv_ready_tokens >= self.prompt_tokens - 1


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
    role: Role = "both"  # prefill/decode disaggregation (``Role``)

    def __post_init__(self) -> None:
        if self.role not in REPLICA_ROLES:
            raise ValueError(f"replica {self.replica_id}: role must be one of {REPLICA_ROLES}")
        if self.weight <= 0:
            raise ValueError(f"replica {self.replica_id}: weight must be > 0")
        if self.max_queue < 1:
            raise ValueError(f"replica {self.replica_id}: max_queue must be >= 1")

    @property
    def hardware_class(self) -> str:
        """Replicas alike enough to share what calibration learns: same model, GPU, tensor
        parallelism and weight precision."""
        cm = self.cost_model
        return f"{self.model}/{cm.gpu.name}/tp{cm.tensor_parallel}/{cm.weight_dtype}"

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
    kv_block_tokens: int | None = None  # tokens per KV block, when the engine says


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
    prefill_mark: float = 0.0  # the replica's prefill_done_s at its last observed token
    stream: bool = True  # its first token will be seen (``RequestView.stream``)
    # When it left the engine's waiting queue: its first token or, one not streamed, its
    # predicted prefill end (``predicted_start_s``) or a scrape that showed it running.
    started_s: float | None = None
    predicted_start_s: float | None = None  # not streamed: dispatch + corrected predicted TTFT
    # What was there at dispatch, for the prefill fit: tokens and requests queued ahead,
    # and sequences decoding.
    queued_prefill_tokens: float = 0.0
    queued_requests: float = 0.0
    running_sequences: float = 0.0
    # Its stream's tokens since the ITL factor last learnt from it: seconds observed,
    # seconds predicted, tokens (``Calibration.observe_tokens`` teaches them as one).
    itl_window_s: float = 0.0
    itl_window_predicted_s: float = 0.0
    itl_window_tokens: int = 0

    @property
    def remaining_tokens(self) -> int:
        """Expected output still to come. A request past its estimate is assumed to have a
        quarter of the estimate left (it is evidently a long one), within ``max_tokens``."""
        expected, generated = self.expected_output_tokens, self.generated_tokens
        remaining = expected - generated if generated < expected else max(expected // 4, 1)
        if self.max_tokens is not None:
            remaining = min(remaining, max(self.max_tokens - generated, 0))
        return remaining


@runtime_checkable
class ShadowListener(Protocol):
    """Receives every shadow-state hook after the set has applied it (stateful plugins).

    ``ReplicaSet.add_listener`` registers one (a ``Policy``, which forwards each hook to
    those of its plugins that implement this protocol)."""

    def on_dispatch(self, record: InFlight, now: float) -> None: ...

    def on_first_token(self, record: InFlight, now: float) -> None: ...

    def on_complete(self, record: InFlight, now: float, ok: bool) -> None: ...
