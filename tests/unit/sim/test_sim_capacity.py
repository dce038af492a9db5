"""Capacity at SLO by bisection, as a pure function of a fake attainment curve."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest

from isocost.sim._capacity import (
    CapacityResult,
    CapacitySpec,
    CapacityStatus,
    Measure,
    Probe,
    best_other,
    capacity_ratio,
    search_capacity,
)

Curve = Callable[[float], float]


def step(capacity: float) -> Curve:
    """Attainment 0.95 up to ``capacity`` req/s, 0.5 above it."""
    return lambda rate: 0.95 if rate <= capacity else 0.5


def falling(capacity: float) -> Curve:
    """A smooth, strictly falling curve crossing 0.9 at ``capacity``."""
    return lambda rate: 0.9 * math.exp(-(rate - capacity) / capacity)


def _measure(curves: dict[str, Curve], rounds: list[list[tuple[str, float]]]) -> Measure[str]:
    """Each probe's attainment from its curve; records each round's probes in ``rounds``."""

    def measure(probes: Sequence[tuple[str, float]]) -> list[float]:
        rounds.append(list(probes))
        return [curves[key](rate) for key, rate in probes]

    return measure


@pytest.mark.parametrize("precision", [0.2, 0.05, 0.01])
@pytest.mark.parametrize("capacity", [0.73, 3.0, 7.7, 19.9])
@pytest.mark.parametrize("shape", [step, falling])
def test_the_capacity_is_bracketed_to_the_precision(
    capacity: float, precision: float, shape: Callable[[float], Curve]
) -> None:
    spec = CapacitySpec(0.5, 20.0, precision)
    rounds: list[list[tuple[str, float]]] = []
    result = search_capacity(["p"], spec, _measure({"p": shape(capacity)}, rounds))["p"]
    assert result.status is CapacityStatus.BRACKETED
    assert result.meets_rps is not None and result.misses_rps is not None
    assert result.meets_rps <= capacity < result.misses_rps
    assert result.misses_rps - result.meets_rps <= precision * result.meets_rps
    assert result.capacity_rps == result.meets_rps
    # every probe is in the result, in order, and the endpoints are the ones measured
    assert [p.rate_rps for p in result.probes] == [r for round_ in rounds for _, r in round_]
    assert (result.attainment_at(result.meets_rps) or 0.0) >= 0.9
    assert (result.attainment_at(result.misses_rps) or 1.0) < 0.9
    # geometric bisection: the bracket's ratio halves (in log) each round after the first
    bound = 2 + math.ceil(math.log2(math.log(20.0 / 0.5) / math.log(1 + precision)))
    assert len(result.probes) <= bound
    assert rounds[0] == [("p", 0.5), ("p", 20.0)]


def test_the_ends_of_the_range_settle_the_search_in_one_round() -> None:
    spec = CapacitySpec(1.0, 10.0, 0.05)
    curves = {"fast": step(50.0), "slow": step(0.5), "both": step(10.0)}
    rounds: list[list[tuple[str, float]]] = []
    results = search_capacity(list(curves), spec, _measure(curves, rounds))
    assert len(rounds) == 1
    fast, slow, both = results["fast"], results["slow"], results["both"]
    assert (fast.status, fast.capacity_rps, fast.misses_rps) == (
        CapacityStatus.AT_LEAST_HIGH, 10.0, None,
    )  # fmt: skip
    assert (slow.status, slow.capacity_rps, slow.misses_rps) == (
        CapacityStatus.BELOW_LOW, None, 1.0,
    )  # fmt: skip
    assert both.status is CapacityStatus.AT_LEAST_HIGH  # HI itself meets: at least HI
    assert fast.bounds == (10.0, math.inf) and slow.bounds == (0.0, 1.0)


def test_every_policy_advances_one_round_at_a_time() -> None:
    spec = CapacitySpec(0.5, 20.0, 0.05)
    curves = {"a": step(2.0), "b": step(15.0), "c": step(100.0)}
    rounds: list[list[tuple[str, float]]] = []
    results = search_capacity(list(curves), spec, _measure(curves, rounds))
    assert [k for k, _ in rounds[0]] == ["a", "a", "b", "b", "c", "c"]
    assert all(len({k for k, _ in r}) == len(r) for r in rounds[1:])  # one probe per policy
    assert all("c" not in {k for k, _ in r} for r in rounds[1:])  # settled in round one
    probes = {k: len(v.probes) for k, v in results.items()}
    assert len(rounds) == max(probes.values()) - 1 and probes["c"] == 2


def test_a_non_monotone_curve_still_reports_a_bracket_it_measured() -> None:
    spec = CapacitySpec(1.0, 16.0, 0.05)
    bumpy: Curve = lambda rate: 0.95 if rate < 3 or 6 < rate < 9 else 0.5  # noqa: E731
    result = search_capacity(["p"], spec, _measure({"p": bumpy}, []))["p"]
    assert result.meets_rps is not None and result.misses_rps is not None
    assert bumpy(result.meets_rps) >= 0.9 > bumpy(result.misses_rps)
    assert result.misses_rps - result.meets_rps <= 0.05 * result.meets_rps


def _exact(rate: float) -> CapacityResult:
    return CapacityResult(CapacityStatus.BRACKETED, rate, rate * 1.04, (Probe(rate, 0.91),))


def test_ratios_carry_the_bounds_of_either_side() -> None:
    at_least = CapacityResult(CapacityStatus.AT_LEAST_HIGH, 20.0, None, ())
    below = CapacityResult(CapacityStatus.BELOW_LOW, None, 0.5, ())
    assert capacity_ratio(_exact(6.0), _exact(4.0)) == (1.5, 1.5)
    assert capacity_ratio(at_least, _exact(4.0)) == (5.0, math.inf)
    assert capacity_ratio(below, _exact(4.0)) == (0.0, 0.125)
    assert capacity_ratio(_exact(4.0), below) == (8.0, math.inf)
    assert capacity_ratio(at_least, at_least) == (0.0, math.inf)
    results = {"a": _exact(3.0), "b": at_least, "c": below, "d": _exact(9.0)}
    assert best_other(results, "b", list(results)) == "d"
    assert best_other(results, "a", list(results)) == "b"
    assert best_other(results, "a", ["a", "c"]) == "c"
    assert best_other(results, "a", ["a"]) is None


@pytest.mark.parametrize(
    ("low", "high", "precision", "target"),
    [(0.0, 5.0, 0.05, 0.9), (5.0, 5.0, 0.05, 0.9), (6.0, 5.0, 0.05, 0.9),
     (1.0, math.inf, 0.05, 0.9), (1.0, 5.0, 0.0, 0.9), (1.0, 5.0, 1.0, 0.9),
     (1.0, 5.0, 0.05, 0.0)],
)  # fmt: skip
def test_a_bad_search_is_refused(low: float, high: float, precision: float, target: float) -> None:
    with pytest.raises(ValueError, match=r"LO|precision|target"):
        CapacitySpec(low, high, precision, target)
