"""The forwarding path against replicas and clients that misbehave, through real processes.

Replicas are fake upstreams (tests/support/fake_upstream.py) whose mode each test sets:
streams that break in every way a stream can, answers that are not what was asked for,
answers too large to buffer. Clients are raw sockets where an HTTP library would hide the
case: one that leaves, one that stops reading, one that half-closes after its request.
Every outcome is checked where an operator would see it: the answer, the gateway's log
line and ``isocost_requests_total``, the replica's breaker in the admin API, and what the
upstream saw (``client_left``: the gateway closed its connection).
"""

from __future__ import annotations

import json
import re
import socket
import struct
import threading
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fake_upstream import received, set_mode, start_fake_upstream
from gateway_harness import gateway_config, http, log_events, wait_for
from isocost_procs import Proc, start_isocost

MODEL = "llama-3.1-8b"
API_KEY = "sk-proxy-5d2e81"
ADMIN = {"Authorization": "Bearer admin-proxy-77c0"}
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


@dataclass
class Rig:
    """A gateway over fake upstreams, logging to a file."""

    gateway: Proc
    upstreams: list[Proc]
    log: Path
    procs: list[Proc] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.gateway.url

    def log_lines(self, event: str) -> list[dict[str, Any]]:
        return log_events(self.log, event)

    def request_log(self, request_id: str) -> list[dict[str, Any]]:
        return [line for line in self.log_lines("request") if line["request_id"] == request_id]

    def replica(self, upstream: Proc) -> dict[str, Any]:
        status, _, body = http("GET", self.url + "/admin/replicas", headers=ADMIN)
        assert status == 200, body
        (row,) = [row for row in body["replicas"] if row["url"] == upstream.url]
        return row

    def requests_total(self, status: int) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        pattern = rf'^isocost_requests_total\{{[^}}]*status="{status}"[^}}]*\}} (\S+)$'
        return sum(float(value) for value in re.findall(pattern, text, re.MULTILINE))

    def close(self) -> None:
        for proc in [self.gateway, *self.upstreams]:
            proc.stop()


def start_rig(
    tmp: Path,
    num_upstreams: int,
    *,
    limits: str = "",
    health: str = "",
    fields: str = "",
    pool_fields: str = "",
) -> Rig:
    upstreams: list[Proc] = []
    try:
        upstreams = [start_fake_upstream() for _ in range(num_upstreams)]
        config = gateway_config(
            [u.url for u in upstreams],
            model=MODEL,
            admin_token="admin-proxy-77c0",
            api_key=API_KEY,
            policy="round_robin",
            replica_fields=f"gpu: a100-80g{fields}",
            limits=f"  idle_timeout_ms: 1500\n{limits}",
            health=health,
            pool_fields=pool_fields,
        )
        path, log = tmp / "gateway.yaml", tmp / "gateway.log"
        path.write_text(config)
        with log.open("a") as sink:
            gateway = start_isocost(["serve", "--config", str(path), "--port", "0"], stderr=sink)
    except BaseException:
        for upstream in upstreams:
            upstream.stop()
        raise
    return Rig(gateway, upstreams, log)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    rig = start_rig(tmp_path, 1)
    try:
        yield rig
    finally:
        rig.close()


def completion(*, stream: bool, max_tokens: int = 8) -> bytes:
    return json.dumps(
        {"model": MODEL, "prompt": "hello", "max_tokens": max_tokens, "stream": stream}
    ).encode()


def post(rig: Rig, *, stream: bool, request_id: str) -> tuple[int, dict[str, str], bytes]:
    """One completion through the gateway; status, headers and the raw body."""
    headers = {**AUTH, "X-Request-Id": request_id}
    request = urllib.request.Request(
        rig.url + "/v1/completions", data=completion(stream=stream), headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def sse_payloads(raw: bytes) -> list[Any]:
    """The data payloads of a stream, parsed (``[DONE]`` as the string)."""
    payloads: list[Any] = []
    for line in raw.decode().splitlines():
        if line.startswith("data:"):
            data = line[len("data:") :].strip()
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


# -- streams that break after they began (item 9) ------------------------------------------

BROKEN_STREAMS = {
    "clean end without [DONE]": {"completion": "no_done"},
    "end mid-event": {"completion": "truncated"},
    "end before any finish_reason": {"completion": "truncated", "tail": ""},
    "reset mid-stream": {"completion": "reset"},
    "a line that is not SSE": {"completion": "garbage"},
    "an event that is not JSON": {"completion": "garbage", "garbage_line": "data: {not json"},
}


@pytest.fixture
def rig_no_resume(tmp_path: Path) -> Iterator[Rig]:
    """One fake upstream, whose pool does not resume broken streams."""
    rig = start_rig(tmp_path, 1, pool_fields="    resume: off")
    try:
        yield rig
    finally:
        rig.close()


@pytest.mark.parametrize("mode", list(BROKEN_STREAMS.values()), ids=list(BROKEN_STREAMS))
def test_a_broken_stream_ends_with_an_error_event_and_counts_against_the_replica(
    rig_no_resume: Rig, mode: dict[str, Any]
) -> None:
    """With ``resume: off`` (and for every stream that cannot be resumed)."""
    rig = rig_no_resume
    (upstream,) = rig.upstreams
    set_mode(upstream.url, **mode, token_delay_s=0.3)  # the first token is relayed first
    status, _, raw = post(rig, stream=True, request_id="broken-1")
    assert status == 200  # the stream had begun: the status line was sent
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]" and raw.endswith(b"data: [DONE]\n\n"), raw[-300:]
    assert payloads[-2]["error"]["type"] == "upstream_error", payloads
    assert payloads[0]["choices"][0]["text"] == "hel"  # what came before was relayed
    assert not any(isinstance(p, dict) and "oops" in json.dumps(p) for p in payloads)
    row = rig.replica(upstream)
    assert row["last_error"].startswith("mid-stream"), row
    assert row["success_rate"] == 0.0, row
    wait_for(lambda: bool(rig.request_log("broken-1")), what="the request's log line")
    (line,) = rig.request_log("broken-1")
    assert line["status"] == 502 and line["error"], line
    assert [e["request_id"] for e in rig.log_lines("stream_error")] == ["broken-1"]
    assert rig.requests_total(502) == 1


def test_a_whole_stream_is_relayed_and_counts_as_a_success(rig: Rig) -> None:
    (upstream,) = rig.upstreams
    set_mode(upstream.url, completion="ok", stream_tokens=50, token_bytes=5)
    status, _, raw = post(rig, stream=True, request_id="whole-1")
    payloads = sse_payloads(raw)
    assert status == 200 and payloads[-1] == "[DONE]" and len(payloads) == 52
    assert not any("error" in p for p in payloads[:-1])
    assert rig.replica(upstream)["success_rate"] == 1.0
    wait_for(lambda: bool(rig.request_log("whole-1")), what="the request's log line")
    assert rig.request_log("whole-1")[0]["status"] == 200


@pytest.mark.parametrize("resume", ["on", "off"])
def test_a_chat_streams_first_token_is_its_first_text_not_its_opening(
    tmp_path: Path, resume: str
) -> None:
    """An upstream that opens a chat stream with the assistant role at once and makes its
    first token 0.5 s later: the gateway's TTFT is the first token's (as its clients time
    it), and the opening is no token. With ``resume`` on, the stream goes through the
    resume ledger; off, through the plain relay."""
    rig = start_rig(tmp_path, 1, pool_fields=f"    resume: {resume}")
    try:
        (upstream,) = rig.upstreams
        set_mode(upstream.url, completion="ok", stream_tokens=4, opening_s=0.5)
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8,
            "stream": True,
        }
        headers = {**AUTH, "X-Request-Id": f"opening-{resume}"}
        request = urllib.request.Request(
            rig.url + "/v1/chat/completions", data=json.dumps(body).encode(), headers=headers
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            payloads = sse_payloads(response.read())
        assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert payloads[-1] == "[DONE]"
        wait_for(lambda: bool(rig.request_log(f"opening-{resume}")), what="the log line")
        (line,) = rig.request_log(f"opening-{resume}")
        assert line["status"] == 200 and line["output_tokens"] == 4, line
        assert line["ttft_ms"] >= 500, line
    finally:
        rig.close()


# -- replicas that answer wrong are ejected, their requests retried (item 13) --------------

BAD_REPLICAS = {
    "404 (serves another model)": ({"completion": "status", "status": 404}, False),
    "429 for everything": ({"completion": "status", "status": 429}, False),
    "500": ({"completion": "status", "status": 500}, False),
    "200 with broken JSON": ({"completion": "invalid_json"}, False),
    "200 with HTML": ({"completion": "html"}, False),
    "200 with HTML to a stream request": ({"completion": "html"}, True),
    "401 (the replica wants another key)": ({"completion": "status", "status": 401}, True),
}


@pytest.mark.parametrize(("mode", "stream"), list(BAD_REPLICAS.values()), ids=list(BAD_REPLICAS))
def test_a_bad_replica_is_ejected_and_the_client_sees_only_good_answers(
    tmp_path: Path, mode: dict[str, Any], stream: bool
) -> None:
    # a long cool-down: once ejected it stays out for the rest of the test
    rig = start_rig(tmp_path, 2, health="  window_size: 10\n  open_ms: 60000")
    try:
        good, bad = rig.upstreams
        set_mode(bad.url, **mode)
        good_name = rig.replica(good)["name"]
        for n in range(24):
            status, headers, raw = post(rig, stream=stream, request_id=f"r{n}")
            assert status == 200, raw[:300]
            assert headers["x-isocost-replica"] == good_name
            if stream:
                assert sse_payloads(raw)[-1] == "[DONE]"
            else:
                assert json.loads(raw)["choices"][0]["text"] == "hello"
        row = rig.replica(bad)
        assert row["state"] == "ejected" and row["success_rate"] < 0.5, row
        sent_to_bad = len(received(bad.url))
        assert 0 < sent_to_bad <= 12  # at most a window's worth before it was ejected
        for n in range(8):
            assert post(rig, stream=stream, request_id=f"after{n}")[0] == 200
        assert len(received(bad.url)) == sent_to_bad  # no traffic once ejected
        assert rig.requests_total(200) == 32
    finally:
        rig.close()


def test_a_clients_own_400_is_relayed_and_not_held_against_the_replica(rig: Rig) -> None:
    (upstream,) = rig.upstreams
    set_mode(upstream.url, completion="status", status=400)
    for n in range(6):
        status, _, raw = post(rig, stream=False, request_id=f"bad-request-{n}")
        assert status == 400 and json.loads(raw)["error"]["message"], raw
    row = rig.replica(upstream)
    assert row["state"] == "healthy" and row["success_rate"] == 1.0, row
    assert len(received(upstream.url)) == 6  # not retried


def test_every_replica_failing_answers_one_clean_openai_error(tmp_path: Path) -> None:
    rig = start_rig(tmp_path, 2)
    try:
        for upstream in rig.upstreams:
            set_mode(upstream.url, completion="status", status=404)
        status, _, raw = post(rig, stream=False, request_id="all-bad")
        assert status == 502 and json.loads(raw)["error"]["code"] == "upstream_error", raw
        for upstream in rig.upstreams:
            set_mode(upstream.url, completion="status", status=429)
        status, headers, raw = post(rig, stream=True, request_id="all-full")
        assert status == 503 and headers.get("Retry-After"), raw
        assert json.loads(raw)["error"]["code"] == "overloaded"
    finally:
        rig.close()


# -- answers too large to buffer (item 12) ---------------------------------------------------


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def test_a_whole_answer_over_max_response_bytes_is_502_and_never_buffered(
    tmp_path: Path,
) -> None:
    rig = start_rig(tmp_path, 1, limits="  max_response_bytes: 1048576")
    try:
        (upstream,) = rig.upstreams
        set_mode(upstream.url, completion="huge", size_bytes=900_000)
        status, _, raw = post(rig, stream=False, request_id="under-the-cap")
        assert status == 200 and len(json.loads(raw)["choices"][0]["text"]) == 900_000
        set_mode(upstream.url, completion="huge", size_bytes=40 << 20)
        before = peak_rss_bytes(rig.gateway.pid)
        results: list[tuple[int, bytes]] = []

        def one(n: int) -> None:
            status, _, raw = post(rig, stream=False, request_id=f"huge-{n}")
            results.append((status, raw))

        threads = [threading.Thread(target=one, args=(n,)) for n in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert len(results) == 3
        for status, raw in results:
            assert status == 502 and json.loads(raw)["error"]["code"] == "response_too_large"
        assert peak_rss_bytes(rig.gateway.pid) - before < 40 << 20  # not one answer held
        assert len(received(upstream.url)) == 4  # too large is not retried elsewhere
        assert rig.replica(upstream)["state"] == "healthy"
        # one stream event over the cap: the line is never buffered whole either
        set_mode(upstream.url, completion="ok", stream_tokens=1, token_bytes=4 << 20)
        status, _, raw = post(rig, stream=True, request_id="huge-event")
        assert status == 502 and json.loads(raw)["error"]["code"] == "response_too_large"
        assert len(received(upstream.url)) == 5
        assert rig.replica(upstream)["state"] == "healthy"
    finally:
        rig.close()


# -- the total timeout is a 504, retried or not ---------------------------------------------


def test_a_request_out_of_total_time_is_504_even_after_a_retry(tmp_path: Path) -> None:
    rig = start_rig(tmp_path, 2, limits="  total_timeout_ms: 1500\n  max_retries: 3")
    try:
        for upstream in rig.upstreams:
            set_mode(upstream.url, completion="hang", stall_s=30)
        for stream in (False, True):
            status, _, raw = post(rig, stream=stream, request_id=f"late-{stream}")
            assert status == 504, raw
            assert json.loads(raw)["error"]["code"] == "upstream_timeout"
    finally:
        rig.close()


# -- clients that leave, stop reading or half-close (item 14 and the smaller ones) -----------


def raw_request(body: bytes, request_id: str) -> bytes:
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {request_id}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def connect(rig: Rig, *, rcvbuf: int | None = None) -> socket.socket:
    host, port = rig.url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect((host, int(port)))
    return sock


def reset(sock: socket.socket) -> None:
    """Close with a reset (linger 0), the way a killed or timed-out client often leaves."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def assert_logged_gone_once(rig: Rig, request_id: str, error: str) -> None:
    wait_for(lambda: bool(rig.request_log(request_id)), what=f"{request_id}'s log line")
    (line,) = rig.request_log(request_id)
    assert line["status"] == 499 and line["error"] == error, line


def upstream_saw_the_client_leave(upstream: Proc, request_id: str) -> Callable[[], bool]:
    """Whether the upstream saw the gateway drop ``request_id`` (its connection closed)."""

    def left() -> bool:
        entries = received(upstream.url)
        mine = [e for e in entries if request_id in {e["headers"].get("X-Request-ID")}]
        return bool(mine) and all(e.get("client_left") for e in mine)

    return left


def test_a_client_that_leaves_mid_stream_is_499_and_the_upstream_is_cancelled(rig: Rig) -> None:
    (upstream,) = rig.upstreams
    set_mode(upstream.url, completion="ok", stream_tokens=400, token_delay_s=0.05)
    for n, leave in enumerate((reset, socket.socket.close)):
        sock = connect(rig)
        sock.sendall(raw_request(completion(stream=True), f"gone-mid-stream-{n}"))
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        leave(sock)
        assert_logged_gone_once(rig, f"gone-mid-stream-{n}", "client disconnected")
        wait_for(
            upstream_saw_the_client_leave(upstream, f"gone-mid-stream-{n}"),
            what="the upstream cancelled",
        )
    assert rig.requests_total(499) == 2
    assert rig.replica(upstream)["success_rate"] == 1.0  # the client's leaving is not its fault


@pytest.mark.parametrize(
    ("stream", "leave"),
    [(False, reset), (True, reset), (False, socket.socket.close), (True, socket.socket.close)],
    ids=["whole-reset", "stream-reset", "whole-close", "stream-close"],
)
def test_a_client_that_leaves_before_the_upstream_answered_is_499(
    rig: Rig, stream: bool, leave: Callable[[socket.socket], None]
) -> None:
    """A close (FIN) looks like a half-close at first: the gateway's probe tells them apart."""
    (upstream,) = rig.upstreams
    set_mode(upstream.url, completion="hang", stall_s=60)
    sock = connect(rig)
    sock.sendall(raw_request(completion(stream=stream), "gone-waiting"))
    wait_for(lambda: len(received(upstream.url)) == 1, what="the request upstream")
    leave(sock)
    assert_logged_gone_once(rig, "gone-waiting", "client disconnected")
    wait_for(upstream_saw_the_client_leave(upstream, "gone-waiting"), what="the upstream cancelled")
    assert rig.requests_total(499) == 1


def test_a_client_that_leaves_while_queued_is_499(tmp_path: Path) -> None:
    rig = start_rig(tmp_path, 1, fields=", max_queue: 1")
    try:
        (upstream,) = rig.upstreams
        set_mode(upstream.url, completion="hang", stall_s=60)
        holder = connect(rig)  # its stream never starts: the replica's queue is full
        holder.sendall(raw_request(completion(stream=True), "holder"))
        wait_for(lambda: len(received(upstream.url)) == 1, what="the first request upstream")
        queued = connect(rig)
        queued.sendall(raw_request(completion(stream=True), "gone-queued"))
        wait_for(
            lambda: queue_depth(rig) == 1,
            what="the second request queued",
            state=lambda: queue_depth(rig),
        )
        reset(queued)
        assert_logged_gone_once(rig, "gone-queued", "client disconnected")
        assert len(received(upstream.url)) == 1  # it never reached the replica
        reset(holder)
        assert_logged_gone_once(rig, "holder", "client disconnected")
        assert rig.requests_total(499) == 2
    finally:
        rig.close()


def queue_depth(rig: Rig) -> float:
    with urllib.request.urlopen(rig.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.findall(r"^isocost_queue_depth\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return sum(float(value) for value in found)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_stops_reading_is_cut_off_and_frees_the_upstream(
    tmp_path: Path, stream: bool
) -> None:
    rig = start_rig(tmp_path, 1, limits="  max_response_bytes: 134217728")
    try:
        (upstream,) = rig.upstreams
        if stream:  # far more than every socket buffer on the way holds
            set_mode(upstream.url, completion="ok", stream_tokens=40_000, token_bytes=1000)
        else:
            set_mode(upstream.url, completion="huge", size_bytes=64 << 20)
        sock = connect(rig, rcvbuf=4096)
        sock.sendall(raw_request(completion(stream=stream), "stalled"))
        assert_logged_gone_once(rig, "stalled", "client stopped reading")
        if stream:  # the gateway stopped reading too: the engine was held until now
            wait_for(
                upstream_saw_the_client_leave(upstream, "stalled"), what="the upstream cancelled"
            )
        sock.close()
        assert rig.requests_total(499) == 1
    finally:
        rig.close()


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize(
    ("stream", "wait_s"),
    [(False, 0.0), (True, 0.0), (False, 1.2), (True, 1.2)],  # under the 1.5 s idle timeout
    ids=["whole", "stream", "whole-after-a-wait", "stream-after-a-wait"],
)
def test_a_client_that_half_closes_after_its_request_gets_the_answer(
    rig: Rig, stream: bool, wait_s: float
) -> None:
    (upstream,) = rig.upstreams
    tokens = 20 if stream else 0
    mode = "hang" if wait_s else "ok"  # hang: nothing for stall_s, then the answer
    set_mode(upstream.url, completion=mode, stall_s=wait_s, stream_tokens=tokens)
    sock = connect(rig)
    sock.sendall(raw_request(completion(stream=stream), "half-closed"))
    sock.shutdown(socket.SHUT_WR)
    answer = read_all(sock)  # the gateway closes once it answered
    sock.close()
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"  # the gateway's probes while it waits
    probes = 0
    while answer.startswith(interim):
        answer, probes = answer[len(interim) :], probes + 1
    assert probes or not wait_s
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), answer[:300]
    if stream:
        assert b"data: [DONE]" in body and b'"error"' not in body
    else:
        assert b'"hello"' in body
    wait_for(lambda: bool(rig.request_log("half-closed")), what="the log line")
    assert rig.request_log("half-closed")[0]["status"] == 200
    # a connection half-closed with nothing asked is simply closed
    idle = connect(rig)
    idle.shutdown(socket.SHUT_WR)
    assert read_all(idle) == b""
    idle.close()
