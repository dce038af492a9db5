"""``isocost drill``: a fault under steady load, against a running gateway."""

from __future__ import annotations

import typer

from isocost.cli._app import app, console, fail
from isocost.cli._options import checked
from isocost.core.bounds import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Bounds


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
    rate: float = typer.Option(
        8.0, "--rate", callback=checked(POSITIVE), help="Steady load, requests/s (Poisson)."
    ),
    max_tokens: int = typer.Option(
        32, "--max-tokens", callback=checked(AT_LEAST_ONE), help="Output tokens per request."
    ),
    stream: bool = typer.Option(True, "--stream/--no-stream", help="Load streams (SSE)."),
    ignore_eos: bool = typer.Option(
        False, "--ignore-eos", help="Ask for exactly --max-tokens per request."
    ),
    warmup: float = typer.Option(
        3.0, "--warmup", callback=checked(NON_NEGATIVE), help="Seconds of load before the fault."
    ),
    fault_duration: float = typer.Option(
        5.0, "--fault-duration", callback=checked(POSITIVE), help="Seconds it lasts."
    ),
    settle: float = typer.Option(
        10.0, "--settle", callback=checked(POSITIVE), help="Longest wait for recovery, s."
    ),
    slowdown: float = typer.Option(
        3.0, "--slowdown", callback=checked(Bounds(1.0)), help="slow: step time factor."
    ),
    error_rate: float = typer.Option(
        1.0,
        "--error-rate",
        callback=checked(Bounds(0.0, 1.0, low_open=True)),
        help="errors: share of 500s.",
    ),
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
        ignore_eos=ignore_eos,
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
