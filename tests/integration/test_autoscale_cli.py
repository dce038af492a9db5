"""``isocost autoscale`` on a real gateway and real engines: a dry run under load only
prints; ``--actuator local`` then starts an engine under the load step (its lead shown)
and, once the load drops, drains and removes one with no request failed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway_harness import admin_replicas, gateway_config, http, wait_for
from isocost_procs import ISOCOST, Proc, start_isocost

MODEL = "llama-3.1-8b"
API_KEY = "sk-autoscale-3e1"
ADMIN_TOKEN = "admin-autoscale-77c"
AUTOSCALE = """
interval_s: 0.5
headroom: 0.2
max_gpus: 4
scale_up_cooldown_s: 0
scale_down_cooldown_s: 1
scale_in_after_s: 2
drain_deadline_s: 20
pools:
  - {gpu: a100-80g, min: 1, max: 2, cold_start_s: 2}
"""


class Load:
    """Threads sending chat completions through the gateway; every status is kept."""

    def __init__(self, url: str) -> None:
        self.url = url + "/v1/chat/completions"
        self.statuses: list[int] = []
        self.senders: list[tuple[threading.Thread, threading.Event]] = []

    def _send(self, stop: threading.Event, pause_s: float) -> None:
        body = json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
        ).encode()
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        while not stop.is_set():
            status, _, _ = http("POST", self.url, body, headers)
            self.statuses.append(status)
            stop.wait(pause_s)

    def run(self, senders: int, pause_s: float = 0.0) -> None:
        """``senders`` more threads, each one request at a time, ``pause_s`` between."""
        for _ in range(senders):
            stop = threading.Event()
            thread = threading.Thread(target=self._send, args=(stop, pause_s), daemon=True)
            thread.start()
            self.senders.append((thread, stop))

    def end(self) -> None:
        for _, stop in self.senders:
            stop.set()
        for thread, _ in self.senders:
            thread.join(timeout=30)
        self.senders.clear()


def start_gateways(tmp_path: Path, procs: list[Proc], count: int) -> list[Proc]:
    """One engine and ``count`` gateways in front of it, each with the same config."""
    engine = start_isocost(
        ["engine", "--port", "0", "--model", MODEL, "--gpu", "a100-80g", "--output-dist", "max"],
        "isocost engine",
    )
    procs.append(engine)
    config = tmp_path / "gateway.yaml"
    config.write_text(
        gateway_config([engine.url], model=MODEL, admin_token=ADMIN_TOKEN, api_key=API_KEY)
    )
    gateways = []
    for index in range(count):
        with (tmp_path / f"gateway-{index}.log").open("a") as log:
            gateway = start_isocost(
                ["serve", "--config", str(config), "--port", "0"], "isocost serve", stderr=log
            )
        procs.append(gateway)
        gateways.append(gateway)
    return gateways


@pytest.fixture
def cluster(tmp_path: Path, procs: list[Proc]) -> Iterator[tuple[Proc, Load]]:
    (gateway,) = start_gateways(tmp_path, procs, 1)
    load = Load(gateway.url)
    yield gateway, load
    load.end()


def replicas(gateway: Proc) -> list[dict[str, Any]]:
    return admin_replicas(gateway.url, ADMIN_TOKEN)


def start_autoscale(tmp: Path, gateway: Proc, *extra: str) -> tuple[subprocess.Popen[str], Path]:
    config = tmp / "autoscale.yaml"
    config.write_text(AUTOSCALE)
    out = tmp / f"autoscale-{len(list(tmp.glob('autoscale-*.out')))}.out"
    args = ["autoscale", "--gateway", gateway.url, "--config", str(config), "--actuator", "local"]
    args += ["--capacity-rps", "3", "--log-dir", str(tmp / "engines"), *extra]
    with out.open("w") as stdout, (tmp / "autoscale.log").open("a") as stderr:
        popen = subprocess.Popen(
            [ISOCOST, *args],
            stdout=stdout,
            stderr=stderr,
            text=True,
            env={**os.environ, "ISOCOST_ADMIN_TOKEN": ADMIN_TOKEN},
        )
    return popen, out


def terminate(popen: subprocess.Popen[str]) -> None:
    """SIGTERM: the autoscaler finishes its drains and stops the engines it started."""
    popen.send_signal(signal.SIGTERM)
    assert popen.wait(timeout=30) == 0


def test_a_load_step_starts_an_engine_and_the_drop_drains_one_with_no_failure(
    tmp_path: Path, cluster: tuple[Proc, Load]
) -> None:
    gateway, load = cluster
    load.run(senders=4)

    dry, dry_out = start_autoscale(tmp_path, gateway, "--dry-run")
    try:
        wait_for(lambda: "-> start 1 a100-80g" in dry_out.read_text(), 20, "a dry-run start")
        assert len(replicas(gateway)) == 1  # printed, not done
    finally:
        terminate(dry)
    assert all(line.startswith("dry-run ") for line in dry_out.read_text().splitlines())

    real, out = start_autoscale(tmp_path, gateway)
    try:
        wait_for(lambda: len(replicas(gateway)) == 2, 30, "a second replica", state=out.read_text)
        wait_for(lambda: "lead: " in out.read_text(), 10, "the lead line")
        started = time.monotonic()
        load.end()
        load.run(senders=1, pause_s=1.0)  # the drop: requests still in flight
        wait_for(lambda: len(replicas(gateway)) == 1, 30, "a scale-in", state=out.read_text)
        print(f"scale-in {time.monotonic() - started:.1f} s after the drop")
        print(next(line for line in out.read_text().splitlines() if line.startswith("lead: ")))
    finally:
        load.end()
        terminate(real)
    assert "-> drain " in out.read_text()
    assert load.statuses and set(load.statuses) == {200}, sorted(set(load.statuses))
    print(f"{len(load.statuses)} requests, all answered 200")


@pytest.mark.parametrize(
    ("config", "flags", "message"),
    [
        (AUTOSCALE.replace("min: 1, max: 2", "min: 3, max: 2"), [], "min (3) > max (2)"),
        (AUTOSCALE.replace("max_gpus: 4", ""), [], "no budget"),
        (AUTOSCALE, ["--actuator", "simulator"], "--actuator simulator: valid: local"),
        (AUTOSCALE, ["--actuator", "command"], "--actuator command needs --scale-command"),
        (AUTOSCALE, ["--gateway", "http://127.0.0.1:9/"], "a gateway named twice"),
        (AUTOSCALE, ["--gateway", "127.0.0.1:8080"], "127.0.0.1:8080: not an http(s):// URL"),
        (AUTOSCALE, ["--gateway", "http://gw:99999"], "gw:99999: its port is not a port"),
        (
            AUTOSCALE,
            ["--actuator", "local", "--metrics-port", "9109", "--metrics-host", "203.0.113.9"],
            "cannot listen on 203.0.113.9:9109",
        ),
    ],
    ids=[
        "min>max",
        "no-budget",
        "simulator",
        "no-command",
        "gateway-twice",
        "gateway-no-url",
        "gateway-port",
        "metrics-host-not-ours",
    ],
)
def test_bad_config_or_flags_are_one_line_and_exit_2(
    tmp_path: Path, config: str, flags: list[str], message: str
) -> None:
    refused(tmp_path, config, flags, message)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (None, "No such file"),
        ("{", "not JSON"),
        ('{"gpu": "a100-80g"}', "not `isocost plan --json` output"),
        ("[]", "pools[0]: no plan for a100-80g"),
        ("[" * 100_000, "not JSON (nested too deep"),
    ],
    ids=["missing", "not-json", "not-a-plan", "no-such-gpu", "nested-too-deep"],
)
def test_a_bad_plan_file_is_one_line_and_exit_2(
    tmp_path: Path, plan: str | None, message: str
) -> None:
    path = tmp_path / "plan.json"
    if plan is not None:
        path.write_text(plan)
    refused(tmp_path, AUTOSCALE, ["--actuator", "local", "--plan", str(path)], message)


def refused(tmp_path: Path, config: str, flags: list[str], message: str) -> None:
    """``isocost autoscale`` with these exits 2 with one line naming ``message``."""
    path = tmp_path / "autoscale.yaml"
    path.write_text(config)
    args = ["autoscale", "--gateway", "http://127.0.0.1:9", "--config", str(path), *flags]
    done = subprocess.run(
        [ISOCOST, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,  # --actuator local's default --log-dir is made there, not in the repo
        env={**os.environ, "ISOCOST_ADMIN_TOKEN": ADMIN_TOKEN},
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
