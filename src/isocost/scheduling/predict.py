"""Latency predictions shared by the shadow state, the equal-cost scorer and admission.

For a request with ``n`` prompt tokens of which ``c`` are cached on a replica, and ``m``
expected output tokens, given the replica's effective load (``Load``) and fitted timing
coefficients (``timing``)::

    wait      = T_pre(Q, 0) + kv_wait            Q = queued (uncached) prefill tokens
    kv_wait   = max(kv_used + n - kv_cap, 0) * mean_remaining_s / K
    prefill   = T_pre(n - c, c)
    ttft      = ttft_factor * (wait + prefill)
    step      = T_step(b + 1, K + n + m / 2)     b running sequences over K context tokens
    decode    = itl_factor * m * step

``kv_wait`` is the time for running requests to free the KV tokens the prompt lacks:
running requests free their ``K`` tokens over their mean remaining time
``mean_remaining_s = (R / b) * T_step(b, K)`` (``R`` = their remaining decode tokens).
Every function is vectorised over the replica slots in ``idx``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from isocost.scheduling.timing import CoefficientArrays, FloatArray, decode_step_s, prefill_s

__all__ = ["Load", "Prediction", "predict"]

IndexArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Load:
    """Effective load of the replicas in ``idx``: local shadow state blended with scrapes."""

    idx: IndexArray
    waiting: FloatArray  # requests queued for prefill
    running: FloatArray  # sequences decoding
    queued_prefill_tokens: FloatArray
    context_tokens: FloatArray  # total context of the running sequences (K)
    remaining_decode_tokens: FloatArray  # R
    kv_used_tokens: FloatArray
    kv_capacity_tokens: FloatArray

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
    """Per-replica predicted times for one request, in seconds (aligned with ``Load.idx``)."""

    wait_s: FloatArray
    prefill_s: FloatArray
    ttft_s: FloatArray
    step_s: FloatArray  # one decode step with the request in the batch (uncorrected)
    base_step_s: FloatArray  # one decode step without it (uncorrected)
    decode_s: FloatArray
    output_tokens: float

    @property
    def e2e_s(self) -> FloatArray:
        return np.asarray(self.ttft_s + self.decode_s, dtype=np.float64)


def predict(
    coef: CoefficientArrays,
    load: Load,
    prompt_tokens: float,
    cached_tokens: FloatArray,
    output_tokens: float,
    ttft_factor: FloatArray,
    itl_factor: FloatArray,
) -> Prediction:
    """The module formulas for every replica of ``load`` (``cached_tokens`` aligned to it)."""
    idx = load.idx
    n, m = float(prompt_tokens), float(output_tokens)
    b, k = load.running, load.context_tokens
    base_step = decode_step_s(coef, np.maximum(b, 1.0), k, idx)
    mean_remaining_s = load.remaining_decode_tokens / np.maximum(b, 1.0) * base_step
    shortfall = np.maximum(load.kv_used_tokens + n - load.kv_capacity_tokens, 0.0)
    kv_wait = np.where(k > 0, shortfall * mean_remaining_s / np.maximum(k, 1.0), 0.0)
    wait = prefill_s(coef, load.queued_prefill_tokens, 0.0, idx) + kv_wait
    cached = np.minimum(cached_tokens, max(n - 1.0, 0.0))  # the last token is always computed
    pre = prefill_s(coef, n - cached, cached, idx)
    ttft = ttft_factor * (wait + pre)
    step = decode_step_s(coef, b + 1.0, k + n + m / 2.0, idx)
    return Prediction(
        wait_s=np.asarray(ttft_factor * wait, dtype=np.float64),
        prefill_s=np.asarray(ttft_factor * pre, dtype=np.float64),
        ttft_s=np.asarray(ttft, dtype=np.float64),
        step_s=step,
        base_step_s=base_step,
        decode_s=np.asarray(itl_factor * m * step, dtype=np.float64),
        output_tokens=m,
    )
