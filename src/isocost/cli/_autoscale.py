"""``isocost autoscale``: control/'s decisions applied to a live gateway's fleet."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

import typer

from isocost.cli._app import app, console, fail
from isocost.cli._listening import Listening
from isocost.cli._options import LogLevelOption, checked
from isocost.cli._outputs import check_outputs
from isocost.core.bounds import POSITIVE, Bounds

_LIVE_ACTUATORS = ("local", "command", "kubernetes")
_DEFAULT_CAPACITY_RPS = 2.0  # without --plan or --capacity-rps


@app.command()
def autoscale(
    gateways: list[str] = typer.Option(
        ...,
        "--gateway",
        help="A gateway's URL; repeat for each gateway in front of the fleet (read summed,"
        " drained on all).",
    ),
    resolve_gateways: bool = typer.Option(
        False,
        "--resolve-gateways",
        help="Read every address each --gateway name resolves to, resolved again each"
        " interval (a Kubernetes headless Service: every gateway Pod).",
    ),
    config_path: Path = typer.Option(..., "--config", help="Autoscale YAML (as sim --autoscale)."),
    actuator_name: str | None = typer.Option(
        None, "--actuator", help="local|command|kubernetes (default: the config's)."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print decisions, change nothing."),
    admin_token_env: str = typer.Option(
        "ISOCOST_ADMIN_TOKEN", "--admin-token-env", help="Env var holding the admin token."
    ),
    plan_path: Path | None = typer.Option(
        None, "--plan", help="`isocost plan --json` output: each pool's capacity per replica."
    ),
    capacity_rps: float | None = typer.Option(
        None,
        "--capacity-rps",
        callback=checked(POSITIVE),
        help="Requests/s one replica sustains (overrides --plan; 2).",
    ),
    model: str | None = typer.Option(
        None, "--model", help="local: the pool to grow (default: the gateway's only one)."
    ),
    engine_arg: list[str] = typer.Option(
        [], "--engine-arg", help="local: one more `isocost engine` argument (repeatable)."
    ),
    log_dir: Path = typer.Option(
        Path("autoscale-logs"), "--log-dir", help="local: the engines' log files."
    ),
    scale_command: str | None = typer.Option(
        None,
        "--scale-command",
        help="command: run with the desired count appended; a stop's victim in"
        " ISOCOST_STOP_REPLICA.",
    ),
    deployment: str | None = typer.Option(
        None, "--deployment", help="kubernetes: the Deployment (-<gpu> with several pools)."
    ),
    namespace: str = typer.Option("default", "--namespace", help="kubernetes: its namespace."),
    kubeconfig: str | None = typer.Option(
        None, "--kubeconfig", help="kubernetes: kubeconfig file (default: in-cluster)."
    ),
    metrics_port: int | None = typer.Option(
        None,
        "--metrics-port",
        callback=checked(Bounds(1, 65535)),
        help="Serve the autoscaler's Prometheus metrics here.",
    ),
    metrics_host: str = typer.Option(
        "127.0.0.1",
        "--metrics-host",
        help="The address --metrics-port listens on (0.0.0.0: all, as in a Pod).",
    ),
    log_level: LogLevelOption = "info",
) -> None:
    """Scale replicas ahead of demand; drain on scale-in."""
    import asyncio
    import time

    import aiohttp
    from prometheus_client import start_http_server

    from isocost.autoscale import (
        Actuator,
        AdminClient,
        AutoscaleLoop,
        CommandActuator,
        GatewayAddresses,
        GatewaySet,
        KubernetesActuator,
        LocalActuator,
        LoopMetrics,
        Tick,
        offers_from_plan,
        read_snapshot,
    )
    from isocost.control import Autoscaler, PoolOffer
    from isocost.core.catalog import Catalog
    from isocost.runtime.logs import configure_logging
    from isocost.serving import run_serving, stop_requested
    from isocost.sim import parse_autoscale_yaml

    try:
        text = config_path.read_text()
    except OSError as exc:
        fail(f"--config {config_path}: {exc.strerror}")
    except UnicodeDecodeError:
        fail(f"--config {config_path}: not UTF-8 text")
    for gateway in gateways:
        url = urlsplit(gateway)
        if url.scheme not in ("http", "https") or not url.hostname:
            fail(f"--gateway {gateway}: not an http(s):// URL")
        try:
            url.port  # noqa: B018 (checked: it raises for a port that is no port)
        except ValueError:
            fail(f"--gateway {gateway}: its port is not a port number (0-65535)")
    if len({g.rstrip("/") for g in gateways}) < len(gateways):
        fail("--gateway: a gateway named twice (its arrivals would count twice)")
    config = parse_autoscale_yaml(text, str(config_path))
    name = actuator_name or config.actuator
    token = os.environ.get(admin_token_env)
    checks = [
        (name in _LIVE_ACTUATORS, f"--actuator {name}: valid: {', '.join(_LIVE_ACTUATORS)}"),
        (name != "command" or bool(scale_command), "--actuator command needs --scale-command"),
        (name != "kubernetes" or bool(deployment), "--actuator kubernetes needs --deployment"),
        (bool(token), f"--admin-token-env: environment variable {admin_token_env} unset"),
    ]
    for ok, message in checks:
        if not ok:
            fail(message)
    if name == "local":
        check_outputs(folders={"--log-dir": str(log_dir)})
    if plan_path is not None:
        try:
            plan_text = plan_path.read_text()
        except OSError as exc:
            fail(f"--plan {plan_path}: {exc.strerror}")
        except UnicodeDecodeError:
            fail(f"--plan {plan_path}: not UTF-8 text")
        offers = offers_from_plan(plan_text, f"--plan {plan_path}", config.pools)
    else:
        catalog = Catalog.builtin()
        offers = [
            PoolOffer(p.gpu, 1, catalog.gpu(p.gpu).usd_per_hour, _DEFAULT_CAPACITY_RPS)
            for p in config.pools
        ]
    if capacity_rps is not None:
        offers = [dataclasses.replace(o, capacity_rps=capacity_rps) for o in offers]
    configure_logging(log_level)
    metrics = LoopMetrics()
    if metrics_port is not None:
        with Listening(metrics_host, metrics_port):
            start_http_server(metrics_port, metrics_host, registry=metrics.registry)

    async def pool_model(admin: GatewaySet) -> str:
        if model is not None:
            return model
        pools = [pool.model for pool in read_snapshot(await admin.snapshot()).pools]
        if len(pools) != 1:
            fail(f"--model: the gateway serves {len(pools)} pools; name one")
        return pools[0]

    async def make_actuator(admin: GatewaySet) -> Actuator:
        if name == "local":
            return LocalActuator(admin, await pool_model(admin), log_dir, engine_arg)
        if name == "command":
            assert scale_command is not None
            return CommandActuator(scale_command)
        assert deployment is not None
        gpus = [p.gpu for p in config.pools]
        names = {g: deployment if len(gpus) == 1 else f"{deployment}-{g}" for g in gpus}
        return KubernetesActuator(admin, names, namespace, kubeconfig)

    async def main() -> None:
        stop = stop_requested()
        assert token is not None
        admin_token = token
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            def client(url: str, host: str | None) -> AdminClient:
                return AdminClient(session, url, admin_token, host)

            following: asyncio.Task[None] | None = None
            if resolve_gateways:
                addresses = GatewayAddresses(gateways, client)
                admin = GatewaySet(await addresses.resolve())
                following = asyncio.create_task(addresses.follow(admin, config.interval_s))
            else:
                admin = GatewaySet([client(g, None) for g in gateways])
            actuator = await make_actuator(admin)
            runner = AutoscaleLoop(
                Autoscaler(config, offers),
                config,
                offers,
                admin,
                actuator,
                clock=time.time,
                metrics=metrics,
                dry_run=dry_run,
            )
            shown = 0

            def show(tick: Tick) -> None:
                nonlocal shown
                for gpu, lead in runner.leads[shown:]:
                    console.print(
                        f"lead: a {gpu} replica was routable {lead:.2f} s after its start"
                    )
                shown = len(runner.leads)
                d = tick.decision
                actions = [f"start {n} {g}" for g, n in d.start.items()]
                actions += [f"undrain {r}" for r in d.undrain] + [f"drain {r}" for r in d.drain]
                console.print(
                    f"{'dry-run ' if dry_run else ''}{d.reason}: desired"
                    f" {sum(d.targets.values())} ready {tick.count('ready')}"
                    f" pending {tick.count('pending')} draining {tick.count('draining')}"
                    f" forecast {d.forecast_rps:.2f} rps ${tick.usd:.4f}"
                    + (f" -> {', '.join(actions)}" if actions else ""),
                    highlight=False,
                    soft_wrap=True,
                )
                sys.stdout.flush()

            try:
                await runner.run(stop, show)
            finally:
                if following is not None:
                    following.cancel()
                await actuator.close()

    run_serving(main())
