"""What a person sees of a run: the live view, the summary table, comparisons and plots."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec
from rich.table import Table

from isocost.bench._records import BenchSummary
from isocost.bench._runner import BenchProgress
from isocost.core.errors import ConfigError
from isocost.core.jsontext import UNDECODABLE
from isocost.files import read_text
from isocost.tables import Fitted, in_chunks

__all__ = ["compare_table", "live_table", "load_summary", "plot_comparison", "summary_table"]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.1f}"


def live_table(progress: BenchProgress) -> Table:
    """Sent, done, errors and running p99s, redrawn while a run goes."""
    table = Table("sent", "done", "errors", "in flight", "TTFT p99 ms", "E2E p99 ms")
    in_flight = progress.sent - progress.done - progress.errors
    table.add_row(
        str(progress.sent),
        str(progress.done),
        str(progress.errors),
        str(in_flight),
        _ms(BenchProgress.p99(progress.ttft_s)),
        _ms(BenchProgress.p99(progress.e2e_s)),
    )
    return table


_LATENCY_ROWS = [
    ("TTFT p50 / p90 / p99 ms", ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")),
    ("TPOT p50 / p90 / p99 ms", ("tpot_p50_s", "tpot_p90_s", "tpot_p99_s")),
    ("ITL p50 / p90 / p99 ms", ("itl_p50_s", "itl_p90_s", "itl_p99_s")),
    ("E2E p50 / p90 / p99 ms", ("e2e_p50_s", "e2e_p90_s", "e2e_p99_s")),
]


def _rows(summary: BenchSummary) -> list[tuple[str, str]]:
    errors = ", ".join(f"{k} {n}" for k, n in summary.errors_by_kind.items()) or "none"
    per_1k = summary.slo_ttft_per_1k_ms
    scaled = f" + {per_1k:g} ms per 1k prompt tokens" if per_1k else ""
    slos = [
        f"{name} <= {value:g} ms{scaled if name == 'TTFT' else ''}"
        for name, value in (("TTFT", summary.slo_ttft_ms), ("TPOT", summary.slo_tpot_ms))
        if value is not None
    ]
    slo = ", ".join(slos) or "no SLO given"
    rows = [
        ("requests / completed", f"{summary.requests} / {summary.completed}"),
        ("errors", f"{summary.errors} ({errors})"),
        ("duration s", f"{summary.duration_s:,.2f}"),
        ("throughput req/s", f"{summary.throughput_rps:,.2f}"),
        ("output tokens/s", f"{summary.output_tokens_per_s:,.1f}"),
        ("goodput req/s", f"{summary.goodput_rps:,.2f} ({slo})"),
    ]
    for name, keys in _LATENCY_ROWS:
        rows.append((name, " / ".join(_ms(getattr(summary, k)) for k in keys)))
    rows.append(
        ("send lag p99 / max ms", f"{_ms(summary.send_lag_p99_s)} / {_ms(summary.send_lag_max_s)}")
    )
    by_replica = summary.completed_by_replica.items()
    rows.append(("completed by replica", ", ".join(f"{k} {n}" for k, n in by_replica) or "-"))
    return rows


def summary_table(summary: BenchSummary) -> Table:
    """One run's figures."""
    table = Table(title=f"{summary.label}: {summary.model} at {summary.url}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in _rows(summary):
        table.add_row(name, value)
    return table


def compare_table(summaries: Sequence[BenchSummary]) -> Fitted:
    """Runs side by side, one column each; as many side by side as fit the width, the
    rest in further tables below."""
    return in_chunks(summaries, _compare_table)


def _compare_table(summaries: Sequence[BenchSummary]) -> Table:
    table = Table(title="bench compare")
    table.add_column("metric")
    for summary in summaries:
        table.add_column(summary.label, justify="right")
    columns = [_rows(s) for s in summaries]
    for i, (name, _) in enumerate(columns[0]):
        table.add_row(name, *(rows[i][1] for rows in columns))
    return table


def load_summary(path: str) -> BenchSummary:
    """A ``--json`` file of ``isocost bench``, or a ConfigError naming it."""
    try:
        return msgspec.json.decode(read_text(path), type=BenchSummary)
    except (*UNDECODABLE, msgspec.ValidationError) as exc:
        raise ConfigError(path, f"not an isocost bench --json summary ({exc})") from None


def plot_comparison(summaries: Sequence[BenchSummary], path: str | Path) -> None:
    """TTFT and E2E CDFs per run, and goodput against throughput bars, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft_ax, e2e_ax, bar_ax) = plt.subplots(1, 3, figsize=(15, 4.5))
    for summary in summaries:
        for ax, samples in ((ttft_ax, summary.ttft_samples_s), (e2e_ax, summary.e2e_samples_s)):
            n = len(samples)
            ax.plot(samples, [(i + 1) / n for i in range(n)], label=summary.label)
    for ax, name in ((ttft_ax, "TTFT"), (e2e_ax, "E2E latency")):
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (s)")
        ax.set_ylabel("share of completed requests")
        ax.grid(True, alpha=0.3)
        ax.legend()
    labels = [s.label for s in summaries]
    xs = range(len(summaries))
    bar_ax.bar([x - 0.2 for x in xs], [s.throughput_rps for s in summaries], 0.4, label="completed")
    bar_ax.bar([x + 0.2 for x in xs], [s.goodput_rps for s in summaries], 0.4, label="within SLO")
    bar_ax.set_xticks(list(xs), labels)
    bar_ax.set_ylabel("requests / s")
    bar_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
