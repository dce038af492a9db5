"""The capacity planner: from a model, a GPU and a target load to TP, replicas and $.

For each tensor-parallel degree ``t`` in 1, 2, 4, 8 (at most a node, and dividing the
attention heads as engines require):

1. **Ledger.** ``KV pool = C*util - W/t - activations - CUDA context`` per GPU; the replica
   holds ``pool / kv_tok_per_gpu`` tokens. ``t`` *fits* when the pool holds one request of
   ``context`` tokens; the smallest such ``t`` is the minimum TP.
2. **Max concurrency** = ``pool * (1 - headroom) / (kv_tok * context)``, capped by
   ``max_num_seqs``. The headroom keeps requests that outgrow the mean from preempting.
3. **Operating point.** With ``b`` requests resident, each of ``m`` output tokens and a
   prompt of ``n = context - m`` tokens, a decode step costs ``T_step(b, K)`` with
   ``K = b * (n + m/2)`` resident tokens, a prefill costs ``T_pre(n)``, and the replica
   completes ``X(b) = b / (b*T_pre + m*T_step)`` requests/s. Prefills stall decodes, so a
   request's time per output token is ``TPOT(b) = T_step + b*T_pre/m``, and its TTFT is the
   prefill plus an M/D/1 wait for the prefill slot, ``T_pre * (1 + rho / (2*(1-rho)))``
   with ``rho = X*T_pre``. Both grow with ``b``: the planner takes the largest ``b`` up to
   the max concurrency that meets the TTFT and TPOT SLOs.
4. **Replicas** = ``max(ceil(qps / X(b)), ceil(concurrency / b))``; GPUs = replicas * t;
   $ per million output tokens = ``t * $/h / 3600 / (X(b) * m) * 1e6``.
5. **Recommendation.** Among the TP degrees that fit and meet the SLOs, the one needing
   the fewest GPUs for the target ``qps``/``concurrency`` (ties: the smaller t, since
   replicas scale out more simply than a wider TP group); without a target, the smallest.

Prefill/decode disaggregation (``plan_disaggregation``, ``isocost plan --disaggregate``):
splits a fleet into prefill and decode replicas in proportion to the replica-seconds a
request takes in each pool, so neither pool idles while the other queues.

Two throughput figures are reported on purpose: ``decode_tokens_per_s`` is the rate of the
decode steps at the operating batch (what "a full KV pool decodes" means), and
``output_tokens_per_s`` is the sustained rate once prefill time is paid, which prices $.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from isocost.core.costmodel import CostModel, EngineLimits
from isocost.core.errors import DoesNotFitError
from isocost.core.hardware import GpuSpec
from isocost.core.models import ModelSpec

__all__ = [
    "MAX_CONTEXT_TOKENS",
    "DisaggPlan",
    "PlanRequest",
    "PlanResult",
    "TpOption",
    "explain",
    "plan",
    "plan_disaggregation",
    "valid_tp_degrees",
]

TP_DEGREES = (1, 2, 4, 8)
# Beyond the longest context any model serves; a prefill is priced chunk by chunk, so a
# context of 1e11 tokens would take minutes to price before it is found not to fit.
MAX_CONTEXT_TOKENS = 10_000_000
_GIB = 1024**3


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """What the user asked for; SLOs and targets are optional."""

    model: ModelSpec
    gpu: GpuSpec
    weight_dtype: str | None = None
    kv_dtype: str | None = None
    context_tokens: int = 2048
    output_tokens: int = 256
    concurrency: int | None = None
    qps: float | None = None
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    gpu_memory_utilization: float = 0.9
    headroom: float = 0.15

    def __post_init__(self) -> None:
        if self.context_tokens <= 0 or self.output_tokens <= 0:
            raise ValueError("context and output tokens must be positive")
        if self.context_tokens > MAX_CONTEXT_TOKENS:
            raise ValueError(f"--context must be at most {MAX_CONTEXT_TOKENS:,} tokens")
        if self.output_tokens >= self.context_tokens:
            raise ValueError(
                f"--output-tokens ({self.output_tokens}) must be below --context "
                f"({self.context_tokens}): context counts prompt and output together"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-mem-util must be in (0, 1]")
        if not 0 <= self.headroom < 1:
            raise ValueError("--headroom must be in [0, 1)")
        if self.concurrency is not None and self.concurrency <= 0:
            raise ValueError("--concurrency must be positive")
        if self.qps is not None and self.qps <= 0:
            raise ValueError("--qps must be positive")

    @property
    def prompt_tokens(self) -> int:
        return self.context_tokens - self.output_tokens


@dataclass(frozen=True, slots=True)
class TpOption:
    """The ledger and operating point of one tensor-parallel degree."""

    tensor_parallel: int
    cost: CostModel
    fits: bool
    max_concurrency: int
    batch_size: int  # operating concurrency under the SLOs (0: SLOs unreachable)
    prefill_s: float
    decode_step_s: float
    tpot_s: float
    ttft_s: float
    requests_per_s: float
    decode_tokens_per_s: float
    output_tokens_per_s: float
    single_stream_tokens_per_s: float
    replicas_needed: int
    usd_per_million_output_tokens: float
    limited_by: str  # what stopped the batch growing: "kv", "max_num_seqs", "ttft", "tpot"

    @property
    def gpus_needed(self) -> int:
        return self.replicas_needed * self.tensor_parallel

    @property
    def meets_slos(self) -> bool:
        return self.fits and self.batch_size > 0


@dataclass(frozen=True, slots=True)
class PlanResult:
    request: PlanRequest
    options: tuple[TpOption, ...]
    min_tensor_parallel: int
    recommended: TpOption
    notes: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, object]:
        """The JSON document of ``isocost plan --json``."""
        rec, req = self.recommended, self.request
        ledger = rec.cost.ledger
        return {
            "model": req.model.id,
            "gpu": req.gpu.id,
            "weight_dtype": rec.cost.weight_dtype,
            "kv_dtype": rec.cost.kv_dtype,
            "context_tokens": req.context_tokens,
            "output_tokens": req.output_tokens,
            "total_params": req.model.total_params,
            "active_params": req.model.active_params,
            "kv_cache_bytes_per_token": rec.cost.kv_bytes_per_token,
            "kv_cache_bytes_per_request": rec.cost.kv_bytes_per_token * req.context_tokens,
            "weights_bytes_total": rec.cost.weights_bytes,
            "weights_bytes_per_gpu": ledger.weights_bytes,
            "activations_bytes_per_gpu": ledger.activations_bytes,
            "cuda_context_bytes_per_gpu": ledger.cuda_context_bytes,
            "kv_pool_bytes_per_gpu": ledger.kv_pool_bytes,
            "kv_pool_tokens_per_replica": rec.cost.kv_capacity_tokens,
            "max_concurrency_per_replica": rec.max_concurrency,
            "operating_concurrency_per_replica": rec.batch_size,
            "limited_by": rec.limited_by,
            "min_tensor_parallel": self.min_tensor_parallel,
            "recommended_tensor_parallel": rec.tensor_parallel,
            "replicas_needed": rec.replicas_needed,
            "gpus_needed": rec.gpus_needed,
            "requests_per_s_per_replica": rec.requests_per_s,
            "decode_tokens_per_s_per_replica": rec.decode_tokens_per_s,
            "output_tokens_per_s_per_replica": rec.output_tokens_per_s,
            "single_stream_tokens_per_s": rec.single_stream_tokens_per_s,
            "predicted_ttft_s": rec.ttft_s,
            "predicted_tpot_s": rec.tpot_s,
            "usd_per_hour_per_replica": rec.tensor_parallel * req.gpu.usd_per_hour,
            "usd_per_million_output_tokens": rec.usd_per_million_output_tokens,
            "headroom": req.headroom,
            "gpu_memory_utilization": req.gpu_memory_utilization,
            "notes": list(self.notes),
            "options": [
                {
                    "tensor_parallel": o.tensor_parallel,
                    "fits": o.fits,
                    "max_concurrency_per_replica": o.max_concurrency,
                    "operating_concurrency_per_replica": o.batch_size,
                    "replicas_needed": o.replicas_needed,
                    "gpus_needed": o.gpus_needed,
                    "decode_tokens_per_s_per_replica": o.decode_tokens_per_s,
                    "usd_per_million_output_tokens": o.usd_per_million_output_tokens,
                }
                for o in self.options
            ],
        }


def valid_tp_degrees(model: ModelSpec, gpu: GpuSpec) -> list[int]:
    """TP degrees within one node that split the attention heads evenly."""
    return [
        t for t in TP_DEGREES if t <= gpu.max_gpus_per_node and model.num_attention_heads % t == 0
    ]


def _operating_point(req: PlanRequest, cost: CostModel, max_conc: int) -> TpOption:
    n, m = req.prompt_tokens, req.output_tokens
    prefill_s = cost.prefill_time_s(n)
    resident = n + m / 2

    def metrics(b: int) -> tuple[float, float, float, float]:
        step = cost.decode_step_time_s(b, int(b * resident))
        x = b / (b * prefill_s + m * step)
        rho = min(x * prefill_s, 0.999)
        ttft = prefill_s * (1 + rho / (2 * (1 - rho)))
        return step, step + b * prefill_s / m, ttft, x

    def ok(b: int) -> bool:
        _, tpot, ttft, _ = metrics(b)
        return (req.tpot_slo_s is None or tpot <= req.tpot_slo_s) and (
            req.ttft_slo_s is None or ttft <= req.ttft_slo_s
        )

    fits = max_conc >= 1
    best = _largest_meeting(ok, max_conc)
    limited_by = "kv"
    if best == 0 or best < max_conc:
        _, tpot, ttft, _ = metrics(min(best + 1, max(max_conc, 1)))
        limited_by = "ttft" if req.ttft_slo_s is not None and ttft > req.ttft_slo_s else "tpot"
    elif max_conc == cost.limits.max_num_seqs:
        limited_by = "max_num_seqs"
    b = max(best, 1)
    step, tpot, ttft, x = metrics(b)
    single = 1.0 / cost.decode_step_time_s(1, req.context_tokens)
    replicas = 1
    if best > 0:
        if req.qps is not None:
            replicas = max(replicas, math.ceil(req.qps / x - 1e-9))
        if req.concurrency is not None:
            replicas = max(replicas, math.ceil(req.concurrency / best))
    usd_per_s = cost.tensor_parallel * cost.gpu.usd_per_hour / 3600
    return TpOption(
        tensor_parallel=cost.tensor_parallel,
        cost=cost,
        fits=fits,
        max_concurrency=max_conc,
        batch_size=best,
        prefill_s=prefill_s,
        decode_step_s=step,
        tpot_s=tpot,
        ttft_s=ttft,
        requests_per_s=x,
        decode_tokens_per_s=b / step,
        output_tokens_per_s=x * m,
        single_stream_tokens_per_s=single,
        replicas_needed=replicas,
        usd_per_million_output_tokens=usd_per_s / (x * m) * 1e6,
        limited_by=limited_by,
    )


def _largest_meeting(ok: Callable[[int], bool], most: int) -> int:
    """The largest ``b`` in ``[1, most]`` with ``ok(b)``, ``ok`` true up to some ``b`` and
    false above (0: not even ``ok(1)``), by bisection."""
    if most < 1 or not ok(1):
        return 0
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


@dataclass(frozen=True, slots=True)
class DisaggPlan:
    """A prefill/decode split of a fleet for one workload (``plan_disaggregation``)."""

    prefill_replicas: int
    decode_replicas: int
    prefill_s_per_request: float  # P replica-seconds a request takes: its uncached prefill
    decode_s_per_request: float  # D replica-seconds: m steps shared by the decode batch
    decode_batch: int  # D's operating batch (TPOT target, KV pool, max_num_seqs)
    requests_per_s: float  # what the split sustains: the slower pool's rate

    @property
    def prefill_share(self) -> float:
        work = self.prefill_s_per_request + self.decode_s_per_request
        return self.prefill_s_per_request / work if work > 0 else 0.0


def plan_disaggregation(
    cost: CostModel,
    replicas: int,
    *,
    prompt_tokens: int,
    output_tokens: int,
    cached_tokens: int = 0,
    tpot_slo_s: float | None = None,
    headroom: float = 0.15,
) -> DisaggPlan:
    """P:D for ``replicas`` replicas of ``cost`` serving requests of ``prompt_tokens``
    (``cached_tokens`` of them found in P's prefix cache) and ``output_tokens``.

    A prefill replica computes one prompt after another (compute-bound, prefill chunks
    batch into full steps): ``T_pre(n - c, c)`` replica-seconds per request. A decode
    replica runs the largest batch ``b`` whose step ``T_step(b, b * (n + m/2))`` meets the
    TPOT target (no prefill stalls it) within its KV pool and ``max_num_seqs``:
    ``m * T_step / b`` replica-seconds per request. The pools split the replicas in
    proportion to those (at least one each), which balances their rates; a TPOT target no
    batch meets leaves ``b = 1``."""
    if replicas < 2:
        raise ValueError("a prefill/decode split needs at least 2 replicas")
    if prompt_tokens < 1 or output_tokens < 1 or not 0 <= cached_tokens < prompt_tokens:
        raise ValueError("need prompt and output tokens >= 1 and cached below the prompt")
    n, m = prompt_tokens, output_tokens
    prefill_s = cost.prefill_time_s(n - cached_tokens, cached_tokens)
    resident = n + m / 2

    def step_s(b: int) -> float:
        return cost.decode_step_time_s(b, int(b * resident))

    most = cost.max_concurrency(resident, headroom)
    batch = max(_largest_meeting(lambda b: tpot_slo_s is None or step_s(b) <= tpot_slo_s, most), 1)
    decode_s = m * step_s(batch) / batch
    share = prefill_s / (prefill_s + decode_s)
    num_prefill = min(max(round(replicas * share), 1), replicas - 1)
    num_decode = replicas - num_prefill
    return DisaggPlan(
        prefill_replicas=num_prefill,
        decode_replicas=num_decode,
        prefill_s_per_request=prefill_s,
        decode_s_per_request=decode_s,
        decode_batch=batch,
        requests_per_s=min(num_prefill / prefill_s, num_decode / decode_s),
    )


def plan(req: PlanRequest) -> PlanResult:
    """Size a deployment; raises DoesNotFitError when no single-node TP holds the model."""
    limits = EngineLimits(gpu_memory_utilization=req.gpu_memory_utilization)
    options: list[TpOption] = []
    for t in valid_tp_degrees(req.model, req.gpu):
        cost = CostModel(
            req.model,
            req.gpu,
            t,
            weight_dtype=req.weight_dtype,
            kv_dtype=req.kv_dtype,
            limits=limits,
        )
        max_conc = cost.max_concurrency(req.context_tokens, req.headroom) if cost.ledger.fits else 0
        options.append(_operating_point(req, cost, max_conc))
    fitting = [o for o in options if o.fits]
    if not fitting:
        raise DoesNotFitError(_does_not_fit_message(req, options))
    notes: list[str] = []
    meeting = [o for o in fitting if o.meets_slos]
    if not meeting:
        notes.append(
            "no tensor-parallel degree meets the SLOs even at concurrency 1; "
            "showing the fastest option: relax the SLOs, shorten the context or use a faster GPU"
        )
        meeting = [min(fitting, key=lambda o: (o.ttft_s, o.tpot_s))]
    recommended = min(meeting, key=lambda o: (o.gpus_needed, o.tensor_parallel))
    if recommended.tensor_parallel > fitting[0].tensor_parallel:
        notes.append(
            f"TP {fitting[0].tensor_parallel} fits the weights but TP "
            f"{recommended.tensor_parallel} needs fewer GPUs for the target: more KV cache per "
            "GPU once the weights are split"
        )
    return PlanResult(req, tuple(options), fitting[0].tensor_parallel, recommended, tuple(notes))


def _does_not_fit_message(req: PlanRequest, options: list[TpOption]) -> str:
    largest = max(options, key=lambda o: o.tensor_parallel)
    cost = largest.cost
    t = largest.tensor_parallel
    weights_gib = cost.weights_bytes / _GIB
    usable_gib = t * cost.ledger.usable_bytes / _GIB
    per_node = cost.weights_bytes / max(t * cost.ledger.usable_bytes, 1)
    nodes = max(2, math.ceil(per_node * 1.25))
    return (
        f"{req.model.id} ({cost.weight_dtype}) needs {weights_gib:,.0f} GiB of weights; "
        f"{t} x {req.gpu.id} hold {usable_gib:,.0f} GiB at "
        f"{req.gpu_memory_utilization:.0%} utilisation, not enough for weights plus KV cache "
        f"for one {req.context_tokens}-token request. Use pipeline parallelism across nodes "
        f"(e.g. TP {t} x PP {nodes}), a smaller --dtype (fp8/int4), or a larger GPU."
    )


def _chunks(tokens: int, chunk: int) -> list[int]:
    """The chunk sizes of a prefill of ``tokens`` (chunked prefill)."""
    return [min(chunk, tokens - done) for done in range(0, tokens, chunk)]


def _layer_kernels_note(cost: CostModel, steps: list[int]) -> str:
    """The GPU's shape terms over ``steps`` (tokens of each), or nothing where they are 0
    (every built-in GPU)."""
    note = ""
    n_half = cost.gpu.gemm_half_rate_tokens
    if n_half:
        note += f" (each step's GEMMs at n + {n_half:g} tokens)"
    total = sum(cost.layer_kernels_time_s(tokens) for tokens in steps)
    if total:
        note += f" + {total * 1e3:,.2f} ms per-layer kernels ({cost.model.num_layers} layers)"
    return note


def explain(result: PlanResult) -> list[tuple[str, str, str]]:
    """Each headline figure of ``result`` as (name, value, derivation) for ``--explain``."""
    req, rec = result.request, result.recommended
    cost, ledger, model, gpu = rec.cost, rec.cost.ledger, req.model, req.gpu
    t = rec.tensor_parallel
    kv_heads = (
        f"MLA latent {model.mla.kv_lora_rank}+{model.mla.qk_rope_head_dim}"
        if model.mla
        else f"2 x {model.num_kv_heads} KV heads x {model.head_dim} head dim"
    )
    rows = [
        (
            "parameters",
            f"{model.total_params / 1e9:,.2f} B total, {model.active_params / 1e9:,.2f} B active",
            "derived from the layer shapes (embeddings, attention, FFN/experts, norms, LM head)",
        ),
        (
            "weights",
            f"{cost.weights_bytes / _GIB:,.2f} GiB ({ledger.weights_bytes / _GIB:,.2f} per GPU)",
            f"{model.total_params / 1e9:,.2f} B params x {cost.weight_bytes_per_param:g} B "
            f"({cost.weight_dtype}) / TP {t}",
        ),
        (
            "KV per token",
            f"{cost.kv_bytes_per_token:,} B",
            f"{model.num_layers} layers x {kv_heads} x {cost.kv_dtype} bytes "
            f"({cost.kv_bytes_per_token // model.num_layers:,} B per layer)",
        ),
        (
            "KV per request",
            f"{cost.kv_bytes_per_token * req.context_tokens / _GIB:,.3f} GiB",
            f"{cost.kv_bytes_per_token:,} B x {req.context_tokens:,} tokens of context",
        ),
        (
            "usable memory",
            f"{ledger.usable_bytes / _GIB:,.2f} GiB per GPU",
            f"{gpu.memory_bytes / _GIB:,.1f} GiB x --gpu-mem-util {req.gpu_memory_utilization:g}",
        ),
        (
            "activations",
            f"{ledger.activations_bytes / _GIB:,.2f} GiB per GPU",
            f"peak of a {cost.limits.max_num_batched_tokens}-token forward pass (hidden + FFN "
            f"intermediates in bf16) + fp32 logits for {cost.limits.max_num_seqs} sequences",
        ),
        (
            "CUDA context",
            f"{ledger.cuda_context_bytes / _GIB:,.2f} GiB per GPU",
            "CUDA context, cuBLAS workspace and CUDA graphs" + (", NCCL buffers" if t > 1 else ""),
        ),
        (
            "KV pool",
            f"{ledger.kv_pool_bytes / _GIB:,.2f} GiB per GPU = {cost.kv_capacity_tokens:,} tokens",
            "usable - weights - activations - CUDA context",
        ),
        (
            "max concurrency",
            f"{rec.max_concurrency}",
            f"{cost.kv_capacity_tokens:,} tokens x (1 - headroom {req.headroom:g}) / "
            f"{req.context_tokens:,} tokens per request, capped at max_num_seqs "
            f"{cost.limits.max_num_seqs}",
        ),
        (
            "min TP",
            f"{result.min_tensor_parallel}",
            "smallest TP (1, 2, 4, 8 dividing the attention heads) whose KV pool holds one request",
        ),
        (
            "operating concurrency",
            f"{rec.batch_size} (limited by {rec.limited_by})",
            "largest batch meeting the TTFT and TPOT SLOs, at most the max concurrency",
        ),
        (
            "prefill",
            f"{rec.prefill_s * 1e3:,.1f} ms",
            f"{req.prompt_tokens:,} prompt tokens: max(2 x P_active x n + attention FLOPs over "
            f"TP x {gpu.compute_flops(cost.weight_bytes_per_param) / 1e12:,.0f} TFLOP/s x MFU "
            f"{gpu.mfu_prefill:g}, weight+KV bytes over bandwidth) + "
            f"{gpu.prefill_overhead_s * 1e3:g} ms"
            + _layer_kernels_note(
                cost, _chunks(req.prompt_tokens, cost.limits.max_num_batched_tokens)
            ),
        ),
        (
            "decode step",
            f"{rec.decode_step_s * 1e3:,.1f} ms",
            f"batch {max(rec.batch_size, 1)}: (weights + KV read) / (TP x "
            f"{gpu.hbm_bandwidth_bytes_per_s / 1e9:,.0f} GB/s x MBU {gpu.mbu_decode:g}) + "
            f"all-reduce + {gpu.step_overhead_s * 1e3:g} ms overhead"
            + _layer_kernels_note(cost, [max(rec.batch_size, 1)]),
        ),
        ("TTFT", f"{rec.ttft_s * 1e3:,.1f} ms", "prefill + M/D/1 wait for the prefill slot"),
        (
            "TPOT",
            f"{rec.tpot_s * 1e3:,.1f} ms",
            "decode step + this request's share of the prefills that stall it (b x T_pre / m)",
        ),
        (
            "single stream",
            f"{rec.single_stream_tokens_per_s:,.0f} tok/s",
            f"1 / decode step at batch 1 with {req.context_tokens:,} tokens of context",
        ),
        (
            "decode rate",
            f"{rec.decode_tokens_per_s:,.0f} tok/s per replica",
            "operating batch / decode step time",
        ),
        (
            "sustained output",
            f"{rec.output_tokens_per_s:,.0f} tok/s per replica",
            "completed requests/s x output tokens, prefill time included",
        ),
        (
            "replicas",
            f"{rec.replicas_needed} x TP {t} = {rec.gpus_needed} GPUs",
            "max(qps / requests per s per replica, concurrency / operating concurrency)",
        ),
        (
            "$ per M output tokens",
            f"${rec.usd_per_million_output_tokens:,.3f}",
            f"TP {t} x ${gpu.usd_per_hour:g}/GPU-hour / sustained output tokens per hour",
        ),
    ]
    return rows
