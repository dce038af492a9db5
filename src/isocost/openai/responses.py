"""JSON answers of the OpenAI HTTP edges: one encoder, one content type."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

__all__ = ["json_response"]

_JSON = msgspec.json.Encoder()


def json_response(
    body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    """``body`` (anything msgspec encodes) as an ``application/json`` response."""
    return web.Response(
        body=_JSON.encode(body), status=status, headers=headers, content_type="application/json"
    )
