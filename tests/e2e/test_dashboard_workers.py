"""The dashboard of ``serve --workers 2`` in headless Chromium: its status line says how
many workers the figures count (the snapshot sums their requests) and which one
answered, whichever worker the page's connection reached."""

from __future__ import annotations

from pathlib import Path

import pytest
from gateway_harness import gateway_config
from isocost_procs import Proc, start_isocost
from process_fixtures import procs
from test_dashboard import CHROMIUM, _watch_errors, browser

pytestmark = pytest.mark.skipif(
    not CHROMIUM.is_file(), reason="needs Debian's chromium at /usr/bin/chromium (make test)"
)
__all__ = ["browser", "procs"]  # the fixtures, imported
MODEL = "llama-3.1-8b"
TOKEN = "dashboard-workers-token-2b9e"


def test_the_status_names_the_workers_counted(
    tmp_path: Path, procs: list[Proc], browser: object
) -> None:
    engine = start_isocost(
        ["engine", "--port", "0", "--model", MODEL, "--gpu", "a100-80g"], "isocost engine"
    )
    procs.append(engine)
    config = tmp_path / "gateway.yaml"
    config.write_text(gateway_config([engine.url], model=MODEL, admin_token=TOKEN, api_key="k"))
    args = ["serve", "--config", str(config), "--port", "0", "--workers", "2"]
    with (tmp_path / "gateway.log").open("a") as log:
        procs.append(gateway := start_isocost(args, "isocost serve", stderr=log))
    page = browser.new_page()  # type: ignore[attr-defined]
    errors = _watch_errors(page)
    page.goto(f"{gateway.url}/dashboard#token={TOKEN}")
    page.wait_for_function(
        "re => new RegExp(re).test(document.querySelector('#status').textContent)",
        arg=" · 2 workers, answered by [01]$",
    )
    assert page.get_attribute("#status", "data-state") == "live"
    assert errors == []
