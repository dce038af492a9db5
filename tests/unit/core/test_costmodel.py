"""The cost model against the anchors of DESIGN §3 and the foundation issue."""

from __future__ import annotations

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
