"""Prefill/decode disaggregation against colocated serving, on 16 simulated GPUs.

Two traces (``../shared/traces``): the Mooncake conversation trace (long prompts: mean
12k tokens, a third of its blocks shared) and the Azure LLM inference code trace (short
ones: mean ~2k tokens, ~28 output tokens; the conversation trace of that release is not
in ``../shared/traces``, so the code trace stands for short-prompt traffic). The first
``--max-requests`` of each replay through the cluster simulator (``isocost sim``'s
engine model and the gateway's own brain) on 16 Llama-3.1-8B replicas on A100-80G, TP 1,
three ways, every one equal_cost:

* ``colocated``: 16 replicas of role ``both``, never split;
* ``pd``: P prefill-only + D decode-only replicas, P + D = 16; every request split
  (``scheduling.disagg``, mode ``pd``), its KV over InfiniBand NDR;
* ``conditional``: the same P:D, each request split only where the brain predicts the
  split cheaper than prefilling on a decode replica (mode ``conditional``).

The split is chosen by a rule, never by the capacity it measures: ``isocost plan
--disaggregate 16`` for the trace's mean prompt, mean cached prefix (what earlier prompts
of the trace hold), mean output and the TPOT target (``core.planner.plan_disaggregation``:
pools in proportion to the replica-seconds a request takes in each). ``--ratios 4:12,8:8``
adds other splits, each measured in both modes, to see how far the rule is from the best.

Capacity at SLO: the highest rate at which 90% of requests meet TTFT <= 2 s + 0.25 s per
1k prompt tokens and a tight TPOT <= 40 ms, bisected to 10% (``sim._capacity``). Requests
carry their targets (SLO admission on, as equal_cost runs in production).

    .venv/bin/python benchmarks/pd.py --json pd.json           # the README's figures
    .venv/bin/python benchmarks/pd.py --quick                  # a smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.core.planner import plan_disaggregation
from isocost.core.slo import SloTargets
from isocost.files import load_trace
from isocost.prefix.hashing import BLOCK_TOKENS
from isocost.sim import (
    CapacityResult,
    CapacitySpec,
    CapacityStatus,
    ClusterConfig,
    ReplicaGroup,
    SimPlan,
    resolve_cluster,
    reusable_prefix_blocks,
    run_capacity,
)
from isocost.workload import WorkloadRequest

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
CATALOG = Catalog.builtin()
GPUS = 16
GPU, MODEL = "a100-80g", "llama-3.1-8b"
SLO = SloTargets(ttft_s=2.0, ttft_per_1k_s=0.25, tpot_s=0.040, share=0.9)
LINK = "infiniband"
MODES = ("colocated", "pd", "conditional")


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    file: str
    trace_format: str
    low_rps: float
    high_rps: float


TRACE_SET = (
    Trace("mooncake", "mooncake_conversation_trace.jsonl", "mooncake", 0.5, 40.0),
    Trace("azure_code", "AzureLLMInferenceTrace_code.csv", "azure", 2.0, 200.0),
)


@dataclass(frozen=True, slots=True)
class Measured:
    trace: str
    mode: str
    prefill_replicas: int  # 0: colocated
    decode_replicas: int
    split_by: str  # "planner", "given" (--ratios) or "-" (colocated)
    result: CapacityResult
    disaggregated_share: float | None  # at the highest rate that met the target
    wall_s: float

    def json(self) -> dict[str, object]:
        return {
            "trace": self.trace,
            "mode": self.mode,
            "prefill_replicas": self.prefill_replicas,
            "decode_replicas": self.decode_replicas,
            "split_by": self.split_by,
            "capacity_at_slo_rps": self.result.capacity_rps,
            "status": self.result.status.value,
            "meets_at_rps": self.result.meets_rps,
            "misses_at_rps": self.result.misses_rps,
            "disaggregated_share_at_capacity": self.disaggregated_share,
        }


def cluster(mode: str, prefill: int) -> ClusterConfig:
    if mode == "colocated":
        groups = [ReplicaGroup(gpu=GPU, model=MODEL, count=GPUS, name="both")]
        return ClusterConfig(replicas=groups)
    groups = [
        ReplicaGroup(gpu=GPU, model=MODEL, count=prefill, name="p", role="prefill"),
        ReplicaGroup(gpu=GPU, model=MODEL, count=GPUS - prefill, name="d", role="decode"),
    ]
    return ClusterConfig(replicas=groups, link=LINK, disaggregation=mode)  # type: ignore[arg-type]


def planned_prefill(requests: Sequence[WorkloadRequest], cost: CostModel) -> int:
    """``isocost plan --disaggregate 16``'s prefill replicas for these requests."""
    cached = [
        min(blocks * BLOCK_TOKENS, r.prompt_tokens - 1)
        for blocks, r in zip(reusable_prefix_blocks(requests), requests, strict=True)
    ]
    split = plan_disaggregation(
        cost,
        GPUS,
        prompt_tokens=round(statistics.fmean(r.prompt_tokens for r in requests)),
        output_tokens=max(round(statistics.fmean(r.output_tokens for r in requests)), 1),
        cached_tokens=round(statistics.fmean(cached)),
        tpot_slo_s=SLO.tpot_s,
    )
    return split.prefill_replicas


def measure(
    trace: Trace,
    requests: list[WorkloadRequest],
    mode: str,
    prefill: int,
    split_by: str,
    spec: CapacitySpec,
    console: Console,
) -> Measured:
    config = cluster(mode, prefill)
    plan = SimPlan(
        cluster=config,
        replicas=tuple(resolve_cluster(config, CATALOG)),
        requests=requests,
        policies=("equal_cost",),
        slo=SLO,
        capacity=spec,
        jobs=1,
    )
    started = time.monotonic()
    probes = 0

    def progress(round_: Sequence[tuple[str, float]]) -> None:  # no bar: a line a round
        nonlocal probes
        probes += len(round_)
        rates = ", ".join(f"{rate:.3g}" for _, rate in round_)
        console.print(f"  {trace.name} {mode} {prefill}:{GPUS - prefill} probe {rates} req/s")

    output = run_capacity(plan, progress)
    result = output.results["equal_cost"]
    at_capacity = [r for r in output.probes["equal_cost"] if r.rate_rps == result.meets_rps]
    share = None
    if at_capacity and at_capacity[0].disagg is not None:
        share = at_capacity[0].disagg.disaggregated_share
    colocated = mode == "colocated"
    return Measured(
        trace.name,
        mode,
        0 if colocated else prefill,
        GPUS if colocated else GPUS - prefill,
        "-" if colocated else split_by,
        result,
        share,
        time.monotonic() - started,
    )


def table(runs: Sequence[Measured]) -> Table:
    out = Table(
        title=f"capacity at SLO, {GPUS} x {MODEL} on {GPU} (TTFT 2 s + 0.25 s/1k, "
        f"TPOT {SLO.tpot_s * 1000:.0f} ms, {SLO.share:.0%})",
        title_justify="left",
        caption="P:D prefill:decode replicas, split by the planner or given by --ratios; "
        "x col: capacity / colocated's; split %: requests split at the capacity",
        caption_justify="left",
    )
    out.add_column("trace", no_wrap=True)
    out.add_column("mode", no_wrap=True)
    for header in ("P:D", "split by", "capacity\nreq/s", "x col", "split\n%", "wall\ns"):
        out.add_column(header, justify="right")
    colocated = {r.trace: r.result.capacity_rps for r in runs if r.mode == "colocated"}
    for run in runs:
        capacity, base = run.result.capacity_rps, colocated.get(run.trace)
        ratio = "-" if capacity is None or not base else f"{capacity / base:.2f}"
        if run.result.status is CapacityStatus.AT_LEAST_HIGH and ratio != "-":
            ratio = ">=" + ratio
        share = run.disaggregated_share
        out.add_row(
            run.trace,
            run.mode,
            "-" if run.mode == "colocated" else f"{run.prefill_replicas}:{run.decode_replicas}",
            run.split_by,
            _capacity_text(run.result),
            ratio,
            "-" if share is None else f"{100 * share:.0f}",
            f"{run.wall_s:.0f}",
        )
    return out


def _capacity_text(result: CapacityResult) -> str:
    """The capacity found, marked when the search hit its ceiling (a lower bound)."""
    if result.capacity_rps is None:
        return "below"
    at_least = result.status is CapacityStatus.AT_LEAST_HIGH
    return f"{'>=' if at_least else ''}{result.capacity_rps:.2f}"


def parse_ratios(text: str) -> list[int]:
    """``4:12,8:8`` -> prefill replicas [4, 8]; each pair must add up to 16."""
    prefill: list[int] = []
    for part in filter(None, text.split(",")):
        p_text, _, d_text = part.partition(":")
        if not (p_text.isdigit() and d_text.isdigit()) or int(p_text) + int(d_text) != GPUS:
            raise ValueError(f"--ratios: {part!r} is not P:D with P + D = {GPUS}, both >= 1")
        if int(p_text) < 1 or int(d_text) < 1:
            raise ValueError(f"--ratios: {part!r} needs at least one replica on each side")
        prefill.append(int(p_text))
    return prefill


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-requests", type=int, default=1000, help="first N of each trace")
    parser.add_argument("--ratios", default="", help="more P:D splits, e.g. 4:12,8:8")
    parser.add_argument("--precision", type=float, default=0.1)
    parser.add_argument("--quick", action="store_true", help="smoke: 120 requests, 30%% bracket")
    parser.add_argument("--json", help="write one object per (trace, mode, split)")
    args = parser.parse_args()
    console = Console(stderr=True)
    try:
        extra = parse_ratios(args.ratios)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.max_requests < 10:
        print("error: --max-requests must be >= 10", file=sys.stderr)
        return 2
    max_requests = 120 if args.quick else args.max_requests
    precision = 0.3 if args.quick else args.precision
    cost = resolve_cluster(cluster("colocated", 0), CATALOG)[0].cost_model
    runs: list[Measured] = []
    for trace in TRACE_SET:
        requests = load_trace(TRACES / trace.file, trace.trace_format)[:max_requests]  # type: ignore[arg-type]
        spec = CapacitySpec(trace.low_rps, trace.high_rps, precision, SLO.share)
        planned = planned_prefill(requests, cost)
        splits = [(planned, "planner")] + [(p, "given") for p in extra if p != planned]
        runs.append(measure(trace, requests, "colocated", 0, "-", spec, console))
        for prefill, split_by in splits:
            for mode in ("pd", "conditional"):
                runs.append(measure(trace, requests, mode, prefill, split_by, spec, console))
    Console().print(table(runs))
    if args.json:
        rows = [run.json() for run in runs]
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
