"""Capacity that follows the traffic: four ways to size one simulated day, side by side.

One day of traffic (compressed to ``--day-s`` simulated seconds, default one hour, so
that the four runs take minutes; cold starts and bursts keep their real length, which
makes the day harder to follow, not easier) replays through the cluster simulator four
ways:

* ``static_peak``: the pool's max (64 replicas) all day;
* ``static_mean``: the replicas the day's mean rate needs, all day;
* ``hpa``: Kubernetes' HPA formula ``desired = ceil(current x metric / target)`` on
  queue length per replica, 10% tolerance, the default scale-up limit, 5-minute
  scale-down stabilization (``control.HpaScaler``); its target is a user's tuning knob,
  so it runs at each of ``--hpa-targets`` (rows ``hpa@<target>``, the GPU-hours against
  attainment frontier) and ``hpa`` is the default target (0.5, settled on seed 0);
* ``isocost``: ``control.Autoscaler``, given the previous day's measured rates (the same
  diurnal shape, its own bursts and noise) as its seasonal history; each scale event
  moves at least 30% of the fleet (``scale_step``), and ``--isocost-target`` /
  ``--isocost-headroom`` / ``--isocost-step`` are its own knobs (attainment target 0.98,
  headroom 0.2, step 0.3).

And a reference, not a fifth way: ``isocost_oracle``, the same autoscaler with a perfect
forecast (today's noiseless rate, bursts included, over each horizon), so that what
forecasting error costs shows apart from what the decisions themselves cost (lead,
cool-downs, scale-in hysteresis, cold starts, the learned capacity).

Traffic: a diurnal curve (``trough + (peak - trough) x ((1 - cos) / 2)^2``: a long night,
a daytime peak) from the rate 16 replicas serve to the rate 64 serve with 20% headroom,
at the capacity per replica measured first (the highest load at which 16 replicas meet
98% of the SLOs; isocost starts from the planner's own figure instead); 6 random bursts
(+40% of the current rate within 30 s, for 4 minutes); Poisson arrivals. Prompt and
output lengths are drawn from the Mooncake trace (``../shared/traces``; prompts up to
32k tokens, 93% of it: a longer prefill misses the TTFT target even on an idle replica),
each prompt its own (no shared prefixes, so routing affinity plays no part).
Llama-3.1-70B on 4x A100-80G per replica; every start takes 2-5 minutes (uniform, the
same draws for both scalers). SLO: TTFT 2 s + 0.25 s per 1k prompt tokens, TPOT 100 ms.
Requests carry no deadline (no SLO admission): overload shows as queueing, the signal
HPA scales on.

Reported per way: GPU-hours and $ over the day (a replica counts from its start, cold
start included, to its stop), the GPU-hours of those cold starts, SLO attainment (share
of all requests that completed within both targets), ramp misses (requests that missed
the SLO among those arriving in a ramp-up window: a minute from which the noiseless rate
rises by at least 5% of the peak within the next 5 minutes), scale events (decisions
that changed the fleet), and requests killed by a scale-in. The header also gives a
clairvoyant reference: the GPU-hours of a fleet that knows the noiseless rate and starts
instantly.

isocost is then held against static-at-peak and against the HPA setting of matching
attainment: the cheapest target whose attainment is at least isocost's; where none
reaches it, that is said, and the aims are counted against HPA's best target instead.

    .venv/bin/python benchmarks/autoscale.py --json autoscale.json
    .venv/bin/python benchmarks/autoscale.py --day-s 1800 --ways hpa,isocost \
        --hpa-targets 0.5   # quick look
    .venv/bin/python benchmarks/autoscale.py --ways isocost --isocost-target 0.6 \
        --isocost-headroom 0   # isocost, leaner: its own knobs
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
from dataclasses import dataclass, replace
from pathlib import Path
from random import Random

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from isocost.control import (
    AutoscaleConfig,
    Autoscaler,
    HpaScaler,
    PoolOffer,
    Scaler,
    parse_autoscale_config,
    planned_capacity_rps,
)
from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError
from isocost.core.slo import SloTargets
from isocost.files import load_trace
from isocost.runtime.processes import dies_with, run_script
from isocost.scheduling.policies import build_policy
from isocost.sim import (
    ClusterConfig,
    ReplicaGroup,
    SimAutoscaler,
    SimReplica,
    Simulator,
    met_slo,
    replica_usd_per_hour,
    resolve_cluster,
)
from isocost.workload import WorkloadRequest, segments_for_blocks

WAYS = ("static_peak", "static_mean", "hpa", "isocost", "isocost_oracle")
TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
MODEL, GPU, TP = "llama-3.1-70b", "a100-80g", 4
MIN_REPLICAS, MAX_REPLICAS = 16, 64
HEADROOM = 0.2
SLO = SloTargets(ttft_s=2.0, tpot_s=0.1, ttft_per_1k_s=0.25)
COLD_START_S = (120.0, 300.0)
INTERVAL_S = 15.0
QUEUE_PER_REPLICA = 2.0  # isocost's guard
HPA_QUEUE_TARGET = 0.5  # HPA's default target per replica (lower scales earlier)
HPA_TARGETS = (0.1, 0.25, 0.5, 1.0, 2.0)
SCALE_UP_COOLDOWN_S = 60.0
BURSTS_PER_DAY = 6
BURST_S = 240.0
BURST_GAIN = 0.4  # a burst adds 40% to the current rate ...
BURST_RISE_S = 30.0  # ... within 30 s
RAMP_LOOKAHEAD_S = 300.0
RAMP_RISE = 0.05  # of the peak rate
ATTAINMENT_TARGET = 0.98  # isocost's guard and capacity learning, over 45 s
SCALE_IN_AFTER_S = 180.0  # the compressed day's 3 hours
SCALE_DOWN_COOLDOWN_S = 60.0
SCALE_STEP = 0.3  # each scale event moves at least 30% of the fleet
MAX_PROMPT_TOKENS = 32_768  # longer ones miss the TTFT target even on an idle replica
PROBE_S = 400.0
SUSTAINED_SHARE = 0.98


@dataclass(frozen=True, slots=True)
class Traffic:
    """The day's noiseless rate: diurnal curve plus bursts (start times)."""

    day_s: float
    trough_rps: float
    peak_rps: float
    bursts_s: tuple[float, ...]

    def rate(self, t: float) -> float:
        phase = (t % self.day_s) / self.day_s
        daylight = (0.5 - 0.5 * math.cos(2 * math.pi * phase)) ** 2  # long night, day peak
        diurnal = self.trough_rps + (self.peak_rps - self.trough_rps) * daylight
        burst = sum(
            BURST_GAIN * min(1.0, (t - b) / BURST_RISE_S)
            for b in self.bursts_s
            if b <= t < b + BURST_S
        )
        return diurnal * (1 + burst)

    def ramp_up(self, t: float) -> bool:
        minute = math.floor(t / 60) * 60
        rise = self.rate(minute + RAMP_LOOKAHEAD_S) - self.rate(minute)
        return rise >= RAMP_RISE * self.peak_rps


def sustained_rps(
    replicas: list[SimReplica], lengths: list[tuple[int, int]], planned_rps: float, seed: int
) -> float:
    """What one replica really sustains at the SLOs: the highest load (in steps of 10% of
    the planner's figure) at which ``MIN_REPLICAS`` replicas meet ``SUSTAINED_SHARE`` of
    ``PROBE_S`` seconds of Poisson traffic."""
    used = replicas[:MIN_REPLICAS]
    cluster = ClusterConfig(replicas=[ReplicaGroup(gpu=GPU, model=MODEL, tp=TP, count=len(used))])
    best = 0.0
    for tenths in range(3, 11):
        per_replica = planned_rps * tenths / 10
        rng = Random(seed + tenths)
        times: list[float] = []
        t = rng.expovariate(per_replica * len(used))
        while t < PROBE_S:
            times.append(t)
            t += rng.expovariate(per_replica * len(used))
        work = requests(times, lengths, rng)
        policy = build_policy("equal_cost", rng=Random(seed))
        records = Simulator(cluster, used, policy, work, model=MODEL).run().records
        if sum(met_slo(r, SLO) for r in records) < SUSTAINED_SHARE * len(records):
            break
        best = per_replica
    if best == 0.0:
        raise SystemExit("no probed load meets the SLOs: relax them")
    return best


def clairvoyant_gpu_hours(shape: Traffic, capacity_rps: float) -> float:
    """A reference, not a way: the fleet that knows the noiseless rate and has no cold
    start, with the same headroom and bounds, each second."""
    replica_s = sum(
        min(
            max(math.ceil(shape.rate(t) * (1 + HEADROOM) / capacity_rps), MIN_REPLICAS),
            MAX_REPLICAS,
        )
        for t in range(int(shape.day_s))
    )
    return replica_s * TP / 3600


def traffic(day_s: float, capacity_rps: float, rng: Random) -> Traffic:
    trough = MIN_REPLICAS * capacity_rps / (1 + HEADROOM)
    peak = MAX_REPLICAS * capacity_rps / (1 + HEADROOM)
    bursts = tuple(sorted(rng.uniform(0.1, 0.9) * day_s for _ in range(BURSTS_PER_DAY)))
    return Traffic(day_s, trough, peak, bursts)


def arrivals(shape: Traffic, rng: Random) -> list[float]:
    """Poisson arrivals at ``shape.rate`` by thinning."""
    bound = shape.peak_rps * (1 + BURST_GAIN * BURSTS_PER_DAY)
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(bound)
        if t >= shape.day_s:
            return out
        if rng.random() * bound < shape.rate(t):
            out.append(t)


def requests(
    times: list[float], lengths: list[tuple[int, int]], rng: Random
) -> list[WorkloadRequest]:
    out = []
    for i, at_s in enumerate(times):
        prompt, output = lengths[rng.randrange(len(lengths))]
        blocks = range(i * 1000, i * 1000 + math.ceil(prompt / 512))
        out.append(WorkloadRequest(i, at_s, prompt, output, segments_for_blocks(blocks, prompt)))
    return out


@dataclass(slots=True)
class NoiselessForecast:
    """A perfect forecast for ``isocost_oracle``: the day's noiseless rate."""

    shape: Traffic
    now: float = 0.0

    def observe(self, now: float, rate_rps: float) -> None:
        self.now = now

    def peak(self, now: float, horizon_s: float) -> float:
        seconds = max(1, math.ceil(horizon_s))
        return max(self.shape.rate(now + horizon_s * i / seconds) for i in range(seconds + 1))

    def slope(self) -> float:
        rise = self.shape.rate(self.now) - self.shape.rate(self.now - INTERVAL_S)
        return rise / INTERVAL_S


def hpa_way(target: float) -> str:
    return f"hpa@{target:g}"


@dataclass(frozen=True, slots=True)
class WayResult:
    policy: str
    queue_target: float | None  # HPA's
    gpu_hours: float
    cold_gpu_hours: float  # of gpu_hours: replicas started, not yet serving
    usd: float
    slo_attainment: float
    ramp_misses: int
    ramp_requests: int
    scale_events: int
    killed: int
    replicas_min: int
    replicas_max: int

    def as_dict(self) -> dict[str, object]:
        row: dict[str, object] = {"policy": self.policy}
        if self.queue_target is not None:
            row["queue_target"] = self.queue_target
        return row | {
            "gpu_hours": round(self.gpu_hours, 3),
            "cold_start_gpu_hours": round(self.cold_gpu_hours, 3),
            "usd": round(self.usd, 2),
            "slo_attainment": round(self.slo_attainment, 5),
            "ramp_misses": self.ramp_misses,
            "ramp_requests": self.ramp_requests,
            "scale_events": self.scale_events,
            "killed_by_scale_in": self.killed,
            "replicas_min": self.replicas_min,
            "replicas_max": self.replicas_max,
        }


@dataclass(frozen=True, slots=True)
class Day:
    """Everything the four ways share."""

    replicas: list[SimReplica]
    work: list[WorkloadRequest]
    shape: Traffic
    planned_rps: float  # the planner's capacity per replica: isocost's prior
    sustained_rps: float  # measured: sizes the traffic and static_mean
    history: list[tuple[float, float]]
    seed: int
    isocost: AutoscaleConfig


def run_way(way: str, day: Day) -> WayResult:
    """``way`` is one of ``WAYS`` but ``hpa``, or ``hpa@<target>``."""
    shape = day.shape
    hpa_target = float(way.removeprefix("hpa@")) if way.startswith("hpa@") else None
    mean_rps = sum(shape.rate(t) for t in range(int(shape.day_s))) / shape.day_s
    fleet = {"static_mean": math.ceil(mean_rps / day.sustained_rps)}.get(way, MAX_REPLICAS)
    used = day.replicas[:fleet]
    cluster = ClusterConfig(replicas=[ReplicaGroup(gpu=GPU, model=MODEL, tp=TP, count=fleet)])
    controller: SimAutoscaler | None = None
    if hpa_target is not None or way.startswith("isocost"):
        scaler: Scaler = (
            HpaScaler(GPU, MIN_REPLICAS, MAX_REPLICAS, hpa_target)
            if hpa_target is not None
            else _isocost(day, oracle=way == "isocost_oracle")
        )
        draws = Random(day.seed + 1)
        controller = SimAutoscaler(
            scaler,
            {GPU: used},
            {GPU: MIN_REPLICAS},
            SLO,
            interval_s=INTERVAL_S,
            drain_deadline_s=600.0,
            cold_start=lambda _: draws.uniform(*COLD_START_S),
        )
    simulator = Simulator(
        cluster,
        used,
        build_policy("equal_cost", rng=Random(day.seed)),
        day.work,
        model=MODEL,
        controller=controller,
        dormant=controller.dormant if controller else (),
    )
    records = simulator.run().records
    met = [met_slo(r, SLO) for r in records]
    ramp = [m for r, m in zip(records, met, strict=True) if shape.ramp_up(r.request.arrival_s)]
    if controller is None:
        gpu_hours = fleet * TP * shape.day_s / 3600
        usd = fleet * replica_usd_per_hour(used[0]) * shape.day_s / 3600
        cold, events, killed, low, high = 0.0, 0, 0, fleet, fleet
    else:
        usage = controller.usage(shape.day_s)
        gpu_hours, usd, cold = usage.gpu_hours, usage.usd, usage.cold_gpu_hours
        events, killed = usage.scale_events, usage.killed
        active = [s.ready + s.pending for s in controller.timeline]
        low, high = min(active), max(active)
    return WayResult(
        way,
        hpa_target,
        gpu_hours,
        cold,
        usd,
        sum(met) / len(met),
        ramp.count(False),
        len(ramp),
        events,
        killed,
        low,
        high,
    )


def isocost_config(day_s: float, target: float, headroom: float, step: float) -> AutoscaleConfig:
    """isocost's settings, with the user's knobs checked as a config file's would be
    (ConfigError: one line)."""
    raw = {
        "pools": [
            {"gpu": GPU, "min": MIN_REPLICAS, "max": MAX_REPLICAS, "cold_start_s": COLD_START_S[1]}
        ],
        "interval_s": INTERVAL_S,
        "headroom": headroom,
        "max_gpus": MAX_REPLICAS * TP,
        "season_s": day_s,
        "queue_per_replica": QUEUE_PER_REPLICA,
        "attainment_target": target,
        "scale_up_cooldown_s": SCALE_UP_COOLDOWN_S,
        "scale_down_cooldown_s": SCALE_DOWN_COOLDOWN_S,
        "scale_in_after_s": SCALE_IN_AFTER_S,
        "scale_step": step,
    }
    return parse_autoscale_config(raw, "--isocost-target/--isocost-headroom/--isocost-step")


def _isocost(day: Day, *, oracle: bool) -> Autoscaler:
    price = replica_usd_per_hour(day.replicas[0])
    offers = [PoolOffer(GPU, TP, price, day.planned_rps)]
    if oracle:
        return Autoscaler(day.isocost, offers, forecast=NoiselessForecast(day.shape))
    return Autoscaler(day.isocost, offers, day.history)


def previous_day(day_s: float, capacity_rps: float, seed: int) -> list[tuple[float, float]]:
    """Yesterday's measured rate per interval (its own bursts, Poisson noise)."""
    rng = Random(seed + 7)
    shape = traffic(day_s, capacity_rps, rng)
    counts = [0] * math.ceil(day_s / INTERVAL_S)
    for t in arrivals(shape, rng):
        counts[int(t // INTERVAL_S)] += 1
    return [((i + 1) * INTERVAL_S - day_s, c / INTERVAL_S) for i, c in enumerate(counts)]


_DAY: Day | None = None  # set before the workers fork


def _run_forked(way: str) -> WayResult:
    assert _DAY is not None
    return run_way(way, _DAY)


def hpa_targets(text: str) -> tuple[float, ...]:
    """``--hpa-targets``: positive queue lengths per replica, comma-separated."""
    try:
        targets = tuple(sorted({float(t) for t in text.split(",") if t.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not targets or min(targets) <= 0:
        raise argparse.ArgumentTypeError("targets must be > 0, at least one")
    return targets


def matching_hpa(isocost: WayResult, sweep: list[WayResult]) -> WayResult | None:
    """The cheapest HPA setting whose attainment is at least isocost's (None: none)."""
    reaching = [r for r in sweep if r.slo_attainment >= isocost.slo_attainment]
    return min(reaching, key=lambda r: (r.gpu_hours, r.policy)) if reaching else None


def frontier(sweep: list[WayResult]) -> set[str]:
    """The targets no other target beats on both GPU-hours and attainment."""
    return {
        r.policy
        for r in sweep
        if not any(
            o.gpu_hours <= r.gpu_hours
            and o.slo_attainment >= r.slo_attainment
            and (o.gpu_hours, o.slo_attainment) != (r.gpu_hours, r.slo_attainment)
            for o in sweep
        )
    }


def verdicts(
    isocost: WayResult, peak: WayResult | None, hpa: WayResult | None, matched: bool
) -> list[str]:
    """The aims, each with its figures and met / missed; ``hpa`` is the matching HPA
    setting, or (not ``matched``) the best one."""

    def aim(text: str, met: bool) -> str:
        return f"  {text}: {'met' if met else 'MISSED'}"

    lines = []
    if peak is not None:
        gap = (peak.slo_attainment - isocost.slo_attainment) * 100
        share = isocost.gpu_hours / peak.gpu_hours
        lines += [
            "against static_peak:",
            aim(f"attainment {gap:.2f} points below (aim <= 1)", gap <= 1),
            aim(f"GPU-hours {share:.1%} of its (aim <= 65%)", share <= 0.65),
        ]
    if hpa is not None:
        cost = isocost.gpu_hours / hpa.gpu_hours
        which = "cheapest HPA at >= isocost's" if matched else "the best HPA"
        lines += [
            f"against {hpa.policy} ({which} attainment: "
            f"{hpa.slo_attainment:.1%} vs {isocost.slo_attainment:.1%}):",
            aim(f"GPU-hours {cost:.2f}x its (aim <= 0.9x)", cost <= 0.9),
            aim(
                f"ramp misses {isocost.ramp_misses:,} vs {hpa.ramp_misses:,} (aim <= 1/3)",
                3 * isocost.ramp_misses <= hpa.ramp_misses,
            ),
            aim(
                f"scale events {isocost.scale_events} vs {hpa.scale_events} (aim fewer)",
                isocost.scale_events < hpa.scale_events,
            ),
        ]
    return lines


def main() -> None:
    global _DAY
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--day-s", type=float, default=3600.0, help="simulated length of the day")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument(
        "--hpa-targets",
        type=hpa_targets,
        default=HPA_TARGETS,
        help="HPA's queue targets per replica to sweep (the default one always runs)",
    )
    parser.add_argument(
        "--isocost-target",
        type=float,
        default=ATTAINMENT_TARGET,
        help="isocost's attainment target (its guard, and what capacity is learnt at)",
    )
    parser.add_argument(
        "--isocost-headroom", type=float, default=HEADROOM, help="isocost's headroom"
    )
    parser.add_argument(
        "--isocost-step",
        type=float,
        default=SCALE_STEP,
        help="isocost's scale_step: the least share of the fleet one scale event moves",
    )
    parser.add_argument("--jobs", type=int, default=2, help="ways run in parallel")
    parser.add_argument("--trace", default=str(TRACE / "mooncake_conversation_trace.jsonl"))
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    try:
        isocost = isocost_config(
            args.day_s, args.isocost_target, args.isocost_headroom, args.isocost_step
        )
    except ConfigError as error:
        parser.error(str(error))
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    unknown = sorted(set(ways) - set(WAYS))
    if unknown:
        parser.error(f"unknown way {', '.join(unknown)}; valid: {', '.join(WAYS)}")
    sweep = sorted({*args.hpa_targets, HPA_QUEUE_TARGET}) if "hpa" in ways else []
    runs = [w for w in ways if w != "hpa"] + [hpa_way(t) for t in sweep]
    group = ReplicaGroup(gpu=GPU, model=MODEL, tp=TP, count=MAX_REPLICAS)
    replicas = resolve_cluster(ClusterConfig(replicas=[group]), Catalog.builtin())
    lengths = [
        (r.prompt_tokens, r.output_tokens)
        for r in load_trace(args.trace)
        if r.prompt_tokens <= MAX_PROMPT_TOKENS
    ]
    mean_prompt = round(sum(p for p, _ in lengths) / len(lengths))
    mean_output = round(sum(o for _, o in lengths) / len(lengths))
    planned = planned_capacity_rps(replicas[0].cost_model, mean_prompt, mean_output, SLO)
    sustained = sustained_rps(replicas, lengths, planned, args.seed)
    rng = Random(args.seed)
    shape = traffic(args.day_s, sustained, rng)
    work = requests(arrivals(shape, rng), lengths, rng)
    history = previous_day(args.day_s, sustained, args.seed)
    _DAY = Day(
        replicas,
        work,
        shape,
        planned,
        sustained,
        history,
        args.seed,
        isocost,
    )
    console = Console(width=80)
    console.print(
        f"{len(work):,} requests over {args.day_s:,.0f} s ({shape.trough_rps:.2f}-"
        f"{shape.peak_rps:.2f} req/s + {BURSTS_PER_DAY} bursts); per replica: planner "
        f"{planned:.3f} req/s, measured {sustained:.3f} req/s at {SUSTAINED_SHARE:.0%}; "
        f"a clairvoyant fleet without cold starts: "
        f"{clairvoyant_gpu_hours(shape, sustained):,.0f} GPU-h"
    )
    jobs = max(1, min(args.jobs, len(runs)))
    done: dict[str, WayResult] = {}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"the day, {len(runs)} ways", total=len(runs))
        if jobs == 1:
            for way in runs:
                done[way] = _run_forked(way)
                progress.advance(task)
        else:
            fork = multiprocessing.get_context("fork")
            with fork.Pool(jobs, initializer=dies_with(os.getpid())) as pool:
                for way, result in zip(runs, pool.imap(_run_forked, runs), strict=True):
                    done[way] = result
                    progress.advance(task)
    default = hpa_way(HPA_QUEUE_TARGET)
    results = [replace(done[default], policy="hpa") if w == "hpa" else done[w] for w in ways] + [
        done[hpa_way(t)] for t in sweep
    ]
    by_policy = {r.policy: r for r in results}
    swept = [done[hpa_way(t)] for t in sweep]
    on_frontier = frontier(swept)
    matched = matching_hpa(by_policy["isocost"], swept) if "isocost" in by_policy else None
    table = Table(title="one simulated day, way by way (HPA at each target)")
    for column in ("way", "GPU-h", "cold", "$", "SLO", "ramp miss", "events", "replicas"):
        table.add_column(column, justify="left" if column == "way" else "right")
    for r in results:
        mark = " *" if r.policy in on_frontier else ""
        table.add_row(
            r.policy + mark,
            f"{r.gpu_hours:,.0f}",
            f"{r.cold_gpu_hours:,.0f}",
            f"{r.usd:,.0f}",
            f"{r.slo_attainment:.1%}",
            f"{r.ramp_misses:,}",
            f"{r.scale_events}",
            f"{r.replicas_min}-{r.replicas_max}",
            end_section=r.policy == ways[-1] and bool(swept),
        )
    console.print(table)
    if swept:
        console.print(f"hpa = {default}; * HPA's frontier (no target both cheaper and better)")
    if "isocost" in by_policy:
        isocost = by_policy["isocost"]
        reference = matched
        if swept and matched is None:
            reference = max(swept, key=lambda r: (r.slo_attainment, -r.gpu_hours))
            console.print(
                f"no HPA target reaches isocost's {isocost.slo_attainment:.1%} attainment "
                f"(the best, {reference.policy}: {reference.slo_attainment:.1%} at "
                f"{reference.gpu_hours:,.0f} GPU-h)"
            )
        peak = by_policy.get("static_peak")
        for line in verdicts(isocost, peak, reference, matched is not None):
            console.print(line)
    if args.json_path:
        rows = [r.as_dict() for r in results]
        if "isocost" in by_policy and swept:
            rows[ways.index("isocost")]["matched_hpa"] = matched.policy if matched else None
        Path(args.json_path).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    run_script(main)
