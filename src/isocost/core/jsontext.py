"""JSON (and msgpack) from outside (a file, a replica's or an API server's answer, a
peer's message): one error for what cannot be decoded.

``json.loads`` and msgspec's decoders raise RecursionError on input nested deeper than
they follow (a hundred thousand ``[`` will do). It is no ValueError nor a
``msgspec.DecodeError``, so it gets past the ``except`` that handles every other bad
input, and ends a task or prints a traceback: catch ``UNDECODABLE`` where
``msgspec.DecodeError`` is meant, and read JSON text with ``parse_json``.
"""

from __future__ import annotations

import json

import msgspec

__all__ = ["UNDECODABLE", "parse_json"]

UNDECODABLE = (msgspec.DecodeError, RecursionError)


def parse_json(text: str | bytes) -> object:
    """``text`` decoded; ``json.JSONDecodeError`` (a ValueError) for what is no JSON,
    nesting too deep included."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deep", "", 0) from None
