"""Latency predictions shared by the shadow state, the equal-cost scorer and admission.

For a request with ``n`` prompt tokens of which ``c`` are cached on a replica, and ``m``
expected output tokens, given the replica's effective load (``Load``) and fitted timing
coefficients (``timing``)::

    wait      = T_pre(Q, 0) + r * W + kv_wait    Q = queued (uncached) prefill tokens
                                               W = queued requests, r = per request
    kv_wait   = max(kv_used + n - kv_cap, 0) * mean_remaining_s / K
    prefill   = T_pre(n - c, c) + r + s * b       s = per running sequence (``timing``)
    ttft      = ttft_factor * (wait + prefill)
    step      = T_step(b + 1, K + n + m / 2)     b running sequences over K context tokens
    stall     = 1 / (1 - min(rho, 0.9))          rho = the replica's prefill duty
    tpot      = itl_factor * step * stall
    decode    = m * tpot
    others    = itl_factor * T_step(b, K) * stall    the running streams' inter-token time
    victims   = b * (1 - exp(-k / mean_m))         k = ttft_factor * prefill / (target - others)

Why ``stall``: with chunked prefill every step that carries a prefill chunk also decodes
one token for each running sequence, so if a share ``rho`` of a replica's time goes to
prefill chunks, a decode step of ``T`` seconds becomes an inter-token time of
``T / (1 - rho)``. ``rho`` is the replica's prefill duty (``ReplicaSet``): the predicted
prefill seconds recently dispatched to it, decayed over ``tau = DUTY_TAU_S`` (about one
reply's decode), per second.

Why ``victims``: the request's own prefill stalls the ``b`` sequences already running
there, not itself. A stream's TPOT is its decode time over its output tokens, so a stall
of ``S`` seconds pushes it past the target exactly when its whole output is shorter than
``k = S / (target - others)`` tokens: a long reply absorbs a stall that ruins a short one.
Output lengths are unknown until the end, and with only their mean ``mean_m`` known the
least-assuming distribution is the exponential, so each running stream is pushed past the
target with probability ``1 - exp(-k / mean_m)`` (all of them when ``others`` is at the
target already). SLO admission admits a request where this expected number of victims is
at most one, the one request it serves (``tpot_victims``). Spreading the stall evenly over
the streams' mean TPOT instead (the earlier rule) refused most long prompts on any replica
with running streams: ``isocost sim --audit-admission`` found 54 of 68 such rejections
false on the Mooncake trace at 2x.

``kv_wait`` is the time for running requests to free the KV tokens the prompt lacks:
running requests free their ``K`` tokens over their mean remaining time
``mean_remaining_s = (R / b) * T_step(b, K)`` (``R`` = their remaining decode tokens).
``predict`` is vectorised over the replica slots in ``key``; ``predict_one`` evaluates the same
formulas (``_times``) on Python floats for one replica (the chosen one), where numpy's
per-call overhead would dominate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from isocost.scheduling.timing import (
    CoefficientArrays,
    FloatArray,
    StepCoefficients,
    decode_step_s,
    prefill_s,
)

__all__ = [
    "DUTY_TAU_S",
    "MAX_TPOT_VICTIMS",
    "Load",
    "Prediction",
    "RawTimes",
    "SlotKey",
    "max_stall_s",
    "predict",
    "predict_one",
    "tpot_victims",
]

IndexArray = npt.NDArray[np.int64]
# Which slots to read: an index array, or a slice when they are one contiguous run (basic
# indexing gives views, where gathering a thousand slots through an array copies them).
SlotKey = IndexArray | slice
_MAX_DUTY = 0.9  # a replica prefilling more than this is priced as if at this share
DUTY_TAU_S = 10.0  # memory of the prefill duty: about one reply's decode
# SLO admission's bound on the running streams a request may push past the TPOT target:
# one, the request it serves (admitting it then does not lower the expected count met).
MAX_TPOT_VICTIMS = 1.0


@dataclass(frozen=True, slots=True)
class Load:
    """Effective load of some replicas (the slots it was read for): local shadow state
    blended with scrapes."""

    waiting: FloatArray  # requests queued for prefill
    running: FloatArray  # sequences decoding
    queued_prefill_tokens: FloatArray
    context_tokens: FloatArray  # total context of the running sequences (K)
    remaining_decode_tokens: FloatArray  # R
    kv_used_tokens: FloatArray
    kv_capacity_tokens: FloatArray
    prefill_duty: FloatArray  # share of the replica's time recently given to prefill

    @property
    def in_flight(self) -> FloatArray:
        return np.asarray(self.waiting + self.running, dtype=np.float64)

    @property
    def kv_usage(self) -> FloatArray:
        return np.asarray(
            np.minimum(self.kv_used_tokens / np.maximum(self.kv_capacity_tokens, 1.0), 1.0),
            dtype=np.float64,
        )


@dataclass(frozen=True, slots=True)
class Prediction:
    """Per-replica predicted times for one request, in seconds (aligned with its ``Load``)."""

    wait_s: FloatArray
    prefill_s: FloatArray
    ttft_s: FloatArray
    step_s: FloatArray  # one decode step with the request in the batch (uncorrected)
    base_step_s: FloatArray  # one decode step without it (uncorrected)
    stall: FloatArray  # inter-token time / decode step (prefill chunks interleaved)
    tpot_s: FloatArray  # its mean inter-token time
    others_itl_s: FloatArray  # the running streams' inter-token time (0: none run)
    decode_s: FloatArray
    output_tokens: float
    uncorrected_wait_s: FloatArray
    uncorrected_prefill_s: FloatArray

    @property
    def e2e_s(self) -> FloatArray:
        return np.asarray(self.ttft_s + self.decode_s, dtype=np.float64)

    def raw_at(self, position: int) -> RawTimes:
        """The uncorrected times of the replica at ``position`` (as ``predict_one`` has them)."""
        return RawTimes(
            float(self.uncorrected_wait_s[position]),
            float(self.uncorrected_prefill_s[position]),
            float(self.step_s[position]),
            float(self.base_step_s[position]),
            float(self.stall[position]),
            self.output_tokens,
        )


@dataclass(frozen=True, slots=True)
class RawTimes:
    """One replica's predicted times for one request, uncorrected (correction factors 1)."""

    wait_s: float
    prefill_s: float
    step_s: float  # one decode step with the request in the batch
    base_step_s: float  # one decode step without it
    stall: float  # inter-token time / decode step (prefill chunks interleaved)
    output_tokens: float

    @property
    def ttft_s(self) -> float:
        return self.wait_s + self.prefill_s

    def corrected(self, ttft_factor: float, itl_factor: float) -> tuple[float, float]:
        """(TTFT, end-to-end) with the replica's correction factors, as ``predict`` has them."""
        ttft = ttft_factor * (self.wait_s + self.prefill_s)
        return ttft, ttft + itl_factor * self.output_tokens * self.step_s * self.stall


def predict_one(
    coef: StepCoefficients,
    load: tuple[float, float, float, float, float, float, float, float],
    prompt_tokens: float,
    cached_tokens: float,
    output_tokens: float,
) -> RawTimes:
    """The module formulas for one replica; ``load`` is (waiting, running, context, queued
    prefill, remaining decode, KV used, KV capacity, prefill duty) as in ``Load``."""
    n, m = float(prompt_tokens), float(output_tokens)
    wait, pre, step, base_step, stall = _times(
        coef.prefill_s,
        coef.decode_step_s,
        max,
        min,
        _if,
        coef.prefill_per_request_s,
        coef.prefill_per_running_s,
        *load,
        n,
        float(cached_tokens),
        m,
    )
    # float(): the load may hold numpy scalars, and a decision must stay JSON-encodable
    return RawTimes(float(wait), float(pre), float(step), float(base_step), float(stall), m)


def predict(
    coef: CoefficientArrays,
    key: SlotKey,
    load: Load,
    prompt_tokens: float,
    cached_tokens: FloatArray,
    output_tokens: float,
    ttft_factor: FloatArray,
    itl_factor: FloatArray,
) -> Prediction:
    """The module formulas for the slots ``key`` whose ``load`` is given (``cached_tokens``
    and the factors aligned to it)."""
    n, m = float(prompt_tokens), float(output_tokens)

    def pre(new: Any, cached: Any) -> FloatArray:
        return prefill_s(coef, new, cached, key)

    def step(batch: Any, context: Any) -> FloatArray:
        return decode_step_s(coef, batch, context, key)

    wait, pre_s, own_step, base_step, stall = _times(
        pre,
        step,
        np.maximum,
        np.minimum,
        np.where,
        coef.per_request_s[key],
        coef.per_running_s[key],
        load.waiting,
        load.running,
        load.context_tokens,
        load.queued_prefill_tokens,
        load.remaining_decode_tokens,
        load.kv_used_tokens,
        load.kv_capacity_tokens,
        load.prefill_duty,
        n,
        cached_tokens,
        m,
    )
    return Prediction(
        wait_s=np.asarray(ttft_factor * wait, dtype=np.float64),
        prefill_s=np.asarray(ttft_factor * pre_s, dtype=np.float64),
        ttft_s=np.asarray(ttft_factor * (wait + pre_s), dtype=np.float64),
        step_s=own_step,
        base_step_s=base_step,
        stall=stall,
        tpot_s=np.asarray(itl_factor * own_step * stall, dtype=np.float64),
        others_itl_s=np.asarray(
            np.where(load.running > 0, itl_factor * base_step * stall, 0.0), dtype=np.float64
        ),
        decode_s=np.asarray(itl_factor * m * own_step * stall, dtype=np.float64),
        output_tokens=m,
        uncorrected_wait_s=np.asarray(wait, dtype=np.float64),
        uncorrected_prefill_s=np.asarray(pre_s, dtype=np.float64),
    )


def tpot_victims(
    running: FloatArray,
    stall_s: FloatArray,
    others_itl_s: FloatArray,
    tpot_target_s: float,
    mean_output_tokens: float,
) -> FloatArray:
    """Expected number of the ``running`` streams that a stall of ``stall_s`` seconds (a
    prefill joining them) pushes past ``tpot_target_s`` (module docstring)."""
    headroom = tpot_target_s - others_itl_s
    tokens = np.where(headroom > 0.0, stall_s / np.maximum(headroom, 1e-12), np.inf)
    share = -np.expm1(-tokens / max(mean_output_tokens, 1.0))
    return np.asarray(np.where(running > 0, running * share, 0.0), dtype=np.float64)


def max_stall_s(
    running: FloatArray, headroom_s: FloatArray, mean_output_tokens: float
) -> FloatArray:
    """The longest stall expected to push at most ``MAX_TPOT_VICTIMS`` of ``running``
    streams, each ``headroom_s`` under its TPOT target, past it: ``tpot_victims`` solved
    for the stall (no bound where no more streams than that run)."""
    share = MAX_TPOT_VICTIMS / np.maximum(running, MAX_TPOT_VICTIMS)
    with np.errstate(divide="ignore", invalid="ignore"):  # share 1: -log1p(-1) = inf
        tokens = -max(mean_output_tokens, 1.0) * np.log1p(-share)
        stall = np.where(headroom_s > 0.0, tokens * headroom_s, 0.0)
    return np.asarray(stall, dtype=np.float64)


def _if(condition: bool, then: float, otherwise: float) -> float:
    return then if condition else otherwise


_Fn = Callable[..., Any]


def _times(
    pre: _Fn,
    step: _Fn,
    maximum: _Fn,
    minimum: _Fn,
    where: _Fn,
    per_request: Any,
    per_running: Any,
    waiting: Any,
    running: Any,
    context: Any,
    queued_prefill: Any,
    remaining_decode: Any,
    kv_used: Any,
    kv_capacity: Any,
    prefill_duty: Any,
    n: float,
    cached_tokens: Any,
    m: float,
) -> tuple[Any, Any, Any, Any, Any]:
    """(wait, prefill, step, base step, stall), uncorrected, on floats or arrays alike."""
    b, k = running, context
    base_step = step(maximum(b, 1.0), k)
    mean_remaining_s = remaining_decode / maximum(b, 1.0) * base_step
    shortfall = maximum(kv_used + n - kv_capacity, 0.0)
    kv_wait = where(k > 0, shortfall * mean_remaining_s / maximum(k, 1.0), 0.0)
    wait = pre(queued_prefill, 0.0) + per_request * waiting + kv_wait
    cached = minimum(cached_tokens, max(n - 1.0, 0.0))  # the last token is always computed
    prefill = pre(n - cached, cached) + per_request + per_running * b
    stall = 1.0 / (1.0 - minimum(prefill_duty, _MAX_DUTY))
    return wait, prefill, step(b + 1.0, k + n + m / 2.0), base_step, stall
