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

__all__ = [
    "PromptTokensDetails",
    "StreamEvent",
    "Usage",
    "answer_usage",
    "cached_prompt_tokens",
    "choice_generated",
    "stream_event",
]

# The chat delta fields that carry generated output; a delta with none of them is the
# stream's opening (the assistant role) or its finish.
_GENERATED_DELTA_KEYS = ("content", "reasoning_content", "reasoning", "tool_calls")


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


class StreamEvent(msgspec.Struct):
    """What the gateway reads of one stream event: its usage, if any, and its choices."""

    usage: Usage | None = None
    choices: Any = None

    @property
    def generated(self) -> bool:
        """It carries generated output: text, reasoning or a tool call. A chat stream's
        opening (the assistant role, no text), a finish and the usage chunk do not: the
        first token is the first event that does, as clients time it."""
        choices = self.choices if isinstance(self.choices, list) else ()
        return any(isinstance(choice, dict) and choice_generated(choice) for choice in choices)


def choice_generated(choice: dict[str, Any]) -> bool:
    """One stream choice carries generated output (``StreamEvent.generated``)."""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return any(delta.get(key) for key in _GENERATED_DELTA_KEYS)
    return bool(choice.get("text"))


_event_decoder = msgspec.json.Decoder(StreamEvent)


def stream_event(payload: bytes | bytearray) -> StreamEvent:
    """One stream event's payload, read; one of ``core.jsontext.UNDECODABLE`` when it is not
    a JSON object (RecursionError when it is nested too deep)."""
    return _event_decoder.decode(payload)


def answer_usage(body: bytes | bytearray) -> Usage | None:
    """The usage of a JSON answer or of one stream event's payload (None when it carries
    none); one of ``core.jsontext.UNDECODABLE`` when ``body`` is not a JSON object (nested
    too deep: RecursionError), so it is the check too."""
    return _decoder.decode(body).usage
