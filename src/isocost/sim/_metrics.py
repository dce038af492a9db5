"""What a run measured: SLOs, per-policy summaries, the isolated-service oracle, capacity.

* TTFT = first token seen at the gateway - arrival; E2E = completion seen - arrival;
  TPOT = (E2E - TTFT) / (output tokens - 1) (0 for one-token replies). Percentiles are
  over completed requests.
* A request meets the SLO when it completed with TTFT <= ``ttft_s + ttft_per_1k_s *
  prompt_tokens / 1000`` (long prompts get proportionally more time, DESIGN §4) and
  TPOT <= ``tpot_s`` (``core.slo.SloTargets``, the definition bench and demo use too).
  Goodput = such requests per second of the run's span (first arrival to the last
  request settled); ``slo_attainment`` = their share of all arrivals.
* Isolated service time: the request alone on an empty replica of the fastest kind in the
  cluster, cold cache, plus both network legs: the prefill in chunks, then ``m - 1``
  decode steps. A lone sequence decodes memory-bound, where a step's time is linear in
  its context, so the ``m - 1`` steps cost exactly ``m - 1`` steps at the mean context.
  Slowdown = E2E / isolated E2E (below 1 only through prefix-cache hits).
* Load imbalance = coefficient of variation (std / mean) of per-replica busy time.
* Capacity at SLO over a rate sweep: the highest offered rate whose SLO attainment is at
  least the target share (e.g. 0.9, ``SloTargets.share``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from isocost.core.costmodel import CostModel
from isocost.core.slo import SloTargets
from isocost.workload import WorkloadRequest

__all__ = [
    "Isolated",
    "PolicySummary",
    "capacity_at_slo",
    "isolated_times",
    "oracle_summary",
    "summarize_sim",
]

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Isolated:
    """Isolated service times per request (aligned with the request list); nan: fits nowhere."""

    ttft_s: FloatArray
    e2e_s: FloatArray


def isolated_times(
    requests: Sequence[WorkloadRequest], cost_models: Sequence[CostModel], delay_s: float
) -> Isolated:
    """Each request's isolated TTFT and E2E on the fastest replica kind that fits it."""
    kinds = {(c.model.id, c.gpu.id, c.tensor_parallel): c for c in cost_models}
    ttft = np.full(len(requests), math.nan)
    e2e = np.full(len(requests), math.nan)
    for i, request in enumerate(requests):
        n, m = request.prompt_tokens, request.output_tokens
        for cost in kinds.values():
            if n + m > min(cost.model.max_context_tokens, cost.kv_capacity_tokens):
                continue
            prefill = cost.prefill_time_s(n)
            decode = 0.0
            if m > 1:  # decode contexts n .. n + m - 2
                low = n + (m - 2) // 2
                high = n + (m - 1) // 2
                step = 0.5 * (cost.step_time_s(0, 0, 1, low) + cost.step_time_s(0, 0, 1, high))
                decode = (m - 1) * step
            total = prefill + decode + 2 * delay_s
            if not total >= e2e[i]:  # also true while e2e[i] is nan
                ttft[i] = prefill + 2 * delay_s
                e2e[i] = total
    return Isolated(ttft, e2e)


@dataclass(frozen=True, slots=True)
class PolicySummary:
    """One row of the results table and one object of the JSON list."""

    policy: str
    arrivals: int
    completed: int
    rejected: int
    rejected_by_reason: dict[str, int]
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    goodput_rps: float
    slo_attainment: float
    output_tokens_per_s: float
    prefix_hit_rate: float | None
    imbalance_cov: float | None
    mean_slowdown: float | None
    preemptions: int
    offered_rps: float | None
    span_s: float


def summarize_sim(
    policy: str,
    requests: Sequence[WorkloadRequest],
    ttft_s: FloatArray,
    e2e_s: FloatArray,
    rejected: Sequence[str | None],
    slo: SloTargets,
    isolated: Isolated,
    end_s: float,
    *,
    busy_s: Sequence[float] | None = None,
    prefix: tuple[int, int] | None = None,
    preemptions: int = 0,
) -> PolicySummary:
    """Summary of one run; ``ttft_s``/``e2e_s`` are nan where a request did not complete."""
    done = ~np.isnan(e2e_s)
    prompt = np.array([r.prompt_tokens for r in requests], dtype=np.float64)
    output = np.array([r.output_tokens for r in requests], dtype=np.float64)
    tpot = np.where(output > 1, (e2e_s - ttft_s) / np.maximum(output - 1, 1), 0.0)
    with np.errstate(invalid="ignore"):
        good = done & slo.met(prompt, ttft_s, tpot)
        slowdown = e2e_s[done] / isolated.e2e_s[done]
    start = min((r.arrival_s for r in requests), default=0.0)
    span = max(end_s - start, 1e-9)
    arrivals = len(requests)
    reasons = Counter(r for r in rejected if r is not None)
    offered = None
    if arrivals > 1:
        last = max(r.arrival_s for r in requests)
        offered = (arrivals - 1) / (last - start) if last > start else None
    busy = np.asarray(busy_s if busy_s is not None else [], dtype=np.float64)
    return PolicySummary(
        policy=policy,
        arrivals=arrivals,
        completed=int(done.sum()),
        rejected=sum(reasons.values()),
        rejected_by_reason=dict(sorted(reasons.items())),
        ttft_p50_s=_pct(ttft_s[done], 50),
        ttft_p90_s=_pct(ttft_s[done], 90),
        ttft_p99_s=_pct(ttft_s[done], 99),
        tpot_p50_s=_pct(tpot[done], 50),
        tpot_p99_s=_pct(tpot[done], 99),
        e2e_p50_s=_pct(e2e_s[done], 50),
        e2e_p99_s=_pct(e2e_s[done], 99),
        goodput_rps=float(good.sum()) / span,
        slo_attainment=float(good.sum()) / arrivals if arrivals else 0.0,
        output_tokens_per_s=float(output[done].sum()) / span,
        prefix_hit_rate=prefix[1] / prefix[0] if prefix and prefix[0] else None,
        imbalance_cov=float(busy.std() / busy.mean()) if busy.size and busy.mean() > 0 else None,
        mean_slowdown=float(np.nanmean(slowdown)) if slowdown.size else None,
        preemptions=preemptions,
        offered_rps=offered,
        span_s=span,
    )


def oracle_summary(
    requests: Sequence[WorkloadRequest], slo: SloTargets, isolated: Isolated
) -> PolicySummary:
    """The isolated-service lower bound as a results row (every request alone)."""
    fits = ~np.isnan(isolated.e2e_s)
    ends = np.array([r.arrival_s for r in requests]) + np.nan_to_num(isolated.e2e_s)
    rejected = [None if ok else "too_long" for ok in fits]
    end_s = float(ends.max()) if ends.size else 0.0
    return summarize_sim(
        "oracle", requests, isolated.ttft_s, isolated.e2e_s, rejected, slo, isolated, end_s
    )


def capacity_at_slo(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The highest rate among ``(rate, slo_attainment)`` points meeting ``target``."""
    meeting = [rate for rate, share in points if share >= target]
    return max(meeting) if meeting else None


def _pct(values: FloatArray, q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None
