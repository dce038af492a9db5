"""The demo's results: per-replica figures from the records, the side-by-side tables,
the plots, and one self-contained HTML report (PNGs embedded as base64, also kept beside
it) in the output folder."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
from rich.console import Console, RenderableType
from rich.table import Table

from isocost.bench import BenchResult
from isocost.bench._report import compare_table, plot_comparison
from isocost.demo._cluster import DemoReplica
from isocost.scheduling.policies import SLO_BASELINES
from isocost.tables import Fitted, in_chunks

__all__ = ["ReplicaStats", "headline", "replica_stats", "replica_table", "write_report"]


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """What one replica did in a run, from the records' ``x-isocost-replica``."""

    name: str
    completed: int
    ttft_p99_s: float | None


def replica_stats(result: BenchResult, names: Sequence[str]) -> list[ReplicaStats]:
    """Completed requests and their P99 TTFT per replica, in the order of ``names``."""
    ttft_s: dict[str, list[float]] = {name: [] for name in names}
    completed = dict.fromkeys(names, 0)
    for record in result.records:
        if record.ok and record.replica in completed:
            completed[record.replica] += 1
            if record.ttft_s is not None:
                ttft_s[record.replica].append(record.ttft_s)
    return [
        ReplicaStats(
            name,
            completed[name],
            float(np.percentile(ttft_s[name], 99)) if ttft_s[name] else None,
        )
        for name in names
    ]


def headline(runs: Sequence[BenchResult]) -> str:
    """One sentence: how the last policy's P99 TTFT compares with its baseline's: the best
    (lowest P99 TTFT) ``<peer>_slo`` run when any other ran, since those share equal_cost's
    admission and so compare routing with routing; else the first run."""
    last = runs[-1].summary
    honest = [
        r.summary
        for r in runs[:-1]
        if r.summary.label in SLO_BASELINES and r.summary.ttft_p99_s is not None
    ]
    baseline = min(honest, key=lambda s: s.ttft_p99_s or 0.0) if honest else runs[0].summary
    if baseline.ttft_p99_s is None or last.ttft_p99_s is None:
        return "not enough completed requests to compare P99 TTFT"
    best = " (the best _slo baseline)" if honest else ""
    comparison = (
        f"{last.label} P99 TTFT {last.ttft_p99_s:.2f} s vs {baseline.label}{best} "
        f"{baseline.ttft_p99_s:.2f} s"
    )
    if last.ttft_p99_s < baseline.ttft_p99_s:
        return f"{comparison}: {baseline.ttft_p99_s / last.ttft_p99_s:.1f}x lower"
    return f"{comparison}: not lower"


def _describe(replica: DemoReplica) -> str:
    slow = f" ({replica.slowdown:g}x slow)" if replica.slowdown != 1 else ""
    return f"{replica.name}{slow}"


def replica_table(runs: Sequence[BenchResult], layout: Sequence[DemoReplica]) -> Fitted:
    """Completed requests and P99 TTFT per replica, one column pair per policy (as many
    policies side by side as fit the width, the rest in further tables below)."""
    return in_chunks(runs, lambda group: _replica_table(group, layout))


def _replica_table(runs: Sequence[BenchResult], layout: Sequence[DemoReplica]) -> Table:
    table = Table(title="where the completed requests went (x-isocost-replica)")
    table.add_column("replica", no_wrap=True)
    table.add_column("gpu")
    names = [replica.name for replica in layout]
    columns = [replica_stats(run, names) for run in runs]
    for run in runs:
        table.add_column(f"{run.summary.label}\ndone", justify="right")
        table.add_column("TTFT\np99 ms", justify="right")  # the policy's left of it
    for i, replica in enumerate(layout):
        cells = [_describe(replica), replica.gpu]
        for stats in (column[i] for column in columns):
            p99 = "-" if stats.ttft_p99_s is None else f"{stats.ttft_p99_s * 1000:,.0f}"
            cells += [str(stats.completed), p99]
        table.add_row(*cells, style="bold red" if replica.slowdown != 1 else None)
    return table


def _plot_timeline(runs: Sequence[BenchResult], layout: Sequence[DemoReplica], path: Path) -> None:
    """TTFT of every request against its arrival time, and completed requests per replica."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (time_ax, bar_ax) = plt.subplots(1, 2, figsize=(15, 4.5))
    for run in runs:
        points = [(r.intended_s, r.ttft_s) for r in run.records if r.ttft_s is not None]
        label = run.summary.label
        time_ax.scatter([p[0] for p in points], [p[1] for p in points], s=6, label=label)
    time_ax.set_yscale("log")
    time_ax.set_xlabel("arrival (s since the run started)")
    time_ax.set_ylabel("TTFT (s)")
    time_ax.set_title("TTFT of each request over the run")
    time_ax.grid(True, alpha=0.3)
    time_ax.legend()
    width = 0.8 / len(runs)
    xs = range(len(layout))
    names = [replica.name for replica in layout]
    for k, run in enumerate(runs):
        offsets = [x - 0.4 + width * (k + 0.5) for x in xs]
        done = [stats.completed for stats in replica_stats(run, names)]
        bar_ax.bar(offsets, done, width, label=run.summary.label)
    bar_ax.set_xticks(list(xs), [_describe(r).replace(" (", "\n(") for r in layout], fontsize=8)
    bar_ax.set_ylabel("requests completed")
    bar_ax.set_title("requests per replica")
    bar_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rich_html(renderables: Sequence[RenderableType]) -> str:
    """Rich tables as HTML ``<pre>`` blocks with inline colours, as the terminal shows them."""
    console = Console(record=True, width=140, file=io.StringIO(), color_system="truecolor")
    for renderable in renderables:
        console.print(renderable)
    return console.export_html(inline_styles=True, code_format="<pre class=rich>{code}</pre>")


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def write_report(
    out_dir: Path,
    runs: Sequence[BenchResult],
    layout: Sequence[DemoReplica],
    setup: Sequence[tuple[str, str]],
) -> Path:
    """Summaries (``isocost bench compare`` can read them), records, PNGs and
    ``report.html``; returns the report's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    encoder = msgspec.json.Encoder()
    for run in runs:
        label = run.summary.label
        (out_dir / f"{label}.json").write_bytes(msgspec.json.format(encoder.encode(run.summary)))
        lines = b"".join(encoder.encode(r) + b"\n" for r in run.records)
        (out_dir / f"{label}.records.jsonl").write_bytes(lines)
    summaries = [run.summary for run in runs]
    latency_png = out_dir / "latency.png"
    plot_comparison(summaries, latency_png)
    replicas_png = out_dir / "replicas.png"
    _plot_timeline(runs, layout, replicas_png)
    setup_rows = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in setup
    )
    tables = _rich_html([compare_table(summaries), replica_table(runs, layout)])
    page = _PAGE.format(
        title=html.escape(" vs ".join(run.summary.label for run in runs)),
        headline=html.escape(headline(runs)),
        setup=setup_rows,
        tables=tables,
        latency=_img(latency_png, "TTFT and E2E CDFs, goodput"),
        replicas=_img(replicas_png, "TTFT over time and requests per replica"),
    )
    report = out_dir / "report.html"
    report.write_text(page, encoding="utf-8")
    return report


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>isocost demo report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; padding: 0 1.5em;
       max-width: 1400px; color: #222; }}
h1 {{ font-size: 1.5em; }} img {{ max-width: 100%; }}
table.setup th {{ text-align: left; padding-right: 1em; font-weight: 600; }}
pre.rich {{ background: #0f1115; color: #ddd; padding: 1em; overflow-x: auto; }}
.headline {{ font-size: 1.2em; font-weight: 600; }}
</style></head><body>
<h1>isocost demo: {title} on a heterogeneous cluster</h1>
<p class="headline">{headline}</p>
<table class="setup">{setup}</table>
<h2>Side by side</h2>
{tables}
<h2>Latency distributions and goodput</h2>
{latency}
<h2>Over time, and per replica</h2>
{replicas}
</body></html>
"""
