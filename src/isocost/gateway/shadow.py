"""Shadow policy evaluation (#25): a pool's candidate policies, judged on live traffic.

A pool's ``shadow`` names candidate policies. Each final decision of the running policy
(ADMIT or REJECT) is shadowed by every candidate's, on the same request and the same
replica states (``Router._shadow``), and never acted on; the candidates get the shadow
hooks of the real dispatches and ends, so their state is the real cluster's. Agreement
(same outcome, same replica) is counted in ``isocost_shadow_decisions_total``.

What a candidate *would* have done to latency needs a replay: the pool keeps a window of
its finished requests (the last ``window_s`` seconds, at most ``max_requests``) as
recording lines (``recording.trace_line``, the recorder's own), and every ``interval_s``
writes them with the fleet through the recorder's writer into a temporary directory and
runs ``isocost sim --from-record`` on it in a subprocess (niced, ``timeout_s``, one replay
at a time across the gateway), with the running policy and the candidates. Each
candidate is compared with the *replay* of the running policy, not with the live figures:
both then carry the twin's own bias, which the ratio cancels. A replay that fails or runs
out of time is a log line and ``isocost_shadow_replays_total{outcome="failed"}``; a window
with fewer than ``min_requests`` is skipped. Requests never wait on any of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from isocost.core.jsontext import UNDECODABLE
from isocost.gateway.metrics import GatewayMetrics
from isocost.gateway.recording import trace_line
from isocost.gateway.supervise import describe
from isocost.runtime.config import GatewayConfig, ShadowConfig, SloConfig
from isocost.runtime.processes import dies_with
from isocost.runtime.recording import (
    FleetFile,
    RecordedRequest,
    monotonic_epoch_s,
    unix_timestamp_ms,
    write_recording,
)

if TYPE_CHECKING:
    from isocost.gateway.proxy import ForwardResult
    from isocost.gateway.routing import GatewayRequest, Router

__all__ = [
    "ISOCOST_COMMAND",
    "CandidateChange",
    "ReplayFailed",
    "ReplayResult",
    "Shadow",
    "ShadowWindow",
    "predicted_changes",
    "run_replay",
]

log = logging.getLogger("isocost.gateway")

ISOCOST_COMMAND = (sys.executable, "-m", "isocost")  # the simulator of this very install
_NICENESS = 10
_WRITE_TIMEOUT_S = 30.0


class ReplayFailed(Exception):
    """The replay could not run or its output could not be read (the message says why)."""


@dataclass(frozen=True, slots=True)
class CandidateChange:
    """One candidate against the running policy, both replayed: candidate / running - 1
    (None where the running policy's figure is 0 or either is missing)."""

    policy: str
    ttft_p99: float | None
    goodput: float | None


@dataclass(frozen=True, slots=True)
class ReplayResult:
    at_s: float  # monotonic seconds the replay finished
    took_s: float  # from writing the window to reading the simulator's answer
    requests: int  # in the window it replayed
    running: str
    changes: tuple[CandidateChange, ...]


class ShadowWindow:
    """Recording lines of the requests finished in the last ``window_s`` seconds, the
    latest ``max_requests`` at most."""

    def __init__(self, window_s: float, max_requests: int) -> None:
        self.window_s = window_s
        self._lines: deque[tuple[float, RecordedRequest]] = deque(maxlen=max_requests)

    def __len__(self) -> int:
        return len(self._lines)

    def add(self, finished_s: float, line: RecordedRequest) -> None:
        self._lines.append((finished_s, line))

    def recent(self, now: float) -> list[RecordedRequest]:
        """The lines still in the window at ``now`` (older ones are forgotten)."""
        while self._lines and self._lines[0][0] < now - self.window_s:
            self._lines.popleft()
        return [line for _, line in self._lines]

    def resized(self, window_s: float, max_requests: int) -> ShadowWindow:
        """This window's lines under new bounds (a reload keeps what it holds)."""
        window = ShadowWindow(window_s, max_requests)
        window._lines.extend(self._lines)
        return window


def predicted_changes(
    rows: Sequence[Mapping[str, Any]], running: str, candidates: Iterable[str]
) -> tuple[CandidateChange, ...]:
    """Each candidate's change from ``isocost sim --json``'s rows (one per policy);
    ReplayFailed when a policy's row is missing."""
    by_policy = {row.get("policy"): row for row in rows}
    missing = [p for p in (running, *candidates) if p not in by_policy]
    if missing:
        raise ReplayFailed(f"the replay has no result for {', '.join(missing)}")
    base = by_policy[running]
    return tuple(
        CandidateChange(
            policy,
            _change(by_policy[policy].get("ttft_p99_s"), base.get("ttft_p99_s")),
            _change(by_policy[policy].get("goodput_rps"), base.get("goodput_rps")),
        )
        for policy in candidates
    )


def _change(candidate: object, running: object) -> float | None:
    if not isinstance(candidate, int | float) or not isinstance(running, int | float):
        return None
    if running == 0 or not math.isfinite(candidate) or not math.isfinite(running):
        return None
    return round(candidate / running - 1, 4)


def _slo_args(slo: SloConfig | None) -> list[str]:
    """The pool's SLO as the simulator's flags (goodput counts against it)."""
    if slo is None:
        return []
    args = ["--slo-ttft-per-1k-ms", f"{slo.ttft_per_1k_ms:g}"]
    if slo.ttft_ms is not None:
        args += ["--slo-ttft-ms", f"{slo.ttft_ms:g}"]
    if slo.tpot_ms is not None:
        args += ["--slo-tpot-ms", f"{slo.tpot_ms:g}"]
    return args


async def run_replay(
    lines: Sequence[RecordedRequest],
    fleet: FleetFile,
    pool: str,
    policies: Sequence[str],
    timeout_s: float,
    *,
    slo: SloConfig | None = None,
    command: Sequence[str] = ISOCOST_COMMAND,
) -> list[dict[str, Any]]:
    """``isocost sim --from-record`` of ``lines`` and ``fleet`` (pool ``pool``) with
    ``policies``, in a niced subprocess killed after ``timeout_s``: its JSON rows.
    ReplayFailed on any failure; the event loop never waits on the work."""
    with tempfile.TemporaryDirectory(prefix="isocost-shadow-") as scratch:
        directory, out = Path(scratch) / "recording", Path(scratch) / "replay.json"
        try:
            await asyncio.to_thread(write_recording, directory, lines, fleet, _WRITE_TIMEOUT_S)
        except OSError as exc:
            raise ReplayFailed(f"cannot write the window: {exc}") from None
        args = ["sim", "--from-record", str(directory), "--pool", pool, "--jobs", "1"]
        args += ["--policies", ",".join(policies), "--json", str(out), *_slo_args(slo)]
        try:
            process = await asyncio.create_subprocess_exec(
                *command,
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                preexec_fn=dies_with(os.getpid()),
            )
        except OSError as exc:
            raise ReplayFailed(f"cannot start the simulator: {exc}") from None
        with contextlib.suppress(OSError):  # it may have exited already
            os.setpriority(os.PRIO_PROCESS, process.pid, _NICENESS)
        try:
            _, stderr = await asyncio.wait_for(process.communicate(), timeout_s)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise ReplayFailed(f"the replay ran past its time limit ({timeout_s:g} s)") from None
        except asyncio.CancelledError:
            process.kill()
            await process.wait()
            raise
        if process.returncode != 0:
            said = stderr.decode(errors="replace").strip().splitlines()
            reason = said[-1] if said else "no message"
            raise ReplayFailed(f"the simulator exited {process.returncode}: {reason}")
        try:
            rows = msgspec.json.decode(out.read_bytes(), type=list[dict[str, Any]])
        except (OSError, *UNDECODABLE, msgspec.ValidationError) as exc:  # too deep included
            raise ReplayFailed(f"unreadable replay output: {exc}") from None
    return rows


@dataclass(slots=True)
class _PoolShadow:
    """One pool's shadow: its settings, window, replay task and latest results."""

    settings: ShadowConfig
    slo: SloConfig | None
    window: ShadowWindow
    task: asyncio.Task[None] | None = None
    result: ReplayResult | None = None  # the latest replay that succeeded
    outcome: str | None = None  # of the latest replay: ok, failed, skipped
    outcome_at_s: float | None = None
    error: str | None = None  # why the latest replay failed or was skipped
    outcomes: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0, "skipped": 0})


class Shadow:
    """Every pool's shadow evaluation; ``record`` is the only hot-path call."""

    def __init__(
        self,
        router: Router,
        metrics: GatewayMetrics,
        fleet: Callable[[], FleetFile],
        block_tokens: int,
        *,
        command: Sequence[str] = ISOCOST_COMMAND,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._router = router
        self._metrics = metrics
        self._fleet = fleet
        self._block_tokens = block_tokens
        self._command = tuple(command)
        self._clock = clock
        self._pools: dict[str, _PoolShadow] = {}
        self._one_at_a_time = asyncio.Lock()
        self._salt = int.from_bytes(os.urandom(8))  # the windows' ids, like a recording's
        self._epoch_s = monotonic_epoch_s()
        self._sequence = 0

    def configure(self, config: GatewayConfig) -> None:
        """Follow ``config``'s pools: start, restart (changed settings) or stop each
        pool's replays. A pool's window and replay counts outlive a change of its
        settings, its latest predictions one that keeps its candidates."""
        wanted = {pool.model: pool for pool in config.pools if pool.shadow is not None}
        for model in [m for m in self._pools if m not in wanted]:
            self._forget(model, self._pools.pop(model))
        for model, pool_config in wanted.items():
            settings = pool_config.shadow
            assert settings is not None
            current = self._pools.get(model)
            if current is None:
                shadow = _PoolShadow(
                    settings,
                    pool_config.slo,
                    ShadowWindow(settings.window_s, settings.max_requests),
                )
            elif (current.settings, current.slo) == (settings, pool_config.slo):
                continue
            else:
                self._stop(current)
                window = current.window.resized(settings.window_s, settings.max_requests)
                shadow = _PoolShadow(settings, pool_config.slo, window, outcomes=current.outcomes)
                if settings.policies == current.settings.policies:
                    shadow.result = current.result
                else:
                    self._forget(model, current)
            shadow.task = asyncio.get_running_loop().create_task(
                self._replay_every(model, shadow), name=f"shadow:{model}"
            )
            self._pools[model] = shadow

    async def stop(self) -> None:
        tasks = [s.task for s in self._pools.values() if s.task is not None]
        for shadow in self._pools.values():
            self._stop(shadow)
        await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    def _stop(shadow: _PoolShadow) -> None:
        if shadow.task is not None:
            shadow.task.cancel()
            shadow.task = None

    def _forget(self, model: str, shadow: _PoolShadow) -> None:
        """Stop ``shadow``'s replays and drop its predictions' series (stale from now on)."""
        self._stop(shadow)
        for change in shadow.result.changes if shadow.result else ():
            for metric in ("ttft_p99", "goodput"):
                with contextlib.suppress(KeyError):
                    self._metrics.shadow_change.remove(model, change.policy, metric)

    def record(self, request: GatewayRequest, result: ForwardResult, e2e_s: float) -> None:
        """Keep one finished request in its pool's window (nothing without a shadow)."""
        shadow = self._pools.get(request.pool.model)
        if shadow is None:
            return
        self._sequence += 1
        line = trace_line(
            request,
            result,
            e2e_s,
            salt=self._salt,
            timestamp_ms=unix_timestamp_ms(request.arrived_at, self._epoch_s),
            unique=self._sequence,
            block_tokens=self._block_tokens,
        )
        shadow.window.add(request.arrived_at + e2e_s, line)

    async def _replay_every(self, model: str, shadow: _PoolShadow) -> None:
        while True:
            await asyncio.sleep(shadow.settings.interval_s)
            await self.replay(model)

    async def replay(self, model: str) -> str:
        """Replay ``model``'s window now (after any replay running): ok, failed or skipped."""
        async with self._one_at_a_time:
            shadow, running = self._pools.get(model), self._running_policy(model)
            if shadow is None or running is None:  # the pool went while this waited
                return "skipped"
            settings = shadow.settings
            candidates = [c for c in settings.policies if c != running]
            lines = shadow.window.recent(self._clock())
            if len(lines) < settings.min_requests or not candidates:
                outcome = "skipped"
                shadow.error = (
                    f"{len(lines)} requests in the window, fewer than {settings.min_requests}"
                    if candidates
                    else f"every candidate is the running policy {running}"
                )
            else:
                outcome = await self._run(model, shadow, lines, running, candidates)
            shadow.outcome, shadow.outcome_at_s = outcome, self._clock()
            shadow.outcomes[outcome] += 1
            self._metrics.shadow_replays.labels(outcome).inc()
            return outcome

    def _running_policy(self, model: str) -> str | None:
        policy = self._router.policies.get(model)
        return None if policy is None else policy.name

    async def _run(
        self,
        model: str,
        shadow: _PoolShadow,
        lines: list[RecordedRequest],
        running: str,
        candidates: list[str],
    ) -> str:
        settings, started_s = shadow.settings, self._clock()
        try:
            rows = await run_replay(
                lines,
                self._fleet(),
                model,
                [running, *candidates],
                settings.timeout_s,
                slo=shadow.slo,
                command=self._command,
            )
            changes = predicted_changes(rows, running, candidates)
        except ReplayFailed as exc:
            shadow.error = str(exc)
            log.warning(
                "shadow replay failed",
                extra={"event": "shadow_replay_failed", "pool": model, "error": describe(exc)},
            )
            return "failed"
        shadow.error = None
        now = self._clock()
        shadow.result = ReplayResult(now, round(now - started_s, 2), len(lines), running, changes)
        gauge = self._metrics.shadow_change
        for change in changes:
            for metric, value in (("ttft_p99", change.ttft_p99), ("goodput", change.goodput)):
                gauge.labels(model, change.policy, metric).set(math.nan if value is None else value)
        return "ok"

    def status(self, now: float) -> dict[str, Any]:
        """By pool: the running policy, each candidate's agreement and the latest
        replay's predicted changes, and how the replays went (the admin snapshot)."""
        out: dict[str, Any] = {}
        for model, shadow in self._pools.items():
            result = shadow.result
            changes = {c.policy: c for c in result.changes} if result else {}
            candidates = []
            for name in shadow.settings.policies:
                agree = self._router.agreement[model, name, True]
                total = agree + self._router.agreement[model, name, False]
                change = changes.get(name)
                candidates.append(
                    {
                        "policy": name,
                        "decisions": total,
                        "agreement": round(agree / total, 4) if total else None,
                        "ttft_p99_change": None if change is None else change.ttft_p99,
                        "goodput_change": None if change is None else change.goodput,
                    }
                )
            out[model] = {
                "running": self._running_policy(model),
                "interval_s": shadow.settings.interval_s,
                "window_requests": len(shadow.window),
                "candidates": candidates,
                "replay": None
                if result is None
                else {
                    "running": result.running,
                    "requests": result.requests,
                    "took_s": result.took_s,
                    "age_s": round(now - result.at_s, 1),
                },
                "last_outcome": shadow.outcome,
                "last_outcome_age_s": None
                if shadow.outcome_at_s is None
                else round(now - shadow.outcome_at_s, 1),
                "last_error": shadow.error,
                "replays": dict(shadow.outcomes),
            }
        return out
