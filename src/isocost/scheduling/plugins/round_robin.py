"""``round-robin-picker``: the candidates in turn.

Formula: the first candidate whose slot (the replica's position in the ``ReplicaSet``,
fixed for its lifetime) follows the previously chosen one's, wrapping around, so that
replicas joining, leaving or being filtered out do not reset the rotation. Inputs:
candidate slots. State: the last chosen slot. Parameters: none. O(log n) per pick.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from isocost.scheduling.interface import Context
from isocost.scheduling.plugins._base import NoParams, PluginKind
from isocost.scheduling.timing import FloatArray

TYPE = "round-robin-picker"


class RoundRobinPicker:
    type_name: ClassVar[str] = TYPE
    kind: ClassVar[PluginKind] = "picker"

    def __init__(self, params: NoParams | None = None) -> None:
        del params
        self._last_slot = -1

    def pick(self, ctx: Context, total: FloatArray) -> int:
        position = int(np.searchsorted(ctx.idx, self._last_slot, side="right"))
        if position >= ctx.idx.size:
            position = 0
        self._last_slot = int(ctx.idx[position])
        return position
