"""The gateway's ``/dashboard`` in headless Chromium while real traffic flows.

A real cluster (one ``isocost engine`` process with three replicas, one slowed, and an
``isocost serve`` gateway, started by the demo's own process helpers) serves a steady
``isocost bench`` load; Debian's ``/usr/bin/chromium``, driven by Playwright (no browser
download), opens the page. ``make test`` installs both on a fresh machine.
The screenshot lands in ``test-artifacts/dashboard.png``.
"""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from isocost_procs import free_port
from playwright.sync_api import BrowserContext, Page, sync_playwright

from isocost.demo._cluster import ClusterSettings, DemoReplica, start_cluster
from isocost.runtime.config import SloConfig
from isocost.runtime.processes import Services

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TOKEN = "dashboard-e2e-token-7c1f"
LAYOUT = (
    DemoReplica("fast-h100", "h100-80g"),
    DemoReplica("fast-a100", "a100-80g"),
    DemoReplica("slow-l20", "l20-48g", slowdown=3.0),
)

pytestmark = pytest.mark.skipif(
    not CHROMIUM.is_file(), reason="needs Debian's chromium at /usr/bin/chromium (make test)"
)


@dataclass(frozen=True)
class Live:
    url: str


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """A cluster under a steady open-loop load for the whole module."""
    out = tmp_path_factory.mktemp("dashboard")
    services = Services(out / "logs")
    settings = ClusterSettings(
        model="llama-3.1-8b",
        layout=LAYOUT,
        time_scale=1.0,
        stream_interval=1,
        gateway_host="127.0.0.1",
        gateway_port=free_port(),
        admin_token=TOKEN,
        seed=0,
        slo=SloConfig(ttft_ms=2000, tpot_ms=100),
    )
    try:
        cluster = start_cluster(services, settings, "equal_cost", out)
        load = ["bench", "--url", cluster.url, "--workload", "mix", "--rate", "3"]
        services.start("bench", [*load, "--duration", "240", "--max-prompt-tokens", "2048"])
        yield Live(cluster.url)
    finally:
        services.stop_all()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[BrowserContext]:
    """A fresh headless Chromium profile (a new user-data-dir per test)."""
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            yield context
        finally:
            context.close()


def _watch_errors(page: Page) -> list[str]:
    """Page errors and console errors, collected as they happen."""
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    return errors


def test_dashboard_shows_replicas_and_live_numbers(live: Live, browser: BrowserContext) -> None:
    page = browser.new_page()
    errors = _watch_errors(page)
    page.goto(f"{live.url}/dashboard#token={TOKEN}")

    page.wait_for_function(
        "n => document.querySelectorAll('#replicas tbody tr').length === n", arg=len(LAYOUT)
    )
    names = page.eval_on_selector_all(
        "#replicas tbody tr", "rows => rows.map(r => r.dataset.replica)"
    )
    assert names == [r.name for r in LAYOUT]
    assert "token" not in page.url  # the secret left the address bar
    assert page.get_attribute("#status", "data-state") == "live"

    # Live: the replica figures change between polls while the load runs.
    before = page.inner_text("#replicas tbody")
    page.wait_for_function(
        "before => document.querySelector('#replicas tbody').innerText !== before",
        arg=before,
        timeout=30_000,
    )
    # Every replica's prefill duty (the shadow state's, so known from the start) is shown.
    duties = page.eval_on_selector_all(
        "#replicas td.prefill-duty", "cells => cells.map(c => c.textContent)"
    )
    assert len(duties) == len(LAYOUT) and all(re.fullmatch(r"\d+ %", d) for d in duties), duties
    # ... and the prefill terms it is priced with (ms per request / chunk / 1k tokens /
    # running sequence).
    terms = page.eval_on_selector_all(
        "#replicas td.prefill-terms", "cells => cells.map(c => c.textContent)"
    )
    number = r"[\d,]+(\.\d)?"
    shape = rf"{number} / {number} / {number} / {number}"
    assert len(terms) == len(LAYOUT) and all(re.fullmatch(shape, t) for t in terms), terms
    # Decisions carry each plugin's score; the policy is the one configured.
    page.wait_for_selector("#decisions tbody tr td.scores div")
    first_decision = page.inner_text("#decisions tbody tr")
    assert "equal_cost" in first_decision
    assert "equal-cost-scorer" in first_decision
    # ... and what it read about each candidate: equal_cost reads them all.
    read = r"cached [\d,]+, queued [\d,]+, running [\d,]+, TTFT ms [\d,.]+"
    assert re.search(read, first_decision), first_decision
    assert page.inner_text("#pools").count("llama-3.1-8b") == 1
    # The gateway judges every answer by the pool's SLO: a share of the last minute's.
    page.wait_for_function(
        "() => /^\\d+(\\.\\d)? %$/.test(document.querySelector('#pools .pool-slo').textContent)",
        timeout=30_000,
    )
    # No state bus: no divergence, and the status says nothing of one.
    divergences = page.eval_on_selector_all(
        "#replicas td.divergence", "cells => cells.map(c => c.textContent)"
    )
    assert divergences == ["–"] * len(LAYOUT)
    assert "state bus" not in page.inner_text("#status")
    polls = int(page.get_attribute("#status", "data-polls") or 0)
    page.wait_for_function(
        "n => Number(document.querySelector('#status').dataset.polls) > n", arg=polls
    )

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    assert errors == []


def test_dashboard_asks_for_the_token_and_refuses_a_wrong_one(
    live: Live, browser: BrowserContext
) -> None:
    page = browser.new_page()
    errors = _watch_errors(page)
    page.goto(f"{live.url}/dashboard")
    page.wait_for_selector("#token-form", state="visible")
    assert page.get_attribute("#status", "data-state") == "auth"
    assert page.query_selector_all("#replicas tbody tr") == []

    page.fill("#token-input", "not-the-token")
    page.click("#token-form button")
    # A function, not an expression: the page's CSP forbids eval of expression strings.
    page.wait_for_function(
        "() => document.querySelector('#status').textContent.includes('refused')"
    )
    assert page.is_visible("#token-form")

    page.fill("#token-input", TOKEN)
    page.click("#token-form button")
    page.wait_for_function(
        "n => document.querySelectorAll('#replicas tbody tr').length === n", arg=len(LAYOUT)
    )
    assert page.is_hidden("#token-form")
    # The browser's 401 for the wrong token is the only console error allowed.
    assert all("401" in e for e in errors), errors


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_dashboard_assets_are_self_contained(live: Live) -> None:
    status, headers, page = _get(f"{live.url}/dashboard")
    assert status == 200
    assert headers["Content-Type"].startswith("text/html")
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    for asset, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        assert f"/dashboard/{asset}".encode() in page
        status, headers, body = _get(f"{live.url}/dashboard/{asset}")
        assert status == 200
        assert headers["Content-Type"].startswith(kind)
        # Works offline: nothing is loaded from another origin.
        assert b"http://" not in body and b"https://" not in body
    status, headers, body = _get(f"{live.url}/dashboard/secrets.txt")
    assert status == 404
    assert b'"error"' in body
