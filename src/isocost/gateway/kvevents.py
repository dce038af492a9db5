"""A replica's KV-cache event stream (ZMQ), applied to its prefix entries as it comes.

For a replica with ``kv_events: tcp://HOST:PORT`` the monitor runs this next to its
probes and scrapes: a ZMQ SUB socket on the engine's publisher (vLLM's
``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:PORT"}'``), each batch decoded and applied by a ``KvEventTracker``
(``isocost.prefix.kvevents``). ZMQ reconnects on its own when the engine restarts; its
sequence numbers then restart, which the tracker sees as a gap and resyncs. Nothing an
engine sends can fail a request: a message that is no batch is logged (once until a good
one comes), counted as a resync, and the replica's entries rebuilt from later events;
without events the index works as before, from dispatches alone.

A resync drops the dispatches' entries too, so a stream that stays bad must not resync at
every message, or the replica's entries would be worse than without events: only the
first of a run of bad messages resyncs, and so does only the first of a run of gaps (a
publisher whose every sequence number is out of order); a repeated sequence number is a
copy, dropped. Each message not applied is counted in ``isocost_kv_event_dropped``.
"""

from __future__ import annotations

import logging

import zmq
import zmq.asyncio

from isocost.gateway.metrics import GatewayMetrics
from isocost.gateway.routing import Router
from isocost.gateway.upstreams import Upstream
from isocost.prefix.kvevents import EventBatch, KvEventError, decode_batch, decode_sequence

__all__ = ["follow_kv_events"]

log = logging.getLogger("isocost.gateway")

_RECEIVE_HWM = 100_000  # batches buffered before ZMQ drops (and the tracker sees a gap)


def _decode(frames: list[bytes]) -> tuple[int, EventBatch]:
    if len(frames) != 3:
        raise KvEventError(f"a message of {len(frames)} frames, expected 3")
    return decode_sequence(frames[1]), decode_batch(frames[2])


async def follow_kv_events(
    upstream: Upstream, endpoint: str, router: Router, metrics: GatewayMetrics
) -> None:
    """Apply ``upstream``'s KV events from ``endpoint`` until cancelled."""
    batches = metrics.kv_event_batches.labels(upstream.pool, upstream.name)
    resyncs = metrics.kv_event_resyncs.labels(upstream.pool, upstream.name)
    dropped = metrics.kv_event_dropped.labels(upstream.pool, upstream.name)
    socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, _RECEIVE_HWM)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    tracker = router.follow_kv_events(upstream)
    failing: str | None = None  # the bad message last logged, until a batch comes
    previous: int | None = None  # the sequence number of the last batch received
    gapped = False  # that batch came after a gap
    extra = {"replica": upstream.name, "endpoint": endpoint}
    try:
        socket.connect(endpoint)
        log.info("following KV events", extra={"event": "kv_events_following", **extra})
        while True:
            frames = await socket.recv_multipart()
            try:
                sequence, batch = _decode(frames)
            except KvEventError as exc:
                dropped.inc()
                if failing is None:
                    tracker.resync()
                    resyncs.inc()
                    log.warning(
                        "bad KV event message",
                        extra={"event": "kv_events_malformed", "error": str(exc), **extra},
                    )
                failing = str(exc)
                continue
            failing = None
            batches.inc()
            copy = sequence == previous
            gap = previous is not None and sequence != previous + 1 and not copy
            if copy or (gap and gapped):
                dropped.inc()  # a copy, or no order yet: the last resync stands
            elif not tracker.apply(sequence, batch):
                resyncs.inc()
                log.info(
                    "KV event gap: prefix entries rebuilt",
                    extra={"event": "kv_events_resync", "sequence": sequence, **extra},
                )
            previous, gapped = sequence, gap
    finally:
        socket.close(linger=0)
        router.unfollow_kv_events(upstream, tracker)
