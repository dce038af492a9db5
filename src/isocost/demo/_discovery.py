"""``isocost demo --discovery etcd``: replicas join and leave the gateway while traffic runs.

It starts a real etcd (Debian's ``etcd-server``) on free ports, three ``isocost engine``
processes (two A100s, one H100), a gateway whose only replicas are those registered in
etcd, and an ``isocost agent`` for each of the first two engines. Then it replays the
scenario mix through the gateway for ``duration_s`` and, a third of the way in, starts the
third engine's agent (the H100 joins), and two thirds in sends the first agent SIGTERM (it
marks its replica draining, waits until the engine is idle, deregisters). It prints when
each replica joined and left (from the gateway's own log), where the requests went and how
many failed, and writes ``discovery.json`` (the bench summary and the timeline).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from isocost.bench import BenchOptions, BenchResult, WorkloadSpec, build_workload, run_bench
from isocost.runtime.processes import Service, ServiceError, Services, free_port
from isocost.workload import SyntheticSpec

__all__ = ["DiscoveryDemoOptions", "run_discovery_demo"]

MODEL = "llama-3.1-8b"
_HOST = "127.0.0.1"
_START_TIMEOUT_S = 60.0
_LAYOUT = (("a100-0", "a100-80g"), ("a100-1", "a100-80g"), ("h100-0", "h100-80g"))


@dataclass(frozen=True, slots=True)
class DiscoveryDemoOptions:
    out_dir: Path
    duration_s: float = 30.0
    rate_rps: float = 6.0
    seed: int = 0
    ttl_s: int = 2


def _start_etcd(services: Services, data_dir: Path) -> tuple[Service, str]:
    binary = shutil.which("etcd")
    if binary is None:
        raise ServiceError("the discovery demo needs etcd: apt-get install etcd-server")
    client = f"http://{_HOST}:{free_port(_HOST)}"
    peer = f"http://{_HOST}:{free_port(_HOST)}"
    args = ["--data-dir", str(data_dir), "--listen-client-urls", client]
    args += ["--advertise-client-urls", client, "--listen-peer-urls", peer]
    args += ["--initial-advertise-peer-urls", peer, "--initial-cluster", f"default={peer}"]
    service = services.start("etcd", args, program=[binary])
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if service.popen.poll() is not None:
            raise ServiceError(f"etcd exited; its log ends with:\n{service.log_tail()}")
        try:
            with urllib.request.urlopen(client + "/health", timeout=2) as response:
                if json.loads(response.read()).get("health") == "true":
                    return service, client
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(0.1)
    raise ServiceError("etcd did not answer /health in time")


def _routable(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return int(json.loads(response.read())["routable_replicas"])
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return 0


def _wait(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not check():
        if time.monotonic() > deadline:
            raise ServiceError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _timeline(log: Path, started_at: float) -> list[tuple[float, str, str]]:
    """(seconds since the traffic began, joined|left, replica) from the gateway's log."""
    events = {"replica_added": "joined", "replica_removed": "left"}
    rows = []
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") in events:
            rows.append((entry["ts"] - started_at, events[entry["event"]], entry["replica"]))
    return rows


def run_discovery_demo(options: DiscoveryDemoOptions, console: Console) -> Path:
    """Run it; the path of ``discovery.json``."""
    out = options.out_dir
    out.mkdir(parents=True, exist_ok=True)
    services = Services(out / "logs")
    try:
        _, etcd_url = _start_etcd(services, out / "etcd-data")
        engines = []
        for name, gpu in _LAYOUT:
            args = ["engine", "--port", "0", "--model", MODEL, "--gpu", gpu, "--time-scale", "0.5"]
            engines.append(services.start(f"engine-{name}", args))
        urls = [engine.wait_ready(1, _START_TIMEOUT_S)[0] for engine in engines]
        config = out / "gateway.yaml"
        config.write_text(f"discovery:\n  etcd: {{endpoints: ['{etcd_url}']}}\n")
        gateway = services.start("gateway", ["serve", "--config", str(config), "--port", "0"])
        gateway_url = gateway.wait_ready(1, _START_TIMEOUT_S)[0]

        def agent(i: int) -> Service:
            name, gpu = _LAYOUT[i]
            args = ["agent", "--engine", urls[i], "--etcd", etcd_url, "--name", name]
            args += ["--gpu", gpu, "--ttl", str(options.ttl_s)]
            return services.start(f"agent-{name}", args)

        first = [agent(0), agent(1)]
        _wait(lambda: _routable(gateway_url) == 2, "the first two replicas")
        console.print(
            f"etcd {etcd_url}, gateway {gateway_url}: a100-0 and a100-1 registered;"
            f" h100-0 joins at {options.duration_s / 3:.0f} s, a100-0 drains and leaves"
            f" at {2 * options.duration_s / 3:.0f} s",
            highlight=False,
        )
        started_at = time.time()
        result = asyncio.run(_traffic(gateway_url, options, lambda: agent(2), first[0], services))
        _wait(lambda: _routable(gateway_url) == 2, "a100-0 to leave")
        timeline = _timeline(gateway.log_path, started_at)
    finally:
        services.stop_all()
    _print(console, result, timeline)
    path = out / "discovery.json"
    summary = msgspec.to_builtins(result.summary)
    path.write_text(
        json.dumps(
            {
                "summary": summary,
                "timeline": [
                    {"t_s": round(t, 3), "event": e, "replica": r} for t, e, r in timeline
                ],
            },
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )
    return path


async def _traffic(
    gateway_url: str,
    options: DiscoveryDemoOptions,
    join: Callable[[], Service],
    leaving: Service,
    services: Services,
) -> BenchResult:
    """The replay, with the join a third of the way in and the drain two thirds in."""
    workload = WorkloadSpec(
        synthetic=SyntheticSpec("mix"), rate_rps=options.rate_rps, seed=options.seed
    )
    bench = BenchOptions(model=MODEL, duration_s=options.duration_s, label="discovery")
    run = asyncio.create_task(run_bench(gateway_url, build_workload(workload, False), bench))
    await asyncio.sleep(options.duration_s / 3)
    await asyncio.to_thread(join)
    await asyncio.sleep(options.duration_s / 3)
    await asyncio.to_thread(services.stop, leaving)  # SIGTERM: drain, then deregister
    return await run


def _print(console: Console, result: BenchResult, timeline: list[tuple[float, str, str]]) -> None:
    events = Table(title="membership while traffic ran (the gateway's log)")
    for column in ("t s", "replica", "event"):
        events.add_column(column, justify="right" if column == "t s" else "left")
    for t, event, replica in timeline:
        events.add_row(f"{t:+.1f}", replica, event)
    console.print(events)
    summary = result.summary
    by_replica = ", ".join(f"{k} {n}" for k, n in summary.completed_by_replica.items())
    console.print(
        f"{summary.completed} of {summary.requests} requests completed, {summary.errors} errors;"
        f" by replica: {by_replica or '-'}",
        highlight=False,
    )
