"""Fit the GPU catalog's efficiency factors to Vidur's public per-layer GPU profiles.

Vidur (Microsoft, MIT licence) publishes, per GPU and model, the median CUDA time in ms of
every operation of one transformer layer (``mlp.csv``: norms, QKV and output projections,
rotary, gated MLP, residual add) against the number of tokens in the step and the tensor
parallel degree. Summed over the layer and times the layer count (Vidur's own
composition, ``vidur/entities/execution_time.py``), a row is the measured GPU time of a
step of that many tokens through the layer stack, without the attention kernels, the
all-reduces, the embedding and LM head, and without host overheads: none of those are
in these files (Vidur's attention profiles are Git-LFS objects not stored here).

The cost model is compared on exactly that: the roofline part of ``CostModel`` (the
larger of its compute and memory time, ``decode_lines``) for a model of the same shape
with no embedding or LM head, at zero context. Steps of up to ``max_num_seqs`` tokens are
decode steps (one token per sequence, memory-bound: ``mbu_decode`` governs them); larger
ones are prefill chunks (compute-bound: ``mfu_prefill``). Per GPU both factors are fitted
by grid search to the least mean |error| over the fitted cases (model x tp x phase, each
case weighing the same), on every profiled model except Llama-2-7B, which is held out and
only evaluated. Host overheads (``step_overhead_s``, ``prefill_overhead_s``) cannot be
identified from GPU kernel times and are left as they are. Run:

    .venv/bin/python benchmarks/calibration/fit_vidur.py [--data DIR] [--json OUT]

``--data`` is a folder laid out like Vidur's ``data/profiling/compute``
(``<gpu>/<org>/<model>/mlp.csv``); the default is the excerpt committed next to this file.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from isocost.core.costmodel import CostModel, EngineLimits
from isocost.core.hardware import BUILTIN_GPUS, GpuSpec
from isocost.core.models import ModelSpec

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE / "data" / "vidur"
HELD_OUT = "Llama-2-7b-hf"
# Vidur's device folders and the catalog GPUs they were profiled on (SXM, 80 GB).
GPU_IDS = {"a100": "a100-80g", "h100": "h100-80g"}
# Layer counts from each model's config.json (Vidur's vidur/config/model_config.py); the
# other shape figures come from the CSV's own columns. phi-2 is profiled too but its MLP
# is not gated, which is not the Llama shape the catalog's ModelSpec describes.
NUM_LAYERS = {
    "Llama-2-7b-hf": 32,
    "Llama-2-70b-hf": 80,
    "Meta-Llama-3-8B": 32,
    "Meta-Llama-3-70B": 80,
    "CodeLlama-34b-Instruct-hf": 48,
    "internlm-20b": 60,
    "Qwen-72B": 80,
}
# One layer's operations, as Vidur's ExecutionTime adds them (attention kernels aside).
LAYER_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "use_gated_mlp")
KEY_COLUMNS = ("num_tokens", "num_tensor_parallel_workers")
DECODE_MAX_TOKENS = EngineLimits().max_num_seqs
COARSE_GRID = np.round(np.arange(0.05, 1.0001, 0.01), 4)
FINE_STEP = 0.001


@dataclass(frozen=True, slots=True)
class Point:
    """One measured step: ``tokens`` through the layer stack on ``tp`` GPUs."""

    tokens: int
    tp: int
    measured_s: float


@dataclass(frozen=True, slots=True)
class Profile:
    """The measured steps of one model on one GPU."""

    device: str  # Vidur's folder: a100, h100
    model: str  # Vidur's folder name, e.g. Meta-Llama-3-8B
    spec: ModelSpec
    points: tuple[Point, ...]


@dataclass(frozen=True, slots=True)
class FitSet:
    """The fitted points of one GPU with the model's roofline at factors 1.0, and each
    point's weight in the objective: ``1 / points of its case / cases``."""

    measured_s: np.ndarray
    compute_s: np.ndarray  # compute time at mfu_prefill = 1
    memory_s: np.ndarray  # memory time at mbu_decode = 1
    weight: np.ndarray

    def objective(self, mfu: float, mbus: np.ndarray) -> np.ndarray:
        """Mean over cases of each case's mean |error| %, one per ``mbus`` value."""
        modelled = np.maximum(self.compute_s / mfu, self.memory_s / mbus[:, None])
        return np.asarray(np.abs(modelled / self.measured_s - 1.0) @ self.weight * 100.0)


def phase_of(tokens: int) -> str:
    return "decode" if tokens <= DECODE_MAX_TOKENS else "prefill"


def load_profiles(data: Path) -> tuple[list[Profile], list[str]]:
    """Every Llama-shaped ``mlp.csv`` under ``data`` for a catalog GPU, and notes on the
    files left out. Rows repeated for one (tokens, tp) are averaged."""
    profiles: list[Profile] = []
    notes: list[str] = []
    for path in sorted(data.glob("*/*/*/mlp.csv")):
        device, model = path.parts[-4], path.parts[-2]
        if device not in GPU_IDS:
            notes.append(f"{device}/{model}: no catalog GPU for {device}")
            continue
        if model not in NUM_LAYERS:
            notes.append(f"{device}/{model}: not one of the Llama-shaped models fitted, skipped")
            continue
        with path.open(newline="") as handle:
            rows = list(csv.DictReader(handle))
        if not rows:
            notes.append(f"{device}/{model}: empty file")
            continue
        spec = _layer_stack(model, rows[0])
        sums: dict[tuple[int, int], list[float]] = defaultdict(list)
        for row in rows:
            tokens, tp = (int(row[c]) for c in KEY_COLUMNS)
            layer_ms = sum(float(row.get(f"time_stats.{op}.median") or 0.0) for op in LAYER_OPS)
            sums[(tokens, tp)].append(layer_ms * spec.num_layers / 1e3)
        points = tuple(Point(t, tp, float(np.mean(v))) for (t, tp), v in sorted(sums.items()))
        profiles.append(Profile(device, model, spec, points))
    return profiles, notes


def _layer_stack(model: str, row: dict[str, str]) -> ModelSpec:
    """The profiled model as the catalog describes it, with no embedding or LM head
    (``vocab_size`` 0), since Vidur's layer profiles leave both out."""
    if row["use_gated_mlp"] != "True":
        raise ValueError(f"{model}: expected a gated MLP")
    heads, kv_heads, hidden, ffn = (int(row[c]) for c in SHAPE_COLUMNS[:4])
    return ModelSpec(
        model.lower(), NUM_LAYERS[model], hidden, heads, kv_heads, hidden // heads, ffn, 0, 4096
    )


def fit_set(profiles: Iterable[Profile], gpu: GpuSpec) -> FitSet:
    """The points of ``profiles`` priced by ``CostModel`` at unit factors, so that any
    factors are a rescaling: the model's rates are ``t * F * mfu`` and ``t * BW * mbu``."""
    unit = replace(gpu, mfu_prefill=1.0, mbu_decode=1.0)
    cases: dict[tuple[str, int, str], list[tuple[float, float, float]]] = defaultdict(list)
    for profile in profiles:
        for point in profile.points:
            lines = CostModel(profile.spec, unit, point.tp).decode_lines(point.tokens)
            key = (profile.model, point.tp, phase_of(point.tokens))
            cases[key].append((point.measured_s, lines.compute_s, lines.memory_s))
    rows = [(*v, 1.0 / len(vs) / len(cases)) for _, vs in sorted(cases.items()) for v in vs]
    measured, compute, memory, weight = (np.array(column) for column in zip(*rows, strict=True))
    return FitSet(measured, compute, memory, weight)


def fit_factors(points: FitSet) -> tuple[float, float]:
    """``(mfu_prefill, mbu_decode)`` of least objective: a coarse grid, then a fine one
    around its best (ties go to the lower factors, so the result is deterministic)."""

    def best(mfus: np.ndarray, mbus: np.ndarray) -> tuple[float, float]:
        scores = [
            (float(score), float(mfu), float(mbu))
            for mfu in mfus
            for score, mbu in zip(points.objective(mfu, mbus), mbus, strict=True)
        ]
        _, mfu, mbu = min(scores)
        return mfu, mbu

    def around(x: float) -> np.ndarray:
        grid = np.arange(x - 0.01, x + 0.01 + FINE_STEP / 2, FINE_STEP)
        return np.round(grid[(grid > 0) & (grid <= 1.0)], 4)

    mfu, mbu = best(COARSE_GRID, COARSE_GRID)
    return best(around(mfu), around(mbu))


def modelled_step_s(profile: Profile, gpu: GpuSpec, point: Point) -> float:
    """The cost model's roofline for one point at ``gpu``'s own factors."""
    lines = CostModel(profile.spec, gpu, point.tp).decode_lines(point.tokens)
    return max(lines.compute_s, lines.memory_s)


@dataclass(frozen=True, slots=True)
class CaseResult:
    model: str
    tp: int
    phase: str
    held_out: bool
    points: int
    catalog_error_pct: float
    fitted_error_pct: float


@dataclass(frozen=True, slots=True)
class GpuResult:
    gpu: GpuSpec
    fitted: GpuSpec
    cases: tuple[CaseResult, ...]

    def mean_error_pct(self, held_out: bool, fitted: bool, phase: str | None = None) -> float:
        """Mean over the held-out (or fitted) cases, of one phase or of both."""
        picked = [c for c in self.cases if c.held_out == held_out and phase in (None, c.phase)]
        if not picked:
            return float("nan")
        return float(
            np.mean([c.fitted_error_pct if fitted else c.catalog_error_pct for c in picked])
        )


def evaluate(profiles: Sequence[Profile], gpu: GpuSpec) -> GpuResult:
    """Fit ``gpu``'s factors on the non-held-out profiles and report every case, with
    errors recomputed through ``CostModel`` at the catalog's and at the fitted factors."""
    fitted_on = [p for p in profiles if p.model != HELD_OUT]
    if not fitted_on:
        raise ValueError(f"{gpu.id}: no profiled model to fit on")
    mfu, mbu = fit_factors(fit_set(fitted_on, gpu))
    fitted = replace(gpu, mfu_prefill=mfu, mbu_decode=mbu)
    errors: dict[tuple[str, int, str], tuple[list[float], list[float]]] = defaultdict(
        lambda: ([], [])
    )
    for profile in profiles:
        for point in profile.points:
            catalog_pct, fitted_pct = errors[(profile.model, point.tp, phase_of(point.tokens))]
            for spec, out in ((gpu, catalog_pct), (fitted, fitted_pct)):
                out.append(abs(modelled_step_s(profile, spec, point) / point.measured_s - 1) * 100)
    cases = tuple(
        CaseResult(model, tp, phase, model == HELD_OUT, len(cat), float(np.mean(cat)),
                   float(np.mean(fit)))
        for (model, tp, phase), (cat, fit) in sorted(
            errors.items(), key=lambda kv: (kv[0][0] == HELD_OUT, *kv[0])
        )
    )  # fmt: skip
    return GpuResult(gpu, fitted, cases)


def run(data: Path) -> tuple[list[GpuResult], list[str]]:
    profiles, notes = load_profiles(data)
    catalog = {g.id: g for g in BUILTIN_GPUS}
    results = []
    for device, gpu_id in sorted(GPU_IDS.items()):
        mine = [p for p in profiles if p.device == device]
        if mine:
            results.append(evaluate(mine, catalog[gpu_id]))
    return results, notes


def table(result: GpuResult) -> str:
    """One GPU's report, 80 columns wide."""
    gpu, fitted = result.gpu, result.fitted
    lines = [
        f"{gpu.id}: mfu_prefill {gpu.mfu_prefill:.3f} -> {fitted.mfu_prefill:.3f}, "
        f"mbu_decode {gpu.mbu_decode:.3f} -> {fitted.mbu_decode:.3f}",
        f"{'model':<26} {'tp':>2} {'phase':<7} {'points':>6} {'catalog |err| %':>15} "
        f"{'fitted |err| %':>14}",
    ]
    for held_out in (False, True):
        lines.append("-- held out (not in the fit)" if held_out else "-- fitted on")
        for c in (c for c in result.cases if c.held_out == held_out):
            mark = " *" if c.fitted_error_pct > 10.0 else ""
            lines.append(
                f"{c.model:<26} {c.tp:>2} {c.phase:<7} {c.points:>6} "
                f"{c.catalog_error_pct:>15.1f} {c.fitted_error_pct:>14.1f}{mark}"
            )
        for phase in ("prefill", "decode", None):
            label = f"mean, {phase or 'all'} cases"
            lines.append(
                f"{label:<43} {result.mean_error_pct(held_out, False, phase):>15.1f} "
                f"{result.mean_error_pct(held_out, True, phase):>14.1f}"
            )
    return "\n".join(lines)


def as_json(results: Sequence[GpuResult], notes: Sequence[str], data: Path) -> str:
    def r(x: float) -> float:
        return round(x, 4)

    doc = {
        "source": "github.com/microsoft/vidur data/profiling/compute (MIT)",
        "data": data.name,
        "held_out": HELD_OUT,
        "decode_max_tokens": DECODE_MAX_TOKENS,
        "notes": list(notes),
        "gpus": [
            {
                "gpu": res.gpu.id,
                "catalog": {"mfu_prefill": res.gpu.mfu_prefill, "mbu_decode": res.gpu.mbu_decode},
                "fitted": {
                    "mfu_prefill": res.fitted.mfu_prefill,
                    "mbu_decode": res.fitted.mbu_decode,
                },
                "mean_error_pct": {
                    f"{'held_out' if h else 'fitted_models'}_{ph or 'all'}_"
                    f"{'fitted' if f else 'catalog'}": r(res.mean_error_pct(h, f, ph))
                    for h in (False, True)
                    for ph in ("prefill", "decode", None)
                    for f in (False, True)
                },
                "cases": [
                    {
                        "model": c.model,
                        "tp": c.tp,
                        "phase": c.phase,
                        "held_out": c.held_out,
                        "points": c.points,
                        "catalog_error_pct": r(c.catalog_error_pct),
                        "fitted_error_pct": r(c.fitted_error_pct),
                    }
                    for c in res.cases
                ],
            }
            for res in results
        ],
    }
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data",
        type=Path,
        default=DEFAULT_DATA,
        help="folder laid out like Vidur's data/profiling/compute",
    )
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)  # fmt: skip
    if not args.data.is_dir():
        print(f"error: --data {args.data} is not a folder", file=sys.stderr)
        return 2
    results, notes = run(args.data)
    if not results:
        print(f"error: no <gpu>/<org>/<model>/mlp.csv for a100 or h100 under {args.data}",
              file=sys.stderr)  # fmt: skip
        return 2
    for note in notes:
        print(f"note: {note}")
    for result in results:
        print()
        print(table(result))
    print()
    print("* above 10% at the fitted factors: beyond what this roofline's shape can fit.")
    print("  It has no fixed time per kernel, which dominates small per-GPU shards")
    print("  (decode at tp 4-8), and no knee: steps of ~96-256 tokens run well below")
    print("  both peaks. See benchmarks/calibration/README.md.")
    if args.json:
        args.json.write_text(as_json(results, notes, args.data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
