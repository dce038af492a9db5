"""isocost against the peer routers, live: the same trace, the same engines, one router at a time.

For each router in turn (sglang-router cache_aware and power_of_two, vllm-router, isocost
round_robin, sglang_cache_aware_slo, llmd_default_slo and equal_cost) this script

1. starts a fresh ``isocost engine`` process serving the same heterogeneous replicas (the
   ``isocost demo`` layout: 2 H100, 3 A100 of which one is slowed 4x, 3 L20), so every
   router starts from cold prefix caches and empty queues;
2. starts the router in front of them on a free port and waits until it answers a
   one-token completion (and, where the router can say so, lists every replica healthy);
3. replays the same trace prefix at the same speed-up through it with ``isocost bench``'s
   Python API (open loop: requests go at their trace times whatever the router does);
4. reads each replica's ``/metrics`` (requests it finished, prefix-cache hits; the column
   "finished on slowed" is the slowed replica's share of the requests the engines
   finished), then stops the router and the engines (process groups, SIGTERM, SIGKILL).

Peers run from PyPI in their own virtual environment, ``.venv-peers/`` (created once;
a stamp file records the pinned versions). They get the replica URLs and their policy and
nothing else. The isocost gateway gets the GPU of each replica in its config file (what an
operator writes), but not the slowdown: it has to learn that from latencies, as the peers
would have to. The engines do not serve SGLang's ``/get_load``, so sglang-router's load
figures for them are -1 (``/get_loads``); its policies work from what the router itself
sees.

The isocost ``<peer>_slo`` rows run a peer's routing (isocost's re-implementation of it)
behind the isocost gateway with equal_cost's SLO admission: equal_cost is compared with
the real peers and, separately, with the best of these, so that what routing wins is not
credited to admission. Every request carries its SLO targets (``isocost bench
--send-slo``: ``x-deadline-ms``, ``x-tpot-ms``), which the isocost gateway's SLO
admission reads and the peers ignore; ``--no-send-slo`` leaves them out, and then no
request gives SLO admission anything to act on.

Load: the offered rate and the prefill demand as a share of the cluster's prefill
capacity (cost model, no prefix-cache hits counted) are printed before the runs.
``--dry-run`` prints them and the chosen routers, then exits without starting anything.

Run (about 13 minutes on 2 busy cores, plus about a minute for the first install):

    benchmarks/peers/run.sh

Outputs: a Rich table on the terminal, ``benchmarks/peers/results.json``,
``benchmarks/peers/RESULTS.md``, and per run the router and engine logs and the bench
summary under ``out/peers/`` (``isocost bench compare out/peers/*.summary.json`` draws them).
On a small shared machine the client, the engines and the router share the cores: compare
the rows of one run, not runs across machines.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import msgspec
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from isocost.bench import (
    BenchOptions,
    BenchSummary,
    WorkloadSpec,
    build_workload,
    run_with_live_view,
)
from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.demo._cluster import (
    ADMIN_TOKEN_ENV,
    DEFAULT_LAYOUT,
    ClusterSettings,
    engine_args,
    gateway_config,
)
from isocost.runtime.processes import Service, isocost_command, run_script
from isocost.scheduling.policies import SLO_BASELINES
from isocost.workload import WorkloadRequest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PEERS_VENV = ROOT / ".venv-peers"
PEER_REQUIREMENTS = ("sglang-router==0.3.2", "vllm-router==0.1.17")
STAMP = PEERS_VENV / "isocost-peers.stamp"
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
MODEL = "llama-3.1-8b"
HOST = "127.0.0.1"
UNREACHABLE_HUB = "http://127.0.0.1:9"  # sglang-router must not look for a tokenizer online
START_TIMEOUT_S = 120.0
GRACE_S = 15.0

Family = Literal["sglang", "vllm", "isocost"]


@dataclass(frozen=True, slots=True)
class Router:
    """One contestant: which router program, with which policy."""

    key: str
    label: str
    family: Family
    policy: str

    @property
    def is_peer(self) -> bool:
        return self.family != "isocost"

    @property
    def is_slo_baseline(self) -> bool:
        """A peer's routing behind isocost's gateway with equal_cost's SLO admission."""
        return self.family == "isocost" and self.policy in SLO_BASELINES


ROUTERS = (
    Router("sglang-cache_aware", "sglang-router cache_aware", "sglang", "cache_aware"),
    Router("sglang-power_of_two", "sglang-router power_of_two", "sglang", "power_of_two"),
    Router("vllm-cache_aware", "vllm-router cache_aware", "vllm", "cache_aware"),
    Router("vllm-power_of_two", "vllm-router power_of_two", "vllm", "power_of_two"),
    Router("isocost-round_robin", "isocost round_robin", "isocost", "round_robin"),
    *(
        Router(f"isocost-{policy}", f"isocost {policy}", "isocost", policy)
        for policy in ("sglang_cache_aware_slo", "llmd_default_slo")
    ),
    Router("isocost-equal_cost", "isocost equal_cost", "isocost", "equal_cost"),
)
DEFAULT_ROUTERS = tuple(r.key for r in ROUTERS)  # both vllm-router candidates: the best counts
HEADLINE = "isocost-equal_cost"


@dataclass(frozen=True, slots=True)
class RouterRun:
    """What one router's replay measured."""

    router: Router
    summary: BenchSummary
    requests_by_replica: list[int]  # engines' own count, in layout order
    prefix_hit_rate: float  # cached prompt tokens / prompt tokens, over all replicas
    isocost_source: str  # the code its processes started from (the tree is shared)


# -- processes ---------------------------------------------------------------------------


def spawn(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Service:
    """``argv`` in its own session (so it stops as a group), output to ``<name>.log``."""
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    return Service(name, popen, log_path)


def ensure_peers_venv(console: Console) -> None:
    """Install the pinned peer routers into ``.venv-peers`` unless its stamp says so."""
    wanted = "\n".join(PEER_REQUIREMENTS) + "\n"
    if STAMP.is_file() and STAMP.read_text() == wanted:
        return
    with console.status(f"installing {', '.join(PEER_REQUIREMENTS)} into {PEERS_VENV}"):
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
        pip = [str(PEERS_VENV / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, *PEER_REQUIREMENTS], check=True)
    STAMP.write_text(wanted)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def router_argv(router: Router, port: int, urls: list[str], config: Path) -> list[str]:
    """The command line that starts ``router`` on ``port`` in front of ``urls``."""
    address = ["--host", HOST, "--port", str(port)]
    if router.family == "sglang":
        program = str(PEERS_VENV / "bin" / "sglang-router")
        return [program, "launch", *address, "--worker-urls", *urls,
                "--policy", router.policy, "--log-level", "warn"]  # fmt: skip
    if router.family == "vllm":
        program = str(PEERS_VENV / "bin" / "vllm-router")
        return [program, *address, "--worker-urls", *urls,
                "--policy", router.policy, "--log-level", "warning"]  # fmt: skip
    return [
        *isocost_command(),
        "serve",
        "--config",
        str(config),
        *address,
        "--log-level",
        "warning",
    ]


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=2) as response:
        return json.loads(response.read())


def _answers_completion(url: str) -> bool:
    body = json.dumps({"model": MODEL, "prompt": "ready?", "max_tokens": 1}).encode()
    request = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        return bool(response.status == 200)


def _all_replicas_routable(router: Router, url: str, num_replicas: int) -> bool:
    """What the router itself says about its replicas (vllm-router says it in its log only,
    after checking every worker, before it listens)."""
    if router.family == "sglang":
        workers = _get_json(url + "/workers")["workers"]
        return sum(1 for w in workers if w["is_healthy"]) >= num_replicas
    if router.family == "isocost":
        return int(_get_json(url + "/health")["routable_replicas"]) >= num_replicas
    return True


def wait_router_ready(service: Service, router: Router, url: str, num_replicas: int) -> None:
    """Poll until the router lists every replica healthy and answers a completion."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if service.popen.poll() is not None:
            raise SystemExit(f"{router.label} exited; its log ends with:\n{service.log_tail()}")
        with contextlib.suppress(urllib.error.URLError, OSError, ValueError, KeyError):
            if _all_replicas_routable(router, url, num_replicas) and _answers_completion(url):
                return
        time.sleep(0.1)
    raise SystemExit(f"{router.label} was not ready after {START_TIMEOUT_S:.0f} s")


# -- measuring ---------------------------------------------------------------------------


def replica_counters(url: str) -> tuple[int, float, float]:
    """(requests finished, prefix-cache hit tokens, prefix-cache query tokens) of a replica."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    totals = {"vllm:request_success": 0.0, "vllm:prefix_cache_hits": 0.0,
              "vllm:prefix_cache_queries": 0.0}  # fmt: skip
    for family in text_string_to_metric_families(text):
        if family.name in totals:
            totals[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return (
        int(totals["vllm:request_success"]),
        totals["vllm:prefix_cache_hits"],
        totals["vllm:prefix_cache_queries"],
    )


def run_router(
    router: Router,
    settings: ClusterSettings,
    spec: WorkloadSpec,
    options: BenchOptions,
    log_dir: Path,
    running: list[Service],
    console: Console,
) -> RouterRun:
    """Fresh engines, the router, one replay; stops both before returning."""
    num_replicas = len(settings.layout)
    source = source_version()
    engines = spawn(f"{router.key}.engines", [*isocost_command(), *engine_args(settings)], log_dir)
    running.append(engines)
    urls = engines.wait_ready(num_replicas, START_TIMEOUT_S)
    config = log_dir / f"{router.key}.gateway.yaml"
    if not router.is_peer:
        config.write_bytes(msgspec.yaml.encode(gateway_config(settings, router.policy, urls)))
    port = free_port()
    env = {"HF_ENDPOINT": UNREACHABLE_HUB, "HF_HUB_OFFLINE": "1"} if router.is_peer else {}
    env[ADMIN_TOKEN_ENV] = settings.admin_token
    service = spawn(router.key, router_argv(router, port, urls, config), log_dir, env)
    running.append(service)
    url = f"http://{HOST}:{port}"
    try:
        wait_router_ready(service, router, url, num_replicas)
        console.print(f"{router.label}: ready at {url}; replaying")
        requests = build_workload(spec, closed_loop=False)
        result, _ = run_with_live_view(url, requests, options, console)
        counters = [replica_counters(u) for u in urls]
    finally:
        for started in (service, engines):
            started.stop(GRACE_S)
            running.remove(started)
    (log_dir / f"{router.key}.summary.json").write_bytes(msgspec.json.encode(result.summary))
    encoder = msgspec.json.Encoder()
    records = b"".join(encoder.encode(r) + b"\n" for r in result.records)
    (log_dir / f"{router.key}.records.jsonl").write_bytes(records)
    hits = sum(c[1] for c in counters)
    queries = sum(c[2] for c in counters)
    return RouterRun(
        router,
        result.summary,
        requests_by_replica=[c[0] for c in counters],
        prefix_hit_rate=hits / queries if queries else 0.0,
        isocost_source=source,
    )


# -- load --------------------------------------------------------------------------------


def offered_load(requests: list[WorkloadRequest], settings: ClusterSettings) -> dict[str, float]:
    """The replayed requests' rate, and prefill demand as a share of prefill capacity.

    Capacity: each replica, alone and busy with prefill only, finishes this mix's requests
    at 1 / (mean cost-model prefill time x slowdown x time scale) per second; the cluster's
    capacity is the sum. Prefix-cache hits are not counted, and decode comes on top.
    """
    span_s = max(r.arrival_s for r in requests) or 1.0
    rate_rps = len(requests) / span_s
    catalog = Catalog.builtin()
    capacity_rps = 0.0
    for replica in settings.layout:
        model = CostModel(catalog.model(settings.model), catalog.gpu(replica.gpu))
        mean_s = sum(model.prefill_time_s(r.prompt_tokens) for r in requests) / len(requests)
        capacity_rps += 1.0 / (mean_s * replica.slowdown * settings.time_scale)
    return {
        "requests": len(requests),
        "arrival_span_s": span_s,
        "rate_rps": rate_rps,
        "prompt_tokens_per_s": sum(r.prompt_tokens for r in requests) / span_s,
        "output_tokens_per_s": sum(r.output_tokens for r in requests) / span_s,
        "prefill_capacity_rps": capacity_rps,
        "prefill_load": rate_rps / capacity_rps,
    }


def replayed_requests(spec: WorkloadSpec, options: BenchOptions) -> list[WorkloadRequest]:
    """The requests a run sends: the workload cut by ``max_requests`` and ``duration_s``."""
    chosen: list[WorkloadRequest] = []
    for request in build_workload(spec, closed_loop=False):
        if options.max_requests is not None and len(chosen) >= options.max_requests:
            break
        if options.duration_s is not None and request.arrival_s >= options.duration_s:
            break
        chosen.append(request)
    return chosen


# -- reporting ---------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f}"


COLUMNS = (
    "router",
    "done / sent",
    "errors",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "TPOT p99 ms",
    "E2E p99 ms",
    "goodput req/s",
    "prefix hits",
    "finished on slowed",
)


def table_rows(runs: list[RouterRun], slowed: list[int]) -> list[list[str]]:
    rows = []
    for run in runs:
        s = run.summary
        served = sum(run.requests_by_replica) or 1
        on_slowed = sum(run.requests_by_replica[i] for i in slowed) / served
        errors = ", ".join(f"{k} {n}" for k, n in s.errors_by_kind.items())
        rows.append(
            [
                run.router.label,
                f"{s.completed} / {s.requests}",
                f"{s.errors}" + (f" ({errors})" if errors else ""),
                _ms(s.ttft_p50_s),
                _ms(s.ttft_p99_s),
                _ms(s.tpot_p99_s),
                _ms(s.e2e_p99_s),
                f"{s.goodput_rps:.2f}",
                f"{run.prefix_hit_rate:.0%}",
                f"{on_slowed:.1%}",
            ]
        )
    return rows


def ratios(runs: list[RouterRun], baseline: Callable[[Router], bool]) -> dict[str, Any] | None:
    """isocost equal_cost against the best ``baseline`` router of each metric (lowest P99
    TTFT, highest goodput); None unless equal_cost and a baseline both took part."""
    ours = next((r for r in runs if r.router.key == HEADLINE), None)
    others = [r for r in runs if baseline(r.router) and r.summary.ttft_p99_s is not None]
    if ours is None or ours.summary.ttft_p99_s is None or not others:
        return None
    best_ttft = min(others, key=lambda r: r.summary.ttft_p99_s or 0.0)
    best_goodput = max(others, key=lambda r: r.summary.goodput_rps)
    ttft_ratio = ours.summary.ttft_p99_s / (best_ttft.summary.ttft_p99_s or 1.0)
    goodput_ratio = (
        ours.summary.goodput_rps / best_goodput.summary.goodput_rps
        if best_goodput.summary.goodput_rps > 0
        else float("inf")
    )
    return {
        "ttft_p99_ratio": ttft_ratio,
        "ttft_p99_best_peer": best_ttft.router.label,
        "goodput_ratio": goodput_ratio,
        "goodput_best_peer": best_goodput.router.label,
        "aim_ttft_p99_ratio_at_most": 0.7,
        "aim_goodput_ratio_at_least": 1.3,
        "aim_met": ttft_ratio <= 0.7 and goodput_ratio >= 1.3,
    }


# (JSON key, what the ratio is against, which routers count)
COMPARISONS: tuple[tuple[str, str, Callable[[Router], bool]], ...] = (
    ("ratios", "the best peer's", lambda router: router.is_peer),
    ("ratios_slo", "the best <peer>_slo's", lambda router: router.is_slo_baseline),
)


def ratio_lines(result: dict[str, Any] | None, against: str) -> list[str]:
    if result is None:
        return [f"(no ratio to {against}: isocost equal_cost and one of them must both run)"]
    met = "met" if result["aim_met"] else "not met"
    return [
        f"isocost equal_cost P99 TTFT = {result['ttft_p99_ratio']:.3f}x {against} "
        f"({result['ttft_p99_best_peer']}); aim <= 0.7x",
        f"isocost equal_cost goodput = {result['goodput_ratio']:.3f}x {against} "
        f"({result['goodput_best_peer']}); aim >= 1.3x",
        f"aim (both) {met}",
    ]


def setup_lines(
    args: argparse.Namespace, settings: ClusterSettings, load: dict[str, float]
) -> list[str]:
    layout = ", ".join(
        f"{r.gpu}"
        + (f" (slowed {r.slowdown:g}x, not told to any router)" if r.slowdown != 1 else "")
        for r in settings.layout
    )
    return [
        f"trace: `{Path(args.trace).name}`, first {load['requests']:.0f} requests "
        f"({load['arrival_span_s']:.0f} s of arrivals after speed-up {args.speedup:g}x)",
        f"offered load: {load['rate_rps']:.2f} req/s, {load['prompt_tokens_per_s']:,.0f} "
        f"prompt tokens/s, {load['output_tokens_per_s']:,.0f} output tokens/s; prefill "
        f"alone (no cache hits) = {load['prefill_load']:.0%} of the cluster's prefill "
        f"capacity ({load['prefill_capacity_rps']:.2f} req/s), decode on top",
        f"replicas: {len(settings.layout)} x `isocost engine` {settings.model}: {layout}; "
        f"time scale {settings.time_scale:g}, {settings.stream_interval} tokens per SSE chunk, "
        "restarted (cold caches) before each router",
        f"goodput SLOs: TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms "
        f"(wall clock; {args.slo_ttft_ms / args.time_scale:g} and "
        f"{args.slo_tpot_ms / args.time_scale:g} ms of modelled GPU time); requests time out "
        f"after {args.timeout:g} s; latencies are wall ms over completed requests only; "
        + (
            "each request carries its targets (x-deadline-ms, x-tpot-ms: isocost's SLO "
            "admission reads them, the peers ignore them)"
            if args.send_slo
            else "requests carry no targets (isocost's SLO admission has none to act on)"
        ),
        f"peers: {', '.join(PEER_REQUIREMENTS)} (PyPI); isocost is told each replica's GPU",
    ]


def write_markdown(
    path: Path,
    command: str,
    wall_s: float,
    setup: list[str],
    rows: list[list[str]],
    ratio_text: list[str],
) -> None:
    lines = ["# isocost vs peer routers, live", ""]
    lines += [f"- {line}" for line in setup]
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", *[f"{line}  " for line in ratio_text], ""]
    lines += [f"Command (wall time {wall_s / 60:.1f} min):", "", "```", command, "```", ""]
    path.write_text("\n".join(lines))


# -- main --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    keys = ", ".join(r.key for r in ROUTERS)
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="trace file to replay")
    parser.add_argument("--speedup", type=float, default=2.0, help="trace time compression")
    parser.add_argument("--max-requests", type=int, default=240)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    parser.add_argument("--time-scale", type=float, default=0.5, help="engine wall s per GPU s")
    parser.add_argument("--stream-interval", type=int, default=8, help="tokens per SSE chunk")
    parser.add_argument("--slo-ttft-ms", type=float, default=2500.0, help="wall ms")
    parser.add_argument("--slo-tpot-ms", type=float, default=75.0, help="wall ms")
    parser.add_argument("--timeout", type=float, default=90.0, help="per request, s")
    parser.add_argument(
        "--send-slo",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="requests carry their SLO targets as headers (isocost's SLO admission)",
    )
    parser.add_argument("--seed", type=int, default=0, help="engine seed")
    parser.add_argument(
        "--routers", default=",".join(DEFAULT_ROUTERS), help=f"comma list from: {keys}"
    )
    parser.add_argument("--log-dir", type=Path, default=ROOT / "out" / "peers")
    parser.add_argument("--json", type=Path, default=HERE / "results.json")
    parser.add_argument("--markdown", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the load and the routers, start nothing"
    )
    args = parser.parse_args(argv)
    by_key = {r.key: r for r in ROUTERS}
    unknown = [k for k in args.routers.split(",") if k not in by_key]
    if unknown:
        parser.error(f"unknown router {', '.join(unknown)}; choose from {keys}")
    args.chosen = [by_key[k] for k in args.routers.split(",")]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    console = Console()
    if not console.is_terminal:  # a log file: room for the whole table
        console = Console(width=160)
    started_s = time.monotonic()
    command = " ".join(["benchmarks/peers/run.sh", *(sys.argv[1:] if argv is None else argv)])
    settings = ClusterSettings(
        model=MODEL,
        layout=DEFAULT_LAYOUT,
        time_scale=args.time_scale,
        stream_interval=args.stream_interval,
        gateway_host=HOST,
        gateway_port=0,
        admin_token=secrets.token_urlsafe(16),
        seed=args.seed,
    )
    spec = WorkloadSpec(trace=args.trace, speedup=args.speedup)
    options = BenchOptions(
        model=MODEL,  # sglang-router lists its model as "unknown"
        max_requests=args.max_requests,
        duration_s=args.duration,
        timeout_s=args.timeout,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        send_slo=args.send_slo,
    )
    load = offered_load(replayed_requests(spec, options), settings)
    setup = setup_lines(args, settings, load)
    for line in setup:
        console.print(line, soft_wrap=True)
    if args.dry_run:
        console.print(f"routers: {', '.join(r.key for r in args.chosen)}", soft_wrap=True)
        return
    ensure_peers_venv(console)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    running: list[Service] = []
    runs: list[RouterRun] = []
    try:
        for router in args.chosen:
            console.rule(router.label)
            labelled = replace(options, label=router.label)
            runs.append(
                run_router(router, settings, spec, labelled, args.log_dir, running, console)
            )
    finally:
        for service in reversed(running):
            service.stop(GRACE_S)
    wall_s = time.monotonic() - started_s
    slowed = [i for i, r in enumerate(settings.layout) if r.slowdown != 1]
    rows = table_rows(runs, slowed)
    table = Table(title="isocost vs peer routers (same trace, same engines, one at a time)")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column == "router" else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    results = {key: ratios(runs, counts) for key, _, counts in COMPARISONS}
    ratio_text = [
        line for key, against, _ in COMPARISONS for line in ratio_lines(results[key], against)
    ]
    sources = sorted({run.isocost_source for run in runs if not run.router.is_peer})
    ratio_text.append(f"isocost source: {'; '.join(sources) or '-'}")
    for line in ratio_text:
        console.print(line)
    console.print(f"wall time {wall_s:.0f} s")
    args.json.write_text(
        json.dumps(
            {
                "command": command,
                "wall_s": wall_s,
                "setup": setup,
                "load": load,
                "runs": [_run_json(run) for run in runs],
                **results,
            },
            indent=2,
        )
        + "\n"
    )
    write_markdown(args.markdown, command, wall_s, setup, rows, ratio_text)
    console.print(f"written: {args.json}, {args.markdown}; logs in {args.log_dir}")


def source_version() -> str:
    """The commit measured, and whether ``src/`` had uncommitted changes then."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "status", "--porcelain", "src"], capture_output=True, text=True)
    return head.stdout.strip() + (" with uncommitted changes in src/" if dirty.stdout else "")


def _run_json(run: RouterRun) -> dict[str, Any]:
    summary: dict[str, Any] = msgspec.to_builtins(run.summary)
    for samples in ("ttft_samples_s", "e2e_samples_s"):
        summary.pop(samples)  # in out/peers/<router>.summary.json
    return {
        "router": run.router.key,
        "label": run.router.label,
        "summary": summary,
        "requests_by_replica": run.requests_by_replica,
        "prefix_hit_rate": run.prefix_hit_rate,
        "isocost_source": run.isocost_source,
    }


if __name__ == "__main__":
    run_script(main)
