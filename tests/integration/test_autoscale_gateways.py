"""``isocost autoscale`` in front of two real gateways (``--gateway`` twice) over real
engines: load through the second gateway alone starts an engine (read through the first
alone, it would see no arrivals), which joins both; once the load drops, the scale-in
drains, stops and removes an engine on both (the second left listing a stopped engine
would route to it), with no request failed. One of them SIGKILLed holds every scale-in
until it is back."""

from __future__ import annotations

import signal
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from gateway_harness import log_events, metric_value, wait_for
from isocost_procs import Proc, start_isocost
from test_autoscale_cli import Load, replicas, start_autoscale, start_gateways, terminate

from isocost.runtime.processes import free_port


@pytest.mark.parametrize("resolve", [False, True], ids=["listed", "resolved"])
def test_load_through_either_gateway_scales_and_a_scale_in_leaves_both(
    tmp_path: Path, procs: list[Proc], resolve: bool
) -> None:
    """``resolved``: with ``--resolve-gateways`` the members are found again each interval
    (an IP address is itself), and a gateway found again keeps its counters."""
    a, b = start_gateways(tmp_path, procs, 2)
    load = Load(b.url)
    load.run(senders=4)
    metrics_port = free_port("127.0.0.1")
    flags = ["--gateway", b.url, "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port)]
    real, out = start_autoscale(tmp_path, a, *flags, *(["--resolve-gateways"] if resolve else []))
    try:
        both = lambda n: len(replicas(a)) == n and len(replicas(b)) == n  # noqa: E731
        wait_for(lambda: both(2), 30, "a second replica on both", state=out.read_text)
        assert {r["name"] for r in replicas(a)} == {r["name"] for r in replicas(b)}
        load.end()
        load.run(senders=1, pause_s=1.0)  # the drop: requests still in flight, through b
        wait_for(lambda: both(1), 30, "a scale-in on both", state=out.read_text)
        drains = metric_value(
            f"http://127.0.0.1:{metrics_port}", 'isocost_autoscale_drains_total{outcome="idle"}'
        )
        assert drains == 1  # its own metrics, where it was told to serve them
    finally:
        load.end()
        terminate(real)
    assert "-> drain " in out.read_text()
    assert load.statuses and set(load.statuses) == {200}, sorted(set(load.statuses))
    print(f"{len(load.statuses)} requests through the second gateway, all answered 200")


def test_a_gateway_killed_holds_every_scale_in_until_it_is_back(
    tmp_path: Path, procs: list[Proc]
) -> None:
    """SIGKILL the first gateway once the fleet has grown: the autoscaler goes on with the
    second, but its drains cannot reach the first (which may still route to the victim),
    so no replica is stopped. Restarted on its port (its admin additions lost, its
    counters back to 0), the first lists only its config's engine: the next scale-in
    drains where the victim is listed (a 404 where it is not is nothing to do) and ends,
    with no request failed."""
    a, b = start_gateways(tmp_path, procs, 2)
    load = Load(b.url)
    load.run(senders=4)
    real, out = start_autoscale(tmp_path, a, "--gateway", b.url)
    log = tmp_path / "autoscale.log"

    def drain_refused_by_a() -> bool:
        failures = log_events(log, "autoscale_failure")
        return any(f.get("action") == "drain" and a.url in f.get("error", "") for f in failures)

    try:
        wait_for(
            lambda: len(replicas(a)) == len(replicas(b)) == 2, 30, "growth", state=out.read_text
        )
        a.stop(signal.SIGKILL)
        load.end()
        load.run(senders=1, pause_s=1.0)
        wait_for(drain_refused_by_a, 30, "a drain refused by the dead gateway", state=out.read_text)
        assert len(replicas(b)) == 2  # no drain reached both: nothing stopped
        port = urlsplit(a.url).port
        config = tmp_path / "gateway.yaml"
        args = ["serve", "--config", str(config), "--port", str(port)]
        with (tmp_path / "gateway-0-restarted.log").open("a") as stderr:
            procs.append(restarted := start_isocost(args, "isocost serve", stderr=stderr))
        wait_for(lambda: len(replicas(b)) == 1, 60, "a scale-in once back", state=out.read_text)
        names = {r["name"] for r in replicas(b)}
        assert {r["name"] for r in replicas(restarted)} <= names
    finally:
        load.end()
        terminate(real)
    assert load.statuses and set(load.statuses) == {200}, sorted(set(load.statuses))
