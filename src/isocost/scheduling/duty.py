"""Prefill duty: the share of each replica's time that prefill chunks will take.

Prefill duty (``scheduling.predict``): the predicted prefill seconds dispatched to each
replica, decayed over ``DUTY_TAU_S``, per second: the share of its time that prefill
chunks will take from the streams decoding there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from isocost.scheduling.predict import DUTY_TAU_S, SlotKey
from isocost.scheduling.slots import SlotArrays
from isocost.scheduling.timing import FloatArray

__all__ = ["PrefillDuty"]


class PrefillDuty(SlotArrays):
    """Predicted prefill seconds dispatched per replica, decayed to the last dispatch."""

    FRESH: ClassVar[Mapping[str, float]] = {"busy_s": 0.0, "busy_at_s": 0.0}

    busy_s: FloatArray  # predicted prefill seconds dispatched, decayed to ...
    busy_at_s: FloatArray  # ... this time (see ``at``)

    def add(self, slot: int, now: float, prefill_s: float) -> None:
        """``prefill_s`` more (corrected) prefill seconds were dispatched to ``slot``."""
        decay = math.exp((self.busy_at_s[slot] - now) / DUTY_TAU_S)
        self.busy_s[slot] = self.busy_s[slot] * decay + prefill_s
        self.busy_at_s[slot] = now

    def at(self, now: float, key: SlotKey | int) -> Any:
        """Share of time the slots ``key`` will spend prefilling, from what was recently
        dispatched to them: predicted prefill seconds, decayed over ``DUTY_TAU_S``."""
        age = now - self.busy_at_s[key]
        return self.busy_s[key] * np.exp(-age / DUTY_TAU_S) / DUTY_TAU_S
