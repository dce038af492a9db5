"""``isocost serve --workers N``: one host's gateway on N processes sharing one port.

One Python process forwards on one core. N workers listen on the same address with
SO_REUSEPORT, so the kernel spreads new connections over them, and share their in-flight
state and API keys' budgets through the state bus, each a peer of the others. Without a
bus configured (Redis or NATS, shared with other hosts' gateways) the supervisor runs one
for them: the hub of ``runtime.bus_hub`` on a Unix socket in its private directory, whose
path each worker gets (``--worker-bus``).

The supervisor (the process the user started) reserves the port (bound, never listening,
so it takes no connection), starts the workers (``isocost serve`` again with
``--worker-id`` and ``--worker-dir``), prints its ready line once every worker is ready,
restarts a worker that dies (more than ``_MAX_RESTARTS`` deaths within
``_RESTART_WINDOW_S`` stop them all, exit 1), and passes SIGTERM/SIGINT on, then waits for
every worker to drain; SIGHUP it passes on too (each worker reloads its config file). A
worker whose supervisor is gone (SIGKILLed) stops by itself.

Each worker also listens on a private 127.0.0.1 port, written to
``<worker-dir>/worker-<id>.json``; through it the workers look like one gateway:

* an admin change (any method but GET under ``/admin/``) made on one worker is made on
  every other (the same request, marked ``x-isocost-sibling``); a sibling that fails it
  is logged and named in the answer's ``x-isocost-workers-failed`` header;
* ``/metrics`` on the shared port holds every worker's series, each with a ``worker``
  label (a worker that does not answer in time is missing, and logged);
* ``/admin/snapshot`` counts every worker's requests in flight and queued (an
  autoscaler waits on them before it stops a drained replica), the rest being the
  answering worker's view (its ``worker`` field says which; ``workers`` names those
  that answered and those that did not);
* each worker keeps the admin changes it made, in order (``GET /admin/changes``); a worker
  restarted after a crash makes a sibling's list on itself before it takes a connection,
  so a replica drained, added or removed and a policy switched through the API stay so on
  every worker. Admin changes leave the same state when made twice (a second add or
  remove is refused and skipped), which lets the catch-up overlap the fan-out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from isocost.core.errors import IsocostError
from isocost.core.jsontext import UNDECODABLE, parse_json
from isocost.runtime.bus_hub import LocalHub
from isocost.runtime.processes import isocost_command
from isocost.serving import run_serving, stop_requested

__all__ = [
    "SIBLING_HEADER",
    "AdminChange",
    "WorkerGroup",
    "merge_metrics",
    "run_workers",
    "sum_workers",
    "watch_supervisor",
    "worker_args",
]

log = logging.getLogger("isocost.gateway")

SIBLING_HEADER = "x-isocost-sibling"  # a call from another worker: answer for yourself only
_SIBLING_TIMEOUT_S = 5.0
_READY_TIMEOUT_S = 120.0
_MAX_RESTARTS = 5
_RESTART_WINDOW_S = 60.0
_PARENT_POLL_S = 1.0
_MAX_CHANGES = 10_000  # admin changes kept for a restarted sibling; past it, none are


@dataclass(frozen=True)
class AdminChange:
    """One admin request that changed this worker: what a restarted sibling repeats."""

    method: str
    path: str  # with its query string
    body: str


class _ChangesList(msgspec.Struct, forbid_unknown_fields=True):
    """``GET /admin/changes`` as a sibling answers it (``WorkerGroup.changes_view``)."""

    changes: list[AdminChange]
    complete: bool


_CHANGES = msgspec.json.Decoder(_ChangesList)


class WorkerGroup:
    """One worker's view of its siblings: its id and the directory where each worker
    announces its private URL."""

    def __init__(self, worker_id: int, directory: Path) -> None:
        self.worker_id = worker_id
        self.directory = directory
        self._parent = os.getppid()
        self.changes: list[AdminChange] = []  # made on this worker, in order
        self.changes_complete = True  # False once past _MAX_CHANGES: none can be repeated

    def announce(self, private_url: str) -> None:
        """Tell the siblings where to reach this worker (written whole, then renamed)."""
        path = self.directory / f"worker-{self.worker_id}.json"
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps({"url": private_url, "pid": os.getpid()}))
        partial.replace(path)

    def withdraw(self) -> None:
        with contextlib.suppress(OSError):
            (self.directory / f"worker-{self.worker_id}.json").unlink()

    def siblings(self) -> dict[int, str]:
        """The other workers' private URLs, by worker id (unreadable entries skipped: a
        worker restarting rewrites its own)."""
        found: dict[int, str] = {}
        for path in self.directory.glob("worker-*.json"):
            try:
                worker_id = int(path.stem.removeprefix("worker-"))
                recorded = parse_json(path.read_text())
            except (OSError, ValueError):
                continue
            url = recorded.get("url") if isinstance(recorded, dict) else None
            if worker_id != self.worker_id and isinstance(url, str):
                found[worker_id] = url
        return found

    def orphaned(self) -> bool:
        """The supervisor that started this worker is gone."""
        return os.getppid() != self._parent

    async def fan_out(
        self, method: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> list[int]:
        """Make the same admin request on every sibling; the ids of those that failed."""
        sent = {**headers, SIBLING_HEADER: str(self.worker_id)}
        siblings = self.siblings()

        async def one(session: aiohttp.ClientSession, worker_id: int, url: str) -> int | None:
            try:
                async with session.request(method, url + path, data=body, headers=sent) as reply:
                    if reply.status < 300:
                        return None
                    reason = f"HTTP {reply.status} {(await reply.text())[:200]}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                reason = type(exc).__name__
            log.warning(
                "admin change not made on a sibling worker",
                extra={"event": "worker_fanout_failed", "worker": worker_id, "path": path,
                       "error": reason},
            )  # fmt: skip
            return worker_id

        async with _session() as session:
            failed = await asyncio.gather(*(one(session, w, u) for w, u in siblings.items()))
        return sorted(w for w in failed if w is not None)

    def made(self, method: str, path: str, body: bytes) -> None:
        """Keep an admin change this worker made (from a client or a sibling)."""
        if len(self.changes) >= _MAX_CHANGES:
            self.changes_complete = False
            return
        self.changes.append(AdminChange(method, path, body.decode()))

    def changes_view(self) -> dict[str, Any]:
        return {
            "changes": [asdict(change) for change in self.changes],
            "complete": self.changes_complete,
        }

    async def catch_up(self, own_url: str, admin: Mapping[str, str], start: int = 0) -> int:
        """Make on this worker (through ``own_url``, its private port) the admin changes
        the first sibling that answers has made, from its ``start``-th on; how many that
        sibling had made (the next call's ``start``). A sibling whose answer is not such a
        list (another version, another process on its port) is logged and skipped. No
        admin token, no sibling, or a sibling whose list overflowed: nothing is made
        (logged), as a fresh worker."""
        if not admin:
            return 0
        headers = {**admin, SIBLING_HEADER: str(self.worker_id)}
        async with _session() as session:
            for worker_id, url in sorted(self.siblings().items()):
                try:
                    async with session.get(url + "/admin/changes", headers=headers) as reply:
                        body = await reply.read() if reply.status == 200 else None
                    listed = None if body is None else _CHANGES.decode(body)
                except (aiohttp.ClientError, TimeoutError, *UNDECODABLE) as exc:
                    log.warning(
                        "a sibling's admin changes could not be read",
                        extra={"event": "worker_catch_up_unreadable", "worker": worker_id,
                               "error": str(exc)[:200]},
                    )  # fmt: skip
                    listed = None
                if listed is None:
                    continue
                if not listed.complete:
                    log.warning(
                        "a sibling's admin changes overflowed: this worker starts from the "
                        "config file alone",
                        extra={"event": "worker_catch_up_skipped", "worker": worker_id},
                    )
                    return 0
                changes = listed.changes
                for change in changes[start:]:
                    await self._repeat(session, own_url, change, headers)
                return len(changes)
        return 0

    async def _repeat(
        self,
        session: aiohttp.ClientSession,
        own_url: str,
        change: AdminChange,
        headers: Mapping[str, str],
    ) -> None:
        sent = {**headers, "Content-Type": "application/json"}
        data = change.body.encode()
        try:
            async with session.request(
                change.method, own_url + change.path, data=data, headers=sent
            ) as reply:
                if reply.status < 300:
                    return
                reason = f"HTTP {reply.status} {(await reply.text())[:200]}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            reason = type(exc).__name__
        log.info(
            "a sibling's admin change was not repeated here",
            extra={"event": "worker_catch_up_refused", "method": change.method,
                   "path": change.path, "error": reason},
        )  # fmt: skip

    async def _gather(
        self, path: str, headers: Mapping[str, str]
    ) -> tuple[dict[int, bytes], dict[int, str]]:
        """``GET path`` on every sibling, each answering for itself: the bodies by worker
        id, and why each one that did not answer did not."""
        bodies: dict[int, bytes] = {}
        missing: dict[int, str] = {}

        async def one(session: aiohttp.ClientSession, worker_id: int, url: str) -> None:
            try:
                sent = {**headers, SIBLING_HEADER: str(self.worker_id)}
                async with session.get(url + path, headers=sent) as reply:
                    if reply.status == 200:
                        bodies[worker_id] = await reply.read()
                        return
                    missing[worker_id] = f"HTTP {reply.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                missing[worker_id] = type(exc).__name__

        async with _session() as session:
            await asyncio.gather(*(one(session, w, u) for w, u in self.siblings().items()))
        for worker_id, reason in missing.items():
            log.warning(
                f"a worker's {path} is missing",
                extra={"event": "worker_missing", "path": path, "worker": worker_id,
                       "error": reason},
            )  # fmt: skip
        return bodies, missing

    async def gather_metrics(self, own: bytes) -> bytes:
        """Every worker's ``/metrics``, each series labelled with its worker."""
        bodies, _ = await self._gather("/metrics", {})
        texts = {worker_id: body.decode() for worker_id, body in bodies.items()}
        return merge_metrics({self.worker_id: own.decode(), **texts})

    async def gather_snapshot(
        self, own: dict[str, Any], headers: Mapping[str, str]
    ) -> dict[str, Any]:
        """``own`` (this worker's ``/admin/snapshot``) with every worker's requests in
        flight and queued summed in (``sum_workers``)."""
        bodies, missing = await self._gather("/admin/snapshot", headers)
        views = {self.worker_id: own}
        for worker_id, body in bodies.items():
            view = parse_json(body) if body else None
            if isinstance(view, dict):
                views[worker_id] = view
            else:
                missing[worker_id] = "not a snapshot"
        return sum_workers(views, sorted(missing))


def sum_workers(views: Mapping[int, dict[str, Any]], missing: Sequence[int]) -> dict[str, Any]:
    """The gateway as a whole, from its workers' snapshots: each replica's and pool's
    requests in flight, queued and held summed over the workers (each counts the
    connections it took), the rest the first view's (the answering worker's); ``workers``
    names those that answered and those that did not (their requests are not in it)."""
    first, *others = views.values()
    merged = {**first, "replicas": [dict(row) for row in first["replicas"]]}
    merged["pools"] = [dict(pool) for pool in first["pools"]]
    for view in others:
        in_flight = {row["name"]: row["in_flight"] for row in view.get("replicas", ())}
        for row in merged["replicas"]:
            row["in_flight"] += in_flight.get(row["name"], 0)
        pools = {pool["model"]: pool for pool in view.get("pools", ())}
        for pool in merged["pools"]:
            theirs = pools.get(pool["model"], {})
            for key in ("in_flight", "queue_depth", "queue_held"):
                pool[key] += theirs.get(key, 0)
    merged["workers"] = {"answered": sorted(views), "missing": sorted(missing)}
    return merged


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_SIBLING_TIMEOUT_S))


class _Families:
    """A collector of already-parsed metric families (``merge_metrics``)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> list[Metric]:
        return self._families


def merge_metrics(texts: Mapping[int, str]) -> bytes:
    """One exposition of several workers' texts, each sample labelled ``worker``."""
    families: dict[str, Metric] = {}
    for worker_id, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            label = {"worker": str(worker_id)}
            merged.samples += [s._replace(labels={**s.labels, **label}) for s in family.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families.values()))
    return generate_latest(registry)


# -- the supervisor ------------------------------------------------------------------------


def worker_args(serve_args: Sequence[str]) -> list[str]:
    """``isocost serve``'s own arguments without ``--workers`` and ``--port`` (the
    supervisor gives each worker its own)."""
    kept: list[str] = []
    skip = False
    for arg in serve_args:
        if skip:
            skip = False
        elif arg in ("--workers", "--port"):
            skip = True
        elif not arg.startswith(("--workers=", "--port=")):
            kept.append(arg)
    return kept


def run_workers(
    args: Sequence[str],
    workers: int,
    host: str,
    port: int,
    on_ready: Callable[[str], None],
    shutdown_timeout_s: float,
    local_bus: bool,
) -> int:
    """Supervise ``workers`` gateway processes on ``host:port`` until SIGTERM/SIGINT (with
    ``local_bus``, sharing state through this process's hub); the exit status (0 after a
    clean stop, 1 when workers kept dying or never got ready)."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise IsocostError("--workers needs SO_REUSEPORT (Linux or BSD)")
    reservation = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        reservation.bind((host, port))
    except OSError as exc:
        reservation.close()
        raise IsocostError(f"--port {port}: {exc.strerror}") from None
    bound = int(reservation.getsockname()[1])
    status = [0]
    with reservation, tempfile.TemporaryDirectory(prefix="isocost-workers-") as directory:
        supervisor = _Supervisor(list(args), workers, bound, Path(directory), shutdown_timeout_s)
        hub = LocalHub() if local_bus else None
        run_serving(supervisor.run(f"http://{host}:{bound}", on_ready, status, hub))
    return status[0]


class _Supervisor:
    def __init__(
        self, args: list[str], workers: int, port: int, directory: Path, shutdown_timeout_s: float
    ) -> None:
        self.args, self.workers, self.port = args, workers, port
        self.directory, self.shutdown_timeout_s = directory, shutdown_timeout_s
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.deaths: deque[float] = deque()

    async def _start(self, worker_id: int) -> None:
        """Start worker ``worker_id`` and wait for its ready line (IsocostError if none)."""
        command = [
            *isocost_command(), "serve", *self.args, "--port", str(self.port),
            "--worker-id", str(worker_id), "--worker-dir", str(self.directory),
        ]  # fmt: skip
        proc = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
        self.procs[worker_id] = proc
        assert proc.stdout is not None
        try:
            async with asyncio.timeout(_READY_TIMEOUT_S):
                while b" ready at " not in (line := await proc.stdout.readline()):
                    if not line:
                        raise IsocostError(f"worker {worker_id} exited before it was ready")
        except TimeoutError:
            proc.kill()
            raise IsocostError(f"worker {worker_id} not ready in {_READY_TIMEOUT_S:g} s") from None

    async def run(
        self, url: str, on_ready: Callable[[str], None], status: list[int], hub: LocalHub | None
    ) -> None:
        stop = stop_requested(hangup=self._hang_up)
        if hub is not None:
            bus_path = self.directory / "bus.sock"
            await hub.start(bus_path)
            self.args += ["--worker-bus", str(bus_path)]
        try:
            await self._supervise(url, on_ready, status, stop)
        finally:
            if hub is not None:
                await hub.close()

    async def _supervise(
        self, url: str, on_ready: Callable[[str], None], status: list[int], stop: asyncio.Event
    ) -> None:
        try:
            await asyncio.gather(*(self._start(i) for i in range(self.workers)))
        except IsocostError as exc:
            print(f"error: {exc}", file=sys.stderr)
            status[0] = 1
            await self._stop_all()
            return
        on_ready(url)
        watchers = {i: asyncio.create_task(self._drain(i)) for i in self.procs}
        stopping = asyncio.create_task(stop.wait())
        try:
            while True:
                done, _ = await asyncio.wait(
                    [stopping, *watchers.values()], return_when=asyncio.FIRST_COMPLETED
                )
                if stopping in done:
                    break
                for worker_id, task in list(watchers.items()):
                    if task in done:
                        if not await self._restart(worker_id, task.result()):
                            status[0] = 1
                            return
                        watchers[worker_id] = asyncio.create_task(self._drain(worker_id))
        finally:
            for task in watchers.values():
                task.cancel()
            stopping.cancel()
            await self._stop_all()

    def _hang_up(self) -> None:
        """SIGHUP on to every worker: each reloads its config file."""
        for proc in self.procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGHUP)

    async def _drain(self, worker_id: int) -> int:
        """Read worker ``worker_id``'s stdout to its end; its exit status."""
        proc = self.procs[worker_id]
        assert proc.stdout is not None
        while await proc.stdout.readline():
            pass
        return await proc.wait()

    async def _restart(self, worker_id: int, returncode: int) -> bool:
        now = time.monotonic()
        self.deaths.append(now)
        while self.deaths[0] < now - _RESTART_WINDOW_S:
            self.deaths.popleft()
        log.error(
            "worker died",
            extra={"event": "worker_died", "worker": worker_id, "returncode": returncode},
        )
        if len(self.deaths) > _MAX_RESTARTS:
            print(
                f"error: {len(self.deaths)} worker deaths within {_RESTART_WINDOW_S:g} s; stopping",
                file=sys.stderr,
            )
            return False
        try:
            await self._start(worker_id)
        except IsocostError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return False
        log.info("worker restarted", extra={"event": "worker_restarted", "worker": worker_id})
        return True

    async def _stop_all(self) -> None:
        """SIGTERM to every worker; SIGKILL to those still up after their drain time."""
        alive = [p for p in self.procs.values() if p.returncode is None]
        for proc in alive:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        try:
            async with asyncio.timeout(self.shutdown_timeout_s + 5):
                await asyncio.gather(*(p.wait() for p in alive))
        except TimeoutError:
            for proc in alive:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await asyncio.gather(*(p.wait() for p in alive))


async def watch_supervisor(group: WorkerGroup, stop: asyncio.Event) -> None:
    """Stop this worker once its supervisor is gone (nobody would stop it otherwise)."""
    while not stop.is_set():
        if group.orphaned():
            log.warning("supervisor gone; stopping", extra={"event": "supervisor_gone"})
            stop.set()
            return
        await asyncio.sleep(_PARENT_POLL_S)
