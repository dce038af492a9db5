"""The one place that turns a refusal into an HTTP answer: OpenAI-style error JSON.

Every error the gateway returns has the body
``{"error": {"message", "type", "param", "code"}}`` and the status of its kind; 429 and
503 carry ``Retry-After`` (whole seconds, at least 1). The shape is shared with the
engine simulator (``isocost.openai_api``); this module adds the gateway's streaming form.
"""

from __future__ import annotations

from isocost.openai_api import ApiError, error_response

__all__ = ["ApiError", "error_body", "error_response", "sse_error_event"]


def error_body(status: int, message: str, code: str, param: str | None = None) -> bytes:
    return ApiError(status, message, code=code, param=param).encode()


def sse_error_event(message: str, code: str, status: int = 502) -> bytes:
    """The event that ends a broken stream, then ``[DONE]``, so clients never hang."""
    return b"data: " + error_body(status, message, code) + b"\n\ndata: [DONE]\n\n"
