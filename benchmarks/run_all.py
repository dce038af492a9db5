"""Run every benchmark once, in turn, with the settings the README quotes (`make bench`).

Each benchmark measures its comparison side by side inside its own run; this script only
sequences them and stops at the first that fails. The live peer comparison
(`benchmarks/peers/run.sh`, ~10 minutes, installs the peer routers) runs with `--peers`,
the equal-terms capacity comparison (`benchmarks/equal_terms/run.sh`, ~60 minutes, reads
the traces in ../shared/traces) with `--equal-terms`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

RUNS: list[list[str]] = [
    ["engine_model_jump.py", "--requests", "2000"],
    ["engine_throughput.py", "--concurrency", "64,256,1024", "--stream-interval", "1,8",
     "--duration", "6"],
    ["scheduling_decision.py", "--replicas", "1000", "--young", "1000", "--old", "5000",
     "--probes", "500"],
    ["gateway_overhead.py", "--requests", "300", "--duration", "5"],
    ["stream_relay.py"],
    ["sim_scale.py"],
    ["discovery/watch_overhead.py", "--requests", "400"],
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
        done = subprocess.run(command, check=False)
        print(f"=== exit {done.returncode} after {time.monotonic() - started:.0f} s", flush=True)
        if done.returncode != 0:
            return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
