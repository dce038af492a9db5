"""The catalog fit to Vidur's public GPU profiles (benchmarks/calibration/fit_vidur.py), run
on the committed excerpt: the fit never loses to the catalog on the models it sees, the
held-out model is reported apart, and the fit's shortcut agrees with the cost model."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

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
        mfu, mbu = result.fitted.mfu_prefill, result.fitted.mbu_decode
        (shortcut,) = points.objective(mfu, np.array([mbu]))
        assert shortcut == pytest.approx(result.mean_error_pct(held_out=False, fitted=True))


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
    doc = json.loads(first.read_text())
    assert doc["held_out"] == fit.HELD_OUT
    capsys.readouterr()
    assert fit.main(["--data", str(tmp_path / "missing")]) == 2
    assert fit.main(["--data", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)
