"""vLLM's KV-cache events from ``isocost engine`` (``--kv-events-port``).

vLLM with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``
publishes its prefix cache's changes on a ZMQ PUB socket; a replica of ``isocost engine``
publishes the same messages, so a gateway follows either the same way
(``kv_events: tcp://HOST:PORT``): a multipart ``(topic, sequence number as 8 bytes
big-endian, msgpack batch [ts, events, data_parallel_rank])`` per advance of the model
that changed the cache, events ``BlockStored`` (the new full blocks' hashes, the hash of
the block before them, their token ids, the block size) and ``BlockRemoved`` (evicted
hashes), in the order they happened. The wire types are the ones the gateway decodes
(``isocost.prefix.kvevents``), so one definition serves both ends. A subscriber too slow
for the send buffer loses batches (PUB drops them); the sequence gap tells it to resync.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec
import zmq

from isocost.engine.records import BlocksStored, CacheChange
from isocost.prefix.kvevents import BlockRemoved, BlockStored, EventBatch, KvEvent

__all__ = ["KvEventPublisher"]

_SEND_HWM = 100_000  # batches queued for a slow subscriber before PUB drops them
_MEDIUM = "GPU"  # where vLLM says its own cache's blocks are (offload tiers name others)


class KvEventPublisher:
    """One replica's KV-cache event publisher, bound at ``endpoint``."""

    def __init__(self, endpoint: str, block_size: int) -> None:
        self.endpoint = endpoint
        self.block_size = block_size
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, _SEND_HWM)
        self._socket.bind(endpoint)
        self._encoder = msgspec.msgpack.Encoder()
        self._sequence = 0

    def publish(self, changes: Sequence[CacheChange]) -> None:
        """Send ``changes`` as one batch (none: nothing is sent)."""
        if not changes:
            return
        events: list[KvEvent] = [self._wire(change) for change in changes]
        payload = self._encoder.encode(EventBatch(time.time(), events, None))
        sequence = self._sequence.to_bytes(8, "big")
        self._sequence += 1
        self._socket.send_multipart([b"", sequence, payload], flags=zmq.NOBLOCK)

    def _wire(self, change: CacheChange) -> KvEvent:
        if isinstance(change, BlocksStored):
            return BlockStored(
                list(change.block_hashes),
                change.parent_block_hash,
                list(change.token_ids),
                self.block_size,
                _MEDIUM,
            )
        return BlockRemoved(list(change.block_hashes), _MEDIUM)

    def close(self) -> None:
        self._socket.close(linger=0)
