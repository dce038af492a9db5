"""JSON text from outside (a file, an API server's answer): one error for what is no JSON."""

from __future__ import annotations

import json

__all__ = ["parse_json"]


def parse_json(text: str | bytes) -> object:
    """``text`` decoded; ``json.JSONDecodeError`` (a ValueError) for what is no JSON,
    nesting too deep included: the decoder's RecursionError would get past every caller's
    ``except ValueError`` and end a provider or print a traceback."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deep", "", 0) from None
