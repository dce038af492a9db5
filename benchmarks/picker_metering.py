"""What metering an answer costs Envoy + ``isocost picker``.

A request without ``max_tokens`` from an API key with a token budget is metered: its
answer's body goes to the picker on a second, observing ext_proc stream (the ``metered``
route of deploy/envoy/picker.yaml) so that the key is charged its output. This runs the
same streamed chats, uncapped, through one Envoy and one picker over one engine, from a
key with a token budget (``metered``) and from one without (``plain``), as a closed loop
of ``--concurrency`` clients for ``--duration`` seconds each, alternated ``--rounds``
times; per key: requests/s (the best round), the picker's CPU per request and per
output token (the lowest round), and the output tokens per request (the engine draws
them from one seeded distribution, so both keys get the same lengths on average).
``--relay``: the picker behind its native relay (``make relay``), whose CPU is counted
with the picker's.

Run (after ``make envoy``):

    .venv/bin/python benchmarks/picker_metering.py [--relay] --json metering.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

from isocost.runtime.processes import run_script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the suites' processes and Envoy

from envoy_harness import missing_binary, picker_behind_envoy  # noqa: E402
from isocost_procs import children, cpu_seconds, start_isocost  # noqa: E402

MODEL = "llama-3.1-8b"
KEYS = {"metered": "sk-bench-metered", "plain": "sk-bench-plain"}


async def _chat(session: aiohttp.ClientSession, url: str, key: str) -> int:
    """One streamed chat without max_tokens; its output tokens (its usage)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "meter me"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as reply:
        data = await reply.read()
    if reply.status != 200:
        raise SystemExit(f"HTTP {reply.status}: {data[:200]!r}")
    events = [line[6:] for line in data.splitlines() if line.startswith(b"data: {")]
    return int(json.loads(events[-1])["usage"]["completion_tokens"])


async def _loop(url: str, key: str, concurrency: int, duration_s: float) -> tuple[float, int, int]:
    """Requests/s of a closed loop, the requests answered and their output tokens."""
    done = tokens = 0
    stop_at = time.perf_counter() + duration_s
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client() -> None:
            nonlocal done, tokens
            while time.perf_counter() < stop_at:
                answered = await _chat(session, url, key)  # `tokens += await ...` would
                tokens += answered  # read the sum before the wait and lose the others'
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return done / (time.perf_counter() - started), done, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output-mean-tokens", type=float, default=32.0)
    parser.add_argument("--time-scale", type=float, default=0.01)
    parser.add_argument("--relay", action="store_true", help="the picker behind its relay")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    missing = missing_binary(relay=args.relay)
    if missing is not None:
        raise SystemExit(missing)
    workdir = Path(tempfile.mkdtemp(prefix="isocost-metering-"))
    engine = start_isocost(
        ["engine", "--port", "0", "--model", MODEL, "--time-scale", str(args.time_scale),
         "--output-mean-tokens", str(args.output_mean_tokens)],
        "isocost engine",
    )  # fmt: skip
    config = workdir / "picker.yaml"
    config.write_text(
        f"pools:\n  - model: {MODEL}\n    replicas:\n      - {{url: '{engine.url}'}}\n"
        "auth:\n  api_keys:\n"
        f"    - {{name: metered, key: {KEYS['metered']}, tokens_per_minute: 1000000000}}\n"
        f"    - {{name: plain, key: {KEYS['plain']}}}\n"
    )
    picker, envoy = picker_behind_envoy(config, engine.url, workdir, relay=args.relay)
    on_path = (picker.pid, *children(picker.pid))  # the picker and its relay
    rates = dict.fromkeys(KEYS, 0.0)
    cpu_per_request: dict[str, float] = {}
    cpu_per_token: dict[str, float] = {}
    sent = dict.fromkeys(KEYS, 0)
    generated = dict.fromkeys(KEYS, 0)
    try:
        for _ in range(args.rounds):
            for name, key in KEYS.items():
                cpu_before = sum(map(cpu_seconds, on_path))
                rate, done, tokens = asyncio.run(
                    _loop(envoy.url, key, args.concurrency, args.duration)
                )
                used_us = 1e6 * (sum(map(cpu_seconds, on_path)) - cpu_before)
                rates[name] = max(rates[name], rate)
                cpu_per_request[name] = min(cpu_per_request.get(name, 1e12), used_us / done)
                cpu_per_token[name] = min(cpu_per_token.get(name, 1e12), used_us / tokens)
                sent[name] += done
                generated[name] += tokens
    finally:
        envoy.stop()
        picker.stop()
        engine.stop()
    behind = " behind its relay" if args.relay else ""
    table = Table(title=f"Metered answers, Envoy + picker{behind}, {args.concurrency} clients")
    table.add_column("figure")
    for name in KEYS:
        table.add_column(name, justify="right")
    table.add_column("metered / plain", justify="right")
    rows = (
        ("requests/s (best round)", rates, "{:.0f}"),
        ("picker CPU µs/request", cpu_per_request, "{:.0f}"),
        ("picker CPU µs/output token", cpu_per_token, "{:.1f}"),
        ("output tokens/request", {k: generated[k] / sent[k] for k in KEYS}, "{:.1f}"),
    )
    for label, values, shape in rows:
        ratio = values["metered"] / values["plain"]
        table.add_row(label, *(shape.format(values[k]) for k in KEYS), f"{ratio:.2f}x")
    Console().print(table)
    if args.json:
        figures = {
            name: {
                "requests_per_s": round(rates[name], 1),
                "picker_cpu_us_per_request": round(cpu_per_request[name], 1),
                "picker_cpu_us_per_token": round(cpu_per_token[name], 2),
                "requests": sent[name],
                "output_tokens": generated[name],
            }
            for name in KEYS
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    run_script(main)
