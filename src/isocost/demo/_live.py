"""What the terminal shows while a policy's run goes: progress, the load generator's
counters, and each replica's load as the gateway's admin snapshot reports it."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from isocost.bench import BenchProgress
from isocost.bench._report import live_table

__all__ = ["LiveState", "poll_snapshot", "render"]

_POLL_S = 0.5


@dataclass(slots=True)
class LiveState:
    """The latest figures of a run, shared by the poller and the renderer."""

    policy: str
    duration_s: float
    loop: asyncio.AbstractEventLoop
    started_at: float
    progress: BenchProgress = field(default_factory=BenchProgress)
    snapshot: dict[str, Any] | None = None

    @property
    def elapsed_s(self) -> float:
        return self.loop.time() - self.started_at


async def poll_snapshot(url: str, token: str, state: LiveState) -> None:
    """Keep ``state.snapshot`` fresh from ``GET /admin/snapshot`` until cancelled."""
    headers = {"Authorization": f"Bearer {token}"}
    timeout = aiohttp.ClientTimeout(total=2.0)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, msgspec.DecodeError):
                async with session.get(url + "/admin/snapshot") as response:
                    if response.status == 200:
                        state.snapshot = msgspec.json.decode(await response.read())
            await asyncio.sleep(_POLL_S)


def _fmt(value: float | None, spec: str = ".0f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _replicas_table(snapshot: dict[str, Any]) -> Table:
    table = Table(
        "replica",
        "gpu",
        "state",
        "in\nflight",  # headers one word a line: the view fits 80 columns
        "run",
        "wait",
        "KV",
        "TTFT\nfactor",
        "TTFT\np50 ms",
        title="replicas (gateway admin snapshot; red: engine queue)",
        title_justify="left",
    )
    for row in snapshot["replicas"]:
        kv = row["kv_usage"]
        style = "red" if (row["engine_waiting"] or 0) > 0 else None
        table.add_row(
            row["name"],
            row["gpu"],
            row["state"],
            str(row["in_flight"]),
            _fmt(row["engine_running"]),
            _fmt(row["engine_waiting"]),
            _fmt(None if kv is None else kv * 100, ".0f", "%"),
            _fmt(row["ttft_factor"], ".2f"),
            _fmt(row["recent_ttft_p50_ms"]),
            style=style,
        )
    return table


def render(state: LiveState) -> RenderableType:
    """The whole live view of one run."""
    elapsed_s = min(state.elapsed_s, state.duration_s)
    progress = state.progress
    if elapsed_s < state.duration_s:
        phase = f"sending {elapsed_s:4.0f} / {state.duration_s:.0f} s"
    else:
        in_flight = progress.sent - progress.done - progress.errors
        phase = f"arrivals over, waiting for {in_flight} in flight"
    header = Table.grid(padding=(0, 2))
    header.add_row(
        Text.assemble(("policy ", "bold"), (state.policy, "bold cyan")),
        ProgressBar(total=state.duration_s, completed=elapsed_s, width=40),
        phase,
    )
    parts: list[RenderableType] = [header, live_table(progress)]
    if state.snapshot is not None:
        parts.append(_replicas_table(state.snapshot))
    return Group(*parts)
