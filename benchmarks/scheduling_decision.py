"""Decision latency of every built-in policy across 1,000 replicas, young and old fleets.

Builds a fleet of ``--replicas`` replicas (llama-3.1-8b on A100, H100 and L40S in turn,
block size 512 as in the Mooncake trace) and feeds each policy the same synthetic stream:
prompts of 100-16,000 tokens sharing prefixes from 64 conversation roots, 100 sessions,
each request completing ``--in-flight`` arrivals after it was sent (so in-flight work and
the prefix index stay bounded, as in a steady cluster).

Two copies of each policy's fleet are fed: a young one (``--young`` requests seen) and an
old one (``--old`` requests seen). Then the same ``--probes`` requests are scheduled on
both, alternating young/old so that the machine's load hits both alike; only ``schedule``
is timed and probes are not dispatched. The table gives mean, median and p99 per fleet
and old/young of the means: near 1 means the decision cost does not grow with requests
seen. Then the same probes go through the old fleet once more, each as a whole request
on the hot path as the gateway drives it: ``schedule``, ``on_dispatch`` (reusing the
decision), ``on_first_token`` and ``on_complete``; the "hooks" column is their mean.

``--in-flight`` defaults to two requests per replica. The "admitted" column is the share
of probes the old fleet admitted: a fleet whose queues are at their caps answers QUEUE
before pricing anything, which would time a shortcut instead of a decision, so a run
where fewer than 90% were admitted says so and exits 1. ``--json FILE`` writes
``{policy: {"young": {"mean_us", "median_us", "p99_us"}, "old": {...}, "old_over_young",
"hot_path_mean_us", "admitted"}}``. Run:

    .venv/bin/python benchmarks/scheduling_decision.py --replicas 1000 --old 20000
    .venv/bin/python benchmarks/scheduling_decision.py --replicas 3 --young 200 --old 2000
    .venv/bin/python benchmarks/scheduling_decision.py --replicas 3 --young 200 --old 2000 \
        --tpot-ms 100

``--tpot-ms`` gives every request a TPOT target, as SLO-bound clients send one: SLO
admission's TPOT checks and equal_cost's headroom price are computed only for those.

With ``--prefix [REQUESTS]`` (default 2,000) it times instead the cluster simulator's
per-request prefix work, per prompt block, on REQUESTS of each of three workloads (the
scenario mix, multi-turn sessions, Mooncake-like 512-token trace blocks):
``PrefixIndex.insert`` into 4 replicas of an A100's KV capacity (round robin; the index
fills, then evicts as it inserts), and chained block hashes from segments two ways side by
side: "keys folded", block keys folded one by one with ``hash`` (the simulator's former
path), and "spans", ``prefix_block_hashes``:

    .venv/bin/python benchmarks/scheduling_decision.py --prefix

Figures depend on the machine and its load; compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from random import Random
from typing import Any

from rich.console import Console
from rich.progress import track
from rich.table import Table

from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.prefix.hashing import BLOCK_TOKENS as SIM_BLOCK_TOKENS
from isocost.prefix.hashing import ROOT_HASH
from isocost.prefix.index import PrefixIndex
from isocost.scheduling import (
    BUILTIN_POLICIES,
    Policy,
    ReplicaSet,
    ReplicaSpec,
    RequestView,
    build_policy,
)
from isocost.tables import Fitted
from isocost.workload import (
    Segment,
    SyntheticSpec,
    WorkloadRequest,
    poisson_arrivals,
    prefix_block_hashes,
    prefix_block_keys,
    segments_for_blocks,
    synthetic_workload,
)

BLOCK_TOKENS = 512
MODEL = "llama-3.1-8b"
_MASK = (1 << 63) - 1
_MIN_ADMITTED = 0.9  # of the probes, for the timings to be decisions (module docstring)


@dataclass
class Fleet:
    replicas: ReplicaSet
    policy: Policy
    now: float


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


def _requests(count: int, seed: int, tpot_target_s: float | None = None) -> list[RequestView]:
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
                tpot_target_s=tpot_target_s,
            )
        )
    return out


def _fed(name: str, size: int, requests: list[RequestView], in_flight: int) -> Fleet:
    """A fleet and its policy after ``requests`` went through, each completing
    ``in_flight`` arrivals after it was sent."""
    replicas = _fleet(size)
    policy = build_policy(name, rng=Random(1))
    replicas.add_listener(policy)
    pending: deque[str] = deque()
    now = 0.0
    for request in requests:
        now += 0.01
        decision = policy.schedule(request, replicas, now)
        if decision.replica_id is not None:
            replicas.on_dispatch(request, decision.replica_id, now)
            pending.append(request.request_id)
        if len(pending) > in_flight:
            done = pending.popleft()
            replicas.on_first_token(done, now)
            replicas.on_complete(done, now, output_tokens=128)
    return Fleet(replicas, policy, now)


def _probe(fleets: tuple[Fleet, Fleet], probes: list[RequestView]) -> list[list[float]]:
    """Seconds per ``schedule`` of each probe on each fleet, alternating between them."""
    timings: list[list[float]] = [[], []]
    for request in probes:
        for fleet, out in zip(fleets, timings, strict=True):
            start = time.perf_counter()
            fleet.policy.schedule(request, fleet.replicas, fleet.now)
            out.append(time.perf_counter() - start)
    return timings


def _hot_path(fleet: Fleet, probes: list[RequestView]) -> tuple[list[float], float]:
    """Seconds per probe for schedule plus the shadow hooks of one whole request, and
    the share of probes admitted."""
    timings, admitted = [], 0
    replicas, now = fleet.replicas, fleet.now
    for request in probes:
        start = time.perf_counter()
        decision = fleet.policy.schedule(request, replicas, now)
        if decision.replica_id is not None:
            replicas.on_dispatch(request, decision.replica_id, now, decision=decision)
            replicas.on_first_token(request.request_id, now)
            replicas.on_complete(request.request_id, now, output_tokens=128)
            admitted += 1
        timings.append(time.perf_counter() - start)
    return timings, admitted / len(probes)


def _prefix_workloads(count: int, seed: int) -> dict[str, list[WorkloadRequest]]:
    """The simulator's prompt shapes: one segment each, growing sessions, trace blocks."""
    rng = Random(seed)
    mix = synthetic_workload(SyntheticSpec("mix"), rng, poisson_arrivals(rng, 10.0))
    turns = SyntheticSpec("multi-turn", sessions=count // 8, turns=8)
    trace = []
    for i in range(count):
        prompt = rng.randint(100, 16_000)
        shared = rng.randint(0, prompt // 512)
        root = rng.randrange(64)
        ids = [root * 1000 + k for k in range(shared)] + [10**6 + i * 100 + k for k in range(32)]
        trace.append(WorkloadRequest(i, 0.0, prompt, 1, segments_for_blocks(ids, prompt)))
    return {
        "mix": [next(mix) for _ in range(count)],
        "multi-turn": list(synthetic_workload(turns, rng, poisson_arrivals(rng, 1.0))),
        "trace": trace,
    }


def _keys_folded(segments: tuple[Segment, ...]) -> tuple[int, ...]:
    """Chained hashes as block keys folded one by one (the simulator's former path)."""
    parent, hashes = ROOT_HASH, []
    for key in prefix_block_keys(segments, SIM_BLOCK_TOKENS):
        parent = hash((parent, key)) & _MASK
        hashes.append(parent)
    return tuple(hashes)


def _per_block_us(run: Callable[[], object], blocks: int) -> float:
    """Best of three runs of ``run``, in microseconds per block."""
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best / blocks * 1e6


def _hash_all(
    hasher: Callable[[tuple[Segment, ...]], object], prompts: list[tuple[Segment, ...]]
) -> None:
    for segments in prompts:
        hasher(segments)


def _spans_hashed(segments: tuple[Segment, ...]) -> tuple[int, ...]:
    return prefix_block_hashes(segments, SIM_BLOCK_TOKENS, ROOT_HASH)


def _insert_all(chains: list[tuple[int, ...]], capacity_blocks: int) -> None:
    """Each chain into one of 4 replicas, round robin: with an A100's capacity the index
    fills during the first half and then evicts as much as it inserts, as in a long run."""
    index = PrefixIndex()
    for replica in range(4):
        index.add_replica(replica, capacity_blocks)
    for i, chain in enumerate(chains):
        index.insert(i % 4, chain)


def prefix_micro(count: int, seed: int) -> None:
    """Microseconds per prompt block of the simulator's per-request prefix work."""
    table = Table(title=f"per-block prefix work, {count} requests per workload (best of 3)")
    columns = ("blocks/req", "hash: keys folded µs", "hash: spans µs", "insert µs")
    for column in ("workload", *columns):
        table.add_column(column, justify="right")
    cost_model = CostModel(Catalog.builtin().model(MODEL), Catalog.builtin().gpu("a100-80g"))
    capacity_blocks = cost_model.kv_capacity_tokens // SIM_BLOCK_TOKENS
    for name, requests in _prefix_workloads(count, seed).items():
        prompts = [r.segments for r in requests]
        chains = [_spans_hashed(s) for s in prompts]
        blocks = sum(map(len, chains))
        table.add_row(
            name,
            f"{blocks / len(chains):.0f}",
            f"{_per_block_us(partial(_hash_all, _keys_folded, prompts), blocks):.3f}",
            f"{_per_block_us(partial(_hash_all, _spans_hashed, prompts), blocks):.3f}",
            f"{_per_block_us(partial(_insert_all, chains, capacity_blocks), blocks):.3f}",
        )
    Console().print(table)


def _stats(window: list[float]) -> dict[str, float]:
    """Mean, median and p99 of ``window`` (seconds), in microseconds."""
    return {
        "mean_us": statistics.fmean(window) * 1e6,
        "median_us": statistics.median(window) * 1e6,
        "p99_us": statistics.quantiles(window, n=100)[98] * 1e6,
    }


def _decision_table(figures: dict[str, dict[str, Any]], title: str, full: bool) -> Table:
    """Every figure per policy (``full``), or the means alone for a narrow console."""
    table = Table(title=title)
    table.add_column("policy", no_wrap=True)
    stats = ("mean_us", "median_us", "p99_us") if full else ("mean_us",)
    for age in ("young", "old"):
        for stat in stats:
            label = f"{age} {stat.removesuffix('_us')}" if full else age
            table.add_column(f"{label} µs", justify="right")
    for header in ("old/young", "hooks µs", "admitted"):
        table.add_column(header, justify="right")
    for name, row in figures.items():
        cells = [name]
        for age in ("young", "old"):
            cells += [f"{row[age][stat]:.0f}" for stat in stats]
        cells.append(f"{row['old_over_young']:.2f}")
        cells.append(f"{row['hot_path_mean_us']:.0f}")
        cells.append(f"{row['admitted']:.0%}")
        table.add_row(*cells)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=1000)
    parser.add_argument("--young", type=int, default=2000, help="requests the young fleet saw")
    parser.add_argument("--old", type=int, default=20_000, help="requests the old fleet saw")
    parser.add_argument("--probes", type=int, default=1000)
    parser.add_argument("--in-flight", type=int, help="requests in flight (default: 2 per replica)")
    parser.add_argument("--policies", default=",".join(BUILTIN_POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tpot-ms",
        type=float,
        help="every request carries this TPOT target (SLO admission's TPOT checks and "
        "equal_cost's headroom price are priced only for such requests)",
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--prefix",
        type=int,
        nargs="?",
        const=2000,
        metavar="REQUESTS",
        help="time the simulator's prefix work per block instead, on REQUESTS per workload",
    )
    args = parser.parse_args()
    if args.prefix is not None:
        prefix_micro(args.prefix, args.seed)
        return
    if not 0 < args.young <= args.old or args.probes < 100 or args.replicas < 1:
        parser.error("need 0 < --young <= --old, --probes >= 100 and --replicas >= 1")
    if args.tpot_ms is not None and not (math.isfinite(args.tpot_ms) and args.tpot_ms > 0):
        parser.error("--tpot-ms must be a positive number of milliseconds")
    in_flight = 2 * args.replicas if args.in_flight is None else args.in_flight
    tpot_s = None if args.tpot_ms is None else args.tpot_ms / 1000
    stream = _requests(args.old + args.probes, args.seed, tpot_s)
    history, probes = stream[: args.old], stream[args.old :]
    figures: dict[str, dict[str, Any]] = {}
    for name in track(args.policies.split(","), description="policies"):
        young = _fed(name, args.replicas, history[: args.young], in_flight)
        old = _fed(name, args.replicas, history, in_flight)
        timings = _probe((young, old), probes)
        hot_path, admitted = _hot_path(old, probes)
        figures[name] = {
            "young": _stats(timings[0]),
            "old": _stats(timings[1]),
            "old_over_young": statistics.fmean(timings[1]) / statistics.fmean(timings[0]),
            "hot_path_mean_us": statistics.fmean(hot_path) * 1e6,
            "admitted": admitted,
        }
    title = (
        f"schedule() across {args.replicas} replicas, {in_flight} in flight, "
        f"young: {args.young} requests seen, old: {args.old}"
    )
    Console().print(Fitted(*(_decision_table(figures, title, full) for full in (True, False))))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    shortcut = [name for name, row in figures.items() if row["admitted"] < _MIN_ADMITTED]
    if shortcut:
        sys.exit(
            f"fewer than {_MIN_ADMITTED:.0%} of the probes admitted ({', '.join(shortcut)}): "
            "queues at their caps answer before pricing; lower --in-flight"
        )


if __name__ == "__main__":
    main()
