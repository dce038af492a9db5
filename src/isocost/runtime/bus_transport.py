"""The state bus's transports, picked by the URL's scheme: Redis pub/sub (``redis://``,
``rediss://``), NATS core subjects (``nats://``, ``tls://``; the same server Dynamo
deployments run), or the hub of ``serve --workers`` on this host (``unix://PATH``:
``runtime.bus_hub``). All are fire and forget with no storage, which is what the soft
state of ``runtime.bus`` needs: a message lost is a sequence gap its receivers handle.

Neither client retries or reconnects on its own: the bus's loops own the retries (one
backoff, one ``bus_down`` line), so each failure, whatever the client called it, is one
``TransportError`` here.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol
from urllib.parse import urlsplit

import nats
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription as NatsSub
from redis import asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from isocost.runtime import bus_hub
from isocost.runtime.config import NATS_SCHEMES

__all__ = ["LOCAL_SCHEME", "Subscription", "Transport", "TransportError", "transport_for"]

LOCAL_SCHEME = "unix"  # unix://PATH: the hub of ``serve --workers`` (``runtime.bus_hub``)


class TransportError(Exception):
    """The bus server could not be reached, or dropped the connection."""


class Subscription(Protocol):
    async def next(self, timeout_s: float) -> bytes | None:
        """The next message, or None when none came within ``timeout_s``."""
        ...

    async def close(self) -> None: ...


class Transport(Protocol):
    async def subscribe(self, channel: str) -> Subscription:
        """A fresh subscription (connecting again first where the last connection died)."""
        ...

    async def publish(self, channel: str, payload: bytes) -> None: ...

    async def close(self) -> None: ...


def transport_for(url: str, timeout_s: float) -> Transport:
    """The transport for ``url`` (its scheme checked by ``check_state_bus``, or the
    supervisor's hub); each call to the server gives up after ``timeout_s``."""
    parts = urlsplit(url)
    if parts.scheme == LOCAL_SCHEME:
        return _Local(parts.path, timeout_s)
    if parts.scheme in NATS_SCHEMES:
        return _Nats(url, timeout_s)
    return _Redis(url, timeout_s)


class _Redis:
    def __init__(self, url: str, timeout_s: float) -> None:
        self._client = aioredis.Redis.from_url(
            url,
            retry=Retry(NoBackoff(), 0),
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
        )

    async def subscribe(self, channel: str) -> Subscription:
        subscription = _RedisSubscription(self._client.pubsub())
        try:
            await subscription.pubsub.subscribe(channel)
        except BaseException as exc:  # a cancellation too: the connection is not left open
            await subscription.close()
            if isinstance(exc, (RedisError, OSError)):
                raise TransportError(f"{type(exc).__name__}: {exc}") from None
            raise
        return subscription

    async def publish(self, channel: str, payload: bytes) -> None:
        try:
            await self._client.publish(channel, payload)
        except (RedisError, OSError) as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from None

    async def close(self) -> None:
        await self._client.aclose()


class _RedisSubscription:
    def __init__(self, pubsub: aioredis.client.PubSub) -> None:
        self.pubsub = pubsub

    async def next(self, timeout_s: float) -> bytes | None:
        try:
            message = await self.pubsub.get_message(
                ignore_subscribe_messages=True, timeout=timeout_s
            )
        except (RedisError, OSError) as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from None
        if message is None or message["type"] != "message":
            return None
        data: bytes = message["data"]
        return data

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            # untyped before redis 8.2, typed since: either passes mypy
            await self.pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]


class _Nats:
    """One NATS connection, made by ``subscribe`` (again once it died); ``publish``
    uses it while it lives and fails while there is none."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url, self.timeout_s = url, timeout_s
        self._client: NatsClient | None = None
        self.last_error: str | None = None

    async def _on_error(self, error: Exception) -> None:
        # nats-py's default logs each with a traceback; the bus logs the state once
        self.last_error = f"{type(error).__name__}: {error}"

    async def subscribe(self, channel: str) -> Subscription:
        await self.close()
        try:
            client = await nats.connect(
                self.url,
                connect_timeout=max(1, round(self.timeout_s)),
                allow_reconnect=False,
                max_reconnect_attempts=0,
                error_cb=self._on_error,
                name="isocost state bus",
            )
        except (nats.errors.Error, OSError) as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from None
        self._client = client
        try:
            subscription = await client.subscribe(channel)
            await asyncio.wait_for(client.flush(), self.timeout_s)  # the server has it
        except (nats.errors.Error, OSError) as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from None
        return _NatsSubscription(client, subscription, self)

    async def publish(self, channel: str, payload: bytes) -> None:
        client = self._client
        if client is None or not client.is_connected:
            raise TransportError("not connected")
        try:
            await client.publish(channel, payload)
        except (nats.errors.Error, OSError) as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from None

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None and not client.is_closed:
            with contextlib.suppress(nats.errors.Error, OSError):
                await client.close()


class _NatsSubscription:
    def __init__(self, client: NatsClient, subscription: NatsSub, transport: _Nats) -> None:
        self._client, self._subscription, self._transport = client, subscription, transport

    async def next(self, timeout_s: float) -> bytes | None:
        if not self._client.is_connected:
            raise TransportError(self._transport.last_error or "the connection closed")
        try:
            message = await self._subscription.next_msg(timeout=timeout_s)
        except nats.errors.TimeoutError:
            return None
        except (nats.errors.Error, OSError) as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from None
        return bytes(message.data)

    async def close(self) -> None:
        with contextlib.suppress(nats.errors.Error, OSError):
            await self._subscription.unsubscribe()


class _Local:
    """One connection to the hub (``runtime.bus_hub``), made by ``subscribe`` (again once
    it died); ``publish`` uses it while it lives and fails while there is none."""

    def __init__(self, path: str, timeout_s: float) -> None:
        self.path, self.timeout_s = path, timeout_s
        self._writer: asyncio.StreamWriter | None = None

    async def subscribe(self, channel: str) -> Subscription:
        await self.close()
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(self.path), self.timeout_s
            )
        except (OSError, TimeoutError) as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from None
        self._writer = writer
        writer.write(bus_hub.frame(bus_hub.SUBSCRIBE, channel.encode(), b""))
        return _LocalSubscription(reader, self.timeout_s)

    async def publish(self, channel: str, payload: bytes) -> None:
        writer = self._writer
        if writer is None or writer.is_closing():
            raise TransportError("not connected")
        writer.write(bus_hub.frame(bus_hub.PUBLISH, channel.encode(), payload))
        try:
            await asyncio.wait_for(writer.drain(), self.timeout_s)
        except (OSError, TimeoutError) as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from None

    async def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


class _LocalSubscription:
    def __init__(self, reader: asyncio.StreamReader, timeout_s: float) -> None:
        self._reader, self.timeout_s = reader, timeout_s

    async def next(self, timeout_s: float) -> bytes | None:
        reader = self._reader
        try:  # a header not come in time leaves the stream as it was; nothing is read
            header = await asyncio.wait_for(reader.readexactly(bus_hub.FRAME.size), timeout_s)
        except TimeoutError:
            return None
        except (asyncio.IncompleteReadError, OSError) as exc:
            raise TransportError(f"the hub closed the connection ({exc})") from None
        _, channel_size, size = bus_hub.FRAME.unpack(header)
        try:  # the rest of a frame the hub wrote whole
            body = await asyncio.wait_for(reader.readexactly(channel_size + size), self.timeout_s)
        except (asyncio.IncompleteReadError, OSError, TimeoutError) as exc:
            raise TransportError(f"a frame cut short ({type(exc).__name__})") from None
        return body[channel_size:]

    async def close(self) -> None:
        """Nothing of its own: the transport's connection closes with the transport."""
