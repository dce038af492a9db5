"""``isocost picker`` over prefill and decode replicas: llm-d's ``x-prefiller-host-port``.

The picker's ext_proc stream is spoken directly (no Envoy needed): a request the brain
splits is sent to the decode replica with the prefill replica's ``ip:port`` in
``x-prefiller-host-port``; a request served whole has a client's own such header removed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from gateway_harness import pd_gateway_config
from isocost_procs import Proc, free_port, start_isocost

MODEL = "llama-3.1-8b"
API_KEY = "sk-test-picker-pd-61a0"
PROMPT = "a prompt long enough to be worth splitting " * 20


def _engine(role: str) -> Proc:
    args = ["engine", "--port", "0", "--model", MODEL, "--gpu", "a100-80g", "--role", role]
    return start_isocost(args, "isocost engine")


def _picker(tmp: Path, roles: dict[str, str], mode: str) -> tuple[Proc, int]:
    text = pd_gateway_config(
        roles, mode, model=MODEL, admin_token="admin-picker-pd", api_key=API_KEY
    )
    config = tmp / f"{mode}.yaml"
    config.write_text(text)
    port = free_port()
    with (tmp / "picker.log").open("a") as log:
        args = ["picker", "--config", str(config), "--port", str(port)]
        return start_isocost(args, "isocost picker", stderr=log), port


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Proc, Proc]]:
    prefill, decode = _engine("prefill"), _engine("decode")
    yield prefill, decode
    decode.stop()
    prefill.stop()


def _pick(port: int, extra_headers: dict[str, str]) -> ext_proc.HeaderMutation:
    """One request's exchange (headers, whole body); the pick's header mutation."""
    headers = {
        ":method": "POST",
        ":path": "/v1/completions",
        "authorization": f"Bearer {API_KEY}",
        "content-type": "application/json",
    } | extra_headers
    header_map = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    )
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 4}).encode()
    messages = [
        ext_proc.ProcessingRequest(request_headers=ext_proc.HttpHeaders(headers=header_map)),
        ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=body, end_of_stream=True)),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ext_proc_grpc.ExternalProcessorStub(channel)
        _, picked = list(stub.Process(iter(messages), timeout=10))
    return picked.request_body.response.header_mutation


def _set(mutation: ext_proc.HeaderMutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def test_split_request_names_its_prefiller(
    engines: tuple[Proc, Proc], tmp_path: Path, procs: list[Proc]
) -> None:
    prefill, decode = engines
    picker, port = _picker(tmp_path, {prefill.url: "prefill", decode.url: "decode"}, "pd")
    procs.append(picker)
    mutation = _pick(port, {})
    assert _set(mutation) == {
        "x-gateway-destination-endpoint": decode.url.removeprefix("http://"),
        "x-prefiller-host-port": prefill.url.removeprefix("http://"),
    }


def test_whole_request_drops_a_clients_prefiller(
    engines: tuple[Proc, Proc], tmp_path: Path, procs: list[Proc]
) -> None:
    prefill, decode = engines
    picker, port = _picker(tmp_path, {prefill.url: "prefill", decode.url: "decode"}, "colocated")
    procs.append(picker)
    mutation = _pick(port, {"x-prefiller-host-port": "10.0.0.66:8000"})
    assert _set(mutation) == {"x-gateway-destination-endpoint": decode.url.removeprefix("http://")}
    assert list(mutation.remove_headers) == ["x-prefiller-host-port", "x-isocost-meter"]
