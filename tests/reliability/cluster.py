"""A local cluster for the reliability tests: N ``isocost engine`` processes and a gateway.

Each engine is its own process (the ``crash`` fault ends the whole process), started on a
free port through the installed CLI and waited for by its ``ready at URL`` line; the
gateway logs to a file the tests can read. ``close`` stops everything with SIGTERM (SIGKILL
after 20 s), so no process outlives a test.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
) -> str:
    """Fast health checks, short timeouts, an admin token and one API key."""
    replicas = "\n".join(f"      - {{url: '{url}', gpu: {gpu}}}" for url in engine_urls)
    return f"""
policy: {policy}
scrape_interval_ms: 100
pools:
  - model: {MODEL}
    replicas:
{replicas}
limits:
  max_body_bytes: 65536
  max_tokens: {max_tokens}
  max_prompt_tokens: 8000
  retry_backoff_ms: 5
  body_timeout_ms: 1000
  idle_timeout_ms: {idle_timeout_ms}
{limits}
health:
  interval_ms: 100
  timeout_ms: 300
  open_ms: 300
auth:
  admin_token: {ADMIN_TOKEN}
  api_keys:
    - name: team-a
      key: {API_KEY}
{keys}
"""


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


def http(
    method: str,
    url: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 30,
) -> tuple[int, dict[str, str], Any]:
    """One request; status, headers and the JSON body (None when empty)."""
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, got, raw = response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        status, got, raw = exc.code, dict(exc.headers), exc.read()
    return status, got, json.loads(raw) if raw else None


def replica_rows(gateway: Proc) -> dict[str, dict[str, Any]]:
    status, _, body = http("GET", gateway.url + "/admin/replicas", headers=ADMIN)
    assert status == 200, body
    return {row["url"]: row for row in body["replicas"]}


def wait_for(predicate: Callable[[], bool], timeout_s: float = 20, what: str = "") -> None:
    """Poll ``predicate`` every 50 ms until it holds; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))
