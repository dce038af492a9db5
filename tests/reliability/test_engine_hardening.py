"""``isocost engine`` against clients that leave and requests its HTTP layer refuses.

A client that closes its connection aborts its request, streamed or not: the engine frees
its KV blocks and counts it as ``finished_reason="abort"`` (a raw socket, so nothing but
the close tells the engine). Every refusal, aiohttp's own included (body over the size
limit, unknown path, wrong method), is OpenAI error JSON, never plain text.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from cluster import MODEL, start_engine
from gateway_harness import http, wait_for
from isocost_procs import Proc, start_isocost
from prometheus_client.parser import text_string_to_metric_families


@pytest.fixture(scope="module")
def engine() -> Iterator[Proc]:
    proc = start_engine()
    try:
        yield proc
    finally:
        proc.stop()


def _metrics(url: str) -> dict[str, float]:
    """The engine's samples by name, ``[finished_reason]`` appended where it has one."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            reason = sample.labels.get("finished_reason")
            out[sample.name + (f"[{reason}]" if reason else "")] = sample.value
    return out


def _raw_request(
    url: str, path: str, body: dict[str, object], receive_buffer: int | None = None
) -> socket.socket:
    """Send one POST on a fresh socket (its receive buffer that small, if given) and
    return it unread."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(10)
    sock.connect((parts.hostname, parts.port))
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


_LONG = {"max_tokens": 100_000, "ignore_eos": True}  # minutes of decode: only an abort ends it
_REQUESTS = {
    "completion": ("/v1/completions", {"model": MODEL, "prompt": "never mind", **_LONG}),
    "chat": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "never mind"}], **_LONG},
    ),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", sorted(_REQUESTS))
def test_a_client_that_leaves_aborts_its_request(engine: Proc, kind: str, stream: bool) -> None:
    path, body = _REQUESTS[kind]
    wait_for(lambda: _metrics(engine.url)["vllm:num_requests_running"] == 0, 20, "idle")
    before = _metrics(engine.url)["vllm:request_success_total[abort]"]
    sock = _raw_request(engine.url, path, {**body, "stream": stream})
    try:
        wait_for(
            lambda: _metrics(engine.url)["vllm:num_requests_running"] == 1,
            20,
            "the request running",
        )
    finally:
        sock.close()
    seen: list[dict[str, float]] = []

    def aborted() -> bool:
        seen.append(_metrics(engine.url))
        return seen[-1]["vllm:request_success_total[abort]"] == before + 1

    wait_for(aborted, 20, "the request aborted", state=lambda: seen[-1])
    wait_for(lambda: _metrics(engine.url)["vllm:num_requests_running"] == 0, 20, "its slot freed")
    assert _metrics(engine.url)["vllm:kv_cache_usage_perc"] == 0


@pytest.fixture(scope="module")
def fast_engine() -> Iterator[Proc]:
    """Events fast enough to fill a stalled client's socket buffers in seconds, tokens
    slow enough that 100,000 of them last over a minute."""
    proc = start_engine(0, "--time-scale", "0.04", "--write-timeout", "1")
    try:
        yield proc
    finally:
        proc.stop()


def test_a_client_that_stops_reading_is_aborted(fast_engine: Proc) -> None:
    """It stays connected but reads nothing: once a write has waited ``--write-timeout``
    the engine drops it and frees its slot, long before its 100,000 tokens would end."""
    url = fast_engine.url
    path, body = _REQUESTS["completion"]
    wait_for(lambda: _metrics(url)["vllm:num_requests_running"] == 0, 20, "idle")
    before = _metrics(url)
    sock = _raw_request(url, path, {**body, "stream": True}, receive_buffer=4096)
    try:
        seen: list[dict[str, float]] = []

        def aborted() -> bool:
            seen.append(_metrics(url))
            return seen[-1]["vllm:request_success_total[abort]"] == (
                before["vllm:request_success_total[abort]"] + 1
            )

        wait_for(aborted, 60, "the stalled stream aborted", state=lambda: seen[-1])
        after = seen[-1]
        assert after["vllm:num_requests_running"] == 0
        finished = ("stop", "length")
        assert all(
            after[f"vllm:request_success_total[{r}]"] == before[f"vllm:request_success_total[{r}]"]
            for r in finished
        )
    finally:
        sock.close()


def _assert_openai_error(status: int, headers: dict[str, str], body: object, code: str) -> None:
    assert headers.get("Content-Type", "").startswith("application/json"), headers
    assert isinstance(body, dict) and body["error"]["code"] == code, body
    assert body["error"]["type"] and body["error"]["message"], body


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_over_the_limit_is_a_json_413(engine: Proc, path: str) -> None:
    big = json.dumps({"model": MODEL, "prompt": "x" * (2 << 20)}).encode()
    headers = {"Content-Type": "application/json"}
    status, got, body = _http_any(engine.url + path, "POST", big, headers)
    assert status == 413
    _assert_openai_error(status, got, body, "request_too_large")


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/v1/nothing", 404, "not_found"),
        ("POST", "/v1/embeddings", 404, "not_found"),
        ("GET", "/v1/completions", 405, "method_not_allowed"),
        ("PUT", "/metrics", 405, "method_not_allowed"),
        ("DELETE", "/v1/models", 405, "method_not_allowed"),
    ],
)
def test_unknown_paths_and_methods_are_json_errors(
    engine: Proc, method: str, path: str, status: int, code: str
) -> None:
    got_status, headers, body = _http_any(engine.url + path, method, None, {})
    assert got_status == status
    _assert_openai_error(got_status, headers, body, code)


def _http_any(
    url: str, method: str, body: bytes | None, headers: dict[str, str]
) -> tuple[int, dict[str, str], object]:
    """``http``, but a body that is not JSON comes back as its text (the failure to see)."""
    try:
        return http(method, url, body, headers)
    except json.JSONDecodeError:
        request = urllib.request.Request(url, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, dict(response.headers), response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read().decode()


def test_the_engine_logs_one_json_object_per_line_and_no_secret(tmp_path: Path) -> None:
    secret = "sk-engine-log-7c1f"
    log_path = tmp_path / "engine.log"
    with log_path.open("w") as log:
        proc = start_isocost(["engine", "--port", "0", "--model", MODEL], stderr=log)
    try:
        host, port = urlsplit(proc.url).hostname or "", urlsplit(proc.url).port or 0
        for garbage in (
            f"GET /health HTTP/1.1\r\nAuthorization: Bearer {secret}\x01\r\n\r\n".encode(),
            f"POST /v1/completions HTTP/1.1\r\nContent-Length: x{secret}\r\n\r\n".encode(),
            b"\x16\x03\x01 not http at all " + secret.encode() + b"\r\n\r\n",
        ):
            with socket.create_connection((host, port), timeout=10) as sock:
                sock.sendall(garbage)
                sock.settimeout(10)
                while sock.recv(65536):
                    pass
        wait_for(lambda: log_path.read_text().strip() != "", 20, "the refusals logged")
    finally:
        proc.stop()
    lines = [line for line in log_path.read_text().splitlines() if line.strip()]
    assert lines
    for line in lines:
        assert isinstance(json.loads(line), dict), line
        assert secret not in line, line
