"""The routing view decoded from request bodies."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isocost.gateway.body import routing_view
from isocost.openai.requests import RequestError
from isocost.prefix.hashing import text_block_hashes, token_block_hashes


def chat(content: object, **extra: object) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": content}], **extra}
    ).encode()


def test_chat_fields_and_estimate() -> None:
    view = routing_view(
        chat("x" * 400, max_tokens=7, stream=True, user="u1"), chat=True, block_tokens=16
    )
    assert (view.model, view.max_tokens, view.stream, view.user) == ("m", 7, True, "u1")
    assert view.prompt_tokens == -(-(len("<|user|>") + 400) // 4)
    assert not view.prompt_tokens_exact
    assert len(view.block_hashes) == (len("<|user|>") + 400) // 64


def test_content_parts_count_like_plain_text() -> None:
    parts = [
        {"type": "text", "text": "hello "},
        {"type": "image_url"},
        {"type": "text", "text": "world"},
    ]
    assert routing_view(chat(parts), chat=True, block_tokens=4) == routing_view(
        chat("hello world"), chat=True, block_tokens=4
    )


def test_max_completion_tokens_wins() -> None:
    view = routing_view(
        chat("x", max_tokens=9, max_completion_tokens=3), chat=True, block_tokens=16
    )
    assert view.max_tokens == 3


def test_token_id_prompts_are_exact() -> None:
    ids = list(range(40))
    view = routing_view(
        json.dumps({"model": "m", "prompt": ids}).encode(), chat=False, block_tokens=16
    )
    assert view.prompt_tokens == 40 and view.prompt_tokens_exact
    assert view.block_hashes == tuple(token_block_hashes(ids, 16))


def test_batched_prompts_count_all_and_hash_the_first() -> None:
    body = json.dumps({"model": "m", "prompt": ["a" * 128, "b" * 64]}).encode()
    view = routing_view(body, chat=False, block_tokens=16)
    assert view.prompt_tokens == 48
    assert view.block_hashes == tuple(text_block_hashes("a" * 128, 64))


@pytest.mark.parametrize(
    ("body", "is_chat", "param"),
    [
        (b"{", True, None),
        (b"[]", True, None),
        (b'{"model": 3, "messages": []}', True, "model"),
        (chat("x", max_tokens="7"), True, "max_tokens"),
        (chat("x", max_tokens=0), True, "max_tokens"),
        (chat("x", stream="yes"), True, "stream"),
        (b'{"model": "m", "messages": []}', True, "messages"),
        (b'{"model": "m", "messages": [{"content": "x"}]}', True, "messages[0]"),
        (b'{"model": "m"}', False, "prompt"),
        (b'{"model": "m", "prompt": [1, "a"]}', False, "prompt"),
    ],
)
def test_bad_bodies(body: bytes, is_chat: bool, param: str | None) -> None:
    with pytest.raises(RequestError) as info:
        routing_view(body, chat=is_chat, block_tokens=16)
    if param is not None:
        assert info.value.param is not None and info.value.param.startswith(param)


@settings(max_examples=150, derandomize=True)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_escape_as_other_errors(data: bytes) -> None:
    with contextlib.suppress(RequestError):
        routing_view(data, chat=True, block_tokens=16)


@settings(max_examples=100, derandomize=True)
@given(st.text(max_size=300), st.text(max_size=300))
def test_shared_prefix_shares_block_hashes(prefix: str, rest: str) -> None:
    a = routing_view(chat(prefix + rest), chat=True, block_tokens=4)
    b = routing_view(chat(prefix), chat=True, block_tokens=4)
    assert a.block_hashes[: len(b.block_hashes)] == b.block_hashes
