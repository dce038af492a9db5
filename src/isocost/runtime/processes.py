"""Local child processes (the demo's cluster, the autoscaler's engines): each started in its
own process group and stopped as a group.

Each service is an ``isocost`` subcommand whose stdout and stderr go to a log file (a pipe
nobody reads would fill up and block it); readiness is its ``... ready at URL`` lines in
that file. A service runs in a new session, so a Ctrl-C in the terminal reaches only the
parent, which then stops its children in order: SIGTERM to the whole group, SIGKILL to the
group if it has not exited within the grace period. ``Services`` remembers everything
started and stops it all, newest first, from a ``finally``.

So that no child outlives its parent however the parent ends: ``sigterm_interrupts`` and
``run_script`` make SIGTERM run those ``finally`` blocks as Ctrl-C does, and ``dies_with``
has the kernel end a worker (a pool's, a forked replay) when its parent dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import NoReturn

from isocost.core.errors import IsocostError

__all__ = [
    "Service",
    "ServiceError",
    "Services",
    "dies_with",
    "free_port",
    "isocost_command",
    "run_script",
    "sigterm_interrupts",
]

_READY = " ready at "
_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1  # prctl(2): the signal a child gets when its parent dies
# prctl(2), looked up before any fork: Linux only
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


class ServiceError(IsocostError):
    """A local service failed to start, exited, or never became ready."""


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def isocost_command() -> list[str]:
    """How to run ``isocost``: the script beside this interpreter, else the one on PATH."""
    beside = Path(sys.executable).with_name("isocost")
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("isocost")
    if found is None:
        raise ServiceError("cannot find the isocost command next to Python or on PATH")
    return [found]


@dataclass
class Service:
    """One running ``isocost`` subcommand and the URLs it announced."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    urls: list[str] = field(default_factory=list)

    def log_tail(self, num_lines: int = 8) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

    def wait_ready(self, num_urls: int, timeout_s: float) -> list[str]:
        """Block until the log shows ``num_urls`` ready lines; ServiceError if it exits first."""
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.log_path.read_text(errors="replace")
            self.urls = [
                line.rsplit(_READY, 1)[1].strip() for line in text.splitlines() if _READY in line
            ]
            if len(self.urls) >= num_urls:
                return self.urls[:num_urls]
            if self.popen.poll() is not None:
                raise ServiceError(
                    f"{self.name} exited with code {self.popen.returncode} before it was ready; "
                    f"its log ({self.log_path}) ends with:\n{self.log_tail()}"
                )
            if time.monotonic() >= deadline:
                raise ServiceError(f"{self.name} was not ready after {timeout_s:.0f} s")
            time.sleep(_POLL_S)

    def stop(self, grace_s: float) -> None:
        """SIGTERM the process group, then SIGKILL it after ``grace_s``; reaps the leader."""
        if self.popen.poll() is not None:
            return
        _signal_group(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(self.popen.pid, signal.SIGKILL)
            self.popen.wait()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class Services:
    """Everything the demo started; ``stop_all`` ends it, newest first."""

    def __init__(self, log_dir: Path, grace_s: float = 15.0) -> None:
        self.log_dir = log_dir
        self.grace_s = grace_s
        self._running: list[Service] = []

    def start(
        self,
        name: str,
        args: list[str],
        env: dict[str, str] | None = None,
        program: list[str] | None = None,
    ) -> Service:
        """``isocost *args`` (or ``program *args``) in its own session, output to
        ``<log_dir>/<name>.log``."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                [*(program or isocost_command()), *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        service = Service(name, popen, log_path)
        self._running.append(service)
        return service

    def stop(self, service: Service) -> None:
        service.stop(self.grace_s)
        if service in self._running:
            self._running.remove(service)

    def stop_all(self) -> None:
        while self._running:
            self.stop(self._running[-1])


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM is taken as Ctrl-C inside, so that the ``finally`` blocks that stop child
    processes run: Python's default exits at once, and children in sessions of their own
    (no signal reaches them from a terminal) are left behind. It goes to whatever handles
    SIGINT now: inside ``asyncio.run``, the runner, which cancels its task first rather
    than let the interrupt land in some callback. A process forked inside (a pool's
    worker, which its pool ends with SIGTERM) dies of it as it would have."""
    owner = os.getpid()

    def as_ctrl_c(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != owner:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        handler = signal.getsignal(signal.SIGINT)
        if not callable(handler):  # SIGINT ignored (a background job) or default
            raise KeyboardInterrupt
        handler(signal.SIGINT, frame)

    previous = signal.signal(signal.SIGTERM, as_ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_script(main: Callable[[], int | None]) -> NoReturn:
    """A script's entry point: ``main`` with Ctrl-C handled even when started in the
    background (where the shell ignores it) and SIGTERM taken as Ctrl-C; an interrupted
    run ends with one line and exit 130, its ``finally`` blocks having stopped what it
    started."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with sigterm_interrupts():
            code = main()
    except KeyboardInterrupt:
        print(f"interrupted: {Path(sys.argv[0]).name} stopped what it started", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)


def dies_with(parent: int) -> Callable[[], None] | None:
    """What a child of ``parent`` runs first (a ``preexec_fn``, a pool's ``initializer``,
    the branch after ``os.fork``): on Linux it asks the kernel to SIGKILL the child when
    ``parent`` dies, SIGKILLed included, so that no worker outlives the process that
    asked for its work (a simulator left by a killed gateway ran an hour; a killed
    ``isocost sim`` left its workers simulating); a child whose parent is already gone
    exits. None elsewhere. ``parent`` is the thread that forks: the main thread here."""
    prctl = _PRCTL
    if prctl is None:
        return None

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # it died before the request took hold
            os._exit(1)

    return hook
