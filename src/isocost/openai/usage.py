"""The usage object: token counts a server reports for one request.

A whole answer carries it at the top level; a stream asked for it with
``stream_options.include_usage`` carries it in one last event before ``[DONE]``. The
gateway reads ``completion_tokens`` from either to settle its shadow state exactly.
"""

from __future__ import annotations

import msgspec

__all__ = ["Usage", "answer_usage"]


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class _WithUsage(msgspec.Struct):
    usage: Usage | None = None


_decoder = msgspec.json.Decoder(_WithUsage)


def answer_usage(body: bytes | bytearray) -> Usage | None:
    """The usage of a JSON answer or of one stream event's payload (None when it carries
    none); msgspec.DecodeError when ``body`` is not a JSON object, so it is the check too."""
    return _decoder.decode(body).usage
