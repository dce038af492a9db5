"""How many concurrent SSE streams one core of `isocost engine` sustains, 8 replicas.

Starts `isocost engine --replicas 8` pinned to CPU 0 (taskset) and ``--clients``
closed-loop client processes pinned to the other CPUs, that keep C streams open (C/8 per
replica), each a streaming completion of ``--max-tokens`` tokens with ``ignore_eos``. For
each C it reports SSE chunks and tokens per second received, the engine's CPU use (share
of its one core, from /proc), chunks per engine CPU-second (the figure that does not
depend on how fast the clients read), and the *lag*: client-observed end-to-end latency
over the engine's modelled one (its ``vllm:e2e_request_latency_seconds`` histograms). A
lag near 1 means streams keep real time; it grows once the engine or the clients saturate
(engine CPU near 100% says which). Run:

    .venv/bin/python benchmarks/engine_throughput.py --concurrency 64,256,1024

Figures depend on the machine; compare rows of one run, not runs across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from isocost.runtime.processes import dies_with, run_script

ROOT = Path(__file__).resolve().parents[1]
ISOCOST = ROOT / ".venv" / "bin" / "isocost"
REPLICAS = 8
PIN = bool(shutil.which("taskset")) and (os.cpu_count() or 1) > 1  # engine CPU 0, client CPU 1


def _start_engine(
    time_scale: float, stream_interval: int
) -> tuple[subprocess.Popen[str], list[str]]:
    pin = ["taskset", "-c", "0"] if PIN else []
    cmd = [
        *pin, str(ISOCOST), "engine", "--port", "0", "--replicas", str(REPLICAS),
        "--time-scale", str(time_scale), "--stream-interval", str(stream_interval),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    urls = [proc.stdout.readline().rsplit(" ready at ", 1)[1].strip() for _ in range(REPLICAS)]
    return proc, urls


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _modelled_e2e(urls: list[str]) -> tuple[float, float]:
    """(sum, count) of the engine's e2e histograms over every replica."""
    total = count = 0.0
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name == "vllm:e2e_request_latency_seconds":
                for s in family.samples:
                    if s.name.endswith("_sum"):
                        total += s.value
                    elif s.name.endswith("_count"):
                        count += s.value
    return total, count


def _client(job: tuple[int, list[str], int, int, float]) -> tuple[int, int, float, int]:
    """One client process: pin it, then run its share of the streams."""
    cpu, urls, concurrency, max_tokens, duration_s = job
    if PIN:
        os.sched_setaffinity(0, {cpu})
    return asyncio.run(_load(urls, concurrency, max_tokens, duration_s))


async def _load(
    urls: list[str], concurrency: int, max_tokens: int, duration_s: float
) -> tuple[int, int, float, int]:
    """(chunks, tokens, summed client e2e of finished streams, finished streams)."""
    chunks = tokens = finished = 0
    e2e_total = 0.0
    deadline = time.monotonic() + duration_s
    body = {
        "model": "llama-3.1-8b", "prompt": "Benchmark the engine simulator please.",
        "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip

    async def worker(session: aiohttp.ClientSession, url: str) -> None:
        nonlocal chunks, tokens, finished, e2e_total
        while time.monotonic() < deadline:
            start = time.monotonic()
            async with session.post(f"{url}/v1/completions", json=body) as response:
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        chunks += 1
            e2e_total += time.monotonic() - start
            finished += 1
            tokens += max_tokens

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session, urls[i % len(urls)]) for i in range(concurrency)))
    return chunks, tokens, e2e_total, finished


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="64,256,1024", help="Total open streams.")
    parser.add_argument("--stream-interval", default="1,8", help="Tokens per SSE chunk.")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--duration", type=float, default=8.0, help="Seconds of load per row.")
    parser.add_argument("--clients", type=int, default=1, help="Client processes.")
    args = parser.parse_args()
    client_cpus = list(range(1, os.cpu_count() or 2)) or [0]
    table = Table(title=f"isocost engine, {REPLICAS} replicas on one core")
    columns = ("streams", "interval", "chunks/s", "tokens/s", "engine CPU", "chunks/CPU-s", "lag")
    for column in columns:
        table.add_column(column, justify="right")
    for interval in (int(v) for v in args.stream_interval.split(",")):
        for concurrency in (int(v) for v in args.concurrency.split(",")):
            proc, urls = _start_engine(args.time_scale, interval)
            try:
                cpu_before, wall_before = _cpu_s(proc.pid), time.monotonic()
                jobs = [
                    (
                        client_cpus[i % len(client_cpus)],
                        urls,
                        concurrency // args.clients,
                        args.max_tokens,
                        args.duration,
                    )
                    for i in range(args.clients)
                ]
                with multiprocessing.Pool(args.clients, initializer=dies_with(os.getpid())) as pool:
                    results = pool.map(_client, jobs)
                chunks, tokens, finished = (sum(r[i] for r in results) for i in (0, 1, 3))
                e2e = sum(r[2] for r in results)
                wall = time.monotonic() - wall_before
                cpu = _cpu_s(proc.pid) - cpu_before
                modelled, count = _modelled_e2e(urls)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)
                assert proc.stdout is not None
                proc.stdout.close()
            lag = (e2e / finished) / (modelled / count) if finished and count else float("nan")
            table.add_row(
                str(concurrency), str(interval), f"{chunks / wall:,.0f}", f"{tokens / wall:,.0f}",
                f"{cpu / wall:.0%}", f"{chunks / cpu:,.0f}", f"{lag:.2f}",
            )  # fmt: skip
    Console().print(table)
    Console().print(" ".join(["command:", sys.executable, *sys.argv]), soft_wrap=True)


if __name__ == "__main__":
    run_script(main)
