"""From ``isocost engine`` flags to serving replicas: validation, specs, ports."""

from __future__ import annotations

from collections.abc import Callable

from isocost.core.costmodel import EngineLimits
from isocost.core.errors import ConfigError
from isocost.core.links import LINK_KINDS
from isocost.engine.config import ROLES, EngineReplicaConfig, resolve_replicas
from isocost.engine.replica import OUTPUT_DISTRIBUTIONS, ServedReplica, ServeOptions
from isocost.engine.server import run_engine
from isocost.files import load_catalog, read_text

__all__ = ["launch"]


def launch(
    *,
    default: EngineReplicaConfig,
    replicas: int,
    spec_strings: list[str],
    replicas_file: str | None,
    port: int,
    catalog_paths: list[str],
    limits: EngineLimits,
    options: ServeOptions,
    on_ready: Callable[[list[tuple[ServedReplica, str]]], None],
) -> None:
    """Serve the replicas on ``port``, ``port + 1``, ... (all OS-chosen when ``port`` is
    0) until SIGINT/SIGTERM. Bad flags raise ``ConfigError`` before any port opens."""
    checks = (
        ("--time-scale", options.time_scale > 0, "must be > 0"),
        ("--stream-interval", options.stream_interval >= 1, "must be >= 1"),
        ("--replicas", replicas >= 1, "must be >= 1"),
        ("--tp", default.tp >= 1, "must be >= 1"),
        ("--port", 0 <= port <= 65535, "must be a TCP port"),
        ("--output-dist", options.output_dist in OUTPUT_DISTRIBUTIONS, "unknown distribution"),
        ("--output-mean-tokens", options.output_mean_tokens >= 1, "must be >= 1"),
        ("--role", default.role in ROLES, f"must be one of {', '.join(ROLES)}"),
        ("--link", default.link in LINK_KINDS, f"must be one of {', '.join(LINK_KINDS)}"),
        ("--kv-hold-timeout", options.kv_hold_timeout_s > 0, "must be > 0"),
        ("--read-timeout", options.read_timeout_s > 0, "must be > 0"),
    )
    for flag, ok, message in checks:
        if not ok:
            raise ConfigError(flag, message)
    problem = default.faults.problem()
    if problem:
        raise ConfigError(f"--{problem[0].replace('_', '-')}", problem[1])
    file_text = read_text(replicas_file) if replicas_file else None
    specs = resolve_replicas(default, replicas, spec_strings, file_text, replicas_file or "")
    if port and port + len(specs) - 1 > 65535:
        raise ConfigError("--port", f"{len(specs)} replicas from port {port} overflow 65535")
    events = options.kv_events_port
    if events is not None and not 1 <= events <= 65536 - len(specs):
        raise ConfigError(
            "--kv-events-port", f"must leave a TCP port for each of {len(specs)} replicas"
        )
    ports = [port + i if port else 0 for i in range(len(specs))]
    run_engine(specs, load_catalog(catalog_paths), limits, options, ports, on_ready)
