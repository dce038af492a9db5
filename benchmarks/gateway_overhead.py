"""What `isocost serve` adds: latency per request and the request rate it sustains.

Starts one `isocost engine` replica (``--time-scale`` small, so that the engine's own time
is a few milliseconds) and `isocost serve --replica <engine>` in front of it, then measures
both paths side by side in one run:

* latency at concurrency 1, requests interleaved (direct, gateway, direct, ...) so that
  drift hits both equally: end-to-end time of non-streamed requests, time to the first
  SSE chunk (TTFT) and end-to-end time of streamed ones; p50 and p99 of each, and what the
  gateway adds (gateway minus direct);
* throughput: a closed loop of ``--concurrency`` workers sending non-streamed requests for
  ``--duration`` seconds, direct then through the gateway, twice in alternation; the best
  of each. Requests/s and the ratio gateway/direct, and the CPU time per request of the
  isocost processes on the path (the gateway, or the picker and its relay; Envoy's own is
  not counted).

With ``--peers`` the same figures are taken, in the same run and against the same
engine, for ``sglang-router`` and ``vllm-router`` (round_robin, their cheapest policy),
installed from PyPI into their own venv ``.venv-peers`` on first use. With ``--envoy``,
for Envoy alone (round robin) and Envoy with ``isocost picker`` choosing
(deploy/envoy/picker.yaml; and its request body BUFFERED or FULL_DUPLEX_STREAMED; and
behind its native relay, ``--relay``, when ``make relay`` built it), and Envoy with a
picker that decides nothing (``null_picker.py``: Python gRPC's own cost). Envoy comes
from ``make envoy``. With ``--shadow a,b`` also the gateway whose pool
evaluates those candidate policies beside ``--policy`` (``shadow:``, each request's
decision computed by every candidate too); its replays are set an hour apart, so the
figures are the per-request cost of the shadow decisions alone.

Run:

    .venv/bin/python benchmarks/gateway_overhead.py --requests 300 --concurrency 32 --peers \
        --envoy --json overhead.json

On a small shared machine the client, the engine and the gateway compete for the same
cores; compare the two columns of one run, not runs across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from isocost.runtime.processes import run_script

ROOT = Path(__file__).resolve().parents[1]
MODEL = "llama-3.1-8b"
PEERS_VENV = ROOT / ".venv-peers"
PEER_PACKAGES = ("sglang-router==0.3.2", "vllm-router==0.1.17")
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the suites' processes and Envoy
from isocost_procs import (  # noqa: E402
    NotReady,
    children,
    cpu_seconds,
    free_port,
    ready_urls,
    spawn_ready,
)


def _peers_venv() -> Path:
    """``.venv-peers`` with the peer routers, created with pip on first use."""
    if not (PEERS_VENV / "bin" / "vllm-router").exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
        pip = [str(PEERS_VENV / "bin" / "pip"), "install", "-q", *PEER_PACKAGES]
        subprocess.run(pip, check=True)
    return PEERS_VENV / "bin"


def _start_peer(name: str, engine_url: str) -> tuple[subprocess.Popen[str], str]:
    """Start a peer router in front of ``engine_url``; wait until it forwards a request."""
    port = free_port()
    common = [
        "--host", "127.0.0.1", "--port", str(port), "--worker-urls", engine_url,
        "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    binary = _peers_venv() / name
    args = [str(binary), "launch", *common] if name == "sglang-router" else [str(binary), *common]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    proc = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, env=env
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        request = urllib.request.Request(
            url + "/v1/completions",
            data=_body(1, False),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                if response.status == 200:
                    return proc, url
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{name} did not start forwarding (exit {proc.poll()})")


def _start(args: list[str], marker: str) -> tuple[subprocess.Popen[str], str]:
    try:
        proc, (url,) = spawn_ready(args, marker, stderr=subprocess.DEVNULL)
    except NotReady as exc:
        raise SystemExit(f"isocost {args[0]} did not become ready ({exc})") from None
    return proc, url


def _start_shadowed(
    engine_url: str, policy: str, candidates: str, workdir: Path
) -> tuple[subprocess.Popen[str], str]:
    """`isocost serve` over the engine, its pool shadowing ``candidates`` (comma-separated)."""
    names = ", ".join(c.strip() for c in candidates.split(",") if c.strip())
    config = workdir / "shadow.yaml"
    config.write_text(
        f"policy: {policy}\n"
        f"pools:\n  - model: {MODEL}\n    replicas: [{{url: '{engine_url}'}}]\n"
        f"    shadow: {{policies: [{names}], interval_s: 3600}}\n"
    )
    return _start(
        ["serve", "--port", "0", "--config", str(config), "--log-level", "warning"],
        "isocost serve",
    )


def start_picker(
    engine_url: str, policy: str, workdir: Path, relay: Path | None = None
) -> tuple[subprocess.Popen[str], int]:
    """``isocost picker`` over the engine (behind ``relay``, the native relay, when
    given), once Envoy is known to be installed: the process and its port."""
    from envoy_harness import ENVOY

    if ENVOY is None:
        raise SystemExit("--envoy: no Envoy binary; run `make envoy` first")
    config = workdir / "picker.yaml"
    config.write_text(
        f"policy: {policy}\npools:\n  - model: {MODEL}\n    replicas:\n"
        f"      - {{url: '{engine_url}'}}\n"
    )
    port = free_port()
    args = ["picker", "--config", str(config), "--port", str(port), "--log-level", "warning"]
    picker, _ = _start(args + (["--relay", str(relay)] if relay else []), "isocost picker")
    return picker, port


def _start_envoy_rows(
    engine_url: str, policy: str, workdir: Path
) -> tuple[list[Callable[[], None]], dict[str, str], dict[str, tuple[int, ...]]]:
    """Envoy alone, Envoy + ``isocost picker`` with the request body STREAMED without
    waiting (deploy/envoy/picker.yaml), BUFFERED and FULL_DUPLEX_STREAMED, the same
    picker behind its native relay when ``make relay`` built it, and Envoy + a picker
    that decides nothing (``null_picker.py``, the shipped config): their stops, URLs and
    the isocost pids on each row's path (one picker serves the three)."""
    from envoy_harness import RELAY, envoy_config, start_envoy

    picker, picker_port = start_picker(engine_url, policy, workdir)
    engine_port = int(engine_url.rsplit(":", 1)[1])
    null_port = free_port()
    null_picker = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("null_picker.py")), str(null_port),
         f"127.0.0.1:{engine_port}"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    stops: list[Callable[[], None]] = [picker.terminate, null_picker.terminate]
    try:
        ready_urls(null_picker, "null picker")
    except NotReady as exc:
        null_picker.kill()
        raise SystemExit(f"the null picker did not become ready ({exc})") from None
    rows: list[tuple[str, int, dict[str, bool]]] = [
        ("envoy", picker_port, {"picker": False}),
        ("envoy+picker", picker_port, {}),
        ("envoy+picker buffered", picker_port, {"buffered": True}),
        ("envoy+picker duplex", picker_port, {"full_duplex": True}),
        ("envoy+null picker", null_port, {}),
    ]
    pids: dict[str, tuple[int, ...]] = {name: (picker.pid,) for name, _, _ in rows[1:4]}
    pids["envoy+null picker"] = (null_picker.pid,)
    if RELAY is not None:
        (workdir / "relayed").mkdir()
        relayed, relayed_port = start_picker(engine_url, policy, workdir / "relayed", RELAY)
        stops.append(relayed.terminate)
        rows.insert(4, ("envoy+picker relay", relayed_port, {}))
        pids["envoy+picker relay"] = (relayed.pid, *children(relayed.pid))
    urls = {}
    for name, port, body_mode in rows:
        envoy = start_envoy(
            envoy_config(
                listen_port=free_port(),
                admin_port=free_port(),
                picker_ports=[port],
                engine_ports=[engine_port],
                **body_mode,
            ),
            workdir / f"{name}.yaml",
            concurrency=2,
        )
        stops.insert(0, envoy.stop)
        urls[name] = envoy.url
    return stops, urls, pids


def stop_all(
    stops: list[Callable[[], None]], procs: list[subprocess.Popen[str]], workdir: Path
) -> None:
    """Stop what a run started: the Envoys and pickers, then the processes (routers
    first, the engine last), and remove its files."""
    for stop in stops:
        stop()
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=20)
    shutil.rmtree(workdir, ignore_errors=True)


def _body(max_tokens: int, stream: bool) -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "prompt": "benchmark prompt " * 8,
            "max_tokens": max_tokens,
            "stream": stream,
        }
    ).encode()


async def _one(
    session: aiohttp.ClientSession, url: str, body: bytes, stream: bool
) -> tuple[float, float]:
    """(TTFT or E2E for non-stream, E2E) in seconds."""
    start = time.perf_counter()
    first = None
    async with session.post(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    ) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: status {response.status}")
        if stream:
            async for _ in response.content.iter_any():
                if first is None:
                    first = time.perf_counter()
        else:
            await response.read()
    end = time.perf_counter()
    return (first or end) - start, end - start


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def latency(
    targets: dict[str, str], requests: int, max_tokens: int, advance: Callable[[], None]
) -> dict[str, dict[str, list[float]]]:
    samples: dict[str, dict[str, list[float]]] = {
        name: {"e2e": [], "stream_ttft": [], "stream_e2e": []} for name in targets
    }
    plain, streamed = _body(max_tokens, False), _body(max_tokens, True)
    async with aiohttp.ClientSession() as session:
        for url in targets.values():  # warm connections and caches
            for _ in range(10):
                await _one(session, url, plain, False)
                await _one(session, url, streamed, True)
        for _ in range(requests):
            for name, url in targets.items():
                _, e2e = await _one(session, url, plain, False)
                samples[name]["e2e"].append(e2e)
                ttft, e2e = await _one(session, url, streamed, True)
                samples[name]["stream_ttft"].append(ttft)
                samples[name]["stream_e2e"].append(e2e)
            advance()
    return samples


async def throughput(
    url: str, concurrency: int, duration_s: float, max_tokens: int
) -> tuple[float, int]:
    """Requests/s of a closed loop of ``concurrency`` workers, and how many were answered."""
    body = _body(max_tokens, False)
    done = 0
    stop_at = time.perf_counter() + duration_s
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                await _one(session, url, body, False)
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - start), done


def _row(
    name: str,
    percentiles: dict[str, dict[str, float]],
    rates: dict[str, float],
    cpu_us: dict[str, float],
) -> dict[str, Any]:
    """One router's JSON object: what it adds to direct (ms), its request rate and (an
    isocost gateway's or picker's) CPU time per request."""

    def added(key: str) -> float:
        return round(percentiles[key][name] - percentiles[key]["direct"], 3)

    return {
        "router": name,
        "added_p50_ms": added("e2e_p50"),
        "added_p99_ms": added("e2e_p99"),
        "stream_added_p50_ms": added("stream_ttft_p50"),
        "stream_added_p99_ms": added("stream_ttft_p99"),
        "rps": round(rates[name], 1),
        "rps_x_direct": round(rates[name] / rates["direct"], 3),
        "cpu_us_per_request": round(cpu_us[name], 1) if name in cpu_us else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="latency samples per path")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per throughput run")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--time-scale", type=float, default=0.01)
    parser.add_argument("--policy", default="equal_cost")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--peers", action="store_true", help="also measure sglang-router and vllm-router"
    )
    parser.add_argument(
        "--envoy", action="store_true", help="also measure Envoy alone and Envoy + picker"
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="also measure `isocost serve --workers N`"
    )
    parser.add_argument(
        "--shadow", help="also measure the gateway with these candidate policies (a,b)"
    )
    args = parser.parse_args()
    console = Console()

    engine, engine_url = _start(
        ["engine", "--port", "0", "--model", MODEL, "--time-scale", str(args.time_scale),
         "--output-dist", "max"],
        "isocost engine",
    )  # fmt: skip
    gateway, gateway_url = _start(
        ["serve", "--port", "0", "--replica", engine_url, "--policy", args.policy,
         "--log-level", "warning"],
        "isocost serve",
    )  # fmt: skip
    procs = [gateway, engine]
    pids = {"isocost": (gateway.pid,)}  # isocost processes whose CPU per request is measured
    targets = {"direct": engine_url, "isocost": gateway_url}
    if args.workers > 1:  # the same gateway on --workers processes sharing the port
        workers, workers_url = _start(
            ["serve", "--port", "0", "--replica", engine_url, "--policy", args.policy,
             "--log-level", "warning", "--workers", str(args.workers)],
            "isocost serve",
        )  # fmt: skip
        procs.insert(0, workers)
        targets[f"isocost x{args.workers}"] = workers_url
    stops: list[Callable[[], None]] = []
    workdir = Path(tempfile.mkdtemp(prefix="isocost-overhead-"))
    try:
        if args.shadow:
            shadowed, shadowed_url = _start_shadowed(engine_url, args.policy, args.shadow, workdir)
            procs.insert(0, shadowed)
            targets["isocost +shadow"] = shadowed_url
            pids["isocost +shadow"] = (shadowed.pid,)
        if args.envoy:
            stops, envoy_urls, picker_pids = _start_envoy_rows(engine_url, args.policy, workdir)
            targets.update(envoy_urls)
            pids.update(picker_pids)
        if args.peers:
            for name in ("sglang-router", "vllm-router"):
                proc, url = _start_peer(name, engine_url)
                procs.insert(0, proc)
                targets[name] = url
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("latency (concurrency 1)", total=args.requests)
            samples = asyncio.run(
                latency(targets, args.requests, args.max_tokens, lambda: progress.advance(task))
            )
            rates: dict[str, float] = {name: 0.0 for name in targets}
            cpu_us: dict[str, float] = {}  # the lowest of the runs, as rates take the highest
            runs = progress.add_task("throughput", total=2 * len(targets))
            for _ in range(2):
                for name, url in targets.items():
                    on_path = pids.get(name, ())
                    cpu_before = sum(map(cpu_seconds, on_path))
                    rate, done = asyncio.run(
                        throughput(url, args.concurrency, args.duration, args.max_tokens)
                    )
                    rates[name] = max(rates[name], rate)
                    if on_path:
                        used_s = sum(map(cpu_seconds, on_path)) - cpu_before
                        used = 1e6 * used_s / max(1, done)
                        cpu_us[name] = min(cpu_us.get(name, used), used)
                    progress.advance(runs)
    finally:
        stop_all(stops, procs, workdir)

    table = Table(title=f"Gateway overhead ({args.requests} requests per path, one engine)")
    table.add_column("metric")
    for name in targets:
        table.add_column(name if name == "direct" else f"{name} (added)", justify="right")
    percentiles: dict[str, dict[str, float]] = {}
    for metric, label in (
        ("e2e", "non-stream E2E"),
        ("stream_ttft", "stream TTFT"),
        ("stream_e2e", "stream E2E"),
    ):
        for q, q_name in ((0.5, "p50"), (0.99, "p99")):
            values = {name: _pct(samples[name][metric], q) * 1000 for name in targets}
            percentiles[f"{metric}_{q_name}"] = values
            direct = values["direct"]
            table.add_row(
                f"{label} {q_name} (ms)",
                *(
                    f"{v:.2f}" if name == "direct" else f"{v:.2f} ({v - direct:+.2f})"
                    for name, v in values.items()
                ),
            )
    table.add_row(
        f"requests/s, {args.concurrency} concurrent (x direct)",
        *(
            f"{rate:.0f}" if name == "direct" else f"{rate:.0f} ({rate / rates['direct']:.2f}x)"
            for name, rate in rates.items()
        ),
    )
    table.add_row(
        "isocost CPU µs/request (x isocost)",
        *(
            "–"
            if name not in cpu_us
            else f"{cpu_us[name]:.0f}"
            if name == "isocost"
            else f"{cpu_us[name]:.0f} ({cpu_us[name] / cpu_us['isocost']:.2f}x)"
            for name in targets
        ),
    )
    console.print(table)
    if args.json:
        rows = [_row(name, percentiles, rates, cpu_us) for name in targets]
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
        console.print(f"figures written to {args.json}")
    sys.exit(0)


if __name__ == "__main__":
    run_script(main)
