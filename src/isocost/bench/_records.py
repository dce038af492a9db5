"""What the load generator records about each request, and the summary of a run.

Times are seconds on the run's monotonic clock, 0 at the start of the run. Latencies count
from ``intended_s``, the time the request was *due* (its arrival in an open-loop run, or
the end of its session's previous turn if later), not from when it was actually sent: a
late send then shows as latency instead of vanishing (no coordinated omission).
``send_lag_s`` reports how late the generator itself was. Goodput counts the requests that
meet the SLO as ``core.slo.SloTargets`` defines it, the same definition as ``isocost sim``'s
(the TTFT target grows with the planned prompt length when a per-1k target is given).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence

import msgspec
import numpy as np

from isocost.core.slo import SloTargets

__all__ = ["BenchRecord", "BenchSummary", "meets_slo", "summarize_bench"]


class BenchRecord(msgspec.Struct, kw_only=True):
    """One request's timeline and outcome (one JSONL line of ``--records``)."""

    request_id: int
    session_id: str | None = None
    turn_index: int = 0
    prompt_tokens: int  # as the workload planned it
    max_tokens: int
    intended_s: float
    sent_s: float
    first_token_s: float | None = None  # first chunk carrying text
    chunk_times_s: list[float] = []  # every chunk carrying text
    end_s: float | None = None
    usage_prompt_tokens: int | None = None  # as the server counted them
    output_tokens: int = 0  # usage.completion_tokens, else the number of text chunks
    status: int = 0  # HTTP status; 0 when no response came
    replica: str | None = None  # x-isocost-replica of an isocost gateway's answer
    resumed: int = 0  # times an isocost gateway resumed the stream on another replica
    error_kind: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None and self.end_s is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.intended_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.intended_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_s is None or self.end_s is None or self.output_tokens < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive text chunks."""
        return [b - a for a, b in itertools.pairwise(self.chunk_times_s)]


class BenchSummary(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A run's figures (the ``--json`` file); percentiles are None without samples.
    ``slo_ttft_per_1k_ms`` is left out of the file while it is 0 (files from before it
    existed read as 0)."""

    label: str
    url: str
    model: str
    requests: int
    completed: int
    errors: int
    errors_by_kind: dict[str, int]
    completed_by_replica: dict[str, int]  # from x-isocost-replica; empty without a gateway
    duration_s: float
    throughput_rps: float
    output_tokens_per_s: float
    goodput_rps: float
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    slo_ttft_per_1k_ms: float = 0.0
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p90_s: float | None
    tpot_p99_s: float | None
    itl_p50_s: float | None
    itl_p90_s: float | None
    itl_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p90_s: float | None
    e2e_p99_s: float | None
    send_lag_p99_s: float | None
    send_lag_max_s: float | None
    ttft_samples_s: list[float]  # sorted, for CDF plots in ``bench compare``
    e2e_samples_s: list[float]


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def meets_slo(record: BenchRecord, slo: SloTargets) -> bool:
    """Completed, and within both targets (a target not given is infinite, so it holds;
    no text chunk counts as an infinite TTFT, fewer than two output tokens as TPOT 0)."""
    if not record.ok:
        return False
    ttft_s, tpot_s = record.ttft_s, record.tpot_s
    return slo.met(
        record.prompt_tokens,
        math.inf if ttft_s is None else ttft_s,
        0.0 if tpot_s is None else tpot_s,
    )


def summarize_bench(
    records: Sequence[BenchRecord],
    *,
    label: str,
    url: str,
    model: str,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    slo_ttft_per_1k_ms: float = 0.0,
) -> BenchSummary:
    """Percentiles, rates and goodput over ``records``; rates are over the run's span."""
    done = [r for r in records if r.ok]
    ttft = sorted(t for r in done if (t := r.ttft_s) is not None)
    tpot = [t for r in done if (t := r.tpot_s) is not None]
    itl = [gap for r in done for gap in r.itl_s]
    e2e = sorted(t for r in done if (t := r.e2e_s) is not None)
    lag = [r.sent_s - r.intended_s for r in records]
    ends = [r.end_s for r in records if r.end_s is not None]
    duration_s = max([*ends, *(r.sent_s for r in records)], default=0.0)

    def per_s(count: int) -> float:
        return count / duration_s if duration_s > 0 else 0.0

    slo = SloTargets.from_ms(slo_ttft_ms, slo_tpot_ms, slo_ttft_per_1k_ms)
    good = sum(1 for r in done if meets_slo(r, slo))
    kinds = Counter(r.error_kind for r in records if r.error_kind is not None)
    return BenchSummary(
        label=label,
        url=url,
        model=model,
        requests=len(records),
        completed=len(done),
        errors=sum(kinds.values()),
        errors_by_kind=dict(sorted(kinds.items())),
        completed_by_replica=dict(sorted(Counter(r.replica for r in done if r.replica).items())),
        duration_s=duration_s,
        throughput_rps=per_s(len(done)),
        output_tokens_per_s=per_s(sum(r.output_tokens for r in done)),
        goodput_rps=per_s(good),
        slo_ttft_ms=slo_ttft_ms,
        slo_tpot_ms=slo_tpot_ms,
        slo_ttft_per_1k_ms=slo_ttft_per_1k_ms,
        ttft_p50_s=_percentile(ttft, 50),
        ttft_p90_s=_percentile(ttft, 90),
        ttft_p99_s=_percentile(ttft, 99),
        tpot_p50_s=_percentile(tpot, 50),
        tpot_p90_s=_percentile(tpot, 90),
        tpot_p99_s=_percentile(tpot, 99),
        itl_p50_s=_percentile(itl, 50),
        itl_p90_s=_percentile(itl, 90),
        itl_p99_s=_percentile(itl, 99),
        e2e_p50_s=_percentile(e2e, 50),
        e2e_p90_s=_percentile(e2e, 90),
        e2e_p99_s=_percentile(e2e, 99),
        send_lag_p99_s=_percentile(lag, 99),
        send_lag_max_s=max(lag, default=None),
        ttft_samples_s=ttft,
        e2e_samples_s=e2e,
    )
