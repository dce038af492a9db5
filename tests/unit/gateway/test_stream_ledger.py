"""The ledger of a resumable stream: what it relays, counts, and rewrites after a resume."""

from __future__ import annotations

import json
from typing import Any

import pytest

from isocost.gateway.resume import SegmentError, StreamLedger


def event(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def chunk(text: str, done: int, *, cid: str = "cmpl-a", finish: str | None = None) -> bytes:
    usage = {"prompt_tokens": 7, "completion_tokens": done, "total_tokens": 7 + done}
    choice = {"index": 0, "text": text, "finish_reason": finish}
    return event(id=cid, object="text_completion", created=1, choices=[choice], usage=usage)


def relayed(ledger: StreamLedger, payload: bytes) -> dict[str, Any] | None:
    out = ledger.relay(payload)
    return None if out is None else json.loads(out)


def test_usage_asked_for_upstream_is_hidden_from_a_client_that_did_not_ask() -> None:
    ledger = StreamLedger({"model": "m", "prompt": "p", "stream": True}, chat=False, cap=10)
    first = relayed(ledger, chunk(" the", 1))
    assert first is not None and "usage" not in first and first["choices"][0]["text"] == " the"
    assert relayed(ledger, event(id="cmpl-a", choices=[], usage={"completion_tokens": 1})) is None
    assert ledger.tokens == 1 and ledger.prompt_tokens == 7


def test_after_a_resume_the_next_replicas_events_continue_the_first_stream() -> None:
    body = {"model": "m", "prompt": "p", "stream": True, "stream_options": {"include_usage": True}}
    ledger = StreamLedger(body, chat=False, cap=5)
    relayed(ledger, chunk(" the", 1))
    relayed(ledger, chunk(" of", 2))
    continued = json.loads(ledger.continuation_body())
    assert continued["prompt"] == "p the of" and continued["max_tokens"] == 3
    ledger.start_segment("a", "b")
    for done, text in enumerate([" and", " to", " in"], start=1):
        finish = "length" if done == 3 else None
        out = relayed(ledger, chunk(text, done, cid="cmpl-b", finish=finish))
        assert out is not None and out["id"] == "cmpl-a" and out["usage"] is None
    assert out["isocost"] == {"resumed": [{"from": "a", "to": "b", "after_tokens": 2}]}
    final = relayed(
        ledger, event(id="cmpl-b", choices=[], usage={"prompt_tokens": 9, "completion_tokens": 3})
    )
    assert final is not None and final["id"] == "cmpl-a"
    assert final["usage"] == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    assert "".join(ledger.text) == " the of and to in"


def test_a_chat_continuation_drops_its_opening_role_chunk() -> None:
    ledger = StreamLedger({"model": "m", "messages": [], "stream": True}, chat=True, cap=None)
    opening = event(id="c1", choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}])
    assert relayed(ledger, opening) is not None  # the first replica's opening is the client's
    relayed(ledger, event(id="c1", choices=[{"index": 0, "delta": {"content": " the"}}]))
    ledger.start_segment("a", "b")
    assert relayed(ledger, opening.replace(b"c1", b"c2")) is None
    assert ledger.tokens == 1  # no usage per chunk from this upstream: one token per chunk


def test_a_tool_call_delta_blocks_the_resume_and_errors_end_the_segment() -> None:
    ledger = StreamLedger({"model": "m", "messages": [], "stream": True}, chat=True, cap=None)
    tool = {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "f"}}]}}
    relayed(ledger, event(id="c1", choices=[tool]))
    assert ledger.blocker == "tool-call deltas were sent"
    with pytest.raises(SegmentError):
        ledger.relay(event(error={"message": "engine dead"}))
    with pytest.raises(SegmentError):
        ledger.relay(b"[1, 2]")


def test_a_stream_broken_at_its_cap_gets_its_tail_written() -> None:
    body = {"model": "m", "prompt": "p", "stream": True, "stream_options": {"include_usage": True}}
    ledger = StreamLedger(body, chat=False, cap=1)
    relayed(ledger, chunk(" the", 1))
    assert ledger.complete()
    tail = ledger.closing_events().decode().split("\n\n")
    finish, usage = json.loads(tail[0][6:]), json.loads(tail[1][6:])
    assert finish["choices"][0]["finish_reason"] == "length" and finish["id"] == "cmpl-a"
    assert usage["usage"]["completion_tokens"] == 1 and tail[2] == "data: [DONE]"


def test_a_stream_resumed_before_any_text_starts_over_with_its_tokens_uncounted() -> None:
    """A first token can carry no text (a piece of a character, a special token): the
    continuation is then the request itself, whose answer is all the client's, so the
    broken replica's tokens count for nothing (counted, the usage ran past max_tokens:
    601 of 600 once on real vLLM)."""
    body = {"model": "m", "prompt": "p", "stream": True, "stream_options": {"include_usage": True}}
    ledger = StreamLedger(body, chat=False, cap=3)
    relayed(ledger, chunk("", 1))
    continued = json.loads(ledger.continuation_body())
    assert continued["prompt"] == "p" and "max_tokens" not in continued
    ledger.start_segment("a", "b")
    for done, text in enumerate([" and", " to", " in"], start=1):
        out = relayed(
            ledger, chunk(text, done, cid="cmpl-b", finish="length" if done == 3 else None)
        )
    assert out is not None
    assert out["isocost"] == {"resumed": [{"from": "a", "to": "b", "after_tokens": 0}]}
    final = relayed(ledger, event(id="cmpl-b", choices=[], usage={"completion_tokens": 3}))
    assert final is not None and final["usage"]["completion_tokens"] == 3
