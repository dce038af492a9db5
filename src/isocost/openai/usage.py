"""The usage object: token counts a server reports for one request.

A whole answer carries it at the top level; a stream asked for it with
``stream_options.include_usage`` carries it in one last event before ``[DONE]``. The
gateway reads ``completion_tokens`` from either to settle its shadow state exactly.
"""

from __future__ import annotations

import msgspec

from isocost.openai.sse import DATA

__all__ = ["Usage", "completion_tokens", "stream_completion_tokens"]


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class _WithUsage(msgspec.Struct):
    usage: Usage | None = None


_decoder = msgspec.json.Decoder(_WithUsage)


def completion_tokens(body: bytes) -> int | None:
    """``usage.completion_tokens`` of a JSON answer; None when it carries no usage."""
    try:
        usage = _decoder.decode(body).usage
    except msgspec.DecodeError:
        return None
    return usage.completion_tokens if usage else None


def stream_completion_tokens(end: bytes) -> int | None:
    """``completion_tokens`` of the usage event among a stream's last bytes ``end``."""
    at = end.rfind(b'"usage":{')
    start = end.rfind(DATA, 0, at) if at >= 0 else -1
    stop = end.find(b"\n", at)
    if start < 0 or stop < 0:
        return None
    return completion_tokens(end[start + len(DATA) : stop])
