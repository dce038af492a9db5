"""``isocost autoscale`` SIGKILLed mid-drain: the next autoscaler finishes that drain
instead of leaving the replica drained, unseen and running. ``--actuator local`` leaves its
engines running (each in a session of its own) and the next one started with the same
``--log-dir`` stops the engine's process; ``--actuator command`` leaves nothing but the
gateway's word that the drain was an autoscaler's."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from gateway_harness import gateway_config, http, wait_for
from isocost_procs import Proc, start_isocost
from test_autoscale_cli import (
    ADMIN_TOKEN,
    API_KEY,
    MODEL,
    Load,
    cluster,
    replicas,
    start_autoscale,
    terminate,
)

__all__ = ["cluster"]  # the fixture, shared with test_autoscale_cli


def _alive(pid: int) -> bool:
    """Running as a process, not a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes() != b""
    except OSError:
        return False


def test_a_killed_autoscalers_drained_engine_is_stopped_by_the_next(
    tmp_path: Path, cluster: tuple[Proc, Load]
) -> None:
    gateway, load = cluster
    load.run(senders=4)
    first, out = start_autoscale(tmp_path, gateway)
    try:
        wait_for(lambda: len(replicas(gateway)) == 2, 30, "a started engine", state=out.read_text)
    finally:
        first.kill()
        first.wait()
        load.end()
    (name,) = [row["name"] for row in replicas(gateway) if row["name"].startswith("autoscale-")]
    pid, _ = map(int, (tmp_path / "engines" / f"{name}.pid").read_text().split())
    assert _alive(pid)  # outlived the autoscaler that started it
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    status, _, answer = http("POST", f"{gateway.url}/admin/replicas/{name}/drain", b"", headers)
    assert status == 200, answer  # the drain the killed autoscaler had begun

    second, out = start_autoscale(tmp_path, gateway)
    try:
        wait_for(lambda: not _alive(pid), 60, f"{name}'s engine stopped", state=out.read_text)
        wait_for(lambda: len(replicas(gateway)) == 1, 30, f"{name} removed")
    finally:
        terminate(second)
    assert not (tmp_path / "engines" / f"{name}.pid").exists()
    log = (tmp_path / "autoscale.log").read_text()
    assert "autoscale_drain_adopted" in log and "autoscale_inherited_stop" in log


def test_a_killed_command_autoscalers_drain_is_finished_by_the_next(
    tmp_path: Path, procs: list[Proc]
) -> None:
    """``--actuator command`` keeps nothing of its own: the next autoscaler knows the drain
    was an autoscaler's because the gateway says so (``drained_by``), waits until the
    killed one's status has gone quiet, then finishes it: once no request is left in
    flight there, the command runs with the lower count and names the victim, and the
    replica is removed. The request in flight on the victim through all of it ends 200."""
    engine = ["engine", "--port", "0", "--model", MODEL, "--gpu", "a100-80g"]
    engine += ["--output-dist", "max", "--time-scale", "2"]  # 700 tokens: ~18 s
    engines = [start_isocost(engine, "isocost engine") for _ in range(2)]
    procs.extend(engines)
    config = tmp_path / "gateway.yaml"
    urls = [e.url for e in engines]
    yaml = gateway_config(urls, model=MODEL, admin_token=ADMIN_TOKEN, api_key=API_KEY,
                          policy="round_robin", replica_fields="gpu: a100-80g")  # fmt: skip
    config.write_text(yaml)
    gateway = start_isocost(["serve", "--config", str(config), "--port", "0"], "isocost serve")
    procs.append(gateway)
    calls = tmp_path / "calls.txt"
    command = tmp_path / "scale.sh"
    command.write_text(f'#!/bin/sh\necho "$1 $ISOCOST_STOP_REPLICA" >> {calls}\n')
    command.chmod(0o755)

    answers: list[int] = []
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 700}
    ).encode()
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    long_requests = [
        threading.Thread(
            target=lambda: answers.append(
                http("POST", gateway.url + "/v1/chat/completions", body, headers, 120)[0]
            )
        )
        for _ in range(2)
    ]  # one on each replica (round robin), each far longer than the rounds below
    for thread in long_requests:
        thread.start()
    wait_for(lambda: all(r["in_flight"] == 1 for r in replicas(gateway)), 20, "both busy")

    def drained() -> list[dict[str, Any]]:
        return [r for r in replicas(gateway) if r["state"] == "drained"]

    args = ["--actuator", "command", "--scale-command", str(command)]
    first, out = start_autoscale(tmp_path, gateway, *args)
    try:
        wait_for(lambda: len(drained()) == 1, 30, "a scale-in's drain", state=out.read_text)
    finally:
        first.kill()
        first.wait()
    (victim,) = drained()
    assert victim["drained_by"].startswith("autoscale:") and victim["in_flight"] == 1

    second, out = start_autoscale(tmp_path, gateway, *args)
    try:
        wait_for(lambda: len(replicas(gateway)) == 1, 60, "the drain finished", state=out.read_text)
    finally:
        terminate(second)
    for thread in long_requests:
        thread.join(timeout=60)
    assert answers == [200, 200]
    assert calls.read_text().splitlines() == [f"1 {victim['name']}"]
    log = (tmp_path / "autoscale.log").read_text()
    assert "autoscale_drain_adopted" in log
