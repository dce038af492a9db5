"""One request of a workload, and its prompt as a sequence of content segments.

A prompt is described, not stored: a tuple of ``Segment(seed, num_tokens)``. Segment seed
``s`` stands for one fixed, endless stream of tokens; a segment is the first
``num_tokens`` tokens of that stream. Two prompts share their first k tokens exactly when
their segment lists agree up to k tokens, so prefix sharing survives every step that keeps
the segments: the simulator (``prefix_block_keys``), the text renderer (``_render``) and a
live replay against a real server.

Mooncake's ``hash_ids`` map one to one: each id is a 512-token segment (the last one
partial), so equal ids at equal positions are a shared prefix here as in the trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "Segment",
    "WorkloadRequest",
    "prefix_block_keys",
    "segments_for_blocks",
]

TRACE_BLOCK_TOKENS = 512  # Mooncake's hash_ids granularity


@dataclass(frozen=True, slots=True)
class Segment:
    """The first ``num_tokens`` tokens of the content stream named ``seed``."""

    seed: int
    num_tokens: int

    def __post_init__(self) -> None:
        if self.num_tokens <= 0:
            raise ValueError(f"segment {self.seed}: num_tokens must be positive")


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """A request as a workload describes it: when, how long in and out, which prefix.

    ``arrival_s`` counts from the workload's start. ``segments`` cover the prompt exactly
    (their token counts sum to ``prompt_tokens``). Multi-turn sessions carry a
    ``session_id`` and the turn's index; turn k's segments start with turn k-1's whole
    prompt and reply, as a chat client resends the history.
    """

    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    segments: tuple[Segment, ...]
    session_id: str | None = None
    turn_index: int = 0

    def __post_init__(self) -> None:
        if self.prompt_tokens <= 0 or self.output_tokens <= 0:
            raise ValueError(f"request {self.request_id}: token counts must be positive")
        if sum(s.num_tokens for s in self.segments) != self.prompt_tokens:
            raise ValueError(f"request {self.request_id}: segments do not cover the prompt")
        if self.arrival_s < 0:
            raise ValueError(f"request {self.request_id}: arrival_s must be >= 0")


def segments_for_blocks(block_ids: Sequence[int], prompt_tokens: int) -> tuple[Segment, ...]:
    """Segments for a trace's block ids: one full block each, the last one cut to fit."""
    segments: list[Segment] = []
    left = prompt_tokens
    for block_id in block_ids:
        if left <= 0:
            break
        take = min(TRACE_BLOCK_TOKENS, left)
        segments.append(Segment(block_id, take))
        left -= take
    if left > 0:
        raise ValueError(
            f"{len(block_ids)} blocks of {TRACE_BLOCK_TOKENS} tokens cannot hold "
            f"{prompt_tokens} prompt tokens"
        )
    return tuple(segments)


Piece = tuple[int, int, int]  # (segment seed, first token, end token) within the stream


def prefix_block_keys(segments: Sequence[Segment], block_tokens: int) -> list[tuple[Piece, ...]]:
    """The content of each full ``block_tokens`` block, as stream pieces.

    Equal keys at position i mean equal tokens in block i. Callers that need chained
    hashes (equal hash = equal whole prefix) fold these keys with their own hasher; the
    simulator uses this to feed the prefix index without rendering any text.
    """
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    keys: list[tuple[Piece, ...]] = []
    current: list[Piece] = []
    room = block_tokens
    for segment in segments:
        offset = 0
        while offset < segment.num_tokens:
            take = min(room, segment.num_tokens - offset)
            current.append((segment.seed, offset, offset + take))
            offset += take
            room -= take
            if room == 0:
                keys.append(tuple(current))
                current = []
                room = block_tokens
    return keys
