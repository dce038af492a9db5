"""The digital twin's fidelity: a live run recorded, then replayed in the simulator.

Starts an `isocost engine` cluster (two A100 replicas, one of them slowed ``--slowdown``
times, which the gateway is not told and calibration must learn) and `isocost serve
--policy round_robin --record DIR` in front of it, drives the Mooncake conversation trace
through it with `isocost bench`, stops the gateway (the recording is flushed), then:

* fidelity: `isocost sim --from-record DIR` replays the recording with the same policy
  on the recorded, calibrated fleet; live (bench) and replayed TTFT p50/p99, TPOT p99 and
  goodput side by side, with the relative error of each;
* what-if direction: the same replay with equal_cost predicts what switching policy
  gains; a second live run, equal_cost, on the same trace (new prompt text, so that the
  engines' caches are cold again), shows what it does gain. Both as ratios: TTFT p50 and
  p99 round_robin / equal_cost, goodput equal_cost / round_robin.

With ``--overhead``, the recording's cost: `isocost serve` with and without ``--record``
in front of a fast engine, a closed loop at ``--overhead-concurrency`` for a few seconds
each, alternated ``--overhead-rounds`` times; the median req/s of each and the median
CPU time the gateway process spent per request, and their ratios.

Run:

    .venv/bin/python benchmarks/twin.py --requests 40 --rate 0.4 --time-scale 1 \
        --stream-interval 1 --json twin.json          # about 5 minutes
    .venv/bin/python benchmarks/twin.py --overhead --requests 0 --json overhead.json

On a small shared machine the engines, the gateway and the load generator share cores:
with faster engines (``--time-scale`` below 1) the live run becomes CPU-bound (TPOT p99
8x the replay's at 0.25, measured), which no replay reproduces; and with several tokens
per SSE chunk the gateway's ITL factors are off. The defaults keep the engines' own timing
in charge.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from isocost.runtime.processes import Services, isocost_command

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the suites' process helpers
from isocost_procs import cpu_seconds  # noqa: E402

TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
MODEL = "llama-3.1-8b"
METRICS = (
    ("TTFT p50 ms", "ttft_p50_s", 1000.0),
    ("TTFT p99 ms", "ttft_p99_s", 1000.0),
    ("TPOT p99 ms", "tpot_p99_s", 1000.0),
    ("goodput req/s", "goodput_rps", 1.0),
)


def _engines(services: Services, args: argparse.Namespace) -> list[str]:
    slowdown = args.slowdown
    engine = services.start(
        "engine",
        [
            "engine", "--port", "0", "-m", MODEL, "--output-dist", "max",
            "--stream-interval", str(args.stream_interval),
            "--time-scale", str(args.time_scale),
            "--replica-spec", "gpu=a100-80g",
            "--replica-spec", f"gpu=a100-80g,slowdown={slowdown:g}",
        ],
    )  # fmt: skip
    return engine.wait_ready(2, 60)


def _gateway(services: Services, name: str, urls: list[str], policy: str, *extra: str) -> Any:
    args = ["serve", "--port", "0", "--policy", policy, "-g", "a100-80g", "--log-level", "error"]
    gateway = services.start(name, [*args, *(a for u in urls for a in ("-r", u)), *extra])
    return gateway, gateway.wait_ready(1, 60)[0]


def _bench(url: str, args: argparse.Namespace, out: Path, text_salt: int) -> dict[str, Any]:
    """The trace through ``url``; a new ``text_salt`` for each run on the same engines, so
    that none finds the prompts of the one before in the engines' prefix caches."""
    command = [
        *isocost_command(), "bench", "--url", url, "--trace", str(args.trace),
        "--max-requests", str(args.requests), "--rate", str(args.rate),
        "--seed", str(args.seed), "--slo-ttft-ms", str(args.slo_ttft_ms),
        "--slo-tpot-ms", str(args.slo_tpot_ms), "--json", str(out),
        "--text-salt", str(text_salt),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    summary: dict[str, Any] = json.loads(out.read_text())
    return summary


def _replay(record: Path, args: argparse.Namespace, out: Path) -> dict[str, dict[str, Any]]:
    command = [
        *isocost_command(), "sim", "--from-record", str(record),
        "--policies", "round_robin,equal_cost", "--jobs", "1", "--seed", str(args.seed),
        "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-ttft-per-1k-ms", "0",
        "--slo-tpot-ms", str(args.slo_tpot_ms), "--json", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    return {row["policy"]: row for row in json.loads(out.read_text())}


def _error(replayed: float | None, live: float | None) -> float | None:
    if replayed is None or live is None or live == 0:
        return None
    return (replayed - live) / live


def fidelity(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    services = Services(work / "logs")
    record = work / "rec"
    try:
        urls = _engines(services, args)
        gateway, url = _gateway(
            services, "gateway-rr", urls, "round_robin", "--record", str(record)
        )
        live_rr = _bench(url, args, work / "live-rr.json", 1)
        services.stop(gateway)  # SIGTERM: the recording is flushed
        extra = ("--record", str(work / "rec-eq"))  # the live what-if, for later replays
        gateway, url = _gateway(services, "gateway-eq", urls, "equal_cost", *extra)
        live_eq = _bench(url, args, work / "live-eq.json", 2)
        services.stop(gateway)
    finally:
        services.stop_all()
    replay = _replay(record, args, work / "replay.json")
    fleet = json.loads((record / "fleet.json").read_text())
    rows = []
    for label, key, scale in METRICS:
        live, replayed = live_rr.get(key), replay["round_robin"].get(key)
        rows.append(
            {
                "metric": label,
                "live": None if live is None else live * scale,
                "replay": None if replayed is None else replayed * scale,
                "error": _error(replayed, live),
            }
        )
    what_if = []
    lives = {"round_robin": live_rr, "equal_cost": live_eq}
    for label, key, over, under in (
        ("TTFT p50 rr / eq", "ttft_p50_s", "round_robin", "equal_cost"),
        ("TTFT p99 rr / eq", "ttft_p99_s", "round_robin", "equal_cost"),
        ("goodput eq / rr", "goodput_rps", "equal_cost", "round_robin"),
    ):
        predicted = replay[over][key] / replay[under][key]
        shown = lives[over][key] / lives[under][key]
        what_if.append(
            {
                "metric": label,
                "predicted": predicted,
                "live": shown,
                "error": _error(predicted, shown),
            }
        )
    factors = {
        r["name"]: [r["ttft_factor"], r["itl_factor"]] for r in fleet["pools"][0]["replicas"]
    }
    return {
        "fidelity": rows,
        "what_if": what_if,
        "calibration": factors,
        "plan": plan(record, args, work),
    }


def plan(record: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``isocost plan --from-record``'s fleet, then the recorded traffic replayed on it
    and on one replica fewer through ``isocost sim --cluster`` (the plan's own runs are
    not taken on trust)."""
    command = [
        *isocost_command(), "plan", "--from-record", str(record), "--json",
        "--ttft-slo-ms", str(args.plan_ttft_slo_ms), "--tpot-slo-ms", str(args.slo_tpot_ms),
        "--growth", str(args.growth), "--gpus", args.plan_gpus,
    ]  # fmt: skip
    found = json.loads(subprocess.run(command, check=True, capture_output=True).stdout)
    chosen = found["cheapest"]
    replayed = {}
    for label, count in (("chosen", chosen["replicas"]), ("one fewer", chosen["replicas"] - 1)):
        if count < 1:
            continue
        cluster = work / f"plan-{count}.yaml"
        group = {k: chosen[k] for k in ("gpu", "tp", "slowdown")}
        cluster.write_text(json.dumps({"replicas": [{**group, "model": MODEL, "count": count}]}))
        out = work / f"plan-{count}.json"
        subprocess.run(
            [
                *isocost_command(), "sim", "--from-record", str(record),
                "--cluster", str(cluster), "--policies", found["policy"],
                "--speedup", str(args.growth), "--jobs", "1", "--json", str(out),
                "--slo-ttft-ms", str(args.plan_ttft_slo_ms), "--slo-ttft-per-1k-ms", "0",
                "--slo-tpot-ms", str(args.slo_tpot_ms),
            ],
            check=True,
            capture_output=True,
        )  # fmt: skip
        (row,) = [r for r in json.loads(out.read_text()) if r["policy"] == found["policy"]]
        replayed[label] = {"replicas": count, "slo_attainment": row["slo_attainment"]}
    return {"cheapest": chosen, "replayed": replayed}


def overhead(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Closed-loop req/s through the gateway without and with ``--record``, and the
    gateway process's CPU time per request (steadier than req/s on a shared machine)."""
    services = Services(work / "logs-overhead")
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "record": []}
    try:
        engine = services.start(
            "engine-fast",
            ["engine", "--port", "0", "-m", MODEL, "--output-dist", "max",
             "--time-scale", "0.001"],
        )  # fmt: skip
        (engine_url,) = engine.wait_ready(1, 60)
        for round_ in range(args.overhead_rounds):
            order = ("plain", "record") if round_ % 2 == 0 else ("record", "plain")
            for mode in order:  # ABBA: a drift in the machine's load hits both alike
                extra = ("--record", str(work / f"rec-{mode}-{round_}")) if mode == "record" else ()
                gateway, url = _gateway(services, f"gw-{mode}", [engine_url], "equal_cost", *extra)
                out = work / f"overhead-{mode}-{round_}.json"
                command = [
                    *isocost_command(), "bench", "--url", url, "--workload", "mix",
                    "--max-prompt-tokens", "256", "--max-tokens", "4", "--no-stream",
                    "--concurrency", str(args.overhead_concurrency),
                    "--duration", str(args.overhead_seconds), "--json", str(out),
                ]  # fmt: skip
                cpu_before = cpu_seconds(gateway.popen.pid)
                subprocess.run(command, check=True, capture_output=True, timeout=600)
                cpu_s = cpu_seconds(gateway.popen.pid) - cpu_before
                services.stop(gateway)
                summary = json.loads(out.read_text())
                runs[mode].append(
                    {
                        "rps": summary["throughput_rps"],
                        "cpu_us_per_request": 1e6 * cpu_s / max(1, summary["completed"]),
                    }
                )
    finally:
        services.stop_all()
    median = {
        mode: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        for mode, rows in runs.items()
    }
    return {
        "runs": runs,
        "median": median,
        "rps_ratio": median["record"]["rps"] / median["plain"]["rps"],
        "cpu_ratio": median["record"]["cpu_us_per_request"] / median["plain"]["cpu_us_per_request"],
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _comparison(
    rows: list[dict[str, Any]], title: str, columns: tuple[str, str, str], spec: str
) -> Table:
    """A metric, two figures of it (keys ``columns[1:]``, shown as ``spec``) and the error."""
    table = Table(title=title)
    for column in (*columns, "error"):
        table.add_column(column, justify="left" if column == columns[0] else "right")
    for row in rows:
        figures = (_fmt(row[key], spec) for key in columns[1:])
        table.add_row(row["metric"], *figures, _fmt(row["error"], "+.1%"))
    return table


def _print(console: Console, result: dict[str, Any]) -> None:
    if "fidelity" in result:
        fidelity = ("live round_robin run vs its replay", ("metric", "live", "replay"), ",.2f")
        console.print(_comparison(result["fidelity"], *fidelity))
        what_if = ("what-if: round_robin -> equal_cost", ("ratio", "predicted", "live"), ".2f")
        console.print(_comparison(result["what_if"], *what_if))
        console.print(f"the gateway's (TTFT, ITL) factors: {result['calibration']}", markup=False)
        chosen, replayed = result["plan"]["cheapest"], result["plan"]["replayed"]
        console.print(
            f"plan: {chosen['replicas']} x {chosen['tp']}x {chosen['gpu']} at "
            f"${chosen['usd_per_hour']:.2f}/h; replayed there "
            + ", ".join(
                f"{r['replicas']} replicas: {100 * r['slo_attainment']:.1f}% within SLO"
                for r in replayed.values()
            ),
            highlight=False,
        )
    if "overhead" in result:
        o = result["overhead"]
        plain, record = o["median"]["plain"], o["median"]["record"]
        console.print(
            f"recording overhead, medians: {plain['rps']:.0f} req/s plain, "
            f"{record['rps']:.0f} with --record (ratio {o['rps_ratio']:.3f}); gateway CPU "
            f"{plain['cpu_us_per_request']:.0f} us/request plain, "
            f"{record['cpu_us_per_request']:.0f} with --record (ratio {o['cpu_ratio']:.3f})",
            highlight=False,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--requests", type=int, default=40, help="0: skip fidelity")
    parser.add_argument("--rate", type=float, default=0.4, help="Mean req/s (Poisson).")
    parser.add_argument("--slowdown", type=float, default=2.0, help="The slow replica's.")
    parser.add_argument("--stream-interval", type=int, default=1, help="Tokens per chunk.")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="Engine time (0.5: GPUs 2x faster)."
    )
    parser.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plan-ttft-slo-ms", type=float, default=6000.0)
    parser.add_argument("--growth", type=float, default=2.0, help="Plan for traffic x this.")
    parser.add_argument("--plan-gpus", default="a100-80g,h100-80g,l40s-48g")
    parser.add_argument("--overhead", action="store_true", help="Also the recording's cost.")
    parser.add_argument("--overhead-concurrency", type=int, default=32)
    parser.add_argument("--overhead-seconds", type=float, default=8.0)
    parser.add_argument("--overhead-rounds", type=int, default=4, help="Alternations.")
    parser.add_argument("--json", type=Path, help="Write the figures here.")
    parser.add_argument("--keep", type=Path, help="Keep the recordings and logs here.")
    args = parser.parse_args()
    console = Console()
    result: dict[str, Any] = {"args": {k: str(v) for k, v in sorted(vars(args).items())}}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="isocost-twin-") as tmp:
        work = args.keep or Path(tmp)
        if args.requests > 0:
            result.update(fidelity(args, work))
        if args.overhead:
            result["overhead"] = overhead(args, work)
    _print(console, result)
    console.print(f"took {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    sys.exit(main())
