"""Arrival processes and time transforms: when each request of a workload arrives.

Processes are endless iterators of absolute arrival times (seconds from 0), drawn from an
injected ``random.Random``:

- ``poisson_arrivals(rng, rate_rps)``: exponential gaps, mean 1/rate.
- ``gamma_arrivals(rng, rate_rps, cv)``: gamma gaps with mean 1/rate and coefficient of
  variation ``cv`` (shape 1/cv²); cv = 1 is Poisson, cv > 1 is bursty, cv < 1 is smoother.

Transforms keep a workload's lengths and prefixes and change only its clock:
``speedup`` compresses time by a factor, ``scale_to_rate`` compresses or stretches it so
the mean rate hits a target (the shape of bursts stays), ``with_arrivals`` replaces the
times with a process (lengths-only traces).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from random import Random

from isocost.core.errors import ConfigError
from isocost.workload._request import WorkloadRequest

__all__ = [
    "check_timed",
    "gamma_arrivals",
    "mean_rate_rps",
    "poisson_arrivals",
    "scale_to_rate",
    "speedup",
    "with_arrivals",
]


def poisson_arrivals(rng: Random, rate_rps: float) -> Iterator[float]:
    """Poisson arrivals at ``rate_rps`` requests per second, the first after one gap."""
    return gamma_arrivals(rng, rate_rps, cv=1.0)


def gamma_arrivals(rng: Random, rate_rps: float, cv: float) -> Iterator[float]:
    """Renewal process with gamma gaps: mean 1/``rate_rps``, coefficient of variation ``cv``."""
    if rate_rps <= 0:
        raise ValueError("rate_rps must be positive")
    if cv <= 0:
        raise ValueError("cv must be positive")
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate_rps * shape)
    return _renewal(rng, shape, scale)


def _renewal(rng: Random, shape: float, scale: float) -> Iterator[float]:
    now = 0.0
    while True:
        now += rng.gammavariate(shape, scale)
        yield now


def with_arrivals(
    requests: Iterable[WorkloadRequest], arrivals: Iterator[float]
) -> Iterator[WorkloadRequest]:
    """Each request in order, stamped with the next time from ``arrivals``."""
    for request in requests:
        yield replace(request, arrival_s=next(arrivals))


def check_timed(requests: Sequence[WorkloadRequest], source: str) -> None:
    """A ConfigError naming ``source`` when several requests all arrive at one instant: a
    trace without arrival times (lengths only) replayed at its own pace would send them
    all at once, where it needs arrivals at a rate."""
    if len(requests) > 1 and len({r.arrival_s for r in requests}) == 1:
        raise ConfigError(source, "the trace has no arrival times; pass --rate")


def speedup(requests: Iterable[WorkloadRequest], factor: float) -> Iterator[WorkloadRequest]:
    """The same requests with time compressed ``factor`` times (2 = twice the rate)."""
    if factor <= 0:
        raise ValueError("speedup factor must be positive")
    return (replace(r, arrival_s=r.arrival_s / factor) for r in requests)


def mean_rate_rps(requests: Sequence[WorkloadRequest]) -> float:
    """Requests per second over the span of arrivals (n-1 gaps over first-to-last)."""
    if len(requests) < 2:
        raise ValueError("a rate needs at least two requests")
    span_s = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    if span_s <= 0:
        raise ValueError("all requests arrive at the same time; the trace has no rate")
    return (len(requests) - 1) / span_s


def scale_to_rate(
    requests: Sequence[WorkloadRequest], rate_rps: float
) -> Iterator[WorkloadRequest]:
    """The same requests with time scaled so the mean rate is ``rate_rps``."""
    if rate_rps <= 0:
        raise ValueError("rate_rps must be positive")
    return speedup(requests, rate_rps / mean_rate_rps(requests))
