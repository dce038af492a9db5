"""The one SLO definition: TTFT targets that grow with the prompt, and the same judgement
on numbers and on arrays (bench judges a request at a time, the simulator a run at once)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from isocost.core.slo import (
    DEFAULT_SLO_SHARE,
    DEFAULT_SLO_TPOT_MS,
    DEFAULT_SLO_TTFT_MS,
    SloTargets,
)


def test_the_ttft_target_grows_per_thousand_prompt_tokens() -> None:
    slo = SloTargets.from_ms(500, 100, ttft_per_1k_ms=250)
    assert slo.ttft_target_s(0) == pytest.approx(0.5)
    assert slo.ttft_target_s(4000) == pytest.approx(1.5)
    assert SloTargets.from_ms(500, 100).ttft_target_s(100_000) == 0.5  # flat without per-1k


def test_defaults_are_the_ones_every_tool_uses() -> None:
    slo = SloTargets()
    assert (slo.ttft_s, slo.tpot_s, slo.ttft_per_1k_s, slo.share) == (
        DEFAULT_SLO_TTFT_MS / 1000,
        DEFAULT_SLO_TPOT_MS / 1000,
        0.0,
        DEFAULT_SLO_SHARE,
    )


def test_met_judges_numbers_and_arrays_alike() -> None:
    slo = SloTargets.from_ms(500, 100, ttft_per_1k_ms=250)
    cases = [  # (prompt tokens, ttft s, tpot s, met)
        (0, 0.4, 0.05, True),
        (0, 0.6, 0.05, False),  # late first token
        (4000, 1.4, 0.05, True),  # a long prompt gets more time
        (4000, 1.4, 0.2, False),  # slow stream
        (10, math.inf, 0.0, False),  # no first token
        (10, math.nan, math.nan, False),  # did not complete
    ]
    for prompt, ttft, tpot, expected in cases:
        assert slo.met(prompt, ttft, tpot) is expected
    prompts, ttfts, tpots, expected = (
        np.array(column, dtype=float) for column in zip(*cases, strict=True)
    )
    with np.errstate(invalid="ignore"):
        judged = slo.met(prompts, ttfts, tpots)
    assert judged.tolist() == expected.astype(bool).tolist()


def test_a_target_not_given_always_holds() -> None:
    slo = SloTargets.from_ms(None, None)
    assert slo.met(100_000, 1e9, 1e9) and slo.met(1, math.inf, 0.0)


@pytest.mark.parametrize(
    "args", [(0, 100, 0), (500, -1, 0), (500, 100, -1)], ids=["ttft", "tpot", "per-1k"]
)
def test_targets_must_be_positive(args: tuple[float, float, float]) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        SloTargets.from_ms(*args)


def test_the_share_is_a_fraction() -> None:
    with pytest.raises(ValueError, match="share"):
        SloTargets.from_ms(500, 100, share=1.5)


def test_an_answer_is_judged_by_its_stream_or_else_by_its_end() -> None:
    slo = SloTargets.from_ms(500, 100)
    # streamed: TTFT 0.4 s, then 10 more tokens in 0.9 s (90 ms each)
    assert slo.met_answer(10, 11, 0.4, 1.3)
    assert not slo.met_answer(10, 11, 0.4, 1.5)  # 110 ms per token
    assert not slo.met_answer(10, 11, 0.6, 1.0)  # late first token
    # whole: only the end is known, judged against both budgets together (0.5 + 10 * 0.1)
    assert slo.met_answer(10, 11, None, 1.5)
    assert not slo.met_answer(10, 11, None, 1.6)
    assert slo.met_answer(10, 1, 0.4, 0.4)  # one token: TPOT 0
