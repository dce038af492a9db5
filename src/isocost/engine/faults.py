"""Fault injection of one ``isocost engine`` replica.

The fault set (``Faults``) comes from flags, spec fields or ``POST /admin/fault`` (the
body replaces the whole fault set; ``{}`` clears it): ``slowdown`` stretches every step,
``error_rate`` answers that share of completion requests with 500, ``hang`` holds every
request except ``/admin/*`` until cleared, ``max_waiting`` answers 503 + Retry-After while
the queue is that long, ``crash`` exits the process (code 70) right after answering,
``crash_after_handoff`` does so right after answering a prefill that hands its KV off.
``GET /admin/fault`` shows the current set. A new set takes effect at once: the step in
flight is re-timed to the new ``slowdown`` (``ServedReplica.set_faults``).
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Callable

from aiohttp import web

from isocost.engine.config import Faults
from isocost.engine.intake import expect_continue, read_body
from isocost.engine.model import EngineModel
from isocost.openai.errors import ApiError
from isocost.openai.requests import decode_body
from isocost.openai.responses import json_response

__all__ = ["FaultInjector", "add_fault_routes", "answer_and_exit"]

_CRASH_EXIT_CODE = 70


class FaultInjector:
    """One replica's fault set, applied to its completion requests (admission, errors,
    hangs); ``model`` is read for its queue length.

    ``rng`` is the replica's seeded generator (shared with its output lengths), so a
    seeded run draws the same failures.
    """

    def __init__(self, model: EngineModel, rng: random.Random) -> None:
        self.model = model
        self.faults = Faults()
        self.unhung = asyncio.Event()
        self.unhung.set()
        self._rng = rng

    def set(self, faults: Faults) -> None:
        """Take ``faults`` for admission and hangs; the model's ``slowdown`` is set with
        the model's clock by ``ServedReplica.set_faults``, which calls this."""
        self.faults = faults
        if faults.hang:
            self.unhung.clear()
        else:
            self.unhung.set()

    def check_admission(self) -> None:
        """ApiError for a completion request the faults refuse: queue cap (503) or an
        injected failure (500)."""
        cap = self.faults.max_waiting
        if cap is not None and self.model.num_waiting >= cap:
            raise ApiError(
                503, "the replica's queue is full", type_="server_error", code="overloaded"
            )
        if self.faults.error_rate > 0 and self._rng.random() < self.faults.error_rate:
            raise ApiError(500, "injected engine failure", type_="server_error", code="internal")


async def answer_and_exit(request: web.Request, response: web.StreamResponse) -> None:
    """Send ``response`` whole, then end the process at once (an injected crash: every
    replica of the process dies, held requests and KV with it)."""
    await response.prepare(request)
    await response.write_eof()
    os._exit(_CRASH_EXIT_CODE)


def add_fault_routes(
    app: web.Application, injector: FaultInjector, apply: Callable[[Faults], None]
) -> None:
    """``GET`` and ``POST /admin/fault`` for ``injector``'s replica; ``apply`` sets a new
    fault set on it."""

    async def get_fault(request: web.Request) -> web.Response:
        return json_response(injector.faults)

    async def post_fault(request: web.Request) -> web.StreamResponse:
        faults = decode_body(await read_body(request) or b"{}", Faults)
        problem = faults.problem()
        if problem:
            raise ApiError(400, f"{problem[0]} {problem[1]}", param=problem[0])
        apply(faults)
        response = json_response(faults)
        if faults.crash:
            await answer_and_exit(request, response)
        return response

    app.router.add_get("/admin/fault", get_fault, expect_handler=expect_continue)
    app.router.add_post("/admin/fault", post_fault, expect_handler=expect_continue)
