"""One API key budget across gateways that share a state bus, end to end: a real bus
server (redis-server and nats-server), a real `isocost engine` replica and two `isocost
serve` gateways on 127.0.0.1, driven by the official `openai` client.

Checked: answers carry the key's `x-ratelimit-*` headers; what a key spends through
gateway A is spent at gateway B too (B's `isocost_api_key_budget_remaining` falls), so B
refuses the key's next request with 429, `rate_limit_exceeded`, a Retry-After and no
requests remaining, where B alone would have let four more through;
another key's budget at B is untouched; a key's `max_in_flight` counts its streams
through A at B, which refuses one more until they end; and with the bus server SIGKILLed
while a stream runs, the stream ends whole, B forgets A's holds, and each gateway goes on
enforcing the budgets on its own traffic, serving what fits.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from bus_servers import BUS_SERVERS, BusServer
from gateway_harness import metric_value, wait_for
from isocost_procs import ISOCOST, Proc, ready_urls, start_isocost

MODEL = "llama-3.1-8b"
PER_MINUTE = 4  # requests per minute of each key: a full bucket of four, one every 15 s
KEYS = {"team-a": "secret-team-a", "team-b": "secret-team-b", "team-c": "secret-team-c"}
AT_ONCE = 2  # team-c's max_in_flight, over both gateways


@dataclass
class Pair:
    bus: BusServer
    a: Proc
    b: Proc
    procs: list[Proc] = field(default_factory=list)


@pytest.fixture(params=BUS_SERVERS)
def pair(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Pair]:
    """The bus server, one engine replica and gateways A and B on one config, peers."""
    bus = request.param(tmp_path / "server")
    bus.start()
    args = ["engine", "--port", "0", "--model", MODEL, "--gpu", "a100-80g"]
    popen = subprocess.Popen([ISOCOST, *args], stdout=subprocess.PIPE, text=True)
    procs = [Proc(popen, "")]
    try:
        (engine,) = ready_urls(popen, "isocost engine", count=1, timeout_s=60)
        keys = "\n".join(
            f"    - {{name: {name}, key: {secret}, requests_per_minute: {PER_MINUTE}}}"
            for name, secret in KEYS.items()
            if name != "team-c"
        )
        keys += f"\n    - {{name: team-c, key: {KEYS['team-c']}, max_in_flight: {AT_ONCE}}}"
        config = tmp_path / "gateway.yaml"
        config.write_text(
            f"""
pools:
  - model: {MODEL}
    replicas: [{{url: '{engine}'}}]
auth:
  api_keys:
{keys}
state_bus: {{url: '{bus.url}', heartbeat_ms: 100, peer_timeout_ms: 800, max_backoff_ms: 200}}
"""
        )
        for name in ("a", "b"):
            with (tmp_path / f"{name}.log").open("a") as log:
                procs.append(
                    start_isocost(["serve", "--config", str(config), "--port", "0"], stderr=log)
                )
        a, b = procs[1], procs[2]
        for gateway in (a, b):
            wait_for(lambda g=gateway: metric(g, "isocost_state_bus_peers") == 1, 10, "peers")
        yield Pair(bus, a, b, procs)
    finally:
        for proc in reversed(procs):
            proc.stop(signal.SIGKILL)
        bus.kill()


def ask(gateway: Proc, key: str) -> openai.types.Completion:
    with openai.OpenAI(
        base_url=gateway.url + "/v1", api_key=KEYS[key], max_retries=0, timeout=15
    ) as client:
        return client.completions.create(model=MODEL, prompt="Budgets.", max_tokens=2)


def metric(gateway: Proc, series: str) -> float | None:
    return metric_value(gateway.url, series)


def remaining(gateway: Proc, key: str) -> float | None:
    series = f'isocost_api_key_budget_remaining{{budget="requests",key="{key}"}}'
    return metric(gateway, series)


def test_a_key_spent_through_a_is_spent_at_b(pair: Pair) -> None:
    with openai.OpenAI(
        base_url=pair.a.url + "/v1", api_key=KEYS["team-a"], max_retries=0, timeout=15
    ) as client:
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt="Budgets.", max_tokens=2
        )
    assert raw.headers["x-ratelimit-limit-requests"] == str(PER_MINUTE)
    assert raw.headers["x-ratelimit-remaining-requests"] == str(PER_MINUTE - 1)
    assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
    for _ in range(PER_MINUTE - 1):
        ask(pair.a, "team-a")
    levels: list[float | None] = []

    def b_heard() -> bool:
        levels.append(remaining(pair.b, "team-a"))
        return levels[-1] is not None and levels[-1] < 1

    wait_for(b_heard, 5, "A's spends at B", state=lambda: levels[-1])
    with pytest.raises(openai.RateLimitError) as refused:
        ask(pair.b, "team-a")  # B alone would let four through
    assert refused.value.status_code == 429
    assert refused.value.code == "rate_limit_exceeded"
    assert float(refused.value.response.headers["Retry-After"]) >= 1
    assert refused.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert ask(pair.b, "team-b").choices  # another key's budget is its own


def test_with_the_bus_gone_each_gateway_enforces_on_its_own_traffic(pair: Pair) -> None:
    with openai.OpenAI(
        base_url=pair.a.url + "/v1", api_key=KEYS["team-c"], max_retries=0, timeout=60
    ) as client:
        stream = client.completions.create(
            model=MODEL, prompt="Go on.", max_tokens=600, stream=True
        )
        chunks = iter(stream)
        next(chunks)  # in flight through A, and known at B, when the bus dies
        wait_for(lambda: in_flight(pair.b, "team-c") == 1, 5, "A's stream at B")
        pair.bus.kill()
        for gateway in (pair.a, pair.b):
            wait_for(lambda g=gateway: metric(g, "isocost_state_bus_up") == 0, 5, "bus down")
        assert in_flight(pair.b, "team-c") == 0  # B forgot A's holds with A
        assert sum(1 for _ in chunks) > 0  # the stream goes on to its end
    for _ in range(PER_MINUTE):
        assert ask(pair.a, "team-a").choices
    with pytest.raises(openai.RateLimitError):
        ask(pair.a, "team-a")
    assert ask(pair.b, "team-a").choices  # B did not hear A's spends: its own bucket


def in_flight(gateway: Proc, key: str) -> float | None:
    return metric(gateway, f'isocost_api_key_in_flight{{key="{key}"}}')


def test_a_keys_requests_in_flight_count_on_every_gateway(pair: Pair) -> None:
    client = openai.OpenAI(
        base_url=pair.a.url + "/v1", api_key=KEYS["team-c"], max_retries=0, timeout=60
    )
    streams = [
        client.completions.create(model=MODEL, prompt="Go on.", max_tokens=4000, stream=True)
        for _ in range(AT_ONCE)
    ]
    try:
        for stream in streams:
            next(iter(stream))  # a first token: in flight through A
        wait_for(lambda: in_flight(pair.b, "team-c") == AT_ONCE, 5, "A's streams at B")
        with pytest.raises(openai.RateLimitError, match="in flight") as refused:
            ask(pair.b, "team-c")  # B alone holds none of them
        assert refused.value.code == "rate_limit_exceeded"
    finally:
        for stream in streams:
            stream.close()  # the client leaves: A lets them go
        client.close()
    wait_for(lambda: in_flight(pair.b, "team-c") == 0, 10, "A's places freed at B")
    assert ask(pair.b, "team-c").choices
