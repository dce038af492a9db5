"""``isocost picker --relay``: what only the native relay's own life shows. Every GAIE
behaviour runs through the relay in ``test_picker.py`` too; here: the relay killed under
the picker (alone, and under load through Envoy), the port taken, a relay binary that is
not there, a method no service has, a health request that is no ``HealthCheckRequest``,
and SIGTERM taking both down.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy_harness import RELAY
from gateway_harness import gateway_config, log_records, wait_for
from isocost_procs import ISOCOST, Proc, children, free_port, start_isocost
from test_picker import (
    ADMIN_TOKEN,
    API_KEY,
    MODEL,
    _engine,
    _Load,
    _running_stack,
    _start_picker,
)

pytestmark = pytest.mark.skipif(
    RELAY is None, reason="the picker's relay is not built (make relay)"
)


@pytest.fixture(scope="module")
def engine() -> Iterator[Proc]:
    proc = _engine()
    yield proc
    proc.stop()


@pytest.fixture
def config(tmp_path: Path, engine: Proc) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(gateway_config([engine.url], model=MODEL, admin_token=ADMIN_TOKEN,
                                   api_key=API_KEY))  # fmt: skip
    return path


def _relay_of(picker: Proc) -> int:
    """The pid of the relay the picker started (its one child)."""
    (relay,) = children(picker.pid)
    return relay


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_relay_killed_stops_the_picker(tmp_path: Path, config: Path) -> None:
    """A picker whose gRPC side died is of no use: it exits (2, as the CLI's errors do)
    and says why in one line, so that its supervisor restarts both."""
    log = tmp_path / "picker.log"
    picker = _start_picker(config, free_port(), log, relay=RELAY)
    try:
        os.kill(_relay_of(picker), signal.SIGKILL)
        assert picker.popen.wait(timeout=20) == 2
    finally:
        picker.stop()
    text = log.read_text()
    exited = [e for e in log_records(text) if e.get("event") == "relay_exited"]
    assert exited and exited[0]["exit_code"] == -signal.SIGKILL
    assert "Traceback" not in text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "relay" in errors[0], errors


def test_a_relay_killed_under_load_loses_no_request(tmp_path: Path) -> None:
    """Three clients looping through Envoy (streamed and not) while the relay is
    SIGKILLed: the picker exits, Envoy (FailOpen) serves the rest on its fallback route,
    and every request is answered 200."""
    with _running_stack(tmp_path, relay=RELAY) as stack:
        load = _Load(stack.envoy.url)
        try:
            wait_for(lambda: any(p for _, _, p in load.answers), what="picked answers")
            os.kill(_relay_of(stack.picker), signal.SIGKILL)
            killed_at = time.monotonic()
            assert stack.picker.popen.wait(timeout=20) == 2
            wait_for(
                lambda: sum(1 for t, _, p in load.answers if t > killed_at and not p) >= 4,
                what="answers from the fallback route",
            )
        finally:
            load.stop()
    failed = [status for _, status, _ in load.answers if status != 200]
    assert not failed, f"{len(failed)} of {len(load.answers)} requests failed: {failed[:5]}"


def test_a_port_taken_is_one_line_and_exit_2(tmp_path: Path, config: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [ISOCOST, "picker", "--config", str(config), "--port", str(port),
             "--relay", str(RELAY)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "the relay exited before it was ready" in done.stderr


def test_a_relay_that_is_not_there_is_one_line_and_exit_2(tmp_path: Path, config: Path) -> None:
    missing = tmp_path / "no-relay"
    done = subprocess.run(
        [ISOCOST, "picker", "--config", str(config), "--port", "0", "--relay", str(missing)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "--relay" in done.stderr, done.stderr


def test_unknown_methods_and_bad_health_requests_then_sigterm(tmp_path: Path, config: Path) -> None:
    """What the picker's handlers do not serve comes back as gRPC statuses through the
    relay; SIGTERM stops the picker (0) and the relay with it."""
    with (tmp_path / "picker.log").open("a") as log:
        picker = start_isocost(
            ["picker", "--config", str(config), "--port", "0", "--relay", str(RELAY)],
            "isocost picker",
            stderr=log,
        )
    try:
        relay = _relay_of(picker)
        with grpc.insecure_channel(picker.url) as channel:
            unknown = channel.unary_unary("/no.such.Service/Method")
            with pytest.raises(grpc.RpcError) as refused:
                unknown(b"", timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
            check = channel.unary_unary("/grpc.health.v1.Health/Check")
            with pytest.raises(grpc.RpcError) as garbled:
                check(b"\xff\xff\xff", timeout=5)
            assert garbled.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert check(b"", timeout=5) == b"\x08\x01"  # service "": SERVING
        picker.popen.send_signal(signal.SIGTERM)
        assert picker.popen.wait(timeout=30) == 0
        assert not _alive(relay)
    finally:
        picker.stop()
