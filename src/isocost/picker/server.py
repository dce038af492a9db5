"""Running ``isocost picker``: the ext_proc service and gRPC health on one grpc.aio server.

Health answers three names: ``liveness`` (the process serves), ``readiness`` and ``""``
(the brain has a replica that may take new work, and is not shutting down), refreshed
every ``_READINESS_EVERY_S``. SIGTERM or SIGINT: readiness fails first, then the server
stops taking streams and gives the open ones ``shutdown_timeout_s`` to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from isocost.core.errors import IsocostError
from isocost.picker.extproc import Brain, Processor, add_processor
from isocost.serving import run_serving, stop_requested

__all__ = ["DEFAULT_PORT", "run_picker"]

log = logging.getLogger("isocost.picker")

DEFAULT_PORT = 9002  # GAIE's convention for the endpoint picker
_READINESS_EVERY_S = 0.5
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Envoy opens one stream per request: allow as many as it has requests in flight.
_SERVER_OPTIONS = [
    ("grpc.max_concurrent_streams", 1 << 20),
    ("grpc.so_reuseport", 0),
]


def run_picker(
    brain: Brain,
    host: str,
    port: int,
    on_ready: Callable[[str], None],
    shutdown_timeout_s: float = 10.0,
) -> None:
    """Serve until SIGINT/SIGTERM; SIGHUP reloads the brain's config file."""
    run_serving(_serve(brain, host, port, on_ready, shutdown_timeout_s))


async def _serve(
    brain: Brain,
    host: str,
    port: int,
    on_ready: Callable[[str], None],
    shutdown_timeout_s: float,
) -> None:
    stop = stop_requested(hangup=brain.reload_requested)
    server = grpc.aio.server(options=_SERVER_OPTIONS)
    add_processor(Processor(brain), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpc's only word for it: the address is taken or not ours
        raise IsocostError(
            f"cannot listen on {host}:{port} (in use, or not an address here)"
        ) from None
    await brain.start()
    await health.set("liveness", _SERVING)
    refresher = asyncio.create_task(_refresh_readiness(brain, health))
    await server.start()
    try:
        on_ready(f"{host}:{bound}")
        await stop.wait()
        refresher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await refresher
        for name in ("", "readiness"):
            await health.set(name, _NOT_SERVING)
        log.info("draining", extra={"event": "draining", "deadline_s": shutdown_timeout_s})
        await server.stop(shutdown_timeout_s)
    finally:
        refresher.cancel()
        await brain.stop()
        log.info("stopped", extra={"event": "stopped"})


async def _refresh_readiness(brain: Brain, health: HealthServicer) -> None:
    """Mirror the brain's readiness into the health service (a Watch sees each change)."""
    current: int | None = None
    while True:
        status = _SERVING if brain.ready() else _NOT_SERVING
        if status != current:
            current = status
            for name in ("", "readiness"):
                await health.set(name, status)
        await asyncio.sleep(_READINESS_EVERY_S)
