"""``isocost autoscale`` in front of two real gateways (``--gateway`` twice) over real
engines: load through the second gateway alone starts an engine (read through the first
alone, it would see no arrivals), which joins both; once the load drops, the scale-in
drains, stops and removes an engine on both (the second left listing a stopped engine
would route to it), with no request failed."""

from __future__ import annotations

from pathlib import Path

import pytest
from gateway_harness import metric_value, wait_for
from isocost_procs import Proc
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
