"""A small etcd v3 client speaking etcd's JSON gateway (``POST /v3/...``) over aiohttp.

Only what the registry needs: range over a prefix (with the store's revision), put and
delete, leases (grant, keep-alive, revoke), a watch from a revision, and a status probe.
Keys and values travel base64-encoded and 64-bit integers as JSON strings, as the gateway
writes them; a key read back that is not UTF-8 keeps its bytes as surrogate escapes (PEP
383), so that one stray key is the reader's to refuse, not an error of the whole read.
Several endpoints may be given: a call that cannot reach one tries the next. Two failures
differ: ``EtcdError``, etcd did not answer or failed (no endpoint reached, a 5xx, a broken
stream), which a retry may get past; ``EtcdRefused``, etcd refused the request itself (a
4xx: a malformed or out-of-range field, a lease it does not have, a permission), which the
same request will meet again.

Why not a gRPC client: etcd serves this JSON mapping of the same v3 API on its client port
(since 3.4 under ``/v3/``), so the gateway's one HTTP stack (aiohttp) reaches it with no
gRPC runtime or generated protobuf code in the dependency tree, and every wire detail that
discovery depends on (the list's revision, the watch's start revision, compaction) is in
plain sight here.
"""

from __future__ import annotations

import base64
import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from isocost.core.jsontext import parse_json

__all__ = [
    "Compacted",
    "EtcdClient",
    "EtcdError",
    "EtcdRefused",
    "KeyValue",
    "LeaseNotFound",
    "WatchEvent",
    "prefix_end",
]

# The 4xx that say "not now" rather than "never": a timed-out or rate-limited request.
_TRANSIENT_4XX = frozenset({408, 429})


class EtcdError(Exception):
    """etcd could not be reached or failed to answer (no endpoint, a 5xx, a broken stream)."""


class EtcdRefused(Exception):
    """etcd refused the request itself (HTTP 4xx): the same request will be refused again."""


class LeaseNotFound(EtcdRefused):
    """The lease named is not (or no longer) in etcd: it expired or was revoked."""


class Compacted(EtcdError):
    """The watch's start revision was compacted away: list again, then watch from there."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted (oldest kept: {compact_revision})")
        self.compact_revision = compact_revision


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str  # a key that is not UTF-8 keeps its bytes as surrogate escapes
    value: bytes
    mod_revision: int
    create_revision: int  # when the key was (last) created: registration order


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change under the watched prefix: a put (``value`` set) or a delete (None)."""

    key: str  # as ``KeyValue.key``
    value: bytes | None
    revision: int


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _key(text: str) -> str:
    """A key as etcd sent it (base64), decoded without failing on bytes that are not UTF-8."""
    return _unb64(text).decode("utf-8", "surrogateescape")


class EtcdClient:
    """Calls to one etcd cluster through any of ``endpoints`` (``http(s)://host:port``),
    over TLS with ``tls`` (``runtime.tls.client_ssl``) for https ones."""

    def __init__(
        self, endpoints: list[str], *, timeout_s: float = 2.0, tls: ssl.SSLContext | bool = True
    ) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint given")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout_s = timeout_s
        self.tls = tls
        self._current = 0
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.tls))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _rotate(self) -> None:
        self._current = (self._current + 1) % len(self.endpoints)

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One unary call; EtcdRefused when etcd refuses it, EtcdError when no endpoint
        answers or etcd fails."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        last: Exception | None = None
        for _ in self.endpoints:
            url = self.endpoints[self._current] + path
            try:
                async with self.session.post(url, json=body, timeout=timeout) as resp:
                    payload = parse_json(await resp.read())
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                last = exc
                self._rotate()
                continue
            if resp.status != 200 or not isinstance(payload, dict):
                message = payload.get("message") if isinstance(payload, dict) else payload
                error = f"{path}: HTTP {resp.status}: {message}"
                if resp.status == 404 and "lease not found" in str(message):
                    raise LeaseNotFound(error)
                if 400 <= resp.status < 500 and resp.status not in _TRANSIENT_4XX:
                    raise EtcdRefused(error)
                raise EtcdError(error)
            return payload
        reason = str(last) or type(last).__name__  # a timeout's text is empty
        raise EtcdError(f"no etcd endpoint answered {path}: {reason}")

    async def range_prefix(self, prefix: str) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` and the store revision they were read at."""
        raw = prefix.encode()
        reply = await self.call(
            "/v3/kv/range", {"key": _b64(raw), "range_end": _b64(prefix_end(raw))}
        )
        kvs = [
            KeyValue(
                _key(kv["key"]),
                _unb64(kv.get("value")),
                int(kv["mod_revision"]),
                int(kv["create_revision"]),
            )
            for kv in reply.get("kvs", [])
        ]
        return int(reply["header"]["revision"]), kvs

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Write ``key``; its revision. With ``lease``, the key goes when the lease does."""
        body: dict[str, Any] = {"key": _b64(key.encode()), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        reply = await self.call("/v3/kv/put", body)
        return int(reply["header"]["revision"])

    async def delete(self, key: str) -> None:
        await self.call("/v3/kv/deleterange", {"key": _b64(key.encode())})

    async def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its id."""
        reply = await self.call("/v3/lease/grant", {"TTL": str(ttl_s)})
        if reply.get("error"):
            raise EtcdRefused(f"lease grant refused: {reply['error']}")
        return int(reply["ID"])

    async def keepalive(self, lease: int) -> int:
        """Renew ``lease``; its TTL now, 0 when etcd no longer has it."""
        reply = await self.call("/v3/lease/keepalive", {"ID": str(lease)})
        result = reply.get("result", reply)
        return int(result.get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        """End ``lease`` now, deleting its keys (an unknown lease is no error)."""
        with contextlib.suppress(LeaseNotFound):
            await self.call("/v3/lease/revoke", {"ID": str(lease)})

    async def status(self) -> int:
        """The revision of the endpoint now asked: a cheap liveness probe."""
        reply = await self.call("/v3/maintenance/status", {})
        return int(reply["header"]["revision"])

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[list[WatchEvent]]:
        """Changes under ``prefix`` from ``start_revision`` on, one list per etcd message
        (a transaction's events come together). Compacted when that revision is gone;
        aiohttp's errors when the stream breaks (the caller lists again)."""
        raw = prefix.encode()
        create = {
            "create_request": {
                "key": _b64(raw),
                "range_end": _b64(prefix_end(raw)),
                "start_revision": str(start_revision),
            }
        }
        url = self.endpoints[self._current] + "/v3/watch"
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout_s)
        try:
            async with self.session.post(url, json=create, timeout=timeout) as resp:
                if resp.status != 200:
                    raise EtcdError(f"/v3/watch: HTTP {resp.status}")
                pending = b""
                async for chunk in resp.content.iter_any():
                    *lines, pending = (pending + chunk).split(b"\n")
                    for line in lines:
                        if line.strip():
                            events = _watch_events(parse_json(line))
                            if events:
                                yield events
                raise EtcdError("etcd ended the watch stream")
        except (aiohttp.ClientError, TimeoutError):
            self._rotate()  # the next attempt tries another endpoint
            raise


def _watch_events(message: object) -> list[WatchEvent]:
    """The events of one watch message; raises for a compaction, a cancel or an error."""
    if not isinstance(message, dict):
        raise EtcdError(f"a watch message that is no object: {str(message)[:100]}")
    if "error" in message:
        raise EtcdError(f"watch failed: {message['error'].get('message', message['error'])}")
    result = message.get("result", {})
    compacted = int(result.get("compact_revision", 0))
    if compacted:
        raise Compacted(compacted)
    if result.get("canceled"):
        raise EtcdError(f"watch canceled: {result.get('cancel_reason', 'no reason given')}")
    events = []
    for event in result.get("events", []):
        kv = event["kv"]
        deleted = event.get("type") == "DELETE"
        events.append(
            WatchEvent(
                _key(kv["key"]),
                None if deleted else _unb64(kv.get("value")),
                int(kv["mod_revision"]),
            )
        )
    return events
