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
    SyntheticSpec,
    TraceFormat,
    WorkloadRequest,
    check_timed,
    gamma_arrivals,
    speedup,
    synthetic_workload,
    with_arrivals,
)

__all__ = ["WorkloadSpec", "build_workload"]


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What to send. Exactly one of ``trace`` and ``synthetic``."""

    trace: str | None = None
    trace_format: TraceFormat | None = None
    synthetic: SyntheticSpec | None = None
    rate_rps: float | None = None
    burstiness: float = 1.0  # coefficient of variation of gaps; 1 = Poisson
    speedup: float = 1.0
    seed: int = 0


def build_workload(spec: WorkloadSpec, closed_loop: bool) -> Iterator[WorkloadRequest]:
    """The requests of ``spec``; a ConfigError for contradictory or incomplete choices."""
    if (spec.trace is None) == (spec.synthetic is None):
        raise ConfigError("bench", "give exactly one of --trace and --workload")
    rng = Random(spec.seed)
    arrivals = gamma_arrivals(rng, spec.rate_rps or 1.0, spec.burstiness)
    if spec.trace is not None:
        requests = load_trace(spec.trace, spec.trace_format)
        if spec.rate_rps is not None:
            return with_arrivals(requests, arrivals)
        if not closed_loop:
            check_timed(requests, spec.trace)
        return speedup(requests, spec.speedup)
    assert spec.synthetic is not None
    if spec.rate_rps is None and not closed_loop:
        raise ConfigError(
            "bench", f"--workload {spec.synthetic.name} needs --rate or --concurrency"
        )
    return synthetic_workload(spec.synthetic, rng, arrivals)  # a closed loop ignores the times
