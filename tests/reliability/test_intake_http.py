"""The HTTP server of `isocost serve` against slow and eager clients, over raw sockets.

Every request of a kept-alive connection gets the header deadline (``limits.body_timeout_ms``,
1 s here), an idle connection is closed after ``limits.keepalive_timeout_ms``, the soft fd
limit is raised to the hard one at start, and ``Expect: 100-continue`` is answered only
once the key and the declared length passed.
"""

from __future__ import annotations

import json
import resource
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import rawhttp
from fake_upstream import start_fake_upstream
from gateway_harness import gateway_config, http, log_records, wait_for
from isocost_procs import Proc, start_isocost

API_KEY = "sk-http-2d8c4f60"
ADMIN_TOKEN = "admin-http-6b1a"
MAX_BODY = 64 * 1024
PATIENCE_S = 30  # far beyond every deadline configured here


@dataclass
class Setup:
    patient: Proc  # keep-alive 60 s: only the header deadline can end a trickle
    brisk: Proc  # keep-alive 0.5 s
    upstream: Proc
    log: Path


def _gateway(tmp: Path, name: str, upstream: str, keepalive_ms: int) -> Proc:
    config = tmp / f"{name}.yaml"
    config.write_text(
        gateway_config(
            [upstream],
            model="fake-model",
            admin_token=ADMIN_TOKEN,
            api_key=API_KEY,
            replica_fields="cost_model: llama-3.1-8b",
            max_body_bytes=MAX_BODY,
            limits=f"  keepalive_timeout_ms: {keepalive_ms}",
        )
    )
    with (tmp / f"{name}.log").open("a") as log:
        return start_isocost(["serve", "--config", str(config), "--port", "0"], stderr=log)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("intake_http")
    upstream = start_fake_upstream()
    # Start the gateways with a low soft fd limit: they must raise it themselves.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
    try:
        patient = _gateway(tmp, "patient", upstream.url, 60_000)
        brisk = _gateway(tmp, "brisk", upstream.url, 500)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        yield Setup(patient, brisk, upstream, tmp / "patient.log")
    finally:
        for proc in (patient, brisk, upstream):
            proc.stop()


def _completion() -> bytes:
    return json.dumps({"model": "fake-model", "prompt": "hi", "max_tokens": 2}).encode()


def _read_answer(sock: socket.socket) -> bytes:
    """One whole answer (head and Content-Length body) off a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(rawhttp.parse(head + b"\r\n\r\n")[1].get("content-length", "0"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _keepalive_request(kind: str) -> bytes:
    if kind == "health":
        return b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    body = _completion()
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def _trickle_until_answered(sock: socket.socket, start: bytes) -> bytes:
    """Send ``start``, then one header line every 0.2 s; what the server answers (b"" if
    it closed), or fail after PATIENCE_S without an answer."""
    sock.sendall(start)
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:
        if select.select([sock], [], [], 0.2)[0]:
            return rawhttp.read_all(sock)
        try:
            sock.sendall(b"X-Trickle: 1\r\n")
        except (BrokenPipeError, ConnectionResetError):
            return b""
    raise AssertionError(f"headers trickled for {PATIENCE_S} s without a 408")


@pytest.mark.parametrize("earlier", [["health"], ["completion"], ["health", "completion"]])
@pytest.mark.parametrize(
    "start", [b"GET /health HTTP/1.1\r\n", b"POST /v1/completions HTTP/1.1\r\n"]
)
def test_every_request_on_a_kept_alive_connection_has_a_header_deadline(
    setup: Setup, earlier: list[str], start: bytes
) -> None:
    with rawhttp.connect(setup.patient.url) as sock:
        for kind in earlier:
            sock.sendall(_keepalive_request(kind))
            assert _read_answer(sock).startswith(b"HTTP/1.1 200")
        answer = _trickle_until_answered(sock, start)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert http("GET", setup.patient.url + "/health")[0] == 200


def test_a_trickled_first_request_still_gets_408(setup: Setup) -> None:
    with rawhttp.connect(setup.patient.url) as sock:
        answer = _trickle_until_answered(sock, b"GET /health HTTP/1.1\r\n")
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]


def test_idle_kept_alive_connections_are_closed_after_the_keepalive_timeout(
    setup: Setup,
) -> None:
    with rawhttp.connect(setup.brisk.url, timeout_s=PATIENCE_S) as sock:
        sock.sendall(_keepalive_request("health"))
        assert _read_answer(sock).startswith(b"HTTP/1.1 200")
        assert sock.recv(1) == b""  # closed by the server (a timeout raises instead)


def _soft_fd_limit(pid: int) -> tuple[str, str]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return soft, hard
    raise AssertionError("no fd limit in /proc")


def test_the_soft_fd_limit_is_raised_to_the_hard_limit(setup: Setup) -> None:
    soft, hard = _soft_fd_limit(setup.patient.pid)
    assert soft == hard, (soft, hard)
    entries = log_records(setup.log)
    assert any(e.get("event") == "fd_limit" and str(e.get("soft")) == soft for e in entries)


def test_more_idle_connections_than_the_old_soft_limit_leave_the_gateway_up(
    setup: Setup,
) -> None:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft < 700:
        pytest.skip(f"this test process may open only {soft} files")
    sockets = [rawhttp.connect(setup.patient.url) for _ in range(300)]  # 256 at start
    try:
        for sock in sockets:
            sock.sendall(b"GET /health HTTP/1.1\r\n")  # and never finish the headers
        wait_for(lambda: http("GET", setup.patient.url + "/health")[0] == 200, 20, "/health")
    finally:
        for sock in sockets:
            sock.close()


def _expect_continue(
    setup: Setup, headers: str, length: int, path: str = "/v1/completions", *, refused: bool
) -> bytes:
    """Send only the headers of a POST with ``Expect: 100-continue``; the first bytes back,
    or, ``refused``, all bytes until the gateway closes the connection, which it must do
    at once: the client sends no body, and a connection kept would read the client's next
    request as that body (or, with nothing coming, linger 10 s)."""
    with rawhttp.connect(setup.patient.url, timeout_s=LINGER_BOUND_S) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
            + f"{headers}Content-Length: {length}\r\nExpect: 100-continue\r\n\r\n".encode()
        )
        return rawhttp.read_all(sock) if refused else sock.recv(65536)


LINGER_BOUND_S = 5  # under aiohttp's 10 s of lingering on a body never sent


@pytest.mark.parametrize(
    ("headers", "length", "status"),
    [
        ("", 100, 401),
        ("Authorization: Bearer sk-wrong\r\n", 100, 401),
        (f"Authorization: Bearer {API_KEY}\r\n", MAX_BODY + 1, 413),
        (f"Authorization: Bearer {API_KEY}\r\n", 10**12, 413),
    ],
)
def test_expect_100_continue_is_not_answered_before_the_key_and_size_checks(
    setup: Setup, headers: str, length: int, status: int
) -> None:
    answer = _expect_continue(setup, headers, length, refused=True)
    assert answer.startswith(f"HTTP/1.1 {status}".encode()), answer[:100]
    assert b"\r\nConnection: close\r\n" in answer and answer.endswith(b"}"), answer


ADMIN_POSTS = ["/admin/replicas", "/admin/policy", "/admin/replicas/x/drain"]


@pytest.mark.parametrize("path", ADMIN_POSTS)
@pytest.mark.parametrize("headers", ["", "Authorization: Bearer wrong-token\r\n"])
def test_expect_100_continue_on_the_admin_api_waits_for_the_token(
    setup: Setup, path: str, headers: str
) -> None:
    answer = _expect_continue(setup, headers, 100, path, refused=True)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:100]
    assert b"\r\nConnection: close\r\n" in answer and answer.endswith(b"}"), answer


@pytest.mark.parametrize("path", ADMIN_POSTS)
def test_expect_100_continue_on_the_admin_api_with_the_token_gets_continue(
    setup: Setup, path: str
) -> None:
    headers = f"Authorization: Bearer {ADMIN_TOKEN}\r\n"
    first = _expect_continue(setup, headers, 100, path, refused=False)
    assert first.startswith(b"HTTP/1.1 100 Continue"), first[:100]


def test_expect_100_continue_with_a_good_key_gets_continue_then_the_answer(
    setup: Setup,
) -> None:
    body = _completion()
    with rawhttp.connect(setup.patient.url) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n".encode()
            + b"Expect: 100-continue\r\nConnection: close\r\n\r\n"
        )
        interim = sock.recv(65536)
        assert interim.startswith(b"HTTP/1.1 100 Continue"), interim[:100]
        sock.sendall(body)
        answer = interim + rawhttp.read_all(sock)
    status, _, parsed = rawhttp.parse(answer)
    assert status == 200, parsed
