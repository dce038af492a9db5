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
from typing import cast

import aiohttp
import msgspec
from aiohttp import HttpVersion11, web
from aiohttp.web_protocol import RequestHandler

from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError, IsocostError
from isocost.gateway.app import build_app
from isocost.gateway.lifecycle import Gateway
from isocost.runtime.config import (
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
    tp: int,
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
            ReplicaConfig(url=url, gpu=gpu, cost_model=spec_model, tp=tp)
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
    handler_factory = runner.server
    assert handler_factory is not None

    def protocol() -> asyncio.Protocol:
        deadline_s = gateway.config.limits.body_timeout_ms / 1000
        return _HeaderDeadline(handler_factory(), deadline_s)

    listener = await loop.create_server(protocol, host, port, backlog=1024)
    try:
        bound = listener.sockets[0].getsockname()[1]
        on_ready(f"http://{host}:{bound}")
        await stop.wait()
    finally:
        listener.close()
        with contextlib.suppress(IsocostError):
            await runner.cleanup()


_PROBE_S = 0.5  # how often a half-closed client is checked while its answer is prepared
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _HeaderDeadline(asyncio.Protocol):
    """aiohttp's request handler, plus a deadline for a connection's first request head.

    aiohttp bounds neither the time to send request headers nor the time before the first
    byte, so a client trickling headers (slowloris) would hold a connection forever. The
    connection is answered 408 and closed unless the blank line ending the first request's
    headers arrives within ``deadline_s`` (``limits.body_timeout_ms``); later requests on a
    kept-alive connection are bounded by aiohttp's keep-alive timeout between requests.
    """

    def __init__(self, inner: RequestHandler, deadline_s: float) -> None:
        self._inner = inner
        self._deadline_s = deadline_s
        self._timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None
        self._tail = b""
        self._received = False  # any bytes yet: an EOF before them closes at once
        self._probe: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self._timer = asyncio.get_running_loop().call_later(self._deadline_s, self._expire)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._received = True
        if self._timer is not None:
            self._tail = (self._tail + data)[-(len(data) + 3) :]
            if b"\r\n\r\n" in self._tail:
                self._timer.cancel()
                self._timer = None
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        """The client closed its sending side: it half-closed after its request
        (``shutdown(SHUT_WR)``), or it left. aiohttp's handler lets the transport close
        then, so a half-closing client got no answer. While a request is in hand the
        connection now stays open for the answer (and closes after it), and
        ``_probe_client`` finds out whether the client is still there."""
        handler = self._inner
        handler.eof_received()
        waiting_for_a_request = handler._waiter is not None and not handler._messages
        if waiting_for_a_request or not self._received:
            return None  # idle: nothing to answer, close
        handler.close()  # no request can follow: close once this one is answered
        self._probe = asyncio.get_running_loop().call_later(_PROBE_S, self._probe_client)
        return True

    def _probe_client(self) -> None:
        """Until the answer begins, an interim ``100 Continue`` every ``_PROBE_S`` (the
        one thing HTTP/1.1 lets a server send first; clients skip it). Only a write tells
        a half-closed client from one that left: that one answers with a reset, the next
        write fails, and aiohttp cancels the request, as when the connection drops."""
        self._probe = None
        transport, request = self._transport, self._inner._current_request
        if transport is None or transport.is_closing():
            return
        if request is not None:
            if request.writer.output_size or request.version < HttpVersion11:
                return  # the answer has begun (its writes tell), or HTTP/1.0: no 1xx
            transport.write(_CONTINUE)
        self._probe = asyncio.get_running_loop().call_later(_PROBE_S, self._probe_client)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def _expire(self) -> None:
        self._timer = None
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(
                b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
            )
            self._transport.close()


def load_gateway(config: GatewayConfig, catalog: Catalog, config_path: Path | None) -> Gateway:
    """A gateway for ``config``; unknown policies or cost models fail before any port opens."""
    gateway = Gateway(config, catalog, config_path)
    gateway.router.check_config(config)
    return gateway
