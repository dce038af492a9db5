"""One fault drill: steady load, a fault, and what the gateway did about it.

Timeline, in seconds on the load generator's clock (0 at its first request): warm-up for
``warmup_s`` with every target healthy in the gateway's admin API -> inject the fault into
each target through its engine's ``POST /admin/fault`` -> hold it for ``fault_s`` -> clear
it (``{}``), or for ``restart`` call the restart hook of the crashed replica (``kill`` is
never undone) -> wait up to ``settle_s`` for the gateway to list every target healthy
again -> stop sending and let the requests in flight finish.

Meanwhile ``GET /admin/replicas`` is polled every ``poll_s``. Detection is the first poll
after injection that shows every target out of rotation (not ``healthy``) or, for
``slow``, also a learned correction factor (TTFT or ITL) at or above ``flag_factor`` times
its own value at injection (factors are relative to the cost model, which a simulator's
time scale or a real engine's efficiency shifts for every replica alike).
Drained is the first poll at or after detection with no request in flight on any target.
Recovery is the first poll after clearing that shows every target healthy (for ``slow``:
with its factors back under the flag).

Requests are judged from the load generator's records. A failure before the first token
is *lost*: the gateway should have retried it elsewhere. A failure after it is a *stream
cut*: tokens already reached the client and the stream could not be resumed elsewhere.
A *resumed* stream went on on another replica (the gateway names its resumes in the
stream's finish chunk); with ``ignore_eos`` its ``resumed_exact`` count says how many of
them still carried exactly ``max_tokens`` completion tokens in their usage. The traffic share of
the targets is the share of completed requests they served, before injection and between
injection and clearing (or the end of sending).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import msgspec

from isocost.bench import (
    MAX_BODY_BYTES,
    BenchOptions,
    BenchProgress,
    BenchRecord,
    WorkloadSpec,
    build_workload,
    error_snippet,
    normalize_url,
    read_capped,
    run_bench,
)
from isocost.core.errors import ConfigError, IsocostError
from isocost.core.jsontext import UNDECODABLE
from isocost.workload import SyntheticSpec, WorkloadRequest

__all__ = ["FAULTS", "DrillError", "DrillOptions", "DrillReport", "Fault", "Restart", "run_drill"]

Fault = Literal["kill", "hang", "slow", "errors", "restart"]
FAULTS: tuple[Fault, ...] = ("kill", "hang", "slow", "errors", "restart")

Restart = Callable[[str], Awaitable[None]]
"""Brings back the replica whose engine URL it is given (``restart`` drills)."""

_HEALTHY = "healthy"


class DrillError(IsocostError):
    """The drill cannot run or went off the rails: bad target, unhealthy start, no admin API."""


@dataclass(frozen=True, slots=True)
class DrillOptions:
    """What to inject, the load to keep up meanwhile, and the phase lengths."""

    fault: Fault
    admin_token: str
    api_key: str | None = None
    model: str | None = None  # None: the first target's pool
    rate_rps: float = 8.0
    max_tokens: int = 32
    stream: bool = True  # False: whole answers, held until the end (the gateway's total timeout)
    ignore_eos: bool = False  # every request asks for exactly max_tokens
    max_prompt_tokens: int = 512
    warmup_s: float = 3.0
    fault_s: float = 5.0
    settle_s: float = 10.0
    slowdown: float = 3.0
    error_rate: float = 1.0
    flag_factor: float = 1.5
    poll_s: float = 0.05
    request_timeout_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ConfigError("drill", f"unknown fault {self.fault!r}; valid: {', '.join(FAULTS)}")
        for name in ("rate_rps", "max_tokens", "max_prompt_tokens", "fault_s", "settle_s"):
            if getattr(self, name) <= 0:
                raise ConfigError("drill", f"{name} must be positive")
        if self.warmup_s < 0 or self.poll_s <= 0 or self.request_timeout_s <= 0:
            raise ConfigError("drill", "warmup_s must be >= 0, poll_s and timeouts positive")
        if self.slowdown < 1 or self.flag_factor <= 1:
            raise ConfigError("drill", "slowdown must be >= 1 and flag_factor > 1")
        if not 0 < self.error_rate <= 1:
            raise ConfigError("drill", "error_rate must be within (0, 1]")

    def fault_body(self) -> dict[str, Any]:
        """The engine's ``/admin/fault`` body for this fault."""
        if self.fault in ("kill", "restart"):
            return {"crash": True}
        if self.fault == "hang":
            return {"hang": True}
        if self.fault == "slow":
            return {"slowdown": self.slowdown}
        return {"error_rate": self.error_rate}


class DrillReport(msgspec.Struct, kw_only=True):
    """A drill's figures (``--json``); times in seconds, None when it did not happen."""

    fault: str
    gateway: str
    targets: list[str]  # the gateway's names of the faulted replicas
    rate_rps: float
    injected_at_s: float
    detected_after_s: float | None
    drained_after_s: float | None
    cleared_after_s: float | None  # fault held this long; None for kill
    recovered_after_s: float | None  # from clearing until healthy again
    requests: int
    completed: int
    lost: int  # failed before their first token
    streams_cut: int  # failed after tokens had reached the client
    streams_resumed: int  # went on on another replica and completed
    resumed_exact: int | None  # of those, with max_tokens in their usage (ignore_eos only)
    errors_by_kind: dict[str, int]
    in_window: int  # requests overlapping [injection, recovery or end of sending]
    share_before: float | None  # targets' share of completed requests before injection
    share_during: float | None  # ... from injection until clearing / end of sending
    max_factor_ratio: float | None  # highest target factor / its value at injection


class _Row(msgspec.Struct):
    """What a drill reads of a replica row of ``GET /admin/replicas``; a gateway answering
    another shape (another version, the wrong port) is a DrillError naming the field."""

    url: str
    name: str
    state: str
    in_flight: int = 0
    pool: str | None = None
    ttft_factor: float | None = None
    itl_factor: float | None = None


class _Replicas(msgspec.Struct):
    replicas: list[_Row]


_replicas = msgspec.json.Decoder(_Replicas)


@dataclass(slots=True)
class _Timeline:
    injected_at: float | None = None
    detected_at: float | None = None
    drained_at: float | None = None
    cleared_at: float | None = None
    recovered_at: float | None = None
    max_factor_ratio: float | None = None


class _Admin:
    """The gateway's admin API and the engines' fault API."""

    def __init__(self, session: aiohttp.ClientSession, gateway: str, token: str) -> None:
        self.session = session
        self.gateway = gateway
        self.headers = {"Authorization": f"Bearer {token}"}

    async def rows(self) -> dict[str, _Row]:
        """Every replica row keyed by its URL."""
        url = f"{self.gateway}/admin/replicas"
        try:
            async with self.session.get(url, headers=self.headers, allow_redirects=False) as resp:
                if resp.status != 200:
                    raise DrillError(
                        f"GET {url} answered {resp.status}: {await error_snippet(resp)}"
                    )
                body = await read_capped(resp, MAX_BODY_BYTES)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise DrillError(f"GET {url} failed: {_reason(exc)}") from None
        if body is None:
            raise DrillError(f"GET {url} answered over {MAX_BODY_BYTES} bytes")
        try:
            listed = _replicas.decode(body)
        except UNDECODABLE as exc:  # nested too deep included
            raise DrillError(f"GET {url}: not an isocost replica list ({exc})") from None
        return {row.url: row for row in listed.replicas}

    async def fault(self, engine: str, body: dict[str, Any]) -> None:
        url = f"{engine}/admin/fault"
        try:
            async with self.session.post(url, json=body, allow_redirects=False) as resp:
                if resp.status != 200:
                    raise DrillError(
                        f"POST {url} answered {resp.status}: {await error_snippet(resp)}"
                    )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise DrillError(f"POST {url} failed: {_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    """One line saying why: a timeout's own text is empty."""
    return " ".join((str(exc) or type(exc).__name__).split())


def _gated(
    requests: Iterable[WorkloadRequest], stop: asyncio.Event, started: asyncio.Future[float]
) -> Iterator[WorkloadRequest]:
    """``requests`` until ``stop`` is set; ``started`` gets the loop time of the first pull.

    The load generator pulls its first request right after starting its clock, so that
    time is the origin of its records' times.
    """
    loop = asyncio.get_running_loop()
    for request in requests:
        if not started.done():
            started.set_result(loop.time())
        if stop.is_set():
            return
        yield request


_FACTORS = ("ttft_factor", "itl_factor")


def _factor_ratio(row: _Row, baseline: _Row | None) -> float | None:
    """The larger of ``row``'s factors over the same factor in ``baseline``."""
    if baseline is None:
        return None
    pairs = [(getattr(row, n), getattr(baseline, n)) for n in _FACTORS]
    return max((now / then for now, then in pairs if now and then), default=None)


def _detected(fault: Fault, ratio: float | None, row: _Row, flag: float) -> bool:
    if row.state != _HEALTHY:
        return True
    return fault == "slow" and ratio is not None and ratio >= flag


def _recovered(fault: Fault, ratio: float | None, row: _Row, flag: float) -> bool:
    slow = fault == "slow" and ratio is not None and ratio >= flag
    return row.state == _HEALTHY and not slow


async def _observe(
    admin: _Admin,
    engines: list[str],
    options: DrillOptions,
    clock: Callable[[], float],
    restart: Restart | None,
) -> _Timeline:
    """Poll the admin API through the phases; inject and clear the fault on time."""
    timeline = _Timeline()
    baselines: dict[str, _Row] = {}  # each target's row at injection
    fault, flag = options.fault, options.flag_factor
    while True:
        all_rows = await admin.rows()
        now = clock()
        present = [all_rows[url] for url in engines if url in all_rows]
        ratios = [_factor_ratio(row, baselines.get(row.url)) for row in present]
        if timeline.injected_at is not None:
            seen = [r for r in ratios if r is not None]
            timeline.max_factor_ratio = max([*seen, timeline.max_factor_ratio or 0.0]) or None
        if timeline.injected_at is None:
            if now >= options.warmup_s:
                unhealthy = [row.name for row in present if row.state != _HEALTHY]
                if unhealthy or len(present) < len(engines):
                    raise DrillError(f"targets not healthy before the fault: {unhealthy}")
                baselines = {row.url: row for row in present}
                await asyncio.gather(*(admin.fault(e, options.fault_body()) for e in engines))
                timeline.injected_at = clock()
        else:
            gone = len(present) < len(engines)
            if timeline.detected_at is None and (
                gone
                or all(
                    _detected(fault, ratio, row, flag)
                    for ratio, row in zip(ratios, present, strict=True)
                )
            ):
                timeline.detected_at = now
            if (
                timeline.detected_at is not None
                and timeline.drained_at is None
                and all(row.in_flight == 0 for row in present)
            ):
                timeline.drained_at = now
            if timeline.cleared_at is None:
                if now >= timeline.injected_at + options.fault_s:
                    if fault == "kill":
                        return timeline
                    if fault == "restart":
                        assert restart is not None
                        await asyncio.gather(*(restart(e) for e in engines))
                    else:
                        await asyncio.gather(*(admin.fault(e, {}) for e in engines))
                    timeline.cleared_at = clock()
            elif not gone and all(
                _recovered(fault, ratio, row, flag)
                for ratio, row in zip(ratios, present, strict=True)
            ):
                timeline.recovered_at = now
                return timeline
            elif now >= timeline.cleared_at + options.settle_s:
                return timeline
        await asyncio.sleep(options.poll_s)


async def run_drill(
    gateway: str,
    engines: list[str],
    options: DrillOptions,
    *,
    restart: Restart | None = None,
    progress: BenchProgress | None = None,
) -> DrillReport:
    """Run one drill against ``gateway``, faulting the replicas at ``engines`` (their URLs)."""
    base = normalize_url(gateway)
    targets = [normalize_url(url) for url in engines]
    if not targets:
        raise DrillError("name at least one replica to fault (--replica-admin)")
    if options.fault == "restart" and restart is None:
        raise DrillError("a restart drill needs a way to restart the replica (--restart-command)")
    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        admin = _Admin(session, base, options.admin_token)
        rows = await admin.rows()
        unknown = [url for url in targets if url not in rows]
        if unknown:
            raise DrillError(f"not replicas of {base}: {', '.join(unknown)}")
        names = [rows[url].name for url in targets]
        model = options.model or rows[targets[0]].pool
        if model is None:
            raise DrillError(f"{base} names no model pool for {targets[0]}: pass the model")
        stop = asyncio.Event()
        started: asyncio.Future[float] = loop.create_future()
        spec = WorkloadSpec(
            synthetic=SyntheticSpec("mix", max_prompt_tokens=options.max_prompt_tokens),
            rate_rps=options.rate_rps,
            seed=options.seed,
        )
        bench_options = BenchOptions(
            model=model,
            max_tokens=options.max_tokens,
            stream=options.stream,
            ignore_eos=options.ignore_eos,
            timeout_s=options.request_timeout_s,
            api_key=options.api_key,
            label=f"drill-{options.fault}",
        )
        requests = _gated(build_workload(spec, closed_loop=False), stop, started)
        load = asyncio.create_task(run_bench(base, requests, bench_options, progress))
        try:
            either: list[asyncio.Future[Any]] = [started, load]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not started.done():
                load.result()  # the load generator failed before sending: re-raise
                raise DrillError("the load generator sent nothing")
            origin = started.result()
            timeline = await _observe(
                admin, targets, options, lambda: loop.time() - origin, restart
            )
        finally:
            stop.set()
        result = await load
    return _report(base, names, options, timeline, result.records)


def _share(records: list[BenchRecord], names: set[str]) -> float | None:
    served = [r.replica for r in records if r.ok]
    return sum(name in names for name in served) / len(served) if served else None


def _report(
    gateway: str,
    names: list[str],
    options: DrillOptions,
    timeline: _Timeline,
    records: list[BenchRecord],
) -> DrillReport:
    assert timeline.injected_at is not None
    injected = timeline.injected_at
    end = max((r.sent_s for r in records), default=injected)
    window_end = timeline.recovered_at if timeline.recovered_at is not None else end
    failed = [r for r in records if not r.ok]
    in_window = [
        r for r in records if r.sent_s <= window_end and (r.end_s is None or r.end_s >= injected)
    ]
    during_end = timeline.cleared_at if timeline.cleared_at is not None else end
    target_names = set(names)
    resumed = [r for r in records if r.ok and r.resumed]

    def after(at: float | None) -> float | None:
        return None if at is None else round(at - injected, 3)

    return DrillReport(
        fault=options.fault,
        gateway=gateway,
        targets=names,
        rate_rps=options.rate_rps,
        injected_at_s=round(injected, 3),
        detected_after_s=after(timeline.detected_at),
        drained_after_s=after(timeline.drained_at),
        cleared_after_s=after(timeline.cleared_at),
        recovered_after_s=None
        if timeline.recovered_at is None or timeline.cleared_at is None
        else round(timeline.recovered_at - timeline.cleared_at, 3),
        requests=len(records),
        completed=len(records) - len(failed),
        lost=sum(r.first_token_s is None for r in failed),
        streams_cut=sum(r.first_token_s is not None for r in failed),
        streams_resumed=len(resumed),
        resumed_exact=sum(r.output_tokens == r.max_tokens for r in resumed)
        if options.ignore_eos
        else None,
        errors_by_kind=dict(Counter(r.error_kind or "" for r in failed)),
        in_window=len(in_window),
        share_before=_share([r for r in records if r.sent_s < injected], target_names),
        share_during=_share(
            [r for r in records if injected <= r.sent_s <= during_end], target_names
        ),
        max_factor_ratio=None
        if timeline.max_factor_ratio is None
        else round(timeline.max_factor_ratio, 3),
    )
