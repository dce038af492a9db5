"""`isocost serve` in front of real `isocost engine` processes on 127.0.0.1.

Every process is a subprocess of the installed CLI on a free port, waited for by reading
its "ready at" line, and stopped with SIGTERM at the end. The engines run with
``--output-dist max`` so that every answer is exactly ``max_tokens`` long.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from gateway_harness import gateway_config, http, log_records, metric_value, wait_for
from isocost_procs import ISOCOST, Proc, start_isocost
from prometheus_client.parser import text_string_to_metric_families

MODEL = "llama-3.1-8b"
API_KEY = "sk-test-team-a-5f2c9e"
ADMIN_TOKEN = "admin-test-token-81d3"
MAX_BODY_BYTES = 64 * 1024


def _start(args: list[str], marker: str, stderr: Any = None, timeout_s: float = 60) -> Proc:
    return start_isocost(args, marker, stderr, timeout_s)


def start_engine(port: int = 0, *extra: str) -> Proc:
    args = ["engine", "--port", str(port), "--model", MODEL, "--gpu", "a100-80g"]
    return _start([*args, "--output-dist", "max", *extra], "isocost engine")


def write_config(
    path: Path,
    engine_urls: list[str],
    *,
    policy: str = "equal_cost",
    replica_fields: str = "",
    limits: str = "",
    keys: str = "",
    health: str = "",
    pool_fields: str = "",
) -> None:
    """The suites' gateway config for ``engine_urls`` with this module's key, written."""
    path.write_text(
        gateway_config(
            engine_urls,
            model=MODEL,
            admin_token=ADMIN_TOKEN,
            api_key=API_KEY,
            policy=policy,
            replica_fields=replica_fields,
            limits=limits,
            health=health,
            keys=keys,
            max_body_bytes=MAX_BODY_BYTES,
            pool_fields=pool_fields,
        )
    )


def start_gateway(config: Path, log_path: Path) -> Proc:
    with log_path.open("a") as log:
        return _start(
            ["serve", "--config", str(config), "--port", "0"], "isocost serve", stderr=log
        )


def chat_body(content: str = "hello there", max_tokens: int = 8, **extra: Any) -> bytes:
    messages = [{"role": "user", "content": content}]
    return json.dumps(
        {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **extra}
    ).encode()


AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}


def admin(gateway: Proc, method: str, path: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    status, _, answer = http(method, gateway.url + path, data, ADMIN)
    assert status in (200, 201), (status, answer)
    return answer


def replica_rows(gateway: Proc) -> dict[str, dict[str, Any]]:
    return {row["url"]: row for row in admin(gateway, "GET", "/admin/replicas")["replicas"]}


@dataclass
class Cluster:
    engines: list[Proc]
    gateway: Proc
    config: Path
    log: Path

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateway.url + "/v1", api_key=API_KEY, **kwargs)


def _cluster(tmp: Path, num_engines: int) -> Generator[Cluster, None, None]:
    engines = [start_engine() for _ in range(num_engines)]
    gateway = None
    try:
        config, log = tmp / "gateway.yaml", tmp / "gateway.log"
        write_config(config, [e.url for e in engines])
        gateway = start_gateway(config, log)
        yield Cluster(engines, gateway, config, log)
    finally:
        if gateway is not None:
            gateway.stop()
        for engine in engines:
            engine.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from _cluster(tmp_path_factory.mktemp("gateway"), 3)


# -- the OpenAI client through the gateway ----------------------------------------------


def test_openai_chat_and_completions_non_stream(cluster: Cluster) -> None:
    client = cluster.client()
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=12
    )
    chat = raw.parse()
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 12
    served_by = raw.headers["x-isocost-replica"]
    assert f"http://{served_by}" in cluster.urls
    assert float(raw.headers["x-isocost-predicted-ttft-ms"]) > 0

    completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=7)
    assert completion.choices[0].text
    assert completion.usage is not None and completion.usage.completion_tokens == 7


def test_openai_chat_and_completions_stream(cluster: Cluster) -> None:
    client = cluster.client()
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count"}],
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens == 20

    pieces = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=9, stream=True))
    assert "".join(p.choices[0].text for p in pieces if p.choices)
    assert pieces[-1].choices[0].finish_reason == "length"


def test_models_lists_the_pool(cluster: Cluster) -> None:
    models = cluster.client().models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_stream_chunks_arrive_as_the_engine_produces_them(cluster: Cluster) -> None:
    """The first chunk reaches the client long before the last one is generated."""

    async def arrivals() -> list[float]:
        async with aiohttp.ClientSession() as session:
            start = time.monotonic()
            times: list[float] = []
            async with session.post(
                cluster.gateway.url + "/v1/completions",
                data=json.dumps(
                    {"model": MODEL, "prompt": "tell a story", "max_tokens": 200, "stream": True}
                ),
                headers=AUTH,
            ) as response:
                assert response.status == 200
                async for _ in response.content.iter_any():
                    times.append(time.monotonic() - start)
            return times

    times = asyncio.run(arrivals())
    # 200 tokens take the modelled engine well over a second; relayed as produced, they
    # arrive in many pieces spread over that time, the first right at the start.
    assert len(times) >= 5, f"the stream came in {len(times)} pieces"
    first, last = times[0], times[-1]
    assert first < 0.5 * last, f"first chunk at {first:.3f}s, last at {last:.3f}s"


# -- refusals: the right status, OpenAI error JSON, and the gateway stays healthy --------


def _assert_error(status: int, body: Any, expected_status: int, code: str | None = None) -> None:
    assert status == expected_status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code, error


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        (b'{"model": "llama-3.1-8b", "messages": [', 400, "invalid_request", None),
        (b"\xff\xfe not json", 400, "invalid_request", None),
        (chat_body(max_tokens="many"), 400, "invalid_request", "max_tokens"),  # type: ignore[arg-type]
        (b'{"model": "llama-3.1-8b", "messages": "hi"}', 400, "invalid_request", "messages"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', 400, "invalid_request", None),
        (chat_body(max_tokens=100_000), 400, "max_tokens_exceeded", "max_tokens"),
        (chat_body(content="x" * (MAX_BODY_BYTES + 1)), 413, "request_too_large", None),
        (
            json.dumps({"model": "no-such-model", "messages": [{"role": "user"}]}).encode(),
            404,
            "model_not_found",
            "model",
        ),
    ],
    ids=[
        "truncated",
        "binary",
        "wrong-type",
        "messages-type",
        "no-model",
        "max-tokens",
        "oversized",
        "unknown-model",
    ],
)
def test_bad_requests_get_openai_errors(
    cluster: Cluster, body: bytes, status: int, code: str, param: str | None
) -> None:
    got, headers, answer = http("POST", cluster.gateway.url + "/v1/chat/completions", body, AUTH)
    _assert_error(got, answer, status, code)
    if param is not None:
        assert answer["error"]["param"] == param
    assert headers["Content-Type"].startswith("application/json")
    assert http("GET", cluster.gateway.url + "/health")[0] == 200


@pytest.mark.parametrize(
    ("headers", "message"),
    [({}, "missing API key"), ({"Authorization": "Bearer sk-wrong"}, "invalid API key")],
)
def test_api_key_required(cluster: Cluster, headers: dict[str, str], message: str) -> None:
    status, _, answer = http(
        "POST", cluster.gateway.url + "/v1/chat/completions", chat_body(), headers
    )
    _assert_error(status, answer, 401, "invalid_api_key")
    assert answer["error"]["message"] == message
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=cluster.gateway.url + "/v1", api_key="sk-wrong").models.list()


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer not-the-token"}, {"X-Admin-Token": "nope"}]
)
def test_admin_requires_its_token(cluster: Cluster, headers: dict[str, str]) -> None:
    for method, path in [("GET", "/admin/snapshot"), ("POST", "/admin/replicas/x/drain")]:
        status, _, answer = http(method, cluster.gateway.url + path, b"", headers)
        _assert_error(status, answer, 401, "invalid_admin_token")
    # The API key is not an admin token either.
    status, _, answer = http("GET", cluster.gateway.url + "/admin/snapshot", None, AUTH)
    _assert_error(status, answer, 401, "invalid_admin_token")


def test_unknown_path_and_method(cluster: Cluster) -> None:
    status, _, answer = http("GET", cluster.gateway.url + "/v1/nothing")
    _assert_error(status, answer, 404)
    status, _, answer = http("GET", cluster.gateway.url + "/v1/chat/completions")
    _assert_error(status, answer, 405)


def test_route_returns_the_decision_without_forwarding(cluster: Cluster) -> None:
    before = replica_rows(cluster.gateway)
    status, _, decision = http("POST", cluster.gateway.url + "/v1/route", chat_body(), AUTH)
    assert status == 200, decision
    assert decision["outcome"] == "admit"
    assert decision["replica_url"] in cluster.urls
    assert decision["predicted_ttft_ms"] > 0
    assert {row["replica_id"] for row in decision["scores"]} <= {
        row["name"] for row in before.values()
    }
    after = replica_rows(cluster.gateway)
    assert all(after[url]["in_flight"] == 0 for url in after)


# -- admin: snapshot, drain, policy switch -----------------------------------------------


def test_admin_snapshot_describes_every_replica(cluster: Cluster) -> None:
    cluster.client().completions.create(model=MODEL, prompt="warm", max_tokens=4, stream=False)
    wait_for(
        lambda: all(r["scrape_age_s"] is not None for r in replica_rows(cluster.gateway).values()),
        what="a first scrape of every replica",
    )
    snap = admin(cluster.gateway, "GET", "/admin/snapshot")
    assert {row["url"] for row in snap["replicas"]} == set(cluster.urls)
    for row in snap["replicas"]:
        assert row["state"] == "healthy"
        assert row["kv_usage"] is not None and 0 <= row["kv_usage"] <= 1
        assert row["ttft_factor"] > 0 and row["itl_factor"] > 0
        assert row["ttft_error"] >= 0 and row["itl_error"] >= 0
        assert 0 <= row["prefill_duty"] < 1
    assert snap["pools"][0]["model"] == MODEL and snap["pools"][0]["healthy"] == 3
    decision = snap["decisions"][-1]
    assert decision["outcome"] == "admit" and decision["scores"]
    # What equal_cost read about each candidate, as it read it.
    for row in decision["scores"]:
        assert set(row["inputs"]) == {"cached_tokens", "waiting", "running", "predicted_ttft_ms"}
        assert row["inputs"]["predicted_ttft_ms"] > 0 and row["inputs"]["waiting"] >= 0
    assert isinstance(snap["rejections"], dict)


def test_the_autoscalers_status_shows_in_the_snapshot_then_goes_stale(cluster: Cluster) -> None:
    status = {"desired": 3, "ready": 2, "pending": 1, "draining": 0, "forecast_rps": 4.2}
    for wrong in ({"interval_s": 0}, {"pending": -1}, {"ejected": -1}, {"forecast_rps": -0.5}):
        bad = json.dumps(status | {"interval_s": 1.0} | wrong).encode()
        code, _, answer = http("POST", cluster.gateway.url + "/admin/autoscaler", bad, ADMIN)
        _assert_error(code, answer, 400, "invalid_request")
        assert answer["error"]["param"] == next(iter(wrong)), answer
    for wrong_instance in ("", "two words", "x" * 129):
        bad = json.dumps(status | {"interval_s": 1.0, "instance": wrong_instance}).encode()
        code, _, answer = http("POST", cluster.gateway.url + "/admin/autoscaler", bad, ADMIN)
        _assert_error(code, answer, 400, "invalid_request")
    admin(cluster.gateway, "POST", "/admin/autoscaler", status | {"interval_s": 1.0})
    shown = admin(cluster.gateway, "GET", "/admin/snapshot")["autoscaler"]
    assert {k: shown[k] for k in status} == status and shown["dry_run"] is False
    assert 0 <= shown["age_s"] < 3 and shown["stale"] is False
    assert shown["live_instances"] == []  # an autoscaler that names none
    for instance in ("0123456789ab", "ba9876543210"):
        body = status | {"interval_s": 1.0, "instance": instance}
        admin(cluster.gateway, "POST", "/admin/autoscaler", body)
    shown = admin(cluster.gateway, "GET", "/admin/snapshot")["autoscaler"]
    assert shown["instance"] == "ba9876543210"  # the latest status
    assert shown["live_instances"] == ["0123456789ab", "ba9876543210"]  # both still post
    wait_for(
        lambda: admin(cluster.gateway, "GET", "/admin/snapshot")["autoscaler"]["stale"],
        what="the status to go stale after 3 intervals",
    )
    assert admin(cluster.gateway, "GET", "/admin/snapshot")["autoscaler"]["live_instances"] == []


def test_drain_and_policy_switch(cluster: Cluster) -> None:
    rows = replica_rows(cluster.gateway)
    victim = rows[cluster.urls[0]]["name"]
    drain = f"{cluster.gateway.url}/admin/replicas/{victim}/drain"
    for bad in (b'{"by": ""}', b'{"by": 3}', b'{"who": "me"}', b"[", b'{"by": "a b"}'):
        status, _, answer = http("POST", drain, bad, ADMIN)
        _assert_error(status, answer, 400, "invalid_request")
    assert replica_rows(cluster.gateway)[cluster.urls[0]]["state"] == "healthy"
    shown = admin(cluster.gateway, "POST", f"/admin/replicas/{victim}/drain", {"by": "autoscale:1"})
    assert shown["state"] == "drained" and shown["drained_by"] == "autoscale:1"
    shown = admin(cluster.gateway, "POST", f"/admin/replicas/{victim}/drain")  # an operator's
    assert shown["state"] == "drained" and shown["drained_by"] is None
    admin(cluster.gateway, "POST", "/admin/policy", {"policy": "round_robin"})
    try:
        client = cluster.client()
        served = [
            client.completions.with_raw_response.create(
                model=MODEL, prompt="x", max_tokens=2
            ).headers["x-isocost-replica"]
            for _ in range(6)
        ]
        assert victim not in served
        assert len(set(served)) == 2, served  # round robin over the two others
        shown = admin(cluster.gateway, "POST", f"/admin/replicas/{victim}/undrain")
        assert shown["state"] == "healthy" and shown["drained_by"] is None
        served = [
            client.completions.with_raw_response.create(
                model=MODEL, prompt="x", max_tokens=2
            ).headers["x-isocost-replica"]
            for _ in range(6)
        ]
        assert victim in served
    finally:
        admin(cluster.gateway, "POST", f"/admin/replicas/{victim}/undrain")
        admin(cluster.gateway, "POST", "/admin/policy", {"policy": "equal_cost"})
    status, _, answer = http(
        "POST", cluster.gateway.url + "/admin/policy", b'{"policy": "nope"}', ADMIN
    )
    _assert_error(status, answer, 400, "unknown_policy")


def test_admin_removes_and_adds_replicas(cluster: Cluster) -> None:
    url = cluster.urls[2]
    name = replica_rows(cluster.gateway)[url]["name"]
    admin(cluster.gateway, "DELETE", f"/admin/replicas/{name}")
    wait_for(lambda: url not in replica_rows(cluster.gateway), what="the removal")
    status, _, answer = http(
        "POST", cluster.gateway.url + "/admin/replicas", b'{"model": "m", "replica": {}}', ADMIN
    )
    _assert_error(status, answer, 400, "invalid_request")
    added = admin(
        cluster.gateway,
        "POST",
        "/admin/replicas",
        {"model": MODEL, "replica": {"url": url, "gpu": "h100-80g"}},
    )
    assert added["url"] == url and added["gpu"] == "h100-80g"
    status, _, answer = http(
        "POST",
        cluster.gateway.url + "/admin/replicas",
        json.dumps({"model": MODEL, "replica": {"url": url}}).encode(),
        ADMIN,
    )
    _assert_error(status, answer, 400, "invalid_replica")
    wait_for(
        lambda: replica_rows(cluster.gateway)[url]["scrape_age_s"] is not None,
        what="the re-added replica to be scraped",
    )


def test_metrics_and_logs(cluster: Cluster) -> None:
    secret_prompt = "purple-elephant-secret-prompt"
    for _ in cluster.client().completions.create(  # streamed: a first token is timed
        model=MODEL, prompt=secret_prompt, max_tokens=3, stream=True
    ):
        pass
    status, _, _ = http("POST", cluster.gateway.url + "/v1/completions", b"{", AUTH)
    assert status == 400  # counted as invalid_body
    with urllib.request.urlopen(cluster.gateway.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    for series in (
        'isocost_requests_total{pool="llama-3.1-8b"',
        "isocost_ttft_seconds_bucket",
        "isocost_e2e_seconds_bucket",
        'isocost_decisions_total{policy="equal_cost"}',
        "isocost_replica_healthy",
        "isocost_replica_ttft_factor",
        "isocost_replica_itl_factor",
        "isocost_replica_ttft_prediction_error",
        "isocost_replica_itl_prediction_error",
        "isocost_replica_prefill_duty",
        'isocost_replica_prefill_term_seconds{pool="llama-3.1-8b"',
        'isocost_rejections_total{reason="invalid_body"}',
    ):
        assert series in text, series
    log = cluster.log.read_text()
    entries = log_records(log)
    assert any(e.get("event") == "request" and e.get("key") == "team-a" for e in entries)
    assert all(e["predicted_ttft_ms"] > 0 for e in entries if e.get("event") == "request")
    assert API_KEY not in log and ADMIN_TOKEN not in log and secret_prompt not in log


def test_each_keys_answers_and_tokens_are_counted(cluster: Cluster) -> None:
    url = cluster.gateway.url
    series = {
        "ok": 'isocost_api_key_requests_total{key="team-a",status="200"}',
        "denied": 'isocost_api_key_requests_total{key="team-a",status="403"}',
        "prompt": 'isocost_api_key_tokens_total{key="team-a",kind="prompt"}',
        "completion": 'isocost_api_key_tokens_total{key="team-a",kind="completion"}',
        "refusals": 'isocost_rejections_total{reason="priority_not_allowed"}',
    }

    def read() -> dict[str, float]:
        return {name: metric_value(url, line) or 0.0 for name, line in series.items()}

    before = read()
    answer = cluster.client().completions.create(model=MODEL, prompt="Count me.", max_tokens=3)
    assert answer.usage is not None
    with pytest.raises(openai.PermissionDeniedError):  # above the key's max_priority
        cluster.client().completions.create(
            model=MODEL, prompt="Me first.", max_tokens=3, extra_headers={"x-priority": "9"}
        )
    after = read()
    assert after["ok"] - before["ok"] == 1
    assert after["completion"] - before["completion"] == answer.usage.completion_tokens
    assert after["prompt"] - before["prompt"] > 0  # the gateway's count of "Count me."
    assert after["denied"] - before["denied"] == 1
    assert after["refusals"] - before["refusals"] == 1


# -- faults: a replica killed under load, ejected, re-admitted ---------------------------


def test_replica_killed_under_load(tmp_path: Path) -> None:
    gen = _cluster(tmp_path, 3)
    c = next(gen)
    try:
        victim = c.engines[0]
        port = int(victim.url.rsplit(":", 1)[1])
        name = replica_rows(c.gateway)[victim.url]["name"]
        admin(c.gateway, "POST", "/admin/policy", {"policy": "round_robin"})

        async def load() -> tuple[list[str], list[str]]:
            client = openai.AsyncOpenAI(
                base_url=c.gateway.url + "/v1", api_key=API_KEY, max_retries=0
            )

            async def one(i: int) -> str:
                raw = await client.completions.with_raw_response.create(
                    model=MODEL, prompt=f"request {i}", max_tokens=200
                )
                answer = raw.parse()
                assert answer.usage is not None and answer.usage.completion_tokens == 200
                return raw.headers["x-isocost-replica"]

            tasks = [asyncio.create_task(one(i)) for i in range(30)]
            await asyncio.to_thread(
                wait_for,
                lambda: replica_rows(c.gateway)[victim.url]["in_flight"] >= 3,
                20,
                "requests in flight on the victim",
            )
            victim.stop(signal.SIGKILL)
            served = await asyncio.gather(*tasks)
            more = await asyncio.gather(*(one(100 + i) for i in range(9)))
            await client.close()
            return list(served), list(more)

        served, more = asyncio.run(load())
        assert len(served) == 30 and name not in served  # every one completed elsewhere
        assert name not in more
        assert replica_rows(c.gateway)[victim.url]["state"] == "ejected"
        with urllib.request.urlopen(c.gateway.url + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
        retried = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("isocost_retries_total")
        )
        assert retried >= 3

        restarted = start_engine(port)
        c.engines[0] = restarted
        wait_for(
            lambda: replica_rows(c.gateway)[victim.url]["state"] == "healthy",
            what="the restarted replica to be re-admitted",
        )
        client = c.client()
        served_after = {
            client.completions.with_raw_response.create(
                model=MODEL, prompt="back", max_tokens=2
            ).headers["x-isocost-replica"]
            for _ in range(6)
        }
        assert name in served_after
    finally:
        gen.close()


def test_stream_broken_mid_way_ends_with_an_error_event(tmp_path: Path) -> None:
    gen = _cluster(tmp_path, 1)
    c = next(gen)
    try:

        async def broken_stream() -> bytes:
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    c.gateway.url + "/v1/completions",
                    data=json.dumps(
                        {"model": MODEL, "prompt": "long", "max_tokens": 2000, "stream": True}
                    ),
                    headers=AUTH,
                ) as response,
            ):
                assert response.status == 200
                received = await response.content.readany()
                c.engines[0].stop(signal.SIGKILL)
                return received + await response.content.read()

        body = asyncio.run(broken_stream())
        events = [e for e in body.decode().split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert set(error) == {"message", "type", "param", "code"}
    finally:
        gen.close()


# -- config hot reload: add and remove replicas without dropping requests ----------------


def test_config_reload_adds_and_removes_replicas(cluster: Cluster, tmp_path: Path) -> None:
    config, log = tmp_path / "reload.yaml", tmp_path / "reload.log"
    first, second, third = cluster.urls
    write_config(config, [first, second])
    gateway = start_gateway(config, log)
    try:
        assert set(replica_rows(gateway)) == {first, second}
        write_config(config, [first, second, third])
        wait_for(lambda: set(replica_rows(gateway)) == {first, second, third}, what="an add")

        async def stream_during_removal() -> str:
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    gateway.url + "/v1/completions",
                    data=json.dumps(
                        {"model": MODEL, "prompt": "keep", "max_tokens": 300, "stream": True}
                    ),
                    headers={**AUTH, "x-isocost-class": "default"},
                ) as response,
            ):
                served_by = "http://" + response.headers["x-isocost-replica"]
                first_chunk = await response.content.readany()
                others = [u for u in (first, second, third) if u != served_by]
                write_config(config, others)
                await asyncio.to_thread(
                    wait_for,
                    lambda: (
                        served_by not in replica_rows(gateway)
                        or replica_rows(gateway)[served_by]["state"] == "removing"
                    ),
                    20,
                    "the removal to start",
                )
                rest = await response.content.read()
            text = (first_chunk + rest).decode()
            assert '"finish_reason":"length"' in text.replace(" ", "") and "error" not in text
            return served_by

        removed = asyncio.run(stream_during_removal())
        wait_for(lambda: removed not in replica_rows(gateway), what="the drained replica to leave")
        assert len(replica_rows(gateway)) == 2

        config.write_text("pools: [{model: m, replicas: [{url: ftp://x}]}]\n")
        wait_for(lambda: "reload_failed" in log.read_text(), what="the bad config to be seen")
        assert len(replica_rows(gateway)) == 2

        remaining = list(replica_rows(gateway))
        config.write_text(  # the replicas move to another pool: the model disappears
            gateway_config(
                remaining,
                model="moved",
                admin_token=ADMIN_TOKEN,
                api_key=API_KEY,
                replica_fields=f"cost_model: {MODEL}",
            )
        )
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY)
        wait_for(
            lambda: [m.id for m in client.models.list().data] == ["moved"],
            what="the pool to be dropped",
        )
        assert set(replica_rows(gateway)) == set(remaining)
        status, _, answer = http("POST", gateway.url + "/v1/chat/completions", chat_body(), AUTH)
        _assert_error(status, answer, 404, "model_not_found")
    finally:
        gateway.stop()


# -- admission: SLO deadlines, the gateway queue, per-key budgets, prompt limits ---------


def test_deadline_that_cannot_be_met_is_refused_with_retry_after(cluster: Cluster) -> None:
    status, headers, answer = http(
        "POST",
        cluster.gateway.url + "/v1/chat/completions",
        chat_body(content="y" * 20000),
        {**AUTH, "x-deadline-ms": "0.001"},
    )
    _assert_error(status, answer, 429, "deadline")
    assert int(headers["Retry-After"]) >= 1
    # no replica streams a token every microsecond
    status, _, answer = http(
        "POST",
        cluster.gateway.url + "/v1/chat/completions",
        chat_body(),
        {**AUTH, "x-tpot-ms": "0.001"},
    )
    _assert_error(status, answer, 429, "deadline")
    for bad in ({"x-priority": "high"}, {"x-tpot-ms": "fast"}, {"x-deadline-ms": "-5"}):
        status, _, answer = http(
            "POST", cluster.gateway.url + "/v1/chat/completions", chat_body(), {**AUTH, **bad}
        )
        _assert_error(status, answer, 400, "bad_header")
        assert next(iter(bad)) in answer["error"]["message"]
    status, _, answer = http(  # above the key's max_priority (0 by default): no queue jumping
        "POST",
        cluster.gateway.url + "/v1/chat/completions",
        chat_body(),
        {**AUTH, "x-priority": "1"},
    )
    _assert_error(status, answer, 403, "priority_not_allowed")
    assert answer["error"]["param"] == "x-priority"


def test_every_answer_gets_an_slo_verdict(tmp_path: Path) -> None:
    """The pool's SLO (a generous TTFT, a TPOT no engine step meets) judges each answer;
    a request's own x-tpot-ms replaces it; a refusal fails it; a bad request is no
    verdict. Whole answers are judged by their end against both budgets together."""
    engine = start_engine()
    config, log = tmp_path / "slo.yaml", tmp_path / "slo.log"
    slo = "    slo: {ttft_ms: 60000, tpot_ms: 0.5}"
    write_config(config, [engine.url], pool_fields=slo)
    gateway = start_gateway(config, log)
    try:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0)
        messages: Any = [{"role": "user", "content": "hello there"}]

        def ask(stream: bool, **headers: str) -> None:
            answer = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, stream=stream, extra_headers=headers
            )
            if stream:
                assert sum(1 for _ in answer) > 1

        ask(stream=True)  # 8 tokens, each far slower than 0.5 ms: missed
        ask(stream=False)  # whole: ended well within 60 s + 7 * 0.5 ms: met
        ask(stream=True, **{"x-tpot-ms": "60000"})  # its own target: met
        with pytest.raises(openai.RateLimitError):  # refused, cannot be met: failed
            ask(stream=False, **{"x-tpot-ms": "0.001"})
        status, _, _ = http("POST", gateway.url + "/v1/chat/completions", b"{", AUTH)
        assert status == 400  # not a request: no verdict
        with urllib.request.urlopen(gateway.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        verdicts = {
            family.name: {
                s.labels["verdict"]: s.value for s in family.samples if s.name.endswith("_total")
            }
            for family in text_string_to_metric_families(text)
            if family.name == "isocost_slo_requests"
        }["isocost_slo_requests"]
        assert verdicts == {"met": 2, "missed": 1, "failed": 1}
    finally:
        gateway.stop()
        engine.stop()


def test_prompt_over_the_token_limit(cluster: Cluster) -> None:
    status, _, answer = http(
        "POST", cluster.gateway.url + "/v1/chat/completions", chat_body(content="z" * 40000), AUTH
    )
    _assert_error(status, answer, 400, "context_length_exceeded")


def test_gateway_queue_binds_late_and_refuses_when_full(tmp_path: Path) -> None:
    """One replica that takes one waiting request at a time, a gateway queue of two."""
    engine = start_engine()
    config, log = tmp_path / "queue.yaml", tmp_path / "queue.log"
    write_config(config, [engine.url], replica_fields="max_queue: 1", limits="  max_queue: 2")
    gateway = start_gateway(config, log)
    try:

        async def burst() -> list[tuple[int, dict[str, str], bytes]]:
            body = json.dumps({"model": MODEL, "prompt": "long prompt " * 1000, "max_tokens": 4})
            async with aiohttp.ClientSession() as session:

                async def one() -> tuple[int, dict[str, str], bytes]:
                    async with session.post(
                        gateway.url + "/v1/completions", data=body, headers=AUTH
                    ) as response:
                        return response.status, dict(response.headers), await response.read()

                return await asyncio.gather(*(one() for _ in range(8)))

        results = asyncio.run(burst())
        statuses = sorted(status for status, _, _ in results)
        assert statuses.count(200) >= 3, statuses  # one admitted and two queued, at least
        refused = [(h, json.loads(b)) for s, h, b in results if s != 200]
        assert refused, statuses
        for headers, answer in refused:
            assert answer["error"]["code"] == "queue_full"
            assert int(headers["Retry-After"]) >= 1
        with urllib.request.urlopen(gateway.url + "/metrics", timeout=10) as response:
            assert 'isocost_rejections_total{reason="queue_full"}' in response.read().decode()
    finally:
        gateway.stop()
        engine.stop()


def test_per_key_request_budget(tmp_path: Path) -> None:
    engine = start_engine()
    config, log = tmp_path / "keys.yaml", tmp_path / "keys.log"
    write_config(
        config,
        [engine.url],
        keys="    - {name: small, key: sk-small-budget, requests_per_minute: 3}",
    )
    gateway = start_gateway(config, log)
    try:
        headers = {"Authorization": "Bearer sk-small-budget"}
        url = gateway.url + "/v1/chat/completions"
        assert [http("POST", url, chat_body(), headers)[0] for _ in range(3)] == [200] * 3
        status, got, answer = http("POST", url, chat_body(), headers)
        _assert_error(status, answer, 429, "rate_limit_exceeded")
        assert 1 <= int(got["Retry-After"]) <= 20
        assert http("POST", url, chat_body(), AUTH)[0] == 200  # other keys are unaffected
        assert "sk-small-budget" not in log.read_text()
    finally:
        gateway.stop()
        engine.stop()


def test_failing_replica_ejected_and_full_one_skipped(tmp_path: Path) -> None:
    """500s count against a replica; a full engine's 503 is retried, not held against it."""
    healthy = start_engine()
    failing = start_engine(0, "--error-rate", "1.0")
    full = start_engine(0, "--max-waiting", "0")
    config, log = tmp_path / "faults.yaml", tmp_path / "faults.log"
    write_config(config, [healthy.url, failing.url, full.url], policy="round_robin")
    gateway = start_gateway(config, log)
    try:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0)
        served = {
            client.completions.with_raw_response.create(
                model=MODEL, prompt="x", max_tokens=3
            ).headers["x-isocost-replica"]
            for _ in range(12)
        }
        assert served == {healthy.url.removeprefix("http://")}
        rows = replica_rows(gateway)
        assert rows[failing.url]["state"] == "ejected"
        assert "status 500" in (rows[failing.url]["last_error"] or "")
        assert rows[full.url]["state"] == "healthy"
        for url in (healthy.url, failing.url):
            admin(gateway, "POST", f"/admin/replicas/{rows[url]['name']}/drain")
        status, headers, answer = http(
            "POST", gateway.url + "/v1/chat/completions", chat_body(), AUTH
        )
        _assert_error(status, answer, 503, "overloaded")
        assert int(headers["Retry-After"]) >= 1
    finally:
        gateway.stop()
        for engine in (healthy, failing, full):
            engine.stop()


def test_large_body_sent_in_pieces_is_read_whole(cluster: Cluster) -> None:
    body = chat_body(content="w" * (MAX_BODY_BYTES // 4), max_tokens=2)
    host, port = cluster.gateway.url.removeprefix("http://").split(":")
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(head.encode() + body[:1000])
        time.sleep(0.2)  # the gateway has read the first piece and must wait for the rest
        sock.sendall(body[1000:])
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


def test_slow_body_gets_408(cluster: Cluster) -> None:
    """A client that announces a body and never sends it is cut off (body_timeout_ms)."""
    host, port = cluster.gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: 100\r\n\r\n{{".encode()
        )
        answer = sock.recv(65536).decode()
    assert answer.startswith("HTTP/1.1 408"), answer
    assert '"code":"body_timeout"' in answer


def test_hung_replica_times_out_with_504(tmp_path: Path) -> None:
    engine = start_engine(0, "--hang")
    config, log = tmp_path / "hang.yaml", tmp_path / "hang.log"
    write_config(config, [engine.url], limits="  total_timeout_ms: 800\n  max_retries: 0")
    gateway = start_gateway(config, log)
    try:
        status, _, answer = http("POST", gateway.url + "/v1/chat/completions", chat_body(), AUTH)
        _assert_error(status, answer, 504, "upstream_timeout")
        assert http("GET", gateway.url + "/health")[0] == 200
    finally:
        gateway.stop()
        engine.stop()


# -- the CLI: no config file, and bad input ----------------------------------------------


def test_serve_without_a_file_discovers_the_model(cluster: Cluster) -> None:
    gateway = _start(
        ["serve", "--port", "0", "--replica", cluster.urls[0], "--replica", cluster.urls[1],
         "--policy", "round_robin", "--gpu", "a100-80g"],
        "isocost serve",
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == [MODEL]
        served = {
            client.completions.with_raw_response.create(
                model=MODEL, prompt="x", max_tokens=2
            ).headers["x-isocost-replica"]
            for _ in range(4)
        }
        assert {f"http://{name}" for name in served} == set(cluster.urls[:2])
        status, _, answer = http("GET", gateway.url + "/admin/snapshot")
        _assert_error(status, answer, 403, "admin_disabled")
    finally:
        gateway.stop()


def test_serve_routes_a_model_in_no_catalog_priced_as_the_generic_prior(tmp_path: Path) -> None:
    private = "org/Private-Model-13B"
    engine = start_engine(0, "--served-model-name", private)
    log = tmp_path / "gateway.log"
    try:
        with log.open("w") as stderr:
            gateway = _start(["serve", "--port", "0", "--replica", engine.url], "isocost serve",
                             stderr=stderr)  # fmt: skip
        try:
            client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused")
            for _ in range(3):
                reply = client.completions.create(model=private, prompt="x", max_tokens=2)
                assert reply.usage is not None and reply.usage.completion_tokens == 2
        finally:
            gateway.stop()
    finally:
        engine.stop()
    said = [line for line in log.read_text().splitlines() if "generic_prior" in line]
    assert len(said) == 1 and private in said[0], said


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["serve"], "either --config"),
        (["serve", "--config", "/nonexistent.yaml"], "no such file"),
        (["serve", "--replica", "ftp://x:1"], "http://"),
        (["serve", "--replica", "http://127.0.0.1:1", "--discover-timeout", "0.3"], "/v1/models"),
    ],
)
def test_serve_bad_input_is_one_line_and_exit_2(args: list[str], fragment: str) -> None:
    done = subprocess.run([ISOCOST, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert fragment in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_serve_rejects_a_config_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("pools:\n  - model: m\n    replicas: [{url: 'http://a:1', gpuu: x}]\n")
    done = subprocess.run(
        [ISOCOST, "serve", "--config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "pools[0].replicas[0]" in done.stderr and "gpuu" in done.stderr
    config.write_text("policy: no_such_policy\n")
    done = subprocess.run(
        [ISOCOST, "serve", "--config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "no_such_policy" in done.stderr


def test_retry_goes_to_another_replica_even_when_the_policy_prefers_the_same(
    tmp_path: Path,
) -> None:
    """Session affinity keeps choosing the failing replica; the retry must exclude it."""
    healthy, failing = start_engine(), start_engine(0, "--error-rate", "1.0")
    config, log = tmp_path / "retry.yaml", tmp_path / "retry.log"
    write_config(
        config, [healthy.url, failing.url], policy="session", health="  failure_threshold: 1000"
    )
    gateway = start_gateway(config, log)
    try:
        url = gateway.url + "/v1/chat/completions"
        session = next(
            f"user-{i}"
            for i in range(200)
            if http("POST", gateway.url + "/v1/route", chat_body(user=f"user-{i}"), AUTH)[2][
                "replica_url"
            ]
            == failing.url
        )
        for _ in range(3):
            status, headers, answer = http("POST", url, chat_body(user=session), AUTH)
            assert status == 200, answer
            assert f"http://{headers['x-isocost-replica']}" == healthy.url
        assert replica_rows(gateway)[failing.url]["state"] == "healthy"  # threshold not reached
    finally:
        gateway.stop()
        healthy.stop()
        failing.stop()


def test_client_that_leaves_frees_its_replica(cluster: Cluster) -> None:
    async def leave_early(stream: bool) -> None:
        body = json.dumps({"model": MODEL, "prompt": "p", "max_tokens": 3000, "stream": stream})
        async with aiohttp.ClientSession() as session:
            if stream:
                response = await session.post(
                    cluster.gateway.url + "/v1/completions", data=body, headers=AUTH
                )
                await response.content.readany()
                response.close()  # the client goes away mid-stream
                return
            with pytest.raises(TimeoutError):  # gives up while the answer is generated
                await session.post(
                    cluster.gateway.url + "/v1/completions",
                    data=body,
                    headers=AUTH,
                    timeout=aiohttp.ClientTimeout(total=0.5),
                )

    def in_flight() -> int:
        return sum(r["in_flight"] for r in replica_rows(cluster.gateway).values())

    for stream in (False, True):
        asyncio.run(leave_early(stream))
        wait_for(lambda: in_flight() == 0, 10, "the abandoned request to be released")
