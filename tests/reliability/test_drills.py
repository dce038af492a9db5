"""Fault drills as tests: `isocost drill`'s engine against four real engine processes.

Each test starts four ``isocost engine`` processes and a gateway, keeps a steady stream of
requests going through the load generator and injects one fault through the engine's
``/admin/fault``; the assertions read the drill's report, which comes from the gateway's
admin API and the load generator's per-request records.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import (
    ADMIN_TOKEN,
    API_KEY,
    AUTH,
    MODEL,
    Cluster,
    http,
    replica_rows,
    start_cluster,
    start_engine,
)
from isocost_procs import ISOCOST

from isocost.drill import DrillOptions, DrillReport, run_drill


def drill(cluster: Cluster, target: str, **fields: object) -> DrillReport:
    """Run one drill against ``cluster``, restarting a crashed engine on its own port."""

    async def restart(url: str) -> None:
        port = int(url.rsplit(":", 1)[1])
        cluster.extra.append(await asyncio.to_thread(start_engine, port))

    defaults: dict[str, object] = {
        "admin_token": ADMIN_TOKEN,
        "api_key": API_KEY,
        "rate_rps": 16.0,
        "max_tokens": 192,
        "warmup_s": 1.5,
        "fault_s": 2.5,
        "settle_s": 10.0,
    }
    options = DrillOptions(**{**defaults, **fields})  # type: ignore[arg-type]
    return asyncio.run(run_drill(cluster.gateway.url, [target], options, restart=restart))


def completion(max_tokens: int = 16) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": max_tokens}).encode()


@pytest.fixture
def round_robin(tmp_path: Path) -> Iterator[Cluster]:
    """Round robin: every replica carries a quarter of the load when the fault comes."""
    cluster = start_cluster(tmp_path, 4, policy="round_robin")
    try:
        yield cluster
    finally:
        cluster.close()


def test_kill_loses_nothing_cuts_no_stream_and_ejects_within_a_second(
    round_robin: Cluster,
) -> None:
    # long answers: several streams are flowing on the target when it is killed
    target = round_robin.engines[0].url
    report = drill(round_robin, target, fault="kill", ignore_eos=True, max_tokens=1000)
    assert round_robin.engines[0].popen.wait(timeout=10) == 70  # the crash fault's exit code
    assert report.lost == 0
    # the streams flowing from the killed replica went on elsewhere, none was cut
    assert report.streams_cut == 0 and report.errors_by_kind == {}, report
    assert report.completed == report.requests
    assert report.streams_resumed > 0
    assert report.resumed_exact == report.streams_resumed  # usage: exactly max_tokens each
    assert report.detected_after_s is not None and report.detected_after_s <= 1.0
    assert report.share_before is not None and report.share_before > 0.15
    assert report.share_during is not None and report.share_during < 0.1
    assert replica_rows(round_robin.gateway)[round_robin.engines[0].url]["state"] == "ejected"


def test_hang_is_detected_by_timeouts_and_health_and_drained(round_robin: Cluster) -> None:
    report = drill(round_robin, round_robin.engines[0].url, fault="hang", fault_s=5.0)
    assert report.detected_after_s is not None
    assert report.drained_after_s is not None
    assert report.lost == 0  # requests held by the hung replica timed out and went elsewhere
    assert set(report.errors_by_kind) <= {"stream_error"}
    assert report.recovered_after_s is not None  # healthy again once the hang is cleared


def test_cli_error_rate_drill_ejects_and_a_live_probe_readmits(round_robin: Cluster) -> None:
    """Through ``isocost drill --json``, as an operator runs it."""
    result = subprocess.run(
        [
            ISOCOST,
            "drill",
            "--gateway",
            round_robin.gateway.url,
            "--replica-admin",
            round_robin.engines[0].url,
            "--fault",
            "errors",
            "--rate",
            "16",
            "--max-tokens",
            "192",
            "--warmup",
            "1.5",
            "--fault-duration",
            "2.5",
            "--api-key-env",
            "DRILL_KEY",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=90,
        env={"ISOCOST_ADMIN_TOKEN": ADMIN_TOKEN, "DRILL_KEY": API_KEY, "PATH": ""},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["fault"] == "errors"
    assert report["lost"] == 0  # 500s before the first token are retried on another replica
    assert report["errors_by_kind"] == {}
    assert report["detected_after_s"] is not None
    assert report["recovered_after_s"] is not None


def test_restarted_replica_is_readmitted_once_healthy(round_robin: Cluster) -> None:
    report = drill(round_robin, round_robin.engines[0].url, fault="restart")
    assert report.lost == 0
    assert report.detected_after_s is not None and report.detected_after_s <= 1.0
    assert report.recovered_after_s is not None
    restarted = round_robin.extra[0]
    assert restarted.url == round_robin.engines[0].url
    served = Counter(
        row["name"]
        for row in replica_rows(round_robin.gateway).values()
        if row["state"] == "healthy"
    )
    assert len(served) == 4


def test_slowed_replica_is_flagged_and_loses_traffic(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path, 4, policy="equal_cost")
    try:
        # slow down the replica equal-cost prefers, so that its share has room to fall
        names = Counter(
            http("POST", cluster.gateway.url + "/v1/completions", completion(), AUTH)[1][
                "x-isocost-replica"
            ]
            for _ in range(8)
        )
        preferred = names.most_common(1)[0][0]
        target = next(
            u for u, row in replica_rows(cluster.gateway).items() if row["name"] == preferred
        )
        report = drill(cluster, target, fault="slow", slowdown=3.0, fault_s=5.0, settle_s=1.0)
        assert report.detected_after_s is not None
        assert report.max_factor_ratio is not None and report.max_factor_ratio >= 1.5
        assert report.share_before is not None and report.share_during is not None
        assert report.share_during < report.share_before
        assert report.lost == 0 and report.errors_by_kind == {}
    finally:
        cluster.close()
