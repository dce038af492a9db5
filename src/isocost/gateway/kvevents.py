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

No frame may exceed ``MAX_FRAME_BYTES`` (ZMQ_MAXMSGSIZE): libzmq rejects a bigger one
from its size header, before allocating it, so a publisher that sends a 2 GiB frame costs
nothing. But libzmq then drops the connection as a protocol error and, unlike after a
lost connection, never connects again (libzmq 4.3.5: no ``EVENT_CONNECT_RETRIED``
follows its ``EVENT_DISCONNECTED``); the follower watches the socket's monitor for that,
connects again, and counts the lost message as a bad one. A vLLM batch is about 8 bytes
per token stored (token id, block hash) plus evicted: the bound takes ~4 M tokens in one
engine step, 4x a 1 M-token prompt prefilled whole, ~500x a step of 8192 tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from isocost.gateway.metrics import GatewayMetrics
from isocost.gateway.routing import Router
from isocost.gateway.upstreams import Upstream
from isocost.prefix.kvevents import EventBatch, KvEventError, decode_batch, decode_sequence

__all__ = ["MAX_FRAME_BYTES", "follow_kv_events"]

log = logging.getLogger("isocost.gateway")

MAX_FRAME_BYTES = 32 << 20  # one frame of a KV-event message (see the module's doc)
_RECEIVE_HWM = 100_000  # batches buffered before ZMQ drops (and the tracker sees a gap)
# libzmq reports a retry microseconds after the disconnect it follows; this much silence
# means it gave up (and paces reconnecting to a publisher that always sends too much)
_RETRY_GRACE_S = 0.5


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
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
    tracker = router.follow_kv_events(upstream)
    failing: str | None = None  # the bad message last logged, until a batch comes
    previous: int | None = None  # the sequence number of the last batch received
    gapped = False  # that batch came after a gap
    extra = {"replica": upstream.name, "endpoint": endpoint}

    def reject(error: str) -> None:
        """Count a message not applied; the first of a run resyncs and is logged."""
        nonlocal failing
        dropped.inc()
        if failing is None:
            tracker.resync()
            resyncs.inc()
            log.warning(
                "bad KV event message",
                extra={"event": "kv_events_malformed", "error": error, **extra},
            )
        failing = error

    try:
        socket.connect(endpoint)
        log.info("following KV events", extra={"event": "kv_events_following", **extra})
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(_reconnect_when_dropped(socket, monitor, endpoint, reject))
            while True:
                frames = await socket.recv_multipart()
                try:
                    sequence, batch = _decode(frames)
                except KvEventError as exc:
                    reject(str(exc))
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
        monitor.close(linger=0)
        router.unfollow_kv_events(upstream, tracker)


async def _reconnect_when_dropped(
    socket: zmq.asyncio.Socket,
    monitor: zmq.asyncio.Socket,
    endpoint: str,
    reject: Callable[[str], None],
) -> None:
    """Connect ``socket`` again each time libzmq drops its connection for good (a frame
    over the bound, a protocol error): libzmq would leave the replica without events."""
    while True:
        if await _event(monitor) != zmq.EVENT_DISCONNECTED:
            continue
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_RETRY_GRACE_S):
                if await _event(monitor) == zmq.EVENT_CONNECT_RETRIED:
                    continue  # a lost connection: libzmq connects again itself
        reject(
            f"ZMQ dropped the connection: a frame over {MAX_FRAME_BYTES} bytes or a protocol error"
        )
        socket.disconnect(endpoint)
        socket.connect(endpoint)


async def _event(monitor: zmq.asyncio.Socket) -> int:
    return parse_monitor_message(await monitor.recv_multipart())["event"]
