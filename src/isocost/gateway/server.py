"""Running ``isocost serve``: discovery without a file, JSON logs, the uvloop server loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import msgspec
from aiohttp import web

from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError, IsocostError
from isocost.gateway.app import Gateway, build_app
from isocost.gateway.config import (
    AuthConfig,
    GatewayConfig,
    PoolConfig,
    ReplicaConfig,
    normalize_replica_url,
)

__all__ = ["configure_logging", "discover_config", "load_gateway", "run_gateway"]

log = logging.getLogger("isocost.gateway")

_STANDARD_ATTRS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, message and the record's extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS:
                entry[key] = value
        return json.dumps(entry, default=str)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter())
    log.handlers[:] = [handler]
    log.setLevel(level.upper())
    log.propagate = False


class _ModelList(msgspec.Struct):
    class _Model(msgspec.Struct):
        id: str

    data: list[_Model]


async def _served_model(session: aiohttp.ClientSession, url: str, deadline: float) -> str:
    while True:
        try:
            async with session.get(url + "/v1/models") as resp:
                if resp.status == 200:
                    models = msgspec.json.decode(await resp.read(), type=_ModelList).data
                    if models:
                        return models[0].id
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError):
            pass
        if time.monotonic() >= deadline:
            raise ConfigError(url, "no answer with a model from GET /v1/models")
        await asyncio.sleep(0.2)


async def discover_config(
    urls: list[str],
    *,
    policy: str,
    gpu: str,
    tensor_parallel: int,
    cost_model: str | None,
    catalog: Catalog,
    admin_token_env: str | None,
    timeout_s: float,
) -> GatewayConfig:
    """A config with one pool per served model, read from each replica's ``/v1/models``."""
    normalized = []
    for url in urls:
        try:
            normalized.append(normalize_replica_url(url))
        except ValueError as exc:
            raise ConfigError("--replica", str(exc)) from None
    deadline = time.monotonic() + timeout_s
    timeout = aiohttp.ClientTimeout(total=2.0)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        models = await asyncio.gather(*(_served_model(session, u, deadline) for u in normalized))
    pools: dict[str, list[ReplicaConfig]] = {}
    for url, model in zip(normalized, models, strict=True):
        spec_model = cost_model or (model if model.lower() in catalog.models else None)
        if spec_model is None:
            raise ConfigError(
                url, f"serves {model!r}, which is not in the catalog; pass --cost-model"
            )
        pools.setdefault(model, []).append(
            ReplicaConfig(url=url, gpu=gpu, cost_model=spec_model, tensor_parallel=tensor_parallel)
        )
    return GatewayConfig(
        pools=[PoolConfig(model=m, replicas=r) for m, r in pools.items()],
        policy=policy,
        auth=AuthConfig(admin_token_env=admin_token_env),
    )


def run_gateway(
    gateway: Gateway,
    host: str,
    port: int,
    on_ready: Callable[[str], None],
    shutdown_timeout_s: float = 10.0,
) -> None:
    """Serve until SIGINT/SIGTERM; in-flight requests get ``shutdown_timeout_s`` to finish."""
    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is not available on Windows
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve(gateway, host, port, on_ready, shutdown_timeout_s))


async def _serve(
    gateway: Gateway,
    host: str,
    port: int,
    on_ready: Callable[[str], None],
    shutdown_timeout_s: float,
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(
        build_app(gateway),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=shutdown_timeout_s,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, backlog=1024)
        await site.start()
        bound = runner.addresses[0][1]
        on_ready(f"http://{host}:{bound}")
        await stop.wait()
    finally:
        with contextlib.suppress(IsocostError):
            await runner.cleanup()


def load_gateway(config: GatewayConfig, catalog: Catalog, config_path: Path | None) -> Gateway:
    """A gateway for ``config``; unknown policies or cost models fail before any port opens."""
    gateway = Gateway(config, catalog, config_path)
    gateway.router.check_config(config)
    return gateway
