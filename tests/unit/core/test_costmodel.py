"""The cost model against the anchors of DESIGN §3 and the foundation issue."""

from __future__ import annotations

from dataclasses import replace

import pytest

from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.core.errors import UnknownEntryError

CATALOG = Catalog.builtin()
GIB = 1024**3


def cost(model: str, gpu: str, tp: int = 1, **kw: str) -> CostModel:
    return CostModel(CATALOG.model(model), CATALOG.gpu(gpu), tp, **kw)  # type: ignore[arg-type]


def test_kv_bytes_per_token_anchors() -> None:
    assert cost("llama-2-7b", "a100-80g", weight_dtype="fp16").kv_bytes_per_token == 524_288
    assert cost("llama-3.1-8b", "a100-80g").kv_bytes_per_token == 131_072
    # MLA caches the 512-d latent plus the 64-d rotary key per layer: 61 * 576 * 2 B.
    assert cost("deepseek-v3", "h200-141g", 8, kv_dtype="bf16").kv_bytes_per_token == 70_272


def test_kv_shards_across_tp_and_replicates_beyond_kv_heads() -> None:
    model = "llama-3.1-70b"  # 8 KV heads
    per_gpu = [cost(model, "h100-80g", t).kv_bytes_per_token_per_gpu for t in (1, 2, 4, 8)]
    assert per_gpu == [per_gpu[0] // t for t in (1, 2, 4, 8)]
    qwen = "qwen2.5-7b"  # 4 KV heads, 28 attention heads: TP 4 replicates nothing yet
    assert (
        cost(qwen, "l40s-48g", 4).kv_bytes_per_token_per_gpu * 4
        == cost(qwen, "l40s-48g", 1).kv_bytes_per_token
    )


def test_int4_weights_are_a_quarter_of_fp16() -> None:
    fp16 = cost("llama-3.1-70b", "h100-80g", weight_dtype="fp16").weights_bytes
    int4 = cost("llama-3.1-70b", "h100-80g", weight_dtype="int4").weights_bytes
    assert int4 == pytest.approx(fp16 / 4, rel=1e-9)


def test_seven_b_on_a100_single_stream_and_full_pool_decode_rates() -> None:
    c = cost("llama-2-7b", "a100-80g", weight_dtype="fp16")
    single = 1 / c.decode_step_time_s(1, 2048)
    assert 60 <= single <= 110
    batch = c.max_concurrency(2048, headroom=0.15)
    full_pool = batch / c.decode_step_time_s(batch, batch * (2048 - 128))
    assert 1000 <= full_pool <= 2500


def test_seven_b_concurrency_at_4k_context_on_a100() -> None:
    c = cost("llama-2-7b", "a100-80g", weight_dtype="fp16")
    per_request = c.kv_bytes_per_token * 4000
    assert per_request / GIB == pytest.approx(2.0, rel=0.03)
    assert 20 <= c.max_concurrency(4000) <= 45  # 90% memory cap, no headroom
    assert 20 <= c.max_concurrency(4000, headroom=0.15) <= 45


def test_prefill_is_compute_bound_and_cached_prefix_saves_time() -> None:
    c = cost("llama-3.1-8b", "a100-80g")
    cold = c.prefill_time_s(4000)
    warm = c.prefill_time_s(96, cached_tokens=3904)
    assert warm < cold / 5
    # Doubling new tokens more than doubles time minus overhead (attention is quadratic).
    assert c.prefill_time_s(16000) > 4 * (c.prefill_time_s(4000) - 0.01)


def test_decode_step_memory_bound_at_small_batch_and_grows_with_context() -> None:
    c = cost("llama-3.1-8b", "h100-80g")
    assert c.decode_step_time_s(8, 8 * 1000) < c.decode_step_time_s(8, 8 * 8000)
    weights_only = c.weights_bytes / (c.gpu.hbm_bandwidth_bytes_per_s * c.gpu.mbu_decode)
    assert c.decode_step_time_s(1, 1) == pytest.approx(weights_only + c.gpu.step_overhead_s, 0.01)


def test_tensor_parallel_adds_communication_and_splits_work() -> None:
    one = cost("llama-3.1-70b", "h100-80g", 4)
    assert one.tp_comm_time_s(1) > 0
    assert cost("llama-3.1-8b", "h100-80g", 1).tp_comm_time_s(100) == 0
    pcie = cost("llama-3.1-70b", "l40s-48g", 4)
    assert pcie.tp_comm_time_s(4096) > one.tp_comm_time_s(4096)


def test_moe_decode_reads_fewer_weights_at_batch_one() -> None:
    mixtral = CATALOG.model("mixtral-8x7b")
    assert mixtral.expected_weight_fraction_read(1) < 0.4
    assert mixtral.expected_weight_fraction_read(64) > 0.99


def test_unknown_dtype_is_named() -> None:
    with pytest.raises(UnknownEntryError, match="dtype 'fp4'"):
        cost("llama-2-7b", "a100-80g", weight_dtype="fp4")


# Step times of the built-in catalog computed by the cost model before the GPU shape terms
# existed (commit 9e25e0f), as float.hex: step_time_s(2048), step_time_s(512, 1024, 16,
# 8000), step_time_s(0, 0, 32, 65536), decode_lines(64).step_time_s(100_000). The shape
# terms default to 0, which must leave every one of them bit-for-bit as it was.
BEFORE_SHAPE_TERMS = {
    ("llama-3.1-8b", "a100-80g", 1): (
        "0x1.c87ca4491e964p-3", "0x1.f887a91011c23p-5",
        "0x1.33def459f2772p-6", "0x1.6648c7b107e70p-6",
    ),
    ("llama-3.1-70b", "h100-80g", 4): (
        "0x1.83a4682385c87p-3", "0x1.b5790beb69745p-5",
        "0x1.510f3f14be69ep-6", "0x1.695dd767cfeb3p-6",
    ),
    ("mixtral-8x7b", "l40s-48g", 2): (
        "0x1.e1ae2545bd268p-3", "0x1.723c5eb60a568p-4",
        "0x1.5282e05621ccfp-4", "0x1.6390c06ae1813p-4",
    ),
    ("deepseek-v3", "h200-141g", 8): (
        "0x1.6d981f779229fp-5", "0x1.18fb452e8687bp-5",
        "0x1.3a6e82b3396dep-6", "0x1.9acb707ebc6a6p-6",
    ),
}  # fmt: skip


@pytest.mark.parametrize(("model", "gpu", "tp"), sorted(BEFORE_SHAPE_TERMS))
def test_builtin_step_times_are_unchanged_by_the_shape_terms(model: str, gpu: str, tp: int) -> None:
    c = cost(model, gpu, tp)
    spec = c.gpu
    assert (spec.kernel_s_per_layer, spec.gemm_half_rate_tokens) == (0.0, 0.0)
    assert spec.elementwise_io_per_layer == 0.0
    now = (
        c.step_time_s(2048),
        c.step_time_s(512, 1024, 16, 8000),
        c.step_time_s(0, 0, 32, 65536),
        c.decode_lines(64).step_time_s(100_000),
    )
    assert tuple(v.hex() for v in now) == BEFORE_SHAPE_TERMS[(model, gpu, tp)]


def shaped(model: str, gpu: str, tp: int, **terms: float) -> tuple[CostModel, CostModel]:
    """The cost model of a built-in GPU and of the same GPU with shape ``terms``."""
    plain = cost(model, gpu, tp)
    return plain, CostModel(plain.model, replace(plain.gpu, **terms), tp)


@pytest.mark.parametrize("tp", [1, 8])
def test_kernel_time_per_layer_scales_with_layers_not_tensor_parallel(tp: int) -> None:
    for model in ("llama-3.1-8b", "llama-3.1-70b"):  # 32 and 80 layers
        plain, with_kernels = shaped(model, "h100-80g", tp, kernel_s_per_layer=40e-6)
        layers = plain.model.num_layers
        for step in ((2048, 0, 0, 0), (0, 0, 16, 16_000)):
            added = with_kernels.step_time_s(*step) - plain.step_time_s(*step)
            assert added == pytest.approx(layers * 40e-6, rel=1e-9)


def test_gemm_half_rate_tokens_price_weight_flops_as_n_plus_n_half() -> None:
    plain, padded = shaped("llama-3.1-8b", "a100-80g", 1, gemm_half_rate_tokens=64)
    # a decode batch's compute line is the weight GEMMs at batch + 64, attention unchanged
    assert padded.decode_lines(8).compute_s == pytest.approx(plain.decode_lines(72).compute_s)
    assert padded.decode_lines(8).compute_s_per_token == plain.decode_lines(8).compute_s_per_token
    # batch-1 decode stays memory-bound; a large prefill chunk barely moves (64 / 4096)
    assert padded.step_time_s(0, 0, 1, 4096) == plain.step_time_s(0, 0, 1, 4096)
    assert padded.step_time_s(4096) / plain.step_time_s(4096) < 1 + 64 / 4096
    # at the knee (~200 tokens) the step is slower than either plain roofline side
    assert padded.step_time_s(0, 0, 200, 0) > 1.2 * plain.step_time_s(0, 0, 200, 0)


@pytest.mark.parametrize("tp", [1, 4])
def test_elementwise_io_is_unsharded_memory_traffic_per_token(tp: int) -> None:
    plain, shaped_ = shaped("llama-3.1-70b", "h100-80g", tp, elementwise_io_per_layer=10)
    m, gpu = plain.model, plain.gpu
    per_token = (
        m.num_layers * 10 * m.hidden_size * 2 / (gpu.hbm_bandwidth_bytes_per_s * gpu.mbu_decode)
    )
    for tokens in (1, 4096):
        added = shaped_.step_time_s(tokens) - plain.step_time_s(tokens)
        assert added == pytest.approx(per_token * tokens, rel=1e-9)


@pytest.mark.parametrize("batch", [1, 16, 200, 256])
def test_decode_lines_agree_with_step_time_under_shape_terms(batch: int) -> None:
    _, c = shaped(
        "llama-3.1-8b", "h100-80g", 2,
        kernel_s_per_layer=38e-6, gemm_half_rate_tokens=120, elementwise_io_per_layer=10,
    )  # fmt: skip
    lines = c.decode_lines(batch)
    for context in (0, batch * 512, batch * 8192):
        direct = c.step_time_s(decode_seqs=batch, decode_context_tokens=context)
        assert lines.step_time_s(context) == pytest.approx(direct, rel=1e-12)
    steps = 50
    summed = sum(lines.step_time_s(1000 + i * batch) for i in range(steps))
    assert lines.run_time_s(1000, steps) == pytest.approx(summed, rel=1e-9)
