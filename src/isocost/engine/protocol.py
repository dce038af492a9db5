"""OpenAI wire format for the engine simulator: request structs, responses, errors.

Requests decode with msgspec; fields the simulator does not use (temperature, top_p, ...)
are accepted and ignored, as engines do. Every error is OpenAI's JSON shape
``{"error": {"message", "type", "param", "code"}}`` carried by ``ApiError``, the shared
OpenAI error (``isocost.openai_api``) with the engine's default type.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from isocost import openai_api

__all__ = [
    "ApiError",
    "ChatRequest",
    "CompletionRequest",
    "chunk_bytes",
    "decode_body",
]


class ApiError(openai_api.ApiError):
    """The engine's errors (``isocost.openai_api``), typed ``invalid_request_error`` unless
    told otherwise, whatever the status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(status, message, code=code, param=param, type_=type_)


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class _Common(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = 1


class CompletionRequest(_Common, frozen=True, kw_only=True):
    prompt: str | list[str | int]


class ContentPart(msgspec.Struct, frozen=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(_Common, frozen=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


_T = TypeVar("_T")
_PATH = re.compile(r"at `\$\.?([^`]*)`|missing required field `([^`]*)`")


def decode_body(body: bytes, kind: type[_T]) -> _T:
    """The request body as ``kind``, or a 400 ApiError naming the offending field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        found = _PATH.search(str(exc))
        param = (found.group(1) or found.group(2) or None) if found else None
        raise ApiError(400, str(exc), param=param, code="invalid_value") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None


_ENCODER = msgspec.json.Encoder()


def chunk_bytes(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or a literal like ``[DONE]``)."""
    data = payload.encode() if isinstance(payload, str) else _ENCODER.encode(payload)
    return b"data: " + data + b"\n\n"
