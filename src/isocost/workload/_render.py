"""Deterministic prompt text for a request, so shared prefixes stay shared on a live server.

Each segment seed names an endless stream of words; a segment of n tokens renders as the
stream's first n words. The stream is cut into chunks of ``CHUNK_WORDS`` words and chunk j
of seed s is ``Random(f"isocost-text:{salt}:{s}:{j}").randbytes(CHUNK_WORDS)`` with each
byte picking one of 128 words (string seeds hash with SHA-512, so the text is the same in
every process and on every machine). Words are joined by single spaces, so equal segment
prefixes give byte-equal text prefixes.

Token budget: every word is three lowercase letters, so one word plus its space is four
characters. Both common approximations (one token per whitespace word; one token per four
characters, rounded up) count a rendered n-token prompt as n tokens. They are common
English words, mostly one token each in large BPE vocabularies; a real tokenizer's count
shows in the usage a server reports, which the load generator records. A different
``salt`` gives unrelated text for the same workload: use it to start a repeated run with a
cold prefix cache.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from random import Random

from isocost.workload._request import Segment, WorkloadRequest

__all__ = ["CHUNK_WORDS", "WORDS", "TextRenderer"]

CHUNK_WORDS = 512

_WORD_LIST = """the and for are but not you all any can had her was one our out day get has him his
    how man new now old see two way who boy did its let put say she too use act add age ago
    aid aim air art ask bad bag bed big bit box bus buy car cat cup cut dog dry ear eat egg
    end eye far fat few fit fix fly fun gas god gun guy hat hit hot ice job key kid lab law
    lay leg lie lot low map mix mom net oil pay pen pet pop pot raw red rid row run sad sea
    set sit six sky son sun tax tea ten tie tip top toy try war wet win yes yet"""
WORDS: tuple[str, ...] = tuple(_WORD_LIST.split())  # 128: a byte modulo 128 picks one
_WORDS_BY_BYTE = WORDS * (256 // len(WORDS))


class TextRenderer:
    """Renders segments to text; keeps up to ``max_cached_chunks`` word chunks."""

    def __init__(self, salt: int = 0, max_cached_chunks: int = 4096) -> None:
        self._salt = salt
        self._max_cached_chunks = max_cached_chunks
        self._chunks: dict[tuple[int, int], tuple[str, ...]] = {}

    def render(self, segments: Iterable[Segment]) -> str:
        """The text of a prompt: its segments' words, space-separated."""
        words: list[str] = []
        for segment in segments:
            words.extend(self._words(segment.seed, segment.num_tokens))
        return " ".join(words)

    def render_request(self, request: WorkloadRequest) -> str:
        """The prompt text of ``request``."""
        return self.render(request.segments)

    def _words(self, seed: int, count: int) -> list[str]:
        words: list[str] = []
        for chunk in range(-(-count // CHUNK_WORDS)):
            take = min(CHUNK_WORDS, count - chunk * CHUNK_WORDS)
            words.extend(self._chunk(seed, chunk)[:take])
        return words

    def _chunk(self, seed: int, index: int) -> tuple[str, ...]:
        key = (seed, index)
        cached = self._chunks.pop(key, None)
        if cached is None:
            data = Random(f"isocost-text:{self._salt}:{seed}:{index}").randbytes(CHUNK_WORDS)
            cached = operator.itemgetter(*data)(_WORDS_BY_BYTE)
            if len(self._chunks) >= self._max_cached_chunks:
                del self._chunks[next(iter(self._chunks))]
        self._chunks[key] = cached  # re-inserted last: the dict order is least recent first
        return cached
