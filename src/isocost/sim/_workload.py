"""From command-line choices to the request list every policy replays.

A trace keeps its own arrival times, compressed by ``speedup`` or scaled so that the mean
rate of its first ``max_requests`` (the ones simulated) is ``rate_rps`` (the shape of its
bursts stays); one without times (lengths only) gets Poisson arrivals at ``rate_rps`` from
``seed``, and is refused without it. A synthetic workload draws Poisson arrivals at
``rate_rps`` (default 1/s) from ``seed``, at most ``MAX_SYNTHETIC_REQUESTS`` of them.
``duration_s`` then keeps the requests arriving before it and ``max_requests``
the first so many. A rate sweep replays this same list with its time scaled to each rate,
so every point has the same requests, and a point at the rate a single run was given is
that run.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from random import Random

from isocost.core.errors import ConfigError
from isocost.files import load_trace
from isocost.workload import (
    MAX_SYNTHETIC_REQUESTS,
    SyntheticSpec,
    TraceFormat,
    WorkloadRequest,
    check_timed,
    poisson_arrivals,
    scale_to_rate,
    speedup,
    synthetic_workload,
    with_arrivals,
)

__all__ = ["WorkloadChoice", "at_rate", "load_requests"]

_DEFAULT_SYNTHETIC_REQUESTS = 1000


@dataclass(frozen=True, slots=True)
class WorkloadChoice:
    """What to replay: exactly one of ``trace``, ``synthetic`` and ``recorded`` (a
    recording's requests, already loaded: ``isocost sim --from-record``)."""

    trace: str | None = None
    trace_format: TraceFormat | None = None
    synthetic: SyntheticSpec | None = None
    rate_rps: float | None = None
    speedup: float = 1.0
    max_requests: int | None = None
    duration_s: float | None = None
    seed: int = 0
    recorded: list[WorkloadRequest] | None = None


def load_requests(choice: WorkloadChoice) -> list[WorkloadRequest]:
    """The requests of ``choice`` in arrival order; ConfigError for bad choices or files."""
    given = [x for x in (choice.trace, choice.synthetic, choice.recorded) if x is not None]
    if len(given) != 1:
        raise ConfigError("sim", "give exactly one of --trace, --workload and --from-record")
    for name, value in (("--rate", choice.rate_rps), ("--speedup", choice.speedup)):
        if value is not None and value <= 0:
            raise ConfigError("sim", f"{name} must be positive")
    if choice.synthetic is None:
        requests = choice.recorded or load_trace(choice.trace or "", choice.trace_format)
        if choice.trace is not None and choice.rate_rps is None:
            check_timed(requests, choice.trace)  # the whole trace: its head may come at once
        requests = requests[: choice.max_requests]  # the whole trace's rate is not its head's
        if choice.rate_rps is not None:
            if len({r.arrival_s for r in requests}) < 2:  # lengths only: Poisson arrivals
                arrivals = poisson_arrivals(Random(choice.seed), choice.rate_rps)
                requests = list(with_arrivals(requests, arrivals))
            else:
                requests = list(scale_to_rate(requests, choice.rate_rps))
        else:
            requests = list(speedup(requests, choice.speedup))
    else:
        requests = _synthetic(choice, choice.synthetic)
    if choice.duration_s is not None:
        requests = [r for r in requests if r.arrival_s < choice.duration_s]
    if choice.max_requests is not None:
        requests = requests[: choice.max_requests]
    if not requests:
        raise ConfigError("sim", "no request arrives within --duration / --max-requests")
    return requests


def at_rate(requests: list[WorkloadRequest], rate_rps: float) -> list[WorkloadRequest]:
    """The same requests with time scaled to a mean rate of ``rate_rps``."""
    return list(scale_to_rate(requests, rate_rps))


def _synthetic(choice: WorkloadChoice, spec: SyntheticSpec) -> list[WorkloadRequest]:
    rng = Random(choice.seed)
    requests = synthetic_workload(spec, rng, poisson_arrivals(rng, choice.rate_rps or 1.0))
    if spec.name != "mix":
        return list(requests)
    # The mix is endless: cut it by count or time, made whole as the other workloads are.
    limit, duration_s = choice.max_requests, choice.duration_s
    if limit is None and duration_s is None:
        limit = _DEFAULT_SYNTHETIC_REQUESTS
    expected = min(limit or math.inf, (choice.rate_rps or 1.0) * (duration_s or math.inf))
    if expected > MAX_SYNTHETIC_REQUESTS:
        raise ConfigError(
            "sim",
            f"--workload mix: about {expected:.3g} requests (--max-requests, or --rate x "
            f"--duration), beyond the limit of {MAX_SYNTHETIC_REQUESTS:,}",
        )
    if duration_s is not None:
        requests = itertools.takewhile(lambda r: r.arrival_s < duration_s, requests)
    return list(itertools.islice(requests, limit))
