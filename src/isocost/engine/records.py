"""The records the engine model takes and gives: a request's spec and live state, the
events its steps emit, its counters and what a metrics scrape reads.

They live apart from ``isocost.engine.model`` so that the HTTP server, the cluster
simulator and the metrics exporter can name them without the scheduler's machinery.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "BlocksEvicted",
    "BlocksStored",
    "CacheChange",
    "EngineCounters",
    "EngineEvent",
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
    # Prompt tokens whose KV arrives with the request (a prefill -> decode hand-off): at
    # admission they count as computed, in blocks of its own, without a prefill step.
    kv_ready_tokens: int = 0
    # The prompt's token ids: what an engine publishing KV events says its blocks hold.
    token_ids: tuple[int, ...] = ()


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
    num_kv_ready_tokens: int = 0  # ``spec.kv_ready_tokens`` until a preemption drops them
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


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Full prompt blocks newly in the prefix cache (vLLM's ``BlockStored``): their hashes
    in order, the hash of the block before the first, the token ids they hold."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlocksEvicted:
    """Cached blocks evicted to make room (vLLM's ``BlockRemoved``)."""

    block_hashes: tuple[int, ...]


CacheChange = BlocksStored | BlocksEvicted
EngineEvent = FirstToken | Finished | Preempted | BlocksStored | BlocksEvicted


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
