"""A script that starts child processes in sessions of their own (as the demo and the
benchmarks do, so a terminal's Ctrl-C reaches only the script) and is SIGTERMed stops
them: ``run_script`` takes SIGTERM as Ctrl-C, so the script's ``finally`` runs, where
Python's default would exit at once and leave the children running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import subprocess, sys, time
    from pathlib import Path
    from isocost.runtime.processes import run_script

    def main() -> None:
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"],
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        Path(sys.argv[1]).write_text(str(child.pid))
        try:
            time.sleep(600)
        finally:
            child.terminate()
            child.wait()

    run_script(main)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_sigtermed_script_stops_its_children_and_says_so(tmp_path: Path) -> None:
    script, pid_file = tmp_path / "bench.py", tmp_path / "child.pid"
    script.write_text(SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(pid_file)], stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, "the script never started"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    try:
        assert _alive(child)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 130
        assert stderr.strip() == "interrupted: bench.py stopped what it started", stderr
        assert not _alive(child)  # terminated and reaped by the script's finally
    finally:
        if _alive(child):  # the failure this test is for: not left behind by the test too
            os.kill(child, signal.SIGKILL)


POOL_SCRIPT = textwrap.dedent(
    """
    import multiprocessing, sys, time
    from pathlib import Path
    from isocost.runtime.processes import run_script

    def main() -> None:
        with multiprocessing.get_context("fork").Pool(1) as pool:  # ends it with SIGTERM
            pool.apply_async(time.sleep, (600,))
            Path(sys.argv[1]).write_text("started")
            time.sleep(600)

    run_script(main)
    """
)


def test_a_forked_worker_ended_by_its_pool_dies_quietly(tmp_path: Path) -> None:
    """The SIGTERM a pool sends its workers as the interrupted script leaves the pool is
    the default one for them, not a second interrupt with a traceback."""
    script, started = tmp_path / "bench.py", tmp_path / "started"
    script.write_text(POOL_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(started)], stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while not started.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the script never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert stderr.strip() == "interrupted: bench.py stopped what it started", stderr
