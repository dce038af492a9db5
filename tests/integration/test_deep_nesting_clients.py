"""The client tools against a server whose JSON is nested deeper than a decoder follows.

msgspec raises RecursionError on it, neither a ValueError nor a ``msgspec.DecodeError``:
it got past the ``except`` that handles every other malformed answer, so a bench run
crashed instead of counting a ``bad_json`` answer, and ``profile`` and ``drill`` ended in
a traceback instead of their one error line. Each now takes the path of other bad JSON.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import msgspec
import pytest
from aiohttp import web
from gateway_harness import serving
from hostile_openai import DEEP, hostile_app, in_thread
from test_bench_hostile_server import _bench, _options, _run, bench_cli
from test_drill_hostile_server import drill_error, drill_refused
from test_profile_hostile_server import _measure, profile_refused

from isocost.bench import BenchResult, EndpointError

ISOCOST = Path(sys.executable).with_name("isocost")
RECURSION = "maximum recursion depth"


@pytest.mark.parametrize(("answer", "stream"), [("deep_nesting", True), ("deep_body", False)])
def test_bench_counts_a_deep_answer_as_bad_json_and_goes_on(answer: str, stream: bool) -> None:
    result = _run(answer, stream)
    bad, good = result.records
    assert (bad.error_kind, good.error_kind) == ("bad_json", None), bad.error
    assert RECURSION in (bad.error or "")
    assert result.summary.errors_by_kind == {"bad_json": 1}
    assert (result.summary.requests, result.summary.completed) == (2, 1)
    msgspec.json.encode([result.summary, *result.records])  # --json and --records


def test_bench_takes_a_deep_model_listing_for_none() -> None:
    async def listing_only(model: str | None) -> BenchResult:
        async with serving(hostile_app(models="deep")) as url:
            return await _bench(url, _options(model=model))

    with pytest.raises(EndpointError) as raised:
        asyncio.run(listing_only(None))
    assert "without a model list; pass --model" in str(raised.value)
    assert "\n" not in str(raised.value)
    result = asyncio.run(listing_only("m"))  # a named model needs no listing
    assert result.summary.completed == 2


def test_the_bench_cli_counts_a_deep_answer_and_writes_the_summary(tmp_path: Path) -> None:
    written = bench_cli(["ok", "deep_nesting", "ok"], tmp_path)
    assert (written["completed"], written["errors_by_kind"]) == (2, {"bad_json": 1})


def test_profile_ends_a_deep_answer_in_one_endpoint_error() -> None:
    with pytest.raises(EndpointError) as raised:
        _measure(["deep_nesting"])
    assert "not an OpenAI completion answer" in str(raised.value)
    assert RECURSION in str(raised.value) and "\n" not in str(raised.value)


def test_the_profile_cli_ends_a_deep_answer_in_one_line() -> None:
    assert "not an OpenAI completion answer" in profile_refused(["deep_nesting"])


async def _deep_replicas() -> web.StreamResponse:
    return web.Response(body=DEEP, content_type="application/json")


def test_drill_ends_a_deep_replica_list_in_one_drill_error() -> None:
    error = drill_error(hostile_app(replicas=_deep_replicas))
    assert "not an isocost replica list" in error and RECURSION in error


def test_the_drill_cli_ends_a_deep_replica_list_in_one_line() -> None:
    with in_thread(hostile_app(replicas=_deep_replicas)) as url:
        assert "not an isocost replica list" in drill_refused(url)
