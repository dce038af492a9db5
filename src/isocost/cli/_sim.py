"""``isocost sim``: policies side by side on a simulated cluster."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from isocost.cli._app import app, console, fail
from isocost.cli._options import (
    CatalogOption,
    GroupsOption,
    MaxPromptTokensOption,
    OutputTokensOption,
    PromptsPerGroupOption,
    QuestionTokensOption,
    SessionsOption,
    SloTpotOption,
    SloTtftOption,
    SloTtftPer1kOption,
    SpeedupOption,
    SystemTokensOption,
    TraceFormatOption,
    TraceOption,
    TurnsOption,
    WorkloadOption,
    checked,
    one_of,
    policy_names,
    synthetic_workload,
)
from isocost.cli._outputs import check_outputs
from isocost.core.bounds import AT_LEAST_ONE, FRACTION, NON_NEGATIVE, POSITIVE
from isocost.core.slo import (
    DEFAULT_SLO_SHARE,
    DEFAULT_SLO_TPOT_MS,
    DEFAULT_SLO_TTFT_MS,
    DEFAULT_SLO_TTFT_PER_1K_MS,
    SloTargets,
)

if TYPE_CHECKING:
    from isocost.sim import CapacitySpec


@app.command()
def sim(
    trace: TraceOption = None,
    trace_format: TraceFormatOption = None,
    workload: WorkloadOption = None,
    config: str | None = typer.Option(
        None, "--config", "-c", help="isocost serve's YAML: one pool, its scheduling and queue."
    ),
    pool: str | None = typer.Option(
        None, "--pool", help="With --config: the pool (model) requests ask for (default: the only)."
    ),
    cluster: str | None = typer.Option(None, "--cluster", help="Cluster YAML (mixed fleets)."),
    from_record: str | None = typer.Option(
        None,
        "--from-record",
        help="A recording (isocost serve --record): its traffic on its calibrated fleet.",
    ),
    fail_at: list[str] | None = typer.Option(
        None, "--fail", help="With --from-record: NAME@SECONDS, a replica failing then."
    ),
    fit_prefill: bool = typer.Option(
        False,
        "--fit-prefill",
        help="With --from-record: fit each replica's prefill overhead to its light TTFTs.",
    ),
    replicas: int = typer.Option(16, "--replicas", help="Identical replicas (no --cluster)."),
    gpu: str = typer.Option("a100-80g", "--gpu", "-g", help="GPU catalog id."),
    model: str = typer.Option("llama-3.1-8b", "--model", "-m", help="Model id or HF folder."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel GPUs per replica."),
    policies: str | None = typer.Option(
        None,
        "--policies",
        help="Comma-separated policies (default: equal_cost,round_robin,least_request; "
        "with --config: the pool's).",
    ),
    slo_ttft_ms: SloTtftOption = DEFAULT_SLO_TTFT_MS,
    slo_ttft_per_1k_ms: SloTtftPer1kOption = DEFAULT_SLO_TTFT_PER_1K_MS,
    slo_tpot_ms: SloTpotOption = DEFAULT_SLO_TPOT_MS,
    deadlines: bool | None = typer.Option(
        None,
        "--deadlines/--no-deadlines",
        help="Requests carry their TTFT and TPOT targets (SLO admission sees them); "
        "default: yes, with --from-record: as recorded.",
    ),
    audit_admission: bool = typer.Option(
        False,
        "--audit-admission",
        help="Replay each SLO-admission rejection as admitted: precision, recall.",
    ),
    rate: float | None = typer.Option(
        None,
        "--rate",
        callback=checked(POSITIVE),
        help="Mean req/s: scales a trace's time; Poisson for --workload.",
    ),
    speedup: SpeedupOption = 1.0,
    sweep_rate: str | None = typer.Option(
        None, "--sweep-rate", help="r1,r2,...: replay at each mean rate; capacity at SLO."
    ),
    capacity: str | None = typer.Option(
        None, "--capacity", help="LO:HI req/s: each policy's capacity at SLO by bisection."
    ),
    precision: float = typer.Option(
        0.05, "--precision", help="With --capacity: relative width of the bracket found."
    ),
    target: float = typer.Option(
        DEFAULT_SLO_SHARE,
        "--target",
        callback=checked(FRACTION),
        help="Share meeting SLOs for capacity.",
    ),
    max_requests: int | None = typer.Option(
        None, "--max-requests", callback=checked(AT_LEAST_ONE), help="First N requests."
    ),
    duration: float | None = typer.Option(
        None, "--duration", callback=checked(POSITIVE), help="Arrivals before s."
    ),
    network_delay_ms: float | None = typer.Option(
        None, "--network-delay-ms", callback=checked(NON_NEGATIVE), help="Each way."
    ),
    scrape_interval_ms: float | None = typer.Option(
        None,
        "--scrape-interval-ms",
        callback=checked(NON_NEGATIVE),
        help="Engine metrics scrape period (0: never).",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of policies and synthetic workloads."),
    jobs: int = typer.Option(
        2, "--jobs", "-j", callback=checked(AT_LEAST_ONE), help="Parallel processes."
    ),
    json_out: str | None = typer.Option(None, "--json", help="Write results JSON."),
    plot: str | None = typer.Option(None, "--plot", help="Write a PNG of CDFs, load, goodput."),
    catalog: CatalogOption = None,
    groups: GroupsOption = 8,
    prompts_per_group: PromptsPerGroupOption = 16,
    sessions: SessionsOption = 16,
    turns: TurnsOption = 4,
    system_tokens: SystemTokensOption = 2048,
    question_tokens: QuestionTokensOption = 128,
    output_tokens: OutputTokensOption = 128,
    max_prompt_tokens: MaxPromptTokensOption = None,
    autoscale: str | None = typer.Option(
        None, "--autoscale", help="Autoscale YAML: control/ starts and drains replicas."
    ),
) -> None:
    """Replay a trace through policies on a simulated cluster.

    The scheduling policies run side by side on the same requests.
    """
    from isocost import sim as simulator
    from isocost.files import load_catalog, read_text
    from isocost.runtime.config import check_references, parse_config
    from isocost.scheduling.policies import SchedulingConfig
    from isocost.workload import mean_rate_rps

    trace_format = one_of("trace format", trace_format, simulator.TRACE_FORMATS)
    if config is not None and cluster is not None:
        fail("give --config (a gateway's file) or --cluster, not both")
    if pool is not None and config is None and from_record is None:
        fail("--pool chooses a pool of --config's file or --from-record's recording")
    if from_record is not None and (config is not None or trace or workload):
        fail("--from-record replays its own traffic: not with --config, --trace or --workload")
    if fail_at and (from_record is None or cluster is not None):
        fail("--fail names a recorded replica: with --from-record and without --cluster")
    if fit_prefill and (from_record is None or cluster is not None):
        fail("--fit-prefill calibrates the recorded fleet: with --from-record, no --cluster")
    failures = [_failure(text) for text in fail_at or []]
    cat = load_catalog(catalog or [])
    scheduling, default_policies = SchedulingConfig(), "equal_cost,round_robin,least_request"
    recording = None
    if from_record is not None:
        recording = simulator.load_recording(from_record, pool)
        cat = simulator.recorded_catalog(recording, cat, from_record)
        default_policies = recording.pool.policy
        if deadlines is None:  # as the live clients sent them
            deadlines = recording.has_deadlines
    deadlines = True if deadlines is None else deadlines
    if config is not None:  # read exactly as `isocost serve` reads it, secrets aside
        gateway = parse_config(read_text(config), config, secrets=False)
        check_references(gateway, cat)
        chosen = simulator.gateway_pool(gateway, pool, config)
        scheduling, default_policies = gateway.scheduling, chosen.policy or gateway.policy
    names = policy_names(policies or default_policies)
    simulator.check_policies(names, scheduling)
    try:
        rates = tuple(float(r) for r in sweep_rate.split(",")) if sweep_rate else ()
    except ValueError as exc:
        fail(f"--sweep-rate {sweep_rate}: {exc}")
    for rate_rps in rates:
        if (problem := POSITIVE.problem(rate_rps)) is not None:
            fail(f"--sweep-rate {sweep_rate}: each rate {problem}")
    slo = SloTargets.from_ms(slo_ttft_ms, slo_tpot_ms, slo_ttft_per_1k_ms, share=target)
    search = _capacity_spec(capacity, precision, target) if capacity is not None else None
    if search is not None and rates:
        fail("give --capacity or --sweep-rate, not both: --capacity chooses its own rates")
    if search is not None and plot is not None:
        fail("--plot draws runs and sweeps; --capacity has no plot (its --json has each probe)")
    if autoscale is not None and (rates or search is not None):
        fail("--autoscale replays the requests at their own rate: not with a sweep or --capacity")
    if audit_admission and not deadlines:
        fail("--audit-admission audits SLO admission, which --no-deadlines turns off")
    check_outputs(files={"--json": json_out}, plots={"--plot": plot})
    overrides = {
        k: v
        for k, v in (
            ("network_delay_ms", network_delay_ms),
            ("scrape_interval_ms", scrape_interval_ms),
        )
        if v is not None
    }
    if config is not None:
        fleet, members = simulator.gateway_cluster(gateway, chosen, cat, config, **overrides)
    elif recording is not None and cluster is None:
        assert from_record is not None
        fleet, members = simulator.recorded_cluster(
            recording, cat, from_record, failures, fit_prefill=fit_prefill, settings=overrides
        )
    else:
        if cluster is not None:
            fleet = simulator.parse_cluster_yaml(read_text(cluster), cluster)
            fleet = simulator.with_settings(fleet, cluster, **overrides)
        else:
            fleet = simulator.uniform_cluster(replicas, gpu, model, tp, **overrides)
        members = simulator.resolve_cluster(fleet, cat)
    synthetic = synthetic_workload(workload, max_prompt_tokens, groups, prompts_per_group,
                                   sessions, turns, system_tokens, question_tokens,
                                   output_tokens)  # fmt: skip
    choice = simulator.WorkloadChoice(
        trace=trace,
        trace_format=trace_format,
        synthetic=synthetic,
        rate_rps=rate,
        speedup=speedup,
        max_requests=max_requests,
        duration_s=duration,
        seed=seed,
        recorded=recording.requests if recording is not None else None,
    )
    requests = simulator.load_requests(choice)
    if rates or search is not None:
        try:
            mean_rate_rps(requests)
        except ValueError as exc:
            fail(f"--sweep-rate and --capacity replay the requests at other rates, but {exc}")
    scaling = None
    if autoscale is not None:
        scaling_config = simulator.parse_autoscale_yaml(read_text(autoscale), autoscale)
        fleet, members, scaling = simulator.autoscaled_cluster(
            scaling_config, fleet, cat, requests, slo, autoscale
        )
    plan = simulator.SimPlan(
        cluster=fleet,
        replicas=tuple(members),
        requests=requests,
        policies=names,
        slo=slo,
        scheduling=scheduling,
        seed=seed,
        deadlines=deadlines,
        rates_rps=rates,
        capacity=search,
        sample_points=200 if plot else 0,
        jobs=jobs,
        audit_admission=audit_admission,
        autoscale=scaling,
    )
    simulator.sim_command(console, plan, json_out, plot)


def _capacity_spec(text: str, precision: float, target: float) -> CapacitySpec:
    """``--capacity LO:HI`` with ``--precision`` and ``--target``; a one-line error if bad."""
    from isocost.sim import CapacitySpec

    low, sep, high = text.partition(":")
    try:
        rates = (float(low), float(high)) if sep else None
    except ValueError:
        rates = None
    if rates is None:
        fail(f"--capacity {text}: give LO:HI in req/s, e.g. 0.5:20")
    try:
        return CapacitySpec(*rates, precision, target)
    except ValueError as exc:
        fail(f"--capacity {text} --precision {precision:g}: {exc}")


def _failure(text: str) -> tuple[str, float]:
    """``--fail NAME@SECONDS`` as ``(name, at_s)``; a one-line error if malformed."""
    name, sep, at = text.rpartition("@")
    try:
        at_s = float(at)
    except ValueError:
        at_s = -1.0
    if not (sep and name and at_s >= 0):
        fail(f"--fail {text}: give NAME@SECONDS, e.g. gpu-3@120")
    return name, at_s
