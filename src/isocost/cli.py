"""The ``isocost`` command: one Typer app, each subcommand a thin shell over a package.

Errors that isocost raises on purpose (unknown names, bad files, models that do not fit)
become one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import sys
from typing import Annotated, NoReturn, TypeVar

import typer
from rich.console import Console

from isocost import __version__
from isocost.core.errors import IsocostError
from isocost.workload import SYNTHETIC_WORKLOADS, SyntheticSpec

app = typer.Typer(
    name="isocost",
    help="Cost-aware load balancer, scheduler and capacity planner for LLM inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # Click's plain help: readable at 80 columns and in pipes
)
console = Console()
err_console = Console(stderr=True)


# Options that several subcommands share, declared once.
TraceOption = Annotated[str | None, typer.Option("--trace", help="Trace file to replay.")]
TraceFormatOption = Annotated[
    str | None,
    typer.Option("--trace-format", help="mooncake|azure|burstgpt|lengths (default: detected)."),
]
WorkloadOption = Annotated[
    str | None, typer.Option("--workload", help="mix|shared-prefix|multi-turn.")
]
SpeedupOption = Annotated[
    float, typer.Option("--speedup", help="Compress trace time by this factor.")
]
GroupsOption = Annotated[int, typer.Option("--groups", help="shared-prefix: groups.")]
PromptsPerGroupOption = Annotated[int, typer.Option("--prompts-per-group", help="shared-prefix.")]
SessionsOption = Annotated[int, typer.Option("--sessions", help="multi-turn: sessions.")]
TurnsOption = Annotated[int, typer.Option("--turns", help="multi-turn: turns per session.")]
SystemTokensOption = Annotated[int, typer.Option("--system-tokens", help="Shared system prompt.")]
QuestionTokensOption = Annotated[int, typer.Option("--question-tokens", help="Question/user turn.")]
MaxPromptTokensOption = Annotated[
    int | None, typer.Option("--max-prompt-tokens", help="mix: cap prompt lengths.")
]
CatalogOption = Annotated[list[str] | None, typer.Option("--catalog", help="Extra catalog YAML.")]


_Choice = TypeVar("_Choice", bound=str)


def _choice(flag: str, value: str | None, valid: tuple[_Choice, ...]) -> _Choice | None:
    """``value`` as one of ``valid`` (None stays None); one line and exit 2 otherwise."""
    if value is None:
        return None
    for option in valid:
        if value == option:
            return option
    fail(f"unknown {flag} {value!r}; valid: {', '.join(valid)}")


def _synthetic(
    workload: str | None,
    max_prompt_tokens: int | None,
    groups: int,
    prompts_per_group: int,
    sessions: int,
    turns: int,
    system_tokens: int,
    question_tokens: int,
    output_tokens: int,
    think_time_s: float = 5.0,
) -> SyntheticSpec | None:
    """The synthetic workload ``--workload`` names, shaped by its options (bench and sim
    share them); None when no workload is named (a trace is replayed)."""
    name = _choice("workload", workload, SYNTHETIC_WORKLOADS)
    if name is None:
        return None
    return SyntheticSpec(
        name,
        max_prompt_tokens=max_prompt_tokens,
        num_groups=groups,
        prompts_per_group=prompts_per_group,
        sessions=sessions,
        turns=turns,
        system_tokens=system_tokens,
        question_tokens=question_tokens,
        output_tokens=output_tokens,
        think_time_s=think_time_s,
    )


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one line to stderr and exit: the CLI's only way to report bad input."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", help="Print the version and exit."),
) -> None:
    if version:
        console.print(__version__)
        raise typer.Exit(0)


def main() -> None:
    try:
        app()
    except IsocostError as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)


@app.command()
def engine(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", "--base-port", help="First port (0: OS picks)."),
    model: str = typer.Option("llama-3.1-8b", "--model", "-m", help="Model id or HF folder."),
    gpu: str = typer.Option("h100-80g", "--gpu", "-g", help="GPU catalog id."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel GPUs per replica."),
    replicas: int = typer.Option(1, "--replicas", help="Identical replicas, one port each."),
    replica_spec: list[str] | None = typer.Option(
        None, "--replica-spec", help="key=value,... per replica (gpu, model, tp, slowdown...)."
    ),
    replicas_file: str | None = typer.Option(None, "--replicas-file", help="YAML replica list."),
    served_model_name: str | None = typer.Option(
        None, "--served-model-name", help="Name clients ask for (default: --model)."
    ),
    time_scale: float = typer.Option(1.0, "--time-scale", help="0.05: a GPU 20x faster."),
    stream_interval: int = typer.Option(1, "--stream-interval", help="Tokens per SSE chunk."),
    max_num_batched_tokens: int = typer.Option(
        8192, "--max-num-batched-tokens", help="Token budget per step (chunked prefill)."
    ),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs", help="Most running requests."),
    gpu_memory_utilization: float = typer.Option(
        0.9, "--gpu-memory-utilization", help="VRAM share for weights, activations and KV."
    ),
    num_gpu_blocks: int | None = typer.Option(
        None, "--num-gpu-blocks-override", help="KV blocks instead of the VRAM ledger's."
    ),
    output_dist: str = typer.Option("exponential", "--output-dist", help="exponential|uniform|max"),
    output_mean_tokens: float = typer.Option(
        128.0, "--output-mean-tokens", help="Mean output length (exponential)."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of output lengths and error draws."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="tokenizer.json: exact."),
    catalog: CatalogOption = None,
    slowdown: float = typer.Option(1.0, "--slowdown", help="Fault: step time factor."),
    error_rate: float = typer.Option(0.0, "--error-rate", help="Fault: share of 500s."),
    hang: bool = typer.Option(False, "--hang", help="Fault: accept, never answer."),
    max_waiting: int | None = typer.Option(None, "--max-waiting", help="Fault: 503 above."),
) -> None:
    """Serve simulated vLLM-like replicas timed by the cost model.

    Each speaks the OpenAI API and exports vLLM's metrics.
    """
    from isocost.core.costmodel import EngineLimits
    from isocost.engine.config import EngineReplicaConfig, Faults
    from isocost.engine.launch import launch
    from isocost.engine.server import Replica, ServeOptions

    faults = Faults(slowdown=slowdown, error_rate=error_rate, hang=hang, max_waiting=max_waiting)
    default = EngineReplicaConfig(
        gpu, model, tp, served_model_name or model, num_gpu_blocks, faults
    )
    limits = EngineLimits(gpu_memory_utilization, max_num_batched_tokens, max_num_seqs)
    options = ServeOptions(
        host, time_scale, stream_interval, output_dist, output_mean_tokens, seed, tokenizer
    )

    def ready(urls: list[tuple[Replica, str]]) -> None:
        for replica, url in urls:
            line = f"isocost engine: {replica.describe()} ready at {url}"
            console.print(line, highlight=False, soft_wrap=True)
        sys.stdout.flush()

    launch(
        default=default,
        replicas=replicas,
        spec_strings=replica_spec or [],
        replicas_file=replicas_file,
        port=port,
        catalog_paths=catalog or [],
        limits=limits,
        options=options,
        on_ready=ready,
    )


@app.command()
def serve(
    config: str | None = typer.Option(
        None, "--config", "-c", help="Gateway YAML; hot-reloaded when it changes."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8080, "--port", help="Port (0: OS picks)."),
    replica: list[str] | None = typer.Option(
        None, "--replica", "-r", help="Replica URL (repeatable); without --config."
    ),
    policy: str | None = typer.Option(
        None, "--policy", help="Scheduling policy (default: the file's, else equal_cost)."
    ),
    gpu: str = typer.Option("a100-80g", "--gpu", "-g", help="GPU of --replica replicas."),
    tp: int = typer.Option(1, "--tp", help="Tensor parallelism of --replica replicas."),
    cost_model: str | None = typer.Option(
        None, "--cost-model", help="Catalog model for --replica replicas (default: served name)."
    ),
    admin_token_env: str | None = typer.Option(
        None, "--admin-token-env", help="Env variable holding the admin token (--replica mode)."
    ),
    catalog: CatalogOption = None,
    discover_timeout: float = typer.Option(30.0, "--discover-timeout", help="Seconds."),
    log_level: str = typer.Option("info", "--log-level", help="debug|info|warning|error"),
) -> None:
    """Run the OpenAI-compatible gateway that routes by equal cost."""
    import asyncio
    from pathlib import Path

    import msgspec

    from isocost.files import load_catalog, read_text
    from isocost.gateway.config import parse_config
    from isocost.gateway.server import (
        configure_logging,
        discover_config,
        load_gateway,
        run_gateway,
    )

    if (config is None) == (not replica):
        fail("give either --config FILE or one or more --replica URL")
    cat = load_catalog(catalog or [])
    if config is not None:
        gateway_config = parse_config(read_text(config), config)
        if policy is not None:  # an explicit --policy overrides the file's default
            gateway_config = msgspec.structs.replace(gateway_config, policy=policy)
    else:
        gateway_config = asyncio.run(
            discover_config(
                replica or [],
                policy=policy or "equal_cost",
                gpu=gpu,
                tensor_parallel=tp,
                cost_model=cost_model,
                catalog=cat,
                admin_token_env=admin_token_env,
                timeout_s=discover_timeout,
            )
        )
    configure_logging(log_level)
    gateway = load_gateway(gateway_config, cat, Path(config) if config else None)

    def ready(url: str) -> None:
        console.print(f"isocost serve: ready at {url}", highlight=False, soft_wrap=True)
        sys.stdout.flush()

    run_gateway(gateway, host, port, ready)


@app.command()
def plan(
    model: str = typer.Option(..., "--model", "-m", help="Catalog id or local HF model folder."),
    gpu: str = typer.Option(..., "--gpu", "-g", help="GPU catalog id, e.g. a100-80g."),
    dtype: str | None = typer.Option(None, "--dtype", help="Weights: fp16|bf16|fp8|int8|int4."),
    kv_dtype: str | None = typer.Option(None, "--kv-dtype", help="KV cache dtype."),
    context: int = typer.Option(2048, "--context", help="Mean tokens per request (in + out)."),
    output_tokens: int = typer.Option(256, "--output-tokens", help="Mean output tokens."),
    concurrency: int | None = typer.Option(None, "--concurrency", help="Concurrent requests."),
    qps: float | None = typer.Option(None, "--qps", help="Target requests per second."),
    ttft_slo_ms: float | None = typer.Option(None, "--ttft-slo-ms", help="TTFT SLO."),
    tpot_slo_ms: float | None = typer.Option(None, "--tpot-slo-ms", help="TPOT SLO."),
    gpu_mem_util: float = typer.Option(0.9, "--gpu-mem-util", help="vLLM memory fraction."),
    headroom: float = typer.Option(0.15, "--headroom", help="KV pool share kept free."),
    price: float | None = typer.Option(None, "--price", help="Override $/GPU-hour."),
    catalog: CatalogOption = None,
    explain: bool = typer.Option(False, "--explain", help="Show each figure's derivation."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """Size a deployment: VRAM, TP, replicas, throughput, $ per token.

    The VRAM ledger per GPU, then each tensor-parallel option.
    """
    from isocost import planview
    from isocost.core.planner import PlanRequest
    from isocost.core.planner import plan as run_plan
    from isocost.files import load_catalog, resolve_model

    cat = load_catalog(catalog)
    gpu_spec = cat.gpu(gpu)
    if price is not None:
        gpu_spec = gpu_spec.with_price(price)
    try:
        request = PlanRequest(
            model=resolve_model(model, cat),
            gpu=gpu_spec,
            weight_dtype=dtype,
            kv_dtype=kv_dtype,
            context_tokens=context,
            output_tokens=output_tokens,
            concurrency=concurrency,
            qps=qps,
            ttft_slo_s=None if ttft_slo_ms is None else ttft_slo_ms / 1000,
            tpot_slo_s=None if tpot_slo_ms is None else tpot_slo_ms / 1000,
            gpu_memory_utilization=gpu_mem_util,
            headroom=headroom,
        )
    except ValueError as exc:
        fail(str(exc))
    result = run_plan(request)
    if as_json:
        planview.print_json(result)
    else:
        planview.print_tables(console, result, explain=explain)


@app.command()
def policies(
    config: str | None = typer.Option(None, "--config", help="Scheduling YAML to check and add."),
    as_yaml: bool = typer.Option(False, "--yaml", help="Print the profiles as scheduling YAML."),
) -> None:
    """List the scheduling policies and the plugin types.

    A policy is a canned profile of plugins.
    """
    from rich.table import Table
    from rich.text import Text

    from isocost.files import read_text
    from isocost.scheduling.plugins import PLUGIN_TYPES
    from isocost.scheduling.policies import (
        BUILTIN_POLICIES,
        SchedulingConfig,
        config_to_yaml,
        parse_scheduling_yaml,
    )

    user = parse_scheduling_yaml(read_text(config), config) if config else SchedulingConfig()
    profiles = {**BUILTIN_POLICIES, **{p.name: p for p in user.policies}}
    if as_yaml:
        merged = SchedulingConfig(user.plugins, list(profiles.values()), user.routes)
        console.print(config_to_yaml(merged), end="", markup=False, highlight=False, soft_wrap=True)
        return
    table = Table(title="policies")
    table.add_column("policy", no_wrap=True)
    table.add_column("what, then its plugins")
    for p in profiles.values():
        plugins = [f"filters {', '.join(p.filters)}"] if p.filters else []
        if p.scorers:
            plugins.append("scorers " + ", ".join(f"{s.plugin} ({s.weight:g})" for s in p.scorers))
        plugins += [f"picker {p.picker}", *(["admission slo"] if p.admission.slo else [])]
        table.add_row(p.name, Text(f"{p.description}\n") + Text("; ".join(plugins), "dim"))
    console.print(table)
    types = Table(title="plugin types")
    for column in ("type", "kind", "what"):
        types.add_column(column)
    for entry in PLUGIN_TYPES.values():
        types.add_row(entry.type_name, entry.kind, entry.summary)
    console.print(types)


@app.command()
def demo(
    out: str = typer.Option("isocost-demo", "--out", help="Folder for the report and logs."),
    duration: float = typer.Option(60.0, "--duration", help="Seconds of arrivals per policy."),
    rate: float = typer.Option(6.0, "--rate", help="Poisson arrivals, requests/s."),
    trace: str | None = typer.Option(None, "--trace", help="Replay this trace's requests."),
    trace_format: TraceFormatOption = None,
    policies: str = typer.Option(
        "round_robin,equal_cost", "--policies", help="Comma-separated, run in this order."
    ),
    time_scale: float = typer.Option(2.0, "--time-scale", help="Engine wall s per GPU s."),
    seed: int = typer.Option(0, "--seed", help="Seed of the workload."),
    port: int = typer.Option(0, "--port", help="Gateway port (0: a free one)."),
    keep_running: bool = typer.Option(
        False, "--keep-running", help="Leave the last cluster up for the dashboard."
    ),
) -> None:
    """Round-robin vs equal-cost on a local heterogeneous cluster.

    A live view while it runs, then the tables and an HTML report.
    """
    from pathlib import Path

    from isocost.bench import TRACE_FORMATS
    from isocost.demo import DemoInterrupted, DemoOptions, run_demo

    trace_format = _choice("trace format", trace_format, TRACE_FORMATS)
    options = DemoOptions(
        out_dir=Path(out),
        duration_s=duration,
        rate_rps=rate,
        trace=trace,
        trace_format=trace_format,
        policies=tuple(p.strip() for p in policies.split(",") if p.strip()),
        time_scale=time_scale,
        seed=seed,
        port=port,
        keep_running=keep_running,
    )
    try:
        run_demo(options, console)
    except DemoInterrupted:
        err_console.print("interrupted: every process the demo started has been stopped")
        raise typer.Exit(130) from None


@app.command()
def drill(
    gateway: str = typer.Option(..., "--gateway", help="Gateway base URL (isocost serve)."),
    replica_admin: list[str] = typer.Option(
        ..., "--replica-admin", help="Engine URL of a replica to fault (its /admin/fault)."
    ),
    fault: str = typer.Option(..., "--fault", help="kill|hang|slow|errors|restart"),
    admin_token_env: str = typer.Option(
        "ISOCOST_ADMIN_TOKEN", "--admin-token-env", help="Env var with the gateway admin token."
    ),
    api_key_env: str | None = typer.Option(
        None, "--api-key-env", help="Env var with an API key for the load."
    ),
    rate: float = typer.Option(8.0, "--rate", help="Steady load, requests/s (Poisson)."),
    max_tokens: int = typer.Option(32, "--max-tokens", help="Output tokens per request."),
    stream: bool = typer.Option(True, "--stream/--no-stream", help="Load streams (SSE)."),
    warmup: float = typer.Option(3.0, "--warmup", help="Seconds of load before the fault."),
    fault_duration: float = typer.Option(5.0, "--fault-duration", help="Seconds it lasts."),
    settle: float = typer.Option(10.0, "--settle", help="Longest wait for recovery, s."),
    slowdown: float = typer.Option(3.0, "--slowdown", help="slow: step time factor."),
    error_rate: float = typer.Option(1.0, "--error-rate", help="errors: share of 500s."),
    restart_command: str | None = typer.Option(
        None, "--restart-command", help="restart: command that starts the replica again."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the load."),
    json_out: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
) -> None:
    """Fault drill under load: detection, requests affected, recovery."""
    import os

    from isocost.drill import FAULTS, DrillOptions, drill_command

    if fault not in FAULTS:
        fail(f"unknown fault {fault!r}; valid: {', '.join(FAULTS)}")
    token = os.environ.get(admin_token_env)
    if not token:
        fail(f"set the gateway's admin token in ${admin_token_env} (or pass --admin-token-env)")
    api_key = os.environ.get(api_key_env) if api_key_env else None
    if api_key_env and not api_key:
        fail(f"environment variable {api_key_env} is unset")
    options = DrillOptions(
        fault=fault,
        admin_token=token,
        api_key=api_key,
        rate_rps=rate,
        max_tokens=max_tokens,
        stream=stream,
        warmup_s=warmup,
        fault_s=fault_duration,
        settle_s=settle,
        slowdown=slowdown,
        error_rate=error_rate,
        seed=seed,
    )
    drill_command(
        gateway,
        replica_admin,
        options,
        console,
        restart_command=restart_command,
        json_out=json_out,
    )


@app.command()
def sim(
    trace: TraceOption = None,
    trace_format: TraceFormatOption = None,
    workload: WorkloadOption = None,
    cluster: str | None = typer.Option(None, "--cluster", help="Cluster YAML (mixed fleets)."),
    replicas: int = typer.Option(16, "--replicas", help="Identical replicas (no --cluster)."),
    gpu: str = typer.Option("a100-80g", "--gpu", "-g", help="GPU catalog id."),
    model: str = typer.Option("llama-3.1-8b", "--model", "-m", help="Model id or HF folder."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel GPUs per replica."),
    policies: str = typer.Option(
        "equal_cost,round_robin,least_request", "--policies", help="Comma-separated policies."
    ),
    slo_ttft_ms: float = typer.Option(2000.0, "--slo-ttft-ms", help="TTFT target."),
    slo_ttft_per_1k_ms: float = typer.Option(
        0.0, "--slo-ttft-per-1k-ms", help="Added to the TTFT target per 1,000 prompt tokens."
    ),
    slo_tpot_ms: float = typer.Option(100.0, "--slo-tpot-ms", help="TPOT target."),
    deadlines: bool = typer.Option(
        True,
        "--deadlines/--no-deadlines",
        help="Requests carry their TTFT and TPOT targets (SLO admission sees them).",
    ),
    rate: float | None = typer.Option(
        None, "--rate", help="Mean req/s: scales a trace's time; Poisson for --workload."
    ),
    speedup: SpeedupOption = 1.0,
    sweep_rate: str | None = typer.Option(
        None, "--sweep-rate", help="r1,r2,...: replay at each mean rate; capacity at SLO."
    ),
    target: float = typer.Option(0.9, "--target", help="Share meeting SLOs for capacity."),
    max_requests: int | None = typer.Option(None, "--max-requests", help="First N requests."),
    duration: float | None = typer.Option(None, "--duration", help="Arrivals before s."),
    network_delay_ms: float | None = typer.Option(None, "--network-delay-ms", help="Each way."),
    scrape_interval_ms: float | None = typer.Option(
        None, "--scrape-interval-ms", help="Engine metrics scrape period (0: never)."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of policies and synthetic workloads."),
    jobs: int = typer.Option(2, "--jobs", "-j", help="Parallel processes."),
    json_out: str | None = typer.Option(None, "--json", help="Write results JSON."),
    plot: str | None = typer.Option(None, "--plot", help="Write a PNG of CDFs, load, goodput."),
    catalog: CatalogOption = None,
    groups: GroupsOption = 8,
    prompts_per_group: PromptsPerGroupOption = 16,
    sessions: SessionsOption = 16,
    turns: TurnsOption = 4,
    system_tokens: SystemTokensOption = 2048,
    question_tokens: QuestionTokensOption = 128,
    output_tokens: int = typer.Option(128, "--output-tokens", help="Synthetic output length."),
    max_prompt_tokens: MaxPromptTokensOption = None,
) -> None:
    """Replay a trace through policies on a simulated cluster.

    The scheduling policies run side by side on the same requests.
    """
    from isocost import sim as simulator
    from isocost.files import load_catalog, read_text

    trace_format = _choice("trace format", trace_format, simulator.TRACE_FORMATS)
    names = tuple(p.strip() for p in policies.split(",") if p.strip())
    simulator.check_policies(names)
    try:
        rates = tuple(float(r) for r in sweep_rate.split(",")) if sweep_rate else ()
        slo = simulator.Slo(slo_ttft_ms / 1000, slo_tpot_ms / 1000, slo_ttft_per_1k_ms / 1000)
    except ValueError as exc:
        fail(f"--sweep-rate or SLO: {exc}")
    if any(r <= 0 for r in rates) or not 0 < target <= 1 or jobs < 1:
        fail("--sweep-rate rates must be positive, --target in (0, 1], --jobs >= 1")
    overrides = {
        k: v
        for k, v in (
            ("network_delay_ms", network_delay_ms),
            ("scrape_interval_ms", scrape_interval_ms),
        )
        if v is not None
    }
    if cluster is not None:
        config = simulator.parse_cluster_yaml(read_text(cluster), cluster)
        config = simulator.with_settings(config, cluster, **overrides)
    else:
        config = simulator.uniform_cluster(replicas, gpu, model, tp, **overrides)
    synthetic = _synthetic(workload, max_prompt_tokens, groups, prompts_per_group, sessions,
                           turns, system_tokens, question_tokens, output_tokens)  # fmt: skip
    choice = simulator.WorkloadChoice(
        trace=trace,
        trace_format=trace_format,
        synthetic=synthetic,
        rate_rps=rate,
        speedup=speedup,
        max_requests=max_requests,
        duration_s=duration,
        seed=seed,
    )
    plan = simulator.SimPlan(
        cluster=config,
        catalog=load_catalog(catalog or []),
        requests=simulator.load_requests(choice),
        policies=names,
        slo=slo,
        seed=seed,
        deadlines=deadlines,
        rates_rps=rates,
        target_attainment=target,
        sample_points=200 if plot else 0,
        jobs=jobs,
    )
    simulator.sim_command(console, plan, json_out, plot)


bench_app = typer.Typer(
    help="Load generator against any OpenAI-compatible endpoint.\n\n"
    "`bench compare` puts runs side by side.",
    invoke_without_command=True,
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(bench_app, name="bench")


@bench_app.callback()
def bench(
    ctx: typer.Context,
    url: str | None = typer.Option(None, "--url", help="Endpoint base URL, e.g. http://h:8000."),
    trace: TraceOption = None,
    trace_format: TraceFormatOption = None,
    workload: WorkloadOption = None,
    rate: float | None = typer.Option(
        None, "--rate", help="Poisson arrivals at this req/s (multi-turn: sessions/s)."
    ),
    burstiness: float = typer.Option(1.0, "--burstiness", help="Gap CV with --rate (>1 bursty)."),
    speedup: SpeedupOption = 1.0,
    concurrency: int | None = typer.Option(None, "--concurrency", help="Closed loop: workers."),
    max_requests: int | None = typer.Option(None, "--max-requests", help="Stop after N."),
    duration: float | None = typer.Option(None, "--duration", help="No new request after s."),
    model: str | None = typer.Option(None, "--model", help="Default: first of /v1/models."),
    chat: bool = typer.Option(False, "--chat", help="Use /v1/chat/completions."),
    stream: bool = typer.Option(True, "--stream/--no-stream", help="Stream with SSE."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", help="Fix every output length."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Ask for exactly max_tokens."),
    slo_ttft_ms: float | None = typer.Option(None, "--slo-ttft-ms", help="TTFT SLO (goodput)."),
    slo_tpot_ms: float | None = typer.Option(None, "--slo-tpot-ms", help="TPOT SLO (goodput)."),
    timeout: float = typer.Option(600.0, "--timeout", help="Per-request timeout, s."),
    seed: int = typer.Option(0, "--seed", help="Seed of synthetic workloads and arrivals."),
    text_salt: int = typer.Option(0, "--text-salt", help="New prompt text (cold cache)."),
    groups: GroupsOption = 8,
    prompts_per_group: PromptsPerGroupOption = 16,
    sessions: SessionsOption = 16,
    turns: TurnsOption = 4,
    think_time: float = typer.Option(5.0, "--think-time", help="multi-turn: mean think s."),
    system_tokens: SystemTokensOption = 2048,
    question_tokens: QuestionTokensOption = 128,
    output_tokens: int = typer.Option(
        128, "--output-tokens", help="shared-prefix, multi-turn: output length."
    ),
    max_prompt_tokens: MaxPromptTokensOption = None,
    label: str = typer.Option("bench", "--label", help="Name of this run in comparisons."),
    api_key: str | None = typer.Option(None, "--api-key", help="Bearer token to send."),
    records: str | None = typer.Option(None, "--records", help="Per-request JSONL output."),
    json_out: str | None = typer.Option(None, "--json", help="Summary JSON output."),
) -> None:
    """Replay a trace or a synthetic workload against URL; print TTFT/TPOT/E2E and goodput."""
    if ctx.invoked_subcommand is not None:
        return
    from isocost.bench import TRACE_FORMATS, BenchOptions, WorkloadSpec, bench_command

    if url is None:
        fail("give the endpoint with --url")
    trace_format = _choice("trace format", trace_format, TRACE_FORMATS)
    synthetic = _synthetic(workload, max_prompt_tokens, groups, prompts_per_group, sessions,
                           turns, system_tokens, question_tokens, output_tokens,
                           think_time)  # fmt: skip
    spec = WorkloadSpec(
        trace=trace,
        trace_format=trace_format,
        synthetic=synthetic,
        rate_rps=rate,
        burstiness=burstiness,
        speedup=speedup,
        seed=seed,
    )
    options = BenchOptions(
        model=model,
        api="chat" if chat else "completions",
        stream=stream,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        concurrency=concurrency,
        max_requests=max_requests,
        duration_s=duration,
        timeout_s=timeout,
        slo_ttft_ms=slo_ttft_ms,
        slo_tpot_ms=slo_tpot_ms,
        text_salt=text_salt,
        api_key=api_key,
        label=label,
    )
    try:
        bench_command(url, spec, options, console, records_path=records, json_path=json_out)
    except ValueError as exc:
        fail(str(exc))


@bench_app.command("compare")
def bench_compare(
    files: list[str] = typer.Argument(..., help="Summary JSON files of `isocost bench --json`."),
    plot: str | None = typer.Option(None, "--plot", help="Write latency CDFs + goodput PNG."),
) -> None:
    """Compare bench runs side by side."""
    from isocost.bench import compare_command

    compare_command(files, console, plot)
