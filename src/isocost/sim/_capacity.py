"""Capacity at SLO by bisection: per policy, the highest offered rate whose SLO attainment
reaches the target, found to a relative precision between two rates.

The first round probes both ends of ``[low, high]``: if ``high`` meets the target the
capacity is at least ``high``; if ``low`` misses it is below ``low``. Otherwise each round
probes the geometric midpoint of the bracket (the highest rate seen to meet, the lowest
seen to miss) and keeps the half that still brackets, until ``misses - meets <= precision
* meets``; the capacity is then ``meets``. The geometric midpoint halves the bracket's
ratio, so the probes needed grow with ``log(log(high / low) / log(1 + precision))``, and a
capacity of 1 req/s is found as finely as one of 100.

Bisection assumes that attainment falls as the rate grows. It need not, strictly (a rate
can line bursts up with a lucky placement), so the result is the bracket found, not the
only one there may be. Every policy's search advances one round at a time, so that one
round's probes, across policies, can run side by side (``measure``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeVar

__all__ = [
    "CapacityResult",
    "CapacitySpec",
    "CapacityStatus",
    "Measure",
    "Probe",
    "best_other",
    "capacity_ratio",
    "search_capacity",
]

Key = TypeVar("Key", bound=Hashable)


@dataclass(frozen=True, slots=True)
class CapacitySpec:
    """The search: rates ``low`` to ``high`` (req/s), ``precision`` relative, ``target``
    the SLO attainment a rate must reach."""

    low_rps: float
    high_rps: float
    precision: float = 0.05
    target: float = 0.9

    def __post_init__(self) -> None:
        if not 0 < self.low_rps < self.high_rps or not math.isfinite(self.high_rps):
            raise ValueError("LO must be > 0 and HI finite and > LO")
        if not 0 < self.precision < 1:
            raise ValueError("the precision must be in (0, 1)")
        if not 0 < self.target <= 1:
            raise ValueError("the target must be in (0, 1]")


class CapacityStatus(StrEnum):
    BRACKETED = "bracketed"  # meets at the capacity, misses within precision above it
    AT_LEAST_HIGH = "at_least_high"  # the highest rate searched meets the target
    BELOW_LOW = "below_low"  # the lowest rate searched misses it


@dataclass(frozen=True, slots=True)
class Probe:
    rate_rps: float
    slo_attainment: float


@dataclass(frozen=True, slots=True)
class CapacityResult:
    """One policy's search: what it found and every probe, in the order probed."""

    status: CapacityStatus
    meets_rps: float | None  # the highest rate probed that meets the target
    misses_rps: float | None  # the lowest rate probed above it that misses
    probes: tuple[Probe, ...]

    @property
    def capacity_rps(self) -> float | None:
        """The rate found (a lower bound when AT_LEAST_HIGH); None when BELOW_LOW."""
        return self.meets_rps

    @property
    def bounds(self) -> tuple[float, float]:
        """Where the capacity lies as far as the search can tell (the found rate when
        bracketed: it is what is reported, to within the precision)."""
        if self.status is CapacityStatus.AT_LEAST_HIGH:
            return (self.meets_rps or 0.0, math.inf)
        if self.status is CapacityStatus.BELOW_LOW:
            return (0.0, self.misses_rps or 0.0)
        return (self.meets_rps or 0.0, self.meets_rps or 0.0)

    def attainment_at(self, rate_rps: float | None) -> float | None:
        return next((p.slo_attainment for p in self.probes if p.rate_rps == rate_rps), None)


@dataclass(slots=True)
class _Search:
    spec: CapacitySpec
    meets: float | None = None
    misses: float | None = None
    status: CapacityStatus | None = None  # None while searching
    probes: list[Probe] = field(default_factory=list)

    def next_rates(self) -> tuple[float, ...]:
        if self.status is not None:
            return ()
        if not self.probes:
            return (self.spec.low_rps, self.spec.high_rps)
        assert self.meets is not None and self.misses is not None
        return (math.sqrt(self.meets * self.misses),)

    def record(self, results: Sequence[Probe]) -> None:
        first = not self.probes
        self.probes += results
        for probe in results:
            if probe.slo_attainment >= self.spec.target:
                self.meets = probe.rate_rps
            else:
                self.misses = probe.rate_rps
        if first:  # (low, high)
            low, high = results
            if high.slo_attainment >= self.spec.target:
                self.status, self.meets, self.misses = (
                    CapacityStatus.AT_LEAST_HIGH, high.rate_rps, None,
                )  # fmt: skip
            elif low.slo_attainment < self.spec.target:
                self.status, self.meets, self.misses = (
                    CapacityStatus.BELOW_LOW, None, low.rate_rps,
                )  # fmt: skip
        if self.status is None:
            assert self.meets is not None and self.misses is not None
            if self.misses - self.meets <= self.spec.precision * self.meets:
                self.status = CapacityStatus.BRACKETED

    def result(self) -> CapacityResult:
        assert self.status is not None
        return CapacityResult(self.status, self.meets, self.misses, tuple(self.probes))


Measure = Callable[[Sequence[tuple[Key, float]]], Sequence[float]]
"""One round: the SLO attainment of each (key, rate) probe, in order."""


def search_capacity(
    keys: Sequence[Key], spec: CapacitySpec, measure: Measure[Key]
) -> dict[Key, CapacityResult]:
    """Each key's capacity, advancing every unfinished search one round per ``measure``."""
    searches = {key: _Search(spec) for key in keys}
    while round_ := [(k, r) for k, s in searches.items() for r in s.next_rates()]:
        attained = measure(round_)
        for key, search in searches.items():
            probed = [
                Probe(rate, share)
                for (k, rate), share in zip(round_, attained, strict=True)
                if k == key
            ]
            if probed:
                search.record(probed)
    return {key: search.result() for key, search in searches.items()}


def best_other(results: dict[Key, CapacityResult], key: Key, among: Sequence[Key]) -> Key | None:
    """The key of ``among`` other than ``key`` with the highest capacity (None if none)."""
    others = [k for k in among if k != key]
    return max(others, key=lambda k: results[k].bounds, default=None)


def capacity_ratio(mine: CapacityResult, theirs: CapacityResult) -> tuple[float, float]:
    """Bounds on mine / theirs from both bounds (a low of 0 or a high of inf: unbounded)."""
    my_low, my_high = mine.bounds
    their_low, their_high = theirs.bounds
    return (my_low / their_high, my_high / their_low if their_low > 0 else math.inf)
