"""What relaying streams costs each router: CPU per streamed request at the engine's pace.

``gateway_overhead.py`` times short answers from an engine made nearly instant, where a
router's fixed cost per request is all there is. Real streams come a token at a time, tens
of milliseconds apart, for hundreds of tokens: a proxy then pays for every chunk it relays,
and an endpoint picker (Envoy relaying, ``isocost picker`` deciding) pays once per request.
This runs that case. One `isocost engine` at its modelled pace (``--time-scale 1``, one
token per SSE chunk, every answer ``--tokens`` long), and in front of it, one at a time,
each router; ``--streams`` clients each stream completions back to back for
``--duration`` seconds. Per router: requests/s, chunks per request, and the CPU each of its
processes spent per request (Linux ``/proc``, steadier than a rate on a shared machine)
and per relayed chunk. ``--rounds`` alternates the routers and keeps each one's lowest
figure (the run least disturbed by the machine's other work).

Routers: ``isocost serve``; with ``--envoy``, Envoy + ``isocost picker``
(deploy/envoy/picker.yaml; CPU of both processes) and Envoy alone (round robin, for what
Envoy's own relaying costs); with ``--peers``, sglang-router and vllm-router
(round_robin, from PyPI into ``.venv-peers``).

    .venv/bin/python benchmarks/stream_relay.py --envoy --peers --json stream_relay.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from gateway_overhead import (
    MODEL,
    _start,
    _start_peer,
    cpu_seconds,
    free_port,
    start_picker,
    stop_all,
)
from isocost.runtime.processes import run_script


@dataclass
class Router:
    name: str
    url: str
    pids: dict[str, int]  # process role (isocost, envoy, router) -> pid


@dataclass
class Run:
    rps: float
    requests: int
    chunks: int
    cpu_s: dict[str, float]  # by role, over the run


async def stream_load(url: str, streams: int, tokens: int, duration_s: float) -> tuple[int, int]:
    """``streams`` clients streaming completions back to back: (requests, chunks)."""
    body = json.dumps(
        {"model": MODEL, "prompt": "benchmark prompt " * 8, "max_tokens": tokens, "stream": True}
    ).encode()
    done = chunks = 0
    stop_at = time.perf_counter() + duration_s
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client() -> None:
            nonlocal done, chunks
            while time.perf_counter() < stop_at:
                async with session.post(
                    url + "/v1/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                ) as response:
                    if response.status != 200:
                        raise RuntimeError(f"{url}: status {response.status}")
                    async for _ in response.content.iter_any():
                        chunks += 1
                done += 1

        await asyncio.gather(*(client() for _ in range(streams)))
    return done, chunks


def measure(router: Router, streams: int, tokens: int, duration_s: float) -> Run:
    asyncio.run(stream_load(router.url, streams, tokens, 1.0))  # connections, caches
    before = {role: cpu_seconds(pid) for role, pid in router.pids.items()}
    start = time.perf_counter()
    requests, chunks = asyncio.run(stream_load(router.url, streams, tokens, duration_s))
    elapsed = time.perf_counter() - start
    used = {role: cpu_seconds(pid) - before[role] for role, pid in router.pids.items()}
    return Run(requests / elapsed, max(requests, 1), max(chunks, 1), used)


def _start_envoys(engine_url: str, workdir: Path) -> tuple[list[Callable[[], None]], list[Router]]:
    """Envoy + ``isocost picker`` over the engine, and Envoy alone."""
    from envoy_harness import envoy_config, start_envoy

    picker, picker_port = start_picker(engine_url, "equal_cost", workdir)
    stops: list[Callable[[], None]] = [picker.terminate]
    routers = []
    engine_port = int(engine_url.rsplit(":", 1)[1])
    for name, with_picker in (("envoy+picker", True), ("envoy", False)):
        envoy = start_envoy(
            envoy_config(
                listen_port=free_port(),
                admin_port=free_port(),
                picker_ports=[picker_port],
                engine_ports=[engine_port],
                picker=with_picker,
            ),
            workdir / f"{name}.yaml",
            concurrency=2,
        )
        stops.insert(0, envoy.stop)
        pids = {"envoy": envoy.popen.pid} | ({"isocost": picker.pid} if with_picker else {})
        routers.append(Router(name, envoy.url, pids))
    return stops, routers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64, help="concurrent streaming clients")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per answer")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs per router, alternated")
    parser.add_argument("--envoy", action="store_true", help="also Envoy + picker, Envoy alone")
    parser.add_argument("--peers", action="store_true", help="also sglang-router, vllm-router")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    if min(args.streams, args.tokens, args.rounds) < 1 or not args.duration > 0:
        parser.error("--streams, --tokens, --rounds and --duration must be positive")
    console = Console(width=80)

    engine, engine_url = _start(
        ["engine", "--port", "0", "--model", MODEL, "--time-scale", "1", "--output-dist",
         "max"],
        "isocost engine",
    )  # fmt: skip
    gateway, gateway_url = _start(
        ["serve", "--port", "0", "--replica", engine_url, "--log-level", "warning"],
        "isocost serve",
    )  # fmt: skip
    routers = [Router("isocost serve", gateway_url, {"isocost": gateway.pid})]
    procs = [gateway, engine]
    stops: list[Callable[[], None]] = []
    workdir = Path(tempfile.mkdtemp(prefix="isocost-stream-relay-"))
    best: dict[str, Run] = {}
    try:
        if args.envoy:
            stops, envoy_routers = _start_envoys(engine_url, workdir)
            routers += envoy_routers
        if args.peers:
            for name in ("sglang-router", "vllm-router"):
                proc, url = _start_peer(name, engine_url)
                procs.insert(0, proc)
                routers.append(Router(name, url, {"router": proc.pid}))
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("streaming", total=args.rounds * len(routers))
            for _ in range(args.rounds):
                for router in routers:
                    run = measure(router, args.streams, args.tokens, args.duration)
                    kept = best.get(router.name)
                    per_request = sum(run.cpu_s.values()) / run.requests
                    if kept is None or per_request < sum(kept.cpu_s.values()) / kept.requests:
                        best[router.name] = run
                    progress.advance(task)
    finally:
        stop_all(stops, procs, workdir)

    rows = []
    for router in routers:
        run = best[router.name]
        total_s = sum(run.cpu_s.values())
        rows.append(
            {
                "router": router.name,
                "rps": round(run.rps, 2),
                "chunks_per_request": round(run.chunks / run.requests, 1),
                "cpu_ms_per_request": round(1e3 * total_s / run.requests, 3),
                "cpu_ms_per_request_by_process": {
                    role: round(1e3 * used / run.requests, 3) for role, used in run.cpu_s.items()
                },
                "cpu_us_per_chunk": round(1e6 * total_s / run.chunks, 2),
            }
        )
    serve_ms = rows[0]["cpu_ms_per_request"]
    table = Table(
        title=f"{args.streams} streams of {args.tokens} tokens at the engine's pace, one engine"
    )
    for column in ("router", "req/s", "chunks/req", "CPU ms/req (x serve)", "µs/chunk"):
        table.add_column(column, justify="left" if column == "router" else "right")
    for row in rows:
        parts = row["cpu_ms_per_request_by_process"]
        split = " + ".join(f"{v:.1f}" for v in parts.values()) if len(parts) > 1 else ""
        table.add_row(
            str(row["router"]),
            f"{row['rps']:.1f}",
            f"{row['chunks_per_request']:.0f}",
            f"{row['cpu_ms_per_request']:.1f} ({row['cpu_ms_per_request'] / serve_ms:.2f}x)"
            + (f"\n= {split}" if split else ""),
            f"{row['cpu_us_per_chunk']:.1f}",
        )
    console.print(table)
    if args.envoy:
        console.print("Envoy + picker: Envoy's CPU + the picker's")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
        console.print(f"figures written to {args.json}")


if __name__ == "__main__":
    run_script(main)
