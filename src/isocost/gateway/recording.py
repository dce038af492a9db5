"""The gateway's side of recording (``isocost serve --record DIR``, the admin API).

``Recording`` owns at most one running ``isocost.runtime.recording.Recorder``: it starts
and stops it, keeps it told what the fleet looks like (every second, from the event
loop, so the writer thread never reads the gateway's state), turns each finished request
into its trace line, and keeps the totals the metrics export across recorders.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isocost.runtime.recording import (
    FleetFile,
    RecordedRequest,
    Recorder,
    recorded_hash_ids,
    usable_directory,
)

if TYPE_CHECKING:
    from isocost.gateway.proxy import ForwardResult
    from isocost.gateway.routing import GatewayRequest

__all__ = ["Recording", "RecordingSettings", "trace_line"]

log = logging.getLogger("isocost.gateway")

_FLEET_PERIOD_S = 1.0
_MASK = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class RecordingSettings:
    directory: Path | None = None  # where ``--record`` (or an admin start without one) writes
    segment_bytes: int = 64 << 20
    max_bytes: int = 1 << 30


class Recording:
    """Start, stop and feed the recorder; ``record`` is the only hot-path call."""

    def __init__(
        self, settings: RecordingSettings, fleet: Callable[[], FleetFile], block_tokens: int
    ) -> None:
        self.settings = settings
        self._fleet = fleet
        self._block_tokens = block_tokens
        self.recorder: Recorder | None = None
        self._task: asyncio.Task[None] | None = None
        self._done = {"recorded": 0, "dropped": 0, "errors": 0}  # of stopped recorders
        self._sequence = 0

    @property
    def active(self) -> bool:
        return self.recorder is not None and self.recorder.active

    async def start(self, directory: Path | None = None) -> Recorder:
        """Record into ``directory`` (default: the configured one), stopping a running
        recording first; ValueError when no directory is known, or when it cannot be
        written (counted as an error; the running recording, if any, goes on)."""
        directory = directory or self.settings.directory
        if directory is None:
            raise ValueError("no recording directory: give one (or start with --record DIR)")
        try:
            await asyncio.to_thread(usable_directory, directory)
        except ValueError:
            self._done["errors"] += 1
            raise
        await self.stop()
        recorder = Recorder(
            directory,
            segment_bytes=self.settings.segment_bytes,
            max_bytes=self.settings.max_bytes,
        )
        recorder.set_fleet(self._fleet())
        recorder.start()
        self.recorder = recorder
        self._task = asyncio.get_running_loop().create_task(self._follow_fleet(recorder))
        log.info("recording", extra={"event": "recording_started", "dir": str(directory)})
        return recorder

    async def stop(self) -> None:
        """Write what is queued and stop."""
        recorder, self.recorder = self.recorder, None
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if recorder is None:
            return
        recorder.set_fleet(self._fleet())
        await asyncio.to_thread(recorder.stop)
        for name in self._done:
            self._done[name] += getattr(recorder, name)
        log.info(
            "recording stopped",
            extra={"event": "recording_stopped", "dir": str(recorder.directory)},
        )

    def total(self, name: str) -> float:
        """``recorded``, ``dropped`` or ``errors`` over every recorder of this gateway."""
        running = getattr(self.recorder, name) if self.recorder is not None else 0
        return float(self._done[name] + running)

    def status(self) -> dict[str, Any]:
        recorder = self.recorder
        return {
            "active": self.active,
            "dir": str(recorder.directory if recorder else self.settings.directory or "") or None,
            "recorded": int(self.total("recorded")),
            "dropped": int(self.total("dropped")),
            "errors": int(self.total("errors")),
            "error": recorder.error if recorder else None,
        }

    async def _follow_fleet(self, recorder: Recorder) -> None:
        while recorder.active:
            await asyncio.sleep(_FLEET_PERIOD_S)
            recorder.set_fleet(self._fleet())

    def record(self, request: GatewayRequest, result: ForwardResult, e2e_s: float) -> None:
        """Queue one finished request's trace line (nothing when not recording)."""
        recorder = self.recorder
        if recorder is None or not recorder.active:
            return
        self._sequence += 1
        recorder.record(
            trace_line(
                request,
                result,
                e2e_s,
                salt=recorder.salt,
                timestamp_ms=recorder.timestamp_ms(request.arrived_at),
                unique=self._sequence,
                block_tokens=self._block_tokens,
            )
        )


def trace_line(
    request: GatewayRequest,
    result: ForwardResult,
    e2e_s: float,
    *,
    salt: int,
    timestamp_ms: float,
    unique: int,
    block_tokens: int,
) -> RecordedRequest:
    """One finished request as a recording's line: ids salted with ``salt`` (stable within
    one recording), ``unique`` telling its unshared blocks apart. The recorder and the
    shadow window (``gateway.shadow``) both build their lines here."""
    view, arrived_at = request.view, request.arrived_at
    session, deadline_at = request.session_key, request.deadline_at
    tpot_s, ttft_s = request.tpot_target_s, result.ttft_s
    return RecordedRequest(
        timestamp=timestamp_ms,
        input_length=view.prompt_tokens,
        output_length=max(1, result.output_tokens or view.max_tokens or 1),
        hash_ids=recorded_hash_ids(
            view.block_hashes, block_tokens, view.prompt_tokens, salt, unique
        ),
        model=request.pool.model,
        session_id=None if session is None else f"{hash((salt, session)) & _MASK:x}",
        route_class=request.route_class,
        priority=request.priority,
        deadline_ms=None if deadline_at is None else _ms(deadline_at - arrived_at),
        tpot_ms=None if tpot_s is None else _ms(tpot_s),
        stream=view.stream,
        max_tokens=view.max_tokens,
        status=result.status,
        replica=result.replica.name if result.replica else None,
        output_tokens=result.output_tokens,
        ttft_ms=None if ttft_s is None else _ms(ttft_s),
        e2e_ms=_ms(e2e_s),
    )


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)
