"""The cost model: VRAM ledger and roofline timings for one replica (DESIGN §3).

A replica is one model on ``t`` GPUs of one kind (tensor parallel inside a node). Every
timing is a roofline: a step costs the larger of its compute time and its memory time,
plus the tensor-parallel all-reduces and a fixed host overhead.

* KV per token (whole replica): ``2 * L * h_kv * d * b_kv`` (MLA: ``L * (r_kv + d_rope) * b_kv``).
  On one GPU of a TP group the KV heads are sharded, or replicated when ``t > h_kv``.
* Weights: ``P_total * b_w``, ``/ t`` per GPU.
* VRAM ledger per GPU: ``C * util - W/t - activations - CUDA context = KV pool``.
* A step that runs ``n`` new prefill tokens (attending to ``c`` cached ones) and ``b`` decode
  sequences over ``K`` context tokens costs::

      flops  = 2 * P_active * (n + b + n_half) + a * (n * (c + n/2) + K)   a = FLOPs/pair
      bytes  = W_read(b + n) + kv_tok * (K + c + n)
      T      = max(flops / (t * F * mfu), bytes / (t * BW * mbu)) + layers + tp_comm
               + overheads
      layers = L * (k_layer + (n + b) * e * H * 2 B / (BW * mbu))

  so prefill (``b = 0``) is compute-bound and decode (``n = 0``) memory-bound, and a mixed
  chunked-prefill step falls out of the same formula. ``n_half``, ``k_layer`` and ``e``
  are the GPU's optional shape terms (``GpuSpec``: ``gemm_half_rate_tokens``,
  ``kernel_s_per_layer``, ``elementwise_io_per_layer``), 0 in the built-in catalog.
* ``tp_comm``: two ring all-reduces per layer of the step's hidden states:
  ``2 * L * (latency + 2 * (t-1)/t * tokens * H * 2 B / link_bandwidth)``.

Everything here is pure arithmetic on numbers fixed at construction, cheap enough to call
per candidate replica per request.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from isocost.core.errors import UnknownEntryError
from isocost.core.hardware import GpuSpec
from isocost.core.models import ModelSpec

__all__ = [
    "DTYPE_BYTES",
    "CostModel",
    "DecodeLines",
    "DecodeSeries",
    "EngineLimits",
    "VramLedger",
    "dtype_bytes",
]

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "fp16": 2.0,
    "bf16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}
_ACTIVATION_BYTES = 2  # activations and all-reduce payloads travel in bf16
_LOGIT_BYTES = 4  # the sampler materialises fp32 logits
_GIB = 1024**3
CUDA_CONTEXT_BYTES = 1 * _GIB  # CUDA context, cuBLAS workspace and CUDA graphs per GPU
NCCL_BUFFER_BYTES = _GIB // 4  # extra per GPU once tensor parallelism needs NCCL


def dtype_bytes(name: str) -> float:
    """Bytes per element for a dtype name (case-insensitive)."""
    key = name.lower()
    if key not in DTYPE_BYTES:
        raise UnknownEntryError("dtype", name, DTYPE_BYTES)
    return DTYPE_BYTES[key]


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """Engine settings that shape memory and batching (vLLM names and defaults)."""

    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    block_size: int = 16


@dataclass(frozen=True, slots=True)
class VramLedger:
    """Where one GPU's memory goes, in bytes."""

    total_bytes: int
    usable_bytes: int  # total * gpu_memory_utilization
    weights_bytes: int
    activations_bytes: int
    cuda_context_bytes: int
    kv_pool_bytes: int  # may be negative: the model does not fit

    @property
    def fits(self) -> bool:
        return self.kv_pool_bytes > 0


@dataclass(frozen=True, slots=True)
class DecodeLines:
    """A decode step of a fixed batch as a function of its total context ``C``:
    ``max(compute_s + compute_s_per_token * C, memory_s + memory_s_per_token * C) + fixed_s``.

    In a run of pure decode steps the batch stays fixed and ``C`` grows by ``batch_size``
    per step, so each side of the roofline is an arithmetic series and a whole run is
    priced in O(1) (``run_time_s``, or ``series`` for many prices of one run) instead of
    one ``step_time_s`` call per step.
    """

    batch_size: int
    compute_s: float
    compute_s_per_token: float
    memory_s: float
    memory_s_per_token: float
    fixed_s: float

    def step_time_s(self, context_tokens: int) -> float:
        """One step at ``context_tokens``: ``CostModel.step_time_s(0, 0, batch_size, C)``."""
        return (
            max(
                self.compute_s + self.compute_s_per_token * context_tokens,
                self.memory_s + self.memory_s_per_token * context_tokens,
            )
            + self.fixed_s
        )

    def run_time_s(self, context_tokens: int, steps: int) -> float:
        """``steps`` consecutive steps, the first at ``context_tokens``: the sum of
        ``step_time_s(context_tokens + i * batch_size)`` for ``i < steps``."""
        return self.series(context_tokens).time_s(steps)

    def series(self, context_tokens: int) -> DecodeSeries:
        """The run whose first step is at ``context_tokens``, with the step where its lines
        cross found once, so that each ``DecodeSeries.time_s`` is a few multiplications.

        The compute line minus the memory line is linear in the step index, so it changes
        sign at most once: the steps before that index are priced on the first step's
        line, the rest on the other.
        """
        slope = self.compute_s_per_token - self.memory_s_per_token
        gap = self.compute_s - self.memory_s + slope * context_tokens  # at the first step
        gap_per_step = slope * self.batch_size
        crossing = _NEVER
        if gap_per_step != 0.0 and (gap >= 0.0) != (gap_per_step > 0.0):
            crossing = max(math.ceil(-gap / gap_per_step), 0)
        return DecodeSeries(self, context_tokens, crossing, gap >= 0.0)


_NEVER = sys.maxsize  # a crossing step no run reaches


@dataclass(frozen=True, slots=True)
class DecodeSeries:
    """The steps of a ``DecodeLines`` run from ``context_tokens`` (``DecodeLines.series``):
    the first ``crossing`` of them on the compute line when ``compute_first``, else on the
    memory line, the rest on the other."""

    lines: DecodeLines
    context_tokens: int
    crossing: int
    compute_first: bool

    def time_s(self, steps: int) -> float:
        """The first ``steps`` steps: two arithmetic series, exact in integers up to the
        last few multiplications."""
        if steps <= 0:
            return 0.0
        lines = self.lines
        context, batch = self.context_tokens, lines.batch_size
        split = self.crossing if self.crossing < steps else steps
        rest = steps - split
        # total context over the steps before and from ``split``, exact in integers
        head = split * context + batch * ((split - 1) * split // 2)
        tail = rest * context + batch * ((split + steps - 1) * rest // 2)
        if not self.compute_first:
            head, tail = tail, head
            split, rest = rest, split
        # now ``split`` steps and ``head`` tokens are on the compute line, the rest memory
        return (
            split * lines.compute_s
            + lines.compute_s_per_token * head
            + rest * lines.memory_s
            + lines.memory_s_per_token * tail
            + lines.fixed_s * steps
        )


class CostModel:
    """Timings and memory of one replica: ``model`` on ``tensor_parallel`` ``gpu`` s."""

    __slots__ = (
        "_attn_flops_per_pair",
        "_comm_bytes_per_token",
        "_comm_fixed_s",
        "_compute_rate",
        "_gemm_pad_flops",
        "_layers_fixed_s",
        "_layers_s_per_token",
        "_memory_rate",
        "gpu",
        "kv_bytes_per_token",
        "kv_bytes_per_token_per_gpu",
        "kv_dtype",
        "ledger",
        "limits",
        "model",
        "tensor_parallel",
        "weight_bytes_per_param",
        "weight_dtype",
        "weights_bytes",
    )

    def __init__(
        self,
        model: ModelSpec,
        gpu: GpuSpec,
        tensor_parallel: int = 1,
        *,
        weight_dtype: str | None = None,
        kv_dtype: str | None = None,
        limits: EngineLimits | None = None,
    ) -> None:
        if tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
        self.model = model
        self.gpu = gpu
        self.tensor_parallel = tensor_parallel
        self.limits = limits or EngineLimits()
        self.weight_dtype = (weight_dtype or model.default_weight_dtype).lower()
        self.weight_bytes_per_param = dtype_bytes(self.weight_dtype)
        default_kv = "bf16" if self.weight_bytes_per_param < 1 else self.weight_dtype
        self.kv_dtype = (kv_dtype or default_kv).lower()
        kv_elem = dtype_bytes(self.kv_dtype)
        t = tensor_parallel

        self.weights_bytes = int(model.total_params * self.weight_bytes_per_param)
        self.kv_bytes_per_token = int(
            model.num_layers * model.kv_elements_per_token_per_layer(1) * kv_elem
        )
        self.kv_bytes_per_token_per_gpu = int(
            model.num_layers * model.kv_elements_per_token_per_layer(t) * kv_elem
        )
        self.ledger = self._ledger()
        self._compute_rate = t * gpu.compute_flops(self.weight_bytes_per_param) * gpu.mfu_prefill
        self._memory_rate = t * gpu.hbm_bandwidth_bytes_per_s * gpu.mbu_decode
        self._attn_flops_per_pair = model.attention_flops_per_token_pair()
        self._gemm_pad_flops = 2.0 * model.active_params * gpu.gemm_half_rate_tokens
        # every GPU of the group runs every layer's kernels on the whole hidden state
        self._layers_fixed_s = model.num_layers * gpu.kernel_s_per_layer
        self._layers_s_per_token = (
            model.num_layers
            * gpu.elementwise_io_per_layer
            * model.hidden_size
            * _ACTIVATION_BYTES
            / (gpu.hbm_bandwidth_bytes_per_s * gpu.mbu_decode)
        )
        if t == 1:
            self._comm_fixed_s = 0.0
            self._comm_bytes_per_token = 0.0
        else:
            link = gpu.interconnect
            calls = 2 * model.num_layers
            self._comm_fixed_s = calls * link.latency_s
            self._comm_bytes_per_token = (
                calls
                * 2
                * (t - 1)
                / t
                * model.hidden_size
                * _ACTIVATION_BYTES
                / link.bandwidth_bytes_per_s
            )

    # -- memory ----------------------------------------------------------------------

    def _ledger(self) -> VramLedger:
        model, t, lim = self.model, self.tensor_parallel, self.limits
        usable = int(self.gpu.memory_bytes * lim.gpu_memory_utilization)
        ffn = model.intermediate_size
        if model.moe is not None:
            ffn = model.moe.expert_intermediate_size * model.moe.experts_per_token
        activations = int(
            lim.max_num_batched_tokens * (4 * model.hidden_size + 2 * ffn / t) * _ACTIVATION_BYTES
            + lim.max_num_seqs * model.vocab_size * _LOGIT_BYTES / t
        )
        context = CUDA_CONTEXT_BYTES + (NCCL_BUFFER_BYTES if t > 1 else 0)
        weights = math.ceil(self.weights_bytes / t)
        return VramLedger(
            total_bytes=self.gpu.memory_bytes,
            usable_bytes=usable,
            weights_bytes=weights,
            activations_bytes=activations,
            cuda_context_bytes=context,
            kv_pool_bytes=usable - weights - activations - context,
        )

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV pool holds (0 when the model does not fit)."""
        return max(self.ledger.kv_pool_bytes, 0) // self.kv_bytes_per_token_per_gpu

    @property
    def kv_capacity_blocks(self) -> int:
        return self.kv_capacity_tokens // self.limits.block_size

    def max_concurrency(self, context_tokens: float, headroom: float = 0.0) -> int:
        """Requests of ``context_tokens`` the pool holds at once, keeping ``headroom`` free."""
        if context_tokens <= 0:
            raise ValueError("context_tokens must be positive")
        usable_tokens = self.kv_capacity_tokens * (1.0 - headroom)
        return min(int(usable_tokens // context_tokens), self.limits.max_num_seqs)

    # -- time ------------------------------------------------------------------------

    def step_time_s(
        self,
        prefill_tokens: int = 0,
        prefill_cached_tokens: int = 0,
        decode_seqs: int = 0,
        decode_context_tokens: int = 0,
    ) -> float:
        """One engine step: a prefill chunk of ``prefill_tokens`` new tokens after
        ``prefill_cached_tokens`` already in cache, plus ``decode_seqs`` decodes whose
        contexts total ``decode_context_tokens``. 0 for an empty step."""
        tokens = prefill_tokens + decode_seqs
        if tokens <= 0:
            return 0.0
        n, c = prefill_tokens, prefill_cached_tokens
        attention_pairs = n * (c + n / 2) + decode_context_tokens
        flops = (
            2.0 * self.model.active_params * tokens
            + self._gemm_pad_flops
            + self._attn_flops_per_pair * attention_pairs
        )
        weight_read = self.weights_bytes * self.model.expected_weight_fraction_read(tokens)
        kv_read = self.kv_bytes_per_token * (decode_context_tokens + (c + n if n else 0))
        roofline = max(flops / self._compute_rate, (weight_read + kv_read) / self._memory_rate)
        overhead = self.gpu.step_overhead_s + (self.gpu.prefill_overhead_s if n else 0.0)
        return roofline + self.layer_kernels_time_s(tokens) + self.tp_comm_time_s(tokens) + overhead

    def decode_lines(self, batch_size: int) -> DecodeLines:
        """``step_time_s(0, 0, batch_size, C)`` as lines in ``C`` (see ``DecodeLines``),
        from the same terms: weights and per-token KV on the memory side, weight FLOPs and
        attention pairs on the compute side, per-layer kernels, all-reduces and step
        overhead fixed."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        weight_read = self.weights_bytes * self.model.expected_weight_fraction_read(batch_size)
        weight_flops = 2.0 * self.model.active_params * batch_size + self._gemm_pad_flops
        return DecodeLines(
            batch_size=batch_size,
            compute_s=weight_flops / self._compute_rate,
            compute_s_per_token=self._attn_flops_per_pair / self._compute_rate,
            memory_s=weight_read / self._memory_rate,
            memory_s_per_token=self.kv_bytes_per_token / self._memory_rate,
            fixed_s=self.gpu.step_overhead_s
            + self.tp_comm_time_s(batch_size)
            + self.layer_kernels_time_s(batch_size),
        )

    def prefill_time_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Prefill of ``new_tokens`` after ``cached_tokens`` reused from the prefix cache,
        in chunks of at most ``max_num_batched_tokens`` (chunked prefill)."""
        chunk = self.limits.max_num_batched_tokens
        total, done = 0.0, 0
        while done < new_tokens:
            size = min(chunk, new_tokens - done)
            total += self.step_time_s(size, cached_tokens + done)
            done += size
        return total

    def decode_step_time_s(self, batch_size: int, total_context_tokens: int) -> float:
        """One decode step for ``batch_size`` sequences holding ``total_context_tokens``."""
        return self.step_time_s(decode_seqs=batch_size, decode_context_tokens=total_context_tokens)

    def layer_kernels_time_s(self, tokens: int) -> float:
        """GPU time outside the roofline of one step carrying ``tokens``: each layer's
        fixed kernel cost and its unsharded elementwise traffic (0 for the built-in GPUs,
        whose shape terms are 0)."""
        return self._layers_fixed_s + self._layers_s_per_token * tokens

    def tp_comm_time_s(self, tokens: int) -> float:
        """All-reduce time of one step carrying ``tokens`` hidden states (0 without TP)."""
        return self._comm_fixed_s + self._comm_bytes_per_token * tokens
