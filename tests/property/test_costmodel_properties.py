"""Monotonicity and bounds of the cost model and planner over generated inputs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.core.planner import PlanRequest, plan

CATALOG = Catalog.builtin()
MODELS = sorted(CATALOG.models)
SMALL_MODELS = [m for m in MODELS if CATALOG.models[m].total_params < 20e9]
GPUS = sorted(CATALOG.gpus)

model_ids = st.sampled_from(MODELS)
gpu_ids = st.sampled_from(GPUS)
tps = st.sampled_from([1, 2, 4, 8])


@given(model_ids, gpu_ids, tps, st.integers(1, 256), st.integers(1, 200_000),
       st.integers(1, 200_000))  # fmt: skip
def test_decode_step_grows_with_context(model: str, gpu: str, tp: int, batch: int,
                                        ctx_a: int, ctx_b: int) -> None:  # fmt: skip
    c = CostModel(CATALOG.model(model), CATALOG.gpu(gpu), tp)
    lo, hi = sorted((ctx_a, ctx_b))
    assert c.decode_step_time_s(batch, lo) <= c.decode_step_time_s(batch, hi)


@given(model_ids, gpu_ids, tps, st.integers(1, 128), st.integers(1, 255), st.integers(0, 10**5))
def test_decode_step_grows_with_batch(model: str, gpu: str, tp: int, b: int, extra: int,
                                      ctx: int) -> None:  # fmt: skip
    c = CostModel(CATALOG.model(model), CATALOG.gpu(gpu), tp)
    assert c.decode_step_time_s(b, ctx) <= c.decode_step_time_s(b + extra, ctx)


@given(model_ids, gpu_ids, tps, st.integers(1, 50_000), st.integers(0, 50_000),
       st.integers(1, 50_000))  # fmt: skip
def test_prefill_grows_with_new_and_cached_tokens(model: str, gpu: str, tp: int, n: int,
                                                  cached: int, more: int) -> None:  # fmt: skip
    c = CostModel(CATALOG.model(model), CATALOG.gpu(gpu), tp)
    assert 0 < c.prefill_time_s(n, cached) <= c.prefill_time_s(n + more, cached)
    assert c.prefill_time_s(n, cached) <= c.prefill_time_s(n, cached + more)


@given(model_ids, gpu_ids, tps, st.integers(1, 100_000), st.integers(1, 100_000))
def test_concurrency_falls_as_context_grows(model: str, gpu: str, tp: int, a: int,
                                            b: int) -> None:  # fmt: skip
    c = CostModel(CATALOG.model(model), CATALOG.gpu(gpu), tp)
    lo, hi = sorted((a, b))
    assert c.max_concurrency(hi) <= c.max_concurrency(lo)


@given(st.sampled_from(["fp16", "bf16", "fp8", "int8", "int4"]), model_ids, gpu_ids)
def test_weights_scale_with_dtype_and_more_params_cost_more(dtype: str, model: str,
                                                            gpu: str) -> None:  # fmt: skip
    base = CostModel(CATALOG.model(model), CATALOG.gpu(gpu), weight_dtype="fp16")
    other = CostModel(CATALOG.model(model), CATALOG.gpu(gpu), weight_dtype=dtype)
    ratio = {"fp16": 1, "bf16": 1, "fp8": 0.5, "int8": 0.5, "int4": 0.25}[dtype]
    assert abs(other.weights_bytes - base.weights_bytes * ratio) <= 1


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(SMALL_MODELS), gpu_ids, st.integers(600, 16_000), st.integers(1, 500),
       st.integers(1, 400), st.integers(1, 400))  # fmt: skip
def test_planner_replicas_monotonic_and_tp_within_a_node(
    model: str, gpu: str, context: int, output: int, conc_a: int, conc_b: int
) -> None:
    lo, hi = sorted((conc_a, conc_b))
    out = min(output, context - 1)
    base = {"model": CATALOG.model(model), "gpu": CATALOG.gpu(gpu), "context_tokens": context,
            "output_tokens": out}  # fmt: skip
    few = plan(PlanRequest(concurrency=lo, **base))  # type: ignore[arg-type]
    many = plan(PlanRequest(concurrency=hi, **base))  # type: ignore[arg-type]
    assert few.recommended.gpus_needed <= many.recommended.gpus_needed
    for result in (few, many):
        assert result.recommended.tensor_parallel <= CATALOG.gpu(gpu).max_gpus_per_node
        assert result.min_tensor_parallel <= result.recommended.tensor_parallel


@given(st.integers(1, 80), st.integers(1, 8))
def test_more_layers_mean_more_parameters_and_kv(layers: int, extra: int) -> None:
    import dataclasses

    base = CATALOG.model("llama-3.1-8b")
    small = dataclasses.replace(base, num_layers=layers)
    large = dataclasses.replace(base, num_layers=layers + extra)
    assert small.total_params < large.total_params
    gpu = CATALOG.gpu("h100-80g")
    assert CostModel(small, gpu).kv_bytes_per_token < CostModel(large, gpu).kv_bytes_per_token
