"""Catalog facts: published shapes give published sizes; lookups and user files behave."""

from __future__ import annotations

import pytest

from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError, UnknownEntryError
from isocost.core.models import model_from_hf_config

CATALOG = Catalog.builtin()

REQUIRED_GPUS = ["a100-40g", "a100-80g", "a800-80g", "h100-80g", "h200-141g", "l20-48g",
                 "l40s-48g", "rtx4090-24g", "b200-180g"]  # fmt: skip
# Published parameter counts (billions) of each model card.
PUBLISHED_PARAMS_B = {
    "llama-2-7b": 6.74, "llama-2-13b": 13.0, "llama-2-70b": 69.0, "llama-3.1-8b": 8.03,
    "llama-3.1-70b": 70.6, "llama-3.1-405b": 405.9, "qwen2.5-7b": 7.61, "qwen2.5-14b": 14.7,
    "qwen2.5-32b": 32.5, "qwen2.5-72b": 72.7, "qwen3-32b": 32.8, "mixtral-8x7b": 46.7,
    "mixtral-8x22b": 140.6, "deepseek-v3": 671.0,
}  # fmt: skip
PUBLISHED_ACTIVE_B = {"mixtral-8x7b": 12.9, "mixtral-8x22b": 39.1, "deepseek-v3": 37.0}


@pytest.mark.parametrize("gpu_id", REQUIRED_GPUS)
def test_required_gpus_exist_with_positive_specs(gpu_id: str) -> None:
    gpu = CATALOG.gpu(gpu_id)
    assert gpu.memory_bytes > 20 * 1024**3
    assert gpu.hbm_bandwidth_bytes_per_s > 5e11
    assert gpu.bf16_flops > 1e14
    assert gpu.usd_per_hour > 0
    assert gpu.interconnect.kind in {"nvlink", "pcie"}


@pytest.mark.parametrize(("model_id", "billions"), sorted(PUBLISHED_PARAMS_B.items()))
def test_derived_parameter_counts_match_model_cards(model_id: str, billions: float) -> None:
    assert CATALOG.model(model_id).total_params / 1e9 == pytest.approx(billions, rel=0.02)


@pytest.mark.parametrize(("model_id", "billions"), sorted(PUBLISHED_ACTIVE_B.items()))
def test_moe_active_parameters_match_model_cards(model_id: str, billions: float) -> None:
    assert CATALOG.model(model_id).active_params / 1e9 == pytest.approx(billions, rel=0.03)


def test_lookups_ignore_case_and_suggest_close_names() -> None:
    assert CATALOG.model("Llama-3.1-8B").id == "llama-3.1-8b"
    assert CATALOG.gpu("A100-80G").id == "a100-80g"
    with pytest.raises(UnknownEntryError, match=r"did you mean .*a100-80g"):
        CATALOG.gpu("a100-80")


def test_user_catalog_adds_gpus_models_and_prices() -> None:
    text = """
gpus:
  - id: MI300X-192G
    memory_gib: 192
    hbm_bandwidth_gb_s: 5300
    bf16_tflops: 1307
    usd_per_hour: 3.0
    interconnect: nvlink
models:
  - id: my-model
    num_layers: 4
    hidden_size: 256
    num_attention_heads: 4
    intermediate_size: 512
    vocab_size: 1000
prices:
  a100-80g: 1.25
"""
    merged = CATALOG.merged(text, "mine.yaml")
    assert merged.gpu("mi300x-192g").memory_bytes == 192 * 1024**3
    assert merged.model("my-model").num_kv_heads == 4
    assert merged.gpu("a100-80g").usd_per_hour == 1.25
    assert CATALOG.gpu("a100-80g").usd_per_hour != 1.25  # the built-in stays untouched


def test_user_gpu_carries_efficiency_factors_and_shape_terms() -> None:
    text = """
gpus:
  - id: a100-fitted
    memory_gib: 80
    hbm_bandwidth_gb_s: 2039
    bf16_tflops: 312
    usd_per_hour: 1.6
    mfu_prefill: 0.7
    mbu_decode: 0.75
    kernel_us_per_layer: 40
    gemm_half_rate_tokens: 64
    elementwise_io_per_layer: 10
"""
    gpu = CATALOG.merged(text, "mine.yaml").gpu("a100-fitted")
    assert (gpu.mfu_prefill, gpu.mbu_decode) == (0.7, 0.75)
    assert gpu.kernel_s_per_layer == pytest.approx(40e-6)
    assert (gpu.gemm_half_rate_tokens, gpu.elementwise_io_per_layer) == (64, 10)
    plain = CATALOG.merged(text.split("    mfu_prefill")[0], "mine.yaml").gpu("a100-fitted")
    assert (plain.kernel_s_per_layer, plain.gemm_half_rate_tokens) == (0.0, 0.0)
    assert plain.elementwise_io_per_layer == 0.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("gpus:\n  - id: x\n    memory_gib: 1\n    hbm_bandwidth_gb_s: 1\n    bf16_tflops: 1\n"
         "    usd_per_hour: 1\n    colour: red\n",
         r"mine\.yaml: .*unknown field `colour`.*gpus\[0\]"),
        ("models: [{id: m}]\n", r"mine\.yaml: .*missing required field"),
        ("prices: {nope-gpu: 1}\n", r"mine\.yaml: prices\.nope-gpu"),
        ("gpus: [\n", r"mine\.yaml: not valid YAML"),
        ("gpus:\n  - id: x\n    memory_gib: -1\n    hbm_bandwidth_gb_s: 1\n    bf16_tflops: 1\n"
         "    usd_per_hour: 1\n", r"mine\.yaml: gpus\[0\]\.memory_gib"),
        ("gpus:\n  - id: x\n    memory_gib: 1\n    hbm_bandwidth_gb_s: 1\n    bf16_tflops: 1\n"
         "    usd_per_hour: 1\n    kernel_us_per_layer: -5\n",
         r"mine\.yaml: gpus\[0\]\.kernel_us_per_layer"),
    ],
)  # fmt: skip
def test_malformed_catalog_names_file_and_key(text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        CATALOG.merged(text, "mine.yaml")


def _gpu(extra: str = "", bandwidth: str = "1", tflops: str = "1", usd: str = "1") -> str:
    return (
        f"gpus:\n  - {{id: x, memory_gib: 1, hbm_bandwidth_gb_s: {bandwidth},"
        f" bf16_tflops: {tflops}, usd_per_hour: {usd}{extra}}}\n"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (_gpu(", mbu_decode: 0"), "gpus[0].mbu_decode: must be in (0, 1]"),
        (_gpu(", mfu_prefill: 2.0"), "gpus[0].mfu_prefill: must be in (0, 1]"),
        (_gpu(bandwidth=".nan"), "gpus[0].hbm_bandwidth_gb_s: must be a finite number > 0"),
        (_gpu(tflops=".inf"), "gpus[0].bf16_tflops: must be a finite number > 0"),
        (_gpu(usd="-1"), "gpus[0].usd_per_hour: must be >= 0"),
        ("prices: {a100-80g: -1}\n", "prices.a100-80g: must be >= 0"),
        ("prices: {a100-80g: .nan}\n", "prices.a100-80g: must be a finite number >= 0"),
        ("models:\n  - {id: m, num_layers: 2, hidden_size: 64, num_attention_heads: 4,"
         " intermediate_size: 0, vocab_size: 10}\n", "models[0].intermediate_size: must be >= 1"),
    ],
)  # fmt: skip
def test_catalog_numbers_are_finite_and_in_range(text: str, expected: str) -> None:
    """Each would divide by zero, price at a negative or NaN rate, or exceed a peak."""
    with pytest.raises(ConfigError) as error:
        CATALOG.merged(text, "mine.yaml")
    assert str(error.value) == f"mine.yaml: {expected}"


def test_hf_config_reproduces_catalog_shape() -> None:
    config = """{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
      "intermediate_size": 14336, "max_position_embeddings": 131072, "model_type": "llama",
      "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
      "torch_dtype": "bfloat16", "vocab_size": 128256}"""
    spec = model_from_hf_config(config, "config.json", "Llama-3.1-8B")
    assert spec.total_params == CATALOG.model("llama-3.1-8b").total_params


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{not json", r"cfg\.json: not valid JSON"),
        ("[" * 100_000, r"cfg\.json: not valid JSON \(nested too deep"),
        ("[1, 2]", r"cfg\.json: expected a JSON object"),
        ('{"hidden_size": 64}', r"cfg\.json: num_attention_heads: expected a positive integer"),
        ('{"hidden_size": "big", "num_attention_heads": 2}', r"cfg\.json: hidden_size"),
    ],
)
def test_malformed_hf_config_names_file_and_key(text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        model_from_hf_config(text, "cfg.json", "x")
