"""What a resumable stream has relayed, and how the next replica's events are made seamless.

A ``StreamLedger`` sits between the upstream streams of one client request and the
client: every upstream event passes ``relay``, which reads what it carries (text, the
usage so far, a finish reason, tool-call or reasoning deltas) and answers the event the
client gets, or None to drop it. Upstreams are asked for the usage in every chunk
(``with_usage_stats``), so the ledger always knows the exact tokens sent; the client sees
usage only as it asked for it. After a resume the next replica's events are rewritten into
the first one's: its ``id`` and ``created``, usage counted from the start of the answer
(prompt tokens as the first replica counted them, completion tokens summed over every
replica), its chat opening chunk (the assistant role, no text) dropped, and the chunk with
the ``finish_reason`` names the resumes in an ``isocost.resumed`` field:
``[{"from": replica, "to": replica, "after_tokens": n}, ...]``.

A stream can no longer be resumed exactly once a tool-call or reasoning delta went out
(``blocker``); it is complete, and only its tail needs writing, once its finish reason went
out or its cap was reached (``closing_events``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from isocost.core.jsontext import UNDECODABLE
from isocost.openai import sse
from isocost.openai.continuation import continuation, with_usage_stats
from isocost.openai.usage import cached_prompt_tokens, choice_generated

__all__ = ["SegmentError", "StreamLedger"]

_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder().encode


class SegmentError(Exception):
    """An upstream event that ends this replica's part of the stream: not a JSON object, or
    an error event (the engine failed mid-generation)."""


class StreamLedger:
    """One resumable stream's relayed state; see the module docstring."""

    def __init__(self, body: dict[str, Any], *, chat: bool, cap: int | None) -> None:
        self.body = body  # the client's request, decoded
        self.chat = chat
        self.cap = cap  # the output cap the engine runs (None: the model's context)
        options = body.get("stream_options")
        options = options if isinstance(options, dict) else {}
        self.client_usage = bool(options.get("include_usage"))
        self.client_continuous = self.client_usage and bool(options.get("continuous_usage_stats"))
        self.text: list[str] = []
        self.offset = 0  # completion tokens of the replicas before this one
        self.segment_tokens = 0  # this replica's completion tokens so far
        self.generated_events = 0  # relayed events that carried generated output, all replicas
        self.prompt_tokens: int | None = None  # as the first replica counted them
        self.cached_tokens: int | None = None  # the first replica's prefix-cache hit
        self.finish_reason: str | None = None
        self.blocker: str | None = None  # why it can no longer be resumed exactly
        self.resumes: list[dict[str, Any]] = []
        self.usage_sent = False
        self._envelope: dict[str, Any] = {}  # the first replica's id, object, created, model

    @property
    def tokens(self) -> int:
        """Completion tokens relayed so far, over every replica."""
        return self.offset + self.segment_tokens

    def upstream_body(self) -> bytes:
        """The first replica's body: the client's, asking for the usage in every chunk."""
        return _encode(with_usage_stats(self.body))

    def complete(self) -> bool:
        """Whether everything but the stream's tail went out already."""
        return self.finish_reason is not None or (self.cap is not None and self.tokens >= self.cap)

    def continuation_body(self) -> bytes:
        """The body that continues the stream from what was relayed so far."""
        text = "".join(self.text)
        if not text:  # nothing generated yet: the request itself, from the start
            return self.upstream_body()
        body = continuation(
            self.body, chat=self.chat, text=text, sent_tokens=self.tokens, cap=self.cap
        )
        return _encode(body)

    def start_segment(self, from_replica: str, to_replica: str) -> None:
        """The continuation goes to ``to_replica``: its events follow what was sent. Before
        any text it is the request itself (``continuation_body``), whose whole answer is
        the client's: the tokens before it, which showed nothing, are not counted."""
        self.offset = self.tokens if self.text else 0
        self.segment_tokens = 0
        self.resumes.append({"from": from_replica, "to": to_replica, "after_tokens": self.offset})

    def abandon_segment(self) -> None:
        """The continuation failed before its first event: forget its resume."""
        self.resumes.pop()

    def relay(self, payload: bytes) -> bytes | None:
        """The client's event for one upstream event's payload (None: dropped)."""
        try:
            event = _decode.decode(payload)
        except UNDECODABLE:
            raise SegmentError("event is not a JSON object") from None
        if not isinstance(event, dict):
            raise SegmentError("event is not a JSON object")
        if "error" in event:
            raise SegmentError("error event")
        if not self._envelope:
            self._envelope = {k: event.get(k) for k in ("id", "object", "created", "model")}
        usage = event.get("usage")
        if isinstance(usage, dict):
            self._count(usage)
        choices = event.get("choices")
        if not choices:  # the usage chunk
            if not self.client_usage or self.usage_sent:
                return None
            self.usage_sent = True
            event["usage"] = self._usage()
            return self._rewrite(event)
        if self.resumes and self._opening(choices):
            return None
        counted = isinstance(usage, dict)
        for choice in choices:
            self._read(choice, counted)
        if any(choice_generated(choice) for choice in choices):  # each an object (_read)
            self.generated_events += 1
        if not self.resumes and "usage" not in event:
            return payload  # nothing to change: as the upstream wrote it (most events)
        if "usage" in event:
            if self.client_continuous and counted:
                event["usage"] = self._usage()
            elif self.client_usage:
                event["usage"] = None
            else:
                del event["usage"]
        if self.resumes and any(c.get("finish_reason") for c in choices):
            event["isocost"] = {"resumed": self.resumes}
        return self._rewrite(event)

    def closing_events(self) -> bytes:
        """The tail of a stream whose upstream broke once it was complete: the finish
        (``length``: the cap was reached) unless it went out, the usage if asked, [DONE]."""
        events = b""
        if self.finish_reason is None:
            self.finish_reason = "length"
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if self.chat:
                choice["delta"] = {}
            else:
                choice["text"] = ""
            finish = {**self._envelope, "choices": [choice]}
            if self.resumes:
                finish["isocost"] = {"resumed": self.resumes}
            events += sse.event(finish)
        if self.client_usage and not self.usage_sent:
            self.usage_sent = True
            events += sse.event({**self._envelope, "choices": [], "usage": self._usage()})
        return events + sse.DONE_EVENT

    def _count(self, usage: dict[str, Any]) -> None:
        completion, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
        if isinstance(completion, int):
            self.segment_tokens = max(self.segment_tokens, completion)
        if isinstance(prompt, int) and self.prompt_tokens is None:
            self.prompt_tokens = prompt
        if not self.resumes and self.cached_tokens is None:
            self.cached_tokens = cached_prompt_tokens(usage)

    def _read(self, choice: Any, counted: bool) -> None:
        if not isinstance(choice, dict):
            raise SegmentError("a choice that is not an object")
        delta = choice.get("delta")
        piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if isinstance(piece, str) and piece:
            self.text.append(piece)
            if not counted:  # an upstream without usage per chunk: one token per chunk
                self.segment_tokens += 1
        if isinstance(delta, dict):
            if delta.get("tool_calls"):
                self.blocker = "tool-call deltas were sent"
            if delta.get("reasoning_content") or delta.get("reasoning"):
                self.blocker = "reasoning deltas were sent"
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])

    def _opening(self, choices: list[Any]) -> bool:
        """A continuation's chat opening chunk: the assistant role and no text."""
        for choice in choices:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if not isinstance(delta, dict) or choice.get("finish_reason"):
                return False
            if delta.get("content") or set(delta) - {"role", "content"}:
                return False
        return True

    def _usage(self) -> dict[str, int]:
        prompt = self.prompt_tokens or 0
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.tokens,
            "total_tokens": prompt + self.tokens,
        }

    def _rewrite(self, event: dict[str, Any]) -> bytes:
        if self.resumes:
            for key in ("id", "created"):
                if self._envelope.get(key) is not None:
                    event[key] = self._envelope[key]
        return _encode(event)
