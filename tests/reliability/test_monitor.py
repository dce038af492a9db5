"""The replica monitor against replicas whose ``/metrics`` is garbage, and dead replicas.

A fake upstream (its own process) serves ``NaN``, ``±Inf``, negative and huge samples, an
unknown or non-text charset, bytes that are not text; through all of it the gateway keeps
probing it: the problem shows as the replica's ``scrape_error`` (admin API) and in the log,
``/health`` failing ejects it, recovering readmits it. Dead replicas (refused, ``/health``
failing, ejected by failing requests) cost the monitor only the breaker's probes (cool-down,
doubled per failed probe), not a scrape per interval, and are readmitted when they recover.
"""

from __future__ import annotations

import itertools
import json
import math
import socket
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cluster import AUTH, MODEL, config_text, replica_rows, start
from fake_upstream import DEFAULT_METRICS, DEFAULT_MODE, hits, set_mode, start_fake_upstream
from gateway_harness import http, log_events, wait_for
from isocost_procs import Proc
from prometheus_client.parser import text_string_to_metric_families

DEAD_POOL = "qwen2.5-7b"
OPEN_S = 0.3  # health.open_ms of gateway_config: the first cool-down


@dataclass
class Watched:
    """A gateway whose one replica is a fake upstream."""

    upstream: Proc
    gateway: Proc
    log: Path

    def row(self) -> dict[str, Any]:
        return replica_rows(self.gateway)[self.upstream.url]

    def log_events(self, event: str) -> list[dict[str, Any]]:
        return log_events(self.log, event)


def start_gateway(tmp: Path, urls: list[str], dead_pool: Sequence[str] = ()) -> tuple[Proc, Path]:
    """A gateway over ``urls`` (model ``MODEL``) and, when given, a pool ``DEAD_POOL``."""
    config, log = tmp / "gateway.yaml", tmp / "gateway.log"
    text = config_text(urls)
    if dead_pool:
        rows = "".join(f"      - {{url: '{url}', gpu: a100-80g}}\n" for url in dead_pool)
        pool = f"  - model: {DEAD_POOL}\n    replicas:\n{rows}"
        text = text.replace("\nlimits:\n", f"\n{pool}limits:\n", 1)
    config.write_text(text)
    with log.open("a") as sink:
        gateway = start(["serve", "--config", str(config), "--port", "0"], stderr=sink)
    return gateway, log


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Watched]:
    upstream = start_fake_upstream()
    try:
        gateway, log = start_gateway(tmp_path_factory.mktemp("monitor"), [upstream.url])
    except BaseException:
        upstream.stop()
        raise
    try:
        yield Watched(upstream, gateway, log)
    finally:
        gateway.stop()
        upstream.stop()


def healthy_and_scraped(watched: Watched) -> bool:
    row = watched.row()
    return row["state"] == "healthy" and row["scrape_error"] is None


def gauges(running: str, waiting: str, extra: str = "") -> dict[str, Any]:
    """A fake upstream mode serving these two request gauges (and ``extra`` lines)."""
    text = f"vllm:num_requests_running {running}\nvllm:num_requests_waiting {waiting}\n"
    return {"metrics": text + extra}


# mode of the fake upstream -> what the replica's scrape_error must then say
GARBAGE: dict[str, tuple[dict[str, Any], str]] = {
    "nan_gauge": (gauges("NaN", "0"), "NaN"),
    "inf_gauge": (gauges("0", "+Inf"), "inf"),
    "minus_inf_kv": (gauges("0", "0", "vllm:kv_cache_usage_perc -Inf\n"), "inf"),
    "only_nan": (gauges("NaN", "nan"), "NaN"),
    "overflowing": (gauges("1e400", "0"), "inf"),
    "huge_gauge": (gauges("0", "1e300"), "clamped"),
    "huge_counter": (gauges("0", "0", "vllm:prefix_cache_queries_total 1e300\n"), "range"),
    "negative_gauge": (gauges("-3", "0"), "negative"),
    "unknown_charset": ({"metrics_content_type": "text/plain; charset=x-no-such"}, "charset"),
    "codec_not_text": ({"metrics_content_type": "text/plain; charset=rot13"}, "charset"),
    "bytes_not_text": ({"metrics_encoding": "utf-16"}, "utf-8"),
    "html": ({"metrics": "<html><body>502 Bad Gateway</body></html>"}, "no vLLM or SGLang"),
}


@pytest.mark.parametrize("kind", list(GARBAGE))
def test_garbage_metrics_are_a_scrape_error_and_health_checks_go_on(
    watched: Watched, kind: str
) -> None:
    mode, reported = GARBAGE[kind]
    url = watched.upstream.url
    set_mode(url, **DEFAULT_MODE)
    wait_for(lambda: healthy_and_scraped(watched), what="a clean start", state=watched.row)

    set_mode(url, **mode)
    wait_for(
        lambda: reported.lower() in (watched.row()["scrape_error"] or "").lower(),
        what=f"the scrape error of {kind}",
        state=watched.row,
    )
    assert any(reported.lower() in e["error"].lower() for e in watched.log_events("scrape_error"))

    set_mode(url, health=500)  # still probed: ejected
    wait_for(lambda: watched.row()["state"] == "ejected", what="ejection", state=watched.row)

    set_mode(url, health=200, metrics=DEFAULT_METRICS)  # and readmitted
    wait_for(lambda: watched.row()["state"] == "healthy", what="readmission", state=watched.row)

    set_mode(url, **DEFAULT_MODE)
    wait_for(lambda: healthy_and_scraped(watched), what="a clean scrape", state=watched.row)
    status, _, _ = http("GET", watched.gateway.url + "/health")
    assert status == 200
    assert sample(watched.gateway, "isocost_task_failures_total", task="monitor") == 0


def test_every_background_task_is_counted_by_name(watched: Watched) -> None:
    """The supervised tasks' failure counters exist from the start, at 0."""
    text = urllib.request.urlopen(watched.gateway.url + "/metrics", timeout=10).read().decode()
    for task in ("monitor", "config_watcher"):
        assert f'isocost_task_failures_total{{task="{task}"}} 0.0' in text


def sample(gateway: Proc, name: str, **labels: str) -> float:
    """The value of the gateway's sample ``name`` with ``labels`` (0 when absent)."""
    with urllib.request.urlopen(gateway.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def refusing_ports(count: int) -> list[socket.socket]:
    """Sockets bound to free ports without listening: a connection there is refused, and
    no other process can take the port while the socket stays open."""
    sockets = []
    for _ in range(count):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sockets.append(sock)
    return sockets


def test_dead_replicas_cost_only_the_breakers_probes_not_a_scrape_per_interval(
    tmp_path: Path,
) -> None:
    """100 refused ports and 3 replicas whose ``/health`` fails, beside one live replica
    scraped every 100 ms: once ejected, the dead get probes on the breaker's schedule
    (cool-down 0.3 s, doubled per failed probe) and no scrape at all."""
    refusing = refusing_ports(100)
    fakes = [start_fake_upstream() for _ in range(4)]
    live, unhealthy = fakes[0], fakes[1:]
    try:
        for fake in unhealthy:
            set_mode(fake.url, health=500)
        dead_urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in refusing]
        dead_urls += [fake.url for fake in unhealthy]
        gateway, _ = start_gateway(tmp_path, [live.url], dead_urls)
        try:
            check_dead_replicas_backoff(gateway, live, unhealthy, len(refusing))
        finally:
            gateway.stop()
    finally:
        for fake in fakes:
            fake.stop()
        for sock in refusing:
            sock.close()


def check_dead_replicas_backoff(
    gateway: Proc, live: Proc, unhealthy: list[Proc], num_refusing: int
) -> None:
    def rows() -> dict[str, dict[str, Any]]:
        return replica_rows(gateway)

    wait_for(
        lambda: all(r["state"] == "ejected" for r in rows().values() if r["pool"] == DEAD_POOL),
        what="every dead replica ejected",
        state=lambda: sorted({r["state"] for r in rows().values() if r["pool"] == DEAD_POOL}),
    )
    ejected_at = [hits(fake.url)[0] for fake in unhealthy]  # on each fake's own clock
    checks_before = dead_checks(gateway)
    window_start = time.monotonic()
    # a window as long as the live replica takes for 30 scrapes at its interval
    live_scrapes_before = len(paths(live, "/metrics"))
    wait_for(
        lambda: len(paths(live, "/metrics")) >= live_scrapes_before + 30,
        what="30 scrapes of the live replica",
    )
    checks = dead_checks(gateway) - checks_before
    window_s = time.monotonic() - window_start

    for fake, since in zip(unhealthy, ejected_at, strict=True):
        _, seen = hits(fake.url)
        assert [p for p, at in seen if at > since and p == "/metrics"] == []
        probes = [at for p, at in seen if at > since and p == "/health"]
        gaps = [b - a for a, b in itertools.pairwise(probes)]
        for i, gap in enumerate(gaps):  # the i-th cool-down since: at least 0.3 s * 2**i
            assert gap >= 0.9 * OPEN_S * 2**i, (i, gaps)

    # at most the probes that cool-downs of 0.3, 0.6, 1.2, ... s let into the window
    most_per_replica = 1 + math.log2(window_s / OPEN_S + 1)
    num_dead = num_refusing + len(unhealthy)
    assert checks <= num_dead * most_per_replica, (checks, window_s)
    # not silenced either: every one is probed again (cool-downs are at most 30 s)
    wait_for(lambda: dead_checks(gateway) >= checks_before + num_dead, 60, what="probes")

    # a dead replica that comes back is readmitted on its next probe, and scraped again
    revived = unhealthy[0]
    set_mode(revived.url, health=200)
    wait_for(lambda: rows()[revived.url]["state"] == "healthy", 40, what="readmission")
    scrapes = len(paths(revived, "/metrics"))
    wait_for(lambda: len(paths(revived, "/metrics")) >= scrapes + 5, what="scrapes again")


def paths(fake: Proc, path: str) -> list[float]:
    """When ``fake`` was sent ``path``, on its clock."""
    return [at for p, at in hits(fake.url)[1] if p == path]


def dead_checks(gateway: Proc) -> float:
    return sum(
        sample(gateway, "isocost_replica_checks_total", pool=DEAD_POOL, check=check)
        for check in ("probe", "live_probe", "scrape")
    )


def test_a_replica_ejected_by_its_answers_gets_live_probes_on_the_breakers_schedule_only(
    tmp_path: Path,
) -> None:
    """Live requests failing with 500 open the breaker; then only the one-token
    completions of half-open probes reach it, each cool-down twice the last, no scrape."""
    fake = start_fake_upstream()
    try:
        set_mode(fake.url, completion="status", status=500)
        gateway, _ = start_gateway(tmp_path, [fake.url])
        try:
            check_live_probe_backoff(gateway, fake)
        finally:
            gateway.stop()
    finally:
        fake.stop()


def check_live_probe_backoff(gateway: Proc, fake: Proc) -> None:
    def state() -> str:
        return str(replica_rows(gateway)[fake.url]["state"])

    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 4}).encode()

    def failing_request_ejects() -> bool:
        http("POST", gateway.url + "/v1/completions", body, AUTH)
        return state() == "ejected"

    wait_for(lambda: state() == "healthy", what="a healthy start")
    wait_for(failing_request_ejects, what="ejection by failing requests", state=state)
    since = hits(fake.url)[0]

    def probes() -> list[float]:
        return [at for p, at in hits(fake.url)[1] if at > since and p == "/v1/completions"]

    wait_for(lambda: len(probes()) >= 3, 30, what="three live probes")  # 0.3 + 0.6 + 1.2 s
    _, seen = hits(fake.url)
    assert [p for p, at in seen if at > since and p != "/v1/completions"] == []
    gaps = [b - a for a, b in itertools.pairwise(probes())]
    for i, gap in enumerate(gaps):
        assert gap >= 0.9 * OPEN_S * 2**i, (i, gaps)

    set_mode(fake.url, completion="ok")  # the next live probe readmits it
    wait_for(lambda: state() == "healthy", 40, what="readmission")
    scrapes = len(paths(fake, "/metrics"))
    wait_for(lambda: len(paths(fake, "/metrics")) >= scrapes + 5, what="scrapes again")
