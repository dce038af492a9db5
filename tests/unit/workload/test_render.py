"""The text renderer: token budget, shared prefixes, salts."""

from __future__ import annotations

import math

from isocost.workload import Segment, TextRenderer, prefix_block_keys
from isocost.workload._render import WORDS


def test_the_vocabulary_is_128_distinct_three_letter_words() -> None:
    assert len(set(WORDS)) == 128 and all(len(w) == 3 and w.isalpha() for w in WORDS)


def test_rendered_text_has_one_word_and_four_characters_per_token() -> None:
    text = TextRenderer().render([Segment(1, 700), Segment(2, 5)])
    assert len(text.split(" ")) == 705
    assert math.ceil(len(text) / 4) == 705


def test_shared_segments_render_to_a_shared_text_prefix() -> None:
    renderer = TextRenderer()
    a = renderer.render([Segment(1, 512), Segment(2, 100)]).split(" ")
    b = renderer.render([Segment(1, 512), Segment(3, 100)]).split(" ")
    assert a[:512] == b[:512]
    assert a[512:] != b[512:]
    short = renderer.render([Segment(1, 300)]).split(" ")
    assert short == a[:300], "a partial segment is a prefix of the full one"


def test_rendering_does_not_depend_on_the_cache_or_instance() -> None:
    small = TextRenderer(max_cached_chunks=1)
    segments = [Segment(9, 1500), Segment(4, 1100), Segment(9, 600)]
    assert small.render(segments) == TextRenderer().render(segments)


def test_salt_changes_the_text() -> None:
    assert TextRenderer(salt=1).render([Segment(1, 50)]) != TextRenderer().render([Segment(1, 50)])


def test_block_keys_cut_segments_at_block_edges() -> None:
    keys = prefix_block_keys([Segment(1, 20), Segment(2, 20)], 16)
    assert keys == [((1, 0, 16),), ((1, 16, 20), (2, 0, 12))]
