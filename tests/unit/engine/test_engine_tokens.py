"""Prompt tokens: the prefix-stable approximation, exact tokenizer files, chat rendering."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

from isocost.engine.tokens import (
    ApproxTokenizer,
    filler_start,
    filler_text,
    load_tokenizer,
    render_chat,
)


def test_approximation_is_deterministic_and_about_four_characters_a_token() -> None:
    tokenizer = ApproxTokenizer(32_000)
    text = "The quick brown fox jumps over the lazy dog, 12345 times_over!"
    ids = tokenizer.encode(text)
    assert ids == ApproxTokenizer(32_000).encode(text)
    assert all(0 <= i < 32_000 for i in ids)
    assert len(text) / 6 < len(ids) < len(text) / 2
    assert "".join(_pieces(text)) == text  # every character lands in some token


def _pieces(text: str) -> list[str]:
    from isocost.engine.tokens import _PIECE

    return _PIECE.findall(text)


def test_shared_text_prefixes_give_shared_token_prefixes() -> None:
    tokenizer = ApproxTokenizer(1000)
    prefix = "You are a helpful assistant. " * 50
    a = tokenizer.encode(prefix + "What is the capital of France?")
    b = tokenizer.encode(prefix + "Tell me a joke.")
    shared = tokenizer.encode(prefix)[:-1]  # the trailing space joins the next word
    assert a[: len(shared)] == b[: len(shared)] == shared
    assert a[len(shared)] != b[len(shared)]


def test_filler_text_is_one_approximate_token_per_output_token() -> None:
    tokenizer = ApproxTokenizer(1000)
    assert len(tokenizer.encode(filler_text(0, 37))) == 37
    assert filler_text(0, 5) + filler_text(5, 3) == filler_text(0, 8)


def test_chat_rendering_is_stable_under_appended_turns() -> None:
    first = [("system", "be brief"), ("user", "hi")]
    assert render_chat(first).removesuffix("<|assistant|>\n") in render_chat(
        [*first, ("assistant", "hello"), ("user", "bye")]
    )


def test_a_tokenizer_json_counts_exactly(tmp_path: Path) -> None:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    exact = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    exact.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    exact.save(str(path))
    assert load_tokenizer(str(path), 99).encode("hello world moon") == [1, 2, 0]
    assert isinstance(load_tokenizer(None, 99), ApproxTokenizer)


def test_the_filler_goes_on_from_the_cycle_word_the_prompt_ends_with() -> None:
    answer = filler_text(0, 30)
    assert filler_start("Tell me a story") == 0 and filler_start("<|assistant|>\n") == 0
    for cut in (1, 7, 11, 12, 29):  # a continuation: the prompt plus the answer so far
        start = filler_start("Tell me a story" + answer[: len(filler_text(0, cut))])
        assert filler_text(0, cut) + filler_text(start, 30 - cut) == answer


def test_a_chat_with_its_final_message_continued_renders_it_open() -> None:
    messages = [("user", "hi"), ("assistant", " the of")]
    opened = render_chat(messages, continue_final=True, generation_prompt=False)
    assert opened == "<|user|>\nhi\n<|assistant|>\n the of"
    assert render_chat(messages[:1]) + " the of" == opened  # the answer's own prefix
    assert render_chat(messages[:1], generation_prompt=False) == "<|user|>\nhi\n"
