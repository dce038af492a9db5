"""A replica whose answer or stream event is nested deeper than msgspec follows (a hundred
thousand ``[``), through a real ``isocost serve``: msgspec raises RecursionError there, no
DecodeError, which got past the ``except`` for every other answer that is no JSON object
(a 500 and a traceback, or a stream cut without its error event). The client must get what
it gets for other junk, and the gateway log no traceback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from fake_upstream import DEFAULT_METRICS, set_mode
from gateway_harness import gateway_config, wait_for
from hostile_openai import in_thread
from isocost_procs import start_isocost
from test_proxy import API_KEY, MODEL, Rig, post, sse_payloads, start_rig

DEEP = "[" * 100_000
DEEP_EVENT = '{"id": "x", "choices": ' + DEEP  # a bare DEEP fails msgspec's type check first


def no_traceback(rig: Rig) -> None:
    text = rig.log.read_text()
    assert "Traceback" not in text and "RecursionError" not in text, text[-2000:]


@pytest.mark.parametrize("resume", ["off", "on"])
def test_a_stream_event_nested_too_deep_ends_the_stream_like_one_that_is_not_json(
    tmp_path: Path, resume: str
) -> None:
    """``resume: off``: the plain relay's event count; ``on``: the resume ledger (one
    replica, so the resume finds none to go on with)."""
    rig = start_rig(tmp_path, 1, pool_fields=f"    resume: {resume}")
    try:
        (upstream,) = rig.upstreams
        set_mode(upstream.url, completion="garbage", garbage_line=f"data: {DEEP_EVENT}")
        status, _, raw = post(rig, stream=True, request_id=f"deep-{resume}")
        assert status == 200  # the stream had begun: the status line was sent
        payloads = sse_payloads(raw)
        assert payloads[-1] == "[DONE]" and raw.endswith(b"data: [DONE]\n\n"), raw[-300:]
        assert payloads[-2]["error"]["type"] == "upstream_error", payloads
        assert payloads[0]["choices"][0]["text"] == "hel"  # what came before was relayed
        row = rig.replica(upstream)
        assert row["last_error"].startswith("mid-stream"), row
        wait_for(lambda: bool(rig.request_log(f"deep-{resume}")), what="the request's log line")
        (line,) = rig.request_log(f"deep-{resume}")
        assert line["status"] == 502 and line["error"], line
        assert [e["request_id"] for e in rig.log_lines("stream_error")] == [f"deep-{resume}"]
        assert rig.requests_total(502) == 1
        no_traceback(rig)
    finally:
        rig.close()


def deep_replica() -> web.Application:
    """A replica that is healthy but answers every completion with JSON nested too deep."""

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=DEFAULT_METRICS)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    async def completion(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(text=DEEP_EVENT, content_type="application/json")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completion)
    return app


@pytest.fixture
def deep_rig(tmp_path: Path) -> Iterator[Rig]:
    with in_thread(deep_replica()) as url:
        config = gateway_config(
            [url],
            model=MODEL,
            admin_token="admin-proxy-77c0",
            api_key=API_KEY,
            replica_fields="gpu: a100-80g",
        )
        path, log = tmp_path / "gateway.yaml", tmp_path / "gateway.log"
        path.write_text(config)
        with log.open("a") as sink:
            gateway = start_isocost(["serve", "--config", str(path), "--port", "0"], stderr=sink)
        rig = Rig(gateway, [], log)
        try:
            yield rig
        finally:
            rig.close()


def test_a_whole_answer_nested_too_deep_is_a_replica_failure_like_broken_json(
    deep_rig: Rig,
) -> None:
    status, _, raw = post(deep_rig, stream=False, request_id="deep-whole")
    assert status == 502, raw[:300]
    error = json.loads(raw)["error"]
    assert error["code"] == "upstream_error", error
    assert "answer is not a JSON object (application/json)" in error["message"], error
    wait_for(lambda: bool(deep_rig.request_log("deep-whole")), what="the request's log line")
    (line,) = deep_rig.request_log("deep-whole")
    assert line["status"] == 502, line
    no_traceback(deep_rig)
