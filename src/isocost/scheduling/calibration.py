"""Online calibration: per-replica correction factors learned from what the streams show.

Learned per replica: ``ttft_factor`` and ``itl_factor``, geometric EWMAs of observed /
predicted TTFT and inter-token time (1.0 = the cost model is right; 2.0 = this replica is
twice as slow as its spec; geometric, so an outlier cannot make a replica look slower than
its twin). A TTFT observation weighs by the prefill's share of its prediction (time queued
says more about the queue model than about the replica); a stream's inter-token time is
compared with its decode steps plus the prefills of the requests that started streaming
meanwhile (each prefill stalls every running stream). Waiting is evidence too:
``ttft_factor_at`` raises a replica's TTFT factor to (elapsed / predicted) of its oldest
request still awaiting a first token, so a replica that slowed down is priced before it
answers. A request not streamed shows no first token: it is never that evidence and never
teaches the TTFT factor; its end-to-end time, less the TTFT the factor predicts, teaches
the ITL factor.

``ReplicaSet`` (``scheduling.state``) calls the ``observe_*`` methods from its hooks; the
predictions they compare with are the uncorrected ones the record carries from dispatch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import ClassVar

import numpy as np

from isocost.scheduling.contract import InFlight
from isocost.scheduling.predict import SlotKey
from isocost.scheduling.slots import SlotArrays
from isocost.scheduling.timing import FloatArray, StepCoefficients

__all__ = ["Calibration"]

_FACTOR_MIN, _FACTOR_MAX = 0.05, 20.0  # bounds of one observed/predicted ratio
# (slot, now) -> the uncorrected decode step of the slot's current batch
StepNow = Callable[[int, float], float]


class Calibration(SlotArrays):
    """The per-replica TTFT and ITL factors, their evidence, and how they learn.

    ``factor_alpha`` (0..1): EWMA weight of a new TTFT/ITL observation.
    """

    FRESH: ClassVar[Mapping[str, float]] = {
        "ttft_factor": 1.0,
        "itl_factor": 1.0,
        "prefill_done_tokens": 0.0,
        "awaiting_since_s": math.inf,
        "awaiting_ttft_s": 1.0,
    }

    ttft_factor: FloatArray
    itl_factor: FloatArray
    prefill_done_tokens: FloatArray  # cumulative uncached prompt tokens whose first token came
    awaiting_since_s: FloatArray  # dispatch of the oldest request awaiting its first token
    awaiting_ttft_s: FloatArray  # its uncorrected predicted TTFT

    def __init__(self, factor_alpha: float) -> None:
        if not 0.0 <= factor_alpha <= 1.0:
            raise ValueError("factor_alpha must be in [0, 1]")
        super().__init__()
        self.factor_alpha = factor_alpha

    def ttft_factor_at(self, now: float, key: SlotKey) -> FloatArray:
        """``ttft_factor`` of the slots ``key``, raised to what waiting already proves: the
        oldest request still awaiting its first token has taken (now - dispatch) / predicted
        times its uncorrected prediction at least. A replica that slowed down is seen before
        it answers, instead of looking cheap (and collecting a burst) until it does."""
        overdue = (now - self.awaiting_since_s[key]) / self.awaiting_ttft_s[key]
        return np.asarray(
            np.maximum(self.ttft_factor[key], np.minimum(overdue, _FACTOR_MAX)), dtype=np.float64
        )

    def awaiting(self, slot: int, head: InFlight | None) -> None:
        """Track the oldest request awaiting its first token (``ttft_factor_at``'s evidence)."""
        self.awaiting_since_s[slot] = math.inf if head is None else head.dispatch_s
        self.awaiting_ttft_s[slot] = 1.0 if head is None else max(head.predicted_ttft_s, 1e-9)

    def prefill_done(self, record: InFlight) -> None:
        """``record`` started: count its prefill as done (the stall its neighbours'
        streams saw), and mark where its own stream's stalls start."""
        slot = record.slot
        self.prefill_done_tokens[slot] += record.prompt_tokens - record.cached_tokens
        record.prefill_mark = self.prefill_done_tokens[slot]

    def observe_first_token(self, record: InFlight, now: float) -> None:
        """The first token of ``record`` came at ``now``: learn the TTFT factor."""
        slot = record.slot
        # A TTFT spent mostly queued says more about the queue model than about the
        # replica's speed: weigh the observation by the prefill's share of the prediction.
        prefill_share = 1.0 - record.predicted_wait_s / max(record.predicted_ttft_s, 1e-9)
        self._learn(
            self.ttft_factor,
            slot,
            now - record.dispatch_s,
            record.predicted_ttft_s,
            weight=prefill_share,
        )

    def observe_tokens(
        self,
        record: InFlight,
        num_tokens: int,
        now: float,
        coefficients: StepCoefficients,
        step_now: StepNow,
    ) -> None:
        """``num_tokens`` more tokens of the streaming ``record`` came at ``now``, before
        it advances: learn the ITL factor (``coefficients``: its replica's timing)."""
        if record.last_token_s is not None and now > record.last_token_s:
            step = step_now(record.slot, now)
            predicted = num_tokens * step + self._prefill_stall_s(record, coefficients)
            self._learn(self.itl_factor, record.slot, now - record.last_token_s, predicted)

    def observe_completion(
        self,
        record: InFlight,
        generated: int,
        now: float,
        coefficients: StepCoefficients,
        step_now: StepNow,
    ) -> None:
        """``record`` completed at ``now`` with ``generated`` (> 0) output tokens."""
        slot = record.slot
        first_token_s = record.first_token_s
        if first_token_s is None:
            # Not streamed: only the end-to-end time is known. With no first token seen it
            # says nothing sure of the TTFT (only seen first tokens teach that): the time
            # after its predicted start is taken as its decode.
            if record.started_s is None or record.predicted_start_s is None:
                return  # it ended before it was even taken to start
            first_token_s = record.predicted_start_s
        elif record.last_token_s != first_token_s:
            return  # streamed with progress hooks: observe_tokens learnt from them
        if generated > 1:
            # The mean inter-token time since the first token.
            step = (record.predicted_step_s + step_now(slot, now)) / 2.0
            predicted = (generated - 1) * step + self._prefill_stall_s(record, coefficients)
            self._learn(self.itl_factor, slot, now - first_token_s, predicted)

    def _learn(
        self,
        factors: FloatArray,
        slot: int,
        observed_s: float,
        predicted_s: float,
        weight: float = 1.0,
    ) -> None:
        if predicted_s <= 0.0 or observed_s < 0.0:
            return
        # In log space (a geometric EWMA): factors multiply, and one observation 20x off
        # (a stall the model did not foresee) moves the factor by 20**alpha, not by +19*alpha.
        ratio = min(max(observed_s / predicted_s, _FACTOR_MIN), _FACTOR_MAX)
        step = self.factor_alpha * min(max(weight, 0.0), 1.0)
        factors[slot] *= (ratio / factors[slot]) ** step

    def _prefill_stall_s(self, record: InFlight, coefficients: StepCoefficients) -> float:
        """Time the record's stream stalled for other requests' prefills since its last
        observed token (those whose first token arrived meanwhile); moves the mark."""
        done = float(self.prefill_done_tokens[record.slot])
        stall = coefficients.prefill_s(done - record.prefill_mark, 0.0)
        record.prefill_mark = done
        return stall
