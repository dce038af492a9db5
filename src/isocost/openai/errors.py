"""OpenAI-style error answers, shared by the HTTP edges that speak the OpenAI API.

The engine simulator and the gateway may not import each other (DESIGN §2), yet both
answer errors the same way: the body ``{"error": {"message", "type", "param", "code"}}``
with the status of its kind, and ``Retry-After`` (whole seconds, at least 1) on 429 and
503 so that clients back off instead of hammering. This module is the one mapping from
an error to its HTTP answer, aiohttp's own HTTP errors (unknown path, wrong method, body
over the size limit) included.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
from aiohttp import web

from isocost.openai.responses import json_response

__all__ = ["STATUS_TYPES", "ApiError", "error_response", "retry_after"]

STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    417: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
    508: "loop_detected_error",
}
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


class ApiError(Exception):
    """A refusal: HTTP status plus the OpenAI error object's fields.

    ``type_`` defaults to the status's type (``STATUS_TYPES``, else ``api_error``);
    ``retry_after_s`` sets ``Retry-After`` on 429 and 503 (1 s when absent);
    ``headers`` are more headers for its answer, set where the refusal is known to
    concern someone (an API key's ``x-ratelimit-*``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type_: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type_ or STATUS_TYPES.get(status, "api_error")
        self.retry_after_s = retry_after_s
        self.headers: dict[str, str] = {}

    @classmethod
    def from_http(cls, exc: web.HTTPException) -> ApiError:
        """aiohttp's own refusal (404, 405, 413, ...) as an OpenAI error."""
        return cls(exc.status, exc.reason, code=_HTTP_CODES.get(exc.status, "http_error"))

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def encode(self) -> bytes:
        """The JSON body."""
        return msgspec.json.encode(self.body())


def retry_after(error: ApiError) -> str | None:
    """The ``Retry-After`` seconds ``error``'s status calls for (429, 503), else None."""
    if error.status in (429, 503):
        return str(max(1, math.ceil(error.retry_after_s or 1)))
    return None


def error_response(error: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    """``error`` as an aiohttp response (with ``Retry-After`` where its status calls for it)."""
    out = error.headers | (headers or {})
    seconds = retry_after(error)
    if seconds is not None:
        out["Retry-After"] = seconds
    return json_response(error.body(), error.status, out)
