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
from typing import Literal

from isocost.core.errors import ConfigError
from isocost.files import read_text
from isocost.workload import (
    TraceFormat,
    WorkloadRequest,
    gamma_arrivals,
    multi_turn,
    parse_trace,
    scenario_mix,
    shared_prefix,
    speedup,
    with_arrivals,
)

__all__ = ["WORKLOADS", "WorkloadName", "WorkloadSpec", "build_workload"]

WorkloadName = Literal["mix", "shared-prefix", "multi-turn"]
WORKLOADS: tuple[WorkloadName, ...] = ("mix", "shared-prefix", "multi-turn")


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
    if spec.trace is not None:
        requests = parse_trace(read_text(spec.trace).splitlines(), spec.trace, spec.trace_format)
        if spec.rate_rps is not None:
            return with_arrivals(requests, _arrivals(rng, spec))
        if len({r.arrival_s for r in requests}) == 1 and len(requests) > 1 and not closed_loop:
            raise ConfigError(spec.trace, "the trace has no arrival times; pass --rate")
        return speedup(requests, spec.speedup)
    if spec.rate_rps is None and not closed_loop:
        raise ConfigError("bench", f"--workload {spec.workload} needs --rate or --concurrency")
    arrivals = _arrivals(rng, spec)
    if spec.workload == "shared-prefix":
        return iter(
            shared_prefix(
                rng,
                arrivals,
                spec.num_groups,
                spec.prompts_per_group,
                spec.system_tokens,
                spec.question_tokens,
                spec.output_tokens,
            )
        )
    if spec.workload == "multi-turn":
        return iter(
            multi_turn(
                rng,
                arrivals,
                spec.sessions,
                spec.turns,
                spec.system_tokens,
                spec.question_tokens,
                spec.output_tokens,
                spec.think_time_s,
            )
        )
    return scenario_mix(rng, arrivals, max_prompt_tokens=spec.max_prompt_tokens)


def _arrivals(rng: Random, spec: WorkloadSpec) -> Iterator[float]:
    """The arrival process; a closed loop ignores times, so any positive rate will do."""
    return gamma_arrivals(rng, spec.rate_rps or 1.0, spec.burstiness)
