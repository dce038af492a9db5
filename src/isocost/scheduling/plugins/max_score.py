"""``max-score-picker``: the candidate with the highest weighted score.

Formula: ``argmax_r total_r``; ties (equal totals) go to the candidate with the highest
rendezvous hash of the request id, so equal replicas share ties evenly yet the same
request always lands on the same replica (deterministic, no RNG). Inputs: the totals and
the request id. Parameters: none.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from isocost.scheduling.interface import Context
from isocost.scheduling.plugins._base import NoParams, PluginKind, rendezvous
from isocost.scheduling.timing import FloatArray

TYPE = "max-score-picker"


class MaxScorePicker:
    type_name: ClassVar[str] = TYPE
    kind: ClassVar[PluginKind] = "picker"

    def __init__(self, params: NoParams | None = None) -> None:
        del params

    def pick(self, ctx: Context, total: FloatArray) -> int:
        best = np.flatnonzero(total >= total.max())
        if best.size == 1:
            return int(best[0])
        hashes = rendezvous(ctx.replicas.slots.salt[ctx.idx[best]], ctx.request_hash)
        return int(best[int(np.argmax(hashes))])
