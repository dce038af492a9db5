"""Running ``isocost serve``: discovery without a file, JSON logs, the uvloop server loop.

Shutdown (SIGTERM or SIGINT) is graceful: readiness fails first (``GET /health`` answers
503 ``draining``), the listening socket closes (no new connections; idle keep-alive ones
close), the requests in flight get ``shutdown_timeout_s`` to finish (streams included),
then the process exits 0; a request still running at the deadline is cancelled. SIGHUP
reloads the config file at once (it is also watched), as nginx does; it never stops.

The HTTP server's own guards: a deadline for the headers of every request of a
connection (``limits.body_timeout_ms``), a keep-alive timeout between requests
(``limits.keepalive_timeout_ms``, read at start), the soft fd limit raised to the hard one
(each connection is a socket), no replica that is the gateway's own address, and an
answer for a client that half-closed after its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import cast

import aiohttp
import msgspec
from aiohttp import HttpVersion11, web
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestHandler

from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError, IsocostError
from isocost.core.jsontext import UNDECODABLE
from isocost.gateway.app import build_app
from isocost.gateway.lifecycle import Gateway
from isocost.gateway.recording import RecordingSettings
from isocost.gateway.workers import WorkerGroup, watch_supervisor
from isocost.openai.http import JsonErrorHandler
from isocost.runtime.config import (
    AuthConfig,
    GatewayConfig,
    PoolConfig,
    ReplicaConfig,
    normalize_replica_url,
)
from isocost.runtime.logs import configure_logging
from isocost.serving import run_serving, stop_requested

__all__ = ["configure_logging", "discover_config", "load_gateway", "run_gateway"]

log = logging.getLogger("isocost.gateway")


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
        except (aiohttp.ClientError, TimeoutError, *UNDECODABLE):
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
    normalized: list[str] = []
    for url in urls:
        try:
            normalized.append(normalize_replica_url(url))
        except ValueError as exc:
            raise ConfigError("--replica", str(exc)) from None
        if normalized[-1] in normalized[:-1]:  # as a config file listing it twice is refused
            raise ConfigError("--replica", f"replica {normalized[-1]} is given twice")
    deadline = time.monotonic() + timeout_s
    timeout = aiohttp.ClientTimeout(total=2.0)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        models = await asyncio.gather(*(_served_model(session, u, deadline) for u in normalized))
    pools: dict[str, list[ReplicaConfig]] = {}
    for url, model in zip(normalized, models, strict=True):
        pools.setdefault(model, []).append(
            ReplicaConfig(url=url, gpu=gpu, cost_model=cost_model, tp=tp)
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
    workers: WorkerGroup | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM, then drain: in-flight requests get
    ``shutdown_timeout_s`` to finish (SIGHUP reloads the config file). As one of
    ``--workers`` (``workers``) it shares the port and listens on a private one for its
    siblings (``gateway.workers``)."""
    run_serving(_serve(gateway, host, port, on_ready, shutdown_timeout_s, workers))


async def _serve(
    gateway: Gateway,
    host: str,
    port: int,
    on_ready: Callable[[str], None],
    shutdown_timeout_s: float,
    workers: WorkerGroup | None,
) -> None:
    stop = stop_requested(hangup=gateway.reload_requested)
    loop = asyncio.get_running_loop()
    raise_fd_limit()
    source = str(gateway.config_path or "--replica")
    if port:  # known before binding: refuse a config that lists this gateway itself
        gateway.intake.listen.set(host, port)
        gateway.intake.listen.check_config(gateway.config, source)
    connections: dict[asyncio.BaseProtocol, _HeaderDeadline] = {}
    app = build_app(gateway)
    app.middlewares.append(_request_phases(connections))
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout_s
    )
    await runner.setup()
    server = runner.server
    assert server is not None
    keepalive_s = gateway.config.limits.keepalive_timeout_ms / 1000

    def protocol() -> asyncio.Protocol:
        deadline_s = gateway.config.limits.body_timeout_ms / 1000
        handler = JsonErrorHandler(
            server,
            loop=loop,
            keepalive_timeout=keepalive_s,
            access_log=cast(logging.Logger, None),  # None turns access logs off; typed Logger
        )
        return _HeaderDeadline(handler, deadline_s, connections)

    private: asyncio.Server | None = None
    listener: asyncio.Server | None = None
    watch: asyncio.Task[None] | None = None
    try:
        if workers is not None:  # a sibling's admin changes made here before any connection
            private = await loop.create_server(protocol, "127.0.0.1", 0)
            own = f"http://127.0.0.1:{private.sockets[0].getsockname()[1]}"
            gateway.workers = workers
            admin = gateway.intake.auth.admin_headers()
            made = await workers.catch_up(own, admin)
            workers.announce(own)
            await workers.catch_up(own, admin, start=made)  # those made while catching up
        shared = workers is not None
        listener = await loop.create_server(protocol, host, port, backlog=1024, reuse_port=shared)
        bound = listener.sockets[0].getsockname()[1]
        gateway.intake.listen.set(host, bound)
        gateway.intake.listen.check_config(gateway.config, source)
        if workers is not None:
            watch = asyncio.create_task(watch_supervisor(workers, stop))
        on_ready(f"http://{host}:{bound}")
        await stop.wait()
        gateway.draining = True  # readiness fails before anything else changes
        log.info(
            "draining",
            extra={
                "event": "draining",
                "in_flight": sum(r.num_in_flight for r in gateway.replicas.values()),
                "deadline_s": shutdown_timeout_s,
            },
        )
    finally:
        if listener is not None:
            listener.close()
        if workers is not None:
            workers.withdraw()
        if watch is not None:
            watch.cancel()
        if private is not None:
            private.close()
        with contextlib.suppress(IsocostError):
            await runner.cleanup()
        log.info("stopped", extra={"event": "stopped"})


def raise_fd_limit() -> None:
    """Raise the soft limit on open files to the hard one: every client connection and
    every upstream connection is a socket, and the usual soft 1024 is soon reached."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            log.warning(
                "fd limit not raised",
                extra={"event": "fd_limit", "soft": soft, "hard": hard, "error": str(exc)},
            )
            return
        soft = target
    log.info("fd limit", extra={"event": "fd_limit", "soft": soft, "hard": hard})


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _request_phases(
    connections: dict[asyncio.BaseProtocol, _HeaderDeadline],
) -> Middleware:
    """A middleware telling a connection's header deadline when each request's handling
    starts (its headers are complete) and ends (the next request's headers may begin)."""

    @web.middleware
    async def phases(request: web.Request, handler: Handler) -> web.StreamResponse:
        guard = connections.get(request.protocol)
        if guard is not None:
            guard.request_started()
        try:
            return await handler(request)
        finally:
            if guard is not None:
                guard.request_finished()

    return phases


_PROBE_S = 0.5  # how often a half-closed client is checked while its answer is prepared
_FIRST_PROBE_S = 0.02  # the first checks come sooner (doubling): a client gone is found fast
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _HeaderDeadline(asyncio.Protocol):
    """aiohttp's request handler, plus a deadline for the headers of every request.

    aiohttp bounds neither the time to send request headers nor the time before the first
    byte, so a client trickling headers (slowloris) would hold a connection forever. A
    request's headers must be complete within ``deadline_s`` (``limits.body_timeout_ms``),
    counted from the connection's start for its first request and from the first byte
    after the previous request's answer for later ones (the idle time before that byte is
    the keep-alive timeout's); else the connection is answered 408 and closed. The app's
    middleware (``_request_phases``) reports when handling starts and ends.
    """

    def __init__(
        self,
        inner: RequestHandler,
        deadline_s: float,
        connections: dict[asyncio.BaseProtocol, _HeaderDeadline],
    ) -> None:
        self._inner = inner
        self._deadline_s = deadline_s
        self._connections = connections
        self._timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None
        self._awaiting_head = True
        self._received = False  # any bytes yet: an EOF before them closes at once
        self._probe: asyncio.TimerHandle | None = None
        self._probe_delay_s = _FIRST_PROBE_S

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self._connections[self._inner] = self
        self._arm()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._received = True
        if self._awaiting_head and self._timer is None:
            self._arm()
        self._inner.data_received(data)

    def request_started(self) -> None:
        self._awaiting_head = False
        self._disarm()

    def request_finished(self) -> None:
        self._awaiting_head = True

    def _arm(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self._deadline_s, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

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
        # probe at once: a client that left (most EOFs) must free its engine slot now
        self._probe_delay_s = _FIRST_PROBE_S
        self._probe = asyncio.get_running_loop().call_later(0, self._probe_client)
        return True

    def _probe_client(self) -> None:
        """Until the answer begins, an interim ``100 Continue`` at once, then after
        ``_FIRST_PROBE_S``, doubling up to every ``_PROBE_S`` (the one thing HTTP/1.1
        lets a server send first; clients skip it). Only a write tells a half-closed
        client from one that left: that one answers with a reset, the next write fails,
        and aiohttp cancels the request, as when the connection drops."""
        self._probe = None
        transport, request = self._transport, self._inner._current_request
        if transport is None or transport.is_closing():
            return
        if request is not None:
            if request.writer.output_size or request.version < HttpVersion11:
                return  # the answer has begun (its writes tell), or HTTP/1.0: no 1xx
            transport.write(_CONTINUE)
        delay_s, self._probe_delay_s = self._probe_delay_s, min(self._probe_delay_s * 2, _PROBE_S)
        self._probe = asyncio.get_running_loop().call_later(delay_s, self._probe_client)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        self._connections.pop(self._inner, None)
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


def load_gateway(
    config: GatewayConfig,
    catalog: Catalog,
    config_path: Path | None,
    recording: RecordingSettings | None = None,
) -> Gateway:
    """A gateway for ``config``; unknown policies or cost models fail before any port opens."""
    gateway = Gateway(config, catalog, config_path, recording)
    gateway.router.check_config(config)
    return gateway
