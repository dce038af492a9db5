"""Clients that leave mid-generation free the engine at once, queued or streaming.

One ``isocost engine`` (in real time, so that answers last) behind a gateway whose replica
takes new work only while nothing waits there (``max_queue: 1``): a burst of 100 streaming
clients leaves some streaming and the rest in the gateway's queue. Then every client
drops its connection; within a second the engine must run nothing (its
``vllm:num_requests_running`` and ``..._waiting`` back to the baseline, 0), and the
gateway must hold nothing (queue, in-flight count and shadow state all empty).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from cluster import ADMIN, AUTH, MODEL, Cluster, http, start_cluster

CLIENTS = 100
PROMPT = "route " * 1500  # ~1500 tokens: each prefill takes a while, so requests queue


@pytest.fixture
def single(tmp_path: Path) -> Iterator[Cluster]:
    cluster = start_cluster(
        tmp_path, 1, engine_args=("--time-scale", "1"), replica_fields="max_queue: 1"
    )
    try:
        yield cluster
    finally:
        cluster.close()


def engine_busy(cluster: Cluster) -> float:
    """The engine's running plus waiting requests, from its own metrics."""
    with urllib.request.urlopen(cluster.engine_urls[0] + "/metrics", timeout=5) as response:
        text = response.read().decode()
    total = 0.0
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        total += sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M))
    return total


def gateway_holds(cluster: Cluster) -> tuple[int, int, int]:
    """The gateway's queue depth, in-flight count and shadow requests of its pool."""
    status, _, body = http("GET", cluster.gateway.url + "/admin/snapshot", headers=ADMIN)
    assert status == 200, body
    (pool,) = body["pools"]
    (row,) = body["replicas"]
    return pool["queue_depth"], pool["in_flight"], row["shadow_waiting"] + row["shadow_running"]


def settle_within(probe: object, what: str, limit_s: float) -> float:
    """Seconds until ``probe()`` is falsy (all zero); fails past ``limit_s``."""
    started = time.monotonic()
    while True:
        value = probe()  # type: ignore[operator]
        if not any(value) if isinstance(value, tuple) else not value:
            return time.monotonic() - started
        assert time.monotonic() - started < limit_s, f"{what} still {value} after {limit_s} s"
        time.sleep(0.02)


async def burst_then_leave(cluster: Cluster) -> tuple[int, int]:
    """Open ``CLIENTS`` streams, wait until some stream and others queue, then drop all;
    how many were streaming and how many queued at that moment."""
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }
    )
    streaming = 0
    first_data = asyncio.Event()

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal streaming
        async with session.post(
            cluster.gateway.url + "/v1/completions", data=body, headers=AUTH
        ) as response:
            assert response.status == 200, await response.text()
            async for line in response.content:
                if line.startswith(b"data:"):
                    streaming += 1
                    first_data.set()
                    break
            await asyncio.Event().wait()  # read no further: a client mid-generation

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [asyncio.create_task(client(session)) for _ in range(CLIENTS)]
        await asyncio.wait_for(first_data.wait(), 30)
        deadline = time.monotonic() + 30
        queued = 0
        while time.monotonic() < deadline:  # some streaming, some still queued
            queued, _, _ = await asyncio.to_thread(gateway_holds, cluster)
            if streaming >= 5 and queued > 0:
                break
            await asyncio.sleep(0.05)
        seen = streaming
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return seen, queued  # leaving the session closed every connection


def test_clients_that_leave_free_the_engine_and_the_gateway_within_a_second(
    single: Cluster,
) -> None:
    assert engine_busy(single) == 0  # the baseline
    streaming, queued = asyncio.run(burst_then_leave(single))
    assert streaming >= 5 and queued > 0, (streaming, queued)
    engine_s = settle_within(lambda: engine_busy(single), "engine requests", 1.0)
    gateway_s = settle_within(lambda: gateway_holds(single), "gateway queue/in-flight", 1.0)
    assert engine_s <= 1.0 and gateway_s <= 1.0
