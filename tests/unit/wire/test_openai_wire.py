"""The OpenAI wire package: decoder errors, error answers, SSE framing, usage readers.

(The folder is not called ``openai`` so that it can never shadow the ``openai`` SDK.)
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from isocost.openai import sse
from isocost.openai.errors import ApiError, error_response
from isocost.openai.requests import ChatRequest, CompletionRequest, RequestError, decode_body
from isocost.openai.usage import Usage, answer_usage, stream_event


@pytest.mark.parametrize(
    ("body", "kind", "param", "code"),
    [
        (b"{", ChatRequest, None, "invalid_json"),
        (b"[]", ChatRequest, None, "invalid_value"),
        (b'{"model": "m"}', CompletionRequest, "prompt", "invalid_value"),
        (b'{"model": "m", "prompt": "x", "n": "2"}', CompletionRequest, "n", None),
        (b'{"model": "m", "messages": [{"content": "x"}]}', ChatRequest, "messages[0].role", None),
    ],
)  # fmt: skip
def test_decoder_names_the_field(
    body: bytes, kind: type[object], param: str | None, code: str | None
) -> None:
    with pytest.raises(RequestError) as info:
        decode_body(body, kind)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.code == (code or "invalid_value")


def test_chat_text_joins_text_parts_only() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "image_url"}, {"text": "b"}]
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": parts}]}).encode()
    assert decode_body(body, ChatRequest).messages[0].text() == "ab"


def test_error_answers_carry_type_and_retry_after() -> None:
    full = error_response(ApiError(503, "full", code="overloaded", retry_after_s=2.5))
    assert full.status == 503 and full.headers["Retry-After"] == "3"
    assert full.content_type == "application/json"
    assert full.body is not None
    assert json.loads(bytes(full.body))["error"] == {
        "message": "full",
        "type": "service_unavailable",
        "param": None,
        "code": "overloaded",
    }
    assert "Retry-After" not in error_response(ApiError(400, "bad")).headers


def test_sse_framing_round_trips() -> None:
    stream = sse.event({"x": 1}) + sse.error_events(ApiError(502, "broke", code="timeout"))
    lines = stream.split(b"\n")
    data = [d for d in (sse.line_data(line) for line in lines) if d is not None]
    assert data[-1] == sse.DONE and json.loads(data[0]) == {"x": 1}
    assert json.loads(data[1])["error"]["type"] == "upstream_error"
    assert sse.count_events(stream) == 2
    assert sse.line_data(b": keep-alive") is None
    with pytest.raises(sse.SseError):
        sse.line_data(b"garbage")


def test_usage_from_an_answer_or_an_event_and_the_check_of_either() -> None:
    usage = Usage(prompt_tokens=3, completion_tokens=5, total_tokens=8)
    assert answer_usage(json.dumps({"usage": {"completion_tokens": 5}}).encode()) == Usage(
        completion_tokens=5
    )
    assert answer_usage(msgspec.json.encode({"choices": [], "usage": usage})) == usage
    assert answer_usage(b"{}") is None
    for not_an_object in (b"not json", b'{"choices": [', b"[1]", b"<html></html>"):
        with pytest.raises(msgspec.DecodeError):
            answer_usage(not_an_object)


@pytest.mark.parametrize(
    ("choices", "generated"),
    [
        ([{"delta": {"role": "assistant", "content": ""}}], False),  # a chat stream's opening
        ([{"delta": {}, "finish_reason": "stop"}], False),  # its finish
        ([], False),  # the usage chunk
        (None, False),
        ([{"delta": {"content": "hel"}}], True),
        ([{"delta": {"reasoning_content": "so"}}], True),
        ([{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}}], True),
        ([{"text": "lo", "finish_reason": None}], True),  # a completion's
        ([{"text": "", "finish_reason": "length"}], False),
        (["not a choice", {"delta": {"content": "x"}}], True),
    ],
)
def test_a_stream_event_carries_generated_output_or_not(choices: Any, generated: bool) -> None:
    event = stream_event(
        json.dumps({"choices": choices, "usage": {"completion_tokens": 2}}).encode()
    )
    assert event.generated is generated
    assert event.usage == Usage(completion_tokens=2)
    with pytest.raises(msgspec.DecodeError):
        stream_event(b"[1]")
