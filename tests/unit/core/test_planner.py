"""The planner's answers for the cases an engineer checks by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.core.errors import DoesNotFitError
from isocost.core.planner import PlanRequest, explain, plan, plan_disaggregation

CATALOG = Catalog.builtin()


def request(model: str, gpu: str, **kw: object) -> PlanRequest:
    return PlanRequest(CATALOG.model(model), CATALOG.gpu(gpu), **kw)  # type: ignore[arg-type]


def test_seven_b_fp16_on_a100_at_4k_context() -> None:
    result = plan(request("llama-2-7b", "a100-80g", weight_dtype="fp16", context_tokens=4000))
    doc = result.as_dict()
    assert doc["kv_cache_bytes_per_token"] == 524_288
    assert doc["kv_cache_bytes_per_request"] == 524_288 * 4000
    assert 20 <= doc["max_concurrency_per_replica"] <= 45  # type: ignore[operator]
    assert doc["recommended_tensor_parallel"] == 1
    assert doc["min_tensor_parallel"] == 1


def test_seventy_b_needs_tp_two_and_recommendation_counts_kv() -> None:
    small = plan(request("llama-2-70b", "a100-80g", weight_dtype="fp16", concurrency=2))
    assert small.min_tensor_parallel >= 2
    assert small.recommended.tensor_parallel == 2
    busy = plan(request("llama-2-70b", "a100-80g", weight_dtype="fp16", concurrency=64))
    assert busy.min_tensor_parallel >= 2
    # TP 2 leaves ~5 GiB of KV per GPU: 64 concurrent requests need wider TP or many replicas.
    assert busy.recommended.tensor_parallel >= 4
    assert busy.recommended.max_concurrency * busy.recommended.replicas_needed >= 64
    assert busy.recommended.gpus_needed <= min(o.gpus_needed for o in busy.options if o.meets_slos)


def test_model_too_large_for_a_node_suggests_pipeline_parallelism() -> None:
    with pytest.raises(DoesNotFitError, match=r"pipeline parallelism.*TP 8 x PP \d"):
        plan(request("llama-3.1-405b", "a100-80g", weight_dtype="bf16"))
    # fp8 halves it: 405 GB over four H200s (126 GiB usable each) leaves room for KV.
    assert plan(request("llama-3.1-405b", "h200-141g", weight_dtype="fp8")).min_tensor_parallel == 4


def test_qps_target_sizes_replicas_under_slos() -> None:
    result = plan(request("llama-3.1-8b", "h100-80g", qps=40, ttft_slo_s=0.5, tpot_slo_s=0.05))
    rec = result.recommended
    assert rec.tpot_s <= 0.05 and rec.ttft_s <= 0.5
    assert rec.replicas_needed * rec.requests_per_s >= 40
    assert (rec.replicas_needed - 1) * rec.requests_per_s < 40
    assert result.as_dict()["gpus_needed"] == rec.replicas_needed * rec.tensor_parallel


def test_tighter_tpot_slo_lowers_batch_and_raises_replicas() -> None:
    loose = plan(request("llama-3.1-8b", "a100-80g", qps=20, tpot_slo_s=0.08)).recommended
    tight = plan(request("llama-3.1-8b", "a100-80g", qps=20, tpot_slo_s=0.03)).recommended
    assert tight.batch_size < loose.batch_size
    assert tight.gpus_needed > loose.gpus_needed
    assert tight.limited_by == "tpot"


def test_unreachable_slo_is_reported_not_hidden() -> None:
    result = plan(request("llama-3.1-70b", "l20-48g", context_tokens=8000, ttft_slo_s=0.01))
    assert not result.recommended.meets_slos
    assert any("SLO" in note for note in result.notes)


def test_json_carries_every_documented_key() -> None:
    doc = plan(request("qwen2.5-7b", "l40s-48g", qps=5)).as_dict()
    for key in (
        "kv_cache_bytes_per_token", "kv_cache_bytes_per_request", "weights_bytes_per_gpu",
        "max_concurrency_per_replica", "min_tensor_parallel", "recommended_tensor_parallel",
        "replicas_needed", "gpus_needed", "decode_tokens_per_s_per_replica",
        "usd_per_million_output_tokens",
    ):  # fmt: skip
        assert key in doc


def test_explain_covers_each_headline_figure() -> None:
    rows = explain(plan(request("mixtral-8x7b", "h100-80g")))
    names = {name for name, _, _ in rows}
    assert {"weights", "KV per token", "KV pool", "max concurrency", "decode step"} <= names
    assert all(value and derivation for _, value, derivation in rows)


def test_explain_names_the_shape_terms_only_where_the_gpu_has_them() -> None:
    gpu = replace(CATALOG.gpu("h100-80g"), kernel_s_per_layer=40e-6, gemm_half_rate_tokens=64)
    model = CATALOG.model("llama-3.1-8b")
    shaped = {name: why for name, _, why in explain(plan(PlanRequest(model, gpu)))}
    plain = {name: why for name, _, why in explain(plan(request("llama-3.1-8b", "h100-80g")))}
    for row in ("prefill", "decode step"):
        assert "per-layer kernels (32 layers)" in shaped[row]
        assert "n + 64 tokens" in shaped[row]
        assert "per-layer" not in plain[row] and "GEMMs at" not in plain[row]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"output_tokens": 4096, "context_tokens": 2048}, "must be below --context"),
        ({"gpu_memory_utilization": 1.5}, "gpu-mem-util"),
        ({"headroom": 1.0}, "headroom"),
        ({"qps": -1.0}, "qps"),
    ],
)
def test_bad_requests_are_rejected(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        request("llama-2-7b", "a100-80g", **kw)


def test_disaggregation_gives_long_prompts_more_prefill_replicas_than_short_ones() -> None:
    catalog = Catalog.builtin()
    cost = CostModel(catalog.model("llama-3.1-8b"), catalog.gpu("a100-80g"), 1)
    long = plan_disaggregation(cost, 16, prompt_tokens=16_000, output_tokens=300)
    chat = plan_disaggregation(cost, 16, prompt_tokens=300, output_tokens=600)
    assert long.prefill_replicas > chat.prefill_replicas >= 1
    assert long.prefill_replicas + long.decode_replicas == 16
    cached = plan_disaggregation(cost, 16, prompt_tokens=16_000, output_tokens=300,
                                 cached_tokens=12_000)  # fmt: skip
    assert cached.prefill_replicas < long.prefill_replicas  # the cache does P's work
    tight = plan_disaggregation(cost, 16, prompt_tokens=2000, output_tokens=300, tpot_slo_s=0.02)
    loose = plan_disaggregation(cost, 16, prompt_tokens=2000, output_tokens=300)
    assert tight.decode_batch < loose.decode_batch
    assert tight.decode_replicas >= loose.decode_replicas
    with pytest.raises(ValueError, match="at least 2"):
        plan_disaggregation(cost, 1, prompt_tokens=100, output_tokens=10)
