"""``isocost engine`` against bad input: fault settings, KV-transfer addresses, body
codings, slow clients, sampling fields and bytes that are no HTTP.

Every refusal is OpenAI error JSON naming the field where there is one; nothing a client
sends makes the engine hang, connect where the client says, or answer 5xx. Raw sockets
send what no HTTP client would.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import urllib.request
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
from cluster import MODEL, start_engine
from gateway_harness import http, wait_for
from isocost_procs import ISOCOST, Proc, free_port
from prometheus_client.parser import text_string_to_metric_families
from rawhttp import address, connect, exchange, parse, read_all, request

JSON = {"Content-Type": "application/json"}
COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": "hi", "max_tokens": 1}


@pytest.fixture(scope="module")
def engine() -> Iterator[Proc]:
    proc = start_engine()  # an A100 at --time-scale 0.2
    try:
        yield proc
    finally:
        proc.stop()


READ_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def quick_engine() -> Iterator[Proc]:
    """An engine with a half-second read timeout."""
    proc = start_engine(0, "--read-timeout", str(READ_TIMEOUT_S))
    try:
        yield proc
    finally:
        proc.stop()


def _post(url: str, body: dict[str, Any] | bytes, headers: dict[str, str] = JSON) -> Any:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http("POST", url, data, headers)


def _assert_error(got: tuple[int, dict[str, str], Any], status: int, param: str | None) -> Any:
    code, headers, body = got
    assert code == status, body
    assert headers["Content-Type"].startswith("application/json"), headers
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if param is not None:
        assert (error["param"] or "").startswith(param), error
    return error


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} not in /metrics")


# -- 1. slowdown: bounded, and clearing it takes effect on the step in flight ------------


@pytest.mark.parametrize("slowdown", ["1e308", "1e999", "1001", "0.0009", "0", "-1"])
def test_a_slowdown_out_of_range_is_a_400_naming_it(engine: Proc, slowdown: str) -> None:
    body = f'{{"slowdown": {slowdown}}}'.encode()
    _assert_error(_post(engine.url + "/admin/fault", body), 400, "slowdown")
    assert http("GET", engine.url + "/admin/fault")[2]["slowdown"] == 1.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replica-spec", "slowdown=1e308"], "slowdown: must be between 0.001 and 1000"),
        (["--slowdown", "5000"], "--slowdown: must be between 0.001 and 1000"),
    ],
)
def test_a_slowdown_flag_out_of_range_exits_2(args: list[str], message: str) -> None:
    run = subprocess.run(
        [ISOCOST, "engine", "--port", "0", *args], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_clearing_a_slowdown_ends_the_step_in_flight_at_once(engine: Proc) -> None:
    """An 8,000-token prefill is one step of ~0.94 s on an A100: at slowdown 1000 and
    --time-scale 0.2 it would last over 3 minutes. Cleared while it runs, the step's rest
    runs at factor 1 and the answer comes long before the socket's 60 s timeout."""
    url = engine.url
    wait_for(lambda: _metric(url, "vllm:num_requests_running") == 0, 20, "idle")
    assert _post(url + "/admin/fault", {"slowdown": 1000})[0] == 200
    body = {"model": MODEL, "prompt": "word " * 8000, "max_tokens": 1}
    try:
        with connect(url, timeout_s=60) as sock:
            sock.sendall(request("POST", "/v1/completions", JSON, json.dumps(body).encode()))
            wait_for(lambda: _metric(url, "vllm:num_requests_running") == 1, 20, "its step")
            assert _post(url + "/admin/fault", {})[0] == 200
            status, _, answer = parse(read_all(sock))
    finally:
        _post(url + "/admin/fault", {})
    assert status == 200 and answer["usage"]["completion_tokens"] == 1, answer


# -- 2. kv_transfer_params: the pull goes to a host and a port, nothing else -------------


def _decode_request(**params: Any) -> dict[str, Any]:
    pull = {"do_remote_prefill": True, "remote_request_id": "r1", "remote_engine_id": "e1"}
    return {**COMPLETION, "kv_transfer_params": {**pull, **params}}


@pytest.mark.parametrize(
    ("host", "port"),
    [
        ("127.0.0.1:{port}/admin/fault?", 8000),  # a path into the engine itself
        ("127.0.0.1/admin/fault#", 8000),
        ("user@127.0.0.1", 8000),
        ("127.0.0.1?x=1", 8000),
        ("[::1", 8000),
        ("[::1]", 8000),
        ("fe80::1%eth0", 8000),
        ("prefill\r\nX-Injected: 1", 8000),
        ("prefill host", 8000),
        ("-prefill", 8000),
        ("127.0.0.1", 99999),
        ("127.0.0.1", -1),
        ("127.0.0.1", 0),
        ("127.0.0.1", 10**30),
    ],
)
def test_a_pull_address_that_is_no_host_and_port_is_a_400(
    engine: Proc, host: str, port: int
) -> None:
    own_port = address(engine.url)[1]
    body = _decode_request(remote_host=host.format(port=own_port), remote_port=port)
    error = _assert_error(_post(engine.url + "/v1/completions", body), 400, "kv_transfer_params")
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_a_valid_pull_address_is_tried(engine: Proc, host: str) -> None:
    """A host name or IP literal (IPv6 too) passes; nothing listens there: 502."""
    body = _decode_request(remote_host=host, remote_port=free_port())
    error = _assert_error(_post(engine.url + "/v1/completions", body), 502, None)
    assert error["code"] == "kv_transfer_failed"


# -- 3. bodies their Content-Encoding does not decode --------------------------------------


@pytest.mark.parametrize(
    ("encoding", "status", "code"),
    [("gzip", 400, "bad_body"), ("deflate", 400, "bad_body"), ("br", 415, None)],
)
def test_a_body_its_content_encoding_cannot_decode_is_json(
    engine: Proc, encoding: str, status: int, code: str | None
) -> None:
    headers = {**JSON, "Content-Encoding": encoding}
    error = _assert_error(
        _post(engine.url + "/v1/completions", b"not compressed", headers), status, None
    )
    assert code is None or error["code"] == code


@pytest.mark.parametrize(
    ("encoding", "compress"), [("gzip", gzip.compress), ("deflate", zlib.compress)]
)
def test_a_compressed_body_is_read(engine: Proc, encoding: str, compress: Any) -> None:
    data = compress(json.dumps(COMPLETION).encode())
    status, _, body = _post(
        engine.url + "/v1/completions", data, {**JSON, "Content-Encoding": encoding}
    )
    assert status == 200, body


# -- 4. slow clients: head and body deadlines ----------------------------------------------


def test_a_body_that_stops_arriving_is_a_408_and_the_connection_closes(
    quick_engine: Proc,
) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 53\r\n\r\n"
    with connect(quick_engine.url) as sock:
        sock.sendall(head + b'{"model": "llama-3.')  # 20 of the 53 bytes, then nothing
        answer = read_all(sock)  # returns once the engine closes
    status, headers, body = parse(answer)
    assert status == 408 and headers["content-type"].startswith("application/json"), answer
    assert body["error"]["code"] == "body_timeout"


@pytest.mark.parametrize(
    "head", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b"GET /hea"]
)
def test_a_head_that_never_ends_is_closed(quick_engine: Proc, head: bytes) -> None:
    with connect(quick_engine.url) as sock:
        sock.sendall(head)
        assert read_all(sock) == b""  # closed, never answered: there is no request


def test_requests_in_time_are_served_by_the_quick_engine(quick_engine: Proc) -> None:
    assert _post(quick_engine.url + "/v1/completions", COMPLETION)[0] == 200


# -- 5. sampling fields vLLM refuses ----------------------------------------------------------

_CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/completions", {"temperature": "hot"}, "temperature"),
        ("/v1/completions", {"temperature": -0.5}, "temperature"),
        ("/v1/completions", {"top_p": 5}, "top_p"),
        ("/v1/completions", {"top_p": 0}, "top_p"),
        ("/v1/completions", {"logprobs": "x"}, "logprobs"),
        ("/v1/completions", {"logprobs": -2}, "logprobs"),
        ("/v1/completions", {"stop": 123}, "stop"),
        ("/v1/completions", {"stop": ["a", 1]}, "stop"),
        ("/v1/completions", {"seed": "x"}, "seed"),
        ("/v1/completions", {"seed": 2**63}, "seed"),
        ("/v1/completions", {"prompt": [-1]}, "prompt"),
        ("/v1/completions", {"prompt": [2**63]}, "prompt"),
        ("/v1/completions", {"prompt": [1, 128256]}, "prompt"),  # Llama 3's vocabulary ends
        ("/v1/chat/completions", {"logprobs": "x"}, "logprobs"),
        ("/v1/chat/completions", {"temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {"top_p": 1.5}, "top_p"),
    ],
)
def test_sampling_fields_vllm_refuses_are_a_400_naming_them(
    engine: Proc, path: str, fields: dict[str, Any], param: str
) -> None:
    base = COMPLETION if path == "/v1/completions" else {**_CHAT, "max_tokens": 1}
    _assert_error(_post(engine.url + path, {**base, **fields}), 400, param)


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/completions", {"temperature": 0, "top_p": 1, "seed": -1, "stop": "a"}),
        ("/v1/completions", {"logprobs": 0, "stop": ["a", "b"], "seed": 2**63 - 1}),
        ("/v1/completions", {"logprobs": -1, "temperature": 2.5, "top_p": 0.01}),
        ("/v1/completions", {"logprobs": True, "prompt": [0, 128255]}),
        ("/v1/chat/completions", {"logprobs": True, "temperature": None, "stop": None}),
        # vLLM takes any role (its CustomChatCompletionMessageParam); templates decide
        ("/v1/chat/completions", {"messages": [{"role": "narrator", "content": "hi"}]}),
    ],
)
def test_sampling_fields_vllm_takes_are_served(
    engine: Proc, path: str, fields: dict[str, Any]
) -> None:
    base = COMPLETION if path == "/v1/completions" else {**_CHAT, "max_tokens": 1}
    status, _, body = _post(engine.url + path, {**base, **fields})
    assert status == 200, body


# -- 6. what aiohttp's parser refuses: JSON that quotes nothing -----------------------------

SECRET = "sk-quoted-back-9d2e"


@pytest.mark.parametrize(
    "garbage",
    [
        f"G\x01T /{SECRET} HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: x{SECRET}\r\n\r\n".encode(),
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        f"{SECRET}\r\n".encode(),
        f"GET /{SECRET}{'a' * 9000} HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + SECRET.encode() + b"\r\n\r\n",
    ],
    ids=["method", "content-length", "chunk-size", "url-too-long", "tls-hello"],
)
def test_what_the_http_parser_refuses_is_json_quoting_nothing(engine: Proc, garbage: bytes) -> None:
    answer = exchange(engine.url, garbage)
    status, headers, body = parse(answer)
    assert status == 400 and headers["content-type"].startswith("application/json"), answer
    assert body["error"]["code"] == "invalid_http"
    assert SECRET.encode() not in answer


def test_an_unknown_expectation_is_a_json_417(engine: Proc) -> None:
    data = json.dumps(COMPLETION).encode()
    answer = exchange(
        engine.url, request("POST", "/v1/completions", {**JSON, "Expect": "foo"}, data)
    )
    status, headers, body = parse(answer)
    assert status == 417 and headers["content-type"].startswith("application/json"), answer
    assert body["error"]["code"] == "expectation_failed"


def test_expect_100_continue_is_still_served(engine: Proc) -> None:
    data = json.dumps(COMPLETION).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n"
    )
    with connect(engine.url) as sock:
        sock.sendall(head.encode())  # the body only once the engine asks for it
        assert sock.recv(64) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(data)
        assert parse(read_all(sock))[0] == 200
