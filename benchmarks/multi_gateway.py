"""Several gateways over one cluster: one gateway, three unshared, three sharing the bus.

Starts a real Redis (Debian's ``redis-server``), then, in one run, replays the same
synthetic workload (``isocost bench``, shared-prefix, Poisson arrivals, the same seed),
each time against a fresh `isocost engine` process serving ``--replicas`` simulated A100
replicas, the last one slowed (``--slowdown``), so that no scenario finds the prefixes an
earlier one left cached, through:

* ``one``: one `isocost serve`;
* ``unshared``: three gateways, each seeing only its own dispatches (and the scrapes);
* ``shared``: three gateways with ``state_bus`` pointing at the Redis.

The load is spread round-robin over the gateways (``isocost bench --url A --url B --url
C``), as an L4 balancer would. Per scenario: bench's summary, ``imbalance_cov`` (coefficient
of variation, over the replicas, of the request-seconds each served: the sum of its
requests' end-to-end times, from bench's records) and, with the bus,
``view_divergence_p99`` (p99 of every gateway's ``isocost_view_divergence`` gauges, sampled
every 100 ms while the load runs) and ``bus_lag_p50_s`` (median time from a gateway's
publish to a peer's receipt, the upper bound of its ``isocost_state_bus_lag_seconds``
bucket); both null without a bus.

Run:

    .venv/bin/python benchmarks/multi_gateway.py --requests 600 --rate 20 --json out.json

On a small shared machine the client, the engines and three gateways compete for the same
cores; compare the columns of one run, not runs across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from isocost.runtime.processes import run_script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the suites' processes
from isocost_procs import ISOCOST, NotReady, free_port, spawn_ready  # noqa: E402

MODEL = "llama-3.1-8b"
SCENARIOS = (("one", 1, False), ("unshared", 3, False), ("shared", 3, True))
GROUPS = 8  # shared-prefix groups: system prompts that requests of a group share


def _start_redis(work_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("no redis-server binary: apt-get install redis-server (make redis)")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(work_dir),
         "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    raise SystemExit("redis-server did not answer")


def _start(args: list[str], marker: str, count: int = 1) -> tuple[subprocess.Popen[str], list[str]]:
    try:
        return spawn_ready(args, marker, count, stderr=subprocess.DEVNULL)
    except NotReady as exc:
        raise SystemExit(f"isocost {args[0]} did not become ready ({exc})") from None


def _gateway_yaml(engines: list[str], bus_url: str | None) -> str:
    replicas = "\n".join(f"      - {{url: '{url}'}}" for url in engines)
    bus = f"state_bus: {{url: '{bus_url}'}}\n" if bus_url else ""
    return f"policy: equal_cost\npools:\n  - model: {MODEL}\n    replicas:\n{replicas}\n{bus}"


async def _sample_divergence(urls: list[str], stop: asyncio.Event, into: list[float]) -> None:
    """Every 100 ms, every gateway's ``isocost_view_divergence`` values, into ``into``."""
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            for url in urls:
                async with session.get(url + "/metrics") as response:
                    text = await response.text()
                into.extend(
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("isocost_view_divergence{")
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)


async def _bench(command: list[str], gateways: list[str], sample: bool) -> list[float]:
    """Run ``isocost bench`` to its end; the divergence samples taken meanwhile."""
    samples: list[float] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_divergence(gateways, stop, samples)) if sample else None
    proc = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await proc.communicate()
    stop.set()
    if sampler is not None:
        await sampler
    if proc.returncode != 0:
        raise SystemExit(f"isocost bench failed: {stderr.decode().strip()}")
    return samples


def _imbalance_cov(records: Path, replicas: list[str]) -> float:
    """CoV over ``replicas`` of the request-seconds each served."""
    busy = dict.fromkeys(replicas, 0.0)
    for line in records.read_text().splitlines():
        record = json.loads(line)
        if record.get("replica") in busy and record.get("end_s") is not None:
            busy[record["replica"]] += record["end_s"] - record["sent_s"]
    values = list(busy.values())
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else 0.0


def _lag_p50_s(urls: list[str]) -> float | None:
    """Median state-bus lag over every gateway's ``isocost_state_bus_lag_seconds``: the
    upper bound of the bucket that holds it."""
    counts: dict[float, float] = {}
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        for line in text.splitlines():
            if line.startswith("isocost_state_bus_lag_seconds_bucket{"):
                bound = float(line.split('le="', 1)[1].split('"', 1)[0])
                counts[bound] = counts.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    total = counts.get(math.inf, 0.0)
    return next((b for b in sorted(counts) if counts[b] >= total / 2), None) if total else None


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0


def _scenario(
    name: str, count: int, shared: bool, engines: list[str], bus_url: str, args: Any, tmp: Path
) -> dict[str, Any]:
    config = tmp / f"{name}.yaml"
    config.write_text(_gateway_yaml(engines, bus_url if shared else None))
    gateways = [
        _start(["serve", "--config", str(config), "--port", "0", "--log-level", "warning"],
               "isocost serve")
        for _ in range(count)
    ]  # fmt: skip
    urls = [found[0] for _, found in gateways]
    summary, records = tmp / f"{name}.json", tmp / f"{name}.jsonl"
    command = [ISOCOST, "bench", *(part for url in urls for part in ("--url", url))]
    command += [
        "--workload", "shared-prefix", "--rate", str(args.rate), "--seed", str(args.seed),
        "--max-requests", str(args.requests), "--max-tokens", str(args.max_tokens),
        "--groups", str(GROUPS), "--prompts-per-group", str(-(-args.requests // GROUPS)),
        "--system-tokens", "1024", "--question-tokens", "64",
        "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms),
        "--label", name, "--json", str(summary), "--records", str(records),
    ]  # fmt: skip
    try:
        samples = asyncio.run(_bench(command, urls, shared))
        lag_p50_s = _lag_p50_s(urls) if shared else None
    finally:
        for proc, _ in gateways:
            proc.terminate()
            proc.wait(timeout=20)
    figures: dict[str, Any] = json.loads(summary.read_text())
    for key in ("ttft_samples_s", "e2e_samples_s"):  # kept in bench's own file, not here
        figures.pop(key, None)
    names = [url.removeprefix("http://") for url in engines]
    figures["imbalance_cov"] = round(_imbalance_cov(records, names), 4)
    figures["view_divergence_p99"] = _p99(samples) if shared else None
    figures["bus_lag_p50_s"] = lag_p50_s
    return figures


def _table(results: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="One gateway, three unshared, three sharing the bus")
    table.add_column("metric")
    for name in results:
        table.add_column(name, justify="right")

    def row(label: str, key: str, scale: float = 1.0, digits: int = 3) -> None:
        cells = []
        for figures in results.values():
            value = figures.get(key)
            cells.append("-" if value is None else f"{value * scale:.{digits}f}")
        table.add_row(label, *cells)

    row("completed", "completed", digits=0)
    row("errors", "errors", digits=0)
    row("TTFT p50 (ms)", "ttft_p50_s", 1000, 1)
    row("TTFT p99 (ms)", "ttft_p99_s", 1000, 1)
    row("E2E p99 (ms)", "e2e_p99_s", 1000, 1)
    row("goodput (req/s)", "goodput_rps", digits=2)
    row("imbalance CoV", "imbalance_cov")
    row("view divergence p99", "view_divergence_p99", digits=1)
    row("bus lag p50 (ms, <=)", "bus_lag_p50_s", 1000, 2)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--slowdown", type=float, default=3.0, help="of the last replica")
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--rate", type=float, default=20.0, help="requests/s")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory(prefix="isocost-multi-gateway-") as work:
        tmp = Path(work)
        redis, bus_url = _start_redis(tmp)
        specs = ["--replica-spec", "gpu=a100-80g"] * (args.replicas - 1)
        specs += ["--replica-spec", f"gpu=a100-80g,slowdown={args.slowdown}"]
        try:
            results = {}
            for name, count, shared in SCENARIOS:
                console.print(f"{name}: {count} gateway(s)" + (", state bus" if shared else ""))
                # a fresh cluster each: no scenario finds the prefixes an earlier one cached
                engine, engines = _start(
                    ["engine", "--port", "0", "--model", MODEL, "--output-dist", "max", *specs],
                    "isocost engine",
                    count=args.replicas,
                )
                try:
                    results[name] = _scenario(name, count, shared, engines, bus_url, args, tmp)
                finally:
                    engine.terminate()
                    engine.wait(timeout=20)
        finally:
            redis.terminate()
            redis.wait(timeout=20)
    console.print(_table(results))
    one, shared = results["one"], results["shared"]
    if one["ttft_p99_s"] and one["goodput_rps"]:
        console.print(
            f"shared vs one: TTFT p99 {shared['ttft_p99_s'] / one['ttft_p99_s']:.2f}x, "
            f"goodput {shared['goodput_rps'] / one['goodput_rps']:.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        console.print(f"figures written to {args.json}")


if __name__ == "__main__":
    run_script(main)
