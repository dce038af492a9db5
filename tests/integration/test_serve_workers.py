"""``isocost serve --workers 2``: two gateway processes on one port that act as one.

Real processes on 127.0.0.1: two ``isocost engine`` replicas, the supervisor and its two
workers (SO_REUSEPORT), which share their state through the supervisor's bus hub (no
state bus is configured). Each plain urllib call is a new connection, so the kernel spreads
them over the workers; a call is repeated until both workers have answered (a worker
seen 40 times running with the other never seen would mean the port is not shared). The
official ``openai`` client sends the traffic.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from gateway_harness import gateway_config, http, wait_for
from isocost_procs import ISOCOST, Proc, start_isocost
from prometheus_client.parser import text_string_to_metric_families

MODEL = "llama-3.1-8b"
ADMIN_TOKEN = "admin-workers-5d2a"
API_KEY = "key-workers-8e1b"
ENGINE = ["engine", "--model", MODEL, "--gpu", "a100-80g", "--output-dist", "max"]
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}


@dataclass
class Fleet:
    engines: list[Proc]
    gateway: Proc  # the supervisor; its URL is the shared port's

    def snapshots(self, tries: int = 40) -> dict[int, dict[str, Any]]:
        """The latest snapshot of each worker that answered, over new connections (until
        two have, or ``tries`` calls)."""
        seen: dict[int, dict[str, Any]] = {}
        for _ in range(tries):
            status, _, snapshot = http("GET", self.gateway.url + "/admin/snapshot", None, ADMIN)
            assert status == 200, snapshot
            seen[snapshot["worker"]] = snapshot
            if len(seen) == 2:
                break
        return seen

    def snapshots_of_every_worker(self) -> dict[int, dict[str, Any]]:
        seen = self.snapshots()
        assert sorted(seen) == [0, 1], f"only workers {sorted(seen)} answered 40 connections"
        return seen

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateway.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    engines = [start_isocost([*ENGINE, "--port", "0"], "isocost engine") for _ in range(2)]
    config = tmp_path / "gateway.yaml"
    config.write_text(
        gateway_config(
            [e.url for e in engines], model=MODEL, admin_token=ADMIN_TOKEN, api_key=API_KEY
        )
    )
    args = ["serve", "--config", str(config), "--port", "0", "--workers", "2"]
    with (tmp_path / "gateway.log").open("a") as log:
        gateway = start_isocost(args, "isocost serve", stderr=log)
    try:
        yield Fleet(engines, gateway)
    finally:
        gateway.stop()
        for engine in engines:
            engine.stop()


def _json(body: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    return json.dumps(body).encode(), headers


def _requests_by_worker(url: str) -> dict[str, float]:
    """``isocost_requests_total`` answered 200, per ``worker`` label of the port's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "isocost_requests_total" and sample.labels["status"] == "200":
                worker = sample.labels["worker"]
                counts[worker] = counts.get(worker, 0.0) + sample.value
    return counts


def test_workers_share_the_port_and_act_as_one_gateway(fleet: Fleet) -> None:
    snapshots = fleet.snapshots_of_every_worker()
    assert snapshots[0]["pid"] != snapshots[1]["pid"]
    for i in range(20):  # each on a new connection: spread over the workers by the kernel
        body = {"model": MODEL, "prompt": f"question {i}", "max_tokens": 4}
        status, _, answer = http("POST", fleet.gateway.url + "/v1/completions", *_json(body))
        assert status == 200 and answer["usage"]["completion_tokens"] == 4, answer
    with fleet.client() as client:  # one kept-alive connection: one worker
        answer = client.completions.create(model=MODEL, prompt="and one more", max_tokens=4)
        assert answer.usage is not None and answer.usage.completion_tokens == 4

    # /metrics on the shared port: both workers' series, labelled, adding up to all answers.
    counts = _requests_by_worker(fleet.gateway.url)
    assert set(counts) == {"0", "1"} and sum(counts.values()) == 21, counts

    # An admin change made through the port is made on every worker.
    name = next(iter(snapshots[0]["replicas"]))["name"]
    by = b'{"by": "autoscale:0123456789ab"}'
    status, headers, _ = http("POST", f"{fleet.gateway.url}/admin/replicas/{name}/drain", by, ADMIN)
    assert status == 200 and "x-isocost-workers-failed" not in headers
    for snapshot in fleet.snapshots_of_every_worker().values():
        states = {row["name"]: (row["state"], row["drained_by"]) for row in snapshot["replicas"]}
        assert states[name] == ("drained", "autoscale:0123456789ab"), (snapshot["worker"], states)
    # An autoscaler's status report reaches every worker too, but is no change to keep.
    report = {"desired": 2, "ready": 2, "pending": 0, "draining": 0, "forecast_rps": 1.5,
              "interval_s": 10, "instance": "0123456789ab"}  # fmt: skip
    status, headers, _ = http(
        "POST", fleet.gateway.url + "/admin/autoscaler", json.dumps(report).encode(), ADMIN
    )
    assert status == 200 and "x-isocost-workers-failed" not in headers
    for snapshot in fleet.snapshots_of_every_worker().values():
        assert snapshot["autoscaler"]["desired"] == 2, snapshot["worker"]
        assert snapshot["autoscaler"]["live_instances"] == ["0123456789ab"], snapshot["worker"]
    status, _, listed = http("GET", fleet.gateway.url + "/admin/changes", None, ADMIN)
    drain = {"method": "POST", "path": f"/admin/replicas/{name}/drain", "body": by.decode()}
    assert status == 200 and listed == {"changes": [drain], "complete": True}, listed


def test_the_snapshot_through_the_port_counts_every_workers_requests(fleet: Fleet) -> None:
    """What an autoscaler waits on before it stops a drained replica, and sizes the fleet
    by: the requests in flight and queued through every worker, whichever one answers
    (each worker alone sees its own connections' only)."""
    streams = []
    try:
        for i in range(6):  # each on a new connection: spread over the workers
            data, headers = _json(
                {"model": MODEL, "prompt": f"long {i}", "max_tokens": 1500, "stream": True}
            )
            request = urllib.request.Request(
                fleet.gateway.url + "/v1/completions", data=data, headers=headers
            )
            streams.append(urllib.request.urlopen(request, timeout=60))
            assert streams[-1].readline().startswith(b"data: ")  # its first token: in flight
        for worker, snapshot in fleet.snapshots_of_every_worker().items():
            in_flight = sum(row["in_flight"] for row in snapshot["replicas"])
            assert in_flight == 6, (worker, [r["in_flight"] for r in snapshot["replicas"]])
            assert sum(pool["in_flight"] for pool in snapshot["pools"]) == 6, worker
            assert snapshot["workers"] == {"answered": [0, 1], "missing": []}, worker
    finally:
        for stream in streams:
            stream.close()


def _by_worker(url: str, name: str, **labels: str) -> dict[str, float]:
    """The samples ``name`` with ``labels`` of the port's /metrics, per ``worker`` label."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        sample.labels["worker"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    }


def test_without_a_bus_the_workers_share_through_the_supervisors_hub(tmp_path: Path) -> None:
    """No state bus configured: the supervisor's hub carries the bus between its workers
    (each shows it up), so a key's budget is one budget: requests sent on one kept-alive
    connection, so to one worker, are spent from the other worker's bucket too. Shared
    by nothing, the other would still hold the whole budget."""
    engine = start_isocost([*ENGINE, "--port", "0"], "isocost engine")
    config = tmp_path / "gateway.yaml"
    budget = "      requests_per_minute: 6"
    config.write_text(gateway_config([engine.url], model=MODEL, admin_token=ADMIN_TOKEN,
                                     api_key=API_KEY, key_fields=budget))  # fmt: skip
    args = ["serve", "--config", str(config), "--port", "0", "--workers", "2"]
    with (tmp_path / "gateway.log").open("a") as log:
        gateway = start_isocost(args, "isocost serve", stderr=log)
    try:
        wait_for(
            lambda: _by_worker(gateway.url, "isocost_state_bus_up") == {"0": 1.0, "1": 1.0},
            what="the bus up on both workers",
        )
        with openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0) as client:
            for i in range(3):
                client.completions.create(model=MODEL, prompt=f"budget {i}", max_tokens=2)
        left: dict[str, float] = {}

        def spent_everywhere() -> bool:
            left.update(_by_worker(gateway.url, "isocost_api_key_budget_remaining",
                                   key="team-a", budget="requests"))  # fmt: skip
            return sorted(left) == ["0", "1"] and max(left.values()) < 4.0

        wait_for(spent_everywhere, what="the budget spent on both workers", state=lambda: left)
    finally:
        gateway.stop()
        engine.stop()
    assert "workers_unshared" not in (tmp_path / "gateway.log").read_text()


def test_a_killed_worker_is_replaced_and_nothing_is_refused(fleet: Fleet) -> None:
    before = fleet.snapshots_of_every_worker()
    # Admin changes made before the crash: the replacement makes them on itself too, the
    # drain's mark included (a later autoscaler finishes it by that mark).
    drained = before[0]["replicas"][0]["name"]
    for path, body in (
        (f"/admin/replicas/{drained}/drain", b'{"by": "autoscale:00000000cafe"}'),
        ("/admin/policy", json.dumps({"policy": "least_request"}).encode()),
    ):
        status, headers, answer = http("POST", fleet.gateway.url + path, body, ADMIN)
        assert status == 200 and "x-isocost-workers-failed" not in headers, answer
    os.kill(before[1]["pid"], signal.SIGKILL)
    # Until the killed worker has exited, its listening socket still takes its share of
    # new connections, and resets them as it closes: wait for it to be gone.
    wait_for(lambda: not _alive(before[1]["pid"]), 10, "the killed worker to exit")
    client = fleet.client()
    for i in range(30):  # the kernel sends new connections to the live socket only
        client.completions.create(model=MODEL, prompt=f"after the kill {i}", max_tokens=2)
    replaced: list[dict[int, dict[str, Any]]] = []

    def worker_1_is_back() -> bool:
        replaced.append(fleet.snapshots())
        return 1 in replaced[-1] and replaced[-1][1]["pid"] != before[1]["pid"]

    wait_for(
        worker_1_is_back,
        30,
        "the supervisor to start worker 1 again",
        state=lambda: [sorted(seen) for seen in replaced[-3:]],
    )
    assert replaced[-1][0]["pid"] == before[0]["pid"]  # the other one was left alone
    for snapshot in replaced[-1].values():
        states = {row["name"]: (row["state"], row["drained_by"]) for row in snapshot["replicas"]}
        assert states[drained] == ("drained", "autoscale:00000000cafe"), (
            snapshot["worker"],
            states,
        )
        assert [pool["policy"] for pool in snapshot["pools"]] == ["least_request"], snapshot

    # SIGTERM to the supervisor drains and stops every worker, exit 0.
    pids = [snapshot["pid"] for snapshot in replaced[-1].values()]
    fleet.gateway.popen.send_signal(signal.SIGTERM)
    assert fleet.gateway.popen.wait(timeout=30) == 0
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie is gone
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--workers", "0"], "--workers must be at least 1"),
        (["--worker-id", "1"], "--worker-id and --worker-dir go together"),
        (["--workers", "2", "--record", "/tmp/x"], "--record with --workers: not supported"),
    ],
)
def test_bad_worker_flags_are_one_line_and_exit_2(args: list[str], fragment: str) -> None:
    run = subprocess.run(
        [ISOCOST, "serve", "--replica", "http://127.0.0.1:9", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert fragment in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_a_bad_config_is_refused_by_the_supervisor_before_any_worker(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(
        "policy: nope\npools:\n  - model: m\n    replicas: [{url: 'http://127.0.0.1:9'}]\n"
    )
    run = subprocess.run(
        [ISOCOST, "serve", "--config", str(config), "--workers", "2", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "unknown policy 'nope'" in run.stderr
    assert "worker" not in run.stderr  # no worker was started to fail
