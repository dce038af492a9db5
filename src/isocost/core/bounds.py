"""The range a number from a user must lie in: one check and one wording for every flag
and every file field (catalog, cluster, autoscale, a recording's fleet.json).

Every such number must also be finite. NaN compares false with everything, so it slips
past a ``value > 0`` check and surfaces later as a conversion error or a loop that never
ends; an infinite rate, delay or span makes a run endless.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from isocost.core.errors import ConfigError

__all__ = [
    "AT_LEAST_ONE",
    "FRACTION",
    "NON_NEGATIVE",
    "POSITIVE",
    "SHARE",
    "Bounds",
    "check_fields",
]


@dataclass(frozen=True, slots=True)
class Bounds:
    """A finite number in ``[low, high]``; ``low_open`` / ``high_open`` leave an end out."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def problem(self, value: float) -> str | None:
        """What is wrong with ``value`` ("must be a finite number > 0"), or None."""
        if not math.isfinite(value):
            return f"must be a finite number {self.describe()}".rstrip()
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return None if above and below else f"must be {self.describe()}"

    def describe(self) -> str:
        """The range in words: ``> 0``, ``in (0, 1]``; empty for any finite number."""
        if math.isinf(self.low) and math.isinf(self.high):
            return ""
        if math.isinf(self.high):
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if math.isinf(self.low):
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {left}{self.low:g}, {self.high:g}{right}"


POSITIVE = Bounds(0.0, low_open=True)
NON_NEGATIVE = Bounds(0.0)
AT_LEAST_ONE = Bounds(1.0)
FRACTION = Bounds(0.0, 1.0, low_open=True)  # a utilisation: (0, 1]
SHARE = Bounds(0.0, 1.0)  # a probability or share: [0, 1]


def check_fields(entry: object, bounds: Mapping[str, Bounds], source: str, where: str = "") -> None:
    """A ConfigError naming ``source`` and the key (under ``where``) of the first of
    ``entry``'s fields outside its bounds; a field left unset (None) passes."""
    for key, bound in bounds.items():
        value = getattr(entry, key)
        if value is not None and (problem := bound.problem(value)) is not None:
            raise ConfigError(source, problem, f"{where}.{key}" if where else key)
