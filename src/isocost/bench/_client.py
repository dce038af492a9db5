"""One OpenAI request over HTTP, timed chunk by chunk; every failure becomes an error kind.

Error kinds (``BenchRecord.error_kind``):

- ``connect``: no connection (refused, reset before a response, DNS).
- ``timeout``: no complete answer within the per-request timeout.
- ``http_<status>``: a response other than 200 (``http_429``, ``http_503``...); redirects
  are not followed, so that no other server is ever contacted (the error names where to).
- ``bad_json``: a body or an SSE event that is not the JSON an OpenAI server sends, or
  usage that is not a count of the tokens asked for.
- ``bad_sse``: a line in the stream that is not SSE (``data:``, ``event:``, ``id:``, ``:``),
  or one longer than aiohttp's line limit.
- ``too_large``: a whole (non-streamed) answer over ``MAX_BODY_BYTES``.
- ``stream_error``: an ``{"error": ...}`` event inside a stream.
- ``truncated``: the stream ended without ``data: [DONE]`` (or the server hung up).
- ``empty``: a 200 answer that carried no generated text at all.

A request is recorded whatever happens, so a misbehaving server never stops a run; and
nothing a server sends is held in full unless it is small, so none can exhaust memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeGuard

import aiohttp
import msgspec
from aiohttp.http_exceptions import LineTooLong

from isocost.bench._records import BenchRecord
from isocost.core.jsontext import UNDECODABLE
from isocost.openai import sse
from isocost.openai.http import read_capped

__all__ = ["MAX_BODY_BYTES", "error_snippet", "send_request"]

MAX_BODY_BYTES = 16 * 1024 * 1024  # a whole answer larger than this is not an OpenAI one
_SNIPPET_BYTES = 4096  # of an error answer's body, enough for its message

_json = msgspec.json.Decoder()
_encode = msgspec.json.Encoder().encode


class _Garbage(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    headers: dict[str, str],
    clock: Callable[[], float],
    record: BenchRecord,
    timeout_s: float,
) -> BenchRecord:
    """POST ``payload`` to ``url`` and fill ``record`` with its timeline and outcome."""
    record.sent_s = clock()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(
                url, data=_encode(payload), headers=headers, allow_redirects=False
            ) as response:
                record.status = response.status
                record.replica = _printable(response.headers.get("x-isocost-replica"))
                if response.status != 200:
                    raise _Garbage(f"http_{response.status}", await error_snippet(response))
                if payload.get("stream"):
                    await _read_stream(response, clock, record)
                else:
                    body = await read_capped(response, MAX_BODY_BYTES)
                    if body is None:
                        raise _Garbage("too_large", f"an answer over {MAX_BODY_BYTES} bytes")
                    _read_body(body, clock, record)
    except _Garbage as exc:
        record.error_kind, record.error = exc.kind, str(exc)
    except TimeoutError:
        record.error_kind, record.error = "timeout", f"no complete answer in {timeout_s:g} s"
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
        record.error_kind, record.error = "truncated", str(exc) or type(exc).__name__
    except aiohttp.ClientError as exc:
        record.error_kind, record.error = "connect", str(exc) or type(exc).__name__
    except (LineTooLong, ValueError):  # aiohttp's reader refuses an endless line (LineTooLong
        # since aiohttp 3.13, ValueError before); it holds no more than its limit meanwhile
        record.error_kind, record.error = "bad_sse", "a line longer than the reader's limit"
    if record.error_kind is None and record.first_token_s is None:
        record.error_kind, record.error = "empty", "the answer carried no generated text"
    if record.error_kind is not None:
        record.end_s = None
    return record


def _printable(header: str | None) -> str | None:
    """A header as text that can be printed and written as JSON: aiohttp keeps bytes that
    are not UTF-8 as lone surrogates, which neither the console nor msgspec accept."""
    if header is None:
        return None
    return header.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


async def error_snippet(response: aiohttp.ClientResponse) -> str:
    """The start of an error answer's body as one line of text, and where a redirect points
    (it is not followed); the rest of the body is never read, however long."""
    text = (await response.content.read(_SNIPPET_BYTES)).decode(errors="replace")
    snippet = " ".join(text.split())[:200]
    location = response.headers.get("location")
    if 300 <= response.status < 400 and location:
        return f"redirects to {_printable(location)} (not followed) {snippet}".strip()
    return snippet


def _decode(data: bytes) -> dict[str, Any]:
    try:
        value = _json.decode(data)
    except UNDECODABLE as exc:  # nested too deep included
        raise _Garbage("bad_json", f"{exc}: {data[:80]!r}") from None
    if not isinstance(value, dict):
        raise _Garbage("bad_json", f"expected a JSON object: {data[:80]!r}")
    return value


def _text(event: dict[str, Any]) -> str:
    """The generated text in a completion or chat (chunk) object."""
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices:
        return ""
    choice = choices[0]
    if not isinstance(choice, dict):
        raise _Garbage("bad_json", "a choice that is not an object")
    text = choice.get("text")
    if text is None:
        part = choice.get("delta") or choice.get("message") or {}
        text = part.get("content") if isinstance(part, dict) else None
    return text if isinstance(text, str) else ""


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _usage(event: dict[str, Any], record: BenchRecord) -> None:
    """The server's token counts; a count that cannot be true (negative, or more output
    than asked for) would skew every rate of the summary, so it fails the request."""
    usage = event.get("usage")
    if isinstance(usage, dict):
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if _count(prompt):
            record.usage_prompt_tokens = prompt
        if completion is None:
            return
        if not _count(completion) or completion > record.max_tokens:
            raise _Garbage(
                "bad_json", f"usage.completion_tokens {str(completion)[:40]} with max_tokens "
                f"{record.max_tokens}"
            )  # fmt: skip
        record.output_tokens = completion


def _resumes(event: dict[str, Any], record: BenchRecord) -> None:
    """An isocost gateway names a stream's resumes in its finish chunk."""
    extra = event.get("isocost")
    resumed = extra.get("resumed") if isinstance(extra, dict) else None
    if isinstance(resumed, list):
        record.resumed = len(resumed)


async def _read_stream(
    response: aiohttp.ClientResponse, clock: Callable[[], float], record: BenchRecord
) -> None:
    chunks = 0
    async for raw in response.content:
        try:
            data = sse.line_data(raw)
        except sse.SseError as exc:
            raise _Garbage("bad_sse", str(exc)) from None
        if data is None:
            continue
        if data == sse.DONE:
            record.end_s = clock()
            if record.output_tokens == 0:
                record.output_tokens = chunks
            return
        event = _decode(data)
        if "error" in event:
            raise _Garbage("stream_error", str(event["error"])[:200])
        if _text(event):
            now = clock()
            if record.first_token_s is None:
                record.first_token_s = now
            record.chunk_times_s.append(now)
            chunks += 1
        _usage(event, record)
        _resumes(event, record)
    raise _Garbage("truncated", "the stream ended without data: [DONE]")


def _read_body(body: bytes, clock: Callable[[], float], record: BenchRecord) -> None:
    now = clock()
    event = _decode(body)
    _usage(event, record)
    if _text(event):
        record.first_token_s = record.end_s = now
        record.chunk_times_s.append(now)
        if record.output_tokens == 0:
            record.output_tokens = 1
