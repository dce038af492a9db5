"""Running policies side by side: the same requests, one simulator per (policy, rate).

Runs are independent, so they go to worker processes (``jobs``; forked, so the request
list and isolated times are shared, not sent) and report simulated time back for the
progress bar. A capacity search (``SimPlan.capacity``, ``sim._capacity``) runs in rounds:
each round's probes, one or two per policy still searching, go to the workers together.
Each run builds a fresh policy with ``random.Random(seed)``, so a run's result depends
only on its inputs: the same seed gives the same JSON.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from random import Random

import numpy as np
import numpy.typing as npt

from isocost.core.slo import SloTargets
from isocost.runtime.processes import dies_with
from isocost.scheduling.policies import SchedulingConfig, build_policy
from isocost.sim._audit import AdmissionAudit, AdmissionAuditor
from isocost.sim._autoscale import FleetUsage, SimAutoscale
from isocost.sim._capacity import CapacityResult, CapacitySpec, search_capacity
from isocost.sim._cluster import ClusterConfig, SimReplica, lowest_slowdowns, served_model
from isocost.sim._core import SimResult, Simulator
from isocost.sim._limits import check_run_length
from isocost.sim._metrics import (
    DisaggSummary,
    Isolated,
    PolicySummary,
    capacity_at_slo,
    isolated_times,
    oracle_summary,
    summarize_disagg,
    summarize_sim,
)
from isocost.sim._workload import at_rate
from isocost.workload import WorkloadRequest

__all__ = [
    "CapacityOutput",
    "RunOutput",
    "SimPlan",
    "SweepOutput",
    "check_policies",
    "run_capacity",
    "run_plan",
]

FloatArray = npt.NDArray[np.float64]
Progress = Callable[[int, float], None]  # (task index, simulated seconds)
Task = tuple[str, float | None]  # (policy, rate; None: the requests' own)


@dataclass(frozen=True, slots=True)
class SimPlan:
    """Everything a set of runs needs."""

    cluster: ClusterConfig  # its settings and events; its replicas are resolved below
    replicas: tuple[SimReplica, ...]
    requests: list[WorkloadRequest]
    policies: tuple[str, ...]
    slo: SloTargets  # its share is the target for capacity at SLO
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)  # added policies
    seed: int = 0
    deadlines: bool = True  # requests carry their TTFT target (SLO admission can use it)
    rates_rps: tuple[float, ...] = ()  # a sweep: replay the requests at each mean rate
    capacity: CapacitySpec | None = None  # instead, search each policy's capacity at SLO
    sample_points: int = 0  # load samples per run, for plots (0: none)
    jobs: int = 2
    audit_admission: bool = False  # replay each SLO-admission rejection as admitted
    autoscale: SimAutoscale | None = None  # replicas started and drained by control/

    def __post_init__(self) -> None:
        """Refuse, before any run starts, runs that would not end (``sim._limits``)."""
        low = min(self.rates_rps, default=None)
        if self.capacity is not None:
            low = self.capacity.low_rps
        control_s = None if self.autoscale is None else self.autoscale.config.interval_s
        check_run_length(self.requests, low, self.cluster.scrape_interval_ms, control_s)


@dataclass(frozen=True, slots=True)
class RunOutput:
    """One (policy, rate) run: its summary and what plots and the table need."""

    summary: PolicySummary
    rate_rps: float | None
    ttft_s: FloatArray  # per request, nan where not completed
    replica_ids: list[str]
    sample_s: list[float]
    load_samples: list[list[int]]
    wall_s: float
    num_events: int
    end_s: float
    audit: AdmissionAudit | None = None  # with ``audit_admission``
    fleet: FleetUsage | None = None  # with ``autoscale``
    disagg: DisaggSummary | None = None  # a fleet with prefill/decode disaggregation

    @property
    def sim_s_per_wall_s(self) -> float:
        return self.end_s / self.wall_s if self.wall_s > 0 else math.inf


@dataclass(frozen=True, slots=True)
class SweepOutput:
    runs: list[RunOutput]  # policies x rates, policy-major
    oracle: PolicySummary  # at the base rate
    capacity_rps: dict[str, float | None]  # per policy (sweeps only)


@dataclass(frozen=True, slots=True)
class CapacityOutput:
    results: dict[str, CapacityResult]  # per policy, in the plan's order
    probes: dict[str, list[RunOutput]]  # per policy, each probe's run in the order probed


def check_policies(names: Sequence[str], scheduling: SchedulingConfig | None = None) -> None:
    """Raise UnknownConfigEntryError, listing the valid names, for an unknown policy
    (the built-ins and those ``scheduling`` defines)."""
    for name in names:
        build_policy(name, config=scheduling, source="--policies")


def run_plan(plan: SimPlan, progress: Progress | None = None) -> SweepOutput:
    """Every policy at every rate (or once at the requests' own rate)."""
    isolated = _isolated(plan)
    rates: tuple[float | None, ...] = plan.rates_rps or (None,)
    runs = _run_tasks(
        plan, isolated, [(p, rate) for p in plan.policies for rate in rates], progress
    )
    capacity: dict[str, float | None] = {}
    if plan.rates_rps:
        for policy in plan.policies:
            points = [
                (r.rate_rps or 0.0, r.summary.slo_attainment)
                for r in runs
                if r.summary.policy == policy
            ]
            capacity[policy] = capacity_at_slo(points, plan.slo.share)
    return SweepOutput(runs, oracle_summary(plan.requests, plan.slo, isolated), capacity)


def run_capacity(
    plan: SimPlan, progress: Callable[[Sequence[tuple[str, float]]], Progress | None]
) -> CapacityOutput:
    """Each policy's capacity at SLO by bisection (``plan.capacity``); ``progress(round)``
    gives the callback for one round's probes (task indices count within the round)."""
    assert plan.capacity is not None
    isolated = _isolated(plan)
    probes: dict[str, list[RunOutput]] = {policy: [] for policy in plan.policies}

    def measure(round_: Sequence[tuple[str, float]]) -> list[float]:
        runs = _run_tasks(plan, isolated, list(round_), progress(round_))
        for (policy, _), run in zip(round_, runs, strict=True):
            probes[policy].append(run)
        return [run.summary.slo_attainment for run in runs]

    results = search_capacity(plan.policies, plan.capacity, measure)
    return CapacityOutput(results, probes)


def _isolated(plan: SimPlan) -> Isolated:
    return isolated_times(
        plan.requests,
        [r.cost_model for r in plan.replicas],
        plan.cluster.network_delay_ms / 1000,
        lowest_slowdowns(plan.cluster, plan.replicas),
    )


def _run_tasks(
    plan: SimPlan, isolated: Isolated, tasks: list[Task], progress: Progress | None
) -> list[RunOutput]:
    """``tasks`` run in order, or in worker processes forked with ``plan`` and ``isolated``."""
    global _SHARED, _PROGRESS
    _SHARED = (plan, isolated)
    jobs = max(1, min(plan.jobs, len(tasks), os.cpu_count() or 1))
    try:
        if jobs == 1:
            return [_run_task(i, policy, rate, progress) for i, (policy, rate) in enumerate(tasks)]
        return _run_parallel(tasks, jobs, progress)
    finally:
        _SHARED = _PROGRESS = None


_SHARED: tuple[SimPlan, Isolated] | None = None  # set before workers fork
_PROGRESS: multiprocessing.queues.SimpleQueue[tuple[int, float]] | None = None


def _run_parallel(tasks: list[Task], jobs: int, progress: Progress | None) -> list[RunOutput]:
    global _PROGRESS
    context = multiprocessing.get_context("fork")
    _PROGRESS = queue = context.SimpleQueue()
    stop = (-1, 0.0)
    reader = None
    with ProcessPoolExecutor(
        jobs, mp_context=context, initializer=_start_worker, initargs=(os.getpid(),)
    ) as pool:
        try:
            futures = [
                pool.submit(_run_task, i, policy, rate, _report_to_queue)
                for i, (policy, rate) in enumerate(tasks)
            ]
            if progress is not None:

                def drain() -> None:
                    while (item := queue.get()) != stop:
                        progress(*item)

                reader = threading.Thread(target=drain, daemon=True)
                reader.start()
            runs = [f.result() for f in futures]
        except BaseException:  # Ctrl-C, or a task failed: what is left is not waited for
            pool.shutdown(wait=False, cancel_futures=True)
            for worker in multiprocessing.active_children():
                worker.kill()  # the reader may wait on a queue a killed worker held: left
            raise
    queue.put(stop)
    if reader is not None:
        reader.join()
    return runs


def _start_worker(parent: int) -> None:
    """A worker ends with ``parent`` (``dies_with``) and leaves Ctrl-C to it: a terminal
    sends SIGINT to the whole group, and a worker interrupted mid-task would hand the
    interrupt back as that task's result and go on to the next one."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if (hook := dies_with(parent)) is not None:
        hook()


def _report_to_queue(task: int, now: float) -> None:
    assert _PROGRESS is not None
    _PROGRESS.put((task, now))


def _run_task(
    task: int, policy_name: str, rate: float | None, progress: Progress | None
) -> RunOutput:
    assert _SHARED is not None
    plan, isolated = _SHARED
    requests = plan.requests if rate is None else at_rate(plan.requests, rate)
    span = max((r.arrival_s for r in requests), default=0.0)
    policy = build_policy(
        policy_name, config=plan.scheduling, rng=Random(plan.seed), source="--policies"
    )
    auditor = AdmissionAuditor(plan.slo) if plan.audit_admission else None
    controller = plan.autoscale.controller(plan.slo) if plan.autoscale else None
    simulator = Simulator(
        plan.cluster,
        plan.replicas,
        policy,
        requests,
        model=served_model(plan.cluster),
        slo=plan.slo if plan.deadlines else None,
        sample_interval_s=span / plan.sample_points if plan.sample_points and span > 0 else None,
        on_progress=None if progress is None else (lambda now: progress(task, now)),
        audit=auditor,
        controller=controller,
        dormant=controller.dormant if controller else (),
    )
    result = simulator.run()
    output = _output(result, requests, plan.slo, isolated, rate)
    if simulator.disaggregation is not None:
        output = dataclasses.replace(output, disagg=summarize_disagg(result.records))
    if controller is not None:
        output = dataclasses.replace(output, fleet=controller.usage(result.end_s))
    if auditor is None:
        return output
    return dataclasses.replace(output, audit=auditor.summary(result.records))


def _output(
    result: SimResult,
    requests: list[WorkloadRequest],
    slo: SloTargets,
    isolated: Isolated,
    rate: float | None,
) -> RunOutput:
    n = len(result.records)
    ttft = np.full(n, math.nan)
    e2e = np.full(n, math.nan)
    for i, record in enumerate(result.records):
        if record.finished_s is not None and record.first_token_s is not None:
            arrival = record.request.arrival_s
            ttft[i] = record.first_token_s - arrival
            e2e[i] = record.finished_s - arrival
    summary = summarize_sim(
        result.policy,
        requests,
        ttft,
        e2e,
        [r.rejected for r in result.records],
        slo,
        isolated,
        result.end_s,
        busy_s=result.busy_s,
        prefix=(result.prefix_queries, result.prefix_hits),
        preemptions=result.preemptions,
        held=(
            sum(r.held_s is not None for r in result.records),
            sum(r.held_s is not None and r.rejected is None for r in result.records),
        ),
    )
    return RunOutput(
        summary=summary,
        rate_rps=rate,
        ttft_s=ttft,
        replica_ids=result.replica_ids,
        sample_s=result.sample_s,
        load_samples=result.load_samples,
        wall_s=result.wall_s,
        num_events=result.num_events,
        end_s=result.end_s,
    )
