"""The routing view decoded from request bodies."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isocost.gateway.body import RoutingView, summarize
from isocost.openai.requests import RequestError
from isocost.prefix.hashing import text_block_hashes, token_block_hashes


def routing_view(body: bytes, *, chat: bool, block_tokens: int) -> RoutingView:
    """What the intake routes by: the body's summary, then its block hashes."""
    return summarize(body, chat=chat).routing_view(block_tokens)


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


def completion(**fields: object) -> bytes:
    return json.dumps({"model": "m", "prompt": "x", **fields}).encode()


@pytest.mark.parametrize(
    ("body", "is_chat", "cap"),
    [
        (chat("x", max_completion_tokens=3), True, 3),
        (chat("x", max_tokens=3), True, 3),
        (chat("x", max_tokens=3, max_completion_tokens=3), True, 3),
        (chat("x"), True, None),  # the engine runs to the context
        (completion(max_completion_tokens=5), False, 5),
        (completion(max_tokens=5), False, 5),
        (completion(), False, 16),  # OpenAI's and vLLM's default
    ],
)
def test_output_cap_reads_both_fields_on_both_endpoints(
    body: bytes, is_chat: bool, cap: int | None
) -> None:
    assert routing_view(body, chat=is_chat, block_tokens=16).max_tokens == cap


@pytest.mark.parametrize("is_chat", [True, False])
def test_output_cap_fields_that_disagree_are_refused(is_chat: bool) -> None:
    fields = {"max_tokens": 9, "max_completion_tokens": 3}
    body = chat("x", **fields) if is_chat else completion(**fields)
    with pytest.raises(RequestError) as info:
        routing_view(body, chat=is_chat, block_tokens=16)
    assert info.value.param == "max_completion_tokens"


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
        (chat("x", max_completion_tokens=0), True, "max_completion_tokens"),
        (b'{"model": "m", "prompt": "x", "max_completion_tokens": -1}', False, "max_comp"),
        (b'{"model": "m", "prompt": "x", "n": ' + b"[" * 5000 + b"]" * 5000 + b"}", False, None),
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


@settings(max_examples=150, derandomize=True, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_escape_as_other_errors(data: bytes) -> None:
    with contextlib.suppress(RequestError):
        routing_view(data, chat=True, block_tokens=16)


@settings(max_examples=100, derandomize=True, deadline=None)
@given(st.text(max_size=300), st.text(max_size=300))
def test_shared_prefix_shares_block_hashes(prefix: str, rest: str) -> None:
    a = routing_view(chat(prefix + rest), chat=True, block_tokens=4)
    b = routing_view(chat(prefix), chat=True, block_tokens=4)
    assert a.block_hashes[: len(b.block_hashes)] == b.block_hashes
