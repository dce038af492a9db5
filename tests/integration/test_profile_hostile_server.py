"""`isocost profile` against a server that misbehaves on purpose (``hostile_openai``).

A probe's bad answer ends the profile in one EndpointError line, never a traceback; a
broken ``/metrics`` (read after every probe, for the KV capacity alone) costs only that.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from gateway_harness import serving
from hostile_openai import hostile_app, in_thread

from isocost.bench import EndpointError
from isocost.bench._profile import Measurements, ProfilePlan, measure_replica

ISOCOST = Path(sys.executable).with_name("isocost")
PLAN = ProfilePlan(
    max_prompt_tokens=64, repeats=1, decode_batches=(1,), decode_tokens=20, timeout_s=3, seed=1
)
METRICS = b'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1\n'


def _measure(script: list[str], metrics: bytes | None = METRICS) -> Measurements:
    async def scenario() -> Measurements:
        async with serving(hostile_app(script, metrics=metrics)) as url:
            return await measure_replica(url, 1000, PLAN)

    return asyncio.run(scenario())


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        # found by this audit: each was an AttributeError, KeyError or LineTooLong traceback
        ("json_list", "Expected `object`, got `array`"),
        ("json_string", "Expected `object`, got `str`"),
        ("choices_dict", "at `$.choices`"),
        ("choices_strings", "at `$.choices[0]`"),
        ("usage_list", "at `$.usage`"),
        ("huge_line", "a line longer than the reader's limit"),
        ("endless_body", "a line longer than the reader's limit"),
        # ... a cut stream taken for an answer, a timeout instead of the status
        ("no_done", "the stream ended without data: [DONE]"),
        ("endless_error_body", "answered 500: <p>xxx"),
        ("redirect", "answered 307: redirects to http://127.0.0.1:9/v1/completions"),
        # held up before
        ("junk_line", "not an SSE line"),
        ("nan_usage", "JSON is malformed"),
        ("reset", "failed: Response payload is not completed"),
        ("hang", "no answer in 3 s"),
        ("html_500", "answered 500: <html>"),
    ],
)
def test_a_bad_probe_answer_is_one_endpoint_error(answer: str, message: str) -> None:
    with pytest.raises(EndpointError) as raised:
        _measure([answer])
    assert message in str(raised.value)


@pytest.mark.parametrize("metrics", [None, b"\xff\xfe junk {{{ NaN\n"], ids=["hang", "junk"])
def test_a_broken_metrics_page_keeps_the_measurements(metrics: bytes | None) -> None:
    measured = _measure(["ok"], metrics)
    assert measured.prefill and measured.decode
    if metrics is None:
        assert measured.metrics_text is None
        assert any("/metrics failed" in note for note in measured.notes), measured.notes


def test_cached_tokens_beyond_the_prompt_are_not_a_cache_hit() -> None:
    measured = _measure(["ok"] * 2 + ["cached_lie"] * 8 + ["ok"] * 100)  # warm-up, prefill
    assert len(measured.prefill) == 4
    assert all(s.cached_tokens == 0 and s.new_tokens > 0 for s in measured.prefill)


def test_the_cli_ends_a_bad_answer_in_one_line() -> None:
    assert "not an OpenAI completion answer" in profile_refused(["choices_strings"])


def profile_refused(script: list[str]) -> str:
    """``isocost profile`` against a hostile server playing ``script``: exit 2 and its one
    error line, no traceback."""
    with in_thread(hostile_app(script)) as url:
        done = subprocess.run(
            [str(ISOCOST), "profile", url, "--id", "x", "--cost-model", "llama-3.1-8b",
             "--timeout", "5"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    return done.stderr.strip()
