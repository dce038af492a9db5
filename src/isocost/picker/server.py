"""Running ``isocost picker``: the ext_proc service and gRPC health, on one grpc.aio server
or behind the native relay (``picker.relay``: ``--relay BINARY``).

Health answers three names: ``liveness`` (the process serves), ``readiness`` and ``""``
(the brain has a replica that may take new work, and is not shutting down), refreshed
every ``_READINESS_EVERY_S``. SIGTERM or SIGINT: readiness fails first, then the server
stops taking streams and gives the open ones ``shutdown_timeout_s`` to end. Behind the
relay the picker starts it (its own gRPC port is the relay's), hands SIGTERM on to it and
answers its calls until it has drained; a relay that dies stops the picker (exit 1), as a
picker whose gRPC server died would be of no use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from isocost.core.errors import IsocostError
from isocost.picker.extproc import Brain, Processor, add_processor
from isocost.picker.relay import RelayServer
from isocost.serving import run_serving, stop_requested

__all__ = ["DEFAULT_PORT", "run_picker"]

log = logging.getLogger("isocost.picker")

DEFAULT_PORT = 9002  # GAIE's convention for the endpoint picker
_READINESS_EVERY_S = 0.5
_RELAY_READY_S = 10.0  # for the relay to connect and listen
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
    relay: Path | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM; SIGHUP reloads the brain's config file. ``relay``: the
    ``isocost-extproc-relay`` binary to serve through (None: grpc.aio)."""
    transport = _grpc if relay is None else _relayed(relay)
    run_serving(_serve(brain, host, port, on_ready, shutdown_timeout_s, transport))


@dataclass(frozen=True)
class _Serving:
    """What a transport serves, where, and for how long it drains."""

    processor: Processor
    health: HealthServicer
    host: str
    port: int
    shutdown_timeout_s: float
    stop: asyncio.Event  # set by a transport that can serve no more


# A transport (``_grpc``, ``_relayed``) enters with the address it bound and, on its way
# out, drains for up to the timeout.
Transport = Callable[[_Serving], contextlib.AbstractAsyncContextManager[str]]


async def _serve(
    brain: Brain,
    host: str,
    port: int,
    on_ready: Callable[[str], None],
    shutdown_timeout_s: float,
    transport: Transport,
) -> None:
    stop = stop_requested(hangup=brain.reload_requested)
    health = HealthServicer()
    refresher: asyncio.Task[None] | None = None
    try:
        await brain.start()
        await health.set("liveness", _SERVING)
        refresher = asyncio.create_task(_refresh_readiness(brain, health))
        serving = _Serving(Processor(brain), health, host, port, shutdown_timeout_s, stop)
        async with transport(serving) as address:
            on_ready(address)
            await stop.wait()
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher
            for name in ("", "readiness"):
                await health.set(name, _NOT_SERVING)
            log.info("draining", extra={"event": "draining", "deadline_s": shutdown_timeout_s})
    finally:
        if refresher is not None:
            refresher.cancel()
        await brain.stop()
        log.info("stopped", extra={"event": "stopped"})


@contextlib.asynccontextmanager
async def _grpc(serving: _Serving) -> AsyncIterator[str]:
    server = grpc.aio.server(options=_SERVER_OPTIONS)
    add_processor(serving.processor, server)
    health_pb2_grpc.add_HealthServicer_to_server(serving.health, server)
    host, port = serving.host, serving.port
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpc's only word for it: the address is taken or not ours
        raise IsocostError(
            f"cannot listen on {host}:{port} (in use, or not an address here)"
        ) from None
    await server.start()
    try:
        yield f"{host}:{bound}"
    finally:
        await server.stop(serving.shutdown_timeout_s)


def _relayed(binary: Path) -> Transport:
    @contextlib.asynccontextmanager
    async def relayed(serving: _Serving) -> AsyncIterator[str]:
        """The relay on host:port, its calls served from a Unix socket in a private
        directory; when the relay dies, ``stop`` is set and IsocostError follows."""
        stop, shutdown_timeout_s = serving.stop, serving.shutdown_timeout_s
        relay_server = RelayServer(serving.processor, serving.health)
        workdir = Path(tempfile.mkdtemp(prefix="isocost-picker-"))  # mode 0700
        socket_path = workdir / "relay.sock"
        listener = await asyncio.start_unix_server(relay_server.serve, socket_path)
        try:
            process = await asyncio.create_subprocess_exec(
                str(binary),
                "--listen", f"{serving.host}:{serving.port}",
                "--socket", str(socket_path),
                "--grace-s", str(shutdown_timeout_s),
                stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
        except OSError as exc:
            listener.close()
            shutil.rmtree(workdir, ignore_errors=True)
            raise IsocostError(f"--relay: cannot run {binary}: {exc.strerror or exc}") from None
        died = False
        try:
            address = await _relay_address(process)

            async def watch() -> None:
                nonlocal died
                await process.wait()
                if not stop.is_set():
                    died = True
                    log.error(
                        "the relay exited",
                        extra={"event": "relay_exited", "exit_code": process.returncode},
                    )
                    stop.set()

            watcher = asyncio.create_task(watch())
            yield address
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)  # it drains; its calls are still served
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(process.wait(), shutdown_timeout_s + 5.0)
            await watcher
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            listener.close()
            shutil.rmtree(workdir, ignore_errors=True)
        if died:
            raise IsocostError(f"the relay {binary} exited ({process.returncode})")

    return relayed


async def _relay_address(process: asyncio.subprocess.Process) -> str:
    """The address from the relay's ready line; IsocostError when it exits or stays
    silent first (what it said why is on the same stderr as the picker's)."""
    assert process.stdout is not None
    marker = b" ready at "
    try:
        async with asyncio.timeout(_RELAY_READY_S):
            while line := await process.stdout.readline():
                if marker in line:
                    return line.rsplit(marker, 1)[1].strip().decode()
    except TimeoutError:
        raise IsocostError(f"the relay was not ready in {_RELAY_READY_S:g} s") from None
    raise IsocostError(f"the relay exited before it was ready ({await process.wait()})")


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
