"""``isocost picker``: the gateway's brain as an Envoy ext_proc / GAIE endpoint picker."""

from __future__ import annotations

import sys

import typer

from isocost.cli._app import app, console, fail
from isocost.cli._options import CatalogOption, LogLevelOption, checked
from isocost.core.bounds import NON_NEGATIVE, POSITIVE


@app.command()
def picker(
    config: str = typer.Option(
        ..., "--config", "-c", help="Gateway YAML (pools, discovery, limits); hot-reloaded."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(9002, "--port", help="gRPC port (0: OS picks)."),
    metrics_port: int | None = typer.Option(
        None, "--metrics-port", help="Serve Prometheus GET /metrics on this port too."
    ),
    fallbacks: int = typer.Option(
        2,
        "--fallbacks",
        callback=checked(NON_NEGATIVE),
        help="Replicas named after the choice, for the data plane's retries (0: one).",
    ),
    relay: str | None = typer.Option(
        None,
        "--relay",
        help="isocost-extproc-relay binary (`make relay`): it speaks gRPC to Envoy.",
    ),
    catalog: CatalogOption = None,
    log_level: LogLevelOption = "info",
    shutdown_timeout: float = typer.Option(
        10.0,
        "--shutdown-timeout",
        callback=checked(POSITIVE),
        help="SIGTERM: seconds open streams get to finish.",
    ),
) -> None:
    """Pick replicas for Envoy: a GAIE endpoint picker over ext_proc."""
    import os
    from pathlib import Path

    # gRPC's C core logs to stderr on its own; the CLI reports errors itself, in one line.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")

    from isocost.files import load_catalog, read_text
    from isocost.gateway.picking import GatewayPicker
    from isocost.gateway.server import configure_logging, load_gateway
    from isocost.picker.server import run_picker
    from isocost.runtime.config import parse_config

    for name, value in (("--port", port), ("--metrics-port", metrics_port)):
        if value is not None and not 0 <= value <= 65535:
            fail(f"{name} must be between 0 and 65535")
    relay_binary = None if relay is None else Path(relay)
    if relay_binary is not None and not os.access(relay_binary, os.X_OK):
        fail(f"--relay {relay}: no executable there (build it: make relay)")
    cat = load_catalog(catalog or [])
    gateway_config = parse_config(read_text(config), config)
    configure_logging(log_level)
    gateway = load_gateway(gateway_config, cat, Path(config))
    if metrics_port is not None:  # the gateway's own metrics, from a thread of their own
        from prometheus_client import start_http_server

        try:
            start_http_server(metrics_port, addr=host, registry=gateway.metrics.registry)
        except OSError as exc:
            fail(f"--metrics-port {metrics_port}: {exc.strerror or exc}")

    def ready(address: str) -> None:
        console.print(f"isocost picker: ready at {address}", highlight=False, soft_wrap=True)
        sys.stdout.flush()

    run_picker(
        GatewayPicker(gateway, fallbacks),
        host,
        port,
        ready,
        shutdown_timeout_s=shutdown_timeout,
        relay=relay_binary,
    )
