"""GPU catalog: memory, bandwidth, FLOP/s, interconnect, price and efficiency factors.

Peak figures are NVIDIA datasheet values for *dense* math (no 2:4 sparsity). Memory is what
``nvidia-smi`` reports as total (MiB), not the marketing number. Prices are typical
on-demand cloud $/GPU-hour in 2025-2026 and are meant to be overridden (``--catalog``).

Efficiency factors turn peaks into what an engine achieves:

* ``mfu_prefill``: model-FLOP utilisation of prefill (compute-bound). Published serving
  measurements put chunked prefill at 40-60% of dense peak on A100/H100 (Sarathi-Serve,
  OSDI'24; vLLM and SGLang prefill benchmarks); PCIe inference cards sit lower.
* ``mbu_decode``: memory-bandwidth utilisation of a decode step (memory-bound). Databricks'
  "LLM Inference Performance Engineering" (2023) reports ~60% MBU at batch 1 for 7B models on
  A100 and notes that better kernels approach 80%; modern engines with CUDA graphs and
  paged-attention kernels sit at 65-80%.
* ``step_overhead_s``: fixed host-side cost per engine step (scheduling, sampling, launch);
  1-3 ms for vLLM V1 with CUDA graphs.
* ``prefill_overhead_s``: fixed cost added to each prefill chunk.

Three optional shape terms (all 0 in the built-in catalog, which leaves its step times as
the plain roofline) describe what a roofline of whole-step FLOPs and bytes misses when a
step is really ~9 separate kernels per layer, fitted to measured kernel times by
``benchmarks/calibration/fit_vidur.py``:

* ``kernel_s_per_layer``: fixed GPU time of one layer's kernels per step (launch, ramp-up
  and tail of each kernel, a few us each). Every GPU of a tensor-parallel group runs every
  layer's kernels, so it scales with the layer count and does not shrink with ``t``; it is
  what keeps small shards (tp 8, small batches) well short of the bandwidth peak.
* ``gemm_half_rate_tokens``: the token count at which the weight GEMMs reach half their
  large-batch rate (Hockney's n_1/2): a step of ``n`` tokens pays weight FLOPs as if it had
  ``n + gemm_half_rate_tokens``, so its GEMM rate is ``mfu * n / (n + n_1/2)``. This is
  the knee: steps of ~100-250 tokens run well below both peaks, since a GEMM with few
  rows fills neither the tensor cores nor the memory pipe.
* ``elementwise_io_per_layer``: hidden-state vectors each token reads and writes per layer
  in the elementwise kernels (norms, residual adds) that run separately from the GEMMs
  and, unsharded, on every GPU of a tensor-parallel group. Memory-bound at ``mbu_decode``
  and serial to the GEMMs, it is why prefill at tp 8 falls short of the GEMMs' MFU.

These are the starting point; the gateway corrects them online per replica from observed
TTFT and inter-token latency (learned correction factors), and ``isocost plan --explain``
shows each one next to the figure it drives.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["BUILTIN_GPUS", "GpuSpec", "Interconnect"]

_MIB = 1024**2
_GB = 1e9
_TFLOPS = 1e12


@dataclass(frozen=True, slots=True)
class Interconnect:
    """Intra-node link used by tensor-parallel all-reduce."""

    kind: str  # "nvlink" or "pcie"
    bandwidth_bytes_per_s: float  # per-direction bandwidth one GPU can drive
    latency_s: float  # per all-reduce launch + sync


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU model. All quantities are per GPU; ``id`` is the lowercase catalog key."""

    id: str
    name: str
    memory_bytes: int
    hbm_bandwidth_bytes_per_s: float
    bf16_flops: float  # dense FP16/BF16 tensor-core FLOP/s
    fp8_flops: float | None  # dense FP8 FLOP/s; None where the GPU has no FP8 tensor cores
    interconnect: Interconnect
    usd_per_hour: float
    max_gpus_per_node: int = 8
    mfu_prefill: float = 0.5
    mbu_decode: float = 0.72
    step_overhead_s: float = 0.002
    prefill_overhead_s: float = 0.003
    kernel_s_per_layer: float = 0.0
    gemm_half_rate_tokens: float = 0.0
    elementwise_io_per_layer: float = 0.0

    def with_price(self, usd_per_hour: float) -> GpuSpec:
        return replace(self, usd_per_hour=usd_per_hour)

    def compute_flops(self, weight_bytes_per_param: float) -> float:
        """Dense tensor-core peak used for a model's matmuls.

        FP8 weights run at FP8 rate only where the GPU has FP8 tensor cores; elsewhere
        (Ampere) they are dequantised and run at BF16 rate (weight-only kernels such as
        Marlin). INT4/INT8 weight-only quantisation likewise computes in BF16.
        """
        if weight_bytes_per_param == 1.0 and self.fp8_flops is not None:
            return self.fp8_flops
        return self.bf16_flops


_NVLINK3 = Interconnect("nvlink", 300 * _GB, 8e-6)  # A100: 600 GB/s bidirectional
_NVLINK3_A800 = Interconnect("nvlink", 200 * _GB, 8e-6)  # A800: export-capped 400 GB/s
_NVLINK4 = Interconnect("nvlink", 450 * _GB, 6e-6)  # H100/H200: 900 GB/s bidirectional
_NVLINK5 = Interconnect("nvlink", 900 * _GB, 5e-6)  # B200: 1.8 TB/s bidirectional
_PCIE4 = Interconnect("pcie", 25 * _GB, 20e-6)  # PCIe 4.0 x16, ~25 GB/s achievable

# fmt: off
BUILTIN_GPUS: tuple[GpuSpec, ...] = (
    GpuSpec("a100-40g", "NVIDIA A100-SXM4-40GB", 40_960 * _MIB, 1_555 * _GB,
            312 * _TFLOPS, None, _NVLINK3, 1.10),
    GpuSpec("a100-80g", "NVIDIA A100-SXM4-80GB", 81_920 * _MIB, 2_039 * _GB,
            312 * _TFLOPS, None, _NVLINK3, 1.60),
    GpuSpec("a800-80g", "NVIDIA A800-SXM4-80GB", 81_920 * _MIB, 2_039 * _GB,
            312 * _TFLOPS, None, _NVLINK3_A800, 1.40),
    GpuSpec("h100-80g", "NVIDIA H100 80GB HBM3 (SXM)", 81_559 * _MIB, 3_350 * _GB,
            989 * _TFLOPS, 1_979 * _TFLOPS, _NVLINK4, 2.60, mfu_prefill=0.45,
            mbu_decode=0.70),
    GpuSpec("h200-141g", "NVIDIA H200 (SXM)", 143_771 * _MIB, 4_800 * _GB,
            989 * _TFLOPS, 1_979 * _TFLOPS, _NVLINK4, 3.60, mfu_prefill=0.45,
            mbu_decode=0.70),
    GpuSpec("l20-48g", "NVIDIA L20", 46_068 * _MIB, 864 * _GB,
            119.5 * _TFLOPS, 239 * _TFLOPS, _PCIE4, 0.80, max_gpus_per_node=8,
            mfu_prefill=0.55, mbu_decode=0.75),
    GpuSpec("l40s-48g", "NVIDIA L40S", 46_068 * _MIB, 864 * _GB,
            362 * _TFLOPS, 733 * _TFLOPS, _PCIE4, 1.00, mfu_prefill=0.40,
            mbu_decode=0.75),
    GpuSpec("rtx4090-24g", "NVIDIA GeForce RTX 4090", 24_564 * _MIB, 1_008 * _GB,
            165 * _TFLOPS, 330 * _TFLOPS, _PCIE4, 0.45, mfu_prefill=0.45,
            mbu_decode=0.75),
    GpuSpec("b200-180g", "NVIDIA B200", 183_359 * _MIB, 8_000 * _GB,
            2_250 * _TFLOPS, 4_500 * _TFLOPS, _NVLINK5, 6.00, mfu_prefill=0.40,
            mbu_decode=0.65, step_overhead_s=0.0015),
)
# fmt: on
