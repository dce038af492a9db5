"""`isocost` subprocesses for tests: start one, wait for its "ready at URL" line, stop it.

Shared by the gateway integration tests and the reliability suite (pytest puts this folder
on ``sys.path``, see ``pythonpath`` in pyproject.toml).
"""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ISOCOST = str(Path(sys.executable).with_name("isocost"))  # the venv running the tests


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


def start_isocost(
    args: list[str], marker: str = "", stderr: Any = None, timeout_s: float = 60
) -> Proc:
    """Start ``isocost *args`` and wait for its ``<marker> ... ready at URL`` line."""
    popen = subprocess.Popen(
        [ISOCOST, *args], stdout=subprocess.PIPE, stderr=stderr, text=True, bufsize=1
    )
    assert popen.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([popen.stdout], [], [], 0.5)
        if ready:
            line = popen.stdout.readline()
            if marker in line and " ready at " in line:
                return Proc(popen, line.rsplit(" ready at ", 1)[1].strip())
            if not line and popen.poll() is not None:
                break
    popen.kill()
    popen.wait()
    raise AssertionError(f"isocost {args[0]} did not become ready (exit {popen.returncode})")
