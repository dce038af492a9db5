"""One request of a workload, and its prompt as a sequence of content segments.

A prompt is described, not stored: a tuple of ``Segment(seed, num_tokens)``. Segment seed
``s`` stands for one fixed, endless stream of tokens; a segment is the first
``num_tokens`` tokens of that stream. Two prompts share their first k tokens exactly when
their segment lists agree up to k tokens, so prefix sharing survives every step that keeps
the segments: the simulator (``prefix_block_hashes``), the text renderer (``_render``) and
a live replay against a real server.

Blocks from segments, without tokens. One walk (``_block_spans``) cuts the prompt into
full blocks of ``block_tokens`` and reports them as spans: a run of whole blocks inside one
segment (its seed, first offset and block count: no per-block work to describe it), or one
block straddling segments (its pieces). ``prefix_block_keys`` spells every block out as
pieces; ``prefix_block_hashes`` folds the spans into chained hashes. Within a run, block
i's hash is ``hash((parent, seed, offset_i))`` with ``parent`` the hash of the block before
the run: the run's start follows from the blocks before it (a new run starts after a
straddling block or at offset 0 of a new segment), so that hash names the whole prefix as
a per-block chain would, and a run costs a C-level ``map`` rather than a Python loop.

Mooncake's ``hash_ids`` map one to one: each id is a 512-token segment (the last one
partial), so equal ids at equal positions are a shared prefix here as in the trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "Segment",
    "WorkloadRequest",
    "prefix_block_hashes",
    "prefix_block_keys",
    "segments_for_blocks",
]

TRACE_BLOCK_TOKENS = 512  # Mooncake's hash_ids granularity
_HASH_MASK = (1 << 63) - 1  # non-negative 63-bit hashes, as isocost.prefix.hashing makes


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
# (seed, first offset, whole blocks, ()) for a run inside one segment, or
# (0, 0, 1, pieces) for one block straddling segments.
_Span = tuple[int, int, int, tuple[Piece, ...]]


def _block_spans(segments: Sequence[Segment], block_tokens: int) -> list[_Span]:
    """Every full ``block_tokens`` block of the prompt, in order, as spans (see above)."""
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    spans: list[_Span] = []
    current: list[Piece] = []  # pieces of the block being filled across segments
    room = block_tokens
    for segment in segments:
        seed, size = segment.seed, segment.num_tokens
        offset = 0
        if current:
            offset = min(room, size)
            current.append((seed, 0, offset))
            room -= offset
            if room:
                continue
            spans.append((0, 0, 1, tuple(current)))
            current = []
        whole = (size - offset) // block_tokens
        if whole:
            spans.append((seed, offset, whole, ()))
            offset += whole * block_tokens
        if offset < size:
            current = [(seed, offset, size)]
            room = block_tokens - (size - offset)
    return spans


def prefix_block_keys(segments: Sequence[Segment], block_tokens: int) -> list[tuple[Piece, ...]]:
    """The content of each full ``block_tokens`` block, as stream pieces.

    Equal keys at position i mean equal tokens in block i (for chained hashes, equal
    exactly where the whole prefix is equal, use ``prefix_block_hashes``).
    """
    keys: list[tuple[Piece, ...]] = []
    for seed, first, count, pieces in _block_spans(segments, block_tokens):
        if pieces:
            keys.append(pieces)
        else:
            end = first + count * block_tokens
            keys.extend(((seed, o, o + block_tokens),) for o in range(first, end, block_tokens))
    return keys


def prefix_block_hashes(
    segments: Sequence[Segment], block_tokens: int, root: int
) -> tuple[int, ...]:
    """Chained hashes of each full ``block_tokens`` block, from the segments alone.

    Equal hashes at position i mean equal ``prefix_block_keys`` at positions 0..i (equal
    whole prefix, as token hashes would say); ``root`` is the parent of block 0 (the
    simulator passes ``isocost.prefix.hashing.ROOT_HASH``). Non-negative 63-bit ints,
    deterministic across processes (``hash`` of tuples of ints is not salted).
    """
    hashes: list[int] = []
    parent = root
    for seed, first, count, pieces in _block_spans(segments, block_tokens):
        if pieces:
            parent = hash((parent, pieces)) & _HASH_MASK
            hashes.append(parent)
        else:
            offsets = range(first, first + count * block_tokens, block_tokens)
            run = map(hash, zip(repeat(parent), repeat(seed), offsets))
            hashes.extend(map(_HASH_MASK.__and__, run))
            parent = hashes[-1]
    return tuple(hashes)
