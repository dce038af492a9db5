"""The usage object: token counts a server reports for one request.

A whole answer carries it at the top level; a stream asked for it with
``stream_options.include_usage`` carries it in one last event before ``[DONE]``. The
gateway reads ``completion_tokens`` from either to settle its shadow state exactly, and
``prompt_tokens_details.cached_tokens`` (vLLM with ``--enable-prompt-tokens-details``) to
check the prefix-cache hit it predicted.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["PromptTokensDetails", "Usage", "answer_usage", "cached_prompt_tokens"]


class PromptTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int | None = None


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @property
    def cached_tokens(self) -> int | None:
        details = self.prompt_tokens_details
        return None if details is None else details.cached_tokens


def cached_prompt_tokens(usage: dict[str, Any]) -> int | None:
    """``prompt_tokens_details.cached_tokens`` of a usage object already decoded to a dict."""
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


class _WithUsage(msgspec.Struct):
    usage: Usage | None = None


_decoder = msgspec.json.Decoder(_WithUsage)


def answer_usage(body: bytes | bytearray) -> Usage | None:
    """The usage of a JSON answer or of one stream event's payload (None when it carries
    none); msgspec.DecodeError when ``body`` is not a JSON object, so it is the check too."""
    return _decoder.decode(body).usage
