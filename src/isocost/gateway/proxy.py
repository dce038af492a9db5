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
not SSE, an error event, an end without ``[DONE]``) is recorded against the replica, and
the stream is *resumed*: its continuation (``isocost.openai.continuation``) is scheduled
like any request (the brain prices its prompt, the text so far included, as prefill; the
replicas already tried are excluded) and relayed into the same client stream through its
``StreamLedger`` (``isocost.gateway.resume``), within the same retry budget and total
timeout. A stream that cannot be resumed (its pool says ``resume: off``, the request is
not resumable, a tool-call delta went out, no replica took the continuation) ends with an
OpenAI-style error event and ``[DONE]``, as does any stream once the budget is spent.
Each data event counts as one streamed token for the shadow state (the usage event, when
the client asked for one, gives the exact count; a resumable stream asks its upstream for
the usage in every chunk), and the times between chunks are the observed inter-token
latencies.

Disaggregated (a pool with prefill- or decode-role replicas, and the brain's pair choice
splitting the request, ``Router.plan_handoff``): vLLM's two-step protocol. The prefill
step goes to P (the request with ``max_tokens: 1``, not streamed, ``kv_transfer_params:
{do_remote_decode: true}``); P's answer's ``kv_transfer_params`` go into the original
request (chat or completions, streamed or not), sent to D and relayed as any attempt, so
the client sees one ordinary answer (``x-isocost-prefill-replica`` names P). A prefill
step that fails (P unreachable, an error, no hand-off in its answer) or a decode whose KV
pull fails (D answers 502 ``kv_transfer_failed``: P died or dropped the KV; not held
against D) is counted (``isocost_pd_handoff_failures``) and the request is prefilled
again: on another pair without that P, else whole on a decode replica; never lost.

A client that leaves (its connection lost) or stops reading (a write blocked for
``idle_timeout_ms``) ends the attempt: the upstream connection is closed, so the engine
aborts the request, and the result is 499.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import aiohttp
import msgspec
from aiohttp import web

from isocost.core.jsontext import UNDECODABLE
from isocost.gateway.body import routing_view, summarize
from isocost.gateway.health import status_fault
from isocost.gateway.loops import HOPS_HEADER, hops
from isocost.gateway.resume import SegmentError, StreamLedger
from isocost.gateway.routing import GatewayRequest, Grant, Router
from isocost.gateway.tracing import Tracing
from isocost.gateway.upstreams import Upstream, connect_failure
from isocost.openai import sse
from isocost.openai.continuation import not_resumable
from isocost.openai.errors import ApiError
from isocost.openai.requests import KV_TRANSFER_MS_HEADER
from isocost.openai.usage import answer_usage, stream_event

__all__ = [
    "AnswerTooLarge",
    "ClientGone",
    "ForwardResult",
    "ForwardSettings",
    "Forwarder",
    "StreamReader",
]

log = logging.getLogger("isocost.gateway")

_HOP_HEADERS = ("Accept", "X-Request-Id")
CLIENT_GONE_STATUS = 499
PREFILL_REPLICA_HEADER = "x-isocost-prefill-replica"  # P, on a split request's answer
_ERROR_PEEK_BYTES = 4096
# A block this small written onto an empty transport buffer stays under the transport's
# low-water mark (16 KiB by default in asyncio and uvloop), so the write cannot pause.
_AT_ONCE_BYTES = 16 * 1024


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
        handoff_lost: bool = False,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.hard = hard  # the process is gone: open the breaker at once
        self.status = status
        self.busy = busy  # a healthy but full engine (503): retry, do not count against it
        self.soft = soft  # an overloaded engine (429): counts in its success rate only
        self.handoff_lost = handoff_lost  # a decode could not pull its KV: P's failure


class ClientGone(Exception):
    """The client left or stopped reading: its request ends as 499 (``reason`` says how)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _BadStream(Exception):
    """An upstream stream that is not OpenAI server-sent events, or broke off."""


class AnswerTooLarge(Exception):
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
    resumes: int = 0  # times its stream went on on another replica
    ttft_s: float | None = None
    predicted_ttft_s: float | None = None  # what the router predicted for the first attempt
    cached_tokens: int | None = None  # the prefix-cache hit the engine reported
    predicted_cached_tokens: int | None = None  # the hit the router predicted, in its terms
    error: str | None = None
    prefill_replica: Upstream | None = None  # P, when the answer came from a split
    prefill_s: float | None = None  # its prefill step's time
    kv_transfer_s: float | None = None  # the KV transfer D reported
    handoff_failures: int = 0  # splits whose prefill or pull failed (prefilled again)
    queues: tuple[int, int] | None = None  # waiting at (P, D) when the answering pair was chosen

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replica is not None


@dataclass(frozen=True, slots=True)
class ForwardSettings:
    connect_timeout_s: float
    idle_timeout_s: float
    total_timeout_s: float
    max_retries: int
    retry_backoff_s: float
    max_response_bytes: int


@dataclass(frozen=True, slots=True)
class _Attempt:
    """One client request's side of its attempts: what every attempt and resume shares."""

    http: web.Request
    request: GatewayRequest
    result: ForwardResult
    tried: set[str]  # replica names tried so far (retries and resumes avoid them)
    deadline: float  # monotonic seconds: the request's total timeout
    ledger: StreamLedger | None  # a resumable stream's relayed state


@dataclass(frozen=True, slots=True)
class _Break:
    """Why one upstream's part of a stream ended early, and whether another may go on."""

    reason: str
    resumable: bool = True


class _Segment(NamedTuple):
    """One upstream's part of a stream: its response, grant, reader, first bytes to relay."""

    upstream: aiohttp.ClientResponse
    grant: Grant
    reader: StreamReader
    block: bytes


class StreamReader:
    """Checks an upstream SSE stream as it arrives and hands back whole lines to relay.

    ``feed`` returns the complete lines of what came so far (a partial line waits for the
    rest), after checking each: SSE, and every data payload a JSON object or ``[DONE]``.
    At ``[DONE]`` the stream is over: the rest is dropped and the canonical ``[DONE]``
    event relayed. A line that breaks the stream stops the feed there: what came before it
    is still handed back (it is sound, and a resumed stream must relay exactly what its
    ledger counted), and ``broken`` says why. With a ``ledger`` (a resumable stream) every
    event is what the ledger makes of it, and nothing else is relayed."""

    def __init__(self, max_line_bytes: int, ledger: StreamLedger | None = None) -> None:
        self.max_line_bytes = max_line_bytes
        self.ledger = ledger
        self.events = 0  # data events, [DONE] not counted
        self.generated = 0  # of them, those that carried generated output (tokens)
        self.usage_tokens: int | None = None
        self._cached_tokens: int | None = None
        self.done = False
        self.broken: str | None = None
        self.at_event_end = True  # what was relayed ends with a blank line
        self._partial = bytearray()

    @property
    def tokens(self) -> int:
        """This upstream's completion tokens: counted exactly when it said, else the
        events that carried generated output."""
        if self.ledger is not None:
            return self.ledger.segment_tokens
        return self.generated if self.usage_tokens is None else self.usage_tokens

    @property
    def cached_tokens(self) -> int | None:
        """The prefix-cache hit the (first) upstream reported, when it did."""
        return self._cached_tokens if self.ledger is None else self.ledger.cached_tokens

    def feed(self, chunk: bytes) -> bytes:
        cut = chunk.rfind(b"\n") + 1
        if not cut:
            self._partial += chunk
            if len(self._partial) > self.max_line_bytes:
                raise AnswerTooLarge
            return b""
        lines = bytes(self._partial) + chunk[:cut]
        self._partial = bytearray(chunk[cut:])
        relayed = bytearray()
        start = 0
        while start < len(lines):
            end = lines.index(b"\n", start) + 1
            line = lines[start:end]
            start = end
            try:
                payload = sse.line_data(line)
            except sse.SseError:
                self.broken = "not an SSE line"
                break
            if payload == sse.DONE:
                self.done = True
                relayed += sse.DONE_EVENT
                break
            if self.ledger is None:
                if payload is not None and not self._count(payload):
                    break
                relayed += line
            elif payload is not None:
                generated_before = self.ledger.generated_events
                try:
                    event = self.ledger.relay(payload)
                except SegmentError as exc:
                    self.broken = str(exc)
                    break
                self.events += 1
                self.generated += self.ledger.generated_events - generated_before
                if event is not None:
                    relayed += b"data: " + event + b"\n\n"
        if self.ledger is None and relayed and not self.done:
            self.at_event_end = relayed.endswith((b"\n\n", b"\r\n\r\n"))
        return bytes(relayed)

    def _count(self, payload: bytes) -> bool:
        """Count one relayed event (its usage, if it carries one); False when it is no
        JSON object (the stream is broken there)."""
        try:
            event = stream_event(payload)
        except UNDECODABLE:
            self.broken = "event is not a JSON object"
            return False
        self.events += 1
        self.generated += event.generated
        usage = event.usage
        if usage is not None:
            self.usage_tokens = usage.completion_tokens
            self._cached_tokens = usage.cached_tokens
        return True

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
        # The key's x-ratelimit-* headers for an answer, and the tracer (set by the gateway)
        self.key_headers: Callable[[str | None], dict[str, str]] = lambda key_name: {}
        self.tracing = Tracing(None)

    async def forward(
        self, http: web.Request, body: bytes, request: GatewayRequest, result: ForwardResult
    ) -> web.StreamResponse:
        """Answer ``http`` from some replica, recording the outcome in ``result``; ApiError
        when no attempt could succeed, ClientGone when the client left."""
        tried: set[str] = set()
        last: _AttemptFailed | None = None
        deadline = request.arrived_at + self.settings.total_timeout_s
        ledger = self._ledger(http, body, request)
        upstream_body = body if ledger is None else ledger.upstream_body()
        split = await self._split(
            _Attempt(http, request, result, tried, deadline, ledger), body, upstream_body
        )
        if split is not None:
            return split
        while True:
            grant = await self._acquire(request, frozenset(tried), deadline)
            tried.add(grant.replica.name)
            result.replica = grant.replica
            if result.predicted_ttft_s is None:
                result.predicted_ttft_s = grant.predicted_ttft_s
            try:
                attempt = _Attempt(http, request, result, tried, deadline, ledger)
                return await self._attempt(attempt, upstream_body, grant)
            except BaseException as exc:  # the client left (cancelled) or the attempt failed
                if not isinstance(exc, _AttemptFailed):
                    self.router.release(grant, time.monotonic(), ok=False, output_tokens=0)
                    raise
                failed = last = exc
            if not await self._after_failure(failed, grant, request, result, deadline, tried):
                break
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

    async def _split(
        self, attempt: _Attempt, body: bytes, upstream_body: bytes
    ) -> web.StreamResponse | None:
        """Answer ``attempt`` split into a prefill on P and the request on D while the brain
        splits it (see the module docstring); None: serve it whole, as never split or
        after failed splits (within the retry budget)."""
        request, result, tried = attempt.request, attempt.result, attempt.tried
        lost_prefills: set[str] = set()  # P that failed this request: no pair with them
        while True:
            handoff = self.router.plan_handoff(request, frozenset(tried | lost_prefills))
            if handoff is None:
                return None
            prefill, decode = handoff.prefill, handoff.decode
            try:
                params = await self._prefill_step(attempt, body, prefill)
            except _AttemptFailed as failed:
                self.router.release(decode, time.monotonic(), ok=False, output_tokens=0)
                lost_prefills.add(prefill.replica.name)
                self._count_lost_handoff(request, result, prefill, "prefill", failed.reason)
                if not await self._after_failure(
                    failed, prefill, request, result, attempt.deadline, tried
                ):
                    return None
                continue
            except BaseException:
                for grant in (prefill, decode):
                    self.router.release(grant, time.monotonic(), ok=False, output_tokens=0)
                raise
            tried.add(decode.replica.name)
            result.replica, result.prefill_replica = decode.replica, prefill.replica
            result.queues = (handoff.prefill_queue, handoff.decode_queue)
            decode_body = _with_kv_params(upstream_body, params)
            try:
                return await self._attempt(attempt, decode_body, decode)
            except _AttemptFailed as failed:
                result.prefill_replica = result.queues = None
                if failed.handoff_lost:
                    tried.discard(decode.replica.name)  # D is fine: P lost the KV
                    lost_prefills.add(prefill.replica.name)
                    self._count_lost_handoff(request, result, prefill, "transfer", failed.reason)
                if not await self._after_failure(
                    failed, decode, request, result, attempt.deadline, tried
                ):
                    return None
            except BaseException:
                self.router.release(decode, time.monotonic(), ok=False, output_tokens=0)
                raise

    async def _prefill_step(self, attempt: _Attempt, body: bytes, grant: Grant) -> dict[str, Any]:
        """Send the prefill step to P and release its grant; the ``kv_transfer_params`` of
        its answer, or _AttemptFailed (recorded by the caller) when it gave none."""
        sent_at = time.monotonic()
        upstream = await self._open(attempt.http, _prefill_body(body), attempt.request, grant)
        try:
            data = await self._read_whole(upstream, attempt.request)
        except BaseException:
            upstream.close()
            raise
        upstream.release()
        if upstream.status >= 400:
            raise _AttemptFailed(f"prefill step refused (status {upstream.status})")
        params = _handoff_params(data)
        if params is None:  # answered, but holds no KV for us (vLLM: no room): a full one
            raise _AttemptFailed("prefill step gave no KV hand-off", busy=True)
        now = time.monotonic()
        grant.replica.breaker.record_success(now)
        self.router.release(grant, now, ok=True, output_tokens=1)
        attempt.result.prefill_s = now - sent_at
        self.router.metrics.pd_prefill.labels(grant.replica.name).observe(now - sent_at)
        return params

    def _count_lost_handoff(
        self,
        request: GatewayRequest,
        result: ForwardResult,
        prefill: Grant,
        stage: str,
        reason: str,
    ) -> None:
        """Count and log a split whose hand-off from ``prefill``'s replica was lost."""
        result.handoff_failures += 1
        self.router.metrics.pd_handoff_failures.labels(request.pool.model, stage).inc()
        log.info(
            "handoff lost",
            extra={
                "event": "handoff_lost",
                "request_id": request.request_id,
                "replica": prefill.replica.name,
                "stage": stage,
                "reason": reason,
            },
        )

    def _ledger(
        self, http: web.Request, body: bytes, request: GatewayRequest
    ) -> StreamLedger | None:
        """The ledger of a stream that may be resumed, None for any other request."""
        if not (request.view.stream and request.pool.resume):
            return None
        chat = http.path.endswith("/chat/completions")
        decoded = msgspec.json.decode(body)  # the intake decoded it: a JSON object
        if not isinstance(decoded, dict) or not_resumable(decoded, chat=chat) is not None:
            return None
        return StreamLedger(decoded, chat=chat, cap=request.view.max_tokens)

    async def _after_failure(
        self,
        failed: _AttemptFailed,
        grant: Grant,
        request: GatewayRequest,
        result: ForwardResult,
        deadline: float,
        tried: set[str],
    ) -> bool:
        """Settle a failed attempt (breaker, shadow state); then whether to try again."""
        now = time.monotonic()
        if not failed.busy:
            grant.replica.breaker.record_failure(
                now, failed.reason, hard=failed.hard, soft=failed.soft
            )
        self.router.release(grant, now, ok=False, output_tokens=0)
        return await self._next_try(request, result, deadline, tried, grant, failed.reason)

    async def _next_try(
        self,
        request: GatewayRequest,
        result: ForwardResult,
        deadline: float,
        tried: set[str],
        grant: Grant,
        reason: str,
    ) -> bool:
        """Whether the retry budget and the total timeout allow one more attempt; if so it
        is counted and logged, and its backoff waited."""
        if result.retries >= self.settings.max_retries or time.monotonic() >= deadline:
            return False
        result.retries += 1
        self.router.metrics.retries.labels(reason).inc()
        log.info(
            "retry",
            extra={
                "event": "retry",
                "request_id": request.request_id,
                "replica": grant.replica.name,
                "reason": reason,
                "attempt": result.retries,
            },
        )
        backoff_s = self.settings.retry_backoff_s * 2 ** (result.retries - 1)
        await asyncio.sleep(min(backoff_s, max(0.0, deadline - time.monotonic())))
        if not self.router.has_candidate(request, frozenset(tried)):
            tried.clear()  # every replica failed once: allow a second try anywhere
        return True

    async def _acquire(
        self, request: GatewayRequest, exclude: frozenset[str], deadline: float
    ) -> Grant:
        """A replica for the next attempt; 504 when the total timeout passes first."""
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise _timed_out("no time left for an attempt")
        try:
            return await self.router.acquire(request, exclude, left_s)
        except TimeoutError:
            raise _timed_out("waiting for a replica") from None

    async def _open(
        self, http: web.Request, body: bytes, request: GatewayRequest, grant: Grant
    ) -> aiohttp.ClientResponse:
        """POST ``body`` to the granted replica; _AttemptFailed for no answer or one that
        is the replica's failure (``_judge_status``)."""
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
        self.tracing.inject(http.headers, headers)
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
        except aiohttp.ClientSSLError as exc:
            raise _AttemptFailed(f"connect: {connect_failure(exc)}", hard=True) from None
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
        except _AttemptFailed:
            lost = upstream.status == 502 and await _is_lost_handoff(upstream)
            upstream.close()
            if lost:
                raise _AttemptFailed("KV transfer failed", busy=True, handoff_lost=True) from None
            raise
        return upstream

    async def _attempt(self, attempt: _Attempt, body: bytes, grant: Grant) -> web.StreamResponse:
        with self.tracing.attempt(grant.replica.name):
            return await self._try(attempt, body, grant)

    async def _try(self, attempt: _Attempt, body: bytes, grant: Grant) -> web.StreamResponse:
        upstream = await self._open(attempt.http, body, attempt.request, grant)
        try:
            response_headers = self.key_headers(attempt.request.key_name)
            response_headers["x-isocost-replica"] = grant.replica.name
            prefill = attempt.result.prefill_replica
            if prefill is not None:
                response_headers[PREFILL_REPLICA_HEADER] = prefill.name
                self._note_transfer(upstream, grant, attempt.result)
            if grant.predicted_ttft_s is not None:
                response_headers["x-isocost-predicted-ttft-ms"] = (
                    f"{grant.predicted_ttft_s * 1000:.1f}"
                )
            if upstream.status >= 400 or not attempt.request.view.stream:
                response = await self._relay_whole(
                    attempt.http, upstream, attempt.request, grant, response_headers, attempt.result
                )
            else:
                response = await self._relay_stream(attempt, upstream, grant, response_headers)
        except BaseException:
            upstream.close()  # never pooled half read: the engine sees the abort
            raise
        upstream.release()
        return response

    def _note_transfer(
        self, upstream: aiohttp.ClientResponse, grant: Grant, result: ForwardResult
    ) -> None:
        """The KV transfer time D reports (isocost's engine does; vLLM does not)."""
        try:
            transfer_s = float(upstream.headers.get(KV_TRANSFER_MS_HEADER, "")) / 1000
        except ValueError:
            return
        result.kv_transfer_s = transfer_s
        self.router.metrics.kv_transfer.labels(grant.replica.name).observe(transfer_s)

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
            except UNDECODABLE:
                kind = upstream.content_type or "no content type"
                raise _AttemptFailed(f"answer is not a JSON object ({kind})") from None
            result.output_tokens = usage.completion_tokens if usage else 0
            if usage is not None:
                self._check_prefix_hit(grant, usage.cached_tokens, result)
        now = time.monotonic()
        if ok:
            grant.replica.breaker.record_success(now)
        self.router.release(grant, now, ok=ok, output_tokens=result.output_tokens)
        result.status = upstream.status
        response = web.StreamResponse(status=upstream.status, headers=headers)
        response.content_type = upstream.content_type or "application/json"
        response.content_length = len(data)
        await self._send(http, _answer_whole(http, response, data))
        return response

    async def _first_events(
        self, upstream: aiohttp.ClientResponse, reader: StreamReader, request: GatewayRequest
    ) -> bytes:
        """What the upstream sent up to its first event; a failure here is retried."""
        block = b""
        try:
            while not (reader.events or reader.done):
                chunk = await upstream.content.readany()
                if not chunk:
                    raise _AttemptFailed(f"stream {reader.end_reason()}")
                block += reader.feed(chunk)
                if reader.broken is not None and not reader.events:
                    raise _AttemptFailed(f"stream: {reader.broken}")
        except TimeoutError:
            raise _AttemptFailed("timeout", status=504) from None
        except aiohttp.ClientError as exc:
            raise _AttemptFailed(f"stream: {type(exc).__name__}") from None
        except AnswerTooLarge:
            raise self._too_large(request) from None
        return block

    async def _relay_stream(
        self,
        attempt: _Attempt,
        upstream: aiohttp.ClientResponse,
        grant: Grant,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        http, request, result, ledger = (
            attempt.http,
            attempt.request,
            attempt.result,
            attempt.ledger,
        )
        reader = StreamReader(self.settings.max_response_bytes, ledger)
        block = await self._first_events(upstream, reader, request)
        response = web.StreamResponse(status=upstream.status, headers=headers)
        response.content_type = upstream.content_type or "text/event-stream"
        response.headers["Cache-Control"] = "no-cache"
        segment = first = _Segment(upstream, grant, reader, block)
        broken: _Break | None = None
        try:
            await self._send(http, response.prepare(http))
            while True:
                broken = await self._pump(http, response, request, result, segment)
                if broken is None:
                    if segment is first:  # a resumed stream's hit was the first replica's
                        self._check_prefix_hit(grant, reader.cached_tokens, result)
                    break
                if ledger is not None and broken.resumable and ledger.complete():
                    await self._send(http, response.write(ledger.closing_events()))
                    broken = None  # nothing was missing but the tail
                    break
                following = await self._resume(attempt, segment.grant, broken)
                if following is None:
                    await self._end_broken_stream(http, response, request, segment, broken.reason)
                    break
                segment = following
                result.replica = segment.grant.replica
            await self._send(http, response.write_eof())
        finally:
            result.output_tokens = segment.reader.tokens if ledger is None else ledger.tokens
        result.status = upstream.status if broken is None else 502
        result.error = None if broken is None else broken.reason
        return response

    def _check_prefix_hit(
        self, grant: Grant, cached_tokens: int | None, result: ForwardResult
    ) -> None:
        """Compare the engine's reported prefix-cache hit with the router's prediction."""
        if cached_tokens is not None:
            result.cached_tokens = cached_tokens
            result.predicted_cached_tokens = self.router.check_prefix_hit(grant, cached_tokens)

    async def _pump(
        self,
        http: web.Request,
        response: web.StreamResponse,
        request: GatewayRequest,
        result: ForwardResult,
        segment: _Segment,
    ) -> _Break | None:
        """Relay one upstream's events to the end of its stream (None) or until it breaks;
        its grant is released either way, its connection closed when broken. The stream's
        first token (``result.ttft_s``) and its gaps are timed by the events that carried
        generated output, not by a chat stream's opening (vLLM sends it with the first
        token, other servers at once) nor its finish."""
        upstream, grant, reader, block = segment
        replica = grant.replica
        itl = self.router.metrics.itl.labels(replica.name)
        last_at = time.monotonic()  # when the latest chunk came
        token_at: float | None = None  # when the latest generated output came
        counted = 0
        broken: _Break | None = None
        try:
            while True:
                if reader.generated > counted:
                    self.router.on_tokens(grant, reader.generated - counted, last_at)
                    counted = reader.generated
                    if token_at is not None:
                        itl.observe(last_at - token_at)
                        replica.recent_itl_s.append(last_at - token_at)
                    elif result.ttft_s is None:
                        result.ttft_s = ttft_s = last_at - request.arrived_at
                        replica.recent_ttft_s.append(ttft_s)
                        self.router.metrics.ttft.labels(replica.name).observe(ttft_s)
                    token_at = last_at
                await self._send(http, response.write(block), len(block))
                if reader.done:
                    break
                try:
                    if reader.broken is not None:
                        raise _BadStream(reader.broken)
                    chunk = await upstream.content.readany()
                    if not chunk:
                        raise _BadStream(reader.end_reason())
                    block = reader.feed(chunk)
                except (TimeoutError, aiohttp.ClientError, _BadStream) as exc:
                    broken = _Break(_broken_reason(exc))
                    replica.breaker.record_failure(time.monotonic(), f"mid-stream {broken.reason}")
                    return broken
                except AnswerTooLarge:
                    broken = _Break(self._too_large(request).message, resumable=False)
                    return broken
                last_at = time.monotonic()
            replica.breaker.record_success(time.monotonic())
            return None
        finally:
            done = reader.done and broken is None
            self.router.release(grant, time.monotonic(), ok=done, output_tokens=reader.tokens)
            if done:
                upstream.release()
            else:
                upstream.close()

    async def _resume(
        self, attempt: _Attempt, broken_grant: Grant, broken: _Break
    ) -> _Segment | None:
        """The next replica's segment of a stream broken mid-way: its continuation, sent
        within the retry budget and the total timeout; None when it cannot go on."""
        ledger, request, result = attempt.ledger, attempt.request, attempt.result
        metrics = self.router.metrics.stream_resumes
        if ledger is None or not broken.resumable or ledger.blocker is not None:
            metrics.labels("not_resumable").inc()
            return None
        previous = broken_grant.replica.name
        reason = f"mid-stream {broken.reason}"
        body = ledger.continuation_body()
        view = await routing_view(
            summarize(body, chat=ledger.chat), self.router.block_tokens, request.pool.tokenizer
        )
        continued = dataclasses.replace(request, view=view, deadline_at=None)
        if not await self._next_try(
            request, result, attempt.deadline, attempt.tried, broken_grant, reason
        ):
            metrics.labels("failed").inc()
            return None
        while True:
            try:
                grant = await self._acquire(continued, frozenset(attempt.tried), attempt.deadline)
            except ApiError:
                metrics.labels("failed").inc()
                return None
            attempt.tried.add(grant.replica.name)
            ledger.start_segment(previous, grant.replica.name)
            try:
                upstream = await self._open(attempt.http, body, continued, grant)
                try:
                    if upstream.status >= 400:  # refused as a request: nowhere else takes it
                        raise ApiError(upstream.status, f"continuation refused: {upstream.status}")
                    reader = StreamReader(self.settings.max_response_bytes, ledger)
                    block = await self._first_events(upstream, reader, continued)
                except BaseException:
                    upstream.close()
                    raise
            except ApiError as refused:
                self.router.release(grant, time.monotonic(), ok=False, output_tokens=0)
                ledger.abandon_segment()
                metrics.labels("failed").inc()
                log.warning(
                    "continuation refused",
                    extra={
                        "event": "resume_refused",
                        "request_id": request.request_id,
                        "replica": grant.replica.name,
                        "error": refused.message,
                    },
                )
                return None
            except _AttemptFailed as failed:
                ledger.abandon_segment()
                if not await self._after_failure(
                    failed, grant, request, result, attempt.deadline, attempt.tried
                ):
                    metrics.labels("failed").inc()
                    return None
                continue
            except BaseException:
                self.router.release(grant, time.monotonic(), ok=False, output_tokens=0)
                raise
            metrics.labels("resumed").inc()
            result.resumes += 1
            log.info(
                "stream resumed",
                extra={
                    "event": "stream_resumed",
                    "request_id": request.request_id,
                    "replica": grant.replica.name,
                    "from_replica": previous,
                    "after_tokens": ledger.offset,
                    "reason": broken.reason,
                },
            )
            return _Segment(upstream, grant, reader, block)

    async def _send(
        self, http: web.Request, write: Awaitable[object], size: int | None = None
    ) -> None:
        """One write to the client, which must drain within ``idle_timeout_s``: a client
        that stops reading would otherwise hold the upstream (and its engine slot). A
        write of ``size`` bytes onto a transport with nothing pending cannot wait, so it
        goes without the timer (a tenth of a relayed chunk's CPU)."""
        transport = http.transport
        may_wait = (
            size is None
            or size > _AT_ONCE_BYTES
            or transport is None
            or transport.get_write_buffer_size() > 0
        )
        try:
            if may_wait:
                async with asyncio.timeout(self.settings.idle_timeout_s):
                    await write
            else:
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
        segment: _Segment,
        reason: str,
    ) -> None:
        replica = segment.grant.replica
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
        separator = b"" if segment.reader.at_event_end else b"\n"  # end a half-relayed event
        await self._send(http, response.write(separator + sse.error_events(error)))


def _prefill_body(body: bytes) -> bytes:
    """The prefill step of a split request, as vLLM's disaggregated proxies send it: one
    output token, not streamed, asking for a remote decode."""
    decoded = msgspec.json.decode(body)  # the intake decoded it: a JSON object
    decoded["max_tokens"] = 1
    if "max_completion_tokens" in decoded:
        decoded["max_completion_tokens"] = 1
    decoded["stream"] = False
    decoded.pop("stream_options", None)
    decoded["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return msgspec.json.encode(decoded)


def _handoff_params(answer: bytes | bytearray) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill step's answer, when it hands the KV off."""
    try:
        decoded = msgspec.json.decode(answer)
    except UNDECODABLE:
        return None
    params = decoded.get("kv_transfer_params") if isinstance(decoded, dict) else None
    if isinstance(params, dict) and params.get("do_remote_prefill"):
        return params
    return None


def _with_kv_params(body: bytes, params: dict[str, Any]) -> bytes:
    """The request for D: the client's, carrying P's hand-off."""
    decoded = msgspec.json.decode(body)
    decoded["kv_transfer_params"] = params
    return msgspec.json.encode(decoded)


async def _is_lost_handoff(upstream: aiohttp.ClientResponse) -> bool:
    """Whether a 502 is a decode's failed KV pull (``kv_transfer_failed``), read from its
    small error body."""
    try:
        data = await upstream.content.read(_ERROR_PEEK_BYTES)
        error = msgspec.json.decode(data).get("error", {})
    except (aiohttp.ClientError, TimeoutError, *UNDECODABLE, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == "kv_transfer_failed"


def _judge_status(status: int) -> None:
    """_AttemptFailed for an upstream status that is the replica's failure, not the client's."""
    fault = status_fault(status)
    if fault is not None:
        raise _AttemptFailed(f"status {status}", busy=fault.busy, soft=fault.soft)


def _broken_reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, _BadStream):
        return str(exc)
    return type(exc).__name__


def _timed_out(reason: str) -> ApiError:
    return ApiError(504, f"the request's total timeout passed: {reason}", code="upstream_timeout")


async def _answer_whole(
    http: web.Request, response: web.StreamResponse, data: bytes | bytearray
) -> None:
    """Headers, body and end of an answer not streamed: one write to drain in time."""
    await response.prepare(http)
    await response.write(data)
    await response.write_eof()
