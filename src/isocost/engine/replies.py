"""Reply formatting of ``isocost engine``: OpenAI response objects, whole or streamed.

A whole answer is one JSON object; a stream is SSE chunks of ``stream_interval`` tokens
(chat streams open with the assistant role), a last chunk with the ``finish_reason``, the
usage chunk when ``stream_options.include_usage`` asked for it, and ``[DONE]``. The text
is filler (``filler_text``): what is modelled is how many tokens come, and when.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from aiohttp import web

from isocost.engine.records import RequestSpec
from isocost.engine.replica import ServedReplica, Waiter
from isocost.engine.tokens import filler_text
from isocost.openai import sse
from isocost.openai.usage import Usage

__all__ = ["Reply", "stream_reply"]


class Reply:
    """OpenAI response objects for one request (completion or chat, whole or chunks)."""

    def __init__(self, chat: bool, model_name: str, spec: RequestSpec, finish_reason: str):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + spec.request_id
        self.created = int(time.time())
        self.model_name = model_name
        self.spec = spec
        self.finish_reason = finish_reason

    def usage(self) -> Usage:
        prompt, output = self.spec.prompt_tokens, self.spec.max_output_tokens
        return Usage(prompt_tokens=prompt, completion_tokens=output, total_tokens=prompt + output)

    def _envelope(self, stream: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if stream else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name}

    def whole(self) -> dict[str, Any]:
        text = filler_text(0, self.spec.max_output_tokens)
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice |= {"logprobs": None, "finish_reason": self.finish_reason}
        return self._envelope(False) | {"choices": [choice], "usage": self.usage()}

    def chunk(
        self, text: str | None, finish_reason: str | None, include_usage: bool, role: bool = False
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice |= {"logprobs": None, "finish_reason": finish_reason}
        chunk = self._envelope(True) | {"choices": [choice]}
        if include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        return self._envelope(True) | {"choices": [], "usage": self.usage()}


async def stream_reply(
    request: web.Request,
    replica: ServedReplica,
    waiter: Waiter,
    reply: Reply,
    include_usage: bool,
) -> web.StreamResponse:
    """Stream ``reply`` as ``waiter``'s tokens come; a client that leaves ends it quietly."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    with contextlib.suppress(ConnectionResetError):  # the client left: the caller aborts
        await _write_stream(response, replica, waiter, reply, include_usage)
    return response


async def _write_stream(
    response: web.StreamResponse,
    replica: ServedReplica,
    waiter: Waiter,
    reply: Reply,
    include_usage: bool,
) -> None:
    if reply.chat:
        await response.write(sse.event(reply.chunk("", None, include_usage, role=True)))
    state, sent = waiter.state, 0
    interval = replica.options.stream_interval
    while True:
        await waiter.wait()
        if replica.closing:
            return  # shutdown: the stream ends without [DONE], the request is aborted
        produced = state.num_output_tokens
        if produced > sent:
            text = filler_text(sent, produced - sent)
            await response.write(sse.event(reply.chunk(text, None, include_usage)))
            sent = produced
        if state.finished_s is not None:
            break
        waiter.wake_at = sent + interval
    await response.write(sse.event(reply.chunk(None, reply.finish_reason, include_usage)))
    if include_usage:
        await response.write(sse.event(reply.usage_chunk()))
    await response.write(sse.DONE_EVENT)
    await response.write_eof()
