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
larger of its compute and memory time, ``decode_lines``) plus its per-layer kernel time
(``layer_kernels_time_s``) for a model of the same shape with no embedding or LM head, at
zero context. Steps of up to ``max_num_seqs`` tokens are decode steps, larger ones
prefill chunks. Per GPU five ``GpuSpec`` parameters are fitted by a deterministic pattern
search to the least mean |error| over the fitted cases (model x tp x phase, each case
weighing the same), on every profiled model except Llama-2-7B, which is held out and only
evaluated: the efficiency factors ``mfu_prefill`` and ``mbu_decode`` and the shape terms
``kernel_s_per_layer``, ``gemm_half_rate_tokens`` and ``elementwise_io_per_layer``
(``isocost.core.hardware`` says what each one is). Host overheads (``step_overhead_s``,
``prefill_overhead_s``) cannot be identified from GPU kernel times and are left as they
are. Run:

    .venv/bin/python benchmarks/calibration/fit_vidur.py [--data DIR] [--json OUT]
        [--catalog-out YAML]

``--data`` is a folder laid out like Vidur's ``data/profiling/compute``
(``<gpu>/<org>/<model>/mlp.csv``); the default is the excerpt committed next to this file.
``--catalog-out`` writes the fitted GPUs as a catalog file under their own ids
(``a100-80g-vidur``, ``h100-80g-vidur``): opt-in, the built-in catalog is not changed.
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

from isocost.core.catalog import gpus_catalog_yaml
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
FITTED_SUFFIX = "-vidur"  # the fitted GPUs' catalog ids: a100-80g-vidur, h100-80g-vidur


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
class Parameter:
    """One fitted ``GpuSpec`` field, searched on multiples of ``resolution`` within
    ``[low, high]``; ``to_spec`` converts the searched unit to the field's (us -> s)."""

    field: str
    resolution: float
    low: float
    high: float
    to_spec: float = 1.0


# The two efficiency factors and the three shape terms (GpuSpec's docstring says why each).
PARAMETERS = (
    Parameter("mfu_prefill", 0.001, 0.05, 1.0),
    Parameter("mbu_decode", 0.001, 0.05, 1.0),
    Parameter("kernel_s_per_layer", 0.1, 0.0, 500.0, to_spec=1e-6),  # searched in us
    Parameter("gemm_half_rate_tokens", 1.0, 0.0, 1024.0),
    Parameter("elementwise_io_per_layer", 0.1, 0.0, 100.0),
)
# Pattern search: steps of resolution * 2**level, from COARSEST_LEVEL down to 0, from each
# start (mfu, mbu, kernel us, n_1/2 tokens, hidden vectors); the best end point wins. The
# objective is flat with shallow local minima, so one start is not enough.
COARSEST_LEVEL = 7
STARTS = (
    (None, None, 0.0, 0.0, 0.0),  # None: the catalog's factor
    *((0.7, 0.8, k, n, e) for k in (20.0, 50.0) for n in (50.0, 150.0) for e in (5.0, 15.0)),
)


@dataclass(frozen=True, slots=True)
class FitSet:
    """The fitted points of one GPU as the terms of the cost model's step time, each at
    unit factor so that any parameters are a rescaling, and each point's weight in the
    objective: ``1 / points of its case / cases``. A point's modelled time is::

        max(gemm_s_per_token * (n + n_half) / mfu, memory_s / mbu)
            + layers * kernel_s + elementwise_s * io / mbu
    """

    measured_s: np.ndarray
    tokens: np.ndarray
    gemm_s_per_token: np.ndarray  # weight FLOPs of one token at mfu_prefill = 1
    memory_s: np.ndarray  # weight reads at mbu_decode = 1
    layers: np.ndarray
    elementwise_s: np.ndarray  # one hidden vector per token per layer at mbu_decode = 1
    weight: np.ndarray

    def modelled_s(self, values: Sequence[float]) -> np.ndarray:
        """Each point's step time at ``values`` (in ``PARAMETERS``' order and units)."""
        mfu, mbu, kernel_us, n_half, io = values
        compute = self.gemm_s_per_token * (self.tokens + n_half) / mfu
        return (
            np.maximum(compute, self.memory_s / mbu)
            + self.layers * kernel_us * 1e-6
            + self.elementwise_s * io / mbu
        )

    def objective(self, values: Sequence[float]) -> float:
        """Mean over cases of each case's mean |error| %."""
        error = np.abs(self.modelled_s(values) / self.measured_s - 1.0)
        return float(error @ self.weight * 100.0)


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
    """The points of ``profiles`` priced by ``CostModel`` at unit factors and unit shape
    terms one at a time, so that the search rescales terms instead of calling it."""
    unit = replace(
        gpu, mfu_prefill=1.0, mbu_decode=1.0, kernel_s_per_layer=0.0,
        gemm_half_rate_tokens=0.0, elementwise_io_per_layer=0.0,
    )  # fmt: skip
    one_vector = replace(unit, elementwise_io_per_layer=1.0)
    cases: dict[tuple[str, int, str], list[tuple[float, ...]]] = defaultdict(list)
    for profile in profiles:
        for point in profile.points:
            n = point.tokens
            lines = CostModel(profile.spec, unit, point.tp).decode_lines(n)
            elementwise = CostModel(profile.spec, one_vector, point.tp).layer_kernels_time_s(n)
            key = (profile.model, point.tp, phase_of(n))
            cases[key].append(
                (point.measured_s, n, lines.compute_s / n, lines.memory_s,
                 profile.spec.num_layers, elementwise)
            )  # fmt: skip
    rows = [(*v, 1.0 / len(vs) / len(cases)) for _, vs in sorted(cases.items()) for v in vs]
    return FitSet(*(np.array(column, dtype=float) for column in zip(*rows, strict=True)))


def fit_parameters(
    points: FitSet, gpu: GpuSpec, fitted_count: int = len(PARAMETERS)
) -> tuple[float, ...]:
    """The parameters of least objective (in ``PARAMETERS``' units): from each of
    ``STARTS``, a pattern search that moves one parameter at a time by its step while
    that lowers the objective, halving the steps when no move does. Parameters stay on
    multiples of their resolution (kept as integers), so the result is deterministic.
    Only the first ``fitted_count`` parameters move; the rest keep ``gpu``'s values."""
    catalog = [getattr(gpu, p.field) / p.to_spec for p in PARAMETERS]
    low = [round(p.low / p.resolution) for p in PARAMETERS]
    high = [round(p.high / p.resolution) for p in PARAMETERS]

    def score(ticks: Sequence[int]) -> float:
        return points.objective([t * p.resolution for t, p in zip(ticks, PARAMETERS, strict=True)])

    best: tuple[float, list[int]] | None = None
    for start in STARTS:
        values = [catalog[i] if v is None or i >= fitted_count else v for i, v in enumerate(start)]
        ticks = [round(v / p.resolution) for v, p in zip(values, PARAMETERS, strict=True)]
        current = score(ticks)
        for level in range(COARSEST_LEVEL, -1, -1):
            step, moved = 2**level, True
            while moved:
                moved = False
                for i in range(fitted_count):
                    for direction in (-step, step):
                        while low[i] <= ticks[i] + direction <= high[i]:
                            trial = [*ticks[:i], ticks[i] + direction, *ticks[i + 1 :]]
                            trial_score = score(trial)
                            if trial_score >= current:
                                break
                            ticks, current, moved = trial, trial_score, True
        if best is None or current < best[0]:
            best = (current, ticks)
    assert best is not None
    return tuple(t * p.resolution for t, p in zip(best[1], PARAMETERS, strict=True))


def with_parameters(gpu: GpuSpec, values: Sequence[float]) -> GpuSpec:
    """``gpu`` with the fitted ``values`` (in ``PARAMETERS``' units)."""
    fields = {p.field: round(v, 6) * p.to_spec for p, v in zip(PARAMETERS, values, strict=True)}
    return replace(gpu, **fields)


def modelled_step_s(profile: Profile, gpu: GpuSpec, point: Point) -> float:
    """The cost model's GPU time for one point at ``gpu``'s own factors and shape terms:
    the roofline plus the per-layer kernels, without all-reduces or host overheads."""
    cost = CostModel(profile.spec, gpu, point.tp)
    lines = cost.decode_lines(point.tokens)
    return max(lines.compute_s, lines.memory_s) + cost.layer_kernels_time_s(point.tokens)


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


def evaluate(
    profiles: Sequence[Profile], gpu: GpuSpec, fitted_count: int = len(PARAMETERS)
) -> GpuResult:
    """Fit ``gpu``'s first ``fitted_count`` parameters on the non-held-out profiles and
    report every case, with errors recomputed through ``CostModel`` at the catalog's and
    at the fitted parameters."""
    fitted_on = [p for p in profiles if p.model != HELD_OUT]
    if not fitted_on:
        raise ValueError(f"{gpu.id}: no profiled model to fit on")
    values = fit_parameters(fit_set(fitted_on, gpu), gpu, fitted_count)
    fitted = with_parameters(gpu, values)
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


def run(data: Path, fitted_count: int = len(PARAMETERS)) -> tuple[list[GpuResult], list[str]]:
    profiles, notes = load_profiles(data)
    catalog = {g.id: g for g in BUILTIN_GPUS}
    results = []
    for device, gpu_id in sorted(GPU_IDS.items()):
        mine = [p for p in profiles if p.device == device]
        if mine:
            results.append(evaluate(mine, catalog[gpu_id], fitted_count))
    return results, notes


def ablation(data: Path) -> list[tuple[str, list[GpuResult]]]:
    """The fit with the parameters added one at a time (the factors alone, then each
    shape term in ``PARAMETERS``' order): what each term buys, fitted and held out."""
    return [
        (PARAMETERS[count - 1].field if count > 2 else "mfu, mbu", run(data, count)[0])
        for count in range(2, len(PARAMETERS) + 1)
    ]


def ablation_table(rows: Sequence[tuple[str, Sequence[GpuResult]]]) -> str:
    """Mean |error| % of all cases, fitted models / held-out model, per GPU."""
    gpus = [r.gpu.id for r in rows[0][1]]
    lines = [
        "what each term buys: mean |error| % of all cases, fitted models / held out",
        f"{'fitted (cumulative)':<26}" + "".join(f"{g:>18}" for g in gpus),
    ]
    for label, results in rows:
        cells = "".join(
            f"{f'{r.mean_error_pct(False, True):.1f} / {r.mean_error_pct(True, True):.1f}':>18}"
            for r in results
        )
        lines.append(f"{('+ ' if label != 'mfu, mbu' else '') + label:<26}{cells}")
    return "\n".join(lines)


def table(result: GpuResult) -> str:
    """One GPU's report, 80 columns wide."""
    gpu, fitted = result.gpu, result.fitted
    lines = [
        f"{gpu.id}: mfu_prefill {gpu.mfu_prefill:.3f} -> {fitted.mfu_prefill:.3f}, "
        f"mbu_decode {gpu.mbu_decode:.3f} -> {fitted.mbu_decode:.3f}",
        f"  kernel time per layer {gpu.kernel_s_per_layer * 1e6:.1f} -> "
        f"{fitted.kernel_s_per_layer * 1e6:.1f} us, GEMM half-rate tokens "
        f"{gpu.gemm_half_rate_tokens:.0f} -> {fitted.gemm_half_rate_tokens:.0f},",
        f"  elementwise io per layer {gpu.elementwise_io_per_layer:.1f} -> "
        f"{fitted.elementwise_io_per_layer:.1f} hidden vectors",
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


def as_json(
    results: Sequence[GpuResult],
    notes: Sequence[str],
    data: Path,
    rows: Sequence[tuple[str, Sequence[GpuResult]]] = (),
) -> str:
    def r(x: float) -> float:
        return round(x, 4)

    doc = {
        "ablation": [
            {
                "fitted_up_to": label,
                **{
                    res.gpu.id: {
                        "fitted_models_all_fitted": r(res.mean_error_pct(False, True)),
                        "held_out_all_fitted": r(res.mean_error_pct(True, True)),
                    }
                    for res in found
                },
            }
            for label, found in rows
        ],
        "source": "github.com/microsoft/vidur data/profiling/compute (MIT)",
        "data": data.name,
        "held_out": HELD_OUT,
        "decode_max_tokens": DECODE_MAX_TOKENS,
        "notes": list(notes),
        "gpus": [
            {
                "gpu": res.gpu.id,
                "catalog": {p.field: getattr(res.gpu, p.field) for p in PARAMETERS},
                "fitted": {p.field: getattr(res.fitted, p.field) for p in PARAMETERS},
                "fitted_catalog_id": res.gpu.id + FITTED_SUFFIX,
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


def as_catalog_yaml(results: Sequence[GpuResult], data: Path) -> str:
    """The fitted GPUs as a user catalog (``isocost ... --catalog FILE``), each under its
    own id (``FITTED_SUFFIX``) so that the built-in GPU stays what it was."""
    comments = [
        "GPUs fitted to Vidur's public per-layer kernel timings (MIT, microsoft/vidur",
        "data/profiling/compute) by benchmarks/calibration/fit_vidur.py, Llama-2-7B held",
        f"out, data folder {data.name}. Opt-in: --catalog FILE, then GPU a100-80g-vidur",
        "or h100-80g-vidur. Only the GEMM and elementwise kernels are fitted: attention,",
        "all-reduces and host overheads keep the built-in GPU's figures.",
    ]
    renamed = (
        replace(
            res.fitted,
            id=res.fitted.id + FITTED_SUFFIX,
            name=f"{res.fitted.name}, fitted to Vidur profiles",
        )
        for res in results
    )
    return gpus_catalog_yaml(renamed, comments)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data",
        type=Path,
        default=DEFAULT_DATA,
        help="folder laid out like Vidur's data/profiling/compute",
    )
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument(
        "--catalog-out", type=Path, help="write the fitted GPUs here as a catalog YAML"
    )
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
    print("* above 10% at the fitted parameters. See benchmarks/calibration/README.md.")
    rows = ablation(args.data)
    print()
    print(ablation_table(rows))
    if args.json:
        args.json.write_text(as_json(results, notes, args.data, rows))
    if args.catalog_out:
        args.catalog_out.write_text(as_catalog_yaml(results, args.data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
