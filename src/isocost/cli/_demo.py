"""``isocost demo``: round-robin against equal-cost on a local cluster."""

from __future__ import annotations

import typer

from isocost.cli._app import app, console, err_console, fail
from isocost.cli._options import (
    SloTpotOption,
    SloTtftOption,
    SloTtftPer1kOption,
    TraceFormatOption,
    one_of,
    policy_names,
)
from isocost.cli._outputs import check_outputs
from isocost.core.bounds import POSITIVE, Bounds
from isocost.core.slo import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS, DEFAULT_SLO_TTFT_PER_1K_MS


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
    slo_ttft_ms: SloTtftOption = DEFAULT_SLO_TTFT_MS,
    slo_ttft_per_1k_ms: SloTtftPer1kOption = DEFAULT_SLO_TTFT_PER_1K_MS,
    slo_tpot_ms: SloTpotOption = DEFAULT_SLO_TPOT_MS,
    port: int = typer.Option(0, "--port", help="Gateway port (0: a free one)."),
    keep_running: bool = typer.Option(
        False, "--keep-running", help="Leave the last cluster up for the dashboard."
    ),
    discovery: str | None = typer.Option(
        None, "--discovery", help="etcd: replicas join and leave while traffic runs."
    ),
) -> None:
    """Round-robin vs equal-cost on a local heterogeneous cluster.

    A live view while it runs, then the tables and an HTML report.
    """
    from pathlib import Path

    from isocost.bench import TRACE_FORMATS
    from isocost.demo import (
        DemoInterrupted,
        DemoOptions,
        DiscoveryDemoOptions,
        run_demo,
        run_discovery_demo,
    )

    if discovery is not None:
        if discovery != "etcd":
            fail(f"--discovery {discovery!r}: the only one is etcd")
        for flag, value, bounds in (
            ("--duration", duration, Bounds(9.0)),
            ("--rate", rate, POSITIVE),
        ):
            if (problem := bounds.problem(value)) is not None:
                fail(f"--discovery etcd: {flag} {problem}")
        check_outputs(folders={"--out": out})
        run_discovery_demo(
            DiscoveryDemoOptions(Path(out), duration_s=duration, rate_rps=rate, seed=seed),
            console,
        )
        return

    trace_format = one_of("trace format", trace_format, TRACE_FORMATS)
    options = DemoOptions(
        out_dir=Path(out),
        duration_s=duration,
        rate_rps=rate,
        trace=trace,
        trace_format=trace_format,
        policies=policy_names(policies),
        time_scale=time_scale,
        seed=seed,
        slo_ttft_ms=slo_ttft_ms,
        slo_ttft_per_1k_ms=slo_ttft_per_1k_ms,
        slo_tpot_ms=slo_tpot_ms,
        port=port,
        keep_running=keep_running,
    )
    check_outputs(folders={"--out": out})
    try:
        run_demo(options, console)
    except DemoInterrupted:
        err_console.print("interrupted: every process the demo started has been stopped")
        raise typer.Exit(130) from None
