"""Model catalog: transformer shapes from which parameters, KV bytes and FLOPs derive.

A model is described the way its Hugging Face ``config.json`` describes it (layers, hidden
size, heads, KV heads, head dim, FFN size, vocabulary, experts, MLA ranks). Parameter
counts are *derived* from the shape by one function, for the built-in catalog and for any
local ``config.json`` alike, so the two can never disagree. Mixture-of-experts models keep
total parameters (memory) apart from active parameters (compute per token); DeepSeek-style
multi-head latent attention (MLA) caches one compressed latent per token and layer instead
of per-head keys and values.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from isocost.core.errors import ConfigError
from isocost.core.jsontext import parse_json

__all__ = ["BUILTIN_MODELS", "MlaShape", "ModelSpec", "MoeShape", "model_from_hf_config"]


@dataclass(frozen=True, slots=True)
class MoeShape:
    """Routed experts (plus always-on shared experts) replacing the dense FFN."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    first_dense_layers: int = 0  # leading layers that keep a dense FFN (DeepSeek)


@dataclass(frozen=True, slots=True)
class MlaShape:
    """Multi-head latent attention ranks (DeepSeek-V2/V3)."""

    kv_lora_rank: int
    q_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A decoder-only transformer. ``id`` is the lowercase catalog key."""

    id: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context_tokens: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    moe: MoeShape | None = None
    mla: MlaShape | None = None
    default_weight_dtype: str = "bf16"
    total_params: float = field(init=False)
    active_params: float = field(init=False)

    def __post_init__(self) -> None:
        total, active = _count_params(self)
        object.__setattr__(self, "total_params", total)
        object.__setattr__(self, "active_params", active)

    def kv_elements_per_token_per_layer(self, tensor_parallel: int) -> int:
        """Cached elements one token adds to one layer on one GPU of a TP group.

        Standard attention stores K and V per KV head; heads shard across the TP group,
        and are replicated when TP exceeds the KV-head count. MLA caches one latent plus
        the rotary key, replicated on every rank.
        """
        if self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        heads_per_gpu = math.ceil(self.num_kv_heads / tensor_parallel)
        return 2 * heads_per_gpu * self.head_dim

    def attention_flops_per_token_pair(self) -> float:
        """FLOPs of QK^T and AV for one (query, key) pair summed over layers."""
        if self.mla is not None:
            qk = self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim
            return 2.0 * self.num_layers * self.num_attention_heads * (qk + self.mla.v_head_dim)
        return 4.0 * self.num_layers * self.num_attention_heads * self.head_dim

    def expected_weight_fraction_read(self, batch_size: int) -> float:
        """Share of the weights a decode step of ``batch_size`` tokens must stream.

        Dense models read everything. An MoE layer reads only the experts its tokens route
        to; with ``k`` of ``E`` experts per token chosen roughly uniformly, a batch of ``b``
        touches ``E * (1 - (1 - k/E)**b)`` distinct experts on average.
        """
        if self.moe is None:
            return 1.0
        moe = self.moe
        per_expert = _expert_params(self)
        routed_total = per_expert * moe.num_experts * self._moe_layers()
        touched = moe.num_experts * (
            1.0 - (1.0 - moe.experts_per_token / moe.num_experts) ** max(batch_size, 1)
        )
        routed_read = per_expert * touched * self._moe_layers()
        return (self.total_params - routed_total + routed_read) / self.total_params

    def _moe_layers(self) -> int:
        assert self.moe is not None
        return self.num_layers - self.moe.first_dense_layers


def _expert_params(model: ModelSpec) -> float:
    assert model.moe is not None
    return 3.0 * model.hidden_size * model.moe.expert_intermediate_size


def _count_params(model: ModelSpec) -> tuple[float, float]:
    """Total and active parameters from the shape (embeddings and LM head included)."""
    h = model.hidden_size
    q_dim = model.num_attention_heads * model.head_dim
    if model.mla is not None:
        mla = model.mla
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        attention = (
            h * mla.q_lora_rank
            + mla.q_lora_rank * model.num_attention_heads * qk
            + h * (mla.kv_lora_rank + mla.qk_rope_head_dim)
            + mla.kv_lora_rank * model.num_attention_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
            + model.num_attention_heads * mla.v_head_dim * h
        )
    else:
        kv_dim = model.num_kv_heads * model.head_dim
        attention = h * q_dim + 2 * h * kv_dim + q_dim * h
        if model.attention_bias:
            attention += q_dim + 2 * kv_dim
    dense_ffn = 3 * h * model.intermediate_size
    norms = 2 * h
    embeddings = model.vocab_size * h * (1 if model.tie_word_embeddings else 2) + h

    if model.moe is None:
        total = model.num_layers * (attention + dense_ffn + norms) + embeddings
        return float(total), float(total)
    moe = model.moe
    per_expert = _expert_params(model)
    dense_layers = moe.first_dense_layers
    moe_layers = model.num_layers - dense_layers
    router = h * moe.num_experts
    shared = moe.num_shared_experts * per_expert
    common = (
        model.num_layers * (attention + norms)
        + dense_layers * dense_ffn
        + moe_layers * (router + shared)
        + embeddings
    )
    routed_total = moe_layers * moe.num_experts * per_expert
    routed_active = moe_layers * moe.experts_per_token * per_expert
    return float(common + routed_total), float(common + routed_active)


def _llama(
    id: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    vocab: int,
    context: int,
    *,
    head_dim: int = 128,
    bias: bool = False,
    tie: bool = False,
    moe: MoeShape | None = None,
) -> ModelSpec:
    return ModelSpec(
        id,
        layers,
        hidden,
        heads,
        kv_heads,
        head_dim,
        ffn,
        vocab,
        context,
        tie_word_embeddings=tie,
        attention_bias=bias,
        moe=moe,
    )


# Shapes from each model's published config.json.
# fmt: off
BUILTIN_MODELS: tuple[ModelSpec, ...] = (
    _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    _llama("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, 131072),
    _llama("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256, 131072),
    _llama("llama-3.1-405b", 126, 16384, 128, 8, 53248, 128256, 131072),
    _llama("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, 131072, bias=True),
    _llama("qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064, 131072, bias=True),
    _llama("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, 131072, bias=True),
    _llama("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, 131072, bias=True),
    _llama("qwen3-32b", 64, 5120, 64, 8, 25600, 151936, 40960),
    _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 32768,
           moe=MoeShape(8, 2, 14336)),
    _llama("mixtral-8x22b", 56, 6144, 48, 8, 16384, 32768, 65536,
           moe=MoeShape(8, 2, 16384)),
    ModelSpec("deepseek-v3", 61, 7168, 128, 128, 128, 18432, 129280, 163840,
              moe=MoeShape(256, 8, 2048, num_shared_experts=1, first_dense_layers=3),
              mla=MlaShape(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                           qk_rope_head_dim=64, v_head_dim=128),
              default_weight_dtype="fp8"),
)
# fmt: on

_DTYPE_NAMES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float8_e4m3fn": "fp8"}


def model_from_hf_config(text: str, source: str, model_id: str) -> ModelSpec:
    """Build a ModelSpec from the text of a Hugging Face ``config.json``.

    Understands Llama/Mistral/Qwen-style dense models, Mixtral/Qwen-MoE routed experts and
    DeepSeek MLA. Errors name ``source`` and the missing or malformed key.
    """
    try:
        raw = parse_json(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(source, f"not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(raw, dict):
        raise ConfigError(source, "expected a JSON object at the top level")
    cfg: Mapping[str, Any] = raw.get("text_config", raw)

    def need(key: str) -> int:
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(source, f"expected a positive integer, got {value!r}", key=key)
        return value

    def optional(key: str, default: int) -> int:
        return need(key) if cfg.get(key) is not None else default

    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    kv_heads = optional("num_key_value_heads", heads)
    head_dim = optional("head_dim", hidden // heads)
    moe: MoeShape | None = None
    experts = cfg.get("num_local_experts") or cfg.get("n_routed_experts") or cfg.get("num_experts")
    if experts:
        moe = MoeShape(
            num_experts=int(experts),
            experts_per_token=need("num_experts_per_tok"),
            expert_intermediate_size=optional("moe_intermediate_size", need("intermediate_size")),
            num_shared_experts=int(cfg.get("n_shared_experts") or 0),
            first_dense_layers=int(cfg.get("first_k_dense_replace") or 0),
        )
    mla: MlaShape | None = None
    if cfg.get("kv_lora_rank"):
        mla = MlaShape(
            kv_lora_rank=need("kv_lora_rank"),
            q_lora_rank=need("q_lora_rank"),
            qk_nope_head_dim=need("qk_nope_head_dim"),
            qk_rope_head_dim=need("qk_rope_head_dim"),
            v_head_dim=need("v_head_dim"),
        )
    dtype = str(cfg.get("torch_dtype") or raw.get("torch_dtype") or "bfloat16")
    return ModelSpec(
        id=model_id.lower(),
        num_layers=need("num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=need("intermediate_size"),
        vocab_size=need("vocab_size"),
        max_context_tokens=optional("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
        moe=moe,
        mla=mla,
        default_weight_dtype=_DTYPE_NAMES.get(dtype, "bf16"),
    )
