"""Jumps against single steps in the pure engine model, side by side in one run.

Replays the same seeded workload (Poisson arrivals, shared-prefix prompts, long outputs)
through ``EngineModel(jump=True)`` and ``EngineModel(jump=False)`` and reports wall time
per modelled engine step and the speed-up; both must produce identical events. Run:

    .venv/bin/python benchmarks/engine_model_jump.py --requests 2000
"""

from __future__ import annotations

import argparse
import random
import time

from rich.console import Console
from rich.table import Table

from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.engine import EngineEvent, EngineModel, RequestSpec
from isocost.prefix.hashing import token_block_hashes


def _workload(requests: int, rate_rps: float, seed: int) -> list[tuple[float, RequestSpec]]:
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
    cost: CostModel, workload: list[tuple[float, RequestSpec]], jump: bool
) -> tuple[list[EngineEvent], int, float]:
    model = EngineModel(cost, jump=jump)
    events: list[EngineEvent] = []
    start = time.perf_counter()
    for now, spec in workload:
        events += model.advance_to(now)
        model.submit(spec, now)
    while (t := model.next_event_time()) is not None:
        events += model.advance_to(t)
    return events, model.counters.num_steps, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=2.0, help="Arrivals per second.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    catalog = Catalog.builtin()
    cost = CostModel(catalog.model("llama-3.1-8b"), catalog.gpu("h100-80g"), 1)
    workload = _workload(args.requests, args.rate, args.seed)
    stepped, steps, stepped_s = _replay(cost, workload, jump=False)
    jumped, _, jumped_s = _replay(cost, workload, jump=True)
    assert jumped == stepped, "jumps changed the events"
    table = Table(title=f"{args.requests} requests, {steps:,} engine steps")
    for column in ("mode", "wall s", "µs / step", "speed-up"):
        table.add_column(column, justify="right")
    table.add_row("single steps", f"{stepped_s:.2f}", f"{stepped_s / steps * 1e6:.1f}", "1.0x")
    table.add_row(
        "jumps", f"{jumped_s:.2f}", f"{jumped_s / steps * 1e6:.1f}", f"{stepped_s / jumped_s:.1f}x"
    )
    Console().print(table)


if __name__ == "__main__":
    main()
