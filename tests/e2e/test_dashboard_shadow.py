"""The dashboard's shadow lines in headless Chromium: a gateway on round_robin with
equal_cost as a candidate, two engines (one slowed 8x), real traffic; once a replay has
run, the pool card shows, under the running policy, the candidate's predicted P99 TTFT
and goodput change with the replay's size, as one of the ``/admin/snapshot`` answers the
page fetched has them (replays rerun each second, so the figures can move between a
snapshot read by the test and the one the page drew). Which way the change goes is
``tests/integration/test_gateway_shadow.py``'s to check: on these 30 requests, in a fresh
clone's ``make test`` with two workers, the replay once put equal_cost's P99 TTFT +192%
above round_robin's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from isocost_procs import Proc
from playwright.sync_api import Response, sync_playwright
from process_fixtures import procs
from shadow_cluster import ADMIN_TOKEN, MODEL, send_traffic, start_shadowed_gateway, wait_for_shadow
from test_dashboard import CHROMIUM, CHROMIUM_FLAGS

pytestmark = pytest.mark.skipif(
    not CHROMIUM.is_file(), reason="needs Debian's chromium at /usr/bin/chromium (make test)"
)
REQUESTS = 30
__all__ = ["procs"]  # the fixture, imported


def _signed_percent(ratio: float) -> str:
    percent = round(ratio * 100)
    return f"{'−' if percent < 0 else '+'}{abs(percent)}%"


def _shadow_line(shadow: dict[str, Any]) -> str | None:
    """The start of the equal_cost line the page draws from one snapshot's shadow entry;
    None before its replay covers every request."""
    if (shadow["replay"] or {}).get("requests") != REQUESTS:
        return None
    (candidate,) = shadow["candidates"]
    return (
        f"candidate equal_cost: P99 TTFT {_signed_percent(candidate['ttft_p99_change'])}, "
        f"goodput {_signed_percent(candidate['goodput_change'])} "
        f"(replay of {REQUESTS} requests, "
    )


def test_the_pool_card_shows_each_candidates_predicted_change(
    tmp_path: Path, procs: list[Proc]
) -> None:
    shadow = "{policies: [equal_cost], interval_s: 1, min_requests: 20}"
    gateway = start_shadowed_gateway(procs, tmp_path, shadow)
    send_traffic(gateway, REQUESTS)
    wait_for_shadow(
        gateway, lambda s: (s["replay"] or {}).get("requests") == REQUESTS, timeout_s=120
    )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_FLAGS,
        )
        try:
            page = browser.new_page()
            snapshots: list[Response] = []
            page.on("response", lambda response: snapshots.append(response))
            page.goto(f"{gateway.url}/dashboard#token={ADMIN_TOKEN}")
            line = page.wait_for_selector(".card .shadow-line[data-policy='equal_cost']")
            assert line is not None
            text = line.inner_text()
            lines = page.inner_text(".card").splitlines()
            # Response events reach Python after the page may have drawn from them; one
            # more snapshot's event means the drawn one's has been delivered.
            with page.expect_response(lambda r: r.url.endswith("/admin/snapshot")):
                pass
            answers = [r.json() for r in snapshots if r.url.endswith("/admin/snapshot") and r.ok]
            drawn = [_shadow_line(a["shadow"][MODEL]) for a in answers]
        finally:
            browser.close()
    assert any(text.startswith(e) for e in drawn if e) and text.endswith(" s ago)"), (text, drawn)
    policy_line = next(i for i, ln in enumerate(lines) if ln.startswith("policy "))
    assert lines[policy_line] == "policy round_robin"
    assert lines[policy_line + 1] == text  # next to the running policy
