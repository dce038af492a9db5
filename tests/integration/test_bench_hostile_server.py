"""`isocost bench` against a server that misbehaves on purpose (``hostile_openai``).

Each bad answer must be an error of its own request, of the kind the client documents,
while the good request beside it still completes and the summary and records can still be
written; a server that cannot be used at all is one EndpointError before the run.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from gateway_harness import serving
from hostile_openai import hostile_app, in_thread, raw_server

from isocost.bench import (
    BenchOptions,
    BenchResult,
    EndpointError,
    WorkloadSpec,
    build_workload,
    run_bench,
)
from isocost.workload import SyntheticSpec

ISOCOST = Path(sys.executable).with_name("isocost")
TIMEOUT_S = 5.0


def _options(stream: bool = True, model: str | None = None) -> BenchOptions:
    return BenchOptions(
        model=model, stream=stream, concurrency=1, max_requests=2, max_tokens=3,
        timeout_s=TIMEOUT_S,
    )  # fmt: skip


def _requests() -> object:
    spec = WorkloadSpec(synthetic=SyntheticSpec("mix", max_prompt_tokens=64), seed=0)
    return build_workload(spec, closed_loop=True)


async def _bench(url: str, options: BenchOptions) -> BenchResult:
    return await run_bench(url, _requests(), options)  # type: ignore[arg-type]


def _run(answer: str, stream: bool) -> BenchResult:
    async def scenario() -> BenchResult:
        async with serving(hostile_app([answer, "ok"])) as url:
            return await _bench(url, _options(stream))

    return asyncio.run(scenario())


@pytest.mark.parametrize(
    ("answer", "stream", "kind", "reason"),
    [
        # found by this audit: each crashed the run, skewed it, or held memory
        ("huge_line", True, "bad_sse", "longer than the reader's limit"),
        ("endless_body", True, "bad_sse", "longer than the reader's limit"),
        ("endless_body", False, "too_large", "an answer over"),
        ("endless_error_body", True, "http_500", "<p>xxx"),
        ("huge_usage", True, "bad_json", "usage.completion_tokens 1000000"),
        ("negative_usage", True, "bad_json", "usage.completion_tokens -5"),
        ("bool_usage", True, "bad_json", "usage.completion_tokens True"),
        ("redirect", True, "http_307", "redirects to http://127.0.0.1:9/v1/completions"),
        # held up before: kept so that they stay so
        ("junk_line", True, "bad_sse", "not an SSE line"),
        ("not_json", True, "bad_json", "JSON is malformed"),
        ("json_list", True, "bad_json", "expected a JSON object"),
        ("choices_strings", True, "bad_json", "a choice that is not an object"),
        ("no_choices", True, "empty", "no generated text"),
        ("null_content", True, "empty", "no generated text"),
        ("int_text", True, "empty", "no generated text"),
        ("nan_usage", True, "bad_json", "JSON is malformed"),
        ("inf_number", True, "bad_json", "out of range"),
        ("non_utf8", True, "bad_json", "UTF-8"),
        ("no_done", True, "truncated", "without data: [DONE]"),
        ("reset", True, "truncated", "not completed"),
        ("hang_after_headers", True, "timeout", "no complete answer"),
        ("hang", False, "timeout", "no complete answer"),
        ("html_500", True, "http_500", "502 Bad Gateway"),
        ("non_utf8_500", False, "http_500", "broken"),
        ("body_wrong_shape", False, "empty", "no generated text"),
        ("body_list", False, "bad_json", "expected a JSON object"),
    ],
)
def test_a_bad_answer_is_an_error_of_its_request_and_the_run_goes_on(
    answer: str, stream: bool, kind: str, reason: str
) -> None:
    result = _run(answer, stream)
    bad, good = result.records
    assert (bad.error_kind, good.error_kind) == (kind, None), bad.error
    assert reason in (bad.error or "")
    assert result.summary.errors_by_kind == {kind: 1}
    assert (result.summary.requests, result.summary.completed) == (2, 1)
    assert good.output_tokens == 3
    msgspec.json.encode([result.summary, *result.records])  # --json and --records


def test_a_replica_header_that_is_not_utf8_can_still_be_written() -> None:
    """aiohttp keeps such bytes as lone surrogates, which msgspec and the console refuse:
    the summary and the records could not be written after the run."""

    async def scenario() -> BenchResult:
        async with raw_server("bad_header") as url:
            return await _bench(url, _options())

    result = asyncio.run(scenario())
    assert result.summary.completed == 2
    written = json.loads(msgspec.json.encode(result.summary))
    assert written["completed_by_replica"] == {"r\ufffd\ufffd": 2}


@pytest.mark.parametrize(
    ("models", "model", "message"),
    [
        ("redirect", None, "answered 302: redirects to http://127.0.0.1:9/ (not followed)"),
        ("redirect", "m", "answered 302: redirects to http://127.0.0.1:9/ (not followed)"),
        ("list", None, "without a model list; pass --model"),
        ("data_dict", None, "without a model list; pass --model"),
        ("html", None, "without a model list; pass --model"),
        ("hang", "m", "cannot reach"),
    ],
)
def test_a_model_listing_that_cannot_be_used_stops_before_the_run(
    models: str, model: str | None, message: str
) -> None:
    async def scenario() -> None:
        async with serving(hostile_app(models=models)) as url:
            await _bench(url, _options(model=model))

    with pytest.raises(EndpointError) as raised:
        asyncio.run(scenario())
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("behaviour", "message"),
    [
        ("close", "cannot reach"),
        ("silent", "cannot reach"),
        ("tls", "Bad status line"),
    ],
)
def test_a_port_that_does_not_speak_http_stops_before_the_run(behaviour: str, message: str) -> None:
    async def scenario() -> None:
        async with raw_server(behaviour) as url:
            await _bench(url, BenchOptions(model="m", max_requests=1, timeout_s=2))

    with pytest.raises(EndpointError) as raised:
        asyncio.run(scenario())
    assert message in str(raised.value) and "\n" not in str(raised.value)


def bench_cli(script: list[str], tmp_path: Path, *extra: str) -> dict[str, Any]:
    """``isocost bench`` (3 requests) against a hostile server playing ``script``: exit 0,
    no traceback; the summary it wrote (``--json``)."""
    summary = tmp_path / "s.json"
    with in_thread(hostile_app(script)) as url:
        run = subprocess.run(
            [str(ISOCOST), "bench", "--url", url, "--workload", "mix", "--concurrency", "1",
             "--max-requests", "3", "--max-tokens", "2", "--max-prompt-tokens", "64",
             "--timeout", "20", "--json", str(summary), *extra],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    written: dict[str, Any] = json.loads(summary.read_text())
    return written


def test_an_enormous_line_mid_run_still_writes_the_summary(tmp_path: Path) -> None:
    """The CLI end to end: the line used to escape as a traceback and lose the run."""
    records = tmp_path / "r.jsonl"
    written = bench_cli(["ok", "huge_line", "ok"], tmp_path, "--records", str(records))
    assert (written["completed"], written["errors_by_kind"]) == (2, {"bad_sse": 1})
    assert len(records.read_text().splitlines()) == 3
