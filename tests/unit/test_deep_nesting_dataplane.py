"""What replicas, engines, KV-event publishers and sibling workers send, nested deeper than
msgspec (or ``json.loads``) follows: a RecursionError, no DecodeError nor ValueError, which
got past the ``except`` that handles every other undecodable answer. Each site must take the
path it takes for other junk (the same error, the same count)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import aiohttp
import msgspec
import pytest
from aiohttp import web
from gateway_harness import serving
from yarl import URL

from isocost.agent import registrar
from isocost.agent.engine import not_ready
from isocost.agent.registrar import Agent, AgentSettings
from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError
from isocost.engine.disagg import KvSource, pull_kv
from isocost.engine.records import RequestSpec
from isocost.engine.replica import ServedReplica
from isocost.gateway.proxy import _handoff_params, _is_lost_handoff
from isocost.gateway.resume import SegmentError, StreamLedger
from isocost.gateway.server import _served_model
from isocost.gateway.workers import WorkerGroup
from isocost.openai.errors import ApiError
from isocost.prefix.kvevents import KvEventError, decode_batch

DEEP = b"[" * 100_000  # no JSON decoder here follows that far


def run(scenario: Callable[[aiohttp.ClientSession], Awaitable[None]]) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            await scenario(session)

    asyncio.run(main())


@asynccontextmanager
async def answering(
    routes: dict[str, tuple[int, bytes]], method: str = "GET"
) -> AsyncIterator[str]:
    """An HTTP server answering each path with (status, JSON body bytes)."""

    async def answer(request: web.Request) -> web.Response:
        status, body = routes[request.path]
        return web.Response(status=status, body=body, content_type="application/json")

    app = web.Application()
    for path in routes:
        app.router.add_route(method, path, answer)
    async with serving(app) as url:
        yield url


# -- KV events (a publisher) ------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        # a fourth element past the three msgspec reads, skipped recursively
        b"\x94" + msgspec.msgpack.encode(1.0) + b"\x90\xc0" + b"\x91" * 100_000,
        # an unknown field of an event, skipped recursively
        b"\x92"
        + msgspec.msgpack.encode(1.0)
        + b"\x91\x82"
        + msgspec.msgpack.encode("type")
        + msgspec.msgpack.encode("AllBlocksCleared")
        + msgspec.msgpack.encode("x")
        + b"\x91" * 100_000,
    ],
)
def test_a_kv_event_batch_nested_too_deep_is_a_kv_event_error(payload: bytes) -> None:
    """Before: RecursionError out of ``decode_batch``, past the follower's handling of a
    bad message (counted, then a resync)."""
    with pytest.raises(KvEventError, match="not a KV-event batch"):
        decode_batch(payload)


# -- an engine's stream events and answers (the gateway's relay) ------------------------------


def test_a_stream_event_nested_too_deep_ends_the_segment() -> None:
    """Before: RecursionError out of ``relay``: a 500 mid-stream, not a resume."""
    ledger = StreamLedger({"model": "m", "prompt": "p", "stream": True}, chat=False, cap=10)
    for payload in (DEEP, b'{"choices": ' + DEEP, b'{"id": "a", "x": ' + DEEP):
        with pytest.raises(SegmentError, match="event is not a JSON object"):
            ledger.relay(payload)


def test_events_nested_around_the_decoders_limit_are_relayed_or_end_the_segment() -> None:
    """Depth by depth across the limit: an event the ledger decodes it also encodes again
    (a usage it rewrites, a frame further down: msgspec's encoder has the more room), and
    one it cannot decode ends the segment; no RecursionError either way."""
    body = {"model": "m", "prompt": "p", "stream": True, "stream_options": {"include_usage": True}}
    outcomes = set()
    for depth in range(700, 1_000):
        ledger = StreamLedger(body, chat=False, cap=10)
        nested = b"[" * depth + b"]" * depth
        payload = b'{"choices": [{"text": "a"}], "usage": {"completion_tokens": 1}, "x": '
        try:
            out = ledger.relay(payload + nested + b"}")
        except SegmentError:
            outcomes.add("segment error")
        else:
            assert out is not None and out.endswith(b"]}")
            outcomes.add("relayed")
    assert outcomes == {"relayed", "segment error"}


def test_a_prefill_answer_nested_too_deep_hands_no_kv_off() -> None:
    """Before: RecursionError out of ``_handoff_params``: a 500, both grants held."""
    assert _handoff_params(DEEP) is None
    assert _handoff_params(b'{"kv_transfer_params": ' + DEEP) is None


def test_an_error_body_nested_too_deep_is_no_lost_handoff() -> None:
    """Before: RecursionError out of ``_is_lost_handoff`` (the peeked 4 KiB is enough)."""
    error = b'{"error": ' + b"[" * 4_000

    async def scenario(session: aiohttp.ClientSession) -> None:
        async with (
            answering({"/v1/completions": (502, error)}, "POST") as url,
            session.post(url + "/v1/completions") as upstream,
        ):
            assert not await _is_lost_handoff(upstream)

    run(scenario)


# -- /v1/models of a replica (the gateway's start) and of an engine (the agent) ---------------


def test_a_model_list_nested_too_deep_is_no_answer_with_a_model() -> None:
    """Before: RecursionError out of ``_served_model``: ``isocost serve`` died with a
    traceback instead of waiting for an answer and naming the replica."""

    async def scenario(session: aiohttp.ClientSession) -> None:
        async with answering({"/v1/models": (200, b'{"object": "list", "x": ' + DEEP)}) as url:
            deadline = asyncio.get_running_loop().time() + 0.3
            with pytest.raises(ConfigError, match="no answer with a model"):
                await _served_model(session, url, deadline)

    run(scenario)


def test_an_engines_model_list_nested_too_deep_is_not_ready() -> None:
    """Before: RecursionError out of ``not_ready``: the agent's wait for its engine died."""

    async def scenario(session: aiohttp.ClientSession) -> None:
        routes = {"/health": (200, b""), "/v1/models": (200, b'{"object": "list", "x": ' + DEEP)}
        async with answering(routes) as url:
            reason = await not_ready(session, url)
            assert reason is not None and reason.startswith("/v1/models is not a model list")

    run(scenario)


def test_the_agent_waits_on_an_engine_whose_facts_are_nested_too_deep(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``engine_facts`` (warm-up, registering) raises what it cannot decode; the agent's
    engine errors now hold RecursionError too, so it waits for the engine as for any other
    junk instead of ending."""
    stop = asyncio.Event()

    async def ready(session: aiohttp.ClientSession, base: str) -> str | None:
        return None

    async def stop_waiting(event: asyncio.Event, seconds: float) -> None:
        stop.set()

    monkeypatch.setattr(registrar, "not_ready", ready)
    monkeypatch.setattr(registrar, "_wait", stop_waiting)

    async def scenario(session: aiohttp.ClientSession) -> None:
        async with answering({"/v1/models": (200, b'{"object": "list", "x": ' + DEEP)}) as url:
            settings = AgentSettings(url, url, "r1", ["http://127.0.0.1:9"], warmup_prompt="hi")
            agent = Agent(settings, Catalog.builtin(), lambda _: None)
            with caplog.at_level(logging.INFO, logger="isocost.agent"):
                assert not await agent._wait_ready(session, stop)

    run(scenario)
    (waiting,) = [r for r in caplog.records if getattr(r, "event", "") == "engine_waiting"]
    assert "recursion" in waiting.__dict__["reason"]


# -- a prefill engine's answer to a KV pull (``isocost engine --role decode``) -----------------


def test_a_pull_answer_nested_too_deep_is_a_failed_transfer() -> None:
    """Before: RecursionError out of ``pull_kv``: a 500 instead of 502
    ``kv_transfer_failed``, which the gateway takes for a lost hand-off and prefills again."""
    model = SimpleNamespace(cached_prefix_tokens=lambda hashes: 0)
    replica = cast(ServedReplica, SimpleNamespace(model=model))
    spec = cast(RequestSpec, SimpleNamespace(block_hashes=(), prompt_tokens=16))

    async def scenario(session: aiohttp.ClientSession) -> None:
        answer = b'{"num_tokens": 16, "x": ' + DEEP
        async with answering({"/kv/pull": (200, answer)}, "POST") as url:
            source = KvSource(URL(url + "/kv/pull"), "req-1", None)
            with pytest.raises(ApiError) as raised:
                await pull_kv(session, replica, source, spec)
            assert raised.value.status == 502 and raised.value.code == "kv_transfer_failed"
            assert "not a pull result" in raised.value.message

    run(scenario)


# -- sibling workers (``isocost serve --workers``) ---------------------------------------------


def test_a_sibling_entry_nested_too_deep_is_skipped(tmp_path: Path) -> None:
    """Before: RecursionError out of ``siblings`` (``json.loads``), past its ValueError."""
    (tmp_path / "worker-1.json").write_bytes(DEEP)
    (tmp_path / "worker-2.json").write_text(json.dumps({"url": "http://127.0.0.1:9"}))
    assert WorkerGroup(0, tmp_path).siblings() == {2: "http://127.0.0.1:9"}


def test_a_siblings_changes_nested_too_deep_are_no_answer(tmp_path: Path) -> None:
    """Before: RecursionError out of ``catch_up`` (``reply.json()``), past its ValueError."""

    async def scenario(session: aiohttp.ClientSession) -> None:
        async with answering({"/admin/changes": (200, DEEP)}) as url:
            (tmp_path / "worker-1.json").write_text(json.dumps({"url": url}))
            group = WorkerGroup(0, tmp_path)
            assert await group.catch_up("http://127.0.0.1:9", {"Authorization": "x"}) == 0

    run(scenario)
