"""A replica taken out of service is logged with why, and counted; its return is logged.

Real processes: a fake upstream (``fake_upstream``) whose ``/health`` answers 500 for a
while, ``isocost serve`` probing it every 100 ms. Before: the breaker's transitions were
in no log line (the reason only in ``/admin/replicas``' ``last_error``) and no counter.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

from fake_upstream import set_mode, start_fake_upstream
from gateway_harness import log_events as events
from gateway_harness import wait_for
from isocost_procs import Proc, start_gateway_with

MODEL = "fake-model"


def ejections(gateway: Proc) -> float:
    with urllib.request.urlopen(gateway.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.search(r'^isocost_replica_ejections_total\{[^}]*replica="r0"[^}]*\} (\S+)$', text,
                      re.MULTILINE)  # fmt: skip
    return float(found.group(1)) if found else 0.0


def test_an_ejection_is_logged_with_its_reason_counted_and_its_end_logged(tmp_path: Path) -> None:
    procs: list[Proc] = []
    upstream = start_fake_upstream()
    procs.append(upstream)
    try:
        config = (
            "health: {interval_ms: 100, timeout_ms: 500, open_ms: 200, failure_threshold: 2}\n"
            f"pools:\n  - model: {MODEL}\n    replicas:\n"
            f"      - {{url: '{upstream.url}', name: r0}}\n"
        )
        gateway = start_gateway_with(config, tmp_path, procs)
        log = tmp_path / "gateway.log"
        set_mode(upstream.url, health=500)
        wait_for(lambda: events(log, "replica_ejected"), what="the ejection logged")
        (ejected,) = events(log, "replica_ejected")
        assert ejected["replica"] == "r0" and ejected["error"] == "probe status 500"
        assert ejections(gateway) == 1
        set_mode(upstream.url, health=200)
        wait_for(lambda: events(log, "replica_restored"), what="the return logged")
        assert len(events(log, "replica_ejected")) == 1  # failed re-probes: one ejection
        assert ejections(gateway) == 1
        set_mode(upstream.url, health=500)
        wait_for(lambda: len(events(log, "replica_ejected")) == 2, what="a second ejection")
        assert ejections(gateway) == 2
    finally:
        for proc in reversed(procs):
            proc.stop()
