"""OpenAI request bodies and the one decoder every HTTP edge reads them with.

Requests decode with msgspec; fields nobody here uses (temperature, top_p, ...) are
accepted and skipped without building objects for them, as engines do, so a 100 kB
prompt costs one pass over the bytes. The structs take what the OpenAI API allows (a
completion ``prompt`` may be one string, token ids, or a batch of either); each edge adds
its own rules on top (the engine simulator serves one prompt per request, the gateway
routes a batch by its first prompt).
"""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec

from isocost.openai.errors import ApiError

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "ContentPart",
    "RequestError",
    "StreamOptions",
    "decode_body",
]


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class _Common(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = 1
    user: str | None = None


class CompletionRequest(_Common, frozen=True, kw_only=True):
    prompt: str | list[str | int | list[int]]


class ContentPart(msgspec.Struct, frozen=True):
    type: str = "text"
    text: str | None = None


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """The message's text: its string content, or its text parts joined."""
        content = self.content
        if isinstance(content, list):
            return "".join(part.text or "" for part in content if part.type == "text")
        return content or ""


class ChatRequest(_Common, frozen=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class RequestError(ApiError):
    """A body that is not a valid request (400); ``param`` names the offending field when
    known, ``code`` is ``invalid_json`` for bytes that are no JSON, else ``invalid_value``."""

    def __init__(
        self, message: str, *, param: str | None = None, code: str = "invalid_value"
    ) -> None:
        super().__init__(400, message, code=code, param=param)


_T = TypeVar("_T")
_AT = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def decode_body(body: bytes, kind: type[_T]) -> _T:
    """The request body as ``kind``, or a RequestError naming the offending field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        raise RequestError(text, param=_field(text)) from None
    except msgspec.DecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except UnicodeDecodeError:  # msgspec raises it for invalid UTF-8 inside a JSON string
        raise RequestError("request body is not valid UTF-8", code="invalid_json") from None


def _field(message: str) -> str | None:
    """The field a msgspec validation message points at: ``messages[0].role``, ``prompt``."""
    at, missing = _AT.search(message), _MISSING.search(message)
    path = [found.group(1) for found in (at, missing) if found and found.group(1)]
    return ".".join(path) or None
