"""KV-cache events applied to the prefix index (``isocost.prefix.kvevents``).

The batches are built as plain msgpack maps and arrays, the shape vLLM 0.32's
``ZmqEventPublisher`` sends (``[ts, [{"type": "BlockStored", ...}], dp_rank]``), not with the
module's own structs, so a drift from the wire format fails here.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from isocost.prefix.hashing import token_block_hashes
from isocost.prefix.index import PrefixIndex
from isocost.prefix.kvevents import (
    KvEventError,
    KvEventTracker,
    decode_batch,
    decode_sequence,
    engine_cached_tokens,
)

INDEX_BLOCK = 16
ENGINE_BLOCK = 64  # four index blocks per engine block
PROMPT = list(range(1000, 1000 + 3 * ENGINE_BLOCK))  # three engine blocks of token ids


def batch(*events: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode([1733000000.0, list(events), None])


def stored(
    hashes: list[Any], tokens: list[int], parent: Any = None, medium: str | None = "GPU"
) -> dict[str, Any]:
    return {
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
        "token_ids": tokens, "block_size": ENGINE_BLOCK, "lora_id": None, "medium": medium,
        "lora_name": None, "extra_keys": None, "group_idx": 0,
    }  # fmt: skip


def removed(hashes: list[Any]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def matched_tokens(index: PrefixIndex, tokens: list[int], slot: int = 0) -> int:
    return index.match_replica(slot, token_block_hashes(tokens, INDEX_BLOCK)) * INDEX_BLOCK


@pytest.fixture
def tracked() -> tuple[PrefixIndex, KvEventTracker]:
    index = PrefixIndex()
    index.add_replica(0, 10_000)
    index.add_replica(1, 10_000)
    return index, KvEventTracker(index, 0, INDEX_BLOCK)


def apply(tracker: KvEventTracker, sequence: int, *events: dict[str, Any]) -> bool:
    return tracker.apply(sequence, decode_batch(batch(*events)))


def test_stored_blocks_match_a_prompt_tokenized_alike(
    tracked: tuple[PrefixIndex, KvEventTracker],
) -> None:
    index, tracker = tracked
    # blocks 0-1 in one event, block 2 in the next, chained by the engine's own hash
    assert apply(tracker, 0, stored([b"\x01" * 32, 7], PROMPT[: 2 * ENGINE_BLOCK]))
    assert matched_tokens(index, [*PROMPT, 5, 6, 7]) == 2 * ENGINE_BLOCK
    assert apply(tracker, 1, stored([8], PROMPT[2 * ENGINE_BLOCK :], parent=7))
    assert matched_tokens(index, [*PROMPT, 5]) == 3 * ENGINE_BLOCK
    assert matched_tokens(index, PROMPT, slot=1) == 0  # another replica's entries untouched
    assert tracker.engine_block_tokens == ENGINE_BLOCK
    assert tracker.counts.stored_blocks == 3


def test_a_removed_block_cuts_the_match_there(tracked: tuple[PrefixIndex, KvEventTracker]) -> None:
    index, tracker = tracked
    apply(tracker, 0, stored([1, 2, 3], PROMPT))
    apply(tracker, 1, removed([2, 99]))  # 99 was never stored: ignored
    assert matched_tokens(index, PROMPT) == ENGINE_BLOCK
    assert tracker.counts.removed_blocks == 1
    apply(tracker, 2, {"type": "AllBlocksCleared"})
    assert matched_tokens(index, PROMPT) == 0
    assert index.num_blocks(0) == 0


def test_a_sequence_gap_drops_the_replicas_entries(
    tracked: tuple[PrefixIndex, KvEventTracker],
) -> None:
    index, tracker = tracked
    apply(tracker, 4, stored([1, 2, 3], PROMPT))  # the first batch seen may have any number
    index.insert(0, token_block_hashes([9] * 32, INDEX_BLOCK))  # a dispatch's own entries
    assert not apply(tracker, 6)  # 5 was lost: a removal may have been in it
    assert tracker.counts.resyncs == 1
    assert index.num_blocks(0) == 0
    assert apply(tracker, 7, stored([11], PROMPT[:ENGINE_BLOCK]))
    assert matched_tokens(index, PROMPT) == ENGINE_BLOCK


def test_after_a_resync_the_next_batch_starts_the_order_afresh(
    tracked: tuple[PrefixIndex, KvEventTracker],
) -> None:
    """A bad message resyncs (the gateway's follower); the batch after it is out of order
    for the lost one, and resyncing again would wipe what dispatches entered since."""
    index, tracker = tracked
    apply(tracker, 0, stored([1, 2, 3], PROMPT))
    tracker.resync()
    index.insert(0, token_block_hashes([9] * 32, INDEX_BLOCK))  # a dispatch's own entries
    assert apply(tracker, 2, stored([11], PROMPT[:ENGINE_BLOCK]))
    assert tracker.counts.resyncs == 1
    assert index.num_blocks(0) == 2 + 4  # the dispatch's two index blocks, the event's four
    assert not apply(tracker, 4)  # and a gap after that is one again
    assert tracker.counts.resyncs == 2


@pytest.mark.parametrize(
    "event",
    [
        stored([5], PROMPT[:ENGINE_BLOCK], parent=12345),  # its parent was never seen
        stored([5], PROMPT[: ENGINE_BLOCK - 1]),  # token ids short of a block
        {**stored([5], PROMPT[:40]), "block_size": 40},  # no multiple of the index's 16
    ],
    ids=["unseen parent", "short tokens", "odd block size"],
)
def test_blocks_that_cannot_be_placed_are_skipped(
    tracked: tuple[PrefixIndex, KvEventTracker], event: dict[str, Any]
) -> None:
    index, tracker = tracked
    assert apply(tracker, 0, event)
    assert index.num_blocks(0) == 0
    assert tracker.counts.unplaced_blocks == 1
    assert tracker.counts.resyncs == 0


def test_an_offload_tiers_blocks_are_not_a_prefill_hit(
    tracked: tuple[PrefixIndex, KvEventTracker],
) -> None:
    index, tracker = tracked
    apply(tracker, 0, stored([1], PROMPT[:ENGINE_BLOCK], medium="CPU"))
    assert index.num_blocks(0) == 0


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", msgspec.msgpack.encode({"ts": 1}), batch({"type": "BlockMoved"})],
    ids=["not msgpack", "a map", "unknown event"],
)
def test_what_is_no_batch_is_a_clear_error(payload: bytes) -> None:
    with pytest.raises(KvEventError, match="not a KV-event batch"):
        decode_batch(payload)


def test_sequence_frames() -> None:
    assert decode_sequence((41).to_bytes(8, "big")) == 41
    with pytest.raises(KvEventError, match="expected 8"):
        decode_sequence(b"\x00\x01")


@pytest.mark.parametrize(
    ("matched", "prompt", "expected"),
    [
        (0, 300, 0),
        (200, 300, 128),  # whole engine blocks only
        (300, 300, 256),  # all of it held: the last token is computed anyway
        (256, 257, 256),
        (256, 256, 128),  # 256 - 1 holds one whole 128-token block
    ],
)
def test_engine_cached_tokens(matched: int, prompt: int, expected: int) -> None:
    assert engine_cached_tokens(matched, prompt, 128) == expected


def test_index_discard_forgets_only_what_was_held() -> None:
    index = PrefixIndex()
    index.add_replica(0, 100)
    index.add_replica(1, 100)
    blocks = token_block_hashes(PROMPT, INDEX_BLOCK)
    index.insert(0, blocks)
    index.insert(1, blocks[:2])
    assert index.discard(0, [blocks[1], 424242]) == 1
    assert index.match_replica(0, blocks) == 1
    assert index.match_replica(1, blocks) == 2  # the shared block is still replica 1's
    assert int(index.block_counts[0]) == len(blocks) - 1


def test_an_engine_that_never_removes_costs_bounded_memory() -> None:
    """Stored blocks past twice the replica's capacity forget the oldest engine hashes: a
    publisher that stores without end (200 blocks on a 10-block replica) holds 20, and the
    newest still chain (a block stored again counts as new)."""
    index = PrefixIndex()
    index.add_replica(0, 10)
    tracker = KvEventTracker(index, 0, INDEX_BLOCK)
    for i in range(200):
        apply(tracker, i, stored([i], [i] * ENGINE_BLOCK))
    apply(tracker, 200, stored([5], [5] * ENGINE_BLOCK))  # the oldest, stored again
    assert len(tracker._blocks) == 20
    assert tracker.counts.forgotten_blocks == 200 + 1 - 20
    assert 5 in tracker._blocks and 199 in tracker._blocks and 180 not in tracker._blocks
    assert apply(tracker, 201, stored([900], PROMPT[:ENGINE_BLOCK], parent=199))
    assert tracker.counts.unplaced_blocks == 0
    assert apply(tracker, 202, stored([901], PROMPT[:ENGINE_BLOCK], parent=181))
    assert tracker.counts.unplaced_blocks == 1  # its parent was forgotten
