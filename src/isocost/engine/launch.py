"""From ``isocost engine`` flags to serving replicas: validation, specs, ports."""

from __future__ import annotations

from collections.abc import Callable

from isocost.core.bounds import AT_LEAST_ONE, FRACTION, POSITIVE, Bounds
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
    numbers = (
        ("--time-scale", options.time_scale, POSITIVE),
        ("--stream-interval", options.stream_interval, AT_LEAST_ONE),
        ("--replicas", replicas, AT_LEAST_ONE),
        ("--tp", default.tp, AT_LEAST_ONE),
        ("--port", port, Bounds(0, 65535)),
        ("--output-mean-tokens", options.output_mean_tokens, AT_LEAST_ONE),
        ("--write-timeout", options.write_timeout_s, Bounds(0.001)),
        ("--kv-hold-timeout", options.kv_hold_timeout_s, POSITIVE),
        ("--read-timeout", options.read_timeout_s, POSITIVE),
        # a step admits no request without a sequence slot and a token to spend: each hangs
        ("--max-num-seqs", limits.max_num_seqs, AT_LEAST_ONE),
        ("--max-num-batched-tokens", limits.max_num_batched_tokens, AT_LEAST_ONE),
        ("--gpu-memory-utilization", limits.gpu_memory_utilization, FRACTION),
        ("--num-gpu-blocks-override", default.num_gpu_blocks, AT_LEAST_ONE),
    )
    for flag, value, bounds in numbers:
        if value is not None and (wrong := bounds.problem(value)) is not None:
            raise ConfigError(flag, wrong)
    names = (
        ("--output-dist", options.output_dist in OUTPUT_DISTRIBUTIONS, "unknown distribution"),
        ("--role", default.role in ROLES, f"must be one of {', '.join(ROLES)}"),
        ("--link", default.link in LINK_KINDS, f"must be one of {', '.join(LINK_KINDS)}"),
    )
    for flag, ok, message in names:
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
