"""Results as a Rich table, as JSON, and a progress bar over simulated time.

The JSON holds only what the simulation determines (no wall-clock figures), so the same
inputs and seed give byte-identical files; speed (simulated seconds per wall second)
appears in the table only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from isocost.core.errors import ConfigError
from isocost.sim._metrics import PolicySummary
from isocost.sim._run import Progress as ProgressCallback
from isocost.sim._run import RunOutput, SimPlan, SweepOutput, run_plan
from isocost.workload import mean_rate_rps

__all__ = ["json_rows", "print_results", "progress_bar", "sim_command", "write_json"]


def json_rows(output: SweepOutput) -> list[dict[str, Any]]:
    """One object per run (policy, and ``rate_rps`` in sweeps), then the oracle.

    Floats keep 12 significant digits: sampling load for ``--plot`` splits engines'
    decode jumps, which sums busy time in another order and moves its last bits.
    """
    rows: list[dict[str, Any]] = []
    for run in output.runs:
        row: dict[str, Any] = dataclasses.asdict(run.summary)
        row["rate_rps"] = run.rate_rps
        if run.rate_rps is not None:
            row["capacity_at_slo_rps"] = output.capacity_rps.get(run.summary.policy)
        rows.append(row)
    oracle: dict[str, Any] = dataclasses.asdict(output.oracle)
    oracle["rate_rps"] = None
    rows.append(oracle)
    return [{k: _rounded(v) for k, v in row.items()} for row in rows]


def _rounded(value: Any) -> Any:
    return float(f"{value:.12g}") if isinstance(value, float) else value


def write_json(output: SweepOutput, path: str) -> None:
    data = msgspec.json.format(msgspec.json.encode(json_rows(output)), indent=2)
    try:
        Path(path).write_bytes(data + b"\n")
    except OSError as exc:
        raise ConfigError(path, exc.strerror or "cannot be written") from None


def print_results(console: Console, output: SweepOutput, target: float) -> None:
    table = Table(title="isocost sim", title_justify="left")
    columns = (
        "policy", "rate", "done", "rej", "TTFT p50", "p90", "p99", "TPOT p50", "p99",
        "E2E p50", "p99", "goodput/s", "SLO %", "out tok/s", "hit %", "imbal", "slowdn",
        "sim s/s",
    )  # fmt: skip
    sweep = any(run.rate_rps is not None for run in output.runs)
    for name in columns:
        if name != "rate" or sweep:
            table.add_column(name, justify="left" if name == "policy" else "right")
    for run in output.runs:
        table.add_row(*_cells(run.summary, run.rate_rps, run, sweep))
    table.add_row(*_cells(output.oracle, None, None, sweep), style="dim")
    console.print(table)
    if sweep:
        capacity = Table(title=f"capacity at SLO ({target:.0%} of requests meet both)")
        capacity.add_column("policy")
        capacity.add_column("highest rate req/s", justify="right")
        for policy, rate in output.capacity_rps.items():
            capacity.add_row(policy, "below sweep" if rate is None else f"{rate:g}")
        console.print(capacity)


def _cells(s: PolicySummary, rate: float | None, run: RunOutput | None, sweep: bool) -> list[str]:
    return [
        s.policy,
        *([("" if rate is None else f"{rate:g}")] if sweep else []),
        str(s.completed),
        str(s.rejected),
        *(_s(v) for v in (s.ttft_p50_s, s.ttft_p90_s, s.ttft_p99_s)),
        *(_ms(v) for v in (s.tpot_p50_s, s.tpot_p99_s)),
        *(_s(v) for v in (s.e2e_p50_s, s.e2e_p99_s)),
        f"{s.goodput_rps:.2f}",
        f"{100 * s.slo_attainment:.1f}",
        f"{s.output_tokens_per_s:,.0f}",
        "-" if s.prefix_hit_rate is None else f"{100 * s.prefix_hit_rate:.1f}",
        "-" if s.imbalance_cov is None else f"{s.imbalance_cov:.3f}",
        "-" if s.mean_slowdown is None else f"{s.mean_slowdown:.2f}",
        "" if run is None else f"{run.sim_s_per_wall_s:,.0f}",
    ]


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.0f}ms"


@contextmanager
def progress_bar(console: Console, bars: Sequence[tuple[str, float]]) -> Iterator[ProgressCallback]:
    """A bar per run over simulated time, each up to its last arrival (label, seconds)."""
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[at]}"))
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=True) as bar:
        tasks = [(bar.add_task(label, total=max(end, 1e-9), at=""), end) for label, end in bars]

        def update(task: int, now: float) -> None:
            task_id, end = tasks[task]
            bar.update(task_id, completed=min(now, end), at=f"t={now:,.0f}s")

        yield update


def sim_command(
    console: Console, plan: SimPlan, json_path: str | None, plot_path: str | None
) -> SweepOutput:
    """Run ``plan`` under a progress bar, print the tables, write JSON and the plot."""
    rates: tuple[float | None, ...] = plan.rates_rps or (None,)
    last_s = max(r.arrival_s for r in plan.requests)
    base_rps = mean_rate_rps(plan.requests) if plan.rates_rps else 1.0
    bars = [
        (policy, last_s) if rate is None else (f"{policy} @ {rate:g}/s", last_s * base_rps / rate)
        for policy in plan.policies
        for rate in rates
    ]
    with progress_bar(console, bars) as update:
        output = run_plan(plan, update)
    print_results(console, output, plan.slo.share)
    if json_path is not None:
        write_json(output, json_path)
        console.print(f"wrote {json_path}", highlight=False)
    if plot_path is not None:
        from isocost.sim._plots import write_plot

        write_plot(output, plot_path)
        console.print(f"wrote {plot_path}", highlight=False)
    return output
