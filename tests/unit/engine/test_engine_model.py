"""The pure engine model: timings against the cost model, prefix caching, KV pressure,
preemption, aborts, the driving contract, jumps against single steps, the decode lines
jumps price runs with, and what ``observe`` reads."""

from __future__ import annotations

import copy
from dataclasses import astuple

import pytest

from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel, DecodeLines, EngineLimits
from isocost.engine import (
    EngineEvent,
    EngineModel,
    Finished,
    FirstToken,
    Preempted,
    RequestSpec,
    prefill_floor_s,
)
from isocost.prefix.hashing import token_block_hashes

CATALOG = Catalog.builtin()


def _cost(limits: EngineLimits | None = None) -> CostModel:
    return CostModel(CATALOG.model("llama-3.1-8b"), CATALOG.gpu("h100-80g"), 1, limits=limits)


def _spec(request_id: str, tokens: list[int], output: int) -> RequestSpec:
    return RequestSpec(request_id, len(tokens), output, tuple(token_block_hashes(tokens, 16)))


def _drain(model: EngineModel) -> list[EngineEvent]:
    events: list[EngineEvent] = []
    while (t := model.next_event_time()) is not None:
        events += model.advance_to(t)
    return events


def _times(events: list[EngineEvent]) -> dict[tuple[str, str], float]:
    return {(type(e).__name__, e.request_id): e.time_s for e in events}


def _exact_and_times(events: list[EngineEvent]) -> tuple[list[list[object]], list[float]]:
    """Events split into what jumps keep exact and their times (equal to ~1e-12)."""
    rows = [(type(e).__name__, *astuple(e)) for e in events]
    exact = [[v for v in row if not isinstance(v, float)] for row in rows]
    return exact, [v for row in rows for v in row if isinstance(v, float)]


@pytest.mark.parametrize(
    ("model", "gpu", "tp"),
    [
        ("llama-3.1-8b", "h100-80g", 1),
        ("llama-3.1-70b", "h100-80g", 8),
        ("mixtral-8x7b", "a100-80g", 2),
        ("deepseek-v3", "h200-141g", 8),
    ],
)
def test_decode_lines_are_the_cost_models_decode_step(model: str, gpu: str, tp: int) -> None:
    cost = CostModel(CATALOG.model(model), CATALOG.gpu(gpu), tp)
    for batch in (1, 2, 3, 7, 16, 64, 255, 256, 1000):
        lines = cost.decode_lines(batch)
        for context in (0, 1, batch, 17 * batch, 1000 * batch, 100_000 * batch):
            expected = cost.step_time_s(0, 0, batch, context)
            assert lines.step_time_s(context) == pytest.approx(expected, rel=1e-12, abs=0)


def test_a_decode_run_is_the_sum_of_its_steps_across_the_roofline_crossover() -> None:
    cost = _cost()
    lines = cost.decode_lines(256)  # compute-bound while contexts are short, then memory
    compute_first = lines.compute_s + lines.compute_s_per_token * 256 * 10
    memory_first = lines.memory_s + lines.memory_s_per_token * 256 * 10
    assert compute_first > memory_first
    assert lines.compute_s_per_token < lines.memory_s_per_token
    for context in (256 * 10, 256 * 11 + 5, 256 * 400):
        total = 0.0
        for steps in range(400):
            assert lines.run_time_s(context, steps) == pytest.approx(total, rel=1e-12, abs=0)
            total += cost.step_time_s(0, 0, 256, context + steps * 256)
    assert lines.run_time_s(0, 0) == 0.0
    with pytest.raises(ValueError, match="batch_size"):
        cost.decode_lines(0)


@pytest.mark.parametrize(
    ("compute_s", "compute_per", "memory_s", "memory_per"),
    [
        (1.0, 0.01, 2.0, 0.001),  # memory-bound first, compute-bound from C = 111.1
        (2.0, 0.001, 1.0, 0.01),  # compute-bound first, memory-bound from C = 111.1
        (1.0, 0.01, 2.0, 0.01),  # parallel lines: memory all along
        (1.0, 0.01, 1.0, 0.01),  # the same line
        (1.0, 0.0101, 2.0, 0.0001),  # crossing exactly at a step (C = 100)
    ],
)
def test_a_decode_run_sums_its_steps_whichever_line_comes_first(
    compute_s: float, compute_per: float, memory_s: float, memory_per: float
) -> None:
    lines = DecodeLines(4, compute_s, compute_per, memory_s, memory_per, fixed_s=0.25)
    for context in (0, 3, 100, 112, 400):
        total = 0.0
        for steps in range(80):
            assert lines.run_time_s(context, steps) == pytest.approx(total, rel=1e-12, abs=0)
            total += lines.step_time_s(context + 4 * steps)


@pytest.mark.parametrize(
    ("compute_s", "compute_per", "memory_s", "memory_per"),
    [(1.0, 0.01, 2.0, 0.001), (2.0, 0.001, 1.0, 0.01), (1.0, 0.01, 2.0, 0.01)],
)
def test_a_series_prices_its_steps_on_the_larger_line_until_the_lines_cross(
    compute_s: float, compute_per: float, memory_s: float, memory_per: float
) -> None:
    lines = DecodeLines(4, compute_s, compute_per, memory_s, memory_per, fixed_s=0.25)
    for context in (0, 3, 100, 112, 400):
        series = lines.series(context)
        for step in range(80):
            tokens = context + 4 * step
            compute = compute_s + compute_per * tokens
            memory = memory_s + memory_per * tokens
            on_compute = series.compute_first == (step < series.crossing)
            assert (compute >= memory - 1e-12) if on_compute else (memory >= compute - 1e-12)


def test_single_request_timing_is_the_cost_model_step_by_step() -> None:
    cost = _cost()
    model = EngineModel(cost)
    model.submit(_spec("a", list(range(1000)), 3), 0.0)
    events = _drain(model)
    ttft = 0.0 + cost.step_time_s(1000, 0, 0, 0)
    end = ttft + cost.step_time_s(0, 0, 1, 1000)
    end = end + cost.step_time_s(0, 0, 1, 1001)
    assert events == [FirstToken("a", ttft, ttft), Finished("a", end, 1000, 3, ttft, end)]


def test_a_batch_is_priced_as_one_step_of_the_cost_model() -> None:
    cost = _cost()
    model = EngineModel(cost)
    model.submit(_spec("a", list(range(300)), 2), 0.0)
    model.submit(_spec("b", list(range(1000, 1500)), 2), 0.0)
    times = _times(_drain(model))
    prefill = cost.step_time_s(800, 0, 0, 0)
    assert times[("FirstToken", "a")] == times[("FirstToken", "b")] == prefill
    assert times[("Finished", "a")] == prefill + cost.step_time_s(0, 0, 2, 800)


def test_long_prompts_prefill_in_chunks_of_the_token_budget() -> None:
    cost = _cost(EngineLimits(max_num_batched_tokens=2048))
    model = EngineModel(cost)
    model.submit(_spec("a", list(range(5000)), 1), 0.0)
    (first, finished) = _drain(model)
    assert model.counters.num_steps == 3  # 2048 + 2048 + 904
    assert first.time_s == finished.time_s == cost.prefill_time_s(5000)


def test_slowdown_stretches_every_step() -> None:
    cost = _cost()
    model = EngineModel(cost)
    model.slowdown = 3.0
    model.submit(_spec("a", list(range(100)), 1), 0.0)
    (first, _) = _drain(model)
    assert first.ttft_s == cost.step_time_s(100) * 3.0


def test_shared_prefix_hits_the_cache_and_cuts_ttft() -> None:
    model = EngineModel(_cost())
    prefix = list(range(4000))
    model.submit(_spec("warmup", [*prefix, 1, 2, 3], 1), 0.0)
    now = _drain(model)[-1].time_s
    queries, hits = model.counters.prefix_cache_queries, model.counters.prefix_cache_hits
    model.submit(_spec("warm", [*prefix, 7, 8, 9], 1), now)
    (warm, done) = _drain(model)
    assert model.counters.prefix_cache_queries - queries == 4003
    assert model.counters.prefix_cache_hits - hits == 4000  # 250 full shared blocks
    model.submit(_spec("cold", list(range(50_000, 54_003)), 1), done.time_s)
    (cold, _) = _drain(model)
    assert isinstance(warm, FirstToken) and isinstance(cold, FirstToken)
    assert warm.ttft_s < cold.ttft_s / 5


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    model = EngineModel(_cost())
    prompt = list(range(64))  # exactly four blocks
    model.submit(_spec("a", prompt, 1), 0.0)
    model.submit(_spec("b", prompt, 1), _drain(model)[-1].time_s)
    _drain(model)
    assert model.counters.prefix_cache_hits == 48  # three blocks; the fourth is recomputed


def _first_token_beside(company: list[RequestSpec]) -> float:
    """TTFT of a prompt whose 40,000-token prefix is cached, entering with ``company``."""
    model = EngineModel(_cost())
    prefix = list(range(40_000))
    model.submit(_spec("warmup", [*prefix, 1], 1), 0.0)
    now = _drain(model)[-1].time_s
    model.submit(_spec("warm", [*prefix, *range(7, 17)], 1), now)
    for spec in company:
        model.submit(spec, now)
    return next(
        e.ttft_s for e in _drain(model) if isinstance(e, FirstToken) and e.request_id == "warm"
    )


def test_the_prefill_floor_is_below_a_cached_prompt_sped_up_by_fresh_company() -> None:
    """A step prices its prefill chunks at their mean cached context: fresh chunks beside a
    memory-bound chunk with a long cached context make its step cheaper than alone."""
    cost = _cost()
    alone = _first_token_beside([])
    beside = min(
        _first_token_beside([_spec(f"fresh{size}", list(range(10**6, 10**6 + size)), 1)])
        for size in (30, 300, 3000)
    )
    assert alone == pytest.approx(cost.prefill_time_s(10, 40_000), rel=1e-12)
    assert beside < 0.95 * alone
    assert prefill_floor_s(cost, 10, 40_000) <= beside


@pytest.mark.parametrize(("new", "cached"), [(5000, 0), (20_000, 3000), (8192, 100)])
def test_the_prefill_floor_of_compute_bound_chunks_is_their_time_alone(
    new: int, cached: int
) -> None:
    cost = _cost()
    assert prefill_floor_s(cost, new, cached) == cost.prefill_time_s(new, cached)


def test_the_prefill_floor_is_the_cheapest_company_of_fresh_chunks() -> None:
    cost = _cost(EngineLimits(max_num_batched_tokens=600))
    new, cached = 24, 30_000
    scanned = min(cost.step_time_s(tokens, new * cached // tokens) for tokens in range(new, 601))
    assert prefill_floor_s(cost, new, cached) == scanned < cost.prefill_time_s(new, cached)


def test_lru_eviction_keeps_the_recently_used_prefix() -> None:
    model = EngineModel(_cost(), num_blocks=8)
    old, new = list(range(64)), list(range(100, 164))
    now = 0.0
    for request_id, prompt in (("old", old), ("new", new)):
        model.submit(_spec(request_id, prompt, 1), now)
        now = _drain(model)[-1].time_s
    model.submit(_spec("filler", list(range(500, 532)), 1), now)  # evicts 2 blocks
    _drain(model)
    hashes_old = token_block_hashes(old, 16)
    hashes_new = token_block_hashes(new, 16)
    assert all(model.pool.is_cached(h) for h in hashes_new)
    assert not model.pool.is_cached(hashes_old[-1])  # tails go first
    assert model.pool.is_cached(hashes_old[0])


def test_full_kv_cache_makes_requests_wait_then_preempts_and_all_finish() -> None:
    model = EngineModel(_cost(), num_blocks=64)  # 1024 tokens
    for i in range(8):
        model.submit(_spec(f"r{i}", list(range(i * 1000, i * 1000 + 200)), 300), 0.0)
    peak_waiting = peak_usage = 0.0
    events: list[EngineEvent] = []
    while (t := model.next_event_time()) is not None:
        events += model.advance_to(t)
        peak_waiting = max(peak_waiting, model.num_waiting)
        peak_usage = max(peak_usage, model.kv_usage)
    finished = [e for e in events if isinstance(e, Finished)]
    preempted = [e for e in events if isinstance(e, Preempted)]
    assert sorted(e.request_id for e in finished) == [f"r{i}" for i in range(8)]
    assert all(e.num_output_tokens == 300 for e in finished)
    assert preempted and model.counters.num_preemptions == len(preempted)
    assert peak_waiting >= 5 and peak_usage == 1.0
    assert model.pool.num_used == 0 and model.num_running == model.num_waiting == 0


def test_preemption_picks_the_newest_running_request() -> None:
    model = EngineModel(_cost(), num_blocks=20)
    model.submit(_spec("old", list(range(100)), 200), 0.0)
    now = model.next_event_time() or 0.0
    model.advance_to(now)
    model.submit(_spec("new", list(range(1000, 1100)), 200), now)
    preempted = [e for e in _drain(model) if isinstance(e, Preempted)]
    assert preempted and {e.request_id for e in preempted} == {"new"}


def test_abort_frees_the_blocks_of_running_and_waiting_requests() -> None:
    model = EngineModel(_cost(), num_blocks=40)
    model.submit(_spec("run", list(range(300)), 300), 0.0)
    model.submit(_spec("wait", list(range(1000, 1400)), 200), 0.0)
    model.advance_to(model.next_event_time() or 0.0)
    assert model.num_running == 1 and model.num_waiting == 1  # 19 + 25 blocks > 40
    model.abort("wait")
    model.abort("run")
    assert model.pool.num_used == 0
    assert [e for e in _drain(model) if not isinstance(e, FirstToken)] == []
    assert model.request("run") is None


def test_the_driving_contract_refuses_skipped_events_and_impossible_requests() -> None:
    model = EngineModel(_cost(), num_blocks=10)
    model.submit(_spec("a", list(range(50)), 5), 1.0)
    with pytest.raises(ValueError, match="before the model clock"):
        model.advance_to(0.5)
    with pytest.raises(ValueError, match="advance_to"):
        model.submit(_spec("b", list(range(50)), 5), 2.0)
    with pytest.raises(ValueError, match="exceeds 160"):
        model.submit(_spec("c", list(range(150)), 11), 1.0)
    with pytest.raises(ValueError, match="duplicate"):
        model.submit(_spec("a", list(range(50)), 5), 1.0)
    with pytest.raises(ValueError, match="at least one"):
        model.submit(RequestSpec("d", 10, 0), 1.0)


def test_requests_submitted_mid_step_wait_for_the_next_step() -> None:
    cost = _cost()
    model = EngineModel(cost)
    model.submit(_spec("a", list(range(2000)), 1), 0.0)
    model.advance_to(0.0)
    model.submit(_spec("b", list(range(5000, 5100)), 1), 0.001)
    times = _times(_drain(model))
    first_step = cost.step_time_s(2000)
    assert times[("FirstToken", "a")] == first_step
    assert times[("FirstToken", "b")] == first_step + cost.step_time_s(100)


def _workload(jump: bool, num_blocks: int | None) -> list[EngineEvent]:
    model = EngineModel(_cost(EngineLimits(max_num_seqs=8)), num_blocks=num_blocks, jump=jump)
    events: list[EngineEvent] = []
    for i in range(40):
        now = i * 0.35
        events += model.advance_to(now)
        prompt = [*range(512 * (i % 3)), *range(10_000 * (i + 1), 10_000 * (i + 1) + 40 + i * 7)]
        model.submit(_spec(f"r{i}", prompt, 20 + (i * 37) % 400), now)
    return events + _drain(model)


@pytest.mark.parametrize("num_blocks", [None, 200])
def test_jumps_give_the_same_events_as_single_steps(num_blocks: int | None) -> None:
    stepped, stepped_times = _exact_and_times(_workload(jump=False, num_blocks=num_blocks))
    jumped, jumped_times = _exact_and_times(_workload(jump=True, num_blocks=num_blocks))
    assert jumped == stepped
    assert jumped_times == pytest.approx(stepped_times, rel=1e-9, abs=1e-9)
    assert sum(row[0] == "Finished" for row in stepped) == 40


def _decoding(num_blocks: int | None = None) -> tuple[EngineModel, float]:
    """Two requests decoding together, past their prefill, with a long run ahead; and the
    model's clock."""
    model = EngineModel(_cost(), num_blocks=num_blocks)
    model.submit(_spec("a", list(range(40)), 500), 0.0)
    model.submit(_spec("b", list(range(1000, 1050)), 300), 0.0)
    now = 0.0
    for _ in range(3):
        now = model.next_event_time() or 0.0
        model.advance_to(now)
    return model, now


@pytest.mark.parametrize("num_blocks", [None, 40])
def test_observe_reads_what_advancing_would_without_advancing(num_blocks: int | None) -> None:
    model, start = _decoding(num_blocks)
    quiet = model.quiet_until()
    assert quiet is not None and quiet > start + 0.1
    before = model.observe(start)
    for i in range(41):
        t = start + (quiet - start) * i / 41
        seen = model.observe(t)
        future = copy.deepcopy(model)
        assert future.advance_to(t) == []
        assert seen == model.observe(t)  # observing changed nothing
        assert (seen.num_running, seen.kv_usage) == (future.num_running, future.kv_usage)
        assert seen.num_waiting == future.num_waiting == 0
    assert model.observe(start) == before  # the clock did not move either
    assert model.observe(quiet - 1e-9).kv_usage > before.kv_usage  # blocks grew on the way


@pytest.mark.parametrize(
    ("num_blocks", "first"),
    [(None, Finished("b", 0.0, 50, 300, 0.0, 0.0)), (40, Preempted("b", 0.0))],
)
def test_the_quiet_time_is_the_next_event_whether_a_run_ends_on_tokens_or_blocks(
    num_blocks: int | None, first: EngineEvent
) -> None:
    """With blocks to spare the run ends a token before ``b``'s last and the quiet time
    reaches the end of the step that emits it; short of blocks it is the run's end, where
    the next step preempts ``b``. Either way stepping one by one gets there too."""
    model, _ = _decoding(num_blocks)
    quiet = model.quiet_until()
    assert quiet is not None
    assert model.advance_to(quiet - 1e-9) == []
    events = model.advance_to(quiet)
    assert [(type(e), e.request_id) for e in events] == [(type(first), first.request_id)]
    assert events[0].time_s == quiet
    stepped = EngineModel(_cost(), num_blocks=num_blocks, jump=False)
    stepped.submit(_spec("a", list(range(40)), 500), 0.0)
    stepped.submit(_spec("b", list(range(1000, 1050)), 300), 0.0)
    events = [e for e in _drain(stepped) if not isinstance(e, FirstToken)]
    assert (type(events[0]), events[0].request_id) == (type(first), first.request_id)
    assert events[0].time_s == pytest.approx(quiet, rel=1e-12)


def test_observe_refuses_times_outside_the_quiet_window() -> None:
    model, now = _decoding()
    quiet = model.quiet_until()
    assert quiet is not None
    with pytest.raises(ValueError, match="before the model clock"):
        model.observe(now - 1.0)
    with pytest.raises(ValueError, match="quiet only until"):
        model.observe(quiet)
    model.submit(_spec("c", list(range(5000, 5100)), 5), now)  # the next step admits
    with pytest.raises(ValueError, match="quiet only until"):
        model.observe(model.next_event_time() or 0.0)
    idle = EngineModel(_cost())
    assert idle.observe(100.0) == idle.observe(0.0)
    idle.submit(_spec("d", list(range(10)), 1), 1.0)
    with pytest.raises(ValueError, match=r"a step starts at 1\.0"):
        idle.observe(1.0)


def test_jumps_record_every_inter_token_gap_of_a_run() -> None:
    stepped, jumped = (
        EngineModel(_cost(), jump=jump, record_inter_token_gaps=True) for jump in (False, True)
    )
    for model in (stepped, jumped):
        model.submit(_spec("a", list(range(40)), 200), 0.0)
        model.submit(_spec("b", list(range(1000, 1050)), 100), 0.0)
        _drain(model)
    stepped_gaps, jumped_gaps = (m.counters.inter_token_gaps for m in (stepped, jumped))
    assert [n for _, n in jumped_gaps] == [n for _, n in stepped_gaps]
    assert sum(n for _, n in stepped_gaps) == 199 + 99
    assert [g for g, _ in jumped_gaps] == pytest.approx([g for g, _ in stepped_gaps], rel=1e-9)


def test_a_prompt_whose_kv_arrived_prefills_only_its_last_token_and_caches_its_blocks() -> None:
    prompt = list(range(8000))
    handed = EngineModel(_cost())
    spec = _spec("d", prompt, 4)
    handed.submit(RequestSpec(spec.request_id, 8000, 4, spec.block_hashes, 7999), 0.0)
    events = _drain(handed)
    first = next(e for e in events if isinstance(e, FirstToken))
    cold = EngineModel(_cost())
    cold.submit(_spec("c", prompt, 4), 0.0)
    cold_first = next(e for e in _drain(cold) if isinstance(e, FirstToken))
    assert first.ttft_s < cold_first.ttft_s / 20  # one token's step, not 8000 tokens' prefill
    assert handed.counters.prefix_cache_hits == 0  # the KV was sent, not found cached
    handed.submit(_spec("again", prompt, 1), events[-1].time_s)
    _drain(handed)
    assert handed.counters.prefix_cache_hits == 7984  # its blocks are in the cache now
