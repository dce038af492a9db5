"""Two tenants, one overloaded replica: first come, first served against fair turns.

In one run, twice, each time on a fresh `isocost engine` replica that runs at most
``--max-num-seqs`` requests at once behind a fresh `isocost serve` (replica queue cap 2,
so the overload waits in the gateway's queue): a heavy tenant sends ``--heavy-rate``
requests/s, well past what the replica serves, and a light tenant ``--light-rate``, both
Poisson, both `isocost bench` processes at once (shared-prefix prompts, ``--max-tokens``
each, streamed), for ``--duration`` seconds.

* ``fifo``: a gateway without API keys; both tenants' requests wait in one line.
* ``fair``: the same gateway with one API key per tenant: waiting requests take turns by
  key (``dispatch.RequestQueue``'s fair turns).

Per scenario and tenant: bench's summary (TTFT percentiles, completed, errors by kind,
goodput against ``--slo-ttft-ms``). ``--json FILE`` writes ``{"fifo": {"heavy": S,
"light": S}, "fair": {...}}``. Run:

    .venv/bin/python benchmarks/fairness.py --json fairness.json

The client, the gateway and the engine share the machine's cores; compare the columns of
one run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from isocost.runtime.processes import run_script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the suites' processes
from isocost_procs import ISOCOST, NotReady, spawn_ready  # noqa: E402

MODEL = "llama-3.1-8b"
TENANTS = ("heavy", "light")
KEYS = {"heavy": "bench-heavy-key", "light": "bench-light-key"}


def _start(args: list[str], marker: str) -> tuple[subprocess.Popen[str], str]:
    try:
        proc, (url,) = spawn_ready(args, marker, 1, stderr=subprocess.DEVNULL)
    except NotReady as exc:
        raise SystemExit(f"isocost {args[0]} did not become ready ({exc})") from None
    return proc, url


def _gateway_yaml(engine: str, keyed: bool) -> str:
    keys = "".join(f"\n    - {{name: {n}, key: {k}}}" for n, k in KEYS.items())
    auth = f"auth:\n  api_keys:{keys}\n" if keyed else ""
    return f"""policy: equal_cost
pools:
  - model: {MODEL}
    replicas: [{{url: '{engine}', max_queue: 2}}]
limits: {{max_queue: 256, queue_timeout_ms: 30000}}
{auth}"""


def _bench(url: str, tenant: str, keyed: bool, args: Any, out: Path) -> dict[str, Any]:
    """One tenant's `isocost bench` run; its summary."""
    rate = args.heavy_rate if tenant == "heavy" else args.light_rate
    per_group = int(rate * args.duration / 8) + 8  # 8 groups: enough prompts for the time
    command = [
        ISOCOST, "bench", "--url", url, "--workload", "shared-prefix",
        "--rate", str(rate), "--duration", str(args.duration),
        "--groups", "8", "--prompts-per-group", str(per_group),
        "--max-tokens", str(args.max_tokens), "--system-tokens", "256",
        "--question-tokens", "64", "--seed", str(args.seed if tenant == "heavy" else args.seed + 1),
        "--text-salt", "1" if tenant == "light" else "0",
        "--slo-ttft-ms", str(args.slo_ttft_ms), "--label", tenant, "--json", str(out),
    ]  # fmt: skip
    if keyed:
        command += ["--api-key", KEYS[tenant]]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"isocost bench ({tenant}) failed: {done.stderr.strip()[-500:]}")
    figures: dict[str, Any] = json.loads(out.read_text())
    for key in ("ttft_samples_s", "e2e_samples_s"):  # kept in bench's own file
        figures.pop(key, None)
    return figures


def _scenario(name: str, keyed: bool, args: Any, tmp: Path) -> dict[str, dict[str, Any]]:
    engine_args = ["engine", "--port", "0", "--model", MODEL, "--gpu", args.gpu]
    engine, engine_url = _start(
        [*engine_args, "--max-num-seqs", str(args.max_num_seqs), "--output-dist", "max"],
        "isocost engine",
    )
    config = tmp / f"{name}.yaml"
    config.write_text(_gateway_yaml(engine_url, keyed))
    serve = ["serve", "--config", str(config), "--port", "0", "--log-level", "warning"]
    gateway, url = _start(serve, "isocost serve")
    try:
        with ThreadPoolExecutor(len(TENANTS)) as pool:
            runs = {
                t: pool.submit(_bench, url, t, keyed, args, tmp / f"{name}-{t}.json")
                for t in TENANTS
            }
            return {t: run.result() for t, run in runs.items()}
    finally:
        for proc in (gateway, engine):
            proc.terminate()
            proc.wait(timeout=20)


def _table(results: dict[str, dict[str, dict[str, Any]]]) -> Table:
    table = Table(title="Two tenants on one overloaded replica")
    table.add_column("figure")
    columns = [(s, t) for s in results for t in TENANTS]
    for scenario, tenant in columns:
        table.add_column(f"{scenario} {tenant}", justify="right")

    def row(label: str, cell: Any) -> None:
        table.add_row(label, *(cell(results[s][t]) for s, t in columns))

    def ms(key: str) -> Any:
        return lambda f: "-" if f.get(key) is None else f"{f[key] * 1000:,.0f}"

    row("sent", lambda f: f"{f['requests']:,}")
    row("completed", lambda f: f"{f['completed']:,}")
    row("refused (429/503)", lambda f: f"{f['errors']:,}")
    row("TTFT p50 (ms)", ms("ttft_p50_s"))
    row("TTFT p99 (ms)", ms("ttft_p99_s"))
    row("goodput (req/s)", lambda f: f"{f['goodput_rps']:.2f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heavy-rate", type=float, default=30.0, help="requests/s")
    parser.add_argument("--light-rate", type=float, default=2.0, help="requests/s")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=4, help="of the replica")
    parser.add_argument("--gpu", default="a100-80g")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    console = Console()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="isocost-fairness-") as work:
        for name, keyed in (("fifo", False), ("fair", True)):
            console.print(f"{name}: " + ("one API key per tenant" if keyed else "no keys"))
            results[name] = _scenario(name, keyed, args, Path(work))
    console.print(_table(results))
    fifo, fair = results["fifo"]["light"], results["fair"]["light"]
    if fifo["ttft_p99_s"] and fair["ttft_p99_s"]:
        console.print(
            f"light tenant, fair vs fifo: TTFT p99 {fair['ttft_p99_s'] / fifo['ttft_p99_s']:.3f}x,"
            f" goodput {fair['goodput_rps']:.2f} vs {fifo['goodput_rps']:.2f} req/s"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        console.print(f"figures written to {args.json}")


if __name__ == "__main__":
    run_script(main)
