"""The catalog fit to Vidur's public GPU profiles (benchmarks/calibration/fit_vidur.py), run
on the committed excerpt: the fit never loses to the catalog on the models it sees, the
held-out model is reported apart, and the fit's shortcut agrees with the cost model."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from isocost.core.catalog import Catalog

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "calibration" / "fit_vidur.py"


@pytest.fixture(scope="module")
def fit() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fit_vidur", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def results(fit: ModuleType) -> list[Any]:
    found, _ = fit.run(fit.DEFAULT_DATA)
    return found


def test_both_catalog_gpus_are_fitted_with_the_held_out_model_apart(
    fit: ModuleType, results: list[Any]
) -> None:
    assert [r.gpu.id for r in results] == ["a100-80g", "h100-80g"]
    for result in results:
        held_out = {c.model for c in result.cases if c.held_out}
        fitted_on = {c.model for c in result.cases if not c.held_out}
        assert held_out == {fit.HELD_OUT}
        assert fit.HELD_OUT not in fitted_on and len(fitted_on) >= 4
        assert {c.phase for c in result.cases} == {"prefill", "decode"}
        for held in (False, True):
            assert math.isfinite(result.mean_error_pct(held, fitted=True))


def test_the_fit_keeps_or_lowers_the_error_on_the_models_it_sees(results: list[Any]) -> None:
    for result in results:
        catalog = result.mean_error_pct(held_out=False, fitted=False)
        fitted = result.mean_error_pct(held_out=False, fitted=True)
        assert fitted <= catalog + 1e-9, (result.gpu.id, catalog, fitted)
        assert result.fitted.step_overhead_s == result.gpu.step_overhead_s  # not identifiable


def test_the_rescaled_objective_is_the_cost_models_own_error(
    fit: ModuleType, results: list[Any]
) -> None:
    """The grid search prices candidates by rescaling unit-factor times; the table prices
    through ``CostModel`` at the fitted factors. Both must give the same figure."""
    profiles, _ = fit.load_profiles(fit.DEFAULT_DATA)
    for result in results:
        device = next(d for d, g in fit.GPU_IDS.items() if g == result.gpu.id)
        seen = [p for p in profiles if p.device == device and p.model != fit.HELD_OUT]
        points = fit.fit_set(seen, result.gpu)
        values = [getattr(result.fitted, p.field) / p.to_spec for p in fit.PARAMETERS]
        shortcut = points.objective(values)
        assert shortcut == pytest.approx(result.mean_error_pct(held_out=False, fitted=True))


def test_the_shape_terms_are_fitted_and_stay_physical(results: list[Any]) -> None:
    """Each GPU gets a fixed time per layer, a GEMM knee and elementwise traffic, all
    positive and of the size a layer's kernels have (tens of us, tens to hundreds of
    tokens, a few to some tens of hidden vectors); the built-in GPU keeps none."""
    for result in results:
        gpu, fitted = result.gpu, result.fitted
        assert (gpu.kernel_s_per_layer, gpu.gemm_half_rate_tokens) == (0.0, 0.0)
        assert 5e-6 < fitted.kernel_s_per_layer < 200e-6
        assert 1 <= fitted.gemm_half_rate_tokens <= 512
        assert 1 <= fitted.elementwise_io_per_layer <= 50
        assert 0.3 < fitted.mfu_prefill <= 1.0 and 0.3 < fitted.mbu_decode <= 1.0


def test_the_catalog_yaml_loads_back_as_the_fitted_gpus(
    fit: ModuleType, results: list[Any]
) -> None:
    catalog = Catalog.builtin().merged(fit.as_catalog_yaml(results, fit.DEFAULT_DATA), "f.yaml")
    for result in results:
        loaded = catalog.gpu(result.gpu.id + fit.FITTED_SUFFIX)
        assert replace(loaded, id=result.gpu.id, name=result.gpu.name) == result.fitted
        assert catalog.gpu(result.gpu.id) == result.gpu  # the built-in stays as it was


def test_the_committed_catalog_matches_the_committed_results(fit: ModuleType) -> None:
    """fitted-gpus.yaml and results.json come from one run on Vidur's full files."""
    doc = json.loads((SCRIPT.parent / "results.json").read_text())
    text = (SCRIPT.parent / "fitted-gpus.yaml").read_text()
    catalog = Catalog.builtin().merged(text, "fitted-gpus.yaml")
    for entry in doc["gpus"]:
        loaded = catalog.gpu(entry["fitted_catalog_id"])
        for field, value in entry["fitted"].items():
            assert getattr(loaded, field) == pytest.approx(value), field


def test_the_table_fits_80_columns_and_names_the_held_out_rows(
    fit: ModuleType, results: list[Any]
) -> None:
    for result in results:
        text = fit.table(result)
        assert max(len(line) for line in text.splitlines()) <= 80, text
        held = text.split("-- held out")[1]
        assert fit.HELD_OUT in held
        assert f"{result.fitted.mfu_prefill:.3f}" in text.splitlines()[0]


def test_json_is_deterministic_and_bad_data_is_one_line(
    fit: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    assert fit.main(["--json", str(first)]) == 0
    assert fit.main(["--json", str(second)]) == 0
    assert first.read_bytes() == second.read_bytes()
    yaml = tmp_path / "fitted.yaml"
    assert fit.main(["--catalog-out", str(yaml)]) == 0
    assert yaml.read_text() == fit.as_catalog_yaml(fit.run(fit.DEFAULT_DATA)[0], fit.DEFAULT_DATA)
    doc = json.loads(first.read_text())
    assert doc["held_out"] == fit.HELD_OUT
    capsys.readouterr()
    assert fit.main(["--data", str(tmp_path / "missing")]) == 2
    assert fit.main(["--data", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)


def test_each_shape_term_lowers_the_fitted_error_and_the_last_row_is_the_fit(
    fit: ModuleType, results: list[Any]
) -> None:
    rows = fit.ablation(fit.DEFAULT_DATA)
    assert [label for label, _ in rows] == ["mfu, mbu"] + [p.field for p in fit.PARAMETERS[2:]]
    for gpu in range(len(results)):
        errors = [found[gpu].mean_error_pct(False, True) for _, found in rows]
        assert errors == sorted(errors, reverse=True), errors
        assert rows[-1][1][gpu].fitted == results[gpu].fitted
        first = rows[0][1][gpu].fitted
        assert (first.kernel_s_per_layer, first.gemm_half_rate_tokens) == (0.0, 0.0)
    assert max(len(line) for line in fit.ablation_table(rows).splitlines()) <= 80
