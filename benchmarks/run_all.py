"""Run every benchmark once, in turn, with the settings the README quotes (`make bench`).

Each benchmark measures its comparison side by side inside its own run; this script only
sequences them and stops at the first that fails. The live peer comparison
(`benchmarks/peers/run.sh`, ~10 minutes, installs the peer routers) runs with `--peers`,
the equal-terms capacity comparison (`benchmarks/equal_terms/run.sh`, ~60 minutes, reads
the traces in ../shared/traces) with `--equal-terms`.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

from isocost.runtime.processes import run_script

HERE = Path(__file__).resolve().parent
STOP_GRACE_S = 120.0  # an interrupted benchmark's time to stop what it started

RUNS: list[list[str]] = [
    ["engine_model_jump.py", "--requests", "2000"],
    ["engine_throughput.py", "--concurrency", "64,256,1024", "--stream-interval", "1,8",
     "--duration", "6"],
    ["scheduling_decision.py", "--replicas", "1000", "--young", "1000", "--old", "5000",
     "--probes", "500"],
    ["gateway_overhead.py", "--requests", "300", "--duration", "5"],
    ["stream_relay.py"],
    ["grpc_floor.py", "--streams", "3000"],
    ["sim_scale.py"],
    ["discovery/watch_overhead.py", "--requests", "400"],
    ["fairness.py"],
]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", action="store_true", help="also run benchmarks/peers")
    parser.add_argument(
        "--equal-terms", action="store_true", help="also run benchmarks/equal_terms"
    )
    args = parser.parse_args()
    runs = [[sys.executable, str(HERE / name), *rest] for name, *rest in RUNS]
    if args.peers:
        runs.append(["bash", str(HERE / "peers" / "run.sh")])
    if args.equal_terms:
        runs.append(["bash", str(HERE / "equal_terms" / "run.sh")])
    for command in runs:
        print(f"\n=== {' '.join(Path(part).name if '/' in part else part for part in command)}",
              flush=True)  # fmt: skip
        started = time.monotonic()
        code = run_benchmark(command)
        print(f"=== exit {code} after {time.monotonic() - started:.0f} s", flush=True)
        if code != 0:
            return code
    return 0


def run_benchmark(command: list[str]) -> int:
    """``command``'s exit code. It runs in a session of its own, so that an interrupt
    reaches it once, from here, as SIGTERM (which each benchmark takes as Ctrl-C), and
    it gets to stop what it started: ``subprocess.run`` would SIGKILL it 0.25 s after
    a Ctrl-C, leaving its engines running."""
    child = subprocess.Popen(command, start_new_session=True)
    try:
        return child.wait()
    except KeyboardInterrupt:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        raise


if __name__ == "__main__":
    run_script(main)
