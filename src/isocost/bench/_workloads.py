"""From command-line choices to a stream of workload requests, in arrival order.

A trace keeps its own timestamps (compressed by ``speedup``) unless ``rate_rps`` is given,
which replaces them with Poisson (or, with ``burstiness`` > 1, gamma) arrivals at that
rate; lengths-only traces need ``rate_rps`` or a closed loop. Synthetic workloads always
draw arrivals from the process, seeded by ``seed``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from random import Random

from isocost.core.errors import ConfigError
from isocost.files import load_trace
from isocost.workload import (
    SYNTHETIC_WORKLOADS,
    SyntheticName,
    SyntheticSpec,
    TraceFormat,
    WorkloadRequest,
    gamma_arrivals,
    speedup,
    synthetic_workload,
    with_arrivals,
)

__all__ = ["WORKLOADS", "WorkloadName", "WorkloadSpec", "build_workload"]

WorkloadName = SyntheticName
WORKLOADS = SYNTHETIC_WORKLOADS


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What to send. Exactly one of ``trace`` and ``workload``."""

    trace: str | None = None
    trace_format: TraceFormat | None = None
    workload: WorkloadName | None = None
    rate_rps: float | None = None
    burstiness: float = 1.0  # coefficient of variation of gaps; 1 = Poisson
    speedup: float = 1.0
    seed: int = 0
    max_prompt_tokens: int | None = None  # caps the mix's long prompts
    num_groups: int = 8
    prompts_per_group: int = 16
    sessions: int = 16
    turns: int = 4
    system_tokens: int = 2048
    question_tokens: int = 128
    output_tokens: int = 128
    think_time_s: float = 5.0


def build_workload(spec: WorkloadSpec, closed_loop: bool) -> Iterator[WorkloadRequest]:
    """The requests of ``spec``; a ConfigError for contradictory or incomplete choices."""
    if (spec.trace is None) == (spec.workload is None):
        raise ConfigError("bench", "give exactly one of --trace and --workload")
    rng = Random(spec.seed)
    arrivals = gamma_arrivals(rng, spec.rate_rps or 1.0, spec.burstiness)
    if spec.trace is not None:
        requests = load_trace(spec.trace, spec.trace_format)
        if spec.rate_rps is not None:
            return with_arrivals(requests, arrivals)
        if len({r.arrival_s for r in requests}) == 1 and len(requests) > 1 and not closed_loop:
            raise ConfigError(spec.trace, "the trace has no arrival times; pass --rate")
        return speedup(requests, spec.speedup)
    if spec.rate_rps is None and not closed_loop:
        raise ConfigError("bench", f"--workload {spec.workload} needs --rate or --concurrency")
    synthetic = SyntheticSpec(
        name=spec.workload or "mix",
        max_prompt_tokens=spec.max_prompt_tokens,
        num_groups=spec.num_groups,
        prompts_per_group=spec.prompts_per_group,
        sessions=spec.sessions,
        turns=spec.turns,
        system_tokens=spec.system_tokens,
        question_tokens=spec.question_tokens,
        output_tokens=spec.output_tokens,
        think_time_s=spec.think_time_s,
    )
    return synthetic_workload(synthetic, rng, arrivals)  # a closed loop ignores the times
