"""Soak (opt-in: ``pytest -m soak``): minutes of steady load, no growth in memory or sockets.

Four engines and a gateway under the load generator's steady Poisson load, in windows of
``WINDOW_S``; after each window the gateway's RSS and open file descriptors are read from
/proc. Pools and caches grow to the load's needs in the first half (keep-alive connections
follow the peak concurrency, which a busy machine raises); the second half must sit on
that plateau: no more than a small margin above the first half's peak. ``ISOCOST_SOAK_S``
sets the length (default 180 s).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from cluster import API_KEY, MODEL, open_fds, rss_bytes, start_cluster

from isocost.bench import BenchOptions, WorkloadSpec, build_workload, run_bench
from isocost.workload import SyntheticSpec

SOAK_S = float(os.environ.get("ISOCOST_SOAK_S", "180"))
WINDOW_S = 15.0


@pytest.mark.soak
@pytest.mark.timeout(SOAK_S + 120)
def test_soak_keeps_memory_and_connections_flat(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path, 4)
    try:
        pid = cluster.gateway.pid
        samples: list[tuple[int, int]] = []
        windows = max(4, round(SOAK_S / WINDOW_S))
        for window in range(windows):
            spec = WorkloadSpec(
                synthetic=SyntheticSpec("mix", max_prompt_tokens=512), rate_rps=20, seed=window
            )
            options = BenchOptions(
                model=MODEL, max_tokens=64, duration_s=WINDOW_S, api_key=API_KEY, timeout_s=60
            )
            result = asyncio.run(
                run_bench(cluster.gateway.url, build_workload(spec, False), options)
            )
            assert result.summary.errors == 0, result.summary.errors_by_kind
            samples.append((rss_bytes(pid), open_fds(pid)))
        print("soak (RSS MiB, fds) per window:", [(r >> 20, f) for r, f in samples])
        first, second = samples[: windows // 2], samples[windows // 2 :]
        assert max(r for r, _ in second) - max(r for r, _ in first) < 8 * 2**20
        assert max(f for _, f in second) <= max(f for _, f in first) + 8
    finally:
        cluster.close()
