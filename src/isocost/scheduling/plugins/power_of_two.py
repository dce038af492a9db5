"""``power-of-two-picker``: the better-scored of ``choices`` random candidates.

Formula: sample ``choices`` distinct candidates uniformly (injected ``random.Random``),
return the one with the highest total score, the first sampled on ties (Mitzenmacher's
power of two choices; SGLang router's ``power_of_two`` with the least-request scorer).
Parameters: ``choices`` (int, 2..16, default 2).
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from isocost.scheduling.interface import Context
from isocost.scheduling.plugins._base import PluginKind
from isocost.scheduling.timing import FloatArray

TYPE = "power-of-two-picker"


class Params(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    choices: int = 2


class PowerOfTwoPicker:
    type_name: ClassVar[str] = TYPE
    kind: ClassVar[PluginKind] = "picker"

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or Params()
        if not 2 <= self.params.choices <= 16:
            raise ValueError("choices must be in 2..16")

    def pick(self, ctx: Context, total: FloatArray) -> int:
        count = total.size
        sample = ctx.rng.sample(range(count), min(self.params.choices, count))
        return max(sample, key=lambda i: float(total[i]))
