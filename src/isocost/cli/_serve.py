"""``isocost serve``: the gateway, from a config file or from replica URLs."""

from __future__ import annotations

import sys

import typer

from isocost.cli._app import app, console, fail
from isocost.cli._listening import Listening
from isocost.cli._options import CatalogOption, LogLevelOption, checked
from isocost.core.bounds import AT_LEAST_ONE, POSITIVE, Bounds


@app.command()
def serve(
    config: str | None = typer.Option(
        None, "--config", "-c", help="Gateway YAML; hot-reloaded when it changes."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(
        8080, "--port", callback=checked(Bounds(0, 65535)), help="Port (0: OS picks)."
    ),
    replica: list[str] | None = typer.Option(
        None, "--replica", "-r", help="Replica URL (repeatable); without --config."
    ),
    policy: str | None = typer.Option(
        None, "--policy", help="Scheduling policy (default: the file's, else equal_cost)."
    ),
    gpu: str = typer.Option("a100-80g", "--gpu", "-g", help="GPU of --replica replicas."),
    tp: int = typer.Option(
        1, "--tp", callback=checked(AT_LEAST_ONE), help="Tensor parallelism of --replica replicas."
    ),
    cost_model: str | None = typer.Option(
        None, "--cost-model", help="Catalog model for --replica replicas (default: served name)."
    ),
    admin_token_env: str | None = typer.Option(
        None, "--admin-token-env", help="Env variable holding the admin token (--replica mode)."
    ),
    state_bus: str | None = typer.Option(
        None,
        "--state-bus",
        help="redis://host:port or nats://host:port shared with the other gateways.",
    ),
    catalog: CatalogOption = None,
    discover_timeout: float = typer.Option(
        30.0, "--discover-timeout", callback=checked(POSITIVE), help="Seconds."
    ),
    log_level: LogLevelOption = "info",
    shutdown_timeout: float = typer.Option(
        10.0,
        "--shutdown-timeout",
        callback=checked(POSITIVE),
        help="SIGTERM: seconds in-flight requests get to finish.",
    ),
    workers: int = typer.Option(
        1, "--workers", help="Processes sharing the port (SO_REUSEPORT) and their state."
    ),
    worker_id: int | None = typer.Option(None, "--worker-id", hidden=True),
    worker_dir: str | None = typer.Option(None, "--worker-dir", hidden=True),
    worker_bus: str | None = typer.Option(None, "--worker-bus", hidden=True),
    record: str | None = typer.Option(
        None, "--record", help="Record traffic and fleet to this directory (isocost sim replays)."
    ),
    record_segment_mb: float = typer.Option(
        64.0,
        "--record-segment-mb",
        callback=checked(POSITIVE),
        help="With --record: a new trace segment past this size.",
    ),
    record_max_mb: float = typer.Option(
        1024.0,
        "--record-max-mb",
        callback=checked(POSITIVE),
        help="With --record: oldest segments go past this total.",
    ),
) -> None:
    """Run the OpenAI-compatible gateway that routes by equal cost."""
    import asyncio
    import os
    from pathlib import Path

    import msgspec

    from isocost.files import load_catalog, read_text
    from isocost.gateway.recording import RecordingSettings
    from isocost.gateway.server import (
        configure_logging,
        discover_config,
        load_gateway,
        run_gateway,
    )
    from isocost.gateway.workers import WorkerGroup, run_workers, worker_args
    from isocost.runtime.bus_transport import LOCAL_SCHEME
    from isocost.runtime.config import StateBusConfig, check_state_bus, parse_config
    from isocost.runtime.recording import usable_directory

    if (config is None) == (not replica):
        fail("give either --config FILE or one or more --replica URL")
    if workers < 1:
        fail("--workers must be at least 1")
    if (worker_id is None) != (worker_dir is None):
        fail("--worker-id and --worker-dir go together (the supervisor of --workers sets them)")
    if record_segment_mb > record_max_mb:
        fail("--record-segment-mb must be at most --record-max-mb")
    if record and workers > 1:
        fail("--record with --workers: not supported (the workers would share one trace)")
    if record:
        try:
            usable_directory(Path(record))
        except ValueError as exc:
            fail(f"--record: {exc}")
    if state_bus is not None:
        check_state_bus(StateBusConfig(url=state_bus), "--state-bus")
    if admin_token_env is not None and not os.environ.get(admin_token_env):
        fail(f"--admin-token-env: environment variable {admin_token_env} unset")
    listening = Listening(host, port)
    listening.probe(reuse_port=workers > 1 or worker_id is not None)
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
                tp=tp,
                cost_model=cost_model,
                catalog=cat,
                admin_token_env=admin_token_env,
                timeout_s=discover_timeout,
            )
        )
    if state_bus is not None:  # overrides the file's url, keeps its other bus settings
        bus = gateway_config.state_bus or StateBusConfig(url=state_bus)
        bus = msgspec.structs.replace(bus, url=state_bus)
        gateway_config = msgspec.structs.replace(gateway_config, state_bus=bus)
    if worker_bus is not None:  # the supervisor's hub, when no bus is configured
        bus = StateBusConfig(url=f"{LOCAL_SCHEME}://{worker_bus}")
        gateway_config = msgspec.structs.replace(gateway_config, state_bus=bus)
    configure_logging(log_level)

    def ready(url: str) -> None:
        listening.ready = True
        console.print(f"isocost serve: ready at {url}", highlight=False, soft_wrap=True)
        sys.stdout.flush()

    config_path = Path(config) if config else None
    if workers > 1 and worker_id is None:  # the supervisor: checks the config, as each worker
        load_gateway(gateway_config, cat, config_path)  # unknown policies, models: exit 2
        serve_args = sys.argv[sys.argv.index("serve") + 1 :]
        local_bus = gateway_config.state_bus is None  # then the workers share through its hub
        sys.exit(
            run_workers(
                worker_args(serve_args), workers, host, port, ready, shutdown_timeout, local_bus
            )
        )
    recording = RecordingSettings(
        Path(record) if record else None,
        segment_bytes=int(record_segment_mb * 2**20),
        max_bytes=int(record_max_mb * 2**20),
    )
    gateway = load_gateway(gateway_config, cat, config_path, recording)
    group = None if worker_dir is None else WorkerGroup(worker_id or 0, Path(worker_dir))
    with listening:
        run_gateway(gateway, host, port, ready, shutdown_timeout_s=shutdown_timeout, workers=group)
