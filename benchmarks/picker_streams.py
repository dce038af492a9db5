"""Many concurrent streams through Envoy + ``isocost picker``: do any fail?

llm-d saw 500s at about 2,000 concurrent streams through Envoy's ext_proc (#1582): each
request holds one gRPC stream to the picker for its whole life, and Envoy's default
circuit breakers allow 1,024 requests per cluster. deploy/envoy/picker.yaml raises them;
this opens ``--streams`` streaming completions at once (one engine, ``--time-scale`` small,
``--max-num-seqs`` as many) and counts the answers that are not 200 with ``[DONE]``.

``--relay`` runs the picker behind its native relay (``make relay``). Run (after ``make
envoy``):

    .venv/bin/python benchmarks/picker_streams.py --streams 2000 [--relay]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

from isocost.runtime.processes import run_script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the suites' processes and Envoy

from envoy_harness import missing_binary, picker_behind_envoy  # noqa: E402
from isocost_procs import start_isocost  # noqa: E402

MODEL = "llama-3.1-8b"


async def _stream(session: aiohttp.ClientSession, url: str, max_tokens: int) -> str:
    """``ok``, or what went wrong with one streamed completion."""
    body = {"model": MODEL, "prompt": "stream", "max_tokens": max_tokens, "stream": True}
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            data = await response.read()
            if response.status != 200:
                return f"status {response.status}"
            return "ok" if data.rstrip().endswith(b"data: [DONE]") else "truncated"
    except aiohttp.ClientError as exc:
        return type(exc).__name__


async def _run(url: str, streams: int, max_tokens: int) -> Counter[str]:
    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        results = await asyncio.gather(*(_stream(session, url, max_tokens) for _ in range(streams)))
    return Counter(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--time-scale", type=float, default=0.05)
    parser.add_argument("--json", type=Path, help="write the counts here")
    parser.add_argument("--relay", action="store_true", help="the picker behind its relay")
    args = parser.parse_args()
    missing = missing_binary(relay=args.relay)
    if missing is not None:
        raise SystemExit(missing)
    workdir = Path(tempfile.mkdtemp(prefix="isocost-streams-"))
    engine = start_isocost(
        ["engine", "--port", "0", "--model", MODEL, "--time-scale", str(args.time_scale),
         "--max-num-seqs", str(args.streams), "--output-dist", "max"],
        "isocost engine",
    )  # fmt: skip
    config = workdir / "picker.yaml"
    config.write_text(
        f"pools:\n  - model: {MODEL}\n    replicas:\n      - {{url: '{engine.url}'}}\n"
    )
    picker, envoy = picker_behind_envoy(config, engine.url, workdir, relay=args.relay)
    try:
        started = time.perf_counter()
        counts = asyncio.run(_run(envoy.url, args.streams, args.max_tokens))
        elapsed_s = time.perf_counter() - started
    finally:
        envoy.stop()
        picker.stop()
        engine.stop()
    errors = args.streams - counts["ok"]
    print(f"{args.streams} concurrent streams: {counts['ok']} ok, {errors} errors "
          f"{dict(counts)} in {elapsed_s:.1f} s")  # fmt: skip
    if args.json:
        figures = {"streams": args.streams, "ok": counts["ok"], "errors": errors}
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    run_script(main)
