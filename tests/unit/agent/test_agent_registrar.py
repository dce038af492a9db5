"""``isocost agent`` on what the audit found: a record every gateway refuses reported as
"registered", silence while the engine does not answer, an etcd refusal retried forever
as if etcd were down, and "deregistered" logged when the delete never happened.

etcd and the engine are stand-ins here (a closed port, or a small aiohttp app answering
what etcd's JSON gateway answers); the same against a real etcd is in
``tests/integration/test_discovery_etcd.py``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from gateway_harness import serving
from isocost_procs import free_port
from typer.testing import CliRunner

from isocost import cli
from isocost.agent import registrar
from isocost.agent.engine import EngineDown, EngineFacts
from isocost.agent.registrar import Agent, AgentSettings
from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError
from isocost.runtime.etcd import EtcdClient, EtcdError, EtcdRefused, LeaseNotFound

MODEL = "llama-3.1-8b"


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO, logger="isocost.agent"):
        yield caplog


def events(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [getattr(r, "event", "") for r in caplog.records]


def closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def agent(etcd: str, **fields: object) -> Agent:
    url = closed_url()
    settings = AgentSettings(url, url, "r1", [etcd], **fields)  # type: ignore[arg-type]
    return Agent(settings, Catalog.builtin(), lambda _: None)


@asynccontextmanager
async def fake_etcd(routes: dict[str, tuple[int, dict[str, object]]]) -> AsyncIterator[str]:
    """An HTTP server answering each ``/v3/...`` path with a (status, JSON body)."""

    async def answer(request: web.Request) -> web.Response:
        status, body = routes[request.path]
        return web.json_response(body, status=status)

    app = web.Application()
    for path in routes:
        app.router.add_post(path, answer)
    async with serving(app) as url:
        yield url


def etcd_error(status: int, message: str, code: int) -> tuple[int, dict[str, object]]:
    """An error as etcd's JSON gateway writes it."""
    return status, {"error": message, "message": message, "code": code}


GRANTED = (200, {"header": {"revision": "1"}, "ID": "7", "TTL": "10"})
LEASE_GONE = etcd_error(404, "etcdserver: requested lease not found", 5)


def run(scenario: Callable[[aiohttp.ClientSession], Awaitable[None]]) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            await scenario(session)

    asyncio.run(main())


def test_waiting_for_the_engine_is_logged_once_per_reason(
    monkeypatch: pytest.MonkeyPatch, logs: pytest.LogCaptureFixture
) -> None:
    answers: list[str | Exception | None] = [
        EngineDown("http://e:1/health: Connect call failed"),
        EngineDown("http://e:1/health: Connect call failed"),
        TimeoutError(),
        "/health answered HTTP 503",
        "/health answered HTTP 503",
        None,
    ]

    async def not_ready(session: aiohttp.ClientSession, base: str) -> str | None:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def no_wait(stop: asyncio.Event, seconds: float) -> None:
        pass

    monkeypatch.setattr(registrar, "not_ready", not_ready)
    monkeypatch.setattr(registrar, "_wait", no_wait)
    the_agent = agent(closed_url())

    async def scenario(session: aiohttp.ClientSession) -> None:
        assert await the_agent._wait_ready(session, asyncio.Event())

    run(scenario)
    reasons = [r.reason for r in logs.records if getattr(r, "event", "") == "engine_waiting"]  # type: ignore[attr-defined]
    assert reasons == [
        "http://e:1/health: Connect call failed",
        "TimeoutError",  # a timeout's text is empty: its type says what happened
        "/health answered HTTP 503",
    ]


def test_a_served_model_no_gateway_would_take_ends_the_agent_before_registering(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def facts(session: aiohttp.ClientSession, base: str) -> EngineFacts:
        return EngineFacts(["m" * 300], "vllm", "r")

    monkeypatch.setattr(registrar, "engine_facts", facts)
    the_agent = agent(closed_url())  # were it tried, etcd would be retried forever

    async def scenario(session: aiohttp.ClientSession) -> None:
        with pytest.raises(ConfigError) as info:
            await the_agent._register(session, asyncio.Event())
        assert info.value.key == "registration.models"

    run(scenario)


def test_an_etcd_refusal_is_raised_not_retried_as_an_outage(logs: pytest.LogCaptureFixture) -> None:
    refused = etcd_error(400, "etcdserver: user name is empty", 3)

    async def scenario(session: aiohttp.ClientSession) -> None:
        async with fake_etcd({"/v3/lease/grant": GRANTED, "/v3/kv/put": refused}) as url:
            the_agent = agent(url)
            the_agent.record = the_agent.settings.record([MODEL])
            with pytest.raises(EtcdRefused, match="user name is empty"):
                await the_agent._write(new_lease=True)
            await the_agent.etcd.close()

    run(scenario)
    assert "etcd_down" not in events(logs)


def test_a_lease_gone_meanwhile_is_granted_anew(logs: pytest.LogCaptureFixture) -> None:
    async def scenario(session: aiohttp.ClientSession) -> None:
        async with fake_etcd({"/v3/kv/put": LEASE_GONE}) as url:
            the_agent = agent(url)
            the_agent.record = the_agent.settings.record([MODEL])
            the_agent.lease = 5
            assert not await the_agent._write()
            assert (the_agent.lease, the_agent._unwritten) == (0, True)  # a new one next tick
            await the_agent.etcd.close()

    run(scenario)
    assert events(logs) == ["lease_lost"]


def test_a_drain_that_cannot_reach_etcd_does_not_claim_to_have_deregistered(
    logs: pytest.LogCaptureFixture,
) -> None:
    the_agent = agent(closed_url(), drain_timeout_s=0.0)
    the_agent.record = the_agent.settings.record([MODEL])

    async def scenario(session: aiohttp.ClientSession) -> None:
        await the_agent._drain(session)
        await the_agent.etcd.close()

    run(scenario)
    assert "deregistered" not in events(logs)
    (failed,) = [r for r in logs.records if getattr(r, "event", "") == "deregister_failed"]
    assert "lease expires" in failed.getMessage()


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (etcd_error(400, "json: cannot unmarshal number into int64", 3), EtcdRefused),
        (LEASE_GONE, LeaseNotFound),
        (etcd_error(429, "etcdserver: too many requests", 8), EtcdError),
        (etcd_error(503, "etcdserver: no leader", 14), EtcdError),
    ],
)
def test_etcd_refusals_and_failures_are_told_apart(
    answer: tuple[int, dict[str, object]], error: type[Exception]
) -> None:
    async def scenario(_: aiohttp.ClientSession) -> None:
        async with fake_etcd({"/v3/lease/grant": answer}) as url:
            client = EtcdClient([url])
            with pytest.raises(error) as info:
                await client.grant(10)
            assert type(info.value) is error
            await client.close()

    run(scenario)


def test_an_etcd_that_never_answers_is_named_by_its_timeout() -> None:
    async def scenario(_: aiohttp.ClientSession) -> None:
        accepted: list[asyncio.StreamWriter] = []  # held open, never answered

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(writer)

        silent = await asyncio.start_server(accept, "127.0.0.1", 0)
        port = silent.sockets[0].getsockname()[1]
        client = EtcdClient([f"http://127.0.0.1:{port}"], timeout_s=0.2)
        with pytest.raises(EtcdError) as info:
            await client.grant(10)
        assert str(info.value) == "no etcd endpoint answered /v3/lease/grant: TimeoutError"
        await client.close()
        for writer in accepted:
            writer.close()
        silent.close()
        await silent.wait_closed()

    run(scenario)


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--ttl", "99999999999999999999"], "--ttl must be <= 3600"),
        (["--name", "n" * 300], "--name: must be 1-253 letters"),
        (["--name", "a/b"], "--name: must be 1-253 letters"),
        (["--gpu", "nope"], "--gpu: unknown GPU 'nope'"),
        (["--cost-model", "nope"], "--cost-model: unknown model 'nope'"),
        (["--tp", "65"], "--tp: must be <= 64"),
        (["--weight", "0"], "--weight: must be > 0"),
    ],
)
def test_a_record_gateways_would_refuse_is_one_line_and_exit_2(
    flags: list[str], error: str
) -> None:
    args = ["agent", "--engine", closed_url(), "--etcd", closed_url(), *flags]
    done = CliRunner().invoke(cli.app, args)
    assert done.exit_code == 2, done.output
    assert done.output.count("\n") == 1 and done.output.startswith(f"error: {error}"), done.output
