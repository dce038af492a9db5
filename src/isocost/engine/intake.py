"""The HTTP edge of ``isocost engine`` below its routes: how long a client may take to send
a request, and OpenAI error JSON for what aiohttp refuses before any route runs.

* Head deadline: a connection must deliver a whole request head (request line and
  headers) within ``read_timeout_s`` of opening or of its previous answer, else it is
  closed. This is aiohttp's own keep-alive timer (``keepalive_timeout``), armed when a
  connection opens and again after each answer and firing only while no request is in
  hand; so an idle keep-alive connection closes after as long. Nothing is answered: a
  client whose head never ends has no request to answer (nginx's client_header_timeout
  closes the same way).
* Body deadline: ``read_body`` waits ``read_timeout_s`` for the body, then answers 408
  ``body_timeout`` and closes the connection; a body its ``Content-Encoding`` cannot
  decode is a 400 ``bad_body``.
* Parser refusals and ``Expect`` as the gateway answers them (``isocost.openai.http``):
  OpenAI error JSON, and ``100 Continue`` at once (the engine checks nothing first).
"""

from __future__ import annotations

import asyncio
import logging
from typing import cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from isocost.openai.http import JsonErrorHandler, read_whole, refuse_expectation, send_continue

__all__ = ["READ_TIMEOUT", "expect_continue", "listen", "read_body"]

READ_TIMEOUT = web.AppKey("read_timeout_s", float)  # the application's body deadline


async def read_body(request: web.Request) -> bytes:
    """The whole (decoded) body within the application's ``READ_TIMEOUT``."""
    return await read_whole(request, request.app[READ_TIMEOUT])


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """The routes' ``expect_handler``: ``100 Continue`` at once, a JSON 417 for any other
    expectation."""
    refusal = refuse_expectation(request)
    if refusal is None:
        await send_continue(request)
    return refusal


# Connections the kernel queues before they are accepted: uvicorn's default, which vLLM
# serves on (asyncio's 100 drops the SYNs of a burst of new connections, which their
# clients see as connect timeouts a second later).
_BACKLOG = 2048


async def listen(
    runner: web.AppRunner, host: str, port: int, read_timeout_s: float
) -> asyncio.Server:
    """Serve ``runner``'s (set up) application on ``host:port`` through
    ``JsonErrorHandler``s with the head deadline ``read_timeout_s``; the caller closes the
    server before it cleans the runner up."""
    server = runner.server
    if server is None:
        raise RuntimeError("set the runner up before it listens")
    loop = asyncio.get_running_loop()

    def handler() -> RequestHandler:
        return JsonErrorHandler(
            server,
            loop=loop,
            keepalive_timeout=read_timeout_s,
            access_log=cast(logging.Logger, None),  # None turns access logs off
        )

    return await loop.create_server(handler, host, port, backlog=_BACKLOG)
