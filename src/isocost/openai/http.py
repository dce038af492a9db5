"""The HTTP edge the engine simulator and the gateway share below their routes.

* ``JsonErrorHandler``: aiohttp's request handler, answering what its parser refuses
  (bytes that are no HTTP/1.1: a bad method, length or chunk size, an over-long line, a
  TLS hello; a ``Content-Encoding`` aiohttp cannot decode, 415) and any exception a route
  lets escape as OpenAI error JSON that quotes nothing of the request: aiohttp's own text
  answer quotes the request's raw bytes back, keys and prompts included.
* ``Expect``: only ``100-continue`` is served; any other expectation gets a JSON 417
  (``refuse_expectation``; aiohttp's own is text, sent before any middleware runs), and
  ``send_continue`` sends the ``100 Continue`` when the server is ready for the body.
* ``close_unread``: an error answered before the body has all arrived (a refusal instead
  of ``100 Continue``, a 413, a 408) closes the connection once it is sent.
* ``read_whole``: a body read whole within a deadline; 408 when it arrives too slowly,
  400 when it is cut short or its ``Content-Encoding`` does not decode it.
* ``read_capped``, the client's side: an answer read whole only while it stays under a
  bound, so that no server (a scraped engine, the Kubernetes API, one a tool is pointed
  at) can fill this process's memory.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.web_protocol import RequestHandler

from isocost.openai.errors import ApiError, error_response

__all__ = [
    "UNREADABLE",
    "JsonErrorHandler",
    "body_timeout",
    "close_unread",
    "read_capped",
    "read_whole",
    "refuse_expectation",
    "send_continue",
    "unreadable",
]

# A body cut short, or one whose Content-Encoding does not decode (aiohttp raises the
# latter as RequestPayloadError, which is not a ClientError).
UNREADABLE = (aiohttp.ClientError, web.RequestPayloadError)


class JsonErrorHandler(RequestHandler):
    """aiohttp's request handler with OpenAI error JSON for its refusals (see above)."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs it, checks nothing was sent
        if isinstance(exc, ContentEncodingError):  # at the head: a coding aiohttp lacks
            error = ApiError(
                415,
                "unsupported Content-Encoding: send the body as is, gzip or deflate",
                type_="invalid_request_error",
                code="unsupported_content_encoding",
            )
        elif status == 400:
            error = ApiError(400, "the request is not valid HTTP/1.1", code="invalid_http")
        else:
            error = ApiError(status, HTTPStatus(status).phrase, code="internal_error")
        response = error_response(error)
        response.force_close()
        return response


def refuse_expectation(request: web.Request) -> web.Response | None:
    """A JSON 417 that closes the connection for an ``Expect`` other than
    ``100-continue`` (its body may follow or not: nothing else can be read); else None."""
    if request.headers.get("Expect", "").lower() == "100-continue":
        return None
    refusal = ApiError(417, "only Expect: 100-continue is supported", code="expectation_failed")
    response = error_response(refusal)
    response.force_close()
    return response


async def send_continue(request: web.Request) -> None:
    """``100 Continue`` to an HTTP/1.1 client waiting for it before sending its body."""
    if request.version >= aiohttp.HttpVersion11 and (
        request.headers.get("Expect", "").lower() == "100-continue"
    ):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer proper has not started


async def close_unread(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """An error ``response`` sent now, then the connection closed, if the request's body
    has not all arrived. Kept open, aiohttp would linger up to 10 s reading the rest to
    discard it (``Connection: close`` alone does not stop that), holding a handler and a
    graceful shutdown as long; a client refused instead of a ``100 Continue`` may send
    its body or not (curl does not), so its next request would be read as that body;
    and a 413's or a 408's body is what is not to be read."""
    if response.status < HTTPStatus.BAD_REQUEST or request.content.is_eof():
        return response
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    if request.protocol is not None:
        request.protocol.force_close()  # what was written is flushed, then it closes
    return response


async def read_whole(request: web.Request, timeout_s: float) -> bytes:
    """The whole (decoded) body; ``body_timeout`` when it takes longer than ``timeout_s``
    to arrive, ``unreadable`` when it cannot be read or decoded."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise body_timeout(timeout_s) from None
    except UNREADABLE as exc:
        raise unreadable(exc, request) from None


def body_timeout(timeout_s: float) -> ApiError:
    return ApiError(
        408, f"the request body took over {timeout_s:g} s to arrive", code="body_timeout"
    )


def unreadable(exc: BaseException, request: web.BaseRequest) -> ApiError:
    encoding = request.headers.get("Content-Encoding", "identity")[:40]
    return ApiError(
        400, f"the request body could not be read (Content-Encoding {encoding!r}): {exc}",
        code="bad_body",
    )  # fmt: skip


async def read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The whole body, or None once it is over ``limit`` bytes (the rest is not read)."""
    if response.content_length is not None and response.content_length > limit:
        return None
    body = bytearray()
    async for chunk in response.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)
