"""The load generator's engine: send a workload to one OpenAI endpoint and time it.

Open loop (default): requests are sent at their arrival times, measured from the start of
the run on the event loop's monotonic clock. The scheduler renders a request's prompt,
sleeps until its absolute due time, starts it as its own task and moves on; it never waits
for answers, so a slow server cannot slow the offered load (no coordinated omission), and
latencies count from the due time (see ``_records``).

Closed loop (``concurrency``): that many workers each send the next request as soon as
their previous one ends; the due time is the moment a worker takes the request.

Sessions: a turn of a multi-turn session waits for its previous turn to end, as a person
cannot reply before reading; its due time is the later of its arrival and that end. Each
turn carries its session id in ``x-session-id``.

Only ``url`` is contacted: ``GET /v1/models`` once before the run (reachability, and the
default model), then ``POST /v1/completions`` or ``/v1/chat/completions``. Given several
URLs (gateways behind no balancer), each is checked the same way and requests go to them
in turn, round-robin, in the order they are sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import msgspec
import numpy as np

from isocost.bench._client import MAX_BODY_BYTES, error_snippet, send_request
from isocost.bench._records import BenchRecord, BenchSummary, summarize_bench
from isocost.core.errors import ConfigError, IsocostError
from isocost.core.jsontext import UNDECODABLE
from isocost.core.slo import SloTargets
from isocost.openai.http import read_capped
from isocost.workload import TextRenderer, WorkloadRequest

__all__ = [
    "BenchOptions",
    "BenchProgress",
    "BenchResult",
    "EndpointError",
    "normalize_url",
    "run_bench",
]

Api = Literal["completions", "chat"]


class EndpointError(IsocostError):
    """The endpoint cannot be used at all: bad URL, unreachable, or no model to name."""


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """How to send: API, streaming, output lengths, loop mode, bounds and SLOs."""

    model: str | None = None  # None: the first model the endpoint lists
    api: Api = "completions"
    stream: bool = True
    max_tokens: int | None = None  # None: each request's own output length
    ignore_eos: bool = False  # vLLM/SGLang extension: generate exactly max_tokens
    concurrency: int | None = None  # closed loop with this many workers; None: open loop
    max_requests: int | None = None
    duration_s: float | None = None  # no new request after this many seconds
    timeout_s: float = 600.0  # per request
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_ttft_per_1k_ms: float = 0.0  # added to the TTFT target per 1,000 prompt tokens
    send_slo: bool = False  # each request carries its targets: x-deadline-ms, x-tpot-ms
    text_salt: int = 0  # a new salt gives new prompt text (a cold prefix cache)
    api_key: str | None = None
    label: str = "bench"

    def __post_init__(self) -> None:
        for name in ("max_tokens", "concurrency", "max_requests", "duration_s", "timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError("bench options", f"{name} must be positive")
        try:
            SloTargets.from_ms(self.slo_ttft_ms, self.slo_tpot_ms, self.slo_ttft_per_1k_ms)
        except ValueError as exc:
            raise ConfigError("bench options", str(exc)) from None
        if self.send_slo and self.slo_ttft_ms is None and self.slo_tpot_ms is None:
            raise ConfigError("bench options", "--send-slo needs --slo-ttft-ms or --slo-tpot-ms")

    def slo_headers(self, prompt_tokens: int) -> dict[str, str]:
        """The request's own SLO targets as a gateway's SLO admission reads them: the TTFT
        target (with its per-1k-token part) as ``x-deadline-ms``, ``x-tpot-ms``; none
        without ``send_slo``."""
        if not self.send_slo:
            return {}
        targets = SloTargets.from_ms(self.slo_ttft_ms, self.slo_tpot_ms, self.slo_ttft_per_1k_ms)
        headers = {}
        if self.slo_ttft_ms is not None:
            headers["x-deadline-ms"] = f"{1000 * targets.ttft_target_s(prompt_tokens):.3f}"
        if self.slo_tpot_ms is not None:
            headers["x-tpot-ms"] = f"{self.slo_tpot_ms:g}"
        return headers


@dataclass(slots=True)
class BenchProgress:
    """Live counters for a progress view; the runner updates them as requests go."""

    sent: int = 0
    done: int = 0
    errors: int = 0
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)

    def add(self, record: BenchRecord) -> None:
        if record.ok:
            self.done += 1
            if record.ttft_s is not None:
                self.ttft_s.append(record.ttft_s)
            if record.e2e_s is not None:
                self.e2e_s.append(record.e2e_s)
        else:
            self.errors += 1

    @staticmethod
    def p99(values: list[float]) -> float | None:
        return float(np.percentile(values, 99)) if values else None


@dataclass(frozen=True, slots=True)
class BenchResult:
    records: list[BenchRecord]
    summary: BenchSummary


def normalize_url(url: str) -> str:
    """The server's base URL (``http://host:port``), accepting a trailing ``/v1``."""
    base = url.strip().rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise EndpointError(f"{url!r} is not an http:// or https:// URL")
    return base.removesuffix("/v1")


async def served_model(
    session: aiohttp.ClientSession,
    base: str,
    model: str | None,
    timeout_s: float,
    api_key: str | None,
) -> tuple[str, int | None]:
    """Check that the endpoint answers; the model to use (given, else the first listed)
    and its ``max_model_len`` where the listing says (vLLM's does)."""
    url = f"{base}/v1/models"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with (
            asyncio.timeout(timeout_s),
            session.get(url, headers=headers, allow_redirects=False) as response,
        ):
            status = response.status
            if 300 <= status < 400:  # the wrong URL: say where, rather than "pass --model"
                raise EndpointError(f"{url} answered {status}: {await error_snippet(response)}")
            body = await read_capped(response, MAX_BODY_BYTES) or b""
    except (aiohttp.ClientError, TimeoutError) as exc:
        reason = " ".join((str(exc) or type(exc).__name__).split())
        raise EndpointError(f"cannot reach {base}: {reason}") from None
    try:
        listed = msgspec.json.decode(body)["data"]
        entries = [e for e in listed if isinstance(e, dict) and isinstance(e.get("id"), str)]
    except (*UNDECODABLE, KeyError, TypeError):
        entries = []
    if model is None:
        if not entries:
            raise EndpointError(f"{url} answered {status} without a model list; pass --model")
        model = entries[0]["id"]
    limit = next((e.get("max_model_len") for e in entries if e["id"] == model), None)
    return model, limit if isinstance(limit, int) and limit > 0 else None


def _payload(
    request: WorkloadRequest, text: str, model: str, options: BenchOptions
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": options.max_tokens or request.output_tokens,
        "stream": options.stream,
    }
    if options.api == "chat":
        payload["messages"] = [{"role": "user", "content": text}]
    else:
        payload["prompt"] = text
    if options.stream:
        payload["stream_options"] = {"include_usage": True}
    if options.ignore_eos:
        payload["ignore_eos"] = True
    return payload


@dataclass(frozen=True, slots=True)
class _Prepared:
    request: WorkloadRequest
    payload: dict[str, Any]
    previous_end: asyncio.Future[float] | None  # end of the session's previous turn
    own_end: asyncio.Future[float] | None  # set when this turn ends


class _Run:
    """State of one run: the clock, the session chains, the records."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        bases: Sequence[str],
        model: str,
        options: BenchOptions,
        progress: BenchProgress,
        stop: asyncio.Event,
    ) -> None:
        self.session = session
        self.stop = stop
        self.model = model
        self.options = options
        self.progress = progress
        path = f"/v1/{'chat/completions' if options.api == 'chat' else 'completions'}"
        self.endpoints = itertools.cycle([base + path for base in bases])
        self.renderer = TextRenderer(salt=options.text_salt)
        self.records: list[BenchRecord] = []
        self.session_ends: dict[str, asyncio.Future[float]] = {}
        loop = asyncio.get_running_loop()
        start = loop.time()
        self.clock: Callable[[], float] = lambda: loop.time() - start

    def prepare(self, request: WorkloadRequest) -> _Prepared:
        """The request's payload and, in a session, the previous turn's end and its own."""
        text = self.renderer.render_request(request)
        payload = _payload(request, text, self.model, self.options)
        if request.session_id is None:
            return _Prepared(request, payload, None, None)
        own_end = asyncio.get_running_loop().create_future()
        previous_end = self.session_ends.get(request.session_id)
        self.session_ends[request.session_id] = own_end
        return _Prepared(request, payload, previous_end, own_end)

    async def send(self, prepared: _Prepared, due_s: float) -> None:
        request = prepared.request
        if prepared.previous_end is not None:
            due_s = max(due_s, await prepared.previous_end)
            await self._sleep_until(due_s)
            if self.stop.is_set():
                return
        headers = {
            "content-type": "application/json",
            **self.options.slo_headers(request.prompt_tokens),
        }
        if request.session_id is not None:
            headers["x-session-id"] = request.session_id
        if self.options.api_key:
            headers["authorization"] = f"Bearer {self.options.api_key}"
        record = BenchRecord(
            request_id=request.request_id,
            session_id=request.session_id,
            turn_index=request.turn_index,
            prompt_tokens=request.prompt_tokens,
            max_tokens=int(prepared.payload["max_tokens"]),
            intended_s=due_s,
            sent_s=due_s,
        )
        self.progress.sent += 1
        try:
            await send_request(
                self.session,
                next(self.endpoints),
                prepared.payload,
                headers,
                self.clock,
                record,
                self.options.timeout_s,
            )
        finally:
            if record.end_s is None and record.error_kind is None:
                record.error_kind, record.error = "cancelled", "the run was stopped"
            self.records.append(record)
            self.progress.add(record)
            if prepared.own_end is not None:
                # a failed turn ends too: the session goes on with its next turn
                end_s = record.end_s if record.end_s is not None else self.clock()
                prepared.own_end.set_result(end_s)

    def _bounded(self, requests: Iterable[WorkloadRequest]) -> Iterator[WorkloadRequest]:
        return itertools.islice(requests, self.options.max_requests)

    def _over(self, at_s: float) -> bool:
        if self.stop.is_set():
            return True
        return self.options.duration_s is not None and at_s >= self.options.duration_s

    async def _sleep_until(self, at_s: float) -> None:
        """Sleep until ``at_s`` on the run's clock, or until the run is stopped."""
        delay_s = at_s - self.clock()
        if delay_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), delay_s)

    async def _finish(self, tasks: list[asyncio.Task[None]]) -> None:
        """Wait for ``tasks``; once the run is stopped, cancel what is still in flight."""
        everything = asyncio.gather(*tasks)
        stopped = asyncio.ensure_future(self.stop.wait())
        either: list[asyncio.Future[Any]] = [everything, stopped]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if everything.done():
            everything.result()  # re-raise a failure of the runner itself
            return
        everything.cancel()
        await asyncio.gather(everything, return_exceptions=True)

    async def open_loop(self, requests: Iterable[WorkloadRequest]) -> None:
        tasks: list[asyncio.Task[None]] = []
        for request in self._bounded(requests):
            if self._over(request.arrival_s):
                break
            prepared = self.prepare(request)  # render before sleeping, not after
            await self._sleep_until(request.arrival_s)
            if self.stop.is_set():
                break
            tasks.append(asyncio.create_task(self.send(prepared, request.arrival_s)))
        await self._finish(tasks)

    async def closed_loop(self, requests: Iterable[WorkloadRequest], workers: int) -> None:
        source = self._bounded(requests)

        async def worker() -> None:
            for request in source:
                if self._over(self.clock()):
                    return
                await self.send(self.prepare(request), self.clock())

        await self._finish([asyncio.create_task(worker()) for _ in range(workers)])


async def run_bench(
    url: str | Sequence[str],
    requests: Iterable[WorkloadRequest],
    options: BenchOptions,
    progress: BenchProgress | None = None,
    stop: asyncio.Event | None = None,
) -> BenchResult:
    """Send ``requests`` (in arrival order) to ``url`` (or round-robin to several URLs);
    every request's record and a summary.

    Setting ``stop`` ends the run early: nothing new is sent, requests in flight are
    cancelled (error kind ``cancelled``) and the summary covers what was sent. Raises
    ``EndpointError`` before sending anything if the endpoint cannot be reached.
    """
    bases = [normalize_url(one) for one in ([url] if isinstance(url, str) else url)]
    if not bases:
        raise EndpointError("no endpoint URL given")
    connector = aiohttp.TCPConnector(limit=0)  # open loop: never queue in the client
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        check_s = min(options.timeout_s, 10.0)
        model, _ = await served_model(session, bases[0], options.model, check_s, options.api_key)
        for other in bases[1:]:  # each must answer too
            await served_model(session, other, model, check_s, options.api_key)
        run = _Run(
            session, bases, model, options, progress or BenchProgress(), stop or asyncio.Event()
        )
        if options.concurrency is None:
            await run.open_loop(requests)
        else:
            await run.closed_loop(requests, options.concurrency)
    records = sorted(run.records, key=lambda r: r.request_id)
    summary = summarize_bench(
        records,
        label=options.label,
        url=",".join(bases),
        model=model,
        slo_ttft_ms=options.slo_ttft_ms,
        slo_tpot_ms=options.slo_tpot_ms,
        slo_ttft_per_1k_ms=options.slo_ttft_per_1k_ms,
    )
    return BenchResult(records, summary)
