"""Online calibration: per-replica correction factors learned from what the streams show.

Learned per replica: ``ttft_factor`` and ``itl_factor``, observed / predicted TTFT and
inter-token time (1.0 = the cost model is right; 2.0 = this replica is twice as slow as
its spec), learned as geometric EWMAs (in log space, so an outlier cannot make a replica
look slower than its twin), each observation counted as at most 2x off the current
estimate (``_LOG_SURPRISE``). Why the clip: in the simulator (engines on the very cost
model), 24% of short prompts sent with nothing queued ahead answered 0.1-1 s late, as
a long prompt sent just after one joined its step and filled the chunk; those ratios of
2-20x held the TTFT factors at 1.1-2.3 where the model was right, and admission refused
requests it predicted late that the replay showed on time. Clipped, the audit's false
rejections on 16 x A100 at 8.46 req/s (the Mooncake trace's 90% point before) fell from
3.5% to 2.3% of arrivals, while a steady slowdown is still learned (at most 2x per
observation, then as before). A TTFT observation weighs by the prefill's share of its
prediction (time queued says more about the queue model than about the replica); a
stream's inter-token time, over windows of ``ITL_WINDOW_TOKENS`` tokens, is compared with
its decode steps plus the prefills of the requests that started meanwhile (each prefill
stalls every running stream), each prefill priced alone: priced as one prompt of their
summed tokens, whose attention grows with the square of the sum, the stalls were
overstated the more prompts started during a stream, and on one replica running the very
cost model (arXiv lengths) the ITL factor fell to 0.90, 0.60 and 0.26 at 1, 2 and 3 req/s
(prediction error 14%, 44%, 78%); priced alone it stays at 1.03, 1.00 and 0.79 (2%, 5%,
10%).
Waiting is evidence too: ``ttft_factor_at`` raises a replica's TTFT factor to (elapsed /
predicted) of its oldest request still awaiting a first token, so a replica that slowed
down is priced before it answers. A request not streamed shows no first token: it is
never that evidence and never teaches the TTFT factor; its end-to-end time, less the TTFT
the factor predicts, teaches the ITL factor.

Pooled by hardware class. A factor is its class's (replicas of the same model, GPU, tensor
parallelism and weight precision) times the replica's own deviation from it, shrunk by
the replica's evidence; until a replica has ITL evidence of its own, its ITL factor
borrows its TTFT deviation::

    log factor_r = log class_c + w_r * deviation_r + (1 - w_r) * w'_r * deviation'_r
    w_r = n_r / (n_r + PRIOR_SAMPLES)        ' : TTFT's (for the ITL factor; 0 for TTFT)

Every observation teaches the class (an EWMA over its members' observations) and the
replica's deviation (the mean of its observations over the class's figure: a plain mean
for its first ``1 / factor_alpha`` observations, an EWMA after); ``n_r`` counts the
replica's observations and fades with time constant ``FRESHNESS_TAU_S`` since its latest
one. Why: with one factor per replica learned alone, the first replicas seen to be
faster than the analytic model look cheapest, take all traffic, and the rest never learn
(four identical replicas taking 0.35x the model's time, 240 requests at 2 req/s behind
equal-cost: 134, 106, 0 and 0, two factors left at 1.0). Pooled, identical
replicas are priced alike from the first observation on; a replica added to a warm pool
starts from what its class has learned; a new class starts from what the whole pool
learned (an engine the catalog does not describe, CPU vLLM say, is off for every replica
alike); and a replica that stopped getting traffic (after a bad spell) drifts back to its
class's figure, and equal-cost tries it again (``stale``), which costs about one request
per such replica per ``FRESHNESS_TAU_S`` at most.

Why a mean, and why borrow: a replica unlike its class (a degraded node, 4x slow) must be
learned from its first few observations, and its slowness shows in its first tokens long
before its streams end. Not the other way round: a streamed request's first token comes
before its stream's tokens, and one not streamed shows no first token, whose TTFT the
ITL would then guess. Learned as an EWMA from the start, its deviation was shrunk twice
(by ``w_r`` and by the EWMA's slow start): on 14 A100 + 2 slowed 4x (the Mooncake trace,
9.5 req/s) the slowed replicas' ITL factors stayed near 1 for the run's first 90 s while
they took up to 19 streams each, and 105 of the 1,008 requests sent there missed their
TPOT target (llm-d's routing with the same admission: 52 of 782). Learned so, with each
stalling prefill priced alone too (above), 13 of 1,062 (``isocost sim``; README "On equal
terms" has every regime).

Prediction error: each observation's error against the prediction made with the factor
before it, ``|predicted - observed| / observed``, feeds a per-replica EWMA over about
``ERROR_WINDOW`` observations: ``ttft_error`` and ``itl_error``, the MAPE the gateway reports.

``ReplicaSet`` (``scheduling.state``) calls ``join`` when it adds a replica and the
``observe_*`` methods from its hooks; the predictions they compare with are the
uncorrected ones the record carries from dispatch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from isocost.scheduling.contract import InFlight
from isocost.scheduling.predict import SlotKey
from isocost.scheduling.slots import BoolArray, SlotArrays
from isocost.scheduling.timing import FloatArray, StepCoefficients

__all__ = ["ERROR_WINDOW", "FRESHNESS_TAU_S", "ITL_WINDOW_TOKENS", "PRIOR_SAMPLES", "Calibration"]

_FACTOR_MIN, _FACTOR_MAX = 0.05, 20.0  # bounds of one observed/predicted ratio
_LOG_SURPRISE = math.log(2.0)  # one observation counts as at most 2x off the estimate
PRIOR_SAMPLES = 2.0  # observations after which a replica's own deviation weighs half
FRESHNESS_TAU_S = 300.0  # how fast a replica's own evidence fades once it gets none
ERROR_WINDOW = 50  # observations the prediction-error EWMA spans, about
_ERROR_ALPHA = 2.0 / (ERROR_WINDOW + 1)
# A stream's tokens taught as one ITL observation: enough to span a burst, few enough that
# a 256-token reply teaches 16 times.
ITL_WINDOW_TOKENS = 16
# (slot, now) -> the uncorrected decode step of the slot's current batch
StepNow = Callable[[int, float], float]


class _Learned(SlotArrays):
    """One learned quantity (TTFT or ITL) of every slot: the effective ``factor`` and what
    it is made of (module docstring), with the class and pool estimates behind it."""

    FRESH: ClassVar[Mapping[str, float]] = {
        "deviation": 0.0,  # log of the replica's own estimate over its class's
        "samples": 0.0,  # its (weighted) observation count
        "seen_s": -math.inf,  # its latest observation
        "error": 0.0,  # EWMA of |predicted - observed| / observed
        "errors": 0.0,  # observations in it
    }

    deviation: FloatArray
    samples: FloatArray
    seen_s: FloatArray
    error: FloatArray
    errors: FloatArray

    def __init__(self) -> None:
        super().__init__()
        self.class_log: list[float] = []  # per hardware class: log of its factor
        self.pool_log = 0.0  # every observation's: where a new class starts
        self.partner: _Learned | None = None  # whose deviation it borrows (below)
        self.version = 0  # bumped by every change the factors depend on
        self._factor = np.ones(0)
        self._computed = (-1, -1)  # the versions (own, partner's) ``_factor`` is of
        self._clock = 0.0

    def grow(self, size: int) -> None:
        super().grow(size)
        self.version += 1

    def reset(self, slot: int) -> None:
        super().reset(slot)
        self.version += 1

    def new_class(self) -> None:
        self.class_log.append(self.pool_log)

    def own(self) -> tuple[FloatArray, FloatArray]:
        """Per slot, the weight of the replica's own evidence and its log deviation so
        weighted."""
        fade = np.exp(np.minimum(self.seen_s - self._clock, 0.0) / FRESHNESS_TAU_S)
        evidence = self.samples * fade
        weight = evidence / (evidence + PRIOR_SAMPLES)
        return np.asarray(weight, dtype=np.float64), np.asarray(weight * self.deviation)

    def factor(self, class_id: npt.NDArray[np.int64]) -> FloatArray:
        """The effective factor of every slot (recomputed after an observation)."""
        partner = self.partner
        versions = (self.version, -1 if partner is None else partner.version)
        if versions != self._computed:
            weight, deviation = self.own()
            if partner is not None:
                deviation = deviation + (1.0 - weight) * partner.own()[1]
            classes = np.asarray(self.class_log or [0.0], dtype=np.float64)
            self._factor = np.asarray(np.exp(classes[class_id] + deviation), dtype=np.float64)
            self._computed = versions
        return self._factor

    def observe(
        self,
        slot: int,
        class_id: int,
        observed_s: float,
        predicted_s: float,
        now: float,
        alpha: float,
        weight: float,
    ) -> None:
        if predicted_s <= 0.0 or observed_s < 0.0:
            return
        factor = self._effective(slot, class_id)
        if observed_s > 0.0:  # the error of the prediction made with the factor so far
            corrected = predicted_s * factor
            errors = self.errors[slot] = self.errors[slot] + 1.0
            step = max(_ERROR_ALPHA, 1.0 / errors)
            self.error[slot] += step * (abs(corrected - observed_s) / observed_s - self.error[slot])
        # In log space (geometric EWMAs), each ratio clipped to 2x either side of the
        # factor: one observation 20x off (a stall the model did not foresee) moves a
        # factor by 2**alpha, not by 20**alpha, nor by +19*alpha as an arithmetic EWMA.
        x = math.log(min(max(observed_s / predicted_s, _FACTOR_MIN), _FACTOR_MAX))
        estimate = math.log(factor)
        x = min(max(x, estimate - _LOG_SURPRISE), estimate + _LOG_SURPRISE)
        weight = min(max(weight, 0.0), 1.0)
        step = alpha * weight
        if step <= 0.0:
            return
        self.class_log[class_id] += step * (x - self.class_log[class_id])
        evidence = self._evidence(slot, now)
        own_step = max(step, weight / (evidence + weight))
        self.deviation[slot] += own_step * (x - self.class_log[class_id] - self.deviation[slot])
        self.samples[slot] = evidence + weight
        self.seen_s[slot] = now
        self.pool_log += step * (x - self.pool_log)
        self._clock = max(self._clock, now)
        self.version += 1

    def _evidence(self, slot: int, now: float) -> float:
        age = max(now - float(self.seen_s[slot]), 0.0)
        return float(self.samples[slot]) * math.exp(-age / FRESHNESS_TAU_S)

    def _own_at(self, slot: int) -> tuple[float, float]:
        """``own()`` of one slot."""
        evidence = self._evidence(slot, self._clock)
        weight = evidence / (evidence + PRIOR_SAMPLES)
        return weight, weight * float(self.deviation[slot])

    def _effective(self, slot: int, class_id: int) -> float:
        """``factor(...)[slot]`` alone, without recomputing every slot's."""
        weight, deviation = self._own_at(slot)
        if self.partner is not None:
            deviation += (1.0 - weight) * self.partner._own_at(slot)[1]
        return math.exp(self.class_log[class_id] + deviation)


class Calibration(SlotArrays):
    """The per-replica TTFT and ITL factors, their evidence, and how they learn.

    ``factor_alpha`` (0..1): EWMA weight of a new TTFT/ITL observation.
    """

    FRESH: ClassVar[Mapping[str, float]] = {
        "prefill_done_s": 0.0,
        "awaiting_since_s": math.inf,
        "awaiting_ttft_s": 1.0,
        "dispatched_s": -math.inf,
    }

    prefill_done_s: FloatArray  # cumulative predicted prefill seconds of the requests started
    awaiting_since_s: FloatArray  # dispatch of the oldest request awaiting its first token
    awaiting_ttft_s: FloatArray  # its uncorrected predicted TTFT
    dispatched_s: FloatArray  # its latest dispatch

    def __init__(self, factor_alpha: float) -> None:
        if not 0.0 <= factor_alpha <= 1.0:
            raise ValueError("factor_alpha must be in [0, 1]")
        self.ttft = _Learned()
        self.itl = _Learned()
        self.itl.partner = self.ttft
        super().__init__()
        self.factor_alpha = factor_alpha
        # False while the prefill terms are fitted instead (``scheduling.prefillfit``): the
        # TTFT factor stays at 1 and only its prediction error is measured.
        self.learn_ttft_factor = True
        self._classes: dict[str, int] = {}
        self._class_id = np.zeros(0, dtype=np.int64)  # per slot, its hardware class (``join``)

    def grow(self, size: int) -> None:
        super().grow(size)
        self.ttft.grow(size)
        self.itl.grow(size)
        grown = np.zeros(size, dtype=np.int64)
        grown[: self._class_id.size] = self._class_id
        self._class_id = grown

    def reset(self, slot: int) -> None:
        super().reset(slot)
        self.ttft.reset(slot)
        self.itl.reset(slot)

    def join(self, slot: int, hardware_class: str) -> None:
        """``slot`` holds a replica of ``hardware_class``: it starts from the
        class's factors (a new class: from the pool's)."""
        class_id = self._classes.get(hardware_class)
        if class_id is None:
            class_id = self._classes[hardware_class] = len(self._classes)
            self.ttft.new_class()
            self.itl.new_class()
        self._class_id[slot] = class_id
        self.ttft.reset(slot)  # its cached factors are out of date
        self.itl.reset(slot)

    def stale(self, now: float, key: SlotKey) -> BoolArray:
        """The slots ``key`` that were used once but sent nothing for ``FRESHNESS_TAU_S``:
        what is known of them is old (the scorer gives them a chance to be measured again).
        One never used is priced as its class and needs no such chance."""
        dispatched = self.dispatched_s[key]
        return np.asarray(
            np.isfinite(dispatched) & (now - dispatched > FRESHNESS_TAU_S), dtype=bool
        )

    @property
    def ttft_factor(self) -> FloatArray:
        return self.ttft.factor(self._class_id)

    @property
    def itl_factor(self) -> FloatArray:
        return self.itl.factor(self._class_id)

    @property
    def ttft_error(self) -> FloatArray:
        """Per slot, the recent mean absolute percentage error of predicted TTFT (0..)."""
        return self.ttft.error

    @property
    def itl_error(self) -> FloatArray:
        """Per slot, the recent mean absolute percentage error of inter-token time (0..)."""
        return self.itl.error

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

    def prefill_done(self, record: InFlight, coefficients: StepCoefficients) -> None:
        """``record`` started: count its prefill as done (the stall its neighbours'
        streams saw), and mark where its own stream's stalls start. Counted in seconds,
        prompt by prompt: ten prompts prefilled are not one prompt ten times as long
        (attention grows with each prompt's length, not with their sum)."""
        slot = record.slot
        new_tokens = record.prompt_tokens - record.cached_tokens
        self.prefill_done_s[slot] += coefficients.prefill_s(new_tokens, record.cached_tokens)
        record.prefill_mark = self.prefill_done_s[slot]

    def observe_first_token(self, record: InFlight, now: float) -> None:
        """The first token of ``record`` came at ``now``: learn the TTFT factor."""
        slot = record.slot
        # A TTFT spent mostly queued says more about the queue model than about the
        # replica's speed: weigh the observation by the prefill's share of the prediction.
        prefill_share = 1.0 - record.predicted_wait_s / max(record.predicted_ttft_s, 1e-9)
        self._learn(
            self.ttft,
            slot,
            now - record.dispatch_s,
            record.predicted_ttft_s,
            now,
            weight=prefill_share if self.learn_ttft_factor else 0.0,
        )

    def observe_tokens(
        self,
        record: InFlight,
        num_tokens: int,
        now: float,
        step_now: StepNow,
    ) -> None:
        """``num_tokens`` more tokens of the streaming ``record`` came at ``now``, before
        it advances: once its stream has shown ``ITL_WINDOW_TOKENS`` since the last
        lesson, learn the ITL factor from them as one observation. Why not every chunk:
        a server that sends tokens in bursts (an API server starved of CPU, a proxy that
        buffers) makes one gap ~0 and the next long, and learnt gap by gap those are a
        factor clipped at its floor, then its ceiling; two identical CPU vLLM replicas
        learnt 0.09 and 0.59 so, and equal-cost sent 52 of 64 requests to the first. A
        window's seconds are what its tokens took, however they were bunched."""
        if record.last_token_s is None:
            return
        step = step_now(record.slot, now)
        record.itl_window_s += max(now - record.last_token_s, 0.0)
        record.itl_window_predicted_s += num_tokens * step + self._prefill_stall_s(record)
        record.itl_window_tokens += num_tokens
        if record.itl_window_tokens >= ITL_WINDOW_TOKENS:
            self._learn_window(record, now)

    def _learn_window(self, record: InFlight, now: float) -> None:
        """Teach the ITL factor ``record``'s tokens since its last lesson, and start anew.
        Tokens that all came within ``_FACTOR_MIN`` of their predicted time were sent
        together, not made that fast (a whole 8-token reply in one burst, on CPU vLLM):
        they say nothing of the replica's speed and teach nothing."""
        observed, predicted = record.itl_window_s, record.itl_window_predicted_s
        if record.itl_window_tokens > 0 and observed > _FACTOR_MIN * predicted:
            self._learn(self.itl, record.slot, observed, predicted, now)
        record.itl_window_s = record.itl_window_predicted_s = 0.0
        record.itl_window_tokens = 0

    def observe_completion(
        self,
        record: InFlight,
        generated: int,
        now: float,
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
            self._learn_window(record, now)  # streamed with progress hooks: their last window
            return
        if generated > 1:
            # The mean inter-token time since the first token.
            step = (record.predicted_step_s + step_now(slot, now)) / 2.0
            predicted = (generated - 1) * step + self._prefill_stall_s(record)
            self._learn(self.itl, slot, now - first_token_s, predicted, now)

    def _learn(
        self,
        learned: _Learned,
        slot: int,
        observed_s: float,
        predicted_s: float,
        now: float,
        weight: float = 1.0,
    ) -> None:
        learned.observe(
            slot, int(self._class_id[slot]), observed_s, predicted_s, now, self.factor_alpha, weight
        )

    def _prefill_stall_s(self, record: InFlight) -> float:
        """Time the record's stream stalled for other requests' prefills since its last
        observed token (those that started meanwhile); moves the mark."""
        done = float(self.prefill_done_s[record.slot])
        stall = done - record.prefill_mark
        record.prefill_mark = done
        return stall
