"""``isocost drill`` for the CLI: a live view while it runs, then a table or JSON."""

from __future__ import annotations

import asyncio
import shlex
import subprocess

import msgspec
from rich.console import Console
from rich.live import Live
from rich.table import Table

from isocost.bench import BenchProgress, live_table
from isocost.drill._drill import DrillError, DrillOptions, DrillReport, Restart, run_drill

__all__ = ["drill_command", "drill_table"]


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _resumed(report: DrillReport) -> str:
    if report.resumed_exact is None:
        return str(report.streams_resumed)
    return f"{report.streams_resumed} ({report.resumed_exact} with exactly max_tokens)"


def drill_table(report: DrillReport) -> Table:
    """One row per figure of ``report``."""
    table = Table(title=f"drill: {report.fault} {', '.join(report.targets)}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    errors = ", ".join(f"{k} {v}" for k, v in sorted(report.errors_by_kind.items())) or "none"
    rows = [
        ("load", f"{report.rate_rps:g} req/s, {report.requests} requests"),
        ("detected after", _seconds(report.detected_after_s)),
        ("drained after", _seconds(report.drained_after_s)),
        ("fault held", "-" if report.cleared_after_s is None else _seconds(report.cleared_after_s)),
        (
            "recovered after clearing",
            "-" if report.cleared_after_s is None else _seconds(report.recovered_after_s),
        ),
        ("completed", str(report.completed)),
        ("lost (failed before first token)", str(report.lost)),
        ("streams cut (failed mid-stream)", str(report.streams_cut)),
        ("streams resumed on another replica", _resumed(report)),
        ("errors", errors),
        ("requests in the fault window", str(report.in_window)),
        (
            "targets' share before / during",
            f"{_share(report.share_before)} / {_share(report.share_during)}",
        ),
        (
            "correction factor vs before (max)",
            "-" if report.max_factor_ratio is None else f"{report.max_factor_ratio:.2f}x",
        ),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _restart_hook(command: str) -> Restart:
    """Run ``command`` (the replica's start command) in its own session and leave it running."""
    argv = shlex.split(command)
    started: list[subprocess.Popen[bytes]] = []  # kept: the replica outlives the drill

    async def restart(_: str) -> None:
        try:
            started.append(
                subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        except OSError as exc:
            raise DrillError(f"--restart-command failed: {exc}") from None

    return restart


def drill_command(
    gateway: str,
    engines: list[str],
    options: DrillOptions,
    console: Console,
    *,
    restart_command: str | None,
    json_out: bool,
) -> DrillReport:
    """Run the drill with a live view; print a table, or the report as JSON."""
    restart = _restart_hook(restart_command) if restart_command else None
    progress = BenchProgress()
    with Live(
        get_renderable=lambda: live_table(progress),
        console=Console(stderr=True),  # stdout stays clean for --json
        refresh_per_second=4,
        transient=True,
    ):
        report = asyncio.run(
            run_drill(gateway, engines, options, restart=restart, progress=progress)
        )
    if json_out:
        console.print_json(msgspec.json.encode(report).decode())
    else:
        console.print(drill_table(report))
    return report
