"""``random-picker``: a random candidate, in proportion to the replicas' static weights.

Formula: ``P(r) = weight_r / sum(weight)`` over the candidates (scores are ignored).
Inputs: ``ReplicaSpec.weight``, the policy's injected ``random.Random`` (deterministic
for a seed). Parameters: none.
"""

from __future__ import annotations

import bisect
from itertools import accumulate
from typing import ClassVar

from isocost.scheduling.interface import Context
from isocost.scheduling.plugins._base import NoParams, PluginKind
from isocost.scheduling.timing import FloatArray

TYPE = "random-picker"


class RandomPicker:
    type_name: ClassVar[str] = TYPE
    kind: ClassVar[PluginKind] = "picker"

    def __init__(self, params: NoParams | None = None) -> None:
        del params

    def pick(self, ctx: Context, total: FloatArray) -> int:
        weights = ctx.replicas.slots.weight[ctx.key].tolist()
        cumulative = list(accumulate(weights))
        point = ctx.rng.random() * cumulative[-1]
        return min(bisect.bisect_right(cumulative, point), len(cumulative) - 1)
