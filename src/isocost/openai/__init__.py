"""The OpenAI wire format, spoken by the engine simulator, the gateway and the load generator.

One room for what travels on the wire: the error object and the HTTP status of each kind
(``errors``), the request bodies and their one decoder (``requests``), JSON answers
(``responses``), server-sent event framing, written and read (``sse``), and the usage
object (``usage``). It sits below every
HTTP edge and imports only ``core`` (DESIGN §2), so the engine and the gateway share it
without importing each other. Imports are absolute, so the package never shadows the
``openai`` SDK that the tests use as a client.
"""

from __future__ import annotations

from isocost.openai.errors import STATUS_TYPES, ApiError, error_response
from isocost.openai.requests import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    ContentPart,
    RequestError,
    StreamOptions,
    decode_body,
)
from isocost.openai.responses import json_response
from isocost.openai.usage import Usage

__all__ = [
    "STATUS_TYPES",
    "ApiError",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "ContentPart",
    "RequestError",
    "StreamOptions",
    "Usage",
    "decode_body",
    "error_response",
    "json_response",
]
