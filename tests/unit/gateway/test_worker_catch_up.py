"""A restarted worker's catch-up (``WorkerGroup.catch_up``) against siblings that answer
``GET /admin/changes`` with the wrong shape: each such sibling is skipped, logged, and
the next one's changes are made, instead of a KeyError or TypeError ending the start."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
from aiohttp import web
from gateway_harness import serving

from isocost.gateway.workers import SIBLING_HEADER, WorkerGroup

GOOD = {
    "changes": [
        {"method": "POST", "path": "/admin/replicas/a/drain", "body": ""},
        {"method": "PUT", "path": "/admin/policy", "body": '{"policy": "round_robin"}'},
    ],
    "complete": True,
}


@pytest.mark.parametrize(
    "wrong",
    [
        b"[]",
        b'{"changes": 5, "complete": true}',
        b'{"changes": [{"method": "POST"}], "complete": true}',
        b'{"changes": [], "complete": "yes"}',
        b'{"complete": true}',
        b"not json",
    ],
)
def test_a_sibling_answering_the_wrong_shape_is_skipped_for_the_next(
    tmp_path: Path, wrong: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    made: list[tuple[str, str, str, str | None]] = []

    async def sibling_wrong(request: web.Request) -> web.Response:
        return web.Response(body=wrong, content_type="application/json")

    async def sibling_good(request: web.Request) -> web.Response:
        return web.json_response(GOOD)

    async def own(request: web.Request) -> web.Response:
        made.append(
            (request.method, request.path_qs, await request.text(),
             request.headers.get(SIBLING_HEADER))
        )  # fmt: skip
        return web.Response(status=204)

    def app(handler: object, method: str = "GET") -> web.Application:
        application = web.Application()
        application.router.add_route(method, "/{tail:.*}", handler)  # type: ignore[arg-type]
        return application

    async def scenario() -> int:
        async with (
            serving(app(sibling_wrong)) as first,
            serving(app(sibling_good)) as second,
            serving(app(own, "*")) as own_url,
        ):
            (tmp_path / "worker-1.json").write_text(json.dumps({"url": first}))
            (tmp_path / "worker-2.json").write_text(json.dumps({"url": second}))
            group = WorkerGroup(0, tmp_path)
            return await group.catch_up(own_url, {"Authorization": "Bearer t"})

    with caplog.at_level(logging.WARNING, logger="isocost.gateway"):
        assert asyncio.run(scenario()) == 2
    assert made == [
        ("POST", "/admin/replicas/a/drain", "", "0"),
        ("PUT", "/admin/policy", '{"policy": "round_robin"}', "0"),
    ]
    logged = [r.__dict__ for r in caplog.records]
    assert [r["worker"] for r in logged if r.get("event") == "worker_catch_up_unreadable"] == [1]
