"""One PNG (matplotlib, Agg): TTFT CDF per policy, goodput against offered rate for
sweeps, and per-replica load over time (requests running or waiting in each engine) as
one heat map per policy."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator

from isocost.core.errors import ConfigError
from isocost.sim._run import RunOutput, SweepOutput

__all__ = ["write_plot"]


def write_plot(output: SweepOutput, path: str) -> None:
    """Write the figure to ``path`` (a ConfigError naming it if it cannot be written)."""
    sweep = any(run.rate_rps is not None for run in output.runs)
    # the load maps and CDFs use each policy's run at its highest rate
    last: dict[str, RunOutput] = {}
    for run in output.runs:
        last[run.summary.policy] = run
    maps = [run for run in last.values() if run.load_samples]
    panels = 1 + int(sweep) + len(maps)
    cols = min(panels, 3)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    flat = list(axes.flat)
    ax = flat[0]
    for policy, run in last.items():
        ttft = np.sort(run.ttft_s[~np.isnan(run.ttft_s)])
        if ttft.size:
            ax.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of completed requests")
    rate = next(iter(last.values())).rate_rps if last else None
    ax.set_title("TTFT CDF" + (f" at {rate:g} req/s" if rate is not None else ""))
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    used = 1
    if sweep:
        ax = flat[used]
        used += 1
        for policy in last:
            points = sorted(
                (r.rate_rps or 0.0, r.summary.goodput_rps)
                for r in output.runs
                if r.summary.policy == policy
            )
            ax.plot(*zip(*points, strict=True), marker="o", label=policy)
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("goodput (req/s meeting both SLOs)")
        ax.set_title("goodput against offered rate")
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    for run in maps:
        ax = flat[used]
        used += 1
        loads = np.asarray(run.load_samples, dtype=np.float64).T  # replica x time
        times = run.sample_s
        image = ax.imshow(
            loads,
            aspect="auto",
            interpolation="nearest",
            origin="lower",
            extent=(times[0], times[-1], -0.5, loads.shape[0] - 0.5),
            cmap="viridis",
        )
        fig.colorbar(image, ax=ax, label="requests in engine")
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel("replica")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"per-replica load: {run.summary.policy}")
    for ax in flat[used:]:
        ax.axis("off")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise ConfigError(path, exc.strerror or "cannot be written") from None
    finally:
        plt.close(fig)
