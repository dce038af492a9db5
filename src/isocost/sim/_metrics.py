"""What a run measured: SLOs, per-policy summaries, the isolated-service oracle, capacity.

* TTFT = first token seen at the gateway - arrival; E2E = completion seen - arrival;
  TPOT = (E2E - TTFT) / (output tokens - 1) (0 for one-token replies). Percentiles are
  over completed requests.
* A request meets the SLO when it completed with TTFT <= ``ttft_s + ttft_per_1k_s *
  prompt_tokens / 1000`` (long prompts get proportionally more time, DESIGN §4) and
  TPOT <= ``tpot_s`` (``core.slo.SloTargets``, the definition bench and demo use too).
  Goodput = such requests per second of the run's span (first arrival to the last
  request settled); ``slo_attainment`` = their share of all arrivals.
* Isolated service time, a lower bound on every request's TTFT and E2E under any policy:
  the request alone on an empty replica of the fastest kind in the cluster (step times
  times the smallest slowdown below 1 any replica of that kind runs at), plus both
  network legs; its prefill in chunks, each at its cheapest company
  (``engine.prefill_floor_s``: the engine model prices a step's prefill chunks at their
  mean cached context, so fresh chunks make a long-context chunk cheaper than alone),
  then ``m - 1`` lone decode steps at contexts ``n .. n + m - 2`` (in closed form,
  ``DecodeLines.run_time_s``). The prefill reuses the best prefix cache the request could
  meet: the longest prefix of its block hashes that requests arriving before it (ties:
  earlier in the list, as the gateway takes them) have in their prompts
  (``reusable_prefix_blocks``), within the engine's rules (only prompt blocks are cached;
  at least one prompt token is computed, so at most ``(n - 1) // block_size`` blocks hit).
  Why no run beats it: hits come only from blocks some prompt computed before the
  request's admission; a prompt arriving later (or the request's own earlier attempt) can
  have computed them only while the request waited, and computing them costs at least
  what they save (a prompt's FLOPs add up however it is chunked; each extra step pays its
  overhead and a weight read again); decodes, bigger contexts and slower replicas only
  add time. Slowdown = E2E / isolated E2E, at least 1 (``tests/property/test_sim_bound.py``
  checks every completed request of several policies and workloads against its bound).
* Load imbalance = coefficient of variation (std / mean) of per-replica busy time.
* Disaggregation (fleets with replica roles, ``DisaggSummary``): the share of arrivals
  whose last attempt was split into prefill and decode legs, the predicted KV transfer
  of those (p50, p99), and the mean requests waiting at P and at D when they were split.
* Capacity at SLO over a rate sweep: the highest offered rate whose SLO attainment is at
  least the target share (e.g. 0.9, ``SloTargets.share``).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from isocost.core.costmodel import CostModel
from isocost.core.slo import SloTargets
from isocost.engine import prefill_floor_s
from isocost.sim._core import SimRecord, block_hashes
from isocost.workload import WorkloadRequest

__all__ = [
    "DisaggSummary",
    "Isolated",
    "PolicySummary",
    "capacity_at_slo",
    "isolated_times",
    "oracle_summary",
    "reusable_prefix_blocks",
    "summarize_disagg",
    "summarize_sim",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Isolated:
    """Isolated service times per request (aligned with the request list); nan: fits nowhere.
    ``cached_tokens``: the prompt tokens the bound took from the prefix cache."""

    ttft_s: FloatArray
    e2e_s: FloatArray
    cached_tokens: IntArray


def isolated_times(
    requests: Sequence[WorkloadRequest],
    cost_models: Sequence[CostModel],
    delay_s: float,
    slowdowns: Sequence[float] = (),
) -> Isolated:
    """Each request's isolated TTFT and E2E on the fastest replica kind that fits it.

    ``slowdowns[i]``, when given, is the smallest step-time factor the replica of
    ``cost_models[i]`` ever runs at (``_cluster.lowest_slowdowns``): a factor below 1 makes
    that kind faster in the bound, one above 1 does not slow it (the bound is a healthy
    replica's).
    """
    kinds: dict[tuple[str, str, int], tuple[CostModel, float]] = {}
    for i, cost in enumerate(cost_models):
        key = (cost.model.id, cost.gpu.id, cost.tensor_parallel)
        factor = min(1.0, slowdowns[i] if slowdowns else 1.0)
        kinds[key] = (cost, min(factor, kinds[key][1]) if key in kinds else factor)
    lone_decode = {key: cost.decode_lines(1) for key, (cost, _) in kinds.items()}
    reusable = reusable_prefix_blocks(requests)
    ttft = np.full(len(requests), math.nan)
    e2e = np.full(len(requests), math.nan)
    cached_tokens = np.zeros(len(requests), dtype=np.int64)
    for i, request in enumerate(requests):
        n, m = request.prompt_tokens, request.output_tokens
        for key, (cost, factor) in kinds.items():
            if n + m > min(cost.model.max_context_tokens, cost.kv_capacity_tokens):
                continue
            block = cost.limits.block_size
            cached = min(reusable[i], (n - 1) // block) * block
            prefill = prefill_floor_s(cost, n - cached, cached) * factor
            decode = lone_decode[key].run_time_s(n, m - 1) * factor if m > 1 else 0.0
            total = prefill + decode + 2 * delay_s
            if not total >= e2e[i]:  # also true while e2e[i] is nan
                ttft[i] = prefill + 2 * delay_s
                e2e[i] = total
                cached_tokens[i] = cached
    return Isolated(ttft, e2e, cached_tokens)


def reusable_prefix_blocks(requests: Sequence[WorkloadRequest]) -> list[int]:
    """Per request, how many leading blocks of its prompt (``_core.block_hashes``) are in
    the prompt of some request that arrives before it (same time: earlier in the list):
    the most its prefix-cache lookup can hit on any replica (the engine caches prompt
    blocks only). Depends on the arrival order only, so a rate sweep keeps it."""
    hashes = [block_hashes(r) for r in requests]
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    seen: set[int] = set()
    blocks = [0] * len(requests)
    for i in order:
        blocks[i] = sum(1 for _ in itertools.takewhile(seen.__contains__, hashes[i]))
        seen.update(hashes[i])
    return blocks


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
    held: int = 0  # held by SLO admission at least once (``dispatch``)
    held_admitted: int = 0  # of them, admitted after all


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
    held: tuple[int, int] = (0, 0),
) -> PolicySummary:
    """Summary of one run; ``ttft_s``/``e2e_s`` are nan where a request did not complete;
    ``held``: the requests SLO admission held, and how many of them it admitted after."""
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
        held=held[0],
        held_admitted=held[1],
    )


@dataclass(frozen=True, slots=True)
class DisaggSummary:
    """Prefill/decode disaggregation in one run (the module docstring)."""

    disaggregated_share: float
    transfer_p50_s: float | None
    transfer_p99_s: float | None
    prefill_queue_mean: float | None
    decode_queue_mean: float | None


def summarize_disagg(records: Sequence[SimRecord]) -> DisaggSummary:
    split = [r for r in records if r.disaggregated]
    transfer = np.array([r.transfer_s for r in split], dtype=np.float64)
    prefill_queue = np.array([r.prefill_queue for r in split], dtype=np.float64)
    decode_queue = np.array([r.decode_queue for r in split], dtype=np.float64)
    return DisaggSummary(
        disaggregated_share=len(split) / len(records) if records else 0.0,
        transfer_p50_s=_pct(transfer, 50),
        transfer_p99_s=_pct(transfer, 99),
        prefill_queue_mean=float(prefill_queue.mean()) if split else None,
        decode_queue_mean=float(decode_queue.mean()) if split else None,
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
