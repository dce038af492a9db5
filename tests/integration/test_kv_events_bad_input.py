"""``isocost serve`` following a KV-event publisher that sends junk, out of order, too
much, or too big, over a real ZMQ socket to one ``isocost engine`` replica (so every
completion is dispatched to the replica whose events are followed). What must hold: no
request fails, the follower keeps going, each bad message is counted, and a stream that
stays bad costs one resync, not one per message (a resync drops the dispatches' entries
too, which would leave the replica worse off than without events).
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import zmq
from gateway_harness import http, wait_for
from isocost_procs import Proc
from test_gateway_kv_events import (
    ENGINE_BLOCK,
    KEY,
    MODEL,
    WORDS,
    Publisher,
    connected,
    metric,
    publisher,
    route,
    start_following_gateway,
    stored,
    token_ids,
    tokenizer_path,
)

from isocost.gateway.kvevents import MAX_FRAME_BYTES

__all__ = ["publisher", "tokenizer_path"]  # fixtures


@pytest.fixture
def gateway(tmp_path: Path, procs: list[Proc], publisher: Publisher, tokenizer_path: Path) -> Proc:
    """One engine, ``events``, following the publisher."""
    return start_following_gateway(tmp_path, procs, publisher, tokenizer_path, plain=False)


def count(gateway: Proc, name: str) -> float:
    return metric(gateway, f"isocost_kv_event_{name}_total", "events")


def complete(gateway: Proc, prompt: str) -> None:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 3}).encode()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    status, _, answer = http("POST", gateway.url + "/v1/completions", body, headers=headers)
    assert status == 200, answer


def _batch(events: object) -> bytes:
    return msgspec.msgpack.encode([1.0, events, None])


SEQ = (1).to_bytes(8, "big")
GARBAGE = [
    [b"", SEQ, b"\xc1 not msgpack"],
    [b"", SEQ, msgspec.msgpack.encode({"ts": 1.0})],  # a map, not an array
    [b"", SEQ, _batch("events")],
    [b"", SEQ, _batch([{"type": "BlockRemoved", "block_hashes": [1.5, "x"]}])],
    [b"", SEQ, _batch([{"type": "BlockStored", "block_hashes": [1], "token_ids": "abc"}])],
    [b"", SEQ, _batch([{"type": "BlocksTeleported", "block_hashes": [1]}])],
    [b"", SEQ, _batch([{"no": "type"}])],
    [b"", b"\x00\x01", _batch([])],  # a sequence of 2 bytes
    [b"", _batch([])],  # two frames
    [b"", SEQ, _batch([]), b"extra"],  # four frames
    [b"\xc1 \x00" * 10_000],  # one frame
]


def test_a_run_of_bad_messages_resyncs_once_and_dispatch_entries_stand(
    gateway: Proc, publisher: Publisher, tmp_path: Path
) -> None:
    """Before: each bad message resynced, dropping the entries every dispatch made since."""
    prompt = " ".join(WORDS[:40])
    connected(gateway, publisher)
    for frames in GARBAGE:
        publisher.socket.send_multipart(frames)
    wait_for(lambda: count(gateway, "dropped") == len(GARBAGE), 10, "every bad message counted")
    assert count(gateway, "resyncs") == 1
    complete(gateway, prompt)  # the dispatch's own entry: scrape-only behaviour
    cached = route(gateway, prompt)["cached_tokens"]
    assert cached > 0
    for frames in GARBAGE:
        publisher.socket.send_multipart(frames)
    wait_for(lambda: count(gateway, "dropped") == 2 * len(GARBAGE), 10, "the second run")
    assert count(gateway, "resyncs") == 1
    assert route(gateway, prompt)["cached_tokens"] == cached  # not wiped again
    received = count(gateway, "batches")
    publisher.send()  # a batch after the junk: the follower is alive and applies it
    wait_for(lambda: count(gateway, "batches") == received + 1, 5, "a good batch after it")
    log = (tmp_path / "gateway.log").read_text()
    assert log.count('"kv_events_malformed"') == 1 and "Traceback" not in log  # once a run


def test_sequence_numbers_out_of_order_or_repeated_resync_once(
    gateway: Proc, publisher: Publisher
) -> None:
    """Before: a publisher whose sequence numbers never follow on (two publishers on one
    endpoint, a replaying one) resynced at every batch; a repeated batch resynced too."""
    prompt = " ".join(WORDS[:40])
    connected(gateway, publisher)
    received = count(gateway, "batches")
    publisher.send(sequence=publisher.sequence - 1)  # the last number again: a copy
    publisher.send(sequence=publisher.sequence - 1)
    wait_for(lambda: count(gateway, "batches") == received + 2, 5, "the copies")
    assert (count(gateway, "resyncs"), count(gateway, "dropped")) == (0, 2)
    complete(gateway, prompt)
    cached = route(gateway, prompt)["cached_tokens"]
    assert cached > 0
    for sequence in range(1000, 0, -50):  # 20 batches, each out of order
        publisher.send(sequence=sequence)
    wait_for(lambda: count(gateway, "batches") == received + 22, 5, "the disordered batches")
    assert (count(gateway, "resyncs"), count(gateway, "dropped")) == (1, 21)
    complete(gateway, prompt)  # entered again after the one resync, and kept
    assert route(gateway, prompt)["cached_tokens"] == cached
    publisher.send(sequence=0)  # a restarted publisher, then in order: one more resync
    publisher.send()
    publisher.send()
    wait_for(lambda: count(gateway, "batches") == received + 25, 5, "in order again")
    assert (count(gateway, "resyncs"), count(gateway, "dropped")) == (2, 22)


def test_a_message_over_the_bound_is_dropped_and_later_events_are_applied(
    gateway: Proc, publisher: Publisher, tokenizer_path: Path, tmp_path: Path
) -> None:
    """Before: a frame of any size was taken whole (a 2 GiB one cost 2 GiB); a bound alone
    would have ended the replica's events for good, as libzmq drops the connection on a
    frame over ZMQ_MAXMSGSIZE and never connects again. And the batch after them, out of
    order for the ones lost, resynced a second time, wiping what dispatches had entered."""
    prompt = " ".join(WORDS[:70])  # BOS + 70 words: two whole engine blocks
    blocks = stored([101, 102], token_ids(tokenizer_path, prompt)[: 2 * ENGINE_BLOCK])
    # a good batch but for its size (an unknown field is skipped)
    oversize = _batch([blocks | {"padding": bytes(MAX_FRAME_BYTES)}])
    connected(gateway, publisher)

    def dropped(total: int) -> bool:
        sequence = publisher.sequence.to_bytes(8, "big")
        publisher.socket.send_multipart([b"", sequence, oversize])  # to each connection
        publisher.sequence += 1
        return count(gateway, "dropped") >= total

    wait_for(lambda: dropped(3), 30, "3 connections dropped, and made again", interval_s=0.2)
    assert count(gateway, "resyncs") == 1  # one run of bad messages
    assert route(gateway, prompt)["cached_tokens"] == 0  # never applied

    def applied() -> bool:
        publisher.send(blocks)
        cached: int = route(gateway, prompt)["cached_tokens"]
        return cached == 2 * ENGINE_BLOCK

    wait_for(applied, 10, "a stored block after them applied", interval_s=0.1)
    assert count(gateway, "resyncs") == 1  # not a second for the gap they left
    log = (tmp_path / "gateway.log").read_text()
    assert log.count('"kv_events_malformed"') == 1 and "Traceback" not in log
    assert f"a frame over {MAX_FRAME_BYTES} bytes" in log


def test_a_restarted_publisher_is_no_dropped_message(
    gateway: Proc, publisher: Publisher, tokenizer_path: Path, tmp_path: Path
) -> None:
    """libzmq connects again by itself after a lost connection: only a connection it gives
    up on (a frame over the bound) is a dropped message, connected again by the follower."""
    prompt = " ".join(WORDS[:70])
    blocks = stored([101, 102], token_ids(tokenizer_path, prompt)[: 2 * ENGINE_BLOCK])
    connected(gateway, publisher)
    publisher.socket.close(linger=0)
    publisher.socket = publisher.context.socket(zmq.PUB)

    def bound() -> bool:  # the old socket's port is freed in ZMQ's own thread
        try:
            publisher.socket.bind(f"tcp://127.0.0.1:{publisher.port}")
        except zmq.ZMQError:
            return False
        return True

    wait_for(bound, 5, "the publisher's port free again")
    publisher.sequence += 1000  # its numbers do not follow on

    def applied() -> bool:
        publisher.send(blocks)
        cached: int = route(gateway, prompt)["cached_tokens"]
        return cached == 2 * ENGINE_BLOCK

    wait_for(applied, 10, "the restarted publisher's blocks applied", interval_s=0.1)
    assert (count(gateway, "dropped"), count(gateway, "resyncs")) == (0, 1)  # the gap
    assert '"kv_events_malformed"' not in (tmp_path / "gateway.log").read_text()
