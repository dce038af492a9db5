"""``EngineModel.set_slowdown``: a new step-time factor re-times the step in flight, so a
fault cleared mid-step ends that step at once, not when the old factor said."""

from __future__ import annotations

import itertools

import pytest

from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.engine import EngineModel, FirstToken, RequestSpec
from isocost.prefix.hashing import token_block_hashes

CATALOG = Catalog.builtin()
COST = CostModel(CATALOG.model("llama-3.1-8b"), CATALOG.gpu("h100-80g"), 1)


def _spec(request_id: str, num_tokens: int, output: int) -> RequestSpec:
    tokens = list(range(num_tokens))
    return RequestSpec(request_id, num_tokens, output, tuple(token_block_hashes(tokens, 16)))


def test_clearing_a_slowdown_mid_step_runs_the_rest_at_the_new_factor() -> None:
    model = EngineModel(COST)
    model.set_slowdown(1000.0, 0.0)
    model.submit(_spec("a", 100, 1), 0.0)
    assert model.advance_to(0.0) == []  # the prefill step starts
    step_s = COST.step_time_s(100)
    assert model.next_event_time() == pytest.approx(1000 * step_s)
    now = 250 * step_s  # a quarter of its work done
    assert model.advance_to(now) == []
    model.set_slowdown(1.0, now)
    end = model.next_event_time()
    assert end == pytest.approx(now + 0.75 * step_s)  # the rest, at the new factor
    first = model.advance_to(end)[0]
    assert isinstance(first, FirstToken) and first.time_s == end


def test_inside_a_decode_run_the_step_in_flight_and_the_rest_come_at_the_new_factor() -> None:
    """A pure-decode run is timed in closed form at the old factor; after the change its
    step in flight and every later step are timed at the new one."""
    model = EngineModel(COST)
    model.set_slowdown(2.0, 0.0)
    model.submit(_spec("a", 100, 50), 0.0)
    while model.counters.num_generation_tokens < 10:
        model.advance_to(model.next_event_time() or 0.0)
    now = model.next_event_time()
    assert now is not None
    model.advance_to(now)
    model.set_slowdown(1.0, now)
    ends = [now]
    while (t := model.next_event_time()) is not None:
        model.advance_to(t)
        ends.append(t)
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    # every later step is a decode of one request at factor 1, about one decode step long
    one_step_s = COST.step_time_s(0, 0, 1, 100 + 20)
    assert all(g == pytest.approx(one_step_s, rel=0.1) for g in gaps)


def test_the_factor_changes_only_at_the_model_clock() -> None:
    model = EngineModel(COST)
    model.submit(_spec("a", 100, 1), 1.0)
    model.advance_to(1.0)
    with pytest.raises(ValueError, match="before the model clock"):
        model.set_slowdown(2.0, 0.5)
    with pytest.raises(ValueError, match="advance_to"):
        model.set_slowdown(2.0, 5.0)
