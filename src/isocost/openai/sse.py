"""Server-sent event framing of OpenAI streams, written and read.

A stream is a run of ``data: <json>`` events, each ended by a blank line, closed by
``data: [DONE]``. Servers write events with ``event``; a stream that breaks after it began
ends with ``error_events`` (an OpenAI error object, then ``[DONE]``) so clients never hang.
Readers take one line at a time (``line_data``), or, when relaying bytes without parsing
them, count the events in what went by (``count_events``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from isocost.openai.errors import ApiError

__all__ = [
    "DATA",
    "DONE",
    "DONE_EVENT",
    "SseError",
    "count_events",
    "error_events",
    "event",
    "line_data",
]

DATA = b"data:"  # the field that carries an event's payload
DONE = b"[DONE]"  # the payload of the last event
DONE_EVENT = b"data: [DONE]\n\n"
_DONE_LINE = DONE_EVENT.rstrip()
_IGNORED = (b":", b"event:", b"id:", b"retry:")  # comments and fields without data
_ENCODER = msgspec.json.Encoder()


def event(payload: Any) -> bytes:
    """One server-sent event: ``data: <json>``."""
    return b"data: " + _ENCODER.encode(payload) + b"\n\n"


def error_events(error: ApiError) -> bytes:
    """The events that end a broken stream: ``error``, then ``[DONE]``."""
    return event(error.body()) + DONE_EVENT


def count_events(window: bytes) -> int:
    """The ``data:`` events in ``window``, ``[DONE]`` not counted."""
    return window.count(DATA) - window.count(_DONE_LINE)


class SseError(ValueError):
    """A line in a stream that is not server-sent events."""


def line_data(raw: bytes) -> bytes | None:
    """The payload of one stream line; None for a line without one (blank, comment,
    ``event:``, ``id:``, ``retry:``); SseError for a line that is not SSE."""
    line = raw.strip()
    if not line or line.startswith(_IGNORED):
        return None
    if not line.startswith(DATA):
        raise SseError(f"not an SSE line: {line[:80]!r}")
    return line[len(DATA) :].strip()
