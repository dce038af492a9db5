"""An engine's own KV-cache events, applied to the prefix index: evictions known, not guessed.

vLLM (``--kv-events-config``, publisher ``zmq``) publishes each engine step's cache changes
as one msgpack batch ``[ts, events, data_parallel_rank]`` in a ZMQ multipart message
``(topic, sequence number as 8 bytes big-endian, batch)``; an event is a map tagged by
``type``: ``BlockStored`` (the engine's hashes of one or more new full blocks, the hash of
the block before them, their token ids, the block size), ``BlockRemoved`` (hashes) or
``AllBlocksCleared``. This module decodes the batches (unknown fields are skipped, so newer
engines still decode) and applies them to one replica's entries in the ``PrefixIndex``.

The engine's block hashes are never reproduced here: they depend on its hash algorithm,
its seed and its block size. A stored block's own token ids are in the event, so the
tracker hashes them with the index's chain (``token_block_hashes``, ``block_tokens`` per
index block, parent = the index hash the engine's parent block was given) and remembers
which index blocks each engine hash became; a removal then forgets exactly those. A
request's blocks hashed from the same token ids (the pool's tokenizer) thus match what
the engine holds. The engine's block size must be a multiple of ``block_tokens`` (vLLM:
16 on GPU, 128 on CPU; the index: 16).

A sequence gap (batches lost: a slow subscriber, a restarted engine) means the picture may
be wrong in ways no later event fixes (a missed removal claims a block that is gone), so
the replica's entries are dropped and rebuilt from what comes next (the dispatches' own
entries included); ``resyncs`` counts that, the known failure it avoids being an index
that keeps claiming blocks evicted while events were lost. Stored blocks that cannot be
placed (a parent stored before the tracker started, a block size that is no multiple of
the index's) are skipped and counted in ``unplaced_blocks``: a match walks from a prompt's
first block, so a block whose ancestors are unknown could never be matched anyway.

The engine hashes remembered are bounded by twice the replica's capacity in index blocks
(each engine block is at least one): an engine that stores and never removes (a bug, or a
publisher that is no engine) would otherwise grow them without end. Past the bound the
oldest are forgotten, counted in ``forgotten_blocks``; the index's own LRU has let their
blocks go long before, and a removal of one forgotten is ignored.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import msgspec

from isocost.core.jsontext import UNDECODABLE
from isocost.prefix.hashing import ROOT_HASH, token_block_hashes
from isocost.prefix.index import PrefixIndex

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KvEventError",
    "KvEventTracker",
    "TrackerCounts",
    "decode_batch",
    "decode_sequence",
    "engine_cached_tokens",
]

EngineHash = bytes | int  # vLLM's ExternalBlockHash


class BlockStored(msgspec.Struct, tag=True, frozen=True):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, frozen=True):
    block_hashes: list[EngineHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


class KvEventError(ValueError):
    """A message that is not a KV-event batch."""


_decoder = msgspec.msgpack.Decoder(EventBatch)
# the medium of an engine's own (GPU or CPU-backend) cache; offload tiers name others
_PRIMARY_MEDIA = {None, "GPU"}


def decode_batch(payload: bytes) -> EventBatch:
    try:
        return _decoder.decode(payload)
    except UNDECODABLE as exc:
        raise KvEventError(f"not a KV-event batch: {exc}") from None


def decode_sequence(frame: bytes) -> int:
    if len(frame) != 8:
        raise KvEventError(f"sequence frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


@dataclass(slots=True)
class TrackerCounts:
    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    unplaced_blocks: int = 0
    forgotten_blocks: int = 0
    resyncs: int = 0


class KvEventTracker:
    """One replica's engine events mapped onto its entries in a ``PrefixIndex``."""

    def __init__(self, index: PrefixIndex, slot: int, block_tokens: int) -> None:
        self.index = index
        self.slot = slot
        self.block_tokens = block_tokens
        self.engine_block_tokens: int | None = None  # learned from the first stored block
        self.counts = TrackerCounts()
        self._blocks: dict[EngineHash, tuple[int, ...]] = {}  # engine hash -> index blocks
        self._last_sequence: int | None = None

    def apply(self, sequence: int, batch: EventBatch) -> bool:
        """Apply one batch; False when a gap before it forced a resync first."""
        in_order = self._last_sequence is None or sequence == self._last_sequence + 1
        if not in_order:
            self.resync()
        self._last_sequence = sequence
        self.counts.batches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                self._remove(event)
            else:
                self._clear()
        return in_order

    def resync(self) -> None:
        """Forget this replica's entries: what is cached is unknown until events rebuild it.
        The next batch starts the order afresh (no second resync for the gap it follows)."""
        self.counts.resyncs += 1
        self._last_sequence = None
        self._clear()

    def _clear(self) -> None:
        self.index.evict(self.slot, self.index.num_blocks(self.slot))
        self._blocks.clear()

    def _store(self, event: BlockStored) -> None:
        """Insert the event's blocks, or count them unplaced (an unseen parent, a block size
        that is no multiple of the index's, token ids that do not fill the blocks)."""
        if event.medium not in _PRIMARY_MEDIA:
            return  # an offload tier's copy: not what a prefill would hit here
        size = event.block_size
        placed = (
            None if event.parent_block_hash is None else self._blocks.get(event.parent_block_hash)
        )
        if (
            size <= 0
            or size % self.block_tokens
            or len(event.token_ids) != size * len(event.block_hashes)
            or (event.parent_block_hash is not None and placed is None)
        ):
            self.counts.unplaced_blocks += len(event.block_hashes)
            return
        parent = ROOT_HASH if placed is None else placed[-1]
        self.engine_block_tokens = size
        for i, engine_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[i * size : (i + 1) * size]
            blocks = token_block_hashes(tokens, self.block_tokens, parent)
            self.index.insert(self.slot, blocks)
            self._blocks.pop(engine_hash, None)  # stored again: the newest, not the oldest
            self._blocks[engine_hash] = tuple(blocks)
            parent = blocks[-1]
        self.counts.stored_blocks += len(event.block_hashes)
        excess = len(self._blocks) - 2 * max(self.index.capacity_blocks(self.slot), 1)
        for engine_hash in list(itertools.islice(self._blocks, max(excess, 0))):
            del self._blocks[engine_hash]
        self.counts.forgotten_blocks += max(excess, 0)

    def _remove(self, event: BlockRemoved) -> None:
        if event.medium not in _PRIMARY_MEDIA:
            return
        for engine_hash in event.block_hashes:
            blocks = self._blocks.pop(engine_hash, None)
            if blocks is not None:
                self.index.discard(self.slot, blocks)
                self.counts.removed_blocks += 1


def engine_cached_tokens(matched_tokens: int, prompt_tokens: int, engine_block_tokens: int) -> int:
    """The prefix-cache hit an engine reports for a prompt whose first ``matched_tokens``
    it holds: whole engine blocks only, and never the prompt's last token (vLLM computes
    at least one token of every prompt, so a fully cached prompt hits one token short)."""
    usable = min(matched_tokens, prompt_tokens - 1)
    return max(0, usable - usable % engine_block_tokens)
