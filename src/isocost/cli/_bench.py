"""``isocost bench`` and ``bench compare``: the load generator and its comparisons."""

from __future__ import annotations

import typer

from isocost.cli._app import app, console, fail
from isocost.cli._options import (
    GroupsOption,
    MaxPromptTokensOption,
    OptionalSloTpotOption,
    OptionalSloTtftOption,
    OutputTokensOption,
    PromptsPerGroupOption,
    QuestionTokensOption,
    SessionsOption,
    SloTtftPer1kOption,
    SpeedupOption,
    SystemTokensOption,
    TraceFormatOption,
    TraceOption,
    TurnsOption,
    WorkloadOption,
    checked,
    one_of,
    synthetic_workload,
)
from isocost.cli._outputs import check_outputs
from isocost.core.bounds import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE
from isocost.core.slo import DEFAULT_SLO_TTFT_PER_1K_MS

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
    url: list[str] | None = typer.Option(
        None, "--url", help="Endpoint base URL, e.g. http://h:8000 (repeat: round-robin)."
    ),
    trace: TraceOption = None,
    trace_format: TraceFormatOption = None,
    workload: WorkloadOption = None,
    rate: float | None = typer.Option(
        None,
        "--rate",
        callback=checked(POSITIVE),
        help="Poisson arrivals at this req/s (multi-turn: sessions/s).",
    ),
    burstiness: float = typer.Option(
        1.0, "--burstiness", callback=checked(POSITIVE), help="Gap CV with --rate (>1 bursty)."
    ),
    speedup: SpeedupOption = 1.0,
    concurrency: int | None = typer.Option(
        None, "--concurrency", callback=checked(AT_LEAST_ONE), help="Closed loop: workers."
    ),
    max_requests: int | None = typer.Option(
        None, "--max-requests", callback=checked(AT_LEAST_ONE), help="Stop after N."
    ),
    duration: float | None = typer.Option(
        None, "--duration", callback=checked(POSITIVE), help="No new request after s."
    ),
    model: str | None = typer.Option(None, "--model", help="Default: first of /v1/models."),
    chat: bool = typer.Option(False, "--chat", help="Use /v1/chat/completions."),
    stream: bool = typer.Option(True, "--stream/--no-stream", help="Stream with SSE."),
    max_tokens: int | None = typer.Option(
        None, "--max-tokens", callback=checked(AT_LEAST_ONE), help="Fix every output length."
    ),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Ask for exactly max_tokens."),
    slo_ttft_ms: OptionalSloTtftOption = None,
    slo_ttft_per_1k_ms: SloTtftPer1kOption = DEFAULT_SLO_TTFT_PER_1K_MS,
    slo_tpot_ms: OptionalSloTpotOption = None,
    send_slo: bool = typer.Option(
        False, "--send-slo", help="Send the targets: x-deadline-ms, x-tpot-ms (SLO admission)."
    ),
    timeout: float = typer.Option(
        600.0, "--timeout", callback=checked(POSITIVE), help="Per-request timeout, s."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of synthetic workloads and arrivals."),
    text_salt: int = typer.Option(0, "--text-salt", help="New prompt text (cold cache)."),
    groups: GroupsOption = 8,
    prompts_per_group: PromptsPerGroupOption = 16,
    sessions: SessionsOption = 16,
    turns: TurnsOption = 4,
    think_time: float = typer.Option(
        5.0, "--think-time", callback=checked(NON_NEGATIVE), help="multi-turn: mean think s."
    ),
    system_tokens: SystemTokensOption = 2048,
    question_tokens: QuestionTokensOption = 128,
    output_tokens: OutputTokensOption = 128,
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

    if not url:
        fail("give the endpoint with --url")
    check_outputs(files={"--records": records, "--json": json_out})
    trace_format = one_of("trace format", trace_format, TRACE_FORMATS)
    synthetic = synthetic_workload(workload, max_prompt_tokens, groups, prompts_per_group,
                                   sessions, turns, system_tokens, question_tokens,
                                   output_tokens, think_time)  # fmt: skip
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
        slo_ttft_per_1k_ms=slo_ttft_per_1k_ms,
        send_slo=send_slo,
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

    check_outputs(plots={"--plot": plot})
    compare_command(files, console, plot)
