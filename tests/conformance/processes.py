"""The processes the conformance suite runs: real vLLM CPU replicas (``vllm_procs``, shared
with the benchmarks) and isocost's CLI.

isocost: ``isocost engine`` and ``isocost serve`` from ``.venv/bin/isocost`` on port 0,
ready once they print their ``ready at URL`` line, stopped with SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from isocost_procs import NotReady, free_port, ready_urls
from vllm_procs import (
    ROOT,
    SERVED_NAME,
    STOP_TIMEOUT_S,
    TINY_MODEL,
    VLLM_PYTHON,
    VllmFleet,
    VllmReplica,
)

__all__ = [
    "ISOCOST",
    "ROOT",
    "SERVED_NAME",
    "TINY_MODEL",
    "VLLM_PYTHON",
    "Endpoint",
    "IsocostProcess",
    "VllmFleet",
    "VllmReplica",
    "free_port",
    "unavailable_reason",
]

ISOCOST = ROOT / ".venv" / "bin" / "isocost"
ENABLE_ENV = "ISOCOST_REAL_VLLM"


@dataclass(frozen=True)
class Endpoint:
    """An engine replica under test."""

    kind: str  # "isocost-engine" or "vllm"
    url: str
    model: str = SERVED_NAME


def unavailable_reason() -> str | None:
    """Why the real-vLLM tests cannot run here, or None when they can."""
    if os.environ.get(ENABLE_ENV) != "1":
        return f"real vLLM runs under `make test-real` ({ENABLE_ENV}=1)"
    if not TINY_MODEL.is_dir():
        return f"{TINY_MODEL} not found"
    if not VLLM_PYTHON.exists():
        return f"{VLLM_PYTHON} not found (`make test-real` builds it)"
    return None


class IsocostProcess:
    """``isocost <args>``: ready once it prints ``<marker> ... ready at URL``."""

    def __init__(self, args: list[str], marker: str, log_path: Path, timeout_s: float = 60):
        with log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                [str(ISOCOST), *args], stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1
            )
        self.log_path = log_path
        self.url = self._wait_ready(marker, timeout_s)

    def _wait_ready(self, marker: str, timeout_s: float) -> str:
        try:
            (url,) = ready_urls(self.popen, marker, timeout_s=timeout_s)
        except NotReady:
            self.stop()
            log = self.log_path.read_text(errors="replace")
            raise RuntimeError(f"isocost {marker!r} did not become ready:\n{log}") from None
        return url

    def stop(self) -> int:
        """SIGTERM (SIGKILL after a timeout); the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        code = self.popen.wait(timeout=STOP_TIMEOUT_S)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        return code
