"""SIGHUP, which ends a process on the spot by default (nothing drained, streams cut):
``isocost serve`` and ``isocost picker`` reload their config file at once, as nginx does,
and keep serving (streams in flight included); ``serve --workers`` passes it on to every
worker; a gateway without a file logs it and keeps serving; the servers that have
nothing to reload (the engine here) stop as for SIGTERM, drained, exit 0.

Real processes: ``isocost engine`` replicas, ``isocost serve`` / ``isocost picker`` on
random ports with their config in ``tmp_path``. The reload is told from the file watcher's
by an unchanged file: the watcher never reloads one, so a reload counted after SIGHUP of
an unchanged file is SIGHUP's.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from gateway_harness import admin_replicas, http, wait_for
from gateway_harness import log_events as events
from isocost_procs import Proc, spawn_ready, start_isocost

MODEL = "llama-3.1-8b"
TOKEN = "sighup-admin-token"


@dataclass
class Engines:
    proc: Proc
    urls: list[str]


@pytest.fixture
def engines() -> Iterator[Engines]:
    """Two replicas of one ``isocost engine`` whose streams take seconds (~5 ms a token)."""
    args = ["engine", "--port", "0", "--model", MODEL, "--replicas", "2", "--time-scale", "0.5",
            "--output-dist", "max"]  # fmt: skip
    popen, urls = spawn_ready(args, "isocost engine", count=2)
    started = Engines(Proc(popen, urls[0]), urls)
    yield started
    started.proc.stop()


def config_text(urls: list[str], policy: str = "round_robin") -> str:
    replicas = "".join(f"      - {{url: '{u}', name: r{i}}}\n" for i, u in enumerate(urls))
    return (
        f"policy: {policy}\nauth:\n  admin_token: {TOKEN}\n"
        f"pools:\n  - model: {MODEL}\n    replicas:\n{replicas}"
    )


def metric(url: str, name: str, labels: str) -> float:
    """The sum of ``name{labels...}`` series on ``url``'s /metrics (every worker's)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    pattern = rf"^{name}{{([^}}]*)}} (\S+)$"
    return sum(
        float(value)
        for found_labels, value in re.findall(pattern, text, re.MULTILINE)
        if labels in found_labels
    )


def reloads_ok(url: str) -> float:
    return metric(url, "isocost_config_reloads_total", 'result="ok"')


def start_serve(tmp_path: Path, text: str, *extra: str) -> tuple[Proc, Path]:
    config, log = tmp_path / "gateway.yaml", tmp_path / "gateway.log"
    config.write_text(text)
    with log.open("a") as sink:
        proc = start_isocost(
            ["serve", "--config", str(config), "--port", "0", *extra], "isocost serve", sink
        )
    return proc, log


def stream_tokens(url: str, max_tokens: int, out: list[int]) -> None:
    """Stream one completion through ``url``; its completion tokens (the usage the last
    chunk carries), appended to ``out`` once the stream ends."""
    body = {
        "model": MODEL, "prompt": "hello " * 8, "max_tokens": max_tokens, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    usage = None
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    out.append(usage["completion_tokens"] if usage else -1)


def test_sighup_reloads_at_once_and_keeps_streams(engines: Engines, tmp_path: Path) -> None:
    urls = engines.urls
    gateway, log = start_serve(tmp_path, config_text(urls))
    try:
        received: list[int] = []
        stream = threading.Thread(target=stream_tokens, args=(gateway.url, 400, received))
        stream.start()
        wait_for(
            lambda: metric(gateway.url, "isocost_replica_in_flight", "") >= 1,
            what="the stream in flight",
        )
        gateway.popen.send_signal(signal.SIGHUP)  # the file unchanged: the watcher would not
        wait_for(lambda: reloads_ok(gateway.url) == 1, what="the reload SIGHUP asked for")
        assert events(log, "reload_requested")[0]["file"] == str(tmp_path / "gateway.yaml")
        stream.join(timeout=60)
        assert received == [400]  # not cut
        (tmp_path / "gateway.yaml").write_text(config_text(urls[:1]))
        gateway.popen.send_signal(signal.SIGHUP)
        wait_for(lambda: reloads_ok(gateway.url) == 2, what="the edited file reloaded")
        wait_for(
            lambda: [r["url"] for r in admin_replicas(gateway.url, TOKEN)] == urls[:1],
            what="the replica no longer listed gone",
        )
        # the watcher sees the file it was given as applied: no second reload of it
        wait_for(lambda: len(events(log, "reload_requested")) == 2, what="two SIGHUPs logged")
        assert gateway.popen.poll() is None
        assert reloads_ok(gateway.url) == 2 and "Traceback" not in log.read_text()
    finally:
        gateway.stop()
    assert gateway.popen.returncode == 0


def test_sighup_without_a_config_file_is_logged_and_serving_goes_on(
    engines: Engines, tmp_path: Path
) -> None:
    log = tmp_path / "gateway.log"
    with log.open("a") as sink:
        gateway = start_isocost(
            ["serve", "--port", "0", "--replica", engines.urls[0]], "isocost serve", sink
        )
    try:
        gateway.popen.send_signal(signal.SIGHUP)
        wait_for(lambda: events(log, "reload_unavailable"), what="the SIGHUP logged")
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
        status, _, _ = http(
            "POST", gateway.url + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        assert status == 200 and gateway.popen.poll() is None
    finally:
        gateway.stop()
    assert gateway.popen.returncode == 0


def test_sighup_reaches_every_worker(engines: Engines, tmp_path: Path) -> None:
    gateway, log = start_serve(tmp_path, config_text(engines.urls), "--workers", "2")
    try:
        gateway.popen.send_signal(signal.SIGHUP)
        wait_for(lambda: len(events(log, "reload_requested")) == 2, what="both workers reload")
        wait_for(lambda: reloads_ok(gateway.url) == 2, what="both workers' reloads counted")
        assert gateway.popen.poll() is None
    finally:
        gateway.stop()
    assert gateway.popen.returncode == 0


def test_sighup_reloads_the_picker(engines: Engines, tmp_path: Path) -> None:
    config, log = tmp_path / "picker.yaml", tmp_path / "picker.log"
    config.write_text(config_text(engines.urls))
    with log.open("a") as sink:
        picker = start_isocost(
            ["picker", "--config", str(config), "--port", "0"], "isocost picker", sink
        )
    try:
        picker.popen.send_signal(signal.SIGHUP)
        wait_for(lambda: events(log, "reloaded"), what="the picker's reload")
        assert events(log, "reload_requested") and picker.popen.poll() is None
    finally:
        picker.stop()
    assert picker.popen.returncode == 0


def test_sighup_stops_an_engine_as_sigterm_does(tmp_path: Path) -> None:
    engine = start_isocost(["engine", "--port", "0", "--model", MODEL], "isocost engine")
    engine.popen.send_signal(signal.SIGHUP)
    assert engine.popen.wait(timeout=30) == 0  # drained, not killed by the signal (-1)
    engine.stop()
