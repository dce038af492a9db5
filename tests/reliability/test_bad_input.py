"""Bad input against a running `isocost serve`: fuzzing, garbage, slow clients, reloads.

The gateway's own OpenAPI document (docs/openapi.yaml) drives schemathesis; hypothesis
generates arbitrary JSON bodies; raw sockets send what no HTTP library would. Every answer
must come from the gateway as a 4xx OpenAI error, never a 5xx it made itself (the engines
behind it are healthy, so a 5xx could only be the gateway's).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from cluster import (
    ADMIN,
    ADMIN_TOKEN,
    API_KEY,
    AUTH,
    MODEL,
    ROOT,
    Cluster,
    config_text,
    http,
    replica_rows,
    start_cluster,
)
from gateway_harness import wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SCHEMA = schemathesis.openapi.from_path(str(ROOT / "docs" / "openapi.yaml"))
MAX_BODY_BYTES = 65536


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # short answers keep a few hundred fuzzed requests within seconds
    cluster = start_cluster(tmp_path_factory.mktemp("bad-input"), 2, max_tokens=32)
    try:
        yield cluster
    finally:
        cluster.close()


def assert_gateway_error(status: int, body: Any) -> None:
    assert status < 500, body
    if status >= 400:
        assert set(body["error"]) >= {"message", "type", "code"}


@SCHEMA.parametrize()
@settings(
    max_examples=12,
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_schemathesis_finds_no_gateway_5xx(case: Any, cluster: Cluster) -> None:
    token = ADMIN_TOKEN if case.path.startswith("/admin") else API_KEY
    response = case.call(
        base_url=cluster.gateway.url, headers={"Authorization": f"Bearer {token}"}, timeout=30
    )
    assert response.status_code < 500, (case.method, case.path, response.text[:300])
    if response.status_code >= 400:
        assert "error" in response.json()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "model": st.just(MODEL) | st.text(),
        "prompt": JSON,
        "messages": JSON,
        "max_tokens": st.integers(-5, 40) | JSON,
        "stream": JSON,
        "stream_options": JSON,
        "user": JSON,
    },
)


@given(body=FIELDS | JSON, chat=st.booleans())
@settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
def test_generated_bodies_get_4xx_or_an_answer(cluster: Cluster, body: Any, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, _, answer = http("POST", cluster.gateway.url + path, json.dumps(body).encode(), AUTH)
    assert_gateway_error(status, answer)


@pytest.mark.parametrize(
    "body",
    [
        b"\xff\xfe\x00garbage",
        b'{"model": "' + MODEL.encode() + b'", "prompt": "\xc3\x28"}',  # invalid UTF-8
        bytes(range(256)) * 4,
        b"",
        b"{" * 5000,  # deep nesting
        b'{"model": 1e999999}',
    ],
)
def test_binary_garbage_and_invalid_utf8(cluster: Cluster, body: bytes) -> None:
    status, _, answer = http("POST", cluster.gateway.url + "/v1/completions", body, AUTH)
    assert 400 <= status < 500
    assert_gateway_error(status, answer)


def _raw(url: str, data: bytes, timeout_s: float = 10) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_oversized_bodies_are_refused_with_413(cluster: Cluster) -> None:
    big = json.dumps({"model": MODEL, "prompt": "x" * (MAX_BODY_BYTES + 10)}).encode()
    status, _, answer = http("POST", cluster.gateway.url + "/v1/completions", big, AUTH)
    assert status == 413 and answer["error"]["code"] == "request_too_large"
    # chunked, so the gateway cannot know the size up front
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nTransfer-Encoding: chunked\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(c), c) for c in [big[i : i + 8192] for i in range(0, len(big), 8192)]
    )
    answer_bytes = _raw(cluster.gateway.url, head + chunks + b"0\r\n\r\n")
    assert answer_bytes.startswith(b"HTTP/1.1 413"), answer_bytes[:200]
    # a Content-Length that lies about a huge body is refused before it is read
    lying = head.replace(b"Transfer-Encoding: chunked", b"Content-Length: 999999999")
    host, port = cluster.gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(lying)  # and no body at all: the answer must not wait for it
        answer = b""
        while chunk := sock.recv(65536):  # nor the connection's end (a 10 s linger: timeout)
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and answer.endswith(b"}"), answer[:200]


def test_slow_body_times_out_with_408(cluster: Cluster) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    host, port = cluster.gateway.url.removeprefix("http://").split(":")
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(head + body[:3])  # then nothing: body_timeout_ms is 1000 in this config
        answer = b""
        while chunk := sock.recv(65536):  # closed with the answer, not after a 10 s linger
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408") and answer.endswith(b"}"), answer[:200]


def test_slow_headers_are_cut_off(cluster: Cluster) -> None:
    """Headers trickling in (slowloris) get a 408 and a closed connection, not a hold."""
    host, port = cluster.gateway.url.removeprefix("http://").split(":")
    received = b""
    with socket.create_connection((host, int(port)), timeout=1) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        deadline = time.monotonic() + 5  # five times the body timeout
        closed = False
        while time.monotonic() < deadline and not closed:
            try:
                sock.sendall(b"X-Slow: y\r\n")
                chunk = sock.recv(4096)
                received += chunk
                closed = chunk == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
        assert closed
    assert received.startswith(b"HTTP/1.1 408"), received[:200]


@pytest.mark.parametrize(
    "header",
    [
        b"X-Request-Id: a\rX-Injected: 1",  # bare CR
        b"X-Session-Id: a\nX-Injected: 1",  # bare LF folds into a second header
        b"X-Session-Id: \x00\x01\x7f",
        b"X-Session-Id: " + b"s" * 9000,  # past aiohttp's field limit
        b"X-Priority: 1\r\n X-Folded: continuation",
        b"X-Deadline-Ms: -1",
        b"X-Deadline-Ms: nan",
        b"X-Deadline-Ms: 1e-300",  # lost in the clock's rounding: once a 500
        b"X-Llm-D-Slo-Ttft-Ms: 1e-20",
        b"X-Tpot-Ms: 5e-324",
        b"X-Priority: 99999999999999999999999",
    ],
)
def test_header_injection_and_abuse(cluster: Cluster, header: bytes) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n".encode()
        + header
        + b"\r\nConnection: close\r\n\r\n"
        + body
    )
    answer = _raw(cluster.gateway.url, request)
    status = int(answer.split(b" ", 2)[1])
    assert status < 500, answer[:300]
    head = answer.split(b"\r\n\r\n", 1)[0].lower()
    assert b"x-injected" not in head and b"x-folded" not in head


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("/v1/completions", AUTH),
        ("/v1/chat/completions", AUTH),
        ("/v1/route", AUTH),
        ("/admin/policy", ADMIN),
    ],
)
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_body_that_does_not_decode_gets_400(
    cluster: Cluster, path: str, headers: dict[str, str], encoding: str
) -> None:
    """A Content-Encoding the body is not in: aiohttp raises while the body is read."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "policy": "equal_cost"}).encode()
    status, _, answer = http(
        "POST", cluster.gateway.url + path, body, {**headers, "Content-Encoding": encoding}
    )
    assert status == 400, answer
    assert answer["error"]["code"] == "bad_body"


@pytest.mark.parametrize("path", ["/v1/completions", "/admin/policy"])
def test_an_unknown_expectation_gets_a_json_417(cluster: Cluster, path: str) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
    status, _, answer = http("POST", cluster.gateway.url + path, body, {**AUTH, "Expect": "foo"})
    assert status == 417, answer
    assert answer["error"]["code"] == "expectation_failed"


def test_many_session_ids_stay_served(cluster: Cluster) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    for i in range(40):
        session = f"s-{i}-" + "é" * (i % 5) + "\u202e"
        status, _, _ = http(
            "POST",
            cluster.gateway.url + "/v1/completions",
            body,
            {**AUTH, "X-Session-Id": session.encode().decode("latin-1")},
        )
        assert status == 200


def test_concurrent_config_reloads_keep_serving(cluster: Cluster) -> None:
    """Writers race each other rewriting the file (some writes invalid) under traffic."""
    urls = cluster.engine_urls
    variants = [
        config_text(urls, policy="round_robin", max_tokens=32),
        config_text(urls, policy="least_request", max_tokens=32),
        "pools: [{model: " + MODEL + ", replicas: [{url: 'not a url'}]}]",  # rejected
        "{{{ not yaml",  # rejected
        config_text(urls[:1], policy="equal_cost", max_tokens=32),
    ]
    statuses: list[int] = []
    stop = threading.Event()

    def traffic() -> None:
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
        while not stop.is_set():
            statuses.append(http("POST", cluster.gateway.url + "/v1/completions", body, AUTH)[0])

    def writer(offset: int) -> None:
        for i in range(30):
            cluster.config.write_text(variants[(i + offset) % len(variants)])
            time.sleep(0.02)

    threads = [threading.Thread(target=traffic) for _ in range(2)]
    writers = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
    for thread in threads + writers:
        thread.start()
    for thread in writers:
        thread.join()
    final = config_text(urls, policy="round_robin", max_tokens=32)
    cluster.config.write_text(final)

    def applied() -> bool:
        rows = replica_rows(cluster.gateway).values()
        _, _, snap = http("GET", cluster.gateway.url + "/admin/snapshot", None, ADMIN)
        healthy = len(rows) == 2 and all(r["state"] == "healthy" for r in rows)
        return healthy and bool(snap["pools"][0]["policy"] == "round_robin")

    wait_for(applied, what="the final config applied")
    stop.set()
    for thread in threads:
        thread.join()
    assert statuses and set(statuses) == {200}
    assert http("GET", cluster.gateway.url + "/health")[0] == 200
