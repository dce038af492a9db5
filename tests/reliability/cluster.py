"""A local cluster for the reliability tests: N ``isocost engine`` processes and a gateway.

Each engine is its own process (the ``crash`` fault ends the whole process), started on a
free port through the installed CLI and waited for by its ``ready at URL`` line; the
gateway logs to a file the tests can read. ``close`` stops everything with SIGTERM (SIGKILL
after 20 s), so no process outlives a test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway_harness import gateway_config, http
from isocost_procs import Proc, start_isocost

ROOT = Path(__file__).resolve().parents[2]

MODEL = "llama-3.1-8b"
API_KEY = "sk-reliability-7c41d0e9"
ADMIN_TOKEN = "admin-reliability-3b9f"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
# 5x faster than an A100: streams last a fraction of a second, drills take seconds
ENGINE_ARGS = ["--model", MODEL, "--gpu", "a100-80g", "--time-scale", "0.2"]


def start(args: list[str], stderr: Any = None, timeout_s: float = 60) -> Proc:
    """Start ``isocost *args`` and wait for its ``ready at URL`` line."""
    return start_isocost(args, stderr=stderr, timeout_s=timeout_s)


def start_engine(port: int = 0, *extra: str) -> Proc:
    return start(["engine", "--port", str(port), *ENGINE_ARGS, *extra])


def config_text(
    engine_urls: list[str],
    *,
    policy: str = "equal_cost",
    limits: str = "",
    keys: str = "",
    max_tokens: int = 4096,
    gpu: str = "a100-80g",
    idle_timeout_ms: int = 1500,
    replica_fields: str = "",
) -> str:
    """The suites' gateway config with this suite's key, short idle timeout and GPU
    (``replica_fields``: more ``key: value`` fields of every replica)."""
    return gateway_config(
        engine_urls,
        model=MODEL,
        admin_token=ADMIN_TOKEN,
        api_key=API_KEY,
        policy=policy,
        replica_fields=f"gpu: {gpu}{', ' if replica_fields else ''}{replica_fields}",
        limits=f"  idle_timeout_ms: {idle_timeout_ms}\n{limits}",
        keys=keys,
        max_tokens=max_tokens,
        health_timeout_ms=300,
    )


@dataclass
class Cluster:
    engines: list[Proc]
    gateway: Proc
    config: Path
    log: Path
    extra: list[Proc] = field(default_factory=list)  # restarted engines

    @property
    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def close(self) -> None:
        for proc in [self.gateway, *self.engines, *self.extra]:
            proc.stop()


def start_cluster(
    tmp: Path,
    num_engines: int,
    *,
    policy: str = "equal_cost",
    limits: str = "",
    keys: str = "",
    gateway_args: tuple[str, ...] = (),
    engine_args: tuple[str, ...] = (),
    max_tokens: int = 4096,
    gpu: str = "a100-80g",
    idle_timeout_ms: int = 1500,
    replica_fields: str = "",
) -> Cluster:
    engines: list[Proc] = []
    try:
        engines = [start_engine(0, *engine_args) for _ in range(num_engines)]
        config, log = tmp / "gateway.yaml", tmp / "gateway.log"
        urls = [e.url for e in engines]
        config.write_text(
            config_text(
                urls,
                policy=policy,
                limits=limits,
                keys=keys,
                max_tokens=max_tokens,
                gpu=gpu,
                idle_timeout_ms=idle_timeout_ms,
                replica_fields=replica_fields,
            )
        )
        with log.open("a") as sink:
            args = ["serve", "--config", str(config), "--port", "0", *gateway_args]
            gateway = start(args, stderr=sink)
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return Cluster(engines, gateway, config, log)


def replica_rows(gateway: Proc) -> dict[str, dict[str, Any]]:
    status, _, body = http("GET", gateway.url + "/admin/replicas", headers=ADMIN)
    assert status == 200, body
    return {row["url"]: row for row in body["replicas"]}


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))
