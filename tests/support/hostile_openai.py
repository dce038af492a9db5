"""A deliberately misbehaving OpenAI-style server on 127.0.0.1, for the client-side tools.

``hostile_app(script)`` answers the n-th completion request with ``script[n % len]``, one
of ``ANSWERS``; ``/v1/models``, ``/metrics`` and ``/admin/replicas`` answer as the
``models``, ``metrics`` and ``replicas`` arguments say. ``raw_server`` is a TCP server that
is not HTTP at all (closes at once, never answers, speaks TLS). Everything is
deterministic: no answer depends on timing, and a hang is an await that never ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

from aiohttp import web
from gateway_harness import serving

MODEL = "hostile-model"
BIG = 4 * 1024 * 1024  # an "enormous" line: far over any reader's line limit
ENDLESS = 40 * 1024 * 1024  # an "endless" body: this much, then a hang (the test stays cheap)
# JSON nested deeper than any decoder follows (RecursionError, not a DecodeError), in a field
# a typed decoder skips, and short enough for a reader's line limit (64 KiB)
DEEP = b'{"choices": [], "deep": ' + b"[" * 50_000

Handler = Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


async def _forever() -> None:
    await asyncio.Event().wait()


async def _sse(
    request: web.Request, lines: Sequence[bytes], *, done: bool = True
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for line in lines:
        await response.write(line + b"\n\n")
    if done:
        await response.write(b"data: [DONE]\n\n")
    return response


def _chunk(text: object) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode()


def _usage(completion: object) -> bytes:
    usage = {"prompt_tokens": 4, "completion_tokens": completion}
    return b"data: " + json.dumps({"choices": [], "usage": usage}).encode()


def _tokens(body: dict[str, Any]) -> list[bytes]:
    return [_chunk(" tok") for _ in range(int(body.get("max_tokens", 1)))]


async def _ok(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    if not body.get("stream"):
        usage = {"prompt_tokens": 4, "completion_tokens": body.get("max_tokens", 1)}
        return web.json_response({"choices": [{"text": " tok"}], "usage": usage})
    return await _sse(request, [*_tokens(body), _usage(body.get("max_tokens", 1))])


async def _reset_mid_event(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    await response.write(_chunk(" tok") + b"\n\n" + b'data: {"choices": [{"te')
    assert request.transport is not None
    request.transport.abort()  # RST, not FIN
    return response


async def _hang_after_headers(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    await response.write(_chunk(" tok") + b"\n\n")
    await _forever()
    return response


async def _hang(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    await _forever()
    raise AssertionError("unreachable")


async def _endless_error_body(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """A 500 whose HTML body does not end (a broken proxy's error page on a loop)."""
    response = web.StreamResponse(status=500, headers={"content-type": "text/html"})
    await response.prepare(request)
    for _ in range(ENDLESS // 65536):
        await response.write(b"<p>" + b"x" * 65536 + b"</p>\n")
    await _forever()
    return response


async def _endless_body(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """A 200 JSON body that does not end: the non-streaming counterpart."""
    response = web.StreamResponse(headers={"content-type": "application/json"})
    await response.prepare(request)
    await response.write(b'{"choices": [{"text": "')
    for _ in range(ENDLESS // 65536):
        await response.write(b"x" * 65536)
    await _forever()
    return response


async def _huge_line(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    await response.write(_chunk(" tok") + b"\n\n")
    await response.write(b"data: " + b"x" * BIG + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    return response


def _stream(lines: Sequence[bytes], *, done: bool = True) -> Handler:
    async def handler(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return await _sse(request, lines, done=done)

    return handler


def _respond(status: int, text: bytes, content_type: str = "text/html", **headers: str) -> Handler:
    async def handler(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return web.Response(status=status, body=text, content_type=content_type, headers=headers)

    return handler


ANSWERS: dict[str, Handler] = {
    "ok": _ok,
    "junk_line": _stream([_chunk(" tok"), b"<html>proxy</html>"]),
    "not_json": _stream([_chunk(" tok"), b"data: {not json"]),
    "json_list": _stream([b"data: [1, 2, 3]"]),
    "json_string": _stream([b'data: "hello"']),
    "no_choices": _stream([b'data: {"id": "x"}']),
    "choices_dict": _stream([b'data: {"choices": {"text": "a"}}']),
    "choices_strings": _stream([b'data: {"choices": ["abc"]}']),
    "null_content": _stream([b'data: {"choices": [{"delta": {"content": null}}]}']),
    "int_text": _stream([_chunk(12345)]),
    "usage_list": _stream([_chunk(" tok"), b'data: {"choices": [], "usage": [1]}']),
    "huge_usage": _stream([_chunk(" tok"), _usage(10**30)]),
    "negative_usage": _stream([_chunk(" tok"), _usage(-5)]),
    "bool_usage": _stream([_chunk(" tok"), _usage(True)]),
    "cached_lie": _stream(
        [
            _chunk(" tok"),
            b'data: {"choices": [], "usage": {"completion_tokens": 1, '
            b'"prompt_tokens_details": {"cached_tokens": 1000000}}}',
        ]
    ),
    "nan_usage": _stream(
        [_chunk(" tok"), b'data: {"choices": [], "usage": {"completion_tokens": NaN}}']
    ),
    "inf_number": _stream([_chunk(" tok"), b'data: {"choices": [], "x": 1e999}']),
    "non_utf8": _stream([_chunk(" tok"), b'data: {"choices": [{"text": "\xff\xfe"}]}']),
    "no_done": _stream([_chunk(" tok")], done=False),
    "reset": _reset_mid_event,
    "hang_after_headers": _hang_after_headers,
    "hang": _hang,
    "html_500": _respond(500, b"<html><body><h1>502 Bad Gateway</h1></body></html>"),
    "html_404": _respond(404, b"<html>Not Found</html>"),
    "non_utf8_500": _respond(500, b"\xff\xfe\xfd broken", "application/octet-stream"),
    "endless_error_body": _endless_error_body,
    "endless_body": _endless_body,
    "huge_line": _huge_line,
    "redirect": _respond(307, b"", "text/plain", location="http://127.0.0.1:9/v1/completions"),
    "body_wrong_shape": _respond(200, b'{"choices": "none"}', "application/json"),
    "body_list": _respond(200, b"[1, 2]", "application/json"),
    "deep_nesting": _stream([_chunk(" tok"), b"data: " + DEEP]),
    "deep_body": _respond(200, DEEP, "application/json"),
}

MODELS: dict[str, Callable[[], web.StreamResponse]] = {
    "ok": lambda: web.json_response({"object": "list", "data": [{"id": MODEL}]}),
    "list": lambda: web.json_response([{"id": MODEL}]),
    "data_dict": lambda: web.json_response({"data": {"id": MODEL}}),
    "html": lambda: web.Response(status=200, body=b"<html>hi</html>", content_type="text/html"),
    "bad_len": lambda: web.json_response({"data": [{"id": MODEL, "max_model_len": "big"}]}),
    "redirect": lambda: web.Response(status=302, headers={"location": "http://127.0.0.1:9/"}),
    "deep": lambda: web.Response(status=200, body=b"[" * 100_000, content_type="application/json"),
}


def hostile_app(
    script: Sequence[str] = ("ok",),
    *,
    models: str = "ok",
    metrics: bytes | None = None,
    replicas: Callable[[], Awaitable[web.StreamResponse]] | None = None,
) -> web.Application:
    """The server."""
    app = web.Application()
    seen = [0]  # completion requests so far

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        answer = ANSWERS[script[seen[0] % len(script)]]
        seen[0] += 1
        return await answer(request, body)

    async def listing(_: web.Request) -> web.StreamResponse:
        if models == "hang":
            await _forever()
        return MODELS[models]()

    async def scrape(_: web.Request) -> web.StreamResponse:
        if metrics is None:
            await _forever()
        return web.Response(body=metrics, content_type="text/plain")

    async def admin(_: web.Request) -> web.StreamResponse:
        assert replicas is not None
        return await replicas()

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/v1/models", listing)
    app.router.add_get("/metrics", scrape)
    app.router.add_get("/admin/replicas", admin)
    return app


TLS_ALERT = b"\x15\x03\x01\x00\x02\x02\x46"  # what a TLS port says to a plain-HTTP hello


@contextlib.asynccontextmanager
async def raw_server(behaviour: str) -> AsyncIterator[str]:
    """A TCP port that is not quite HTTP: ``close`` hangs up at once, ``silent`` reads and
    never answers, ``tls`` answers a TLS alert and hangs up, ``bad_header`` answers like an
    OpenAI server but with an ``x-isocost-replica`` header that is not UTF-8 (which an
    aiohttp server cannot send)."""

    writers: list[asyncio.StreamWriter] = []  # closed at the end: a silent one never is

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        if behaviour == "bad_header":
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: *(\d+)", head)
            await reader.readexactly(int(length[1]) if length else 0)  # unread, a close is RST
            writer.write(_bad_header_answer(head))
            await writer.drain()
        if behaviour == "silent":
            await reader.read(65536)
            await _forever()
        if behaviour == "tls":
            await reader.read(65536)
            writer.write(TLS_ALERT)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for writer in writers:
            writer.close()


def _bad_header_answer(head: bytes) -> bytes:
    if head.startswith(b"GET"):
        body = json.dumps({"data": [{"id": MODEL}]}).encode()
        kind = b"application/json"
    else:
        body = _chunk(" tok") + b"\n\ndata: [DONE]\n\n"
        kind = b"text/event-stream"
    return (
        b"HTTP/1.1 200 OK\r\nconnection: close\r\nx-isocost-replica: r\xff\xfe\r\n"
        b"content-type: " + kind + b"\r\ncontent-length: " + str(len(body)).encode()
        + b"\r\n\r\n" + body
    )  # fmt: skip


@contextlib.contextmanager
def in_thread(app: web.Application) -> Iterator[str]:
    """``app`` served from its own thread and event loop, for a CLI run in a subprocess."""
    loop = asyncio.new_event_loop()
    url: asyncio.Future[str] = loop.create_future()
    stop = asyncio.Event()

    async def main() -> None:
        async with serving(app) as base:
            url.set_result(base)
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    try:
        yield asyncio.run_coroutine_threadsafe(_wait(url), loop).result(timeout=10)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=10)
        loop.close()


async def _wait(future: asyncio.Future[str]) -> str:
    return await future
