"""Does watching etcd cost a gateway request latency? Static vs discovered, side by side.

Starts a real etcd (Debian's ``etcd-server``), one `isocost engine` replica (``--time-scale``
small: the engine's own time is a few milliseconds), a second engine process serving
``--churn-replicas`` idle replicas, and three gateways in front of the first engine: two with
it in a static pool, one that learns it from etcd (as `isocost agent` would write it). While
requests run, a writer keeps registrations churning in etcd (``--churn-rate`` puts or
deletes per second of the idle replicas, which join and leave a second pool), so the
watching gateway applies membership changes all along. Requests go to both gateways at
concurrency 1, interleaved (static, discovered, static, ...) so that drift hits both
equally; a third gateway, static like the first, measures the run's own noise. "No
measurable latency" means discovered - static is within static-2 - static.

Run:

    .venv/bin/python benchmarks/discovery/watch_overhead.py --requests 400 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from isocost.runtime.discovery.records import Registration
from isocost.runtime.etcd import EtcdClient
from isocost.runtime.processes import run_script

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the suites' processes
from isocost_procs import NotReady, free_port, spawn_ready  # noqa: E402

MODEL = "llama-3.1-8b"
CHURN_MODEL = "churn"
PREFIX = "/isocost-bench"


def _start_etcd(data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    etcd = shutil.which("etcd")
    if etcd is None:
        raise SystemExit("no etcd binary: apt-get install etcd-server (make etcd)")
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [etcd, "--data-dir", str(data_dir), "--listen-client-urls", client,
         "--advertise-client-urls", client, "--listen-peer-urls", peer,
         "--initial-advertise-peer-urls", peer, "--initial-cluster", f"default={peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return proc, client


def _start(args: list[str], marker: str, count: int = 1) -> tuple[subprocess.Popen[str], list[str]]:
    try:
        return spawn_ready(args, marker, count, stderr=subprocess.DEVNULL)
    except NotReady as exc:
        raise SystemExit(f"isocost {args[0]} did not become ready ({exc})") from None


def _body(max_tokens: int) -> bytes:
    prompt = "benchmark prompt " * 8
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}).encode()


async def _wait_routable(session: aiohttp.ClientSession, url: str, body: bytes) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            async with session.post(url + "/v1/completions", data=body) as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise SystemExit(f"{url} never routed a request")


async def _churn(
    client: EtcdClient, urls: list[str], rate: float, seed: int, changes: list[int]
) -> None:
    """Put or delete a random idle replica's registration ``rate`` times a second,
    counting them in ``changes[0]``."""
    rng = random.Random(seed)
    present: set[int] = set()
    while True:
        i = rng.randrange(len(urls))
        key = f"{PREFIX}/replicas/churn-{i}"
        if i in present:
            await client.delete(key)
            present.discard(i)
        else:
            record = Registration(
                name=f"churn-{i}", url=urls[i], models=[CHURN_MODEL], cost_model=MODEL
            )
            await client.put(key, record.encode())
            present.add(i)
        changes[0] += 1
        await asyncio.sleep(1 / rate)


async def _measure(
    targets: dict[str, str], requests: int, max_tokens: int
) -> dict[str, list[float]]:
    body = _body(max_tokens)
    samples: dict[str, list[float]] = {name: [] for name in targets}
    async with aiohttp.ClientSession(headers={"Content-Type": "application/json"}) as session:
        for url in targets.values():
            await _wait_routable(session, url, body)
            for _ in range(20):  # warm connections
                async with session.post(url + "/v1/completions", data=body) as response:
                    await response.read()
        for _ in range(requests):
            for name, url in targets.items():
                started = time.perf_counter()
                async with session.post(url + "/v1/completions", data=body) as response:
                    await response.read()
                    if response.status != 200:
                        raise SystemExit(f"{name}: HTTP {response.status}")
                samples[name].append(time.perf_counter() - started)
    return samples


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    procs: list[subprocess.Popen[Any]] = []
    try:
        etcd, etcd_url = _start_etcd(workdir / "etcd")
        procs.append(etcd)
        engine_args = ["engine", "--port", "0", "--model", MODEL, "--time-scale", "0.01"]
        engine, (engine_url,) = _start(engine_args, "isocost engine")
        procs.append(engine)
        idle, idle_urls = _start(
            [*engine_args, "--replicas", str(args.churn_replicas)],
            "isocost engine",
            args.churn_replicas,
        )
        procs.append(idle)
        common = "scrape_interval_ms: 200\nhealth: {interval_ms: 500}\n"
        static = workdir / "static.yaml"
        static.write_text(
            common + f"pools: [{{model: {MODEL}, replicas: [{{url: '{engine_url}'}}]}}]\n"
        )
        watching = workdir / "discovery.yaml"
        watching.write_text(
            common + f"discovery: {{etcd: {{endpoints: ['{etcd_url}'], prefix: {PREFIX}}}}}\n"
        )
        gateways = {}
        for name, config in (("static", static), ("discovered", watching), ("static-2", static)):
            proc, (url,) = _start(
                ["serve", "--config", str(config), "--port", "0"], "isocost serve"
            )
            procs.append(proc)
            gateways[name] = url
        client = EtcdClient([etcd_url])
        record = Registration(name="engine", url=engine_url, models=[MODEL])
        await client.put(f"{PREFIX}/replicas/engine", record.encode())
        changes = [0]
        churn = asyncio.create_task(_churn(client, idle_urls, args.churn_rate, args.seed, changes))
        samples = await asyncio.wait_for(
            _measure(gateways, args.requests, args.max_tokens), timeout=600
        )
        churn.cancel()
        await asyncio.gather(churn, return_exceptions=True)
        await client.close()
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=20)
    figures: dict[str, Any] = {
        "requests_per_gateway": args.requests,
        "churn_rate_per_s": args.churn_rate,
        "churn_replicas": args.churn_replicas,
        "membership_changes": changes[0],
    }
    for name, values in samples.items():
        figures[name] = {
            "p50_ms": round(_pct(values, 0.5) * 1000, 3),
            "p99_ms": round(_pct(values, 0.99) * 1000, 3),
        }
    for q in ("p50_ms", "p99_ms"):
        figures[f"added_{q}"] = round(figures["discovered"][q] - figures["static"][q], 3)
        figures[f"noise_{q}"] = round(figures["static-2"][q] - figures["static"][q], 3)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="samples per gateway")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--churn-rate", type=float, default=20.0, help="etcd changes per s")
    parser.add_argument("--churn-replicas", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    if args.requests < 10 or args.churn_rate <= 0 or args.churn_replicas < 1:
        sys.exit("error: --requests >= 10, --churn-rate > 0, --churn-replicas >= 1")
    with tempfile.TemporaryDirectory(prefix="isocost-discovery-bench-") as tmp:
        figures = asyncio.run(run(args, Path(tmp)))
    table = Table(title="request latency, static vs discovered (etcd watch + churn)")
    for column in ("gateway", "p50 ms", "p99 ms"):
        table.add_column(column, justify="right" if column != "gateway" else "left")
    for name in ("static", "discovered", "static-2"):
        table.add_row(name, f"{figures[name]['p50_ms']:.2f}", f"{figures[name]['p99_ms']:.2f}")
    table.add_row(
        "discovered - static", f"{figures['added_p50_ms']:+.2f}", f"{figures['added_p99_ms']:+.2f}"
    )
    table.add_row(
        "static-2 - static (noise)",
        f"{figures['noise_p50_ms']:+.2f}",
        f"{figures['noise_p99_ms']:+.2f}",
    )
    console = Console(width=80)
    console.print(table)
    console.print(
        f"{figures['membership_changes']} membership changes applied meanwhile"
        f" ({args.churn_rate:g}/s over {args.churn_replicas} idle replicas)"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
        console.print(f"figures written to {args.json}")


if __name__ == "__main__":
    run_script(main)
