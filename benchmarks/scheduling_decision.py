"""Decision latency of every built-in policy across 1,000 replicas, early and late in a run.

Builds a fleet of ``--replicas`` replicas (llama-3.1-8b on A100, H100 and L40S in turn,
block size 512 as in the Mooncake trace) and feeds each policy the same synthetic stream:
prompts of 100-16,000 tokens sharing prefixes from 64 conversation roots, 100 sessions,
each request completing ``--in-flight`` arrivals after it was sent (so in-flight work,
and the prefix index, stay bounded as in a steady cluster). Only ``schedule`` is timed.

For each policy it reports the mean and p99 decision time over an early window (requests
1,000-2,000) and a late one (the last 1,000 of ``--requests``), and late/early: a ratio
near 1 means the decision cost does not grow with requests seen. Run:

    .venv/bin/python benchmarks/scheduling_decision.py --replicas 1000 --requests 10000

Figures depend on the machine and its load; compare rows of one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque
from random import Random

from rich.console import Console
from rich.progress import track
from rich.table import Table

from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.prefix.hashing import ROOT_HASH
from isocost.scheduling import BUILTIN_POLICIES, ReplicaSet, ReplicaSpec, RequestView, build_policy

BLOCK_TOKENS = 512
MODEL = "llama-3.1-8b"


def _fleet(size: int) -> ReplicaSet:
    catalog = Catalog.builtin()
    models = [
        CostModel(catalog.model(MODEL), catalog.gpu(gpu))
        for gpu in ("a100-80g", "h100-80g", "l40s-48g")
    ]
    replicas = ReplicaSet(block_tokens=BLOCK_TOKENS)
    for i in range(size):
        replicas.add(ReplicaSpec(f"r{i:04d}", MODEL, models[i % 3]))
    return replicas


def _requests(count: int, seed: int) -> list[RequestView]:
    rng = Random(seed)
    out = []
    for i in range(count):
        prompt = rng.randint(100, 16_000)
        root = rng.randrange(64)
        shared = rng.randint(0, prompt // BLOCK_TOKENS)
        blocks = [hash((ROOT_HASH, root, k)) for k in range(shared)]
        blocks += [hash((i, k)) for k in range(shared, prompt // BLOCK_TOKENS)]
        out.append(
            RequestView(
                f"q{i}",
                MODEL,
                prompt,
                block_hashes=tuple(blocks),
                max_tokens=rng.choice([64, 256, 1024]),
                session_key=f"s{rng.randrange(100)}",
            )
        )
    return out


def _run(name: str, size: int, requests: list[RequestView], in_flight: int) -> list[float]:
    replicas = _fleet(size)
    policy = build_policy(name, rng=Random(1))
    replicas.add_listener(policy)
    pending: deque[str] = deque()
    timings = []
    now = 0.0
    for request in requests:
        now += 0.01
        start = time.perf_counter()
        decision = policy.schedule(request, replicas, now)
        timings.append(time.perf_counter() - start)
        if decision.replica_id is not None:
            replicas.on_dispatch(request, decision.replica_id, now)
            pending.append(request.request_id)
        if len(pending) > in_flight:
            done = pending.popleft()
            replicas.on_first_token(done, now)
            replicas.on_complete(done, now, output_tokens=128)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--in-flight", type=int, default=2000)
    parser.add_argument("--policies", default=",".join(BUILTIN_POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.requests < 3000:
        parser.error("--requests must be >= 3000 (two disjoint windows of 1,000)")
    requests = _requests(args.requests, args.seed)
    table = Table(title=f"schedule() across {args.replicas} replicas, {args.requests} requests")
    for column in ("policy", "early mean µs", "early p99 µs", "late mean µs", "late p99 µs"):
        table.add_column(column, justify="right" if "µs" in column else "left")
    table.add_column("late/early", justify="right")
    for name in track(args.policies.split(","), description="policies"):
        timings = _run(name, args.replicas, requests, args.in_flight)
        early, late = timings[1000:2000], timings[-1000:]
        early_mean, late_mean = statistics.fmean(early), statistics.fmean(late)
        table.add_row(
            name,
            f"{early_mean * 1e6:.0f}",
            f"{statistics.quantiles(early, n=100)[98] * 1e6:.0f}",
            f"{late_mean * 1e6:.0f}",
            f"{statistics.quantiles(late, n=100)[98] * 1e6:.0f}",
            f"{late_mean / early_mean:.2f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
