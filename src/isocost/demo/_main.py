"""``isocost demo``: the same workload through the same heterogeneous cluster, once per
policy, side by side.

For each policy (round_robin, then equal_cost) the demo starts a fresh cluster, so that
caches and queues start equal and the gateway has learned nothing yet: one ``isocost
engine`` process with every replica (one of them secretly slowed), then an ``isocost
serve`` gateway on the same port each time (a dashboard left open follows along). It
replays the workload (the scenario mix, or ``--trace``, at ``--rate`` for ``--duration``
seconds, the same seed each time) through the gateway with the load generator's Python
API, showing a live view; reads per-replica counts from the gateway's ``/metrics``; and
stops the cluster, except the last one with ``--keep-running``. Then it prints the tables
and writes the HTML report.

The default load is chosen so that round-robin, which sends the slowed replica its equal
share, drowns it (its queue grows for the whole run), while equal-cost learns the
replica's correction factor from its first answers and sends it only what it can take.

Stopping: Ctrl-C (SIGINT) and SIGTERM end the run; every child process group is then
terminated from a ``finally`` before the demo exits with code 130.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.live import Live

from isocost.bench import BenchOptions, BenchResult, WorkloadSpec, build_workload, run_bench
from isocost.bench._report import compare_table
from isocost.core.bounds import POSITIVE, Bounds
from isocost.core.errors import ConfigError
from isocost.core.slo import (
    DEFAULT_SLO_TPOT_MS,
    DEFAULT_SLO_TTFT_MS,
    DEFAULT_SLO_TTFT_PER_1K_MS,
    SloTargets,
)
from isocost.demo._cluster import (
    DEFAULT_LAYOUT,
    Cluster,
    ClusterSettings,
    DemoReplica,
    start_cluster,
)
from isocost.demo._live import LiveState, poll_snapshot, render
from isocost.demo._report import headline, replica_table, write_report
from isocost.runtime.config import SloConfig
from isocost.runtime.processes import Services, free_port, sigterm_interrupts
from isocost.scheduling.policies import BUILTIN_POLICIES
from isocost.workload import SyntheticSpec, TraceFormat

__all__ = ["DEFAULT_POLICIES", "DemoInterrupted", "DemoOptions", "run_demo"]

DEFAULT_POLICIES = ("round_robin", "equal_cost")


class DemoInterrupted(Exception):
    """Ctrl-C or SIGTERM: the demo stopped what it started and should exit with 130."""


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """Every knob of ``isocost demo``; the defaults are the tuned demo."""

    out_dir: Path = Path("isocost-demo")
    duration_s: float = 60.0
    rate_rps: float = 6.0
    trace: str | None = None
    trace_format: TraceFormat | None = None
    policies: tuple[str, ...] = DEFAULT_POLICIES
    model: str = "llama-3.1-8b"
    layout: tuple[DemoReplica, ...] = DEFAULT_LAYOUT
    time_scale: float = 2.0
    stream_interval: int = 1
    max_prompt_tokens: int = 8192
    slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS
    slo_ttft_per_1k_ms: float = DEFAULT_SLO_TTFT_PER_1K_MS
    slo_tpot_ms: float = DEFAULT_SLO_TPOT_MS
    timeout_s: float = 60.0
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port, the same for every run
    keep_running: bool = False

    def check(self) -> None:
        """ConfigError for a knob out of range, before anything starts."""
        numbers = (
            ("--duration", self.duration_s, POSITIVE),
            ("--rate", self.rate_rps, POSITIVE),
            ("--time-scale", self.time_scale, POSITIVE),
            ("--port", self.port, Bounds(0, 65535)),
            ("--timeout", self.timeout_s, POSITIVE),
        )
        for flag, value, bounds in numbers:
            if (problem := bounds.problem(value)) is not None:
                raise ConfigError(flag, problem)
        checks = (
            ("--policies", len(self.policies) >= 1, "name at least one policy"),
            ("--policies", set(self.policies) <= set(BUILTIN_POLICIES), _valid_policies()),
        )
        for flag, ok, message in checks:
            if not ok:
                raise ConfigError(flag, message)
        try:
            SloTargets.from_ms(self.slo_ttft_ms, self.slo_tpot_ms, self.slo_ttft_per_1k_ms)
        except ValueError as exc:
            raise ConfigError(
                "--slo-ttft-ms, --slo-ttft-per-1k-ms, --slo-tpot-ms", str(exc)
            ) from None


def _valid_policies() -> str:
    return f"valid policies: {', '.join(BUILTIN_POLICIES)}"


def _workload(options: DemoOptions) -> WorkloadSpec:
    """The same requests for every policy: the seed fixes lengths, text and arrivals."""
    return WorkloadSpec(
        trace=options.trace,
        trace_format=options.trace_format,
        synthetic=None
        if options.trace
        else SyntheticSpec("mix", max_prompt_tokens=options.max_prompt_tokens),
        rate_rps=options.rate_rps,
        seed=options.seed,
    )


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """A second Ctrl-C must not cut the cleanup short and leave children behind."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def _run_policy(
    cluster: Cluster,
    options: DemoOptions,
    policy: str,
    token: str,
    console: Console,
) -> BenchResult:
    """One replay through ``cluster`` with the live view; KeyboardInterrupt on a signal."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    interrupted: list[int] = []

    def on_signal(signum: int) -> None:
        interrupted.append(signum)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    bench_options = BenchOptions(
        duration_s=options.duration_s,
        timeout_s=options.timeout_s,
        slo_ttft_ms=options.slo_ttft_ms,
        slo_tpot_ms=options.slo_tpot_ms,
        slo_ttft_per_1k_ms=options.slo_ttft_per_1k_ms,
        label=policy,
    )
    state = LiveState(policy, options.duration_s, loop, loop.time())
    poller = asyncio.create_task(poll_snapshot(cluster.url, token, state))
    try:
        requests = build_workload(_workload(options), closed_loop=False)
        with Live(get_renderable=lambda: render(state), console=console, refresh_per_second=4):
            result = await run_bench(cluster.url, requests, bench_options, state.progress, stop)
        console.line()
    finally:
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if interrupted:
        raise KeyboardInterrupt
    return result


def _setup_rows(options: DemoOptions) -> list[tuple[str, str]]:
    slowed = [f"{r.name} ({r.slowdown:g}x)" for r in options.layout if r.slowdown != 1]
    gpus = ", ".join(f"{r.name}={r.gpu}" for r in options.layout)
    workload = options.trace or "scenario mix (65% chat, 30% RAG, 5% long documents)"
    return [
        ("model", options.model),
        ("replicas", gpus),
        ("slowed (hidden from the gateway)", ", ".join(slowed) or "none"),
        ("workload", f"{workload}, Poisson {options.rate_rps:g} req/s, seed {options.seed}"),
        ("duration", f"{options.duration_s:g} s of arrivals per policy"),
        ("engine time scale", f"{options.time_scale:g} (wall s per modelled GPU s)"),
        ("SLOs (goodput)", _slo_text(options)),
    ]


def _slo_text(options: DemoOptions) -> str:
    per_1k = options.slo_ttft_per_1k_ms
    scaled = f" + {per_1k:g} ms per 1k prompt tokens" if per_1k else ""
    return f"TTFT {options.slo_ttft_ms:g} ms{scaled}, TPOT {options.slo_tpot_ms:g} ms"


def run_demo(options: DemoOptions, console: Console) -> Path:
    """Run the demo; returns the report's path. Raises DemoInterrupted after Ctrl-C or
    SIGTERM, once every process it started has been stopped; bad options or an unreadable
    trace raise ConfigError before anything starts."""
    options.check()
    build_workload(_workload(options), closed_loop=False)  # reads and checks a trace now
    token = secrets.token_urlsafe(16)
    out_dir = options.out_dir.resolve()
    services = Services(out_dir / "logs")
    settings = ClusterSettings(
        model=options.model,
        layout=options.layout,
        time_scale=options.time_scale,
        stream_interval=options.stream_interval,
        gateway_host=options.host,
        gateway_port=options.port or free_port(options.host),
        admin_token=token,
        seed=options.seed,
        slo=SloConfig(options.slo_ttft_ms, options.slo_tpot_ms, options.slo_ttft_per_1k_ms),
    )
    dashboard = f"http://{options.host}:{settings.gateway_port}/dashboard#token={token}"
    console.print(
        f"[bold]isocost demo[/]: {len(options.layout)} replicas, policies "
        f"{', '.join(options.policies)}; output in {out_dir}"
    )
    console.print(f"live dashboard (while a run goes): {dashboard}", soft_wrap=True)
    runs: list[BenchResult] = []
    try:
        with sigterm_interrupts():
            for i, policy in enumerate(options.policies):
                console.rule(f"{policy}: starting engines and gateway")
                cluster = start_cluster(services, settings, policy, out_dir)
                runs.append(asyncio.run(_run_policy(cluster, options, policy, token, console)))
                console.print(f"{policy}: {runs[-1].summary.completed} requests done")
                last = i == len(options.policies) - 1
                if not (last and options.keep_running):
                    services.stop(cluster.gateway)
                    services.stop(cluster.engines)
            report = write_report(out_dir, runs, options.layout, _setup_rows(options))
            console.print(compare_table([run.summary for run in runs]))
            console.print(replica_table(runs, options.layout))
            console.print(f"[bold]{headline(runs)}[/]")
            console.print(f"report: {report}", soft_wrap=True)
            if options.keep_running:
                console.print(f"cluster still up; dashboard: {dashboard}", soft_wrap=True)
                console.print("press Ctrl-C to stop it")
                signal.pause()
            return report
    except KeyboardInterrupt:
        raise DemoInterrupted from None
    finally:
        with _signals_ignored():
            services.stop_all()
