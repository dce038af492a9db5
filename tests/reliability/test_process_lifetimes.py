"""No process outlives the one that started it, however that one ends.

A script that starts children in sessions of their own (as the demo and the benchmarks
do, so a terminal's Ctrl-C reaches only the script) and is SIGTERMed stops them:
``run_script`` takes SIGTERM as Ctrl-C, so the script's ``finally`` runs, where Python's
default would exit at once and leave the children running. A pool's workers die with
the process that forked them, SIGKILLed included (``dies_with``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
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
    """Running, not a zombie: one whose parent died waits for whatever reaps orphans."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


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


def _children(pid: int) -> set[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return {int(line) for line in found.stdout.split()}


@contextlib.contextmanager
def _sweep() -> Iterator[tuple[subprocess.Popen[str], set[int]]]:
    """``isocost sim --jobs 2`` sweeping, in a process group of its own as a terminal's
    job is (SIGINT not ignored, whatever this runner inherited), once both its workers
    run; whatever is left of it is killed after."""
    isocost = Path(sys.executable).with_name("isocost")
    proc = subprocess.Popen(
        [str(isocost), "sim", "--workload", "mix", "--sweep-rate", "20,40,60,80",
         "--duration", "20000", "--jobs", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(workers := _children(proc.pid)) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "no workers started"
            time.sleep(0.05)
        yield proc, workers
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()


def _assert_gone(workers: set[int]) -> None:
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived the simulation"
        time.sleep(0.05)


def test_a_killed_simulation_takes_its_workers_with_it() -> None:
    """``isocost sim`` SIGKILLed mid-sweep: its pool's workers die with it (the kernel's
    parent-death signal), instead of simulating on, orphaned."""
    with _sweep() as (proc, workers):
        proc.kill()
        proc.wait(timeout=10)
        _assert_gone(workers)


def test_ctrl_c_stops_a_simulation_at_once_with_its_workers() -> None:
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) mid-sweep: the
    workers leave it to ``isocost sim``, which stops them and exits, instead of each
    worker handing the interrupt back as one task's result and going on to the next."""
    with _sweep() as (proc, workers):
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 130, stderr
        assert "Traceback" not in stderr, stderr
        _assert_gone(workers)
