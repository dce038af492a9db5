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

from dataclasses import dataclass

from isocost.openai.requests import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    RequestError,
    decode_body,
)
from isocost.prefix.hashing import text_block_hashes, token_block_hashes

__all__ = ["BYTES_PER_TOKEN", "RoutingView", "routing_view"]

BYTES_PER_TOKEN = 4  # rough UTF-8 bytes per token of English text for BPE tokenizers


@dataclass(frozen=True, slots=True)
class RoutingView:
    """What the gateway knows about a request before it is forwarded."""

    model: str
    stream: bool
    max_tokens: int | None  # as sent; None when the client left it to the engine
    user: str | None
    prompt_tokens: int
    prompt_tokens_exact: bool  # True when the prompt came as token ids
    block_hashes: tuple[int, ...]


def routing_view(body: bytes, *, chat: bool, block_tokens: int) -> RoutingView:
    """The routing view of ``body``; RequestError on malformed JSON, wrong types or missing
    fields."""
    parsed: ChatRequest | CompletionRequest
    if chat:
        parsed = decode_body(body, ChatRequest)
        max_tokens = parsed.max_completion_tokens or parsed.max_tokens
    else:
        parsed = decode_body(body, CompletionRequest)
        max_tokens = parsed.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise RequestError("max_tokens must be at least 1", param="max_tokens")
    if isinstance(parsed, ChatRequest):
        if not parsed.messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        text = "".join(_message_text(m) for m in parsed.messages)
        tokens, hashes = _text_estimate(text, block_tokens)
        exact = False
    else:
        tokens, hashes = _prompt_estimate(parsed.prompt, block_tokens)
        prompt = parsed.prompt
        exact = not isinstance(prompt, str) and not any(isinstance(p, str) for p in prompt)
    return RoutingView(
        model=parsed.model,
        stream=parsed.stream,
        max_tokens=max_tokens,
        user=parsed.user,
        prompt_tokens=tokens,
        prompt_tokens_exact=exact,
        block_hashes=tuple(hashes),
    )


def _message_text(message: ChatMessage) -> str:
    return f"<|{message.role}|>{message.text()}"


def _text_estimate(text: str, block_tokens: int) -> tuple[int, list[int]]:
    data_len = len(text.encode("utf-8", "surrogatepass"))
    return max(1, -(-data_len // BYTES_PER_TOKEN)), text_block_hashes(
        text, block_tokens * BYTES_PER_TOKEN
    )


def _prompt_estimate(
    prompt: str | list[str | int | list[int]], block_tokens: int
) -> tuple[int, list[int]]:
    if isinstance(prompt, str):
        return _text_estimate(prompt, block_tokens)
    if all(isinstance(item, int) for item in prompt):
        ids = [item for item in prompt if isinstance(item, int)]
        return max(1, len(ids)), token_block_hashes(ids, block_tokens)
    # A batch of prompts: route by the first, count them all.
    total = 0
    first: list[int] | None = None
    for item in prompt:
        if isinstance(item, str):
            tokens, hashes = _text_estimate(item, block_tokens)
        elif isinstance(item, list):
            tokens, hashes = max(1, len(item)), token_block_hashes(item, block_tokens)
        else:
            raise RequestError("prompt mixes token ids with strings or lists", param="prompt")
        total += tokens
        first = hashes if first is None else first
    return max(1, total), first or []
