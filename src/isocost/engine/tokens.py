"""Prompt tokens, chat rendering and filler output for the engine simulator.

Without a tokenizer, text is cut by one regular expression into word-piece-like tokens:
an optional leading space plus up to 4 letters, up to 3 digits, a run of punctuation, or a
run of whitespace (roughly 4 characters of English per token, like BPE vocabularies).
Each piece maps to an id by CRC-32 modulo the vocabulary size. The split is prefix-stable:
two texts that share a prefix share every token up to the last piece boundary inside it,
so shared text prefixes give shared token blocks and hit the prefix cache. With
``--tokenizer tokenizer.json`` the Hugging Face ``tokenizers`` library counts exactly.

Chat messages render to one prompt string, one ``<|role|>`` header per message and a
trailing ``<|assistant|>``, so identical conversation prefixes render to identical text
prefixes; vLLM's ``continue_final_message`` leaves the last (assistant) message open
instead, and ``add_generation_prompt: false`` leaves the trailing header out. Generated
text is filler: a fixed cycle of words, each one approximate token, that goes on from the
word the prompt ends with when that is a word of the cycle (``filler_start``), else from
its first word. So a continuation (the prompt plus the answer so far, or the chat with the
partial answer continued) goes on exactly where the answer broke off, as a model would.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from functools import lru_cache
from typing import Protocol

from isocost.files import read_tokenizer

__all__ = [
    "ApproxTokenizer",
    "HfTokenizer",
    "Tokenizer",
    "filler_start",
    "filler_text",
    "load_tokenizer",
    "render_chat",
]

_PIECE = re.compile(r" ?[^\W\d_]{1,4}| ?\d{1,3}| ?(?:[^\s\w]|_)+|\s+")
_FILLER = (" the", " of", " and", " to", " in", " is", " that", " for", " it", " as", " with")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class ApproxTokenizer:
    """The deterministic, prefix-stable approximation described in the module docstring."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError("vocab_size must be positive")
        self.vocab_size = vocab_size
        self._piece_id = lru_cache(maxsize=1 << 16)(self._hash_piece)

    def _hash_piece(self, piece: str) -> int:
        return zlib.crc32(piece.encode("utf-8", "surrogatepass")) % self.vocab_size

    def encode(self, text: str) -> list[int]:
        piece_id = self._piece_id
        return [piece_id(piece) for piece in _PIECE.findall(text)]


class HfTokenizer:
    """An exact tokenizer from a local ``tokenizer.json``, without special tokens."""

    def __init__(self, path: str) -> None:
        self._tokenizer = read_tokenizer(path)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ids


def load_tokenizer(path: str | None, vocab_size: int) -> Tokenizer:
    """``HfTokenizer(path)`` when a path is given, else the approximation."""
    return HfTokenizer(path) if path else ApproxTokenizer(vocab_size)


def render_chat(
    messages: Sequence[tuple[str, str]],
    *,
    continue_final: bool = False,
    generation_prompt: bool = True,
) -> str:
    """One prompt string for ``(role, content)`` messages: ready for the assistant's
    answer (``generation_prompt``), or with the last message left open to be continued
    (``continue_final``)."""
    parts = [f"<|{role}|>\n{content}\n" for role, content in messages]
    if continue_final and parts:
        parts[-1] = parts[-1].removesuffix("\n")
    elif generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def filler_start(prompt: str) -> int:
    """Where in the filler cycle the answer to ``prompt`` begins: after the cycle's word
    that ends the prompt, else at the cycle's first word."""
    for index, word in enumerate(_FILLER):
        if prompt.endswith(word):
            return (index + 1) % len(_FILLER)
    return 0


def filler_text(start: int, count: int) -> str:
    """Output tokens ``start .. start+count-1`` of the filler answer."""
    return "".join(_FILLER[i % len(_FILLER)] for i in range(start, start + count))
