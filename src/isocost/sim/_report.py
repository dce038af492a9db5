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
from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from isocost.core.errors import ConfigError
from isocost.sim._audit import audit_table
from isocost.sim._metrics import PolicySummary
from isocost.sim._run import Progress as ProgressCallback
from isocost.sim._run import RunOutput, SimPlan, SweepOutput, run_plan
from isocost.tables import Fitted
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
        if run.audit is not None:
            row["admission_audit"] = {k: _rounded(v) for k, v in run.audit.json_fields().items()}
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


# (name, header in the full layout, where each "p99" follows its "TTFT p50", header in
# the narrow ones, one word a line)
_COLUMNS = (
    ("policy", "policy", "policy"),
    ("rate", "rate", "rate"),
    ("done", "done", "done"),
    ("rej", "rej", "rej"),
    ("TTFT p50", "TTFT p50", "TTFT\np50"),
    ("TTFT p90", "p90", "TTFT\np90"),
    ("TTFT p99", "p99", "TTFT\np99"),
    ("TPOT p50", "TPOT p50", "TPOT\np50"),
    ("TPOT p99", "p99", "TPOT\np99"),
    ("E2E p50", "E2E p50", "E2E\np50"),
    ("E2E p99", "p99", "E2E\np99"),
    ("goodput/s", "goodput/s", "goodput\nreq/s"),
    ("SLO %", "SLO %", "SLO\n%"),
    ("out tok/s", "out tok/s", "out\ntok/s"),
    ("hit %", "hit %", "hit\n%"),
    ("imbal", "imbal", "imbal"),
    ("slowdn", "slowdn", "slowdn"),
    ("sim s/s", "sim s/s", "sim\ns/s"),
)
# the narrow layouts leave these out one by one, first first, until the table fits; the
# policy and the headline figures (done, rejected, TTFT p50/p99, TPOT p99, goodput, SLO)
# always stay
_NARROWING = (
    "sim s/s",
    "slowdn",
    "imbal",
    "out tok/s",
    "TTFT p90",
    "E2E p50",
    "TPOT p50",
    "E2E p99",
    "hit %",
)


def print_results(console: Console, output: SweepOutput, target: float) -> None:
    """The results table, at the console's width (see ``isocost.tables``), then in sweeps
    capacity at SLO."""
    sweep = any(run.rate_rps is not None for run in output.runs)
    rows = [_cells(run.summary, run.rate_rps, run) for run in output.runs]
    oracle = _cells(output.oracle, None, None)
    names = [name for name, _, _ in _COLUMNS if name != "rate" or sweep]
    layouts = [_results_table(names, rows, oracle, narrow=False)]
    for dropped in range(len(_NARROWING) + 1):
        kept = [name for name in names if name not in _NARROWING[:dropped]]
        layouts.append(_results_table(kept, rows, oracle, narrow=True))
    console.print(Fitted(*layouts))
    audited = [(r.summary.policy, r.rate_rps, r.audit) for r in output.runs if r.audit is not None]
    if audited:
        console.print(audit_table(audited))
    if sweep:
        capacity = Table(title=f"capacity at SLO ({target:.0%} of requests meet both)")
        capacity.add_column("policy")
        capacity.add_column("highest rate req/s", justify="right")
        for policy, rate in output.capacity_rps.items():
            capacity.add_row(policy, "below sweep" if rate is None else f"{rate:g}")
        console.print(capacity)


def _results_table(
    names: Sequence[str], rows: Sequence[dict[str, str]], oracle: dict[str, str], narrow: bool
) -> Table:
    """The columns ``names`` of every run's row and the oracle's; ``narrow``: headers one
    word a line, no vertical rules, and a caption naming what is left out."""
    left_out = sum(1 for name, _, _ in _COLUMNS if name not in names and name != "rate")
    caption = f"{left_out} more columns in a wider terminal; --json has every figure"
    table = Table(
        title="isocost sim",
        title_justify="left",
        box=box.SIMPLE_HEAD if narrow else box.HEAVY_HEAD,
        pad_edge=not narrow,
        collapse_padding=narrow,
        caption=caption if left_out else None,
        caption_justify="left",
    )
    headers = {
        name: narrow_header if narrow else header for name, header, narrow_header in _COLUMNS
    }
    for name in names:
        table.add_column(headers[name], justify="left" if name == "policy" else "right")
    for row in rows:
        table.add_row(*(row[name] for name in names))
    table.add_row(*(oracle[name] for name in names), style="dim")
    return table


def _cells(s: PolicySummary, rate: float | None, run: RunOutput | None) -> dict[str, str]:
    return {
        "policy": s.policy,
        "rate": "" if rate is None else f"{rate:g}",
        "done": str(s.completed),
        "rej": str(s.rejected),
        "TTFT p50": _s(s.ttft_p50_s),
        "TTFT p90": _s(s.ttft_p90_s),
        "TTFT p99": _s(s.ttft_p99_s),
        "TPOT p50": _ms(s.tpot_p50_s),
        "TPOT p99": _ms(s.tpot_p99_s),
        "E2E p50": _s(s.e2e_p50_s),
        "E2E p99": _s(s.e2e_p99_s),
        "goodput/s": f"{s.goodput_rps:.2f}",
        "SLO %": f"{100 * s.slo_attainment:.1f}",
        "out tok/s": f"{s.output_tokens_per_s:,.0f}",
        "hit %": "-" if s.prefix_hit_rate is None else f"{100 * s.prefix_hit_rate:.1f}",
        "imbal": "-" if s.imbalance_cov is None else f"{s.imbalance_cov:.3f}",
        "slowdn": "-" if s.mean_slowdown is None else f"{s.mean_slowdown:.2f}",
        "sim s/s": "" if run is None else f"{run.sim_s_per_wall_s:,.0f}",
    }


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
