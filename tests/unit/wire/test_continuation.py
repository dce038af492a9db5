"""The continuation of a broken generation: what can be continued, and its body."""

from __future__ import annotations

from typing import Any

import pytest

from isocost.openai.continuation import continuation, not_resumable, with_usage_stats

CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 100,
    "temperature": 0.7,
    "stream": True,
}
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "Once", "max_tokens": 50, "stream": True}


@pytest.mark.parametrize(
    ("body", "chat", "reason"),
    [
        ({**CHAT, "n": 2}, True, "n > 1"),
        ({**COMPLETION, "best_of": 3}, False, "n > 1"),
        ({**CHAT, "logprobs": True}, True, "logprobs"),
        ({**COMPLETION, "logprobs": 0}, False, "logprobs"),
        ({**CHAT, "response_format": {"type": "json_object"}}, True, "guided decoding"),
        ({**COMPLETION, "guided_regex": "a+"}, False, "guided decoding"),
        ({**COMPLETION, "echo": True}, False, "echo"),
        ({**COMPLETION, "suffix": "end"}, False, "suffix"),
        ({**COMPLETION, "prompt": [1, 2, 3]}, False, "prompt of token ids or a batch"),
        ({**COMPLETION, "prompt": ["a", "b"]}, False, "prompt of token ids or a batch"),
        ({**CHAT, "continue_final_message": True}, True, "the chat continues its own final"),
    ],
)
def test_what_cannot_be_continued_exactly_is_named(
    body: dict[str, Any], chat: bool, reason: str
) -> None:
    found = not_resumable(body, chat=chat)
    assert found is not None and found.startswith(reason)


@pytest.mark.parametrize(
    ("body", "chat"),
    [
        (CHAT, True),
        ({**CHAT, "logprobs": False, "tools": [{"type": "function"}]}, True),
        ({**CHAT, "response_format": {"type": "text"}}, True),
        (COMPLETION, False),
        ({**COMPLETION, "prompt": ["Once"], "logprobs": None}, False),
    ],
)
def test_plain_requests_can_be_continued(body: dict[str, Any], chat: bool) -> None:
    assert not_resumable(body, chat=chat) is None


def test_a_chat_continues_the_partial_assistant_message_with_what_is_left() -> None:
    body = continuation(CHAT, chat=True, text=" the of", sent_tokens=2, cap=100)
    assert body["messages"] == [*CHAT["messages"], {"role": "assistant", "content": " the of"}]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 98 and "max_completion_tokens" not in body
    assert body["temperature"] == 0.7  # sampling as the client asked
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert CHAT["messages"] == [{"role": "user", "content": "hi"}]  # the original untouched


def test_a_completion_continues_its_prompt_and_lowers_every_cap_given() -> None:
    original = {**COMPLETION, "prompt": ["Once"], "max_completion_tokens": 50, "min_tokens": 8}
    body = continuation(original, chat=False, text=" upon", sent_tokens=5, cap=50)
    assert body["prompt"] == "Once upon"
    assert body["max_tokens"] == body["max_completion_tokens"] == 45
    assert body["min_tokens"] == 3


def test_a_capless_request_gets_what_is_left_of_the_default_cap() -> None:
    body = continuation(
        {"model": "m", "prompt": "x", "stream": True}, chat=False, text="y", sent_tokens=4, cap=16
    )
    assert body["max_tokens"] == 12
    chat = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    assert "max_tokens" not in continuation(chat, chat=True, text="y", sent_tokens=4, cap=None)


def test_usage_stats_are_asked_for_without_losing_the_clients_options() -> None:
    body = with_usage_stats({**CHAT, "stream_options": {"include_usage": False, "x": 1}})
    assert body["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": True,
        "x": 1,
    }
