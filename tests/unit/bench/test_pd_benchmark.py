"""benchmarks/pd.py --quick end to end: one JSON object per (trace, mode), each with its
capacity, the splits the planner chose, and bad --ratios refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "pd.py"
TRACES = Path(__file__).resolve().parents[4] / "shared" / "traces"


@pytest.mark.skipif(not TRACES.is_dir(), reason="../shared/traces is not beside the project")
def test_quick_run_writes_one_object_per_trace_and_mode(tmp_path: Path) -> None:
    out = tmp_path / "pd.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert [(r["trace"], r["mode"]) for r in rows] == [
        (trace, mode)
        for trace in ("mooncake", "azure_code")
        for mode in ("colocated", "pd", "conditional")
    ]
    for row in rows:
        assert row["capacity_at_slo_rps"] is None or row["capacity_at_slo_rps"] > 0
        if row["mode"] == "colocated":
            assert (row["prefill_replicas"], row["decode_replicas"]) == (0, 16)
        else:
            assert row["prefill_replicas"] + row["decode_replicas"] == 16
            assert row["split_by"] == "planner"


def test_a_split_that_is_not_16_gpus_is_refused_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--ratios", "4:10"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().startswith("error: --ratios") and "\n" not in done.stderr.strip()
