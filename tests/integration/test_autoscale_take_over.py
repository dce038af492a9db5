"""``isocost autoscale --actuator local`` SIGKILLed leaves its engines running (each in a
session of its own) and, here, one of them drained: the next autoscaler started with the
same ``--log-dir`` finishes that drain, stops the engine's process and removes it from
the gateway, instead of leaving it drained, unseen and running."""

from __future__ import annotations

from pathlib import Path

from gateway_harness import http, wait_for
from isocost_procs import Proc
from test_autoscale_cli import ADMIN_TOKEN, Load, cluster, replicas, start_autoscale, terminate

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
