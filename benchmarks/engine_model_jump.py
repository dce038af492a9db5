"""Jumps against single steps in the pure engine model, side by side in one run.

Replays the same seeded workload (Poisson arrivals, shared-prefix prompts, long outputs)
through ``EngineModel(jump=False)`` (every step priced and applied) and
``EngineModel(jump=True)`` (decode runs in closed form: O(1) per run plus a short search,
O(batch) to apply) and reports CPU time per modelled engine step and the speed-up. Both
must give the same events, with times equal to 1e-9 (the closed form rounds differently).

Then it replays the workload again with a metrics scrape every ``--scrape-ms``, read once
by advancing the model to the scrape (what a simulator did) and once by
``EngineModel.observe`` (advancing only when the scrape falls outside the quiet window),
and reports CPU time per scrape. Run:

    .venv/bin/python benchmarks/engine_model_jump.py --requests 2000
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable
from dataclasses import astuple

from rich.console import Console
from rich.table import Table

from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.engine import EngineEvent, EngineModel, EngineObservation, RequestSpec
from isocost.prefix.hashing import token_block_hashes

Workload = list[tuple[float, RequestSpec]]


def _workload(requests: int, rate_rps: float, seed: int) -> Workload:
    rng = random.Random(seed)
    now, out = 0.0, []
    for i in range(requests):
        now += rng.expovariate(rate_rps)
        group = rng.randrange(8)
        tokens = [*range(group * 100_000, group * 100_000 + 1024)]
        tokens += range(10_000_000 + i * 1000, 10_000_000 + i * 1000 + rng.randint(16, 900))
        spec = RequestSpec(
            f"r{i}", len(tokens), rng.randint(200, 1500), tuple(token_block_hashes(tokens, 16))
        )
        out.append((now, spec))
    return out


def _replay(
    cost: CostModel, workload: Workload, jump: bool
) -> tuple[list[EngineEvent], int, float]:
    model = EngineModel(cost, jump=jump)
    events: list[EngineEvent] = []
    start = time.process_time()
    for now, spec in workload:
        events += model.advance_to(now)
        model.submit(spec, now)
    while (t := model.next_event_time()) is not None:
        events += model.advance_to(t)
    return events, model.counters.num_steps, time.process_time() - start


def _by_advancing(model: EngineModel, t: float) -> EngineObservation:
    model.advance_to(t)
    counters = model.counters
    return EngineObservation(
        model.num_running,
        model.num_waiting,
        model.kv_usage,
        counters.prefix_cache_queries,
        counters.prefix_cache_hits,
        counters.num_preemptions,
    )


def _by_observing(model: EngineModel, t: float) -> EngineObservation:
    quiet = model.quiet_until()
    if quiet is not None and t >= quiet:
        model.advance_to(t)
    return model.observe(t)


def _scraped(
    cost: CostModel,
    workload: Workload,
    scrape_s: float,
    read: Callable[[EngineModel, float], EngineObservation],
) -> tuple[list[EngineObservation], float]:
    """Scrape readings over the replay and the CPU seconds the scrapes took."""
    model = EngineModel(cost)
    readings: list[EngineObservation] = []
    spent = 0.0
    tick = scrape_s
    arrivals = iter(workload)
    arrival = next(arrivals, None)
    while arrival is not None or model.next_event_time() is not None:
        due = model.quiet_until()
        wake = min(arrival[0] if arrival else math.inf, due if due is not None else math.inf)
        while tick < wake:  # scrapes before the model's next wake-up
            start = time.process_time()
            readings.append(read(model, tick))
            spent += time.process_time() - start
            tick += scrape_s
        model.advance_to(wake)
        if arrival is not None and arrival[0] == wake:
            model.submit(arrival[1], wake)
            arrival = next(arrivals, None)
    return readings, spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=2.0, help="Arrivals per second.")
    parser.add_argument("--scrape-ms", type=float, default=200.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    catalog = Catalog.builtin()
    cost = CostModel(catalog.model("llama-3.1-8b"), catalog.gpu("h100-80g"), 1)
    workload = _workload(args.requests, args.rate, args.seed)
    stepped, steps, stepped_s = _replay(cost, workload, jump=False)
    jumped, _, jumped_s = _replay(cost, workload, jump=True)
    rows = [[(type(e).__name__, *astuple(e)) for e in x] for x in (stepped, jumped)]
    for a, b in zip(*rows, strict=True):
        assert [v for v in a if not isinstance(v, float)] == [
            v for v in b if not isinstance(v, float)
        ], "jumps changed the events"
        assert all(
            math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)
            for x, y in zip(a, b, strict=True)
            if isinstance(x, float)
        ), "jumps moved an event"
    table = Table(title=f"{args.requests} requests, {steps:,} engine steps")
    for column in ("mode", "CPU s", "µs / step", "speed-up"):
        table.add_column(column, justify="right")
    table.add_row("single steps", f"{stepped_s:.2f}", f"{stepped_s / steps * 1e6:.2f}", "1.0x")
    table.add_row(
        "jumps", f"{jumped_s:.2f}", f"{jumped_s / steps * 1e6:.2f}", f"{stepped_s / jumped_s:.1f}x"
    )
    Console().print(table)

    scrape_s = args.scrape_ms / 1000
    advanced, advanced_s = _scraped(cost, workload, scrape_s, _by_advancing)
    observed, observed_s = _scraped(cost, workload, scrape_s, _by_observing)
    assert observed == advanced, "observe read something advancing did not"
    table = Table(title=f"{len(observed):,} scrapes, one every {args.scrape_ms:g} ms")
    for column in ("read by", "CPU s", "µs / scrape", "speed-up"):
        table.add_column(column, justify="right")
    per = 1e6 / len(observed)
    table.add_row("advance_to", f"{advanced_s:.2f}", f"{advanced_s * per:.1f}", "1.0x")
    table.add_row(
        "observe",
        f"{observed_s:.2f}",
        f"{observed_s * per:.1f}",
        f"{advanced_s / observed_s:.1f}x",
    )
    Console().print(table)


if __name__ == "__main__":
    main()
