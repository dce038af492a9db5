"""The demo's headline compares the last policy with its honest baseline: the best
``<peer>_slo`` run when one ran, else the first run."""

from __future__ import annotations

from isocost.bench import BenchResult
from isocost.bench._records import BenchSummary
from isocost.demo._report import headline


def _run(label: str, ttft_p99_s: float | None) -> BenchResult:
    summary = BenchSummary(
        label=label, url="http://127.0.0.1:8080", model="llama-3.1-8b", requests=100,
        completed=100, errors=0, errors_by_kind={}, completed_by_replica={}, duration_s=60.0,
        throughput_rps=1.6, output_tokens_per_s=100.0, goodput_rps=1.5, slo_ttft_ms=2000,
        slo_tpot_ms=100, ttft_p50_s=0.3, ttft_p90_s=1.0, ttft_p99_s=ttft_p99_s,
        tpot_p50_s=0.04, tpot_p90_s=0.05, tpot_p99_s=0.06, itl_p50_s=0.04, itl_p90_s=0.05,
        itl_p99_s=0.06, e2e_p50_s=5.0, e2e_p90_s=8.0, e2e_p99_s=10.0, send_lag_p99_s=0.0,
        send_lag_max_s=0.0, ttft_samples_s=[], e2e_samples_s=[],
    )  # fmt: skip
    return BenchResult([], summary)


def test_without_slo_baselines_the_last_run_is_compared_with_the_first() -> None:
    text = headline([_run("round_robin", 20.0), _run("llmd_default", 2.0), _run("equal_cost", 4.0)])
    assert text == "equal_cost P99 TTFT 4.00 s vs round_robin 20.00 s: 5.0x lower"


def test_the_best_slo_baseline_is_the_reference_when_one_ran() -> None:
    runs = [
        _run("round_robin", 20.0),
        _run("llmd_default_slo", 3.0),
        _run("dynamo_kv_slo", 6.0),
        _run("equal_cost", 4.0),
    ]
    text = headline(runs)
    assert "vs llmd_default_slo (the best _slo baseline) 3.00 s: not lower" in text
    faster = [*runs[:-1], _run("equal_cost", 1.5)]
    assert headline(faster).endswith("3.00 s: 2.0x lower")


def test_a_baseline_without_completed_requests_is_passed_over() -> None:
    runs = [_run("round_robin", 20.0), _run("llmd_default_slo", None), _run("equal_cost", 4.0)]
    assert "vs round_robin 20.00 s" in headline(runs)
