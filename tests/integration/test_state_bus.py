"""Gateways sharing one view through the state bus, end to end: a real bus server (every
test twice: redis-server and nats-server), real `isocost engine` replicas and `isocost
serve` gateways on 127.0.0.1.

Checked, each by polling against a deadline: a prefix dispatched through gateway A is
matched by gateway B's index (B's decision reports the cached tokens, on A's replica); a
request in flight through A shows in B's shadow state (B's own count staying 0) and leaves
it when A's request ends; the bus server SIGKILLed under load through both gateways fails no
request, both report the bus down and come back to sharing once it returns; a gateway
SIGKILLed mid-request has its in-flight forgotten by its peer within the peer timeout; a
made-up peer's junk (a request dispatched twice, a count out of bounds, a send time of nan)
is counted and dropped while the bus stays up and its subscriber never fails.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
from bus_servers import BUS_SERVERS, BusServer
from gateway_harness import http, metric_value, wait_for
from isocost_procs import ISOCOST, Proc, ready_urls, start_isocost

from isocost.runtime.bus import Batch, Cancel, Dispatch, Heartbeat

MODEL = "llama-3.1-8b"
TOKEN = "bus-admin-7f3a"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
HEARTBEAT_MS = 100
PEER_TIMEOUT_MS = 800


@dataclass
class Cluster:
    bus: BusServer
    engines: list[str]
    config: Path
    procs: list[Proc] = field(default_factory=list)

    def gateway(self, name: str) -> Proc:
        with (self.config.parent / f"{name}.log").open("a") as log:
            proc = start_isocost(["serve", "--config", str(self.config), "--port", "0"], stderr=log)
        self.procs.append(proc)
        return proc


@pytest.fixture(scope="module", params=BUS_SERVERS)
def cluster(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    """The bus server, two engine replicas and the gateways' shared config; A and B
    started."""
    tmp = tmp_path_factory.mktemp("bus")
    bus = request.param(tmp / "server")
    bus.start()
    args = ["engine", "--port", "0", "--replicas", "2", "--model", MODEL, "--gpu", "a100-80g"]
    popen = subprocess.Popen(
        [ISOCOST, *args, "--output-dist", "max"], stdout=subprocess.PIPE, text=True
    )
    engines = Proc(popen, "")
    urls = ready_urls(popen, "isocost engine", count=2, timeout_s=60)
    replicas = "\n".join(f"      - {{url: '{url}'}}" for url in urls)
    config = tmp / "gateway.yaml"
    config.write_text(
        f"""
scrape_interval_ms: 100
pools:
  - model: {MODEL}
    replicas:
{replicas}
limits: {{retry_backoff_ms: 5, max_retries: 3}}
health: {{interval_ms: 100, timeout_ms: 500, open_ms: 300}}
auth: {{admin_token: {TOKEN}}}
state_bus:
  url: {bus.url}
  heartbeat_ms: {HEARTBEAT_MS}
  peer_timeout_ms: {PEER_TIMEOUT_MS}
  max_backoff_ms: 200
"""
    )
    built = Cluster(bus, urls, config)
    try:
        a, b = built.gateway("a"), built.gateway("b")
        for gateway in (a, b):
            wait_for(lambda g=gateway: metric(g, "isocost_state_bus_peers") == 1, 10, "peers")
        yield built
    finally:
        for proc in reversed(built.procs):
            proc.stop(signal.SIGKILL)
        engines.stop(signal.SIGKILL)
        bus.kill()


def metrics_text(gateway: Proc) -> str:
    with urllib.request.urlopen(gateway.url + "/metrics", timeout=10) as response:
        return str(response.read().decode())


def metric(gateway: Proc, name: str) -> float | None:
    return metric_value(gateway.url, name)


def rows(gateway: Proc) -> dict[str, dict[str, Any]]:
    status, _, body = http("GET", gateway.url + "/admin/snapshot", headers=ADMIN)
    assert status == 200, body
    return {row["name"]: row for row in body["replicas"]}


def shadow_in_flight(gateway: Proc) -> int:
    return sum(row["shadow_in_flight"] for row in rows(gateway).values())


def post(gateway: Proc, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    headers = {"Content-Type": "application/json"}
    return http("POST", gateway.url + path, json.dumps(body).encode(), headers)


def gateways(cluster: Cluster) -> tuple[Proc, Proc]:
    return cluster.procs[0], cluster.procs[1]


def test_prefix_dispatched_through_a_is_matched_by_b(cluster: Cluster) -> None:
    a, b = gateways(cluster)
    prompt = "You are a careful assistant who answers about leases. " * 60
    fresh = "An unrelated question about tides and the moon, asked once. " * 60
    status, headers, _ = post(
        a, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    )
    assert status == 200
    served_by = headers["x-isocost-replica"]
    decisions: list[dict[str, Any]] = []

    def b_matches() -> bool:
        _, _, decision = post(b, "/v1/route?kind=completion", {"model": MODEL, "prompt": prompt})
        decisions.append(decision)
        return bool(decision["cached_tokens"])

    wait_for(b_matches, 5, "B's index to hold A's prefix", state=lambda: decisions[-1])
    assert decisions[-1]["replica"] == served_by
    assert decisions[-1]["cached_tokens"] >= 400
    _, _, unseen = post(b, "/v1/route?kind=completion", {"model": MODEL, "prompt": fresh})
    assert unseen["cached_tokens"] == 0  # B's index holds what A sent, not everything


def test_request_in_flight_through_a_is_visible_at_b(cluster: Cluster) -> None:
    a, b = gateways(cluster)
    done = threading.Event()

    def stream() -> None:
        with openai.OpenAI(base_url=a.url + "/v1", api_key="unused", max_retries=0) as client:
            for _ in client.completions.create(
                model=MODEL, prompt="Count slowly.", max_tokens=400, stream=True
            ):
                pass
        done.set()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    seen: list[dict[str, dict[str, Any]]] = []

    def b_sees_it() -> bool:
        seen.append(rows(b))
        return any(r["shadow_in_flight"] == 1 and r["in_flight"] == 0 for r in seen[-1].values())

    wait_for(b_sees_it, 5, "A's request in B's shadow state", state=lambda: seen[-1])
    assert not done.is_set(), "the request ended before B was seen holding it"
    lines = metrics_text(b).splitlines()
    divergence = [line for line in lines if line.startswith("isocost_view_divergence{")]
    assert len(divergence) == len(cluster.engines)
    _, _, snapshot = http("GET", b.url + "/admin/snapshot", headers=ADMIN)  # the dashboard's
    assert snapshot["state_bus"] == {"up": True, "peers": len(cluster.procs) - 1}
    assert all(row["view_divergence"] is not None for row in snapshot["replicas"])
    thread.join(timeout=30)
    assert done.is_set()
    wait_for(lambda: shadow_in_flight(b) == 0, 5, "A's completion to reach B")


@dataclass
class Load:
    """Short streams through several gateways from one thread each, until stopped."""

    targets: list[Proc]
    answers: int = 0
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Load:
        for target in self.targets:
            thread = threading.Thread(target=self._work, args=(target,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def _work(self, target: Proc) -> None:
        with openai.OpenAI(
            base_url=target.url + "/v1", api_key="unused", max_retries=0, timeout=15
        ) as client:
            while not self._stop.is_set():
                try:
                    for _ in client.completions.create(
                        model=MODEL, prompt="Tell me about buses.", max_tokens=8, stream=True
                    ):
                        pass
                    self.answers += 1
                except openai.APIError as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")

    def more(self, count: int) -> None:
        target = self.answers + count
        wait_for(lambda: self.answers >= target, 20, f"{count} more answers")


def test_bus_server_killed_under_load_fails_nothing_and_sharing_resumes(
    cluster: Cluster,
) -> None:
    a, b = gateways(cluster)
    with Load([a, b]) as load:
        load.more(10)
        cluster.bus.kill()
        for gateway in (a, b):
            wait_for(lambda g=gateway: metric(g, "isocost_state_bus_up") == 0, 5, "bus down")
        assert metric(b, "isocost_state_bus_peers") == 0
        load.more(20)  # served on scrapes alone
        cluster.bus.start()
        for gateway in (a, b):
            wait_for(lambda g=gateway: metric(g, "isocost_state_bus_up") == 1, 5, "bus up")
            wait_for(lambda g=gateway: metric(g, "isocost_state_bus_peers") == 1, 5, "peer back")
        load.more(10)
    assert load.errors == []
    wait_for(lambda: shadow_in_flight(b) == 0 and shadow_in_flight(a) == 0, 5, "views settle")


def test_killed_gateway_is_forgotten_within_the_peer_timeout(cluster: Cluster) -> None:
    _, b = gateways(cluster)
    c = cluster.gateway("c")
    wait_for(lambda: metric(b, "isocost_state_bus_peers") == 2, 5, "B hearing C")

    def stream() -> None:
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0)
        try:
            for _ in client.completions.create(
                model=MODEL, prompt="A long story.", max_tokens=2000, stream=True
            ):
                pass
        except openai.APIError:
            pass  # its gateway is killed mid-stream
        finally:
            client.close()

    threading.Thread(target=stream, daemon=True).start()
    wait_for(lambda: shadow_in_flight(b) == 1, 5, "C's request at B")
    c.popen.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(lambda: shadow_in_flight(b) == 0, 5, "B to forget C's request", interval_s=0.02)
    forgotten_s = time.monotonic() - killed_at
    assert forgotten_s <= PEER_TIMEOUT_MS / 1000 + 1.0  # the timeout, a heartbeat, polls
    assert metric(b, "isocost_state_bus_peers") == 1


def test_a_peer_sending_junk_is_counted_and_dropped_and_the_bus_stays_up(
    cluster: Cluster,
) -> None:
    _, b = gateways(cluster)
    replica = next(iter(rows(b)))

    def dispatch(request_id: str) -> Dispatch:
        return Dispatch(request_id, replica, MODEL, 10, 16, "default", True, None, ())

    def rejected(reason: str) -> float:
        return metric(b, f'isocost_state_bus_rejected_total{{reason="{reason}"}}') or 0.0

    failures = 'isocost_task_failures_total{task="state_bus_subscriber"}'
    before = {reason: rejected(reason) for reason in ("duplicate", "invalid")}
    gaps, failed = metric(b, "isocost_state_bus_gaps_total"), metric(b, failures)
    junk = [
        Batch("junk", 1, math.nan, [dispatch("dup1")]),
        Batch("junk", 2, time.time(), [dispatch("dup1")]),
        Batch("junk", 3, time.time(), [Heartbeat({replica: 2**62})]),  # dropped whole: ...
        Batch("junk", 4, time.time(), [Cancel("dup1")]),  # ... a gap, its dup1 forgotten
    ]
    for message in junk:
        cluster.bus.publish("isocost:state", msgspec.msgpack.encode(message))

    def counted() -> bool:
        return (
            rejected("duplicate") == before["duplicate"] + 1
            and rejected("invalid") == before["invalid"] + 1
            and metric(b, "isocost_state_bus_gaps_total") == (gaps or 0.0) + 1
        )

    def bus_series() -> list[str]:
        return [line for line in metrics_text(b).splitlines() if "_bus_" in line]

    wait_for(counted, 5, "B to count the junk", state=bus_series)
    assert metric(b, failures) == failed
    assert metric(b, "isocost_state_bus_up") == 1
    lag_sum = metric(b, "isocost_state_bus_lag_seconds_sum")
    assert lag_sum is not None and math.isfinite(lag_sum)
    assert shadow_in_flight(b) == 0
