"""Starting and crashing the real servers the distributed tests run (etcd, Redis, NATS):
each binary started with its output in a log file and waited for until it answers."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def spawn_server(
    args: list[str], log: Path, answers: Callable[[], bool], timeout_s: float
) -> subprocess.Popen[bytes]:
    """Start ``args`` (output appended to ``log``) and wait until ``answers()``;
    AssertionError if it exits first or ``timeout_s`` passes."""
    name = Path(args[0]).name
    with log.open("ab") as sink:
        popen = subprocess.Popen(args, stdout=sink, stderr=sink)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise AssertionError(f"{name} exited {popen.returncode}: see {log}")
        if answers():
            return popen
        time.sleep(0.02)
    popen.kill()
    popen.wait()
    raise AssertionError(f"{name} did not answer in {timeout_s:g} s: see {log}")


def crash(popen: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL, as a crash (nothing if never started or already gone)."""
    if popen is not None and popen.poll() is None:
        popen.send_signal(signal.SIGKILL)
        popen.wait(timeout=10)
