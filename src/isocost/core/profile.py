"""A catalog GPU entry fitted to what one idle replica is measured to do (``isocost profile``).

The built-in catalog prices an engine from datasheet peaks and published efficiencies. An
engine on hardware it does not describe (a CPU, a new accelerator, an unusual build) has
costs of another *shape*, and a correction factor learnt online scales the shape it has:
CPU vLLM serving a 12M-parameter model takes ~105 ms to prefill 600 tokens and ~27 ms when
592 of them are cached, while the model's A100 prices both at its 5 ms chunk overhead, so
a factor of 20 prices a cached prefix at nothing. Measured on an idle replica, the shape is
two lines, each a fixed cost plus a roofline:

* prefill of ``n`` uncached tokens: ``a + max(flops(n) / F, bytes(n) / R)``, ``flops(n) =
  2 P n + A n^2 / 2`` (``P`` active parameters, ``A`` attention FLOPs per token pair),
  ``bytes(n)`` the weights read plus ``n`` tokens of KV: ``F`` is the compute rate the
  engine reaches, ``a`` its fixed cost per request (HTTP, the scheduler, sampling), and
  a short prompt may be bound by reading the weights;
* a decode step of ``b`` sequences holding ``K`` context tokens: ``s + max(bytes(b, K) /
  R, flops(b, K) / F)``: ``R`` the memory rate it reaches, ``s`` its fixed cost per step,
  and a big batch on a slow processor may be bound by compute.

Both lines are fitted at once (``_fit_rates``: neither phase alone pins both rates),
to relative errors, ``a >= s >= 0``, and written back as the catalog's own knobs, so the
cost model, the planner, the gateway and the simulator price the replica with no new
code path: ``bf16_tflops = F / mfu_prefill``, ``hbm_bandwidth = R / mbu_decode`` (the
utilisations stay the base GPU's: only their products with the peaks are measured),
``step_overhead = s``, ``prefill_overhead = a - s``. Memory is sized so that the
ledger's KV pool holds what the engine reports (vLLM's ``cache_config_info``). Where one
rate's term never binds (the memory of a tiny model on a CPU), the rate is the base
GPU's, or the nearest that keeps the term from binding: a price, not a measurement of
the hardware. Prefills that found part of the prompt cached are not fitted: they check
the fit, since pricing a cached prefix right is the point.

Pure arithmetic; the measuring is ``bench``'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from isocost.core.costmodel import CostModel, EngineLimits
from isocost.core.errors import IsocostError
from isocost.core.hardware import GpuSpec
from isocost.core.models import ModelSpec

__all__ = ["DecodeSample", "PrefillSample", "Profile", "ProfileError", "ProfileRow", "fit_profile"]

_LEAST_OVERHEAD_S = 1e-5  # a step's fixed cost fitted below this is taken as this
# Per squared log-factor from the base GPU's rate, in mean squared relative error: a
# rate 10x off costs as much as fitting 2.3% worse (RMS), a well-measured rate's optimum
# moves by a fraction of a percent.
_PRIOR_PULL = 1e-4
_TYPICAL_MISS = 0.1  # a median relative error above this is reported: noise, not a shape


class ProfileError(IsocostError):
    """The measurements cannot be fitted (too few, or not growing with the work)."""


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One request's prompt of ``new_tokens`` after ``cached_tokens`` found cached: its
    first (and only) output token came ``seconds`` after it was sent."""

    new_tokens: int
    cached_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class DecodeSample:
    """Decode steps of ``batch`` sequences holding ``context_tokens`` between them took
    ``seconds`` each."""

    batch: int
    context_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class ProfileRow:
    """One measurement beside what the fitted entry predicts for it."""

    phase: str  # "prefill", "cached" (a prompt found partly cached) or "decode"
    size: int  # new prompt tokens, or the batch
    context_tokens: int  # cached tokens, or the batch's context
    measured_s: float
    modelled_s: float  # by the fitted entry
    base_s: float  # by the GPU it started from: how far off the catalog was
    fitted: bool  # False: a check the fit did not see

    @property
    def error(self) -> float:
        return (self.modelled_s - self.measured_s) / self.measured_s


@dataclass(frozen=True, slots=True)
class Profile:
    gpu: GpuSpec
    rows: tuple[ProfileRow, ...]
    notes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Phase:
    """One phase's measured times beside the work each did: the FLOPs and bytes the
    roofline prices, one entry per sample."""

    flops: npt.NDArray[np.float64]
    bytes: npt.NDArray[np.float64]
    seconds: npt.NDArray[np.float64]

    def check_grows(self, work: npt.NDArray[np.float64], what: str) -> None:
        if float(self.seconds.max() - self.seconds.min()) <= 0.0 or work.max() <= work.min():
            raise ProfileError(
                f"{what} time does not grow with the work: the measurements are noise "
                "(is the replica idle?)"
            )

    def roofline(
        self, compute_rate: npt.NDArray[np.float64], memory_rate: npt.NDArray[np.float64]
    ) -> npt.NDArray[np.float64]:
        """Seconds each sample's roofline takes, for every pair of rates (a grid)."""
        return np.maximum(
            self.flops / compute_rate[:, None, None], self.bytes / memory_rate[None, :, None]
        )


def _fit_rates(
    prefill: _Phase, decode: _Phase, prior_compute: float, prior_memory: float
) -> tuple[float, float, float, float]:
    """``(compute rate, memory rate, prefill's fixed cost, a step's fixed cost)`` that
    minimise the mean squared relative error of both phases at once: prefill ``a +
    roofline``, decode ``s + roofline``, ``a >= s >= 0`` (a prefill is a step, and a
    fixed cost is never negative). Fitted together because neither phase alone pins
    both rates: a dense model's decode reads nearly the same bytes at every batch, so
    its fixed cost and the weights' read trade off within the noise, and the short
    prompts that prefill reads the weights for are what bound the memory rate. Where
    the measurements still barely tell rates apart, a weak pull towards the base GPU's
    rates decides, not the noise (``_PRIOR_PULL``). The rates are searched on a log
    grid, a factor 1e4 either way of those at which each phase's measured span is all
    work, then on finer grids around the best point; the fixed costs are weighted means."""
    prefill.check_grows(prefill.flops, "prefill")
    decode.check_grows(decode.bytes, "decode step")
    count = len(prefill.seconds) + len(decode.seconds)
    weight_p = 1.0 / prefill.seconds**2 / count
    weight_d = 1.0 / decode.seconds**2 / count

    def errors(
        log_compute: npt.NDArray[np.float64], log_memory: npt.NDArray[np.float64]
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        compute, memory = np.exp(log_compute), np.exp(log_memory)
        rest_p = prefill.seconds - prefill.roofline(compute, memory)
        rest_d = decode.seconds - decode.roofline(compute, memory)
        sum_p, sum_d = rest_p @ weight_p, rest_d @ weight_d
        own_a, own_s = sum_p / weight_p.sum(), sum_d / weight_d.sum()
        shared = np.maximum((sum_p + sum_d) / (weight_p.sum() + weight_d.sum()), 0.0)
        bound = own_a < own_s  # a >= s binds: one fixed cost for both
        a = np.where(bound, shared, np.maximum(own_a, 0.0))
        s = np.where(bound, shared, np.maximum(own_s, 0.0))
        error = ((rest_p - a[..., None]) ** 2) @ weight_p + (
            (rest_d - s[..., None]) ** 2
        ) @ weight_d
        pull = (log_compute[:, None] - math.log(prior_compute)) ** 2 + (
            log_memory[None, :] - math.log(prior_memory)
        ) ** 2
        return error + _PRIOR_PULL * pull, a, s

    def span_guess(work: npt.NDArray[np.float64], phase: _Phase) -> float:
        return math.log(float(work.max() - work.min()) / float(np.ptp(phase.seconds)))

    centre = (span_guess(prefill.flops, prefill), span_guess(decode.bytes, decode))
    half, points = math.log(1e4), 81
    for _ in range(6):  # a coarse grid, then finer ones around its best point
        grids = [np.linspace(c - half, c + half, points) for c in centre]
        error, a, s = errors(grids[0], grids[1])
        i, j = np.unravel_index(int(np.argmin(error)), error.shape)
        centre = (float(grids[0][i]), float(grids[1][j]))
        half, points = 2 * half / (points - 1), 21
    return math.exp(centre[0]), math.exp(centre[1]), float(a[i, j]), float(s[i, j])


def fit_profile(
    model: ModelSpec,
    base: GpuSpec,
    gpu_id: str,
    prefill: Sequence[PrefillSample],
    decode: Sequence[DecodeSample],
    *,
    kv_capacity_tokens: int | None = None,
    limits: EngineLimits | None = None,
    name: str | None = None,
) -> Profile:
    """``base`` with its rates, overheads and memory fitted to the measurements of one
    replica serving ``model`` (module docstring); ProfileError when they cannot be."""
    limits = limits or EngineLimits()
    reference = CostModel(model, base, limits=limits)
    notes: list[str] = []
    uncached = [s for s in prefill if s.cached_tokens == 0]
    if len({s.new_tokens for s in uncached}) < 2:
        raise ProfileError("prefill needs uncached prompts of at least two lengths")
    if len({s.batch for s in decode}) < 2:
        raise ProfileError("decode needs steps measured at at least two batch sizes")

    def weights_read(tokens: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        fractions = [model.expected_weight_fraction_read(int(t)) for t in tokens]
        return reference.weights_bytes * np.array(fractions, dtype=np.float64)

    pairs_flops = model.attention_flops_per_token_pair()
    n = np.array([s.new_tokens for s in uncached], dtype=np.float64)
    prefill_s = np.array([s.seconds for s in uncached])
    prefill_flops = 2.0 * model.active_params * n + pairs_flops * n * n / 2
    prefill_bytes = weights_read(n) + reference.kv_bytes_per_token * n
    batch = np.array([s.batch for s in decode], dtype=np.float64)
    context = np.array([s.context_tokens for s in decode], dtype=np.float64)
    decode_s = np.array([s.seconds for s in decode])
    decode_flops = 2.0 * model.active_params * batch + pairs_flops * context
    decode_bytes = weights_read(batch) + reference.kv_bytes_per_token * context
    compute_rate, memory_rate, intercept, step_s = _fit_rates(
        _Phase(prefill_flops, prefill_bytes, prefill_s),
        _Phase(decode_flops, decode_bytes, decode_s),
        base.bf16_flops * base.mfu_prefill,
        base.hbm_bandwidth_bytes_per_s * base.mbu_decode,
    )
    step_s = max(step_s, _LEAST_OVERHEAD_S)
    prefill_overhead = max(intercept - step_s, 0.0)
    memory_bytes = base.memory_bytes
    if kv_capacity_tokens is not None and kv_capacity_tokens > 0:
        ledger = reference.ledger
        fixed = ledger.usable_bytes - ledger.kv_pool_bytes  # weights, activations, context
        pool = kv_capacity_tokens * reference.kv_bytes_per_token_per_gpu
        memory_bytes = int((pool + fixed) / limits.gpu_memory_utilization) + 1
    else:
        notes.append(f"the engine did not say its KV capacity: memory kept at {base.id}'s")
    fitted = dataclasses.replace(
        base,
        id=gpu_id.lower(),
        name=name or gpu_id,
        memory_bytes=memory_bytes,
        hbm_bandwidth_bytes_per_s=memory_rate / base.mbu_decode,
        bf16_flops=compute_rate / base.mfu_prefill,
        fp8_flops=None,
        step_overhead_s=step_s,
        prefill_overhead_s=prefill_overhead,
        kernel_s_per_layer=0.0,
        gemm_half_rate_tokens=0.0,
        elementwise_io_per_layer=0.0,
    )
    priced = CostModel(model, fitted, limits=limits)
    rows = [
        ProfileRow(
            "prefill" if s.cached_tokens == 0 else "cached",
            s.new_tokens,
            s.cached_tokens,
            s.seconds,
            priced.prefill_time_s(s.new_tokens, s.cached_tokens),
            reference.prefill_time_s(s.new_tokens, s.cached_tokens),
            s.cached_tokens == 0,
        )
        for s in prefill
    ]
    rows += [
        ProfileRow(
            "decode",
            s.batch,
            s.context_tokens,
            s.seconds,
            priced.decode_step_time_s(s.batch, s.context_tokens),
            reference.decode_step_time_s(s.batch, s.context_tokens),
            True,
        )
        for s in decode
    ]
    typical = float(np.median([abs(r.error) for r in rows]))
    if typical > _TYPICAL_MISS:
        notes.append(
            f"the fit misses half of the measurements by more than {typical:.0%}: "
            "the times do not follow one roofline (was the replica, or this machine, "
            "busy?); profile again before pricing with it"
        )
    return Profile(fitted, tuple(rows), tuple(notes))
