"""`isocost bench` against `isocost engine`: same latencies, same shared prefixes.

The engine records TTFT and E2E in vLLM's Prometheus histograms from its modelled clock;
bench measures them over HTTP. Sorted, the k-th fastest request of each side must land in
the same histogram bucket or a neighbouring one (a value near a bucket edge may cross it
by the few milliseconds HTTP and the event loops add).

A Mooncake replay's shared ``hash_ids`` must reach the engine's prefix cache intact: its
hit counter must equal the hits the trace's block structure predicts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from isocost_procs import ready_urls
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from isocost.files import read_text
from isocost.workload import parse_trace, prefix_block_keys

ROOT = Path(__file__).resolve().parents[2]
ISOCOST = Path(sys.executable).with_name("isocost")  # the venv running the tests
MOONCAKE = ROOT / "tests" / "fixtures" / "traces" / "mooncake_conversation_head.jsonl"
ENGINE_BLOCK_TOKENS = 16  # vLLM's default KV block, the engine simulator's too


def _running_engine(*extra: str) -> Iterator[str]:
    proc = subprocess.Popen(
        [str(ISOCOST), "engine", "--port", "0", "--gpu", "a100-80g", "--model", "llama-3.1-8b",
         *extra],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        yield ready_urls(proc, "isocost engine")[0]  # printed once the replica listens
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        proc.stdout.close()


@pytest.fixture
def engine() -> Iterator[str]:
    yield from _running_engine()


@pytest.fixture
def fast_engine() -> Iterator[str]:
    """A GPU 50x faster than modelled: timing is not under test, only the cache."""
    yield from _running_engine("--time-scale", "0.02")


def _family(url: str, name: str) -> list[Sample]:
    """The samples of one metric family on the engine's /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return list(family.samples)
    raise AssertionError(f"{name} not in /metrics")


def _histogram(url: str, name: str) -> list[tuple[float, int]]:
    """(upper bound, cumulative count) of a histogram on the engine's /metrics."""
    samples = _family(url, name)
    return [(float(s.labels["le"]), int(s.value)) for s in samples if s.name.endswith("_bucket")]


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


def _expected_prefix_hits(num_requests: int) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of the trace's first requests sent one by one."""
    requests = parse_trace(read_text(MOONCAKE).splitlines(), str(MOONCAKE))[:num_requests]
    seen: set[int] = set()
    hits = 0
    for request in requests:
        chain, matching = 0, True
        for key in prefix_block_keys(request.segments, ENGINE_BLOCK_TOKENS):
            chain = hash((chain, key))  # equal chain = equal whole prefix
            matching = matching and chain in seen
            hits += ENGINE_BLOCK_TOKENS if matching else 0
            seen.add(chain)
    return sum(r.prompt_tokens for r in requests), hits


def test_mooncake_shared_prefixes_hit_the_engine_prefix_cache(fast_engine: str) -> None:
    run = subprocess.run(
        [
            str(ISOCOST), "bench", "--url", fast_engine, "--trace", str(MOONCAKE),
            "--concurrency", "1", "--max-requests", "20", "--max-tokens", "2",
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    prompt_tokens, cached_tokens = _expected_prefix_hits(20)
    assert cached_tokens > 0
    queries = _family(fast_engine, "vllm:prefix_cache_queries")[0].value
    hits = _family(fast_engine, "vllm:prefix_cache_hits")[0].value
    assert (queries, hits) == (prompt_tokens, cached_tokens)
