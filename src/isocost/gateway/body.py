"""Decode only what routing needs from an OpenAI request body; the bytes are forwarded as is.

msgspec skips every field it is not asked for without building objects for it, so a
100 kB prompt costs one pass over the bytes. The prompt text (chat messages joined in
order, or the completion prompt) serves two things: a token estimate (~4 bytes per token
unless the prompt is already token ids) and chained block hashes for the prefix index.
Both are estimates of what the engine's tokenizer will do; what matters is that equal
prefixes hash equal, which holds for text as for tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from isocost.prefix.hashing import text_block_hashes, token_block_hashes

__all__ = ["BYTES_PER_TOKEN", "BodyError", "RoutingView", "decode_body"]

BYTES_PER_TOKEN = 4  # rough UTF-8 bytes per token of English text for BPE tokenizers


class _TextPart(msgspec.Struct):
    type: str = "text"
    text: str | None = None


class _Message(msgspec.Struct):
    role: str
    content: str | list[_TextPart] | None = None


class _Body(msgspec.Struct):
    model: str
    stream: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    user: str | None = None
    messages: list[_Message] | None = None
    prompt: str | list[str | int | list[int]] | None = None


_decoder = msgspec.json.Decoder(_Body)


class BodyError(ValueError):
    """The body is not a valid request; ``param`` names the offending field when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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


def decode_body(body: bytes, *, chat: bool, block_tokens: int) -> RoutingView:
    """The routing view of ``body``; BodyError on malformed JSON, wrong types or missing fields."""
    try:
        parsed = _decoder.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.rsplit("$.", 1)[-1].rstrip("`") if "$." in text else None
        raise BodyError(text, param) from None
    except msgspec.DecodeError as exc:
        raise BodyError(f"request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError:  # msgspec raises it for invalid UTF-8 inside a JSON string
        raise BodyError("request body is not valid UTF-8") from None
    max_tokens = parsed.max_completion_tokens or parsed.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise BodyError("max_tokens must be at least 1", "max_tokens")
    if chat:
        if not parsed.messages:
            raise BodyError("messages must be a non-empty list", "messages")
        text = "".join(_message_text(m) for m in parsed.messages)
        tokens, hashes = _text_estimate(text, block_tokens)
        exact = False
    else:
        if parsed.prompt is None:
            raise BodyError("prompt is required", "prompt")
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


def _message_text(message: _Message) -> str:
    content = message.content
    if isinstance(content, list):
        content = "".join(part.text or "" for part in content)
    return f"<|{message.role}|>{content or ''}"


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
            raise BodyError("prompt mixes token ids with strings or lists", "prompt")
        total += tokens
        first = hashes if first is None else first
    return max(1, total), first or []
