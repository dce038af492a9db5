"""What the HTTP test suites share around ``isocost serve``: its config, one request, a poll.

``gateway_config``: fast health checks and short timeouts (a test notices a dead replica
in well under a second), a small body limit, an admin token and one API key (``team-a``).
Suites add their own lines: per-replica fields, more ``limits``, ``health`` and
``api_keys`` entries.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web


def gateway_config(
    engine_urls: Sequence[str],
    *,
    model: str,
    admin_token: str,
    api_key: str,
    policy: str = "equal_cost",
    replica_fields: str = "",
    limits: str = "",
    health: str = "",
    keys: str = "",
    key_fields: str = "",
    max_body_bytes: int = 64 * 1024,
    max_tokens: int = 4096,
    health_timeout_ms: int = 500,
    pool_fields: str = "",
) -> str:
    """YAML for one pool of ``model`` over ``engine_urls``; the extra strings are indented
    lines appended to their sections (``replica_fields``: ``key: value, ...`` per replica,
    ``pool_fields``: ``key: value`` lines of the pool, ``key_fields``: of key team-a)."""
    fields = f", {replica_fields}" if replica_fields else ""
    replicas = "\n".join(f"      - {{url: '{url}'{fields}}}" for url in engine_urls)
    return f"""
policy: {policy}
scrape_interval_ms: 100
pools:
  - model: {model}
{pool_fields}
    replicas:
{replicas}
limits:
  max_body_bytes: {max_body_bytes}
  max_tokens: {max_tokens}
  max_prompt_tokens: 8000
  retry_backoff_ms: 5
  body_timeout_ms: 1000
{limits}
health:
  interval_ms: 100
  timeout_ms: {health_timeout_ms}
  open_ms: 300
{health}
auth:
  admin_token: {admin_token}
  api_keys:
    - name: team-a
      key: {api_key}
{key_fields}
{keys}
"""


def pd_gateway_config(
    roles: dict[str, str], mode: str, *, admin_token: str, api_key: str, model: str, pool: str = ""
) -> str:
    """``gateway_config`` for a P/D pool: each engine URL with its ``role``, the pool
    disaggregating in ``mode`` (``pool``: more ``key: value`` lines of the pool)."""
    fields = f"    disaggregation: {mode}" + (f"\n{pool}" if pool else "")
    text = gateway_config(
        list(roles), model=model, admin_token=admin_token, api_key=api_key, pool_fields=fields
    )
    for url, role in roles.items():
        text = text.replace(f"{{url: '{url}'}}", f"{{url: '{url}', role: {role}}}")
    return text


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


def metric_value(url: str, series: str) -> float | None:
    """The value of ``series`` on ``url``'s /metrics: a name, with its labels as the
    exposition writes them where it has any; None when it is not there."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def admin_replicas(url: str, token: str) -> list[dict[str, Any]]:
    """The rows of a gateway's ``GET /admin/replicas`` (asserted answered)."""
    status, _, body = http(
        "GET", url + "/admin/replicas", headers={"Authorization": f"Bearer {token}"}
    )
    assert status == 200, body
    rows: list[dict[str, Any]] = body["replicas"]
    return rows


def log_records(text: str | Path) -> list[dict[str, Any]]:
    """The records of an isocost JSON log (its text, or its path). Lines that are no JSON
    object are skipped: a process still running may be halfway through writing the last
    one when a test reads it."""
    if isinstance(text, Path):
        text = text.read_text()
    found = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            found.append(record)
    return found


def log_events(log: Path, event: str) -> list[dict[str, Any]]:
    """The records of ``event`` in an isocost JSON log (``log_records``)."""
    return [record for record in log_records(log) if record.get("event") == event]


def wait_for(
    predicate: Callable[[], bool],
    timeout_s: float = 20,
    what: str = "",
    *,
    interval_s: float = 0.05,
    state: Callable[[], object] | None = None,
) -> None:
    """Poll ``predicate`` every ``interval_s`` until it holds; fail after ``timeout_s``, the
    message showing ``state()`` (what was last seen) when given. The one polling loop of
    the test suites (a condition, a ``/health`` answer)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            seen = "" if state is None else f"; saw {state()}"
            raise AssertionError(f"timed out waiting for {what}{seen}")
        time.sleep(interval_s)


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """``app`` on a random port of 127.0.0.1 in this event loop; its base URL."""
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
