"""The two commands behind ``isocost bench``: a run, and a comparison of runs."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec
from rich.console import Console
from rich.live import Live

from isocost.bench._report import (
    compare_table,
    live_table,
    load_summary,
    plot_comparison,
    summary_table,
)
from isocost.bench._runner import BenchOptions, BenchProgress, BenchResult, run_bench
from isocost.bench._workloads import WorkloadSpec, build_workload
from isocost.core.errors import ConfigError
from isocost.workload import WorkloadRequest

__all__ = ["bench_command", "compare_command", "run_with_live_view"]


def bench_command(
    url: str | Sequence[str],
    spec: WorkloadSpec,
    options: BenchOptions,
    console: Console,
    records_path: str | None = None,
    json_path: str | None = None,
) -> BenchResult:
    """Run, with a live view; print the summary and write ``--records`` / ``--json``."""
    endless = spec.synthetic is not None and spec.synthetic.name == "mix"
    if endless and options.max_requests is None and options.duration_s is None:
        raise ConfigError("bench", "--workload mix is endless: give --max-requests or --duration")
    requests = build_workload(spec, closed_loop=options.concurrency is not None)
    result, stopped = run_with_live_view(url, requests, options, console)
    if stopped:
        console.print("stopped by Ctrl-C: the summary covers the requests sent until then")
    console.print(summary_table(result.summary))
    if records_path is not None:
        encoder = msgspec.json.Encoder()
        _write(records_path, b"".join(encoder.encode(r) + b"\n" for r in result.records))
    if json_path is not None:
        _write(json_path, msgspec.json.format(msgspec.json.encode(result.summary)))
    return result


def _write(path: str, data: bytes) -> None:
    """Write ``data``; a ConfigError naming the file if it cannot be written (the CLI
    checks its paths before the run, so this is a disk that filled or changed since)."""
    try:
        Path(path).write_bytes(data)
    except OSError as exc:
        raise ConfigError(path, exc.strerror or "cannot be written") from None


def run_with_live_view(
    url: str | Sequence[str],
    requests: Iterable[WorkloadRequest],
    options: BenchOptions,
    console: Console,
) -> tuple[BenchResult, bool]:
    """``run_bench`` under a live progress table; the result, and whether Ctrl-C stopped it."""
    progress = BenchProgress()
    with Live(
        get_renderable=lambda: live_table(progress),
        console=console,
        refresh_per_second=4,
        transient=True,
    ):
        return asyncio.run(_run_until_interrupted(url, requests, options, progress))


async def _run_until_interrupted(
    url: str | Sequence[str],
    requests: Iterable[WorkloadRequest],
    options: BenchOptions,
    progress: BenchProgress,
) -> tuple[BenchResult, bool]:
    """``run_bench`` where Ctrl-C stops the run instead of killing it; and whether it did."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    try:
        return await run_bench(url, requests, options, progress, stop), stop.is_set()
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def compare_command(paths: Sequence[str], console: Console, plot_path: str | None) -> None:
    """Runs side by side; ``plot_path`` also gets latency CDFs and goodput bars."""
    summaries = [load_summary(p) for p in paths]
    console.print(compare_table(summaries))
    if plot_path is not None:
        plot_comparison(summaries, plot_path)
        console.print(f"plot written to {plot_path}")
