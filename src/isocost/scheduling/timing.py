"""The cost model in a form numpy can evaluate for a thousand replicas at once.

``CostModel.step_time_s`` is a roofline with a ``max`` and per-chunk loops: exact, but a
Python call per replica. A scheduler that prices every replica for every request needs
the same numbers as array arithmetic, so each replica's cost model is reduced, once when
the replica joins, to a handful of coefficients fitted at sample points of the real
``CostModel``:

* prefill of ``n`` new tokens after ``c`` cached ones, in chunks of ``C`` tokens::

      T_pre(n, c) = max(ceil(n / C) * a + beta * n + gamma * n * (c + n / 2),
                        ceil(n / C) * floor)

  (``a`` fixed cost per chunk, ``beta`` per token, ``gamma`` per attention pair, the pair
  term summing exactly over chunks; ``floor`` the memory-bound time of a tiny chunk,
  which reads all weights however few tokens it computes), plus ``r`` per request
  (``prefill_per_request_s``: 0 in the roofline; ``scheduling.prefillfit`` learns it where
  an engine spends time per request, and ``predict`` charges it for each queued one), plus
  ``s`` per sequence already decoding there (``prefill_per_running_s``: the first token
  comes out of a step that also decodes every running sequence; 0 in the roofline, where
  a compute-bound prefill chunk carries a few decode tokens for free, but an engine with a
  host cost per sequence and step, CPU vLLM, pays it, and ``prefillfit`` learns it);
* one decode step of ``b`` sequences holding ``K`` context tokens::

      T_step(b, K) = max(m0 + mk * K + mb * b,  c0 + cb * b)

  (the memory line: weights plus KV read, the compute line: matmul FLOPs).

Both lines include the host and tensor-parallel overheads. The fit is exact at its sample
points and within a few percent elsewhere for dense models (tested); for MoE models the
memory line is linear in ``b`` where the true expert-read fraction is concave, so it
over-prices large memory-bound batches slightly.

Each formula is written once (``_t_pre``, ``_t_step``) over operands that are either numpy
arrays (``prefill_s`` / ``decode_step_s``: every replica at once) or Python floats
(``StepCoefficients.prefill_s`` / ``.decode_step_s``: one replica, where numpy's per-call
overhead would cost more than the arithmetic); both give bit-identical results.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from isocost.core.costmodel import CostModel

__all__ = ["CoefficientArrays", "StepCoefficients", "decode_step_s", "prefill_s"]

FloatArray = npt.NDArray[np.float64]

_P1, _P2, _PC = 1024, 2048, 8192  # prefill sample points: new tokens, cached context
_KB = 1_000_000  # decode sample: context tokens
_BM = 16  # decode sample: a memory-bound batch
_BC1, _BC2 = 4096, 8192  # decode samples: compute-bound batches


@dataclass(frozen=True, slots=True)
class StepCoefficients:
    """Fitted timing coefficients of one replica (seconds; see the module docstring)."""

    prefill_chunk_tokens: int
    prefill_per_chunk_s: float
    prefill_per_token_s: float
    prefill_per_pair_s: float
    prefill_floor_s: float
    decode_fixed_s: float  # m0
    decode_per_context_token_s: float  # mk
    decode_per_seq_memory_s: float  # mb
    decode_compute_fixed_s: float  # c0
    decode_per_seq_compute_s: float  # cb
    prefill_per_request_s: float = 0.0  # r
    prefill_per_running_s: float = 0.0  # s

    @classmethod
    def fit(cls, cost_model: CostModel) -> StepCoefficients:
        step = cost_model.step_time_s
        s1, s2, s3 = step(_P1), step(_P2), step(_P1, _PC)
        gamma = max((s3 - s1) / (_P1 * _PC), 0.0)
        pairs1, pairs2 = _P1 * _P1 / 2, _P2 * _P2 / 2
        beta = max((s2 - s1 - gamma * (pairs2 - pairs1)) / (_P2 - _P1), 0.0)
        a = max(s1 - beta * _P1 - gamma * pairs1, 0.0)
        d1 = step(decode_seqs=1)
        mk = max((step(decode_seqs=1, decode_context_tokens=_KB) - d1) / _KB, 0.0)
        mb = max((step(decode_seqs=_BM) - d1) / (_BM - 1), 0.0)
        m0 = d1 - mb
        c1, c2 = step(decode_seqs=_BC1), step(decode_seqs=_BC2)
        cb = max((c2 - c1) / (_BC2 - _BC1), 0.0)
        return cls(
            prefill_chunk_tokens=cost_model.limits.max_num_batched_tokens,
            prefill_per_chunk_s=a,
            prefill_per_token_s=beta,
            prefill_per_pair_s=gamma,
            prefill_floor_s=step(1),
            decode_fixed_s=m0,
            decode_per_context_token_s=mk,
            decode_per_seq_memory_s=mb,
            decode_compute_fixed_s=c1 - cb * _BC1,
            decode_per_seq_compute_s=cb,
        )

    def prefill_s(self, new_tokens: float, cached_tokens: float) -> float:
        """``T_pre`` of this replica (0 when there is nothing new to prefill)."""
        return float(
            _t_pre(
                max(new_tokens, 0.0),
                cached_tokens,
                float(max(self.prefill_chunk_tokens, 1)),
                self.prefill_per_chunk_s,
                self.prefill_per_token_s,
                self.prefill_per_pair_s,
                self.prefill_floor_s,
                max,
                math.ceil,
            )
        )

    def decode_step_s(self, batch: float, context_tokens: float) -> float:
        """``T_step`` of this replica (callers pass ``batch >= 1``)."""
        return float(
            _t_step(
                batch,
                context_tokens,
                self.decode_fixed_s,
                self.decode_per_context_token_s,
                self.decode_per_seq_memory_s,
                self.decode_compute_fixed_s,
                self.decode_per_seq_compute_s,
                max,
            )
        )


@dataclass(frozen=True, slots=True)
class CoefficientArrays:
    """The coefficients of many replicas, one array per field (indexed by replica slot)."""

    chunk_tokens: FloatArray
    per_chunk_s: FloatArray
    per_token_s: FloatArray
    per_pair_s: FloatArray
    floor_s: FloatArray
    decode_fixed_s: FloatArray
    per_context_token_s: FloatArray
    per_seq_memory_s: FloatArray
    compute_fixed_s: FloatArray
    per_seq_compute_s: FloatArray
    per_request_s: FloatArray
    per_running_s: FloatArray

    @classmethod
    def zeros(cls, size: int) -> CoefficientArrays:
        return cls(*(np.zeros(size) for _ in range(12)))

    def grown(self, size: int) -> CoefficientArrays:
        def grow(a: FloatArray) -> FloatArray:
            out = np.zeros(size)
            out[: a.size] = a
            return out

        return CoefficientArrays(
            grow(self.chunk_tokens),
            grow(self.per_chunk_s),
            grow(self.per_token_s),
            grow(self.per_pair_s),
            grow(self.floor_s),
            grow(self.decode_fixed_s),
            grow(self.per_context_token_s),
            grow(self.per_seq_memory_s),
            grow(self.compute_fixed_s),
            grow(self.per_seq_compute_s),
            grow(self.per_request_s),
            grow(self.per_running_s),
        )

    def set(self, slot: int, c: StepCoefficients) -> None:
        self.chunk_tokens[slot] = max(c.prefill_chunk_tokens, 1)
        self.per_chunk_s[slot] = c.prefill_per_chunk_s
        self.per_token_s[slot] = c.prefill_per_token_s
        self.per_pair_s[slot] = c.prefill_per_pair_s
        self.floor_s[slot] = c.prefill_floor_s
        self.decode_fixed_s[slot] = c.decode_fixed_s
        self.per_context_token_s[slot] = c.decode_per_context_token_s
        self.per_seq_memory_s[slot] = c.decode_per_seq_memory_s
        self.compute_fixed_s[slot] = c.decode_compute_fixed_s
        self.per_seq_compute_s[slot] = c.decode_per_seq_compute_s
        self.per_request_s[slot] = c.prefill_per_request_s
        self.per_running_s[slot] = c.prefill_per_running_s


def prefill_s(
    coef: CoefficientArrays,
    new_tokens: FloatArray | float,
    cached_tokens: FloatArray | float,
    idx: npt.NDArray[np.int64] | slice = slice(None),
) -> FloatArray:
    """``T_pre`` per replica in ``idx`` (0 where there is nothing new to prefill)."""
    out = _t_pre(
        np.maximum(new_tokens, 0.0),
        cached_tokens,
        coef.chunk_tokens[idx],
        coef.per_chunk_s[idx],
        coef.per_token_s[idx],
        coef.per_pair_s[idx],
        coef.floor_s[idx],
        np.maximum,
        np.ceil,
    )
    return np.asarray(out, dtype=np.float64)


def decode_step_s(
    coef: CoefficientArrays,
    batch: FloatArray | float,
    context_tokens: FloatArray | float,
    idx: npt.NDArray[np.int64] | slice = slice(None),
) -> FloatArray:
    """``T_step`` per replica in ``idx`` (callers pass ``batch >= 1``)."""
    out = _t_step(
        batch,
        context_tokens,
        coef.decode_fixed_s[idx],
        coef.per_context_token_s[idx],
        coef.per_seq_memory_s[idx],
        coef.compute_fixed_s[idx],
        coef.per_seq_compute_s[idx],
        np.maximum,
    )
    return np.asarray(out, dtype=np.float64)


# The formulas, on floats or arrays alike (``maximum``/``ceil`` of the operands' kind).
_Max = Callable[[Any, Any], Any]


def _t_pre(
    n: Any,
    cached: Any,
    chunk: Any,
    per_chunk: Any,
    per_token: Any,
    per_pair: Any,
    floor: Any,
    maximum: _Max,
    ceil: Callable[[Any], Any],
) -> Any:
    chunks = ceil(n / chunk)
    compute = chunks * per_chunk + n * per_token + n * (cached + n / 2.0) * per_pair
    return maximum(compute, chunks * floor)


def _t_step(
    batch: Any,
    context: Any,
    fixed: Any,
    per_context: Any,
    per_seq_memory: Any,
    compute_fixed: Any,
    per_seq_compute: Any,
    maximum: _Max,
) -> Any:
    memory = fixed + context * per_context + batch * per_seq_memory
    compute = compute_fixed + batch * per_seq_compute
    return maximum(memory, compute)
