"""Reply formatting of ``isocost engine``: OpenAI response objects, whole or streamed.

A whole answer is one JSON object; a stream is SSE chunks of ``stream_interval`` tokens
(a chat stream opens with the assistant role once the first token is made, as vLLM's
does), a last chunk with the ``finish_reason``, the usage chunk when
``stream_options.include_usage`` asked for it, and ``[DONE]``; with vLLM's
``continuous_usage_stats`` as well, every chunk carries the usage so far. The text is
filler (``filler_text``, from ``filler_start``): what is modelled is how many tokens come,
and when. A client that stops reading is taken for gone once a write has waited
``write_timeout_s``: its connection is dropped and its request aborted, so it cannot hold
a batch slot forever.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from isocost.engine.records import RequestSpec
from isocost.engine.replica import ServedReplica, Waiter
from isocost.engine.tokens import filler_text
from isocost.engine.validation import Generation
from isocost.openai import sse
from isocost.openai.usage import PromptTokensDetails, Usage

__all__ = ["Reply", "stream_reply"]


class Reply:
    """OpenAI response objects for one request (completion or chat, whole or chunks)."""

    def __init__(
        self,
        chat: bool,
        model_name: str,
        spec: RequestSpec,
        finish_reason: str,
        filler_from: int = 0,
        cached_tokens: Callable[[], int] | None = None,
    ):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + spec.request_id
        self.created = int(time.time())
        self.model_name = model_name
        self.spec = spec
        self.finish_reason = finish_reason
        self.filler_from = filler_from  # where in the filler cycle the answer begins
        # its prompt's prefix-cache hit so far, when the usage reports it (vLLM's
        # --enable-prompt-tokens-details)
        self.cached_tokens = cached_tokens

    def text(self, start: int, count: int) -> str:
        """Output tokens ``start .. start+count-1`` of this answer."""
        return filler_text(self.filler_from + start, count)

    def usage(self, output: int | None = None) -> Usage:
        """The usage of the whole answer, or of its first ``output`` tokens."""
        prompt = self.spec.prompt_tokens
        if output is None:
            output = self.spec.max_output_tokens
        details = None if self.cached_tokens is None else PromptTokensDetails(self.cached_tokens())
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=output,
            total_tokens=prompt + output,
            prompt_tokens_details=details,
        )

    def _envelope(self, stream: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if stream else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name}

    def whole(self) -> dict[str, Any]:
        text = self.text(0, self.spec.max_output_tokens)
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice |= {"logprobs": None, "finish_reason": self.finish_reason}
        return self._envelope(False) | {"choices": [choice], "usage": self.usage()}

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None,
        include_usage: bool,
        role: bool = False,
        usage: Usage | None = None,
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
            chunk["usage"] = usage
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        return self._envelope(True) | {"choices": [], "usage": self.usage()}


async def stream_reply(
    request: web.Request,
    replica: ServedReplica,
    waiter: Waiter,
    reply: Reply,
    generation: Generation,
    headers: dict[str, str] | None = None,
) -> web.StreamResponse:
    """Stream ``reply`` as ``waiter``'s tokens come; a client that leaves, or stops
    reading, ends it quietly (the caller aborts the request)."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"} | (headers or {})
    )
    await response.prepare(request)
    try:
        await _write_stream(
            _Writer(response, replica.options.write_timeout_s),
            replica,
            waiter,
            reply,
            generation,
        )
    except ConnectionResetError:
        if request.transport is not None:
            request.transport.abort()  # drop what it would not read
    return response


class _Writer:
    """Writes of one stream, each allowed ``timeout_s``: a client that reads nothing for
    that long is gone (``ConnectionResetError``, as if it had closed)."""

    def __init__(self, response: web.StreamResponse, timeout_s: float) -> None:
        self.response = response
        self.timeout_s = timeout_s

    async def write(self, data: bytes) -> None:
        await self._within(self.response.write(data))

    async def write_eof(self) -> None:
        await self._within(self.response.write_eof())

    async def _within(self, write: Awaitable[None]) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                await write
        except TimeoutError:
            raise ConnectionResetError("the client stopped reading") from None


async def _write_stream(
    response: _Writer,
    replica: ServedReplica,
    waiter: Waiter,
    reply: Reply,
    generation: Generation,
) -> None:
    include_usage = generation.include_usage

    def so_far(tokens: int) -> Usage | None:
        return reply.usage(tokens) if generation.continuous_usage else None

    state, sent = waiter.state, 0
    interval = replica.options.stream_interval
    while True:
        await waiter.wait()
        if replica.closing:
            return  # shutdown: the stream ends without [DONE], the request is aborted
        produced = state.num_output_tokens
        if reply.chat and sent == 0 and (produced or state.finished_s is not None):
            # vLLM opens a chat stream with the assistant role once the first token is made
            await response.write(
                sse.event(reply.chunk("", None, include_usage, role=True, usage=so_far(0)))
            )
        if produced > sent:
            text = reply.text(sent, produced - sent)
            chunk = reply.chunk(text, None, include_usage, usage=so_far(produced))
            await response.write(sse.event(chunk))
            sent = produced
        if state.finished_s is not None:
            break
        waiter.wake_at = sent + interval
    last = reply.chunk(None, reply.finish_reason, include_usage, usage=so_far(sent))
    await response.write(sse.event(last))
    if include_usage:
        await response.write(sse.event(reply.usage_chunk()))
    await response.write(sse.DONE_EVENT)
    await response.write_eof()
