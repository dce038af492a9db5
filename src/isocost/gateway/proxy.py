"""Forwarding: one client request -> attempts on replicas -> bytes relayed back.

The original request bytes go upstream unchanged. An attempt that fails before anything
was sent to the client (connection refused or reset, a 5xx including an engine's 503
"full", a body that breaks before the first chunk) is recorded against the replica's
breaker and retried on another replica, at most ``max_retries`` times, after a backoff of
``retry_backoff_ms * 2**attempt``. The client's response is only started when the first
upstream chunk is in hand, so "before the first byte" is exact. Once streaming has begun,
an upstream failure ends the stream with an OpenAI-style error event and ``[DONE]``.

Streams are relayed chunk by chunk as they arrive (aiohttp sets TCP_NODELAY on both
sides); each SSE ``data:`` event counts as one streamed token for the shadow state (the
final usage event, when the client asked for one, gives the exact count at the end), and
the times between chunks are the observed inter-token latencies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from isocost.gateway.loops import HOPS_HEADER, hops
from isocost.gateway.routing import GatewayRequest, Grant, Router
from isocost.gateway.upstreams import Upstream
from isocost.openai import sse
from isocost.openai.errors import ApiError
from isocost.openai.usage import completion_tokens, stream_completion_tokens

__all__ = ["ForwardResult", "ForwardSettings", "Forwarder"]

log = logging.getLogger("isocost.gateway")

_HOP_HEADERS = ("Accept", "X-Request-Id")


class _AttemptFailed(Exception):
    """An attempt that may be retried elsewhere: nothing reached the client yet."""

    def __init__(
        self, reason: str, *, hard: bool = False, status: int = 502, busy: bool = False
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.hard = hard  # the process is gone: open the breaker at once
        self.status = status
        self.busy = busy  # a healthy but full engine (503): retry, do not count against it


@dataclass(slots=True)
class ForwardResult:
    """How one client request ended, for logs and metrics."""

    status: int
    replica: Upstream | None
    output_tokens: int = 0
    retries: int = 0
    ttft_s: float | None = None


@dataclass(frozen=True, slots=True)
class ForwardSettings:
    connect_timeout_s: float
    idle_timeout_s: float
    total_timeout_s: float
    max_retries: int
    retry_backoff_s: float


class Forwarder:
    """Sends requests to replicas chosen by the router, with retries and relaying."""

    def __init__(
        self, session: aiohttp.ClientSession, router: Router, settings: ForwardSettings
    ) -> None:
        self.session = session
        self.router = router
        self.settings = settings

    async def forward(
        self, http: web.Request, body: bytes, request: GatewayRequest
    ) -> tuple[web.StreamResponse, ForwardResult]:
        """Answer ``http`` from some replica; ApiError when no attempt could succeed."""
        tried: set[str] = set()
        retries = 0
        last: _AttemptFailed | None = None
        while True:
            grant = await self.router.acquire(request, frozenset(tried))
            tried.add(grant.replica.name)
            try:
                return await self._attempt(http, body, request, grant, retries)
            except BaseException as exc:  # the client left (cancelled) or the attempt failed
                if not isinstance(exc, _AttemptFailed):
                    self.router.release(grant, time.monotonic(), ok=False, output_tokens=0)
                    raise
                failed = exc
                last = failed
                now = time.monotonic()
                if not failed.busy:
                    grant.replica.breaker.record_failure(now, failed.reason, hard=failed.hard)
                self.router.release(grant, now, ok=False, output_tokens=0)
                if retries >= self.settings.max_retries:
                    break
                retries += 1
                self.router.metrics.retries.labels(failed.reason).inc()
                log.info(
                    "retry",
                    extra={
                        "event": "retry",
                        "request_id": request.request_id,
                        "replica": grant.replica.name,
                        "reason": failed.reason,
                        "attempt": retries,
                    },
                )
                await asyncio.sleep(self.settings.retry_backoff_s * 2 ** (retries - 1))
                if not self.router.has_candidate(request, frozenset(tried)):
                    tried.clear()  # every replica failed once: allow a second try anywhere
        assert last is not None
        if last.busy:
            raise ApiError(503, "every replica tried is full", code="overloaded", retry_after_s=1.0)
        if last.status == 504:
            raise ApiError(504, f"replicas timed out: {last.reason}", code="upstream_timeout")
        raise ApiError(
            502, f"no replica could serve the request: {last.reason}", code="upstream_error"
        )

    async def _attempt(
        self,
        http: web.Request,
        body: bytes,
        request: GatewayRequest,
        grant: Grant,
        retries: int,
    ) -> tuple[web.StreamResponse, ForwardResult]:
        replica = grant.replica
        settings = self.settings
        headers = {"Content-Type": "application/json", **replica.upstream_headers}
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
            if upstream.status >= 500 and upstream.status != 508:  # a loop: relay, no retry
                raise _AttemptFailed(f"status {upstream.status}", busy=upstream.status == 503)
            response_headers = {"x-isocost-replica": replica.name}
            if grant.predicted_ttft_s is not None:
                response_headers["x-isocost-predicted-ttft-ms"] = (
                    f"{grant.predicted_ttft_s * 1000:.1f}"
                )
            if upstream.status >= 400 or not request.view.stream:
                return await self._relay_whole(
                    http, upstream, request, grant, response_headers, retries
                )
            return await self._relay_stream(
                http, upstream, request, grant, response_headers, retries
            )
        finally:
            upstream.release()

    async def _relay_whole(
        self,
        http: web.Request,
        upstream: aiohttp.ClientResponse,
        request: GatewayRequest,
        grant: Grant,
        headers: dict[str, str],
        retries: int,
    ) -> tuple[web.StreamResponse, ForwardResult]:
        try:
            data = await upstream.read()
        except TimeoutError:
            raise _AttemptFailed("timeout", status=504) from None
        except aiohttp.ClientError as exc:
            raise _AttemptFailed(f"body: {type(exc).__name__}") from None
        now = time.monotonic()
        ok = upstream.status < 400
        output_tokens = 0
        if ok:
            grant.replica.breaker.record_success(now)
            output_tokens = completion_tokens(data) or 0
        self.router.release(grant, now, ok=ok, output_tokens=output_tokens)
        response = web.Response(
            status=upstream.status,
            body=data,
            content_type=upstream.content_type or "application/json",
            headers=headers,
        )
        return response, ForwardResult(upstream.status, grant.replica, output_tokens, retries)

    async def _relay_stream(
        self,
        http: web.Request,
        upstream: aiohttp.ClientResponse,
        request: GatewayRequest,
        grant: Grant,
        headers: dict[str, str],
        retries: int,
    ) -> tuple[web.StreamResponse, ForwardResult]:
        replica = grant.replica
        try:
            first = await upstream.content.readany()
        except TimeoutError:
            raise _AttemptFailed("timeout", status=504) from None
        except aiohttp.ClientError as exc:
            raise _AttemptFailed(f"stream: {type(exc).__name__}") from None
        if not first:
            raise _AttemptFailed("empty stream")
        now = time.monotonic()
        ttft_s = now - request.arrived_at
        replica.breaker.record_success(now)
        replica.recent_ttft_s.append(ttft_s)
        metrics = self.router.metrics
        metrics.ttft.labels(replica.name).observe(ttft_s)
        itl = metrics.itl.labels(replica.name)

        response = web.StreamResponse(status=upstream.status, headers=headers)
        response.content_type = upstream.content_type or "text/event-stream"
        response.headers["Cache-Control"] = "no-cache"
        await response.prepare(http)

        tokens = 0
        tail = b""
        chunk = first
        older = previous = b""
        last_at = now
        status = upstream.status
        try:
            while chunk:
                older, previous = previous, chunk
                await response.write(chunk)
                window = tail + chunk
                events = sse.count_events(window)
                tail = chunk[-(len(sse.DATA) - 1) :]
                if events:
                    tokens += events
                    self.router.on_tokens(grant, events, last_at)
                try:
                    chunk = await upstream.content.readany()
                except (TimeoutError, aiohttp.ClientError) as exc:
                    status = 502
                    await self._end_broken_stream(response, request, replica, exc)
                    break
                now = time.monotonic()
                if chunk:
                    itl.observe(now - last_at)
                    replica.recent_itl_s.append(now - last_at)
                last_at = now
            await response.write_eof()
            tokens = stream_completion_tokens(older + previous) or tokens
        except ConnectionResetError:
            status = 499  # the client went away; the upstream connection is closed with it
        finally:
            self.router.release(grant, time.monotonic(), ok=status < 400, output_tokens=tokens)
        return response, ForwardResult(status, replica, tokens, retries, ttft_s)

    async def _end_broken_stream(
        self,
        response: web.StreamResponse,
        request: GatewayRequest,
        replica: Upstream,
        exc: Exception,
    ) -> None:
        reason = "timeout" if isinstance(exc, TimeoutError) else type(exc).__name__
        replica.breaker.record_failure(time.monotonic(), f"mid-stream {reason}")
        log.warning(
            "stream broken",
            extra={
                "event": "stream_error",
                "request_id": request.request_id,
                "replica": replica.name,
                "reason": reason,
            },
        )
        error = ApiError(502, f"replica {replica.name} failed mid-stream: {reason}", code=reason)
        await response.write(sse.error_events(error))
