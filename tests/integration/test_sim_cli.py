"""`isocost sim` as a user runs it: a real subprocess on the committed trace excerpt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ISOCOST = Path(sys.executable).with_name("isocost")
TRACE = (
    Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "mooncake_conversation_head.jsonl"
)
REQUIRED = {
    *("policy", "completed", "rejected", "ttft_p50_s", "ttft_p99_s", "tpot_p99_s", "e2e_p99_s"),
    *("goodput_rps", "prefix_hit_rate", "imbalance_cov", "mean_slowdown"),
}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run(
        [str(ISOCOST), "sim", *args], capture_output=True, text=True, timeout=240, env=env,
        check=False,
    )  # fmt: skip


def test_policies_side_by_side_json_table_plot_and_repeatable(tmp_path: Path) -> None:
    args = ("--trace", str(TRACE), "--replicas", "4", "--policies", "equal_cost,round_robin",
            "--speedup", "2", "--slo-ttft-per-1k-ms", "200", "--max-requests", "80")  # fmt: skip
    first = run(*args, "--json", str(tmp_path / "a.json"), "--plot", str(tmp_path / "a.png"))
    assert first.returncode == 0, first.stderr
    for text in ("equal_cost", "round_robin", "oracle", "TTFT p50", "goodput/s"):
        assert text in first.stdout
    rows = json.loads((tmp_path / "a.json").read_text())
    assert [r["policy"] for r in rows] == ["equal_cost", "round_robin", "oracle"]
    for row in rows:
        assert row.keys() >= REQUIRED
        assert row["completed"] + row["rejected"] == 80
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    second = run(*args, "--json", str(tmp_path / "b.json"), "--jobs", "1")
    assert second.returncode == 0, second.stderr
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_a_rate_sweep_reports_capacity_at_slo(tmp_path: Path) -> None:
    done = run("--workload", "shared-prefix", "--groups", "4", "--prompts-per-group", "10",
               "--replicas", "2", "--policies", "round_robin,equal_cost", "--sweep-rate", "2,40",
               "--slo-ttft-ms", "500", "--json", str(tmp_path / "s.json"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "capacity at SLO" in done.stdout
    rows = json.loads((tmp_path / "s.json").read_text())
    assert sorted({r["rate_rps"] for r in rows if r["policy"] != "oracle"}) == [2.0, 40.0]
    slow = [r for r in rows if r["rate_rps"] == 2.0]
    assert all(r["capacity_at_slo_rps"] in (2.0, 40.0) for r in slow)


def test_a_missing_trace_is_one_line_naming_the_file() -> None:
    done = run("--trace", "/nonexistent/trace.jsonl")
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert "/nonexistent/trace.jsonl" in done.stderr and "no such file" in done.stderr


def test_a_malformed_trace_line_is_named(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    lines = TRACE.read_text().splitlines()[:3]
    trace.write_text("\n".join([*lines, '{"timestamp": 5, "input_length": "many"}']) + "\n")
    done = run("--trace", str(trace))
    assert done.returncode == 2
    assert f"{trace}:4" in done.stderr
    assert done.stderr.strip().count("\n") == 0


def test_an_unknown_policy_lists_the_valid_ones() -> None:
    done = run("--trace", str(TRACE), "--policies", "equal_cost,fastest")
    assert done.returncode == 2
    assert "unknown policy 'fastest'" in done.stderr
    for name in ("dynamo_kv", "equal_cost", "llmd_default", "round_robin", "sglang_cache_aware"):
        assert name in done.stderr


def test_a_mixed_cluster_file_runs_and_a_bad_one_is_named(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "cluster.yaml"
    done = run("--trace", str(TRACE), "--cluster", str(example), "--policies", "equal_cost",
               "--max-requests", "40", "--json", str(tmp_path / "c.json"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    (row, _oracle) = json.loads((tmp_path / "c.json").read_text())
    assert row["completed"] + row["rejected"] == 40
    bad = tmp_path / "bad.yaml"
    bad.write_text("replicas: [{gpu: a100-80g, model: llama-3.1-8b, colour: red}]\n")
    done = run("--trace", str(TRACE), "--cluster", str(bad))
    assert done.returncode == 2
    assert str(bad) in done.stderr and "colour" in done.stderr
    assert done.stderr.strip().count("\n") == 0
