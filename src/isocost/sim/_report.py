"""Results as a Rich table, as JSON, and a progress bar over simulated time.

The JSON holds only what the simulation determines (no wall-clock figures), so the same
inputs and seed give byte-identical files; speed (simulated seconds per wall second)
appears in the table only. A capacity search (``--capacity``) prints its own table and
writes its own JSON object instead (``capacity_json``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from isocost.core.errors import ConfigError
from isocost.scheduling.policies import SLO_BASELINES
from isocost.sim._audit import audit_table
from isocost.sim._capacity import CapacityResult, CapacitySpec, best_other, capacity_ratio
from isocost.sim._metrics import DisaggSummary, PolicySummary
from isocost.sim._run import CapacityOutput, RunOutput, SimPlan, SweepOutput, run_capacity, run_plan
from isocost.sim._run import Progress as ProgressCallback
from isocost.tables import Fitted
from isocost.workload import mean_rate_rps

__all__ = [
    "capacity_json",
    "disagg_table",
    "json_rows",
    "print_capacity",
    "print_results",
    "progress_bar",
    "sim_command",
    "write_json",
]


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
        if run.fleet is not None:
            row["autoscale"] = dataclasses.asdict(run.fleet)
        if run.audit is not None:
            row["admission_audit"] = {k: _rounded(v) for k, v in run.audit.json_fields().items()}
        if run.disagg is not None:
            row["disaggregation"] = dataclasses.asdict(run.disagg)
        rows.append(row)
    oracle: dict[str, Any] = dataclasses.asdict(output.oracle)
    oracle["rate_rps"] = None
    rows.append(oracle)
    return [_rounded(row) for row in rows]


def _rounded(value: Any) -> Any:
    """``value`` with every float in it (in dicts and lists too) kept to 12 digits."""
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return float(f"{value:.12g}") if isinstance(value, float) else value


def capacity_json(output: CapacityOutput, spec: CapacitySpec) -> dict[str, Any]:
    """The search's settings, then per policy its capacity, bracket, ratio and every probe
    (the run's summary at that rate, in the order probed)."""
    among, reference = _ratio_reference(list(output.results))
    policies = []
    for policy, result in output.results.items():
        ratio = _ratio(output.results, policy, among)
        row: dict[str, Any] = {
            "policy": policy,
            "status": result.status.value,
            "capacity_rps": result.capacity_rps,
            "meets_at_rps": result.meets_rps,
            "misses_at_rps": result.misses_rps,
            "slo_attainment_at_capacity": result.attainment_at(result.meets_rps),
            "capacity_ratio": None
            if ratio is None
            else {"against": ratio[0], "low": ratio[1], "high": _finite(ratio[2])},
            "probes": [_probe_json(run) for run in output.probes[policy]],
        }
        policies.append(row)
    settings = {"low_rps": spec.low_rps, "high_rps": spec.high_rps, "precision": spec.precision}
    content = {**settings, "target": spec.target, "ratio_against": reference}
    return {k: _rounded(v) for k, v in {**content, "policies": policies}.items()}


def _probe_json(run: RunOutput) -> dict[str, Any]:
    row: dict[str, Any] = {"rate_rps": run.rate_rps, **dataclasses.asdict(run.summary)}
    if run.disagg is not None:
        row["disaggregation"] = dataclasses.asdict(run.disagg)
    return row


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _ratio_reference(policies: Sequence[str]) -> tuple[list[str], str]:
    """Whom each policy's capacity is divided by: the best of the others among the
    ``<peer>_slo`` policies that ran (equal_cost's admission, so routing is compared with
    routing), or among all others when none of those ran."""
    honest = [p for p in policies if p in SLO_BASELINES]
    return (honest, "best other <peer>_slo") if honest else (list(policies), "best other")


def _ratio(
    results: dict[str, CapacityResult], policy: str, among: Sequence[str]
) -> tuple[str, float, float] | None:
    """(the reference policy, bounds on the ratio) or None when no other policy ran."""
    reference = best_other(results, policy, among)
    if reference is None:
        return None
    return (reference, *capacity_ratio(results[policy], results[reference]))


def write_json(output: SweepOutput, path: str) -> None:
    _write_json(json_rows(output), path)


def _write_json(content: object, path: str) -> None:
    data = msgspec.json.format(msgspec.json.encode(content), indent=2)
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
    split = [(r.summary.policy, r.rate_rps, r.disagg) for r in output.runs if r.disagg]
    if split:
        console.print(disagg_table(split))
    if sweep:
        capacity = Table(title=f"capacity at SLO ({target:.0%} of requests meet both)")
        capacity.add_column("policy")
        capacity.add_column("highest rate req/s", justify="right")
        for policy, rate in output.capacity_rps.items():
            capacity.add_row(policy, "below sweep" if rate is None else f"{rate:g}")
        console.print(capacity)


def disagg_table(runs: Sequence[tuple[str, float | None, DisaggSummary]]) -> Table:
    """Per run, how much it disaggregated: share split, KV transfer, P and D queues."""
    table = Table(
        title="prefill/decode disaggregation",
        title_justify="left",
        caption="xfer: predicted KV transfer of split requests; queues: waiting at P and D",
        caption_justify="left",
    )
    table.add_column("policy", no_wrap=True)
    for header in ("rate", "split\n%", "xfer\np50 ms", "xfer\np99 ms", "P\nqueue", "D\nqueue"):
        table.add_column(header, justify="right")
    for policy, rate, d in runs:
        table.add_row(
            policy,
            "-" if rate is None else f"{rate:g}",
            f"{100 * d.disaggregated_share:.1f}",
            *(
                "-" if t is None else f"{1000 * t:.1f}"
                for t in (d.transfer_p50_s, d.transfer_p99_s)
            ),
            *(
                "-" if q is None else f"{q:.1f}"
                for q in (d.prefill_queue_mean, d.decode_queue_mean)
            ),
        )
    return table


def print_capacity(console: Console, output: CapacityOutput, spec: CapacitySpec) -> None:
    """Each policy's capacity at SLO, its bracket, its probes and its ratio to the best
    other policy (``_ratio_reference``)."""
    among, reference = _ratio_reference(list(output.results))
    ratios = len(output.results) > 1
    table = Table(
        title=f"capacity at SLO ({spec.target:.0%} of requests meet both), "
        f"bisected to {spec.precision:.0%}",
        title_justify="left",
        caption="bracket: the highest rate probed that met the target, then the lowest "
        "above it that missed; SLO %: at the capacity (at LO when below it)",
        caption_justify="left",
    )
    table.add_column("policy", no_wrap=True)
    for header in ("capacity\nreq/s", "bracket\nreq/s", "probes", "SLO\n%"):
        table.add_column(header, justify="right")
    if ratios:
        table.add_column(f"÷ {reference}", justify="right")
    for policy, result in output.results.items():
        attained = result.attainment_at(result.meets_rps or result.misses_rps)
        cells = [
            policy,
            _capacity_text(result, spec),
            f"{_rate(result.meets_rps)} – {_rate(result.misses_rps)}",
            str(len(result.probes)),
            "-" if attained is None else f"{100 * attained:.1f}",
        ]
        if ratios:
            ratio = _ratio(output.results, policy, among)
            cells.append(_ratio_text(ratio[1], ratio[2]) if ratio else "-")
        table.add_row(*cells)
    console.print(table)


def _capacity_text(result: CapacityResult, spec: CapacitySpec) -> str:
    if result.capacity_rps is None:
        return f"< {spec.low_rps:g}"
    if result.misses_rps is None:
        return f"≥ {spec.high_rps:g}"
    return _rate(result.capacity_rps)


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _ratio_text(low: float, high: float) -> str:
    """Bounds on a ratio as one figure: exact, at least, at most, or unknown ("-")."""
    if math.isinf(high):
        return "-" if low == 0 else f"≥ {low:.2f}x"
    return f"{low:.2f}x" if low == high else f"≤ {high:.2f}x"


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


Bars = Callable[[Sequence[tuple[str, float]]], ProgressCallback]


@contextmanager
def _bars(console: Console) -> Iterator[Bars]:
    """``show(bars)``: a bar per run over simulated time, each up to its last arrival
    (label, seconds), in place of those shown before; returns their update callback."""
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[at]}"))
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=True) as bar:

        def show(bars: Sequence[tuple[str, float]]) -> ProgressCallback:
            for task_id in bar.task_ids:
                bar.remove_task(task_id)
            tasks = [(bar.add_task(label, total=max(end, 1e-9), at=""), end) for label, end in bars]

            def update(task: int, now: float) -> None:
                task_id, end = tasks[task]
                bar.update(task_id, completed=min(now, end), at=f"t={now:,.0f}s")

            return update

        yield show


@contextmanager
def progress_bar(console: Console, bars: Sequence[tuple[str, float]]) -> Iterator[ProgressCallback]:
    """A bar per run over simulated time, each up to its last arrival (label, seconds)."""
    with _bars(console) as show:
        yield show(bars)


def sim_command(
    console: Console, plan: SimPlan, json_path: str | None, plot_path: str | None
) -> SweepOutput | CapacityOutput:
    """Run ``plan`` under a progress bar, print the tables, write JSON and the plot (a
    capacity search has no plot)."""
    if plan.capacity is not None:
        return _capacity_command(console, plan, plan.capacity, json_path)
    if plan.rates_rps:
        bar = _bar_at_rate(plan)
        bars = [bar(policy, rate) for policy in plan.policies for rate in plan.rates_rps]
    else:
        last_s = max(r.arrival_s for r in plan.requests)
        bars = [(policy, last_s) for policy in plan.policies]
    with progress_bar(console, bars) as update:
        output = run_plan(plan, update)
    print_results(console, output, plan.slo.share)
    for run in output.runs:
        if run.fleet is not None:
            console.print(
                f"autoscaled {run.summary.policy}: {run.fleet.gpu_hours:,.2f} GPU-h "
                f"({run.fleet.cold_gpu_hours:,.2f} in cold starts), "
                f"${run.fleet.usd:,.2f}, {run.fleet.scale_events} scale events, "
                f"{run.fleet.killed} killed",
                highlight=False,
            )
    if json_path is not None:
        write_json(output, json_path)
        console.print(f"wrote {json_path}", highlight=False)
    if plot_path is not None:
        from isocost.sim._plots import write_plot

        write_plot(output, plot_path)
        console.print(f"wrote {plot_path}", highlight=False)
    return output


def _bar_at_rate(plan: SimPlan) -> Callable[[str, float], tuple[str, float]]:
    """The bar of a run at a rate: its label and its last arrival once scaled to it."""
    last_s = max(r.arrival_s for r in plan.requests)
    base_rps = mean_rate_rps(plan.requests)
    return lambda policy, rate: (f"{policy} @ {rate:g}/s", last_s * base_rps / rate)


def _capacity_command(
    console: Console, plan: SimPlan, spec: CapacitySpec, json_path: str | None
) -> CapacityOutput:
    bar = _bar_at_rate(plan)
    with _bars(console) as show:
        output = run_capacity(plan, lambda round_: show([bar(p, rate) for p, rate in round_]))
    print_capacity(console, output, spec)
    if json_path is not None:
        _write_json(capacity_json(output, spec), json_path)
        console.print(f"wrote {json_path}", highlight=False)
    return output
