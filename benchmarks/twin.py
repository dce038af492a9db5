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

With ``--engine vllm``, the same fidelity comparison on real engines: two vLLM CPU
replicas of tiny-llama (``tests/support/vllm_procs.py``, the conformance suite's fleet)
behind `isocost serve --record` with ``--policy``, the first ``--requests`` rows of the
trace with their lengths scaled to tiny-llama's 1,024-token context, at ``--rate``; then
the recording's replay, with what its calibration fitted per replica (slowdown, prefill
overhead) and the machine's load as the live run ended. ``--replay-only`` replays a run
kept with ``--keep`` again. No what-if, no plan. With ``--profile`` the replicas are
priced on the GPU entry ``isocost profile`` fits to the first of them while idle, not on
the default A100; the recording carries that entry, so the replay starts from it.

With ``--overhead``, the recording's cost: `isocost serve` with and without ``--record``
in front of a fast engine, a closed loop at ``--overhead-concurrency`` for a few seconds
each, alternated ``--overhead-rounds`` times; the median req/s of each and the median
CPU time the gateway process spent per request, and their ratios.

Run:

    .venv/bin/python benchmarks/twin.py --requests 40 --rate 0.4 --time-scale 1 \
        --stream-interval 1 --json twin.json          # about 5 minutes
    .venv/bin/python benchmarks/twin.py --overhead --requests 0 --json overhead.json
    .venv/bin/python benchmarks/twin.py --engine vllm --requests 60 --rate 1.5 \
        --json twin-vllm.json                          # about 2.5 minutes

On a small shared machine the engines, the gateway and the load generator share cores:
with faster engines (``--time-scale`` below 1) the live run becomes CPU-bound (TPOT p99
8x the replay's at 0.25, measured), which no replay reproduces; and with several tokens
per SSE chunk the gateway's ITL factors are off. The defaults keep the engines' own timing
in charge.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from isocost.core.catalog import Catalog
from isocost.runtime.processes import Services, isocost_command, run_script
from isocost.sim import load_recording, recorded_catalog, recorded_cluster
from isocost.workload import TRACE_BLOCK_TOKENS, Segment, TextRenderer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the suites' process helpers
from isocost_procs import cpu_seconds  # noqa: E402
from vllm_procs import MAX_MODEL_LEN, TINY_MODEL, VllmFleet, gateway_yaml  # noqa: E402

TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
MODEL = "llama-3.1-8b"
PROFILED_GPU = "cpu-core"  # vllm --profile: the replicas' GPU, as isocost profile fits it
_SLOS_MS = {"isocost": (3000.0, 60.0), "vllm": (1000.0, 25.0)}  # (TTFT, TPOT) per engine
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


def _bench(
    url: str, args: argparse.Namespace, out: Path, text_salt: int, trace: Path, *extra: str
) -> dict[str, Any]:
    """``trace`` through ``url``; a new ``text_salt`` for each run on the same engines, so
    that none finds the prompts of the one before in the engines' prefix caches."""
    command = [
        *isocost_command(), "bench", "--url", url, "--trace", str(trace), *extra,
        "--max-requests", str(args.requests), "--rate", str(args.rate),
        "--seed", str(args.seed), "--slo-ttft-ms", str(args.slo_ttft_ms),
        "--slo-tpot-ms", str(args.slo_tpot_ms), "--json", str(out),
        "--text-salt", str(text_salt),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    summary: dict[str, Any] = json.loads(out.read_text())
    return summary


def _replay(
    record: Path, args: argparse.Namespace, out: Path, policies: str
) -> dict[str, dict[str, Any]]:
    command = [
        *isocost_command(), "sim", "--from-record", str(record),
        "--policies", policies, "--jobs", "1", "--seed", str(args.seed),
        "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-ttft-per-1k-ms", "0",
        "--slo-tpot-ms", str(args.slo_tpot_ms), "--json", str(out),
        *(["--fit-prefill"] if args.fit_prefill else []),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    return {row["policy"]: row for row in json.loads(out.read_text())}


def _fidelity_rows(live: dict[str, Any], replay: dict[str, Any]) -> list[dict[str, Any]]:
    """Each of ``METRICS`` live (bench's summary) and replayed (sim's row), and the
    relative error; then errors: bench's failed requests, the replay's rejected ones."""
    rows = []
    for label, key, scale in METRICS:
        shown, replayed = live.get(key), replay.get(key)
        rows.append(
            {
                "metric": label,
                "live": None if shown is None else shown * scale,
                "replay": None if replayed is None else replayed * scale,
                "error": _error(replayed, shown),
            }
        )
    errors = {"live": live["errors"], "replay": replay["rejected"]}
    rows.append({"metric": "errors", **errors, "error": _error(errors["replay"], errors["live"])})
    return rows


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
        live_rr = _bench(url, args, work / "live-rr.json", 1, args.trace)
        services.stop(gateway)  # SIGTERM: the recording is flushed
        extra = ("--record", str(work / "rec-eq"))  # the live what-if, for later replays
        gateway, url = _gateway(services, "gateway-eq", urls, "equal_cost", *extra)
        live_eq = _bench(url, args, work / "live-eq.json", 2, args.trace)
        services.stop(gateway)
    finally:
        services.stop_all()
    replay = _replay(record, args, work / "replay.json", "round_robin,equal_cost")
    fleet = json.loads((record / "fleet.json").read_text())
    rows = _fidelity_rows(live_rr, replay["round_robin"])
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


def vllm_fidelity(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Fidelity on the real engine: two vLLM CPU replicas of tiny-llama (the conformance
    suite's fleet) behind ``isocost serve --record``, the scaled trace through it with
    ``--policy``, then its replay; and what the replay's calibration fitted. With
    ``--replay-only``, the live run kept in ``work`` is replayed again."""
    record, live_path, load_path = work / "rec", work / "live.json", work / "load.json"
    if not args.replay_only:
        trace = _scaled_trace(args, work / "trace.jsonl")
        services = Services(work / "logs")
        services.log_dir.mkdir(parents=True, exist_ok=True)
        fleet = VllmFleet(services.log_dir, size=2)
        try:
            catalog = _profile(fleet, work) if args.profile else None
            config = work / "gateway.yaml"
            config.write_text(
                gateway_yaml(
                    fleet.replicas,
                    args.policy,
                    tokenizer=True,
                    gpu=PROFILED_GPU if catalog else None,
                )
            )
            gateway = services.start(
                "gateway",
                ["serve", "--config", str(config), "--port", "0", "--record", str(record),
                 "--log-level", "error", *(["--catalog", str(catalog)] if catalog else [])],
            )  # fmt: skip
            (url,) = gateway.wait_ready(1, 60)
            _bench(url, args, live_path, 1, trace, "--ignore-eos")
            load_path.write_text(json.dumps(_load()))  # the 1-minute average: the run's
            services.stop(gateway)  # SIGTERM: the recording is flushed
        finally:
            services.stop_all()
            fleet.stop()
    live = json.loads(live_path.read_text())
    replay = _replay(record, args, work / "replay.json", args.policy)
    return {
        "fidelity": _fidelity_rows(live, replay[args.policy]),
        "calibration": _fitted(record),
        "load": json.loads(load_path.read_text()),
    }


def _profile(fleet: VllmFleet, work: Path) -> Path:
    """``isocost profile`` of the first replica while idle: a catalog whose
    ``PROFILED_GPU`` prices both in the CPU's own shape (the recording carries it)."""
    out = work / "profile.yaml"
    command = [
        *isocost_command(), "profile", fleet.urls[0], "--id", PROFILED_GPU,
        "--cost-model", str(TINY_MODEL), "--out", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    return out


def _scaled_trace(args: argparse.Namespace, out: Path) -> Path:
    """The first ``--requests`` rows of ``--trace`` with their lengths scaled to fit
    tiny-llama's context: prompts x ``--prompt-scale``, at most half the context in the
    tiny tokenizer's tokens (the rendered words, counted by it), outputs x
    ``--output-scale``, at most the other half; block ids cut to the scaled prompt."""
    tokenizer = Tokenizer.from_file(str(TINY_MODEL / "tokenizer.json"))
    sample = TextRenderer().render([Segment(0, TRACE_BLOCK_TOKENS)])
    tokens_per_word = len(tokenizer.encode(sample).ids) / TRACE_BLOCK_TOKENS
    half = MAX_MODEL_LEN // 2
    lines = []
    with args.trace.open() as source:
        for line, _ in zip(source, range(args.requests), strict=False):
            row = json.loads(line)
            words = round(row["input_length"] * args.prompt_scale)
            words = max(1, min(words, int(half / tokens_per_word)))
            output = max(1, min(round(row["output_length"] * args.output_scale), half - 1))
            blocks = -(-words // TRACE_BLOCK_TOKENS)
            scaled = {**row, "input_length": words, "output_length": output}
            lines.append(json.dumps({**scaled, "hash_ids": row["hash_ids"][:blocks]}))
    out.write_text("\n".join(lines) + "\n")
    return out


def _fitted(record: Path) -> dict[str, dict[str, float]]:
    """Per replica, what ``sim --from-record`` calibrates it to: the gateway's factors,
    the fitted slowdown and the fitted prefill overhead."""
    recording = load_recording(str(record), None)
    factors = {r.name: (r.ttft_factor, r.itl_factor) for r in recording.pool.replicas}
    catalog = recorded_catalog(recording, Catalog.builtin(), str(record))
    _, replicas = recorded_cluster(recording, catalog, str(record))
    return {
        r.replica_id: {
            "ttft_factor": factors[r.replica_id][0],
            "itl_factor": factors[r.replica_id][1],
            "slowdown": round(r.slowdown, 4),
            "prefill_overhead_ms": round(1000 * r.cost_model.gpu.prefill_overhead_s, 3),
        }
        for r in replicas
    }


def _load() -> dict[str, float]:
    """The machine's 1-, 5- and 15-minute load averages and CPU count, as the live run
    ends (the engines, the gateway, the load generator and whatever else runs share
    these cores)."""
    one, five, fifteen = os.getloadavg()
    return {"load_1m": one, "load_5m": five, "load_15m": fifteen, "cpus": os.cpu_count() or 0}


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
        fidelity = ("live run vs its replay", ("metric", "live", "replay"), ",.2f")
        console.print(_comparison(result["fidelity"], *fidelity))
        console.print(f"calibration: {result['calibration']}", markup=False)
    if "what_if" in result:
        what_if = ("what-if: round_robin -> equal_cost", ("ratio", "predicted", "live"), ".2f")
        console.print(_comparison(result["what_if"], *what_if))
    if "plan" in result:
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
    if "load" in result:
        load = result["load"]
        console.print(
            f"machine load as the live run ended: {load['load_1m']:.1f} (1 min), "
            f"{load['load_5m']:.1f} (5 min) on {load['cpus']} CPUs",
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
    parser.add_argument("--engine", choices=("isocost", "vllm"), default="isocost")
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--requests", type=int, default=40, help="0: skip fidelity")
    parser.add_argument("--rate", type=float, default=0.4, help="Mean req/s (Poisson).")
    parser.add_argument("--policy", default="round_robin", help="vllm: the live run's.")
    parser.add_argument("--prompt-scale", type=float, default=1 / 32, help="vllm: lengths.")
    parser.add_argument("--output-scale", type=float, default=0.5, help="vllm: lengths.")
    parser.add_argument("--slowdown", type=float, default=2.0, help="The slow replica's.")
    parser.add_argument("--stream-interval", type=int, default=1, help="Tokens per chunk.")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="Engine time (0.5: GPUs 2x faster)."
    )
    parser.add_argument("--slo-ttft-ms", type=float, help="Default 3000; vllm: 1000.")
    parser.add_argument("--slo-tpot-ms", type=float, help="Default 60; vllm: 25.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plan-ttft-slo-ms", type=float, default=6000.0)
    parser.add_argument("--growth", type=float, default=2.0, help="Plan for traffic x this.")
    parser.add_argument("--plan-gpus", default="a100-80g,h100-80g,l40s-48g")
    parser.add_argument("--overhead", action="store_true", help="Also the recording's cost.")
    parser.add_argument("--overhead-concurrency", type=int, default=32)
    parser.add_argument("--overhead-seconds", type=float, default=8.0)
    parser.add_argument("--overhead-rounds", type=int, default=4, help="Alternations.")
    parser.add_argument(
        "--replay-only", action="store_true", help="vllm: replay the live run kept in --keep."
    )
    parser.add_argument(
        "--fit-prefill",
        action=argparse.BooleanOptionalAction,
        help="Replays fit prefill overheads too (sim --fit-prefill); default: with vllm.",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="vllm: price the replicas on an isocost profile of the first (not an A100).",
    )
    parser.add_argument("--json", type=Path, help="Write the figures here.")
    parser.add_argument("--keep", type=Path, help="Keep the recordings and logs here.")
    args = parser.parse_args()
    if args.fit_prefill is None:
        args.fit_prefill = args.engine == "vllm"
    if args.profile and (args.engine != "vllm" or args.replay_only):
        parser.error("--profile profiles a live vLLM replica: with --engine vllm")
    if args.replay_only and (args.engine != "vllm" or args.keep is None):
        parser.error("--replay-only replays a kept vllm run: with --engine vllm --keep DIR")
    ttft_ms, tpot_ms = _SLOS_MS[args.engine]
    args.slo_ttft_ms = ttft_ms if args.slo_ttft_ms is None else args.slo_ttft_ms
    args.slo_tpot_ms = tpot_ms if args.slo_tpot_ms is None else args.slo_tpot_ms
    console = Console()
    result: dict[str, Any] = {"args": {k: str(v) for k, v in sorted(vars(args).items())}}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="isocost-twin-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.requests > 0:
            result.update((vllm_fidelity if args.engine == "vllm" else fidelity)(args, work))
        if args.overhead:
            result["overhead"] = overhead(args, work)
    _print(console, result)
    console.print(f"took {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    run_script(main)
