"""The one place that turns a refusal into an HTTP answer: OpenAI-style error JSON.

Every error the gateway returns has the body
``{"error": {"message", "type", "param", "code"}}`` and the status of its kind; 429 and
503 carry ``Retry-After`` (whole seconds, at least 1).
"""

from __future__ import annotations

import math

import msgspec
from aiohttp import web

__all__ = ["ApiError", "error_body", "error_response", "sse_error_event"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ApiError(Exception):
    """A refusal: status, message, and the OpenAI ``code``/``param`` fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s


def error_body(status: int, message: str, code: str, param: str | None = None) -> bytes:
    return msgspec.json.encode(
        {
            "error": {
                "message": message,
                "type": _TYPES.get(status, "api_error"),
                "param": param,
                "code": code,
            }
        }
    )


def error_response(error: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    out = dict(headers or {})
    if error.status in (429, 503):
        out["Retry-After"] = str(max(1, math.ceil(error.retry_after_s or 1)))
    return web.Response(
        status=error.status,
        body=error_body(error.status, error.message, error.code, error.param),
        content_type="application/json",
        headers=out,
    )


def sse_error_event(message: str, code: str, status: int = 502) -> bytes:
    """The event that ends a broken stream, then ``[DONE]``, so clients never hang."""
    return b"data: " + error_body(status, message, code) + b"\n\ndata: [DONE]\n\n"
