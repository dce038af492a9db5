"""`isocost` subprocesses for tests: start one, wait for its "ready at URL" line, stop it.

Shared by the gateway integration tests, the reliability suite and the conformance suite
(pytest puts this folder on ``sys.path``, see ``pythonpath`` in pyproject.toml).
``ready_urls`` is the one place that reads ``... ready at URL`` lines off a process's
stdout, for every suite that starts ``isocost engine`` or ``isocost serve``.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ISOCOST = str(Path(sys.executable).with_name("isocost"))  # the venv running the tests


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``): steadier than
    a request rate on a shared machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux ``/proc``): a picker's relay, say."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return found


@dataclass
class Proc:
    popen: subprocess.Popen[str]
    url: str

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)
        if self.popen.stdout is not None:
            self.popen.stdout.close()


def spawn_ready(
    args: list[str], marker: str = "", count: int = 1, stderr: Any = None, timeout_s: float = 60
) -> tuple[subprocess.Popen[str], list[str]]:
    """Start ``isocost *args``; the process and the URLs of its first ``count`` ready lines.
    NotReady, the process killed, when it exits or ``timeout_s`` passes first."""
    popen = subprocess.Popen(
        [ISOCOST, *args], stdout=subprocess.PIPE, stderr=stderr, text=True, bufsize=1
    )
    try:
        return popen, ready_urls(popen, marker, count, timeout_s)
    except NotReady:
        abandon(popen)
        raise


def abandon(popen: subprocess.Popen[str]) -> None:
    """Kill a process that did not become ready, and close the pipe its ready lines were
    read from (left open, its collection warns in whichever test runs then)."""
    popen.kill()
    popen.wait()
    if popen.stdout is not None:
        popen.stdout.close()


def start_isocost(
    args: list[str], marker: str = "", stderr: Any = None, timeout_s: float = 60
) -> Proc:
    """Start ``isocost *args`` and wait for its ``<marker> ... ready at URL`` line."""
    try:
        popen, (url,) = spawn_ready(args, marker, 1, stderr, timeout_s)
    except NotReady as exc:
        raise AssertionError(f"isocost {args[0]} did not become ready ({exc})") from None
    return Proc(popen, url)


def start_gateway_with(config_text: str, tmp: Path, procs: list[Proc]) -> Proc:
    """``isocost serve`` on a random port with ``config_text`` as its file
    (``tmp/gateway.yaml``) and its log in ``tmp/gateway.log``; added to ``procs``."""
    config = tmp / "gateway.yaml"
    config.write_text(config_text)
    with (tmp / "gateway.log").open("a") as log:
        gateway = start_isocost(["serve", "--config", str(config), "--port", "0"], stderr=log)
    procs.append(gateway)
    return gateway


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class NotReady(AssertionError):
    """The process exited, or ``timeout_s`` passed, before all its ready lines came."""


def ready_urls(
    popen: subprocess.Popen[str], marker: str = "", count: int = 1, timeout_s: float = 60
) -> list[str]:
    """Read ``popen``'s stdout until ``count`` lines ``<marker> ... ready at URL`` have
    come, skipping other lines; their URLs, in order. NotReady when the process exits or
    ``timeout_s`` passes first. Reads the pipe's file descriptor directly (several lines
    may come in one read), so nothing else should read that stdout afterwards."""
    assert popen.stdout is not None
    fd = popen.stdout.fileno()
    urls: list[str] = []
    pending = b""
    deadline = time.monotonic() + timeout_s
    while len(urls) < count and (left_s := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], min(left_s, 0.5))[0]:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:  # end of file: it exited
            break
        *lines, pending = (pending + chunk).split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace")
            if marker in line and " ready at " in line:
                urls.append(line.rsplit(" ready at ", 1)[1].strip())
    if len(urls) < count:
        raise NotReady(f"{len(urls)} of {count} {marker!r} ready lines (exit {popen.poll()})")
    return urls[:count]
