"""A misbehaving OpenAI upstream for tests: a real HTTP server in its own process.

Real engines misbehave in ways ``isocost engine``'s fault flags do not cover: a ``/metrics``
with ``NaN`` samples or an unknown charset, answers in HTML or broken JSON, 404 or 429 for
everything, a stream that ends without ``[DONE]``, a 200 MB body. This server does whatever
its current *mode* says, and a test changes the mode at run time::

    upstream = start_fake_upstream()            # a Proc (isocost_procs) with .url
    set_mode(upstream.url, completion="no_done", metrics="vllm:num_requests_running NaN")
    received(upstream.url)                      # what it was sent: path, headers, body,
                                                # client_left: True once its client went
    hits(upstream.url)                          # when each path was requested

Mode keys (``POST /_fake/mode`` merges them into the current mode):

* ``health``: status of ``GET /health`` (200);
* ``metrics``: body of ``GET /metrics`` (vLLM gauges at 0); ``metrics_content_type``;
  ``metrics_encoding``: the codec that turns it into bytes (``utf-8``);
* ``completion``: what ``POST /v1/completions`` and ``/v1/chat/completions`` answer:
  ``ok`` (a small valid answer, streamed or not as asked), ``no_done`` (a stream that
  ends cleanly without ``[DONE]``), ``invalid_json``, ``html``, ``status`` (an OpenAI error
  with status ``status``), ``huge`` (a valid JSON answer of ``size_bytes``), ``stall``
  (headers, then nothing for ``stall_s``), ``hang`` (nothing at all for ``stall_s``); for
  streams, after the first token: ``truncated`` (writes ``tail``, then ends cleanly),
  ``reset`` (resets the connection), ``garbage`` (a ``garbage_line``, then the rest);
* ``stream_tokens``, ``token_bytes``, ``token_delay_s``: an ``ok`` stream of that many
  tokens of that size, that far apart (0 tokens: the two tokens ``hel``, ``lo``); the
  stream faults above come after the first token and its delay;
* ``opening_s``: a chat stream opens with the assistant role (no text) at once, and its
  first token comes this much later (vLLM sends the opening with the first token; some
  OpenAI-compatible servers and proxies at once); None (the default): no opening;
* ``completion_tokens``: what a whole answer's ``usage`` says it generated (2);
* ``model``: the model ``/v1/models`` lists (``fake-model``).

Run as a script: ``python fake_upstream.py [--port 0]`` prints ``fake upstream ready at URL``;
with ``--tls-cert FILE --tls-key FILE`` it serves HTTPS, and with ``--tls-client-ca FILE``
too it requires a client certificate signed by that CA.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import ssl
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

sys.path.insert(0, str(Path(__file__).parent))  # run as a script: import its siblings
from isocost_procs import NotReady, Proc, abandon, ready_urls

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

DEFAULT_METRICS = (
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{model_name="fake-model"} 0\n'
    "# TYPE vllm:num_requests_waiting gauge\n"
    'vllm:num_requests_waiting{model_name="fake-model"} 0\n'
    'vllm:kv_cache_usage_perc{model_name="fake-model"} 0.0\n'
)
DEFAULT_MODE: dict[str, Any] = {
    "health": 200,
    "metrics": DEFAULT_METRICS,
    "metrics_content_type": "text/plain; version=0.0.4; charset=utf-8",
    "metrics_encoding": "utf-8",
    "completion": "ok",
    "status": 500,
    "size_bytes": 1 << 20,
    "stall_s": 30.0,
    "tail": 'data: {"id": "fa',
    "garbage_line": "<html>oops</html>",
    "stream_tokens": 0,
    "token_bytes": 1,
    "token_delay_s": 0.0,
    "opening_s": None,
    "completion_tokens": 2,
    "model": "fake-model",
}


def _app() -> web.Application:
    mode = dict(DEFAULT_MODE)
    log: list[dict[str, Any]] = []
    hit_log: list[tuple[str, float]] = []

    @web.middleware
    async def count_hits(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.startswith("/_fake/"):
            hit_log.append((request.path, time.monotonic()))
        return await handler(request)

    async def set_mode(request: web.Request) -> web.Response:
        mode.update(await request.json())
        return web.json_response(mode)

    async def get_received(_: web.Request) -> web.Response:
        return web.json_response(log)

    async def get_hits(_: web.Request) -> web.Response:
        return web.json_response({"now": time.monotonic(), "hits": hit_log})

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=int(mode["health"]), text="")

    async def metrics(_: web.Request) -> web.Response:
        body = str(mode["metrics"]).encode(str(mode["metrics_encoding"]))
        return web.Response(body=body, headers={"Content-Type": mode["metrics_content_type"]})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": mode["model"]}]})

    async def completion(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        entry: dict[str, Any] = {
            "path": request.path,
            "headers": dict(request.headers),
            "body": raw.decode(),
        }
        log.append(entry)
        try:
            return await answer(request, json.loads(raw or b"{}"))
        except (asyncio.CancelledError, ConnectionResetError):
            entry["client_left"] = True
            raise

    async def answer(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        chat = request.path.endswith("chat/completions")
        kind = mode["completion"]
        if kind == "status":
            error = {"message": "fake upstream error", "type": "fake", "code": mode["status"]}
            return web.json_response({"error": error}, status=int(mode["status"]))
        if kind == "invalid_json":
            return web.Response(text='{"choices": [', content_type="application/json")
        if kind == "html":
            return web.Response(
                text="<html><body>502 Bad Gateway</body></html>", content_type="text/html"
            )
        if kind == "huge":
            padding = "x" * int(mode["size_bytes"])
            return web.json_response(_answer(chat, padding, body, mode["completion_tokens"]))
        if kind == "hang":
            await asyncio.sleep(float(mode["stall_s"]))
        if kind == "stall":
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await asyncio.sleep(float(mode["stall_s"]))
            return response
        if not body.get("stream"):
            return web.json_response(_answer(chat, "hello", body, mode["completion_tokens"]))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if chat and mode["opening_s"] is not None:
            opening = _chunk(chat, "", None)
            opening["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            await response.write(f"data: {json.dumps(opening)}\n\n".encode())
            await asyncio.sleep(float(mode["opening_s"]))
        count = int(mode["stream_tokens"])
        words = ["x" * int(mode["token_bytes"])] * count if count else ["hel", "lo"]
        for at, word in enumerate(words):
            if at:
                await asyncio.sleep(float(mode["token_delay_s"]))
            if at == 1 and kind == "truncated":
                await response.write(str(mode["tail"]).encode())
                await response.write_eof()
                return response
            if at == 1 and kind == "reset" and (transport := request.transport) is not None:
                sock = transport.get_extra_info("socket")  # linger 0: a reset, not a FIN
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                transport.abort()
                return response
            if at == 1 and kind == "garbage":
                await response.write(f"{mode['garbage_line']}\n\n".encode())
            chunk = _chunk(chat, word, None)
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(f"data: {json.dumps(_chunk(chat, '', 'stop'))}\n\n".encode())
        if kind != "no_done":
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application(middlewares=[count_hits])
    app.router.add_post("/_fake/mode", set_mode)
    app.router.add_get("/_fake/received", get_received)
    app.router.add_get("/_fake/hits", get_hits)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completion)
    app.router.add_post("/v1/chat/completions", completion)
    return app


def _answer(chat: bool, text: str, request: dict[str, Any], generated: int) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    usage = {"prompt_tokens": 3, "completion_tokens": generated, "total_tokens": 3 + generated}
    kind = "chat.completion" if chat else "text_completion"
    return {
        "id": "fake-1",
        "object": kind,
        "model": request.get("model"),
        "choices": [choice],
        "usage": usage,
    }


def _chunk(chat: bool, text: str, finish: str | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": "fake-1", "object": kind, "choices": [choice]}


def set_mode(url: str, **mode: Any) -> None:
    """Merge ``mode`` into the running upstream's mode (see the module docstring)."""
    request = urllib.request.Request(
        url + "/_fake/mode", data=json.dumps(mode).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()


def received(url: str) -> list[dict[str, Any]]:
    """Every completion request the upstream got so far: path, headers, body text."""
    with urllib.request.urlopen(url + "/_fake/received", timeout=10) as response:
        result: list[dict[str, Any]] = json.loads(response.read())
    return result


def hits(url: str) -> tuple[float, list[tuple[str, float]]]:
    """The upstream's clock now, and (path, time on that clock) of every request it got."""
    with urllib.request.urlopen(url + "/_fake/hits", timeout=10) as response:
        answer = json.loads(response.read())
    return answer["now"], [(path, at) for path, at in answer["hits"]]


def start_fake_upstream(timeout_s: float = 20, tls: list[str] | None = None) -> Proc:
    """Start this script in its own process; a ``Proc`` with its URL once it listens.
    ``tls``: more arguments, ``--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]``."""
    popen = subprocess.Popen(
        [sys.executable, str(Path(__file__)), "--port", "0", *(tls or [])],
        stdout=subprocess.PIPE, text=True, bufsize=1,
    )  # fmt: skip
    try:
        (url,) = ready_urls(popen, "fake upstream", timeout_s=timeout_s)
    except NotReady:
        abandon(popen)
        raise
    return Proc(popen, url)


async def _serve(port: int, tls: ssl.SSLContext | None) -> None:
    runner = web.AppRunner(_app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls)
    await site.start()
    sockets = site._server.sockets if site._server is not None else []  # type: ignore[union-attr]
    bound = sockets[0].getsockname()[1]
    scheme = "https" if tls is not None else "http"
    print(f"fake upstream ready at {scheme}://127.0.0.1:{bound}", flush=True)
    await asyncio.Event().wait()


def _server_tls(cert: str | None, key: str | None, client_ca: str | None) -> ssl.SSLContext | None:
    """HTTPS with this certificate and key; with ``client_ca``, a client certificate that
    chains to it is required (mutual TLS)."""
    if cert is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    if client_ca is not None:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    parser.add_argument("--tls-client-ca")
    args = parser.parse_args()
    asyncio.run(_serve(args.port, _server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)))
