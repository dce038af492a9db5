"""`isocost sim` as a user runs it: a real subprocess on the committed trace excerpt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from isocost.core.catalog import Catalog
from isocost.core.errors import IsocostError
from isocost.runtime.config import check_references, parse_config

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


GATEWAY_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gateway.yaml"

# A policy that exists only in this file: a declared plugin instance with its own
# parameters, composed with an affinity scorer, behind SLO admission, plus a route.
CUSTOM_POLICY = """\
policy: cheap_affinity
pools:
  - model: llama-3.1-8b
    replicas:
      - {url: "http://10.0.0.1:8000", name: fast, gpu: h100-80g, groups: [fast]}
      - {url: "http://10.0.0.2:8000", gpu: l20-48g, tp: 2, weight: 0.5, max_queue: 8}
scheduling:
  plugins:
    - {name: gentle-cost, type: equal-cost-scorer, parameters: {lambda_delay: 0.5}}
  policies:
    - name: cheap_affinity
      scorers:
        - {plugin: gentle-cost, weight: 1.0}
        - {plugin: session-affinity-scorer, weight: 0.3}
      admission: {slo: true}
  routes:
    - {name: short, max_prompt_tokens: 4000, groups: [[fast], []]}
limits: {max_queue: 16, queue_timeout_ms: 5000, max_retries: 1}
"""


def test_the_gateway_example_runs_its_pool_policy(tmp_path: Path) -> None:
    done = run("--config", str(GATEWAY_EXAMPLE), "--pool", "llama-3.1-8b", "--trace", str(TRACE),
               "--max-requests", "40", "--json", str(tmp_path / "g.json"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "g.json").read_text())
    assert [r["policy"] for r in rows] == ["cost_with_affinity", "oracle"]
    assert rows[0]["completed"] + rows[0]["rejected"] == 40


def test_a_policy_defined_only_in_the_file_is_simulated(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(CUSTOM_POLICY)
    done = run("--config", str(config), "--trace", str(TRACE), "--max-requests", "40",
               "--policies", "cheap_affinity,round_robin", "--plot", str(tmp_path / "p.png"),
               "--json", str(tmp_path / "c.json"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "c.json").read_text())
    assert [r["policy"] for r in rows] == ["cheap_affinity", "round_robin", "oracle"]
    assert all(r["completed"] + r["rejected"] == 40 for r in rows)
    default = run("--config", str(config), "--trace", str(TRACE), "--max-requests", "10")
    assert default.returncode == 0, default.stderr
    assert "cheap_affinity" in default.stdout and "round_robin" not in default.stdout


def test_several_pools_need_pool_and_the_error_lists_them() -> None:
    done = run("--config", str(GATEWAY_EXAMPLE), "--trace", str(TRACE))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert "llama-3.1-8b, llama-3.1-70b" in done.stderr and "--pool" in done.stderr


@pytest.mark.parametrize(
    "text",
    [
        "pools: [{model: llama-3.1-8b, replicas: [{url: 'http://a:1', gpuu: a100-80g}]}]",
        "pools: [{model: llama-3.1-8b, replicas: [{url: 'http://a:1', tensor_parallel: 2}]}]",
        "pools: [{model: llama-3.1-8b, replicas: [{url: 'http://a:1', name: x},"
        " {url: 'http://b:1', name: x}]}]",
        "pools: [{model: llama-3.1-8b, policy: fastest, replicas: [{url: 'http://a:1'}]}]",
    ],
    ids=["unknown-key", "renamed-key", "duplicate-name", "unknown-policy"],
)
def test_a_bad_gateway_file_gets_the_same_line_as_serve(tmp_path: Path, text: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text + "\n")
    with pytest.raises(IsocostError) as parsed:
        check_references(parse_config(text, str(config)), Catalog.builtin())
    expected = f"error: {parsed.value}"
    simulated = run("--config", str(config), "--trace", str(TRACE))
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    served = subprocess.run(
        [str(ISOCOST), "serve", "--config", str(config), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    for done in (simulated, served):
        assert done.returncode == 2
        assert done.stderr.strip() == expected


def test_capacity_by_bisection_brackets_each_policy_to_the_precision(tmp_path: Path) -> None:
    args = ("--workload", "mix", "--max-requests", "200", "--replicas", "2", "--policies",
            "round_robin,equal_cost", "--capacity", "0.5:20", "--precision", "0.1")  # fmt: skip
    done = run(*args, "--json", str(tmp_path / "a.json"))
    assert done.returncode == 0, done.stderr
    assert "capacity at SLO" in done.stdout and "bisected to 10%" in done.stdout
    result = json.loads((tmp_path / "a.json").read_text())
    assert (result["low_rps"], result["high_rps"], result["precision"]) == (0.5, 20.0, 0.1)
    target = result["target"]
    assert [p["policy"] for p in result["policies"]] == ["round_robin", "equal_cost"]
    for policy in result["policies"]:
        assert policy["status"] == "bracketed", policy["status"]
        attained = {p["rate_rps"]: p["slo_attainment"] for p in policy["probes"]}
        meets, misses = policy["meets_at_rps"], policy["misses_at_rps"]
        assert policy["capacity_rps"] == meets and 0.5 <= meets < misses <= 20.0
        assert attained[meets] >= target > attained[misses]
        assert policy["slo_attainment_at_capacity"] == attained[meets]
        assert misses - meets <= 0.1 * meets
        # no probe between the two ends of the bracket; every probe ran all 200 requests
        assert not any(meets < rate < misses for rate in attained)
        assert all(p["arrivals"] == 200 for p in policy["probes"])
        assert policy["capacity_ratio"]["against"] != policy["policy"]
    again = run(*args, "--json", str(tmp_path / "b.json"), "--jobs", "1")
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--capacity", "0:20"), "LO must be > 0"),
        (("--capacity", "5:2"), "HI finite and > LO"),
        (("--capacity", "fast"), "give LO:HI"),
        (("--capacity", "1:20", "--precision", "1"), "precision must be in (0, 1)"),
        (("--capacity", "1:20", "--sweep-rate", "2,4"), "not both"),
    ],
)
def test_bad_capacity_arguments_are_one_line(extra: tuple[str, ...], message: str) -> None:
    done = run("--workload", "mix", "--max-requests", "20", "--replicas", "2", *extra)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and message in done.stderr, done.stderr


def test_the_admission_audit_replays_rejections_in_each_worker(tmp_path: Path) -> None:
    args = ("--trace", str(TRACE), "--replicas", "2", "--policies", "equal_cost,round_robin",
            "--speedup", "4", "--slo-ttft-per-1k-ms", "200", "--max-requests", "80",
            "--audit-admission", "--jobs", "2")  # fmt: skip
    done = run(*args, "--json", str(tmp_path / "a.json"))
    assert done.returncode == 0, done.stderr
    assert "admission audit" in done.stdout and "precision" in done.stdout
    rows = json.loads((tmp_path / "a.json").read_text())
    audit = rows[0]["admission_audit"]
    assert audit["rejections"] == rows[0]["rejected_by_reason"].get("deadline", 0) > 0
    assert audit["true_rejections"] + audit["false_rejections"] == audit["rejections"]
    again = run(*args[:-1], "1", "--json", str(tmp_path / "b.json"))
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    refused = run(*args, "--no-deadlines")
    assert refused.returncode != 0 and refused.stderr.strip().count("\n") == 0
    assert "--audit-admission" in refused.stderr


def test_a_rate_is_the_simulated_requests_own_and_a_sweep_point_there_is_the_same_run(
    tmp_path: Path,
) -> None:
    args = ("--trace", str(TRACE), "--replicas", "2", "--policies", "round_robin",
            "--max-requests", "80")  # fmt: skip
    single = run(*args, "--rate", "3", "--json", str(tmp_path / "single.json"))
    assert single.returncode == 0, single.stderr
    swept = run(*args, "--sweep-rate", "3,6", "--json", str(tmp_path / "sweep.json"))
    assert swept.returncode == 0, swept.stderr
    (row,) = [
        r for r in json.loads((tmp_path / "single.json").read_text()) if r["policy"] != "oracle"
    ]
    assert row["offered_rps"] == pytest.approx(3.0)  # the first 80's rate, not the trace's
    at_three = next(
        r for r in json.loads((tmp_path / "sweep.json").read_text()) if r.get("rate_rps") == 3.0
    )
    for key in ("offered_rps", "completed", "ttft_p99_s", "slo_attainment"):
        assert at_three[key] == row[key], key


def test_a_lengths_only_trace_gets_poisson_arrivals_at_the_rate(tmp_path: Path) -> None:
    lengths = TRACE.with_name("vidur_arxiv_head.csv")
    args = ("--trace", str(lengths), "--replicas", "2", "--policies", "round_robin",
            "--max-requests", "60", "--rate", "4")  # fmt: skip
    done = run(*args, "--json", str(tmp_path / "a.json"))
    assert done.returncode == 0, done.stderr
    row = json.loads((tmp_path / "a.json").read_text())[0]
    assert row["completed"] + row["rejected"] == 60
    assert 2.5 < row["offered_rps"] < 6.0  # 60 Poisson arrivals at 4/s, not one burst at t=0
    again = run(*args, "--json", str(tmp_path / "b.json"))
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
