"""``Bounds``: the one range check every flag and file field goes through."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from isocost.core.bounds import (
    AT_LEAST_ONE,
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    SHARE,
    Bounds,
    check_fields,
)
from isocost.core.errors import ConfigError


@pytest.mark.parametrize(
    ("bounds", "inside", "outside", "problem"),
    [
        (POSITIVE, (1e-300, 3.0), (0.0, -1.0), "must be > 0"),
        (NON_NEGATIVE, (0.0, 5.0), (-1e-9,), "must be >= 0"),
        (AT_LEAST_ONE, (1, 10**12), (0, -5), "must be >= 1"),
        (FRACTION, (1e-9, 1.0), (0.0, 1.5), "must be in (0, 1]"),
        (SHARE, (0.0, 1.0), (-0.1, 1.1), "must be in [0, 1]"),
        (Bounds(0.0, 10.0, high_open=True), (0.0, 9.99), (10.0,), "must be in [0, 10)"),
        (Bounds(high=5.0), (-3.0, 5.0), (5.5,), "must be <= 5"),
    ],
)
def test_a_number_is_within_its_bounds_or_told_why(
    bounds: Bounds, inside: tuple[float, ...], outside: tuple[float, ...], problem: str
) -> None:
    assert all(bounds.problem(value) is None for value in inside)
    assert {bounds.problem(value) for value in outside} == {problem}


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_infinities_are_never_within_bounds(value: float) -> None:
    """NaN passes every comparison-based check by failing it; inf is endless."""
    assert POSITIVE.problem(value) == "must be a finite number > 0"
    assert Bounds().problem(value) == "must be a finite number"
    assert Bounds().problem(1e308) is None


@dataclass
class _Entry:
    rate: float
    price: float | None = None


def test_check_fields_names_the_source_and_the_first_bad_key() -> None:
    bounds = {"rate": POSITIVE, "price": NON_NEGATIVE}
    check_fields(_Entry(1.0), bounds, "f.yaml")  # an unset field passes
    with pytest.raises(ConfigError) as error:
        check_fields(_Entry(1.0, -2.0), bounds, "f.yaml", "pools[3]")
    assert str(error.value) == "f.yaml: pools[3].price: must be >= 0"
    with pytest.raises(ConfigError, match=r"^f\.yaml: rate: must be a finite number > 0$"):
        check_fields(_Entry(math.nan), bounds, "f.yaml")
