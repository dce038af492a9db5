"""How far the cluster simulator scales, on one core.

Runs (each in this process, one after the other, so figures are side by side):

* ``big``: 1,024 GPUs as 128 replicas x TP 8 of Llama-3.1-70B on H100-80G, the scenario
  mix at ``--big-rate`` req/s for ``--big-duration`` simulated seconds (default one hour).
* ``wide``: 1,024 replicas x TP 1 of Llama-3.1-8B on A100-80G, the mix at ``--wide-rate``
  req/s for ``--wide-duration`` simulated seconds.
* growth: the wide cluster's cost as replicas grow (64 .. 1,024 at a fixed rate per
  replica) and as requests grow (the same cluster for 1x, 2x, 4x the duration).
* decisions: one ``Policy.schedule`` call per policy against 16 .. 1,024 replicas holding
  in-flight work, microseconds per decision (the brain alone, no engine).

Each run reports wall and CPU seconds, then events, simulated requests and simulated
seconds per CPU second (CPU time of this process, so that a busy shared host does not
distort the rates) and mean replica utilisation (busy time / span).

    .venv/bin/python benchmarks/sim_scale.py                 # everything (long)
    .venv/bin/python benchmarks/sim_scale.py --only decisions
    .venv/bin/python benchmarks/sim_scale.py --only big --big-duration 600
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass
from random import Random

from rich.console import Console
from rich.table import Table

from isocost.core.catalog import Catalog
from isocost.scheduling.contract import ReplicaSpec, RequestView
from isocost.scheduling.policies import build_policy
from isocost.scheduling.state import ReplicaSet
from isocost.sim import ClusterConfig, ReplicaGroup, Simulator, block_hashes, resolve_cluster
from isocost.workload import WorkloadRequest, poisson_arrivals, scenario_mix

CATALOG = Catalog.builtin()
POLICY = "equal_cost"


@dataclass(frozen=True, slots=True)
class Measured:
    label: str
    replicas: int
    requests: int
    sim_s: float
    wall_s: float
    cpu_s: float  # this process's CPU time: what the run costs, whatever else the host runs
    events: int
    utilisation: float

    def row(self) -> list[str]:
        return [
            self.label,
            f"{self.replicas:,}",
            f"{self.requests:,}",
            f"{self.sim_s:,.0f}",
            f"{self.wall_s:,.1f}",
            f"{self.cpu_s:,.1f}",
            f"{self.events / self.cpu_s:,.0f}",
            f"{self.requests / self.cpu_s:,.0f}",
            f"{self.sim_s / self.cpu_s:,.1f}",
            f"{100 * self.utilisation:.0f}%",
        ]


def mix(rate_rps: float, duration_s: float, seed: int = 0) -> list[WorkloadRequest]:
    rng = Random(seed)
    stream = scenario_mix(rng, poisson_arrivals(rng, rate_rps), max_prompt_tokens=32_000)
    return list(itertools.takewhile(lambda r: r.arrival_s < duration_s, stream))


def simulate(
    label: str,
    gpu: str,
    model: str,
    tp: int,
    replicas: int,
    rate_rps: float,
    duration_s: float,
    scrape_interval_ms: float,
) -> Measured:
    config = ClusterConfig(
        replicas=[ReplicaGroup(gpu=gpu, model=model, tp=tp, count=replicas)],
        scrape_interval_ms=scrape_interval_ms,
    )
    requests = mix(rate_rps, duration_s)
    simulator = Simulator(
        config,
        resolve_cluster(config, CATALOG),
        build_policy(POLICY, rng=Random(0)),
        requests,
        model=model,
    )
    cpu_started = time.process_time()
    result = simulator.run()
    cpu_s = time.process_time() - cpu_started
    unsettled = sum(not r.settled for r in result.records)
    assert unsettled == 0, f"{unsettled} requests never settled"
    span = max(result.end_s, 1e-9)
    return Measured(
        label,
        replicas,
        len(requests),
        result.end_s,
        result.wall_s,
        cpu_s,
        result.num_events,
        sum(result.busy_s) / (span * replicas),
    )


def decisions(console: Console, sizes: list[int], repeat: int) -> None:
    """Microseconds per ``schedule`` call, per policy and replica count."""
    policies = ["round_robin", "least_request", "power_of_two", "sglang_cache_aware",
                "llmd_default", "dynamo_kv", "equal_cost"]  # fmt: skip
    cost = resolve_cluster(
        ClusterConfig(replicas=[ReplicaGroup(gpu="a100-80g", model="llama-3.1-8b")]), CATALOG
    )[0].cost_model
    rng = Random(1)
    probes = [
        RequestView(f"probe-{i}", "llama-3.1-8b", r.prompt_tokens, block_hashes(r))
        for i, r in enumerate(mix(50.0, 10.0, seed=7)[:repeat])
    ]
    table = Table(title="CPU µs per Policy.schedule call (best of 3; 4 requests in flight each)")
    table.add_column("policy")
    for n in sizes:
        table.add_column(f"{n:,} replicas", justify="right")
    table.add_column(f"{sizes[-1]}/{sizes[0]} ratio", justify="right")
    for name in policies:
        cells = []
        per_size = []
        for n in sizes:
            replicas = ReplicaSet(block_tokens=16)
            for i in range(n):
                replicas.add(ReplicaSpec(f"r{i}", "llama-3.1-8b", cost))
            policy = build_policy(name, rng=Random(0))
            replicas.add_listener(policy)
            for j, request in enumerate(mix(50.0, 4 * n / 50.0, seed=3)[: 4 * n]):
                view = RequestView(
                    f"w{j}", "llama-3.1-8b", request.prompt_tokens, block_hashes(request)
                )
                replicas.on_dispatch(view, f"r{rng.randrange(n)}", 0.0)
            passes = []
            for _ in range(3):
                started = time.process_time()
                for probe in probes:
                    policy.schedule(probe, replicas, 1.0)
                passes.append(time.process_time() - started)
            per_call = min(passes) / len(probes) * 1e6
            per_size.append(per_call)
            cells.append(f"{per_call:,.0f}")
        table.add_row(name, *cells, f"{per_size[-1] / per_size[0]:.1f}x")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["big", "wide", "growth", "decisions"], default=None)
    parser.add_argument("--big-rate", type=float, default=128.0, help="req/s, 128 x TP8 70B")
    parser.add_argument("--big-duration", type=float, default=3600.0)
    parser.add_argument("--wide-rate", type=float, default=1024.0, help="req/s, 1024 x 8B")
    parser.add_argument("--wide-duration", type=float, default=30.0)
    parser.add_argument("--scrape-interval-ms", type=float, default=200.0)
    args = parser.parse_args()
    console = Console()
    runs: list[Measured] = []
    scrape = args.scrape_interval_ms

    def show() -> None:
        table = Table(title=f"isocost sim scale ({POLICY}, scrape every {scrape:g} ms)")
        for name in ("run", "replicas", "requests", "sim s", "wall s", "cpu s", "events/cpu s",
                     "req/cpu s", "sim s/cpu s", "util"):  # fmt: skip
            table.add_column(name, justify="left" if name == "run" else "right")
        for run in runs:
            table.add_row(*run.row())
        console.print(table)

    if args.only in (None, "decisions"):
        decisions(console, [16, 128, 1024], repeat=200)
    if args.only in (None, "big"):
        runs.append(simulate("big: 128 x TP8 70B H100", "h100-80g", "llama-3.1-70b", 8, 128,
                             args.big_rate, args.big_duration, scrape))  # fmt: skip
        show()
    if args.only in (None, "wide"):
        runs.append(simulate("wide: 1024 x TP1 8B A100", "a100-80g", "llama-3.1-8b", 1, 1024,
                             args.wide_rate, args.wide_duration, scrape))  # fmt: skip
        show()
    if args.only in (None, "growth"):
        per_replica = args.wide_rate / 1024
        for n in (64, 256, 1024):
            runs.append(simulate(f"replicas x{n // 64}", "a100-80g", "llama-3.1-8b", 1, n,
                                 per_replica * n, args.wide_duration, scrape))  # fmt: skip
        for k in (1, 2, 4):
            runs.append(simulate(f"requests x{k}", "a100-80g", "llama-3.1-8b", 1, 64,
                                 per_replica * 64, k * args.wide_duration, scrape))  # fmt: skip
        show()


if __name__ == "__main__":
    main()
