"""``isocost agent``: register one engine in etcd under a lease, drain it on SIGTERM."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import typer

from isocost.cli._app import app, console, fail
from isocost.cli._options import CatalogOption, LogLevelOption, checked
from isocost.core.bounds import NON_NEGATIVE, POSITIVE, SHARE
from isocost.serving import stop_requested

if TYPE_CHECKING:
    from isocost.core.errors import ConfigError

# The flag that sets each field of the record, where it is not ``--<field>``.
_FLAG_OF = {"url": "--advertise", "models": "the engine's served model"}


def _names(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def _refused(exc: ConfigError) -> str:
    """Why gateways would refuse the record, named by the flag that sets the field."""
    field = (exc.key or "").rpartition(".")[2]
    reason = str(exc).removeprefix(f"{exc.source}: {exc.key}: ")
    return f"{_FLAG_OF.get(field, '--' + field.replace('_', '-'))}: {reason}"


@app.command()
def agent(
    engine: str = typer.Option(
        ..., "--engine", help="The engine's URL, e.g. http://127.0.0.1:8000."
    ),
    etcd: str = typer.Option(..., "--etcd", help="etcd endpoint URL(s), comma-separated."),
    etcd_ca_file: str | None = typer.Option(
        None, "--etcd-ca-file", help="https:// etcd: the CA its certificate chains to."
    ),
    etcd_cert_file: str | None = typer.Option(
        None, "--etcd-cert-file", help="A client certificate, where etcd requires one."
    ),
    etcd_key_file: str | None = typer.Option(
        None, "--etcd-key-file", help="Its key (default: in --etcd-cert-file)."
    ),
    name: str | None = typer.Option(None, "--name", help="Replica name (default: host:port)."),
    advertise: str | None = typer.Option(
        None, "--advertise", help="URL gateways use (default: --engine)."
    ),
    gpu: str = typer.Option("a100-80g", "--gpu", help="GPU catalog id."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel GPUs."),
    groups: str | None = typer.Option(None, "--groups", help="Route groups, comma-separated."),
    weight: float = typer.Option(1.0, "--weight", help="Relative capacity share, > 0."),
    usd_per_hour: float | None = typer.Option(None, "--usd-per-hour", help="Price per hour."),
    cost_model: str | None = typer.Option(
        None, "--cost-model", help="Catalog model (default: the served model name)."
    ),
    ttl: int = typer.Option(
        10, "--ttl", help="Lease TTL in seconds, 1 to 3600 (renewed every TTL/3)."
    ),
    prefix: str = typer.Option("/isocost", "--prefix", help="etcd key prefix."),
    warmup_prompt: str | None = typer.Option(
        None, "--warmup-prompt", help="One completion before registering."
    ),
    drain_timeout: float = typer.Option(
        60.0, "--drain-timeout", callback=checked(NON_NEGATIVE), help="Seconds, on SIGTERM."
    ),
    health_window: float = typer.Option(
        30.0,
        "--health-window",
        callback=checked(POSITIVE),
        help="Seconds the success rate must stay bad to drain.",
    ),
    min_success_rate: float = typer.Option(
        0.5, "--min-success-rate", callback=checked(SHARE), help="Within [0, 1]."
    ),
    catalog: CatalogOption = None,
    log_level: LogLevelOption = "info",
) -> None:
    """Register an engine in etcd under a lease.

    SIGTERM marks it draining, waits for the engine to go idle, then deregisters. The
    record is checked as the gateways check it (give them the same --catalog) before it is
    registered: a record they would refuse is one line and exit 2, not a registration.
    """
    import asyncio
    from urllib.parse import urlsplit

    from isocost.agent.registrar import MAX_TTL_S, Agent, AgentSettings
    from isocost.core.errors import ConfigError
    from isocost.files import load_catalog
    from isocost.runtime.config import GENERIC_PRIOR_MODEL, TlsConfig, normalize_replica_url
    from isocost.runtime.discovery.records import Registration, check_registration
    from isocost.runtime.etcd import EtcdRefused
    from isocost.runtime.logs import configure_logging
    from isocost.runtime.tls import client_ssl

    try:
        engine_url = normalize_replica_url(engine)
        advertise_url = normalize_replica_url(advertise or engine)
        endpoints = [normalize_replica_url(e) for e in _names(etcd)]
    except ValueError as exc:
        fail(str(exc))
    if not endpoints:
        fail("--etcd: give at least one endpoint URL")
    try:
        etcd_tls = client_ssl(
            TlsConfig(etcd_ca_file, etcd_cert_file, etcd_key_file),
            "isocost agent",
            lambda field: "--etcd-" + field.replace("_", "-"),
        )
    except ConfigError as exc:
        fail(str(exc))
    checks = [
        (ttl >= 1, "--ttl must be >= 1"),
        (ttl <= MAX_TTL_S, f"--ttl must be <= {MAX_TTL_S}"),
        (prefix.startswith("/"), "--prefix must start with /"),
    ]
    for ok, message in checks:
        if not ok:
            fail(message)
    parts = urlsplit(advertise_url)
    settings = AgentSettings(
        engine_url=engine_url,
        advertise_url=advertise_url,
        name=f"{parts.hostname}:{parts.port}" if name is None else name,
        etcd=endpoints,
        etcd_tls=etcd_tls,
        gpu=gpu,
        tp=tp,
        groups=_names(groups),
        weight=weight,
        usd_per_hour=usd_per_hour,
        cost_model=cost_model,
        ttl_s=ttl,
        prefix=prefix,
        warmup_prompt=warmup_prompt,
        drain_timeout_s=drain_timeout,
        health_window_s=health_window,
        min_success_rate=min_success_rate,
    )
    try:
        cat = load_catalog(catalog or [])
    except ConfigError as exc:
        fail(str(exc))
    try:  # what the engine does not decide, now; its served model once it names one
        check_registration(settings.record([GENERIC_PRIOR_MODEL]), cat)
    except ConfigError as exc:
        fail(_refused(exc))
    configure_logging(log_level)

    def registered(record: Registration) -> None:
        console.print(
            f"isocost agent: {record.name} ({record.engine}, release {record.release})"
            f" registered, ready at {record.url}",
            highlight=False,
            soft_wrap=True,
        )
        sys.stdout.flush()

    async def main() -> None:
        await Agent(settings, cat, registered).run(stop_requested())

    try:
        asyncio.run(main())
    except ConfigError as exc:  # the served model, as no gateway would take it
        fail(_refused(exc))
    except EtcdRefused as exc:
        fail(f"etcd refused the request, not retried: {exc}")
