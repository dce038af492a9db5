"""Continuing a generation that broke off: which requests can be, and the bodies to send.

A stream that breaks after some text reached the client goes on elsewhere as a
*continuation*: a completion's prompt plus the text so far, or a chat's messages plus the
partial assistant message, continued in place (vLLM's ``continue_final_message: true``
with ``add_generation_prompt: false``), with the output caps lowered by the tokens already
sent and every other field (sampling included) as the client sent it. The relaying side
needs the exact token count at every point, so upstream streams are asked for the usage
in every chunk (vLLM's and SGLang's ``stream_options.continuous_usage_stats``).

What cannot be continued exactly (``not_resumable``): ``n`` or ``best_of`` above 1 (the
choices interleave), logprobs of any kind (the continuation's would restart), ``echo`` and
``suffix`` (both frame the prompt), a prompt of token ids or a batch (the text so far has
no ids), guided decoding (its grammar would restart mid-answer), and a chat that already
continues its own final message.
"""

from __future__ import annotations

from typing import Any

__all__ = ["continuation", "not_resumable", "with_usage_stats"]

_GUIDED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)
_CAPS = ("max_tokens", "max_completion_tokens")


def not_resumable(body: dict[str, Any], *, chat: bool) -> str | None:
    """Why the request ``body`` cannot be continued exactly, or None when it can."""
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return "n > 1"
    logprobs = body.get("logprobs")  # chat: a bool; completions: a count, 0 included
    if (
        (logprobs is not None and logprobs is not False)
        or body.get("top_logprobs")
        or (body.get("prompt_logprobs") is not None)
    ):
        return "logprobs"
    if any(body.get(name) is not None for name in _GUIDED):
        return "guided decoding"
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return "guided decoding"
    if chat:
        if body.get("continue_final_message") or body.get("add_generation_prompt") is False:
            return "the chat continues its own final message"
        return None
    if body.get("echo"):
        return "echo"
    if body.get("suffix") is not None:
        return "suffix"
    if _prompt_text(body.get("prompt")) is None:
        return "prompt of token ids or a batch"
    return None


def with_usage_stats(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` asking for the usage so far in every stream chunk."""
    options = body.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    options["include_usage"] = True
    options["continuous_usage_stats"] = True
    return {**body, "stream_options": options}


def continuation(
    body: dict[str, Any], *, chat: bool, text: str, sent_tokens: int, cap: int | None
) -> dict[str, Any]:
    """The body that continues ``body`` after ``text`` (``sent_tokens`` tokens) was
    generated, the caps lowered to what is left of ``cap``; ``text`` must not be empty,
    and ``body`` must be resumable (``not_resumable``)."""
    resumed = with_usage_stats(body)
    if chat:
        resumed["messages"] = [*body["messages"], {"role": "assistant", "content": text}]
        resumed["continue_final_message"] = True
        resumed["add_generation_prompt"] = False
    else:
        prompt = _prompt_text(body["prompt"])
        assert prompt is not None, "not a resumable completion"
        resumed["prompt"] = prompt + text
    if cap is not None:
        left = cap - sent_tokens
        named = [name for name in _CAPS if body.get(name) is not None] or ["max_tokens"]
        for name in named:
            resumed[name] = left
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > 0:
        resumed["min_tokens"] = max(0, min_tokens - sent_tokens)
    return resumed


def _prompt_text(prompt: object) -> str | None:
    """A completion prompt's text: one string, or a list of exactly one string."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return None
