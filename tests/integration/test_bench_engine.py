"""`isocost bench` against `isocost engine`: both sides measure the same latencies.

The engine records TTFT and E2E in vLLM's Prometheus histograms from its modelled clock;
bench measures them over HTTP. Sorted, the k-th fastest request of each side must land in
the same histogram bucket or a neighbouring one (a value near a bucket edge may cross it
by the few milliseconds HTTP and the event loops add).
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
ISOCOST = ROOT / ".venv" / "bin" / "isocost"


@pytest.fixture
def engine() -> Iterator[str]:
    proc = subprocess.Popen(
        [str(ISOCOST), "engine", "--port", "0", "--gpu", "a100-80g", "--model", "llama-3.1-8b"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline()  # printed once the replica listens
        assert " ready at http://" in line, line
        yield line.rsplit(" ready at ", 1)[1].strip()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        proc.stdout.close()


def _histogram(url: str, name: str) -> list[tuple[float, int]]:
    """(upper bound, cumulative count) of a histogram on the engine's /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return [
                (float(s.labels["le"]), int(s.value))
                for s in family.samples
                if s.name.endswith("_bucket")
            ]
    raise AssertionError(f"{name} not in /metrics")


def _bucket(value: float, bounds: list[float]) -> int:
    return next(i for i, bound in enumerate(bounds) if value <= bound)


def _engine_buckets(histogram: list[tuple[float, int]]) -> list[int]:
    """The bucket of the k-th smallest observation, for every k."""
    buckets, previous = [], 0
    for i, (_, cumulative) in enumerate(histogram):
        buckets.extend([i] * (cumulative - previous))
        previous = cumulative
    return buckets


def test_bench_latencies_agree_with_engine_histograms(engine: str, tmp_path: Path) -> None:
    records = tmp_path / "r.jsonl"
    run = subprocess.run(
        [
            str(ISOCOST), "bench", "--url", engine, "--workload", "mix", "--rate", "4",
            "--max-requests", "12", "--max-tokens", "8", "--ignore-eos",
            "--records", str(records),
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert all(r["error_kind"] is None and r["output_tokens"] == 8 for r in lines)
    # the engine's approximate tokenizer counts the rendered prompt as planned
    assert all(r["usage_prompt_tokens"] == r["prompt_tokens"] for r in lines)
    measured = {
        "vllm:time_to_first_token_seconds": sorted(
            r["first_token_s"] - r["intended_s"] for r in lines
        ),
        "vllm:e2e_request_latency_seconds": sorted(r["end_s"] - r["intended_s"] for r in lines),
    }
    for name, values in measured.items():
        histogram = _histogram(engine, name)
        bounds = [bound for bound, _ in histogram]
        expected = _engine_buckets(histogram)
        assert len(expected) == len(values) == 12
        got = [_bucket(v, bounds) for v in values]
        assert all(abs(g - e) <= 1 for g, e in zip(got, expected, strict=True)), (
            name,
            got,
            expected,
        )
