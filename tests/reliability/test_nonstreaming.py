"""Requests not streamed through a real gateway: ``max_queue`` bounds waiting, not running.

A request that is not streamed shows the gateway no first token, only its end. The shadow
state takes it to leave the engine's waiting queue at its predicted prefill end (or when a
scrape shows it running), so a replica with ``max_queue: 4`` runs 32 long ones at once,
as the engine's own ``/metrics`` shows. Their end-to-end times teach the replica's TTFT
factor nothing (the engines run 5x faster than the gateway's cost model, so a factor
learnt from them would fall to about 0.2); it stays 1.0.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import AUTH, MODEL, Cluster, config_text, replica_rows, start, start_engine
from gateway_harness import http, wait_for

CONCURRENT = 32
MAX_QUEUE = 4
OUTPUT_TOKENS = 3000  # about 5 s of decode at --time-scale 0.2: long enough to overlap


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    engine = start_engine()
    try:
        config, log = tmp_path / "gateway.yaml", tmp_path / "gateway.log"
        config.write_text(config_text([engine.url], gpu=f"a100-80g, max_queue: {MAX_QUEUE}"))
        with log.open("a") as sink:
            gateway = start(["serve", "--config", str(config), "--port", "0"], stderr=sink)
    except BaseException:
        engine.stop()
        raise
    cluster = Cluster([engine], gateway, config, log)
    try:
        yield cluster
    finally:
        cluster.close()


def _body(max_tokens: int, **extra: object) -> bytes:
    fields = {"model": MODEL, "prompt": "hello " * 50, "max_tokens": max_tokens, **extra}
    return json.dumps(fields).encode()


def _engine_running(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    match = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.MULTILINE)
    assert match is not None, text[:500]
    return float(match.group(1))


def test_max_queue_does_not_cap_running_requests_not_streamed(cluster: Cluster) -> None:
    engine, gateway = cluster.engines[0], cluster.gateway
    statuses: list[int] = []

    def one() -> None:
        status, _, _ = http(
            "POST",
            gateway.url + "/v1/completions",
            _body(OUTPUT_TOKENS, ignore_eos=True),
            headers=AUTH,
            timeout_s=120,
        )
        statuses.append(status)

    clients = [threading.Thread(target=one) for _ in range(CONCURRENT)]
    for client in clients:
        client.start()
    try:
        peak = [0.0]

        def many_running() -> bool:
            peak[0] = max(peak[0], _engine_running(engine.url))
            return peak[0] >= CONCURRENT / 2

        # Capped at the queue, the engine would run MAX_QUEUE at a time, one batch after
        # the other; all dispatched, it runs (nearly) all of them at once.
        wait_for(many_running, 60, "the engine running many at once", state=lambda: peak[0])
    finally:
        for client in clients:
            client.join(timeout=180)
    assert statuses == [200] * CONCURRENT
    row = replica_rows(gateway)[engine.url]
    assert row["ttft_factor"] == 1.0, row  # no first token seen: nothing taught it
    assert (row["shadow_waiting"], row["shadow_running"], row["in_flight"]) == (0, 0, 0), row


def test_requests_not_streamed_beyond_engine_capacity_still_all_complete(
    cluster: Cluster,
) -> None:
    """Variant: many short ones through the four queue places, engine waiting included."""
    engine, gateway = cluster.engines[0], cluster.gateway
    statuses: list[int] = []

    def one() -> None:
        status, _, _ = http(
            "POST", gateway.url + "/v1/completions", _body(32), headers=AUTH, timeout_s=120
        )
        statuses.append(status)

    clients = [threading.Thread(target=one) for _ in range(3 * CONCURRENT)]
    for client in clients:
        client.start()
    for client in clients:
        client.join(timeout=180)
    assert statuses == [200] * len(clients)
    wait_for(lambda: _engine_running(engine.url) == 0, 20, "the engine idle")
    row = replica_rows(gateway)[engine.url]
    assert row["ttft_factor"] == 1.0, row
    assert (row["shadow_waiting"], row["shadow_running"]) == (0, 0), row
