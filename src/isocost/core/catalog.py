"""Catalog of GPUs and models: built-ins plus user additions, looked up ignoring case.

User catalogs are YAML (``--catalog my.yaml``); unknown keys are rejected and every error
names the file and the key path::

    gpus:
      - id: mi300x-192g            # new GPU
        memory_gib: 192
        hbm_bandwidth_gb_s: 5300
        bf16_tflops: 1307
        fp8_tflops: 2615
        interconnect: nvlink       # nvlink | pcie
        interconnect_gb_s: 448
        usd_per_hour: 3.0
        # optional efficiency factors and shape terms (GpuSpec), e.g. fitted ones from
        # benchmarks/calibration/fitted-gpus.yaml:
        # mfu_prefill, mbu_decode, step_overhead_ms, prefill_overhead_ms,
        # kernel_us_per_layer, gemm_half_rate_tokens, elementwise_io_per_layer (all >= 0;
        # mfu_prefill and mbu_decode in (0, 1])
    models:
      - id: my-13b
        num_layers: 40
        hidden_size: 5120
        num_attention_heads: 40
        num_kv_heads: 40
        intermediate_size: 13824
        vocab_size: 32000
        max_context_tokens: 4096
    prices:                        # override built-in $/GPU-hour
      a100-80g: 1.2

Parsing takes text, not paths: reading files is the caller's job (``isocost.files``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

from isocost.core.bounds import (
    AT_LEAST_ONE,
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    Bounds,
    check_fields,
)
from isocost.core.errors import ConfigError, UnknownEntryError
from isocost.core.hardware import BUILTIN_GPUS, GpuSpec, Interconnect
from isocost.core.models import BUILTIN_MODELS, ModelSpec

__all__ = ["Catalog", "gpus_catalog_yaml", "parse_catalog_yaml"]

_GB = 1e9
_GIB = 1024**3


@dataclass(frozen=True, slots=True)
class Catalog:
    """GPUs and models by lowercase id."""

    gpus: dict[str, GpuSpec] = field(default_factory=dict)
    models: dict[str, ModelSpec] = field(default_factory=dict)

    @classmethod
    def builtin(cls) -> Catalog:
        return cls({g.id: g for g in BUILTIN_GPUS}, {m.id: m for m in BUILTIN_MODELS})

    def gpu(self, name: str) -> GpuSpec:
        found = self.gpus.get(name.strip().lower())
        if found is None:
            raise UnknownEntryError("GPU", name, self.gpus)
        return found

    def model(self, name: str) -> ModelSpec:
        found = self.models.get(name.strip().lower())
        if found is None:
            raise UnknownEntryError("model", name, self.models)
        return found

    def with_models(self, models: Iterable[ModelSpec]) -> Catalog:
        return Catalog(dict(self.gpus), {**self.models, **{m.id: m for m in models}})

    def merged(self, text: str, source: str) -> Catalog:
        """This catalog plus the YAML ``text`` read from ``source``."""
        extra = parse_catalog_yaml(text, source)
        gpus = dict(self.gpus)
        for entry in extra.gpus:
            gpus[entry.id.lower()] = entry.to_spec()
        for gpu_id, price in extra.prices.items():
            key = gpu_id.lower()
            if key not in gpus:
                raise ConfigError(
                    source, f"price for unknown GPU {gpu_id!r}", key=f"prices.{gpu_id}"
                )
            gpus[key] = gpus[key].with_price(price)
        return Catalog(gpus, dict(self.models)).with_models(e.to_spec() for e in extra.models)


class _GpuEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    id: str
    memory_gib: float
    hbm_bandwidth_gb_s: float
    bf16_tflops: float
    usd_per_hour: float
    fp8_tflops: float | None = None
    name: str | None = None
    interconnect: str = "pcie"
    interconnect_gb_s: float = 25.0
    interconnect_latency_us: float = 20.0
    max_gpus_per_node: int = 8
    mfu_prefill: float = 0.5
    mbu_decode: float = 0.72
    step_overhead_ms: float = 2.0
    prefill_overhead_ms: float = 3.0
    kernel_us_per_layer: float = 0.0
    gemm_half_rate_tokens: float = 0.0
    elementwise_io_per_layer: float = 0.0

    def to_spec(self) -> GpuSpec:
        return GpuSpec(
            id=self.id.lower(),
            name=self.name or self.id,
            memory_bytes=int(self.memory_gib * _GIB),
            hbm_bandwidth_bytes_per_s=self.hbm_bandwidth_gb_s * _GB,
            bf16_flops=self.bf16_tflops * 1e12,
            fp8_flops=None if self.fp8_tflops is None else self.fp8_tflops * 1e12,
            interconnect=Interconnect(
                self.interconnect,
                self.interconnect_gb_s * _GB,
                self.interconnect_latency_us * 1e-6,
            ),
            usd_per_hour=self.usd_per_hour,
            max_gpus_per_node=self.max_gpus_per_node,
            mfu_prefill=self.mfu_prefill,
            mbu_decode=self.mbu_decode,
            step_overhead_s=self.step_overhead_ms / 1000,
            prefill_overhead_s=self.prefill_overhead_ms / 1000,
            kernel_s_per_layer=self.kernel_us_per_layer * 1e-6,
            gemm_half_rate_tokens=self.gemm_half_rate_tokens,
            elementwise_io_per_layer=self.elementwise_io_per_layer,
        )


class _ModelEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    id: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int
    max_context_tokens: int = 4096
    num_kv_heads: int | None = None
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    default_weight_dtype: str = "bf16"

    def to_spec(self) -> ModelSpec:
        return ModelSpec(
            id=self.id.lower(),
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_kv_heads=self.num_kv_heads or self.num_attention_heads,
            head_dim=self.head_dim or self.hidden_size // self.num_attention_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            max_context_tokens=self.max_context_tokens,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.attention_bias,
            default_weight_dtype=self.default_weight_dtype,
        )


class _CatalogFile(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    gpus: list[_GpuEntry] = []
    models: list[_ModelEntry] = []
    prices: dict[str, float] = {}


def parse_catalog_yaml(text: str, source: str) -> _CatalogFile:
    try:
        parsed = msgspec.yaml.decode(text or "{}", type=_CatalogFile)
    except msgspec.ValidationError as exc:
        raise ConfigError(source, str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise ConfigError(source, f"not valid YAML: {exc}") from exc
    for i, gpu in enumerate(parsed.gpus):
        check_fields(gpu, _GPU_BOUNDS, source, f"gpus[{i}]")
        if gpu.interconnect not in ("nvlink", "pcie"):
            raise ConfigError(source, "must be nvlink or pcie", key=f"gpus[{i}].interconnect")
    for i, model in enumerate(parsed.models):
        check_fields(model, _MODEL_BOUNDS, source, f"models[{i}]")
    for gpu_id, price in parsed.prices.items():
        if (problem := NON_NEGATIVE.problem(price)) is not None:
            raise ConfigError(source, problem, key=f"prices.{gpu_id}")
    return parsed


# Every number of an entry, checked when the catalog is read: a zero utilisation divides by
# zero in the cost model, a NaN or an infinity poisons every time and price derived from it.
_GPU_BOUNDS: dict[str, Bounds] = {
    "memory_gib": POSITIVE,
    "hbm_bandwidth_gb_s": POSITIVE,
    "bf16_tflops": POSITIVE,
    "fp8_tflops": POSITIVE,
    "usd_per_hour": NON_NEGATIVE,
    "interconnect_gb_s": POSITIVE,
    "interconnect_latency_us": NON_NEGATIVE,
    "max_gpus_per_node": AT_LEAST_ONE,
    "mfu_prefill": FRACTION,
    "mbu_decode": FRACTION,
    "step_overhead_ms": NON_NEGATIVE,
    "prefill_overhead_ms": NON_NEGATIVE,
    "kernel_us_per_layer": NON_NEGATIVE,
    "gemm_half_rate_tokens": NON_NEGATIVE,
    "elementwise_io_per_layer": NON_NEGATIVE,
}
_MODEL_BOUNDS: dict[str, Bounds] = dict.fromkeys(
    (
        *("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim"),
        *("intermediate_size", "vocab_size", "max_context_tokens"),
    ),
    AT_LEAST_ONE,
)


def gpus_catalog_yaml(gpus: Iterable[GpuSpec], comments: Sequence[str] = ()) -> str:
    """``gpus`` as a user catalog (``--catalog FILE``) that ``parse_catalog_yaml`` reads
    back to the same specs, after ``comments`` as ``#`` lines."""
    lines = [f"# {line}" if line else "#" for line in comments]
    lines.append("gpus:")
    for g in gpus:
        fields: dict[str, object] = {
            "id": g.id,
            "name": g.name,
            "memory_gib": g.memory_bytes / _GIB,
            "hbm_bandwidth_gb_s": g.hbm_bandwidth_bytes_per_s / _GB,
            "bf16_tflops": g.bf16_flops / 1e12,
            "fp8_tflops": None if g.fp8_flops is None else g.fp8_flops / 1e12,
            "interconnect": g.interconnect.kind,
            "interconnect_gb_s": g.interconnect.bandwidth_bytes_per_s / _GB,
            "interconnect_latency_us": round(g.interconnect.latency_s * 1e6, 6),
            "usd_per_hour": g.usd_per_hour,
            "max_gpus_per_node": g.max_gpus_per_node,
            "mfu_prefill": g.mfu_prefill,
            "mbu_decode": g.mbu_decode,
            "step_overhead_ms": round(g.step_overhead_s * 1e3, 6),
            "prefill_overhead_ms": round(g.prefill_overhead_s * 1e3, 6),
            "kernel_us_per_layer": round(g.kernel_s_per_layer * 1e6, 6),
            "gemm_half_rate_tokens": g.gemm_half_rate_tokens,
            "elementwise_io_per_layer": g.elementwise_io_per_layer,
        }
        for i, (key, value) in enumerate(fields.items()):
            if value is not None:
                text = json.dumps(value) if isinstance(value, str) else repr(value)
                lines.append(f"{'  - ' if i == 0 else '    '}{key}: {text}")
    return "\n".join(lines) + "\n"
