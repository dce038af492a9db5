"""A state bus for one host without a server: the hub ``serve --workers`` runs.

N workers of one gateway are peers on the state bus like gateways on several hosts. With
no Redis or NATS configured, the supervisor runs this hub on a Unix socket in its private
directory and hands each worker its path (``unix://PATH``: ``runtime.bus_transport``), so
the workers price each other's in-flight and hold every API key's budgets and
``max_in_flight`` together all the same. It is pub/sub as the bus needs it: every message
published on a channel goes to every connection subscribed to it (the sender's own too:
the bus counts its own heartbeat as a sign the bus is up), nothing is stored, and a
subscriber too slow to take ``MAX_BUFFERED_BYTES`` more loses messages, which it sees as a
sequence gap, as it would on Redis.

A frame is ``FRAME`` (kind, channel length, payload length; little-endian), the channel,
the payload. Clients send ``SUBSCRIBE`` (no payload) and ``PUBLISH``; the hub sends
``MESSAGE``. A frame past ``MAX_PAYLOAD_BYTES`` or of an unknown kind ends its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections import defaultdict
from pathlib import Path

__all__ = [
    "FRAME",
    "MAX_BUFFERED_BYTES",
    "MAX_PAYLOAD_BYTES",
    "MESSAGE",
    "PUBLISH",
    "SUBSCRIBE",
    "LocalHub",
    "frame",
]

FRAME = struct.Struct("<BHI")
SUBSCRIBE, PUBLISH, MESSAGE = 1, 2, 3
MAX_PAYLOAD_BYTES = 16 << 20  # a bus message is kilobytes; this bounds a broken one
MAX_BUFFERED_BYTES = 8 << 20  # a subscriber behind by this much loses messages


def frame(kind: int, channel: bytes, payload: bytes) -> bytes:
    return FRAME.pack(kind, len(channel), len(payload)) + channel + payload


class LocalHub:
    """The hub (module docstring): ``start`` it on a path, ``close`` it at the end."""

    def __init__(self) -> None:
        self._subscribers: defaultdict[bytes, set[asyncio.StreamWriter]] = defaultdict(set)
        self._clients: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def start(self, path: Path) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in self._clients:  # left open by the server's close; what a client
                writer.transport.abort()  # has not read yet would hold a close for good
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channels: set[bytes] = set()
        self._clients.add(writer)
        try:
            while True:
                kind, channel_size, size = FRAME.unpack(await reader.readexactly(FRAME.size))
                if size > MAX_PAYLOAD_BYTES or kind not in (SUBSCRIBE, PUBLISH):
                    return
                channel = await reader.readexactly(channel_size)
                payload = await reader.readexactly(size)
                if kind == SUBSCRIBE:
                    self._subscribers[channel].add(writer)
                    channels.add(channel)
                else:
                    self._fan_out(channel, frame(MESSAGE, channel, payload))
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            self._clients.discard(writer)
            for channel in channels:
                self._subscribers[channel].discard(writer)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _fan_out(self, channel: bytes, message: bytes) -> None:
        for subscriber in self._subscribers.get(channel, ()):
            if subscriber.is_closing():
                continue
            if subscriber.transport.get_write_buffer_size() <= MAX_BUFFERED_BYTES:
                subscriber.write(message)
