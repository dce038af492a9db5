"""Forwarding: one client request -> attempts on replicas -> bytes relayed back.

The original request bytes go upstream unchanged. Every upstream answer is judged before
anything reaches the client: connection refused or reset, a 5xx (an engine's 503 "full"
included), a 429, a 401/403/404 (a replica that cannot serve this pool's model: never the
client's fault, the gateway checked the model and key), a whole answer that is not a JSON
object, a stream whose first event is not OpenAI SSE. Such an attempt is recorded against
the replica's breaker (a 503 "full" not at all, a 429 in its success rate only) and retried
on another replica, at most ``max_retries`` times, after a backoff of
``retry_backoff_ms * 2**attempt``, while the total timeout lasts (after it: 504). Other
4xx are the client's own and relayed as they are.

Whole answers are read up to ``max_response_bytes`` (beyond: 502, the upstream connection
closed). Streams are relayed line by line as they arrive (aiohttp sets TCP_NODELAY on both
sides), each checked: every ``data:`` payload a JSON object, the stream closed by
``[DONE]``. The client's response starts with the first event, so "before the first byte"
is exact. Once streaming has begun, an upstream failure (a reset, a timeout, a line that is
not SSE, an end without ``[DONE]``) is recorded against the replica and ends the client's
stream with an OpenAI-style error event and ``[DONE]``. Each data event counts as one
streamed token for the shadow state (the usage event, when the client asked for one, gives
the exact count), and the times between chunks are the observed inter-token latencies.

A client that leaves (its connection lost) or stops reading (a write blocked for
``idle_timeout_ms``) ends the attempt: the upstream connection is closed, so the engine
aborts the request, and the result is 499.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass

import aiohttp
import msgspec
from aiohttp import web

from isocost.gateway.loops import HOPS_HEADER, hops
from isocost.gateway.routing import GatewayRequest, Grant, Router
from isocost.gateway.upstreams import Upstream
from isocost.openai import sse
from isocost.openai.errors import ApiError
from isocost.openai.usage import answer_usage

__all__ = ["ClientGone", "ForwardResult", "ForwardSettings", "Forwarder"]

log = logging.getLogger("isocost.gateway")

_HOP_HEADERS = ("Accept", "X-Request-Id")
_NOT_SERVED_HERE = frozenset({401, 403, 404})  # the replica, not the client, is wrong
_OVERLOADED = 429
_FULL = 503
_LOOP_DETECTED = 508  # from a gateway down the line
CLIENT_GONE_STATUS = 499


class _AttemptFailed(Exception):
    """An attempt that may be retried elsewhere: nothing reached the client yet."""

    def __init__(
        self,
        reason: str,
        *,
        hard: bool = False,
        status: int = 502,
        busy: bool = False,
        soft: bool = False,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.hard = hard  # the process is gone: open the breaker at once
        self.status = status
        self.busy = busy  # a healthy but full engine (503): retry, do not count against it
        self.soft = soft  # an overloaded engine (429): counts in its success rate only


class ClientGone(Exception):
    """The client left or stopped reading: its request ends as 499 (``reason`` says how)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _BadStream(Exception):
    """An upstream stream that is not OpenAI server-sent events, or broke off."""


class _TooLarge(Exception):
    """An answer (or one stream line) over ``max_response_bytes``: the request's doing, not
    the replica's, so neither retried nor held against it."""


@dataclass(slots=True)
class ForwardResult:
    """How one client request ended, for logs and metrics; filled in as it goes, so a
    request cancelled half way (the client left) still says where it got to."""

    status: int
    replica: Upstream | None = None
    output_tokens: int = 0
    retries: int = 0
    ttft_s: float | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ForwardSettings:
    connect_timeout_s: float
    idle_timeout_s: float
    total_timeout_s: float
    max_retries: int
    retry_backoff_s: float
    max_response_bytes: int


class _StreamReader:
    """Checks an upstream SSE stream as it arrives and hands back whole lines to relay.

    ``feed`` returns the complete lines of what came so far (a partial line waits for the
    rest), after checking each: SSE, and every data payload a JSON object or ``[DONE]``.
    At ``[DONE]`` the stream is over: the rest is dropped and the canonical ``[DONE]``
    event relayed."""

    def __init__(self, max_line_bytes: int) -> None:
        self.max_line_bytes = max_line_bytes
        self.events = 0  # data events, [DONE] not counted
        self.usage_tokens: int | None = None
        self.done = False
        self.at_event_end = True  # what was relayed ends with a blank line
        self._partial = bytearray()

    def feed(self, chunk: bytes) -> bytes:
        cut = chunk.rfind(b"\n") + 1
        if not cut:
            self._partial += chunk
            if len(self._partial) > self.max_line_bytes:
                raise _TooLarge
            return b""
        lines = bytes(self._partial) + chunk[:cut]
        self._partial = bytearray(chunk[cut:])
        start = 0
        while start < len(lines):
            end = lines.index(b"\n", start) + 1
            try:
                payload = sse.line_data(lines[start:end])
            except sse.SseError:
                raise _BadStream("not an SSE line") from None
            if payload == sse.DONE:
                self.done = True
                return lines[:start] + sse.DONE_EVENT
            if payload is not None:
                try:
                    usage = answer_usage(payload)
                except msgspec.DecodeError:
                    raise _BadStream("event is not a JSON object") from None
                self.events += 1
                if usage is not None:
                    self.usage_tokens = usage.completion_tokens
            start = end
        self.at_event_end = lines.endswith((b"\n\n", b"\r\n\r\n"))
        return lines

    def end_reason(self) -> str:
        """Why a stream that stopped here is broken."""
        return "ended mid-event" if self._partial else "ended before [DONE]"


class Forwarder:
    """Sends requests to replicas chosen by the router, with retries and relaying."""

    def __init__(
        self, session: aiohttp.ClientSession, router: Router, settings: ForwardSettings
    ) -> None:
        self.session = session
        self.router = router
        self.settings = settings

    async def forward(
        self, http: web.Request, body: bytes, request: GatewayRequest, result: ForwardResult
    ) -> web.StreamResponse:
        """Answer ``http`` from some replica, recording the outcome in ``result``; ApiError
        when no attempt could succeed, ClientGone when the client left."""
        tried: set[str] = set()
        last: _AttemptFailed | None = None
        deadline = request.arrived_at + self.settings.total_timeout_s
        while True:
            grant = await self._acquire(request, frozenset(tried), deadline)
            tried.add(grant.replica.name)
            result.replica = grant.replica
            try:
                return await self._attempt(http, body, request, grant, result)
            except BaseException as exc:  # the client left (cancelled) or the attempt failed
                if not isinstance(exc, _AttemptFailed):
                    self.router.release(grant, time.monotonic(), ok=False, output_tokens=0)
                    raise
                failed = last = exc
            now = time.monotonic()
            if not failed.busy:
                grant.replica.breaker.record_failure(
                    now, failed.reason, hard=failed.hard, soft=failed.soft
                )
            self.router.release(grant, now, ok=False, output_tokens=0)
            if result.retries >= self.settings.max_retries or now >= deadline:
                break
            result.retries += 1
            self.router.metrics.retries.labels(failed.reason).inc()
            log.info(
                "retry",
                extra={
                    "event": "retry",
                    "request_id": request.request_id,
                    "replica": grant.replica.name,
                    "reason": failed.reason,
                    "attempt": result.retries,
                },
            )
            backoff_s = self.settings.retry_backoff_s * 2 ** (result.retries - 1)
            await asyncio.sleep(min(backoff_s, max(0.0, deadline - time.monotonic())))
            if not self.router.has_candidate(request, frozenset(tried)):
                tried.clear()  # every replica failed once: allow a second try anywhere
        assert last is not None
        if time.monotonic() >= deadline:
            raise _timed_out(last.reason)
        if last.status == 504:
            raise ApiError(504, f"replicas timed out: {last.reason}", code="upstream_timeout")
        if last.busy or last.soft:
            raise ApiError(503, "every replica tried is full", code="overloaded", retry_after_s=1.0)
        raise ApiError(
            502, f"no replica could serve the request: {last.reason}", code="upstream_error"
        )

    async def _acquire(
        self, request: GatewayRequest, exclude: frozenset[str], deadline: float
    ) -> Grant:
        """A replica for the next attempt; 504 when the total timeout passes first."""
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise _timed_out("no time left for an attempt")
        try:
            async with asyncio.timeout(left_s):
                return await self.router.acquire(request, exclude)
        except TimeoutError:
            raise _timed_out("waiting for a replica") from None

    async def _attempt(
        self,
        http: web.Request,
        body: bytes,
        request: GatewayRequest,
        grant: Grant,
        result: ForwardResult,
    ) -> web.StreamResponse:
        replica = grant.replica
        settings = self.settings
        # identity: the body is judged (and relayed) as the replica wrote it
        headers = {
            "Content-Type": "application/json",
            "Accept-Encoding": "identity",
            **replica.upstream_headers,
        }
        headers[HOPS_HEADER] = str(hops(http.headers) + 1)  # a loop ends in 508
        for name in _HOP_HEADERS:
            if name in http.headers:
                headers[name] = http.headers[name]
        remaining_s = max(0.001, request.arrived_at + settings.total_timeout_s - time.monotonic())
        timeout = aiohttp.ClientTimeout(
            total=remaining_s,
            sock_connect=settings.connect_timeout_s,
            sock_read=settings.idle_timeout_s if request.view.stream else remaining_s,
        )
        try:
            upstream = await self.session.post(
                replica.url + http.path, data=body, headers=headers, timeout=timeout
            )
        except aiohttp.ClientConnectorError as exc:
            raise _AttemptFailed(f"connect: {exc.os_error.strerror or exc}", hard=True) from None
        except (aiohttp.ServerDisconnectedError, ConnectionResetError):
            # Soft: a pooled keep-alive connection the replica just closed looks the same;
            # a dead process is caught as "refused" by the next attempt or probe.
            raise _AttemptFailed("disconnected") from None
        except TimeoutError:
            raise _AttemptFailed("timeout", status=504) from None
        except aiohttp.ClientError as exc:
            raise _AttemptFailed(f"upstream: {type(exc).__name__}") from None
        try:
            _judge_status(upstream.status)
            response_headers = {"x-isocost-replica": replica.name}
            if grant.predicted_ttft_s is not None:
                response_headers["x-isocost-predicted-ttft-ms"] = (
                    f"{grant.predicted_ttft_s * 1000:.1f}"
                )
            if upstream.status >= 400 or not request.view.stream:
                response = await self._relay_whole(
                    http, upstream, request, grant, response_headers, result
                )
            else:
                response = await self._relay_stream(
                    http, upstream, request, grant, response_headers, result
                )
        except BaseException:
            upstream.close()  # never pooled half read: the engine sees the abort
            raise
        upstream.release()
        return response

    async def _read_whole(
        self, upstream: aiohttp.ClientResponse, request: GatewayRequest
    ) -> bytearray:
        """The whole body, read no further than ``max_response_bytes`` (beyond: 502)."""
        limit = self.settings.max_response_bytes
        data = bytearray()
        try:
            if (upstream.content_length or 0) <= limit:
                async for chunk in upstream.content.iter_any():
                    data += chunk
                    if len(data) > limit:
                        break
        except TimeoutError:
            raise _AttemptFailed("timeout", status=504) from None
        except aiohttp.ClientError as exc:
            raise _AttemptFailed(f"body: {type(exc).__name__}") from None
        if (upstream.content_length or 0) > limit or len(data) > limit:
            raise self._too_large(request)
        return data

    def _too_large(self, request: GatewayRequest) -> ApiError:
        limit = self.settings.max_response_bytes
        log.warning(
            "response too large",
            extra={
                "event": "response_too_large",
                "request_id": request.request_id,
                "limit_bytes": limit,
            },
        )
        return ApiError(
            502,
            f"the replica's answer is larger than the gateway's limit ({limit} bytes)",
            code="response_too_large",
        )

    async def _relay_whole(
        self,
        http: web.Request,
        upstream: aiohttp.ClientResponse,
        request: GatewayRequest,
        grant: Grant,
        headers: dict[str, str],
        result: ForwardResult,
    ) -> web.StreamResponse:
        data = await self._read_whole(upstream, request)
        ok = upstream.status < 400
        if ok:
            try:
                usage = answer_usage(data)
            except msgspec.DecodeError:
                kind = upstream.content_type or "no content type"
                raise _AttemptFailed(f"answer is not a JSON object ({kind})") from None
            result.output_tokens = usage.completion_tokens if usage else 0
        now = time.monotonic()
        if ok:
            grant.replica.breaker.record_success(now)
        self.router.release(grant, now, ok=ok, output_tokens=result.output_tokens)
        result.status = upstream.status
        response = web.StreamResponse(status=upstream.status, headers=headers)
        response.content_type = upstream.content_type or "application/json"
        response.content_length = len(data)
        await self._send(http, response.prepare(http))
        await self._send(http, response.write(data))
        await self._send(http, response.write_eof())
        return response

    async def _relay_stream(
        self,
        http: web.Request,
        upstream: aiohttp.ClientResponse,
        request: GatewayRequest,
        grant: Grant,
        headers: dict[str, str],
        result: ForwardResult,
    ) -> web.StreamResponse:
        replica = grant.replica
        reader = _StreamReader(self.settings.max_response_bytes)
        block = b""
        try:  # up to the first event: a failure here is retried elsewhere
            while not (reader.events or reader.done):
                chunk = await upstream.content.readany()
                if not chunk:
                    raise _AttemptFailed(f"stream {reader.end_reason()}")
                block += reader.feed(chunk)
        except TimeoutError:
            raise _AttemptFailed("timeout", status=504) from None
        except aiohttp.ClientError as exc:
            raise _AttemptFailed(f"stream: {type(exc).__name__}") from None
        except _BadStream as exc:
            raise _AttemptFailed(f"stream: {exc}") from None
        except _TooLarge:
            raise self._too_large(request) from None
        now = time.monotonic()
        result.ttft_s = ttft_s = now - request.arrived_at
        replica.recent_ttft_s.append(ttft_s)
        metrics = self.router.metrics
        metrics.ttft.labels(replica.name).observe(ttft_s)
        itl = metrics.itl.labels(replica.name)

        response = web.StreamResponse(status=upstream.status, headers=headers)
        response.content_type = upstream.content_type or "text/event-stream"
        response.headers["Cache-Control"] = "no-cache"
        broken: str | None = None
        delivered = False  # the whole stream reached the client (False: it left)
        last_at = now
        counted = 0
        try:
            await self._send(http, response.prepare(http))
            while True:
                if reader.events > counted:
                    self.router.on_tokens(grant, reader.events - counted, last_at)
                    counted = reader.events
                await self._send(http, response.write(block))
                if reader.done:
                    break
                try:
                    chunk = await upstream.content.readany()
                    if not chunk:
                        raise _BadStream(reader.end_reason())
                    block = reader.feed(chunk)
                except (TimeoutError, aiohttp.ClientError, _BadStream) as exc:
                    broken = _broken_reason(exc)
                    replica.breaker.record_failure(time.monotonic(), f"mid-stream {broken}")
                    break
                except _TooLarge:
                    broken = self._too_large(request).message
                    break
                now = time.monotonic()
                itl.observe(now - last_at)
                replica.recent_itl_s.append(now - last_at)
                last_at = now
            if broken is None:
                replica.breaker.record_success(time.monotonic())
            else:
                await self._end_broken_stream(http, response, request, replica, reader, broken)
            await self._send(http, response.write_eof())
            delivered = broken is None
        finally:
            tokens = reader.events if reader.usage_tokens is None else reader.usage_tokens
            result.output_tokens = tokens
            self.router.release(grant, time.monotonic(), ok=delivered, output_tokens=tokens)
        result.status = upstream.status if broken is None else 502
        result.error = broken
        return response

    async def _send(self, http: web.Request, write: Awaitable[object]) -> None:
        """One write to the client, which must drain within ``idle_timeout_s``: a client
        that stops reading would otherwise hold the upstream (and its engine slot)."""
        try:
            async with asyncio.timeout(self.settings.idle_timeout_s):
                await write
        except (TimeoutError, ConnectionResetError) as exc:
            if http.transport is not None:
                http.transport.abort()  # drop what is buffered: the answer cannot complete
            stalled = isinstance(exc, TimeoutError)
            raise ClientGone(
                "client stopped reading" if stalled else "client disconnected"
            ) from None

    async def _end_broken_stream(
        self,
        http: web.Request,
        response: web.StreamResponse,
        request: GatewayRequest,
        replica: Upstream,
        reader: _StreamReader,
        reason: str,
    ) -> None:
        log.warning(
            "stream broken",
            extra={
                "event": "stream_error",
                "request_id": request.request_id,
                "replica": replica.name,
                "reason": reason,
            },
        )
        error = ApiError(
            502, f"replica {replica.name} failed mid-stream: {reason}", code="stream_broken"
        )
        separator = b"" if reader.at_event_end else b"\n"  # end a half-relayed event first
        await self._send(http, response.write(separator + sse.error_events(error)))


def _judge_status(status: int) -> None:
    """_AttemptFailed for an upstream status that is the replica's failure, not the client's."""
    if status == _LOOP_DETECTED:
        return  # a gateway down the line found a loop: relay it, retrying would loop again
    if status >= 500:
        raise _AttemptFailed(f"status {status}", busy=status == _FULL)
    if status == _OVERLOADED:
        raise _AttemptFailed(f"status {status}", soft=True)
    if status in _NOT_SERVED_HERE:
        raise _AttemptFailed(f"status {status}")


def _broken_reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, _BadStream):
        return str(exc)
    return type(exc).__name__


def _timed_out(reason: str) -> ApiError:
    return ApiError(504, f"the request's total timeout passed: {reason}", code="upstream_timeout")
