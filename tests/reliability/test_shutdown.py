"""SIGTERM to a gateway under load: no new connections, every request in flight finishes,
exit 0 within the deadline.

Two ``isocost engine`` processes behind a gateway started with ``--shutdown-timeout``; 20
long streams are flowing when the gateway gets SIGTERM. While they drain the listening
socket refuses connections; each stream must still end with its full answer and
``[DONE]``, and the process must exit 0 before the deadline.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from cluster import AUTH, MODEL, start_cluster

STREAMS = 20
MAX_TOKENS = 1500  # ~2 s per answer here: still flowing well after the signal
DEADLINE_S = 20.0


def refuses_connections(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=1):
            return False
    except ConnectionRefusedError:
        return True


async def streams_through_sigterm(gateway_url: str, terminate: object) -> list[bytes]:
    """Open the streams, SIGTERM the gateway once each has data, read them to their end."""
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": "drain me",
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    started = 0
    all_started = asyncio.Event()

    async def client(session: aiohttp.ClientSession) -> bytes:
        nonlocal started
        raw = b""
        async with session.post(gateway_url + "/v1/completions", data=body, headers=AUTH) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if not raw:
                    started += 1
                    if started == STREAMS:
                        all_started.set()
                raw += line
        return raw

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(client(session)) for _ in range(STREAMS)]
        await asyncio.wait_for(all_started.wait(), 30)
        terminate()  # type: ignore[operator]
        return await asyncio.gather(*tasks)


def test_sigterm_drains_in_flight_streams_and_exits_zero(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path, 2, gateway_args=("--shutdown-timeout", str(DEADLINE_S)))
    try:
        gateway = cluster.gateway
        signalled: list[float] = []
        refused_while_draining: list[bool] = []

        def terminate() -> None:
            gateway.popen.send_signal(signal.SIGTERM)
            signalled.append(time.monotonic())
            deadline = time.monotonic() + 5
            while not refuses_connections(gateway.url):
                assert time.monotonic() < deadline, "still accepting connections"
                time.sleep(0.02)
            refused_while_draining.append(gateway.popen.poll() is None)

        answers = asyncio.run(streams_through_sigterm(gateway.url, terminate))
        code = gateway.popen.wait(timeout=DEADLINE_S)
        exited_after_s = time.monotonic() - signalled[0]
    finally:
        cluster.close()
    assert refused_while_draining == [True]  # no new connection while the streams drained
    for raw in answers:
        assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
        payloads = [
            json.loads(line[5:])
            for line in raw.splitlines()
            if line.startswith(b"data:") and line != b"data: [DONE]"
        ]
        assert not any("error" in p for p in payloads)
        assert payloads[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert code == 0 and exited_after_s < DEADLINE_S
    log = [json.loads(line) for line in cluster.log.read_text().splitlines() if line]
    (draining,) = [line for line in log if line.get("event") == "draining"]
    assert draining["in_flight"] == STREAMS
    assert [line["event"] for line in log if line.get("event") == "stopped"] == ["stopped"]
