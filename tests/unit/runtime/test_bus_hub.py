"""The hub of ``serve --workers`` (``runtime.bus_hub``) and its ``unix://`` transport, on
real Unix sockets: every subscriber of a channel gets each message (its sender too), other
channels get none, a client that sends junk is cut off alone, a subscriber that stops
reading loses messages instead of holding the others up, and a hub gone is a
``TransportError``, not a hang."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import pytest

from isocost.runtime import bus_hub
from isocost.runtime.bus_transport import Transport, TransportError, transport_for


def _run(scenario: Coroutine[Any, Any, None]) -> None:
    """Run ``scenario``; one that hangs (a hub that blocks on a slow client) fails."""
    asyncio.run(asyncio.wait_for(scenario, 30))


@contextlib.asynccontextmanager
async def _hub(path: Path) -> AsyncIterator[bus_hub.LocalHub]:
    """A hub serving on ``path`` for the block, closed after it."""
    hub = bus_hub.LocalHub()
    await hub.start(path)
    try:
        yield hub
    finally:
        await hub.close()


async def _subscribed(hub: bus_hub.LocalHub, channel: bytes, count: int) -> None:
    """Until ``count`` clients are subscribed to ``channel`` at ``hub``: a subscription
    is a frame the hub reads after the client sent it."""
    for _ in range(200):
        if len(hub._subscribers.get(channel, ())) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{count} subscribers to {channel!r} never reached the hub")


@contextlib.asynccontextmanager
async def _clients(
    path: Path, count: int, timeout_s: float = 2.0
) -> AsyncIterator[list[Transport]]:
    """``count`` ``unix://`` transports to the hub at ``path``, closed after the block."""
    transports = [transport_for(f"unix://{path}", timeout_s) for _ in range(count)]
    try:
        yield transports
    finally:
        for transport in transports:
            await transport.close()


def test_each_subscriber_of_a_channel_gets_every_message_the_sender_too(tmp_path: Path) -> None:
    async def scenario() -> None:
        path = tmp_path / "bus.sock"
        async with _hub(path) as hub, _clients(path, 3) as (a, b, other):
            a_in, b_in = await a.subscribe("state"), await b.subscribe("state")
            other_in = await other.subscribe("elsewhere")
            await _subscribed(hub, b"state", 2)
            await _subscribed(hub, b"elsewhere", 1)
            await a.publish("state", b"from a")
            assert await a_in.next(2.0) == b"from a"
            assert await b_in.next(2.0) == b"from a"
            assert await other_in.next(0.2) is None

    _run(scenario())


def test_junk_cuts_its_sender_off_alone(tmp_path: Path) -> None:
    async def scenario() -> None:
        path = tmp_path / "bus.sock"
        async with _hub(path) as hub, _clients(path, 1) as (good,):
            inbox = await good.subscribe("state")
            await _subscribed(hub, b"state", 1)
            for junk in (
                bus_hub.FRAME.pack(9, 0, 0),  # no such kind
                bus_hub.FRAME.pack(bus_hub.PUBLISH, 5, bus_hub.MAX_PAYLOAD_BYTES + 1),
            ):
                reader, writer = await asyncio.open_unix_connection(path)
                writer.write(junk)
                await writer.drain()
                assert await asyncio.wait_for(reader.read(), 2.0) == b""  # cut off
                writer.close()
            await good.publish("state", b"still here")
            assert await inbox.next(2.0) == b"still here"

    _run(scenario())


def test_a_subscriber_that_stops_reading_loses_messages_not_the_others(tmp_path: Path) -> None:
    async def scenario() -> None:
        path = tmp_path / "bus.sock"
        async with _hub(path) as hub, _clients(path, 1) as (reader,):
            inbox = await reader.subscribe("state")
            _, stuck = await asyncio.open_unix_connection(path)  # subscribes, never reads
            stuck.write(bus_hub.frame(bus_hub.SUBSCRIBE, b"state", b""))
            await stuck.drain()
            await _subscribed(hub, b"state", 2)
            payload = b"x" * (1 << 20)
            count = (bus_hub.MAX_BUFFERED_BYTES >> 20) * 4  # far past what it may hold
            for _ in range(count):
                await reader.publish("state", payload)
                assert await inbox.next(2.0) == payload  # the reader keeps up, unblocked
            # what the hub holds for the stuck one stays bounded: the rest was dropped
            held = [w.transport.get_write_buffer_size() for w in hub._subscribers[b"state"]]
            bound = bus_hub.MAX_BUFFERED_BYTES + len(payload) + 64
            assert len(held) == 2 and max(held) <= bound
            stuck.close()

    _run(scenario())


def test_a_hub_gone_is_a_transport_error(tmp_path: Path) -> None:
    async def scenario() -> None:
        path = tmp_path / "bus.sock"
        absent = transport_for(f"unix://{path}", 0.5)
        with pytest.raises(TransportError):
            await absent.subscribe("state")
        with pytest.raises(TransportError):
            await absent.publish("state", b"x")
        async with _clients(path, 1, 0.5) as (client,):
            async with _hub(path) as hub:
                inbox = await client.subscribe("state")
                await _subscribed(hub, b"state", 1)
            with pytest.raises(TransportError):
                await inbox.next(2.0)

    _run(scenario())
