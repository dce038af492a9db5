"""``isocost demo --discovery etcd`` end to end: real etcd, engines, agents and a gateway;
a replica joins and one drains and leaves while traffic runs, and nothing fails."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from etcd_server import ETCD
from isocost_procs import ISOCOST


@pytest.mark.skipif(ETCD is None, reason="no etcd binary (make test installs it)")
def test_replicas_join_and_leave_while_traffic_runs(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    done = subprocess.run(
        [
            ISOCOST,
            "demo",
            "--discovery",
            "etcd",
            "--duration",
            "9",
            "--rate",
            "4",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "discovery.json").read_text())
    events = [(e["replica"], e["event"]) for e in report["timeline"]]
    assert ("h100-0", "joined") in events and ("a100-0", "left") in events
    joined_at = next(e["t_s"] for e in report["timeline"] if e["replica"] == "h100-0")
    left_at = next(e["t_s"] for e in report["timeline"] if e["event"] == "left")
    assert 0 < joined_at < left_at
    summary = report["summary"]
    assert summary["errors"] == 0 and summary["completed"] == summary["requests"] > 0
    assert set(summary["completed_by_replica"]) == {"a100-0", "a100-1", "h100-0"}
    assert f"{summary['completed']} of {summary['requests']} requests completed" in done.stdout


def test_an_unknown_discovery_provider_is_one_line() -> None:
    done = subprocess.run(
        [ISOCOST, "demo", "--discovery", "consul"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "error: --discovery 'consul': the only one is etcd"
