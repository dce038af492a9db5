"""What routing needs from an OpenAI request body; the bytes are forwarded as is.

The body decodes with the one OpenAI decoder (``isocost.openai``), which skips every field
it is not asked for without building objects for it, so a 100 kB prompt costs one pass
over the bytes. The prompt text (chat messages joined in order, or the completion prompt)
serves two things: a token estimate (~4 bytes per token unless the prompt is already
token ids) and chained block hashes for the prefix index.
Both are estimates of what the engine's tokenizer will do; what matters is that equal
prefixes hash equal, which holds for text as for tokens.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from isocost.openai.requests import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    RequestError,
    decode_body,
    output_cap,
)
from isocost.prefix.hashing import text_block_hashes, token_block_hashes

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["BYTES_PER_TOKEN", "BodySummary", "RoutingView", "routing_view", "summarize"]

BYTES_PER_TOKEN = 4  # rough UTF-8 bytes per token of English text for BPE tokenizers


@dataclass(frozen=True, slots=True)
class RoutingView:
    """What the gateway knows about a request before it is forwarded."""

    model: str
    stream: bool
    max_tokens: int | None  # the output cap the engine will run (``output_cap``)
    user: str | None
    prompt_tokens: int
    prompt_tokens_exact: bool  # True when the prompt came as token ids
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BodySummary:
    """A decoded body before its prompt is hashed: enough for every limit check, so that
    a request refused as too long costs no hashing (``routing_view`` does that)."""

    model: str
    stream: bool
    max_tokens: int | None
    max_tokens_param: str  # the field the cap came from, for error messages
    user: str | None
    prompt_tokens: int
    prompt_tokens_exact: bool
    hash_source: str | list[int]  # the (first) prompt, as text or token ids
    completion_text: bool  # a completion's one text prompt, which a tokenizer makes exact

    def routing_view(self, block_tokens: int, tokenizer: Tokenizer | None = None) -> RoutingView:
        """The view with the prompt's chained block hashes. With the pool's ``tokenizer``
        a completion's text prompt is tokenized as the engine does (special tokens
        included), so its hashes equal those of the blocks the engine reports storing
        (``isocost.prefix.kvevents``) and its token count is exact; chat prompts stay text
        (the engine's chat template is not rendered here)."""
        source = self.hash_source
        prompt_tokens, exact = self.prompt_tokens, self.prompt_tokens_exact
        if tokenizer is not None and self.completion_text and isinstance(source, str):
            source = tokenizer.encode_batch([source])[0].ids  # the batch call frees the GIL
            prompt_tokens, exact = max(1, len(source)), True
        hashes = (
            text_block_hashes(source, block_tokens * BYTES_PER_TOKEN)
            if isinstance(source, str)
            else token_block_hashes(source, block_tokens)
        )
        return RoutingView(
            model=self.model,
            stream=self.stream,
            max_tokens=self.max_tokens,
            user=self.user,
            prompt_tokens=prompt_tokens,
            prompt_tokens_exact=exact,
            block_hashes=tuple(hashes),
        )


async def routing_view(
    summary: BodySummary, block_tokens: int, tokenizer: Tokenizer | None
) -> RoutingView:
    """``summary.routing_view``, in a thread when a tokenizer runs: tokenizing a long prompt
    takes milliseconds (~10 ms for 8 kB measured here, 0.2 s for 100 kB), which the event
    loop must not wait for."""
    if tokenizer is None:
        return summary.routing_view(block_tokens)
    return await asyncio.to_thread(summary.routing_view, block_tokens, tokenizer)


def summarize(body: bytes, *, chat: bool) -> BodySummary:
    """The limits' view of ``body`` (no hashing); RequestError as for ``routing_view``."""
    parsed: ChatRequest | CompletionRequest
    parsed = decode_body(body, ChatRequest) if chat else decode_body(body, CompletionRequest)
    if parsed.kv_transfer_params is not None:
        # the engine acts on them: a client's would have it pull KV from any host it names,
        # or hold KV for a transfer no one makes (the gateway sets them for P/D itself)
        raise RequestError(
            "kv_transfer_params is set by the gateway, not by clients",
            param="kv_transfer_params",
        )
    max_tokens, param = output_cap(parsed)
    source: str | list[int]
    if isinstance(parsed, ChatRequest):
        if not parsed.messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        source = "".join(_message_text(m) for m in parsed.messages)
        tokens, exact = _text_tokens(source), False
    else:
        tokens, source = _prompt_estimate(parsed.prompt)
        prompt = parsed.prompt
        exact = not isinstance(prompt, str) and not any(isinstance(p, str) for p in prompt)
    return BodySummary(
        model=parsed.model,
        stream=parsed.stream,
        max_tokens=max_tokens,
        max_tokens_param=param,
        user=parsed.user,
        prompt_tokens=tokens,
        prompt_tokens_exact=exact,
        hash_source=source,
        completion_text=isinstance(parsed, CompletionRequest) and isinstance(parsed.prompt, str),
    )


def _message_text(message: ChatMessage) -> str:
    return f"<|{message.role}|>{message.text()}"


def _text_tokens(text: str) -> int:
    return max(1, -(-len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN))


def _prompt_estimate(prompt: str | list[str | int | list[int]]) -> tuple[int, str | list[int]]:
    """Tokens of a completion prompt, and what to hash: the prompt, or a batch's first."""
    if isinstance(prompt, str):
        return _text_tokens(prompt), prompt
    if all(isinstance(item, int) for item in prompt):
        ids = [item for item in prompt if isinstance(item, int)]
        return max(1, len(ids)), ids
    # A batch of prompts: route by the first, count them all.
    total = 0
    first: str | list[int] | None = None
    for item in prompt:
        if isinstance(item, str):
            total += _text_tokens(item)
        elif isinstance(item, list):
            total += max(1, len(item))
        else:
            raise RequestError("prompt mixes token ids with strings or lists", param="prompt")
        first = item if first is None else first
    return max(1, total), first if first is not None else []
