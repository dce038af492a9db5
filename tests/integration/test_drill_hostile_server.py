"""`isocost drill` against an admin API that answers in the wrong shape (another version of
the gateway, the wrong port): one DrillError line naming what is wrong, never a traceback,
and no redirect followed with the admin token."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from gateway_harness import serving
from hostile_openai import hostile_app, in_thread

from isocost.drill import DrillError, DrillOptions, run_drill

ISOCOST = Path(sys.executable).with_name("isocost")
Body = Callable[[str], Any]  # the /admin/replicas JSON, given the server's own URL


def _row(url: str, **fields: object) -> dict[str, object]:
    return {"url": url, "name": "r0", "pool": "m", "state": "healthy", "in_flight": 0} | fields


def _admin(body: Body, status: int = 200) -> tuple[web.Application, list[str]]:
    """A hostile server whose /admin/replicas answers ``body``; and a slot for its URL."""
    url: list[str] = []

    async def replicas() -> web.StreamResponse:
        return web.json_response(body(url[0]), status=status)

    return hostile_app(replicas=replicas), url


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (lambda u: [1], "Expected `object`, got `array`"),
        (lambda u: {"rows": []}, "missing required field `replicas`"),
        (lambda u: {"replicas": ["r0"]}, "at `$.replicas[0]`"),
        (lambda u: {"replicas": [{"name": "r0"}]}, "missing required field `url`"),
        (lambda u: {"replicas": [_row(u, state=None)]}, "at `$.replicas[0].state`"),
        (lambda u: {"replicas": [_row(u, pool=5)]}, "at `$.replicas[0].pool`"),
        (lambda u: {"replicas": [_row(u, ttft_factor="x")]}, "at `$.replicas[0].ttft_factor`"),
        (lambda u: {"replicas": [_row(u, in_flight="x")]}, "at `$.replicas[0].in_flight`"),
        (lambda u: {"replicas": [_row(u, pool=None)]}, "names no model pool"),
    ],
)
def test_a_replica_list_of_the_wrong_shape_is_one_drill_error(body: Body, message: str) -> None:
    app, slot = _admin(body)
    assert message in drill_error(app, slot)


def test_a_redirect_is_not_followed_with_the_admin_token() -> None:
    async def redirect() -> web.StreamResponse:
        return web.Response(status=302, headers={"location": "http://127.0.0.1:9/steal"})

    error = drill_error(hostile_app(replicas=redirect))
    assert "answered 302: redirects to http://127.0.0.1:9/steal (not followed)" in error


def drill_error(app: web.Application, urls: list[str] | None = None) -> str:
    """The ``DrillError`` a drill raises against ``app`` as its gateway and replica admin
    (its URL appended to ``urls`` once it listens, for an app that names itself)."""

    async def scenario() -> None:
        async with serving(app) as url:
            if urls is not None:
                urls.append(url)
            await run_drill(url, [url], DrillOptions(fault="errors", admin_token="t"))

    with pytest.raises(DrillError) as raised:
        asyncio.run(scenario())
    return str(raised.value)


def drill_refused(url: str) -> str:
    """``isocost drill`` on a gateway at ``url``: exit 2 and its one error line."""
    done = subprocess.run(
        [str(ISOCOST), "drill", "--gateway", url, "--replica-admin", url, "--fault", "kill"],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "ISOCOST_ADMIN_TOKEN": "t", "COLUMNS": "200"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_the_cli_ends_a_wrong_shape_in_one_line() -> None:
    app, slot = _admin(lambda u: {"replicas": [{"name": "r0"}]})
    with in_thread(app) as url:
        slot.append(url)
        assert "not an isocost replica list" in drill_refused(url)
