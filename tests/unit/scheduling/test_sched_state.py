"""Shadow state: hooks keep exact counts, scrapes add foreign load that fades, factors learn."""

from __future__ import annotations

from dataclasses import replace
from random import Random

import numpy as np
import pytest
from conftest import MODEL, Factory, cost_model
from hypothesis import given, settings
from hypothesis import strategies as st

from isocost.core.costmodel import CostModel
from isocost.scheduling.contract import EngineMetrics, ReplicaSpec, RequestView
from isocost.scheduling.policies import build_policy
from isocost.scheduling.predict import Prediction, SlotKey, predict
from isocost.scheduling.state import ReplicaSet
from isocost.scheduling.timing import StepCoefficients


def test_hooks_keep_counts_exact_and_return_to_zero(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"])
    slot = replicas.get("r0").slot
    for i in range(3):
        replicas.on_dispatch(RequestView(f"q{i}", MODEL, 1000, max_tokens=50), "r0", 0.0)
    assert replicas.get("r0").num_waiting == 3
    assert replicas.local.queued_prefill_tokens[slot] == 3000
    replicas.on_first_token("q0", 0.2)
    replicas.on_tokens("q0", 9, 0.3)
    state = replicas.get("r0")
    assert (state.num_waiting, state.num_running) == (2, 1)
    assert replicas.local.context_tokens[slot] == 1010
    assert state.in_flight["q0"].generated_tokens == 10
    replicas.on_complete("q0", 0.5, output_tokens=10)
    replicas.on_complete("q1", 0.5, ok=False)
    replicas.on_complete("q2", 0.5)
    assert not replicas.on_complete("q2", 0.6)  # already done: ignored
    for name in (
        "waiting",
        "running",
        "queued_prefill_tokens",
        "context_tokens",
        "kv_tokens",
        "remaining_tokens",
    ):
        assert getattr(replicas.local, name)[slot] == 0, name


def test_scrape_adds_foreign_load_that_fades(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"], staleness_tau_s=2.0)
    replicas.on_dispatch(RequestView("mine", MODEL, 100), "r0", 0.0)
    replicas.apply_scrape("r0", EngineMetrics(num_running=10, num_waiting=4, kv_usage=0.5), 0.0)
    idx = np.array([replicas.get("r0").slot])
    fresh = replicas.load(0.0, idx)
    assert fresh.waiting[0] == pytest.approx(4.0)  # mine plus 3 foreign
    assert fresh.running[0] == pytest.approx(10.0)
    assert fresh.kv_usage[0] == pytest.approx(0.5)
    stale = replicas.load(20.0, idx)
    assert stale.waiting[0] == pytest.approx(1.0, abs=1e-3)  # only mine remains
    assert replicas.get("r0").scrape_s == 0.0


def test_ttft_and_itl_factors_learn_observed_over_predicted(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"], factor_alpha=0.5)
    for i in range(12):
        record = replicas.on_dispatch(RequestView(f"q{i}", MODEL, 2000), "r0", 10.0 * i)
        first = 10.0 * i + 2.0 * record.predicted_ttft_s
        replicas.on_first_token(record.request_id, first)
        replicas.on_complete(
            record.request_id, first + 3.0 * 99 * record.predicted_step_s, output_tokens=100
        )
    state = replicas.get("r0")
    assert state.ttft_factor == pytest.approx(2.0, rel=0.01)
    assert state.itl_factor == pytest.approx(3.0, rel=0.01)


def test_remove_forgets_requests_and_frees_the_slot(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g", "a100-80g"])
    replicas.on_dispatch(RequestView("q", MODEL, 100, block_hashes=(1, 2)), "r0", 0.0)
    replicas.remove("r0")
    assert "r0" not in replicas and len(replicas) == 1
    assert not replicas.on_first_token("q", 1.0)
    state = replicas.add(ReplicaSpec("r9", MODEL, cost_model("h100-80g")))
    assert state.slot == 0 and state.num_waiting == 0
    assert replicas.prefix.num_blocks(0) == 0


# an H100 with the shape terms fitted to Vidur's profiles (benchmarks/calibration)
SHAPED_H100 = {"kernel_s_per_layer": 36e-6, "gemm_half_rate_tokens": 128.0,
               "elementwise_io_per_layer": 11.0}  # fmt: skip


@pytest.mark.parametrize(
    ("gpu", "shape"),
    [("a100-80g", {}), ("h100-80g", {}), ("l40s-48g", {}), ("h100-80g", SHAPED_H100)],
)
def test_fitted_coefficients_track_the_cost_model(gpu: str, shape: dict[str, float]) -> None:
    plain = cost_model(gpu)
    model = CostModel(plain.model, replace(plain.gpu, **shape), plain.tensor_parallel)
    coef = StepCoefficients.fit(model)
    for new, cached in [(100, 0), (1000, 0), (4000, 2000), (20_000, 0)]:
        chunks = -(-new // coef.prefill_chunk_tokens)
        fitted = max(
            chunks * coef.prefill_per_chunk_s
            + new * coef.prefill_per_token_s
            + new * (cached + new / 2) * coef.prefill_per_pair_s,
            chunks * coef.prefill_floor_s,
        )
        assert fitted == pytest.approx(model.prefill_time_s(new, cached), rel=0.1)
    for batch, context in [(1, 1000), (16, 30_000), (64, 200_000), (256, 100_000)]:
        memory = (
            coef.decode_fixed_s
            + context * coef.decode_per_context_token_s
            + batch * coef.decode_per_seq_memory_s
        )
        compute = coef.decode_compute_fixed_s + batch * coef.decode_per_seq_compute_s
        exact = model.decode_step_time_s(batch, context)
        assert max(memory, compute) == pytest.approx(exact, rel=0.1)


def test_remaining_output_of_a_request_past_its_estimate(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"])
    record = replicas.on_dispatch(RequestView("q", MODEL, 10, max_tokens=300), "r0", 0.0)
    assert record.expected_output_tokens == 256  # the estimator's prior, under max_tokens
    replicas.on_first_token("q", 0.1)
    replicas.on_tokens("q", 199, 0.2)
    assert record.remaining_tokens == 56
    replicas.on_tokens("q", 80, 0.3)  # 280 > 256: a long one, a quarter of 256 to go ...
    assert record.remaining_tokens == 20  # ... but max_tokens leaves only 20
    slot = replicas.get("r0").slot
    assert replicas.local.remaining_tokens[slot] == 20


def test_itl_factor_is_not_fooled_by_prefill_stalls(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"], factor_alpha=1.0)
    stream = replicas.on_dispatch(RequestView("stream", MODEL, 100), "r0", 0.0)
    replicas.on_first_token("stream", stream.predicted_ttft_s)
    t = stream.predicted_ttft_s
    big = replicas.on_dispatch(RequestView("big", MODEL, 16_000), "r0", t)
    replicas.on_first_token("big", t + big.predicted_ttft_s)  # its prefill stalled "stream"
    replicas.on_complete("big", t + big.predicted_ttft_s, ok=False)
    end = t + big.predicted_ttft_s + 99 * stream.predicted_step_s
    replicas.on_complete("stream", end, output_tokens=101)
    # The stream took over twice its 100 decode steps, all of it explained by the prefill.
    assert replicas.get("r0").itl_factor == pytest.approx(1.0, abs=0.1)
    assert end - stream.first_token_s > 2 * 100 * stream.predicted_step_s  # a real stall


def test_prefills_that_stall_a_stream_are_counted_one_prompt_at_a_time(
    make_replicas: Factory,
) -> None:
    """Eight 4,000-token prompts start while a stream decodes: it stalls for eight such
    prefills, not for one of 32,000 tokens, whose attention grows with the square of
    the sum (counted so, the ITL factor learnt 0.6 on one replica at 2 req/s of arXiv
    lengths, where the engine ran the very cost model)."""
    replicas = make_replicas(["a100-80g"], factor_alpha=1.0)
    stream = replicas.on_dispatch(RequestView("stream", MODEL, 100), "r0", 0.0)
    t = stream.predicted_ttft_s
    replicas.on_first_token("stream", t)
    for i in range(8):
        prompt = replicas.on_dispatch(RequestView(f"p{i}", MODEL, 4_000), "r0", t)
        t += prompt.predicted_ttft_s - prompt.predicted_wait_s
        replicas.on_first_token(f"p{i}", t)
        replicas.on_complete(f"p{i}", t, ok=False)
    end = t + 99 * stream.predicted_step_s
    replicas.on_complete("stream", end, output_tokens=101)
    assert replicas.get("r0").itl_factor == pytest.approx(1.0, abs=0.1)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    sent=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 20_000), st.integers(0, 40), st.booleans()),
        max_size=12,
    ),
    scrape=st.tuples(st.integers(0, 64), st.integers(0, 64), st.floats(0.0, 1.0)),
    scrape_age_s=st.floats(0.0, 10.0),
    prompt=st.integers(1, 40_000),
    cached=st.integers(0, 40_000),
    output=st.integers(1, 4096),
)
def test_one_replica_prediction_is_bit_identical_to_the_vector_one(
    sent: list[tuple[int, int, int, bool]],
    scrape: tuple[int, int, float],
    scrape_age_s: float,
    prompt: int,
    cached: int,
    output: int,
) -> None:
    """``predict_one`` (Python floats) and ``predict`` (numpy) are one formula, two forms."""
    replicas = ReplicaSet()
    for i, gpu in enumerate(("a100-80g", "h100-80g", "l40s-48g")):
        replicas.add(ReplicaSpec(f"r{i}", MODEL, cost_model(gpu)))
    for n, (slot, tokens, max_tokens, streaming) in enumerate(sent):
        view = RequestView(f"q{n}", MODEL, tokens, block_hashes=(n,), max_tokens=max_tokens)
        replicas.on_dispatch(view, f"r{slot}", 0.0)
        if streaming:
            replicas.on_tokens(f"q{n}", 3, 0.5)
    replicas.apply_scrape("r1", EngineMetrics(scrape[0], scrape[1], scrape[2]), 1.0)
    now = 1.0 + scrape_age_s
    idx = np.arange(3, dtype=np.int64)

    def predict_for(key: SlotKey) -> Prediction:
        load = replicas.load(now, key)
        ones = np.ones(3)
        return predict(
            replicas.slots.coef, key, load, prompt, np.full(3, float(cached)), output, ones, ones
        )

    vector = predict_for(idx)
    as_slice = predict_for(slice(0, 3))  # a contiguous run is read through views
    for field in ("wait_s", "prefill_s", "ttft_s", "tpot_s", "others_itl_s", "decode_s"):
        assert np.array_equal(getattr(as_slice, field), getattr(vector, field))
    for slot in range(3):
        one = replicas.predict_one(slot, now, prompt, cached, output)
        assert one.wait_s == vector.wait_s[slot]
        assert one.prefill_s == vector.prefill_s[slot]
        assert one.ttft_s == vector.ttft_s[slot]
        assert one.step_s == vector.step_s[slot]
        assert one.base_step_s == vector.base_step_s[slot]


@pytest.mark.parametrize("policy", ["round_robin", "equal_cost"])
def test_dispatch_with_the_decision_records_what_it_would_compute(
    make_replicas: Factory, policy: str
) -> None:
    """Passing the decision to ``on_dispatch`` reuses its figures; the record is the same."""
    records = []
    for reuse in (False, True):
        replicas = make_replicas(["a100-80g", "h100-80g", "l40s-48g"])
        chooser = build_policy(policy, rng=Random(3))
        replicas.add_listener(chooser)
        for n in range(30):
            view = RequestView(f"q{n}", MODEL, 500 + 97 * n, block_hashes=(n % 4, n), max_tokens=64)
            decision = chooser.schedule(view, replicas, n * 0.05)
            assert decision.replica_id is not None and decision.raw_times is not None
            record = replicas.on_dispatch(
                view, decision.replica_id, n * 0.05, decision=decision if reuse else None
            )
            records.append((reuse, record))
            if n % 3 == 0:
                replicas.on_tokens(f"q{n}", 2, n * 0.05 + 0.02)
    plain = [r for reuse, r in records if not reuse]
    reused = [r for reuse, r in records if reuse]
    assert plain == reused
    assert len({r.predicted_ttft_s for r in plain}) > 1  # the load moved the predictions


@pytest.mark.parametrize("pass_decision", [False, True])
def test_schedule_expects_the_output_lengths_completions_taught(
    make_replicas: Factory, pass_decision: bool
) -> None:
    """The estimator learns under the class ``schedule`` reads (``default`` when no rule)."""
    replicas = make_replicas(["a100-80g", "h100-80g"])
    policy = build_policy("equal_cost", rng=Random(0))
    replicas.add_listener(policy)
    for n in range(60):
        view = RequestView(f"q{n}", MODEL, 300, max_tokens=2048)
        decision = policy.schedule(view, replicas, float(n))
        assert decision.replica_id is not None
        replicas.on_dispatch(
            view, decision.replica_id, float(n), decision=decision if pass_decision else None
        )
        replicas.on_complete(f"q{n}", n + 0.5, output_tokens=40)
    probe = policy.schedule(RequestView("probe", MODEL, 300, max_tokens=2048), replicas, 99.0)
    assert probe.route_class == "default"
    assert probe.predicted_output_tokens == 40


# One scrape of one replica: running, waiting, KV usage (beyond 1 too), counters.
_scrape = st.tuples(
    st.integers(0, 12),
    st.integers(0, 12),
    st.floats(-0.5, 1.5),
    st.integers(0, 400),
    st.integers(0, 400),
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(rounds=st.lists(st.lists(_scrape, min_size=4, max_size=4), min_size=1, max_size=4))
def test_batch_scrapes_leave_the_state_per_replica_scrapes_leave(
    rounds: list[list[tuple[int, int, float, int, int]]],
) -> None:
    sets = []
    for _ in range(2):
        replicas = ReplicaSet()
        for i, gpu in enumerate(["a100-80g", "h100-80g", "a100-80g", "l40s-48g"]):
            replicas.add(ReplicaSpec(f"r{i}", MODEL, cost_model(gpu)))
        for n in range(8):  # local load and prefix entries on every replica
            view = RequestView(f"q{n}", MODEL, 200 + 50 * n, block_hashes=(n, 100 + n))
            replicas.on_dispatch(view, f"r{n % 4}", 0.0)
        sets.append(replicas)
    one_by_one, batched = sets
    slots = np.array([batched.get(f"r{i}").slot for i in range(4)])
    previous: list[tuple[int, int, float, int, int] | None] = [None] * 4
    forgotten = [False] * 4  # a scrape's counters went back: the engine restarted
    assert batched.get("r0").scrape_s is None
    for t, scrapes in enumerate(rounds, start=1):
        for i, (running, waiting, kv, queries, hits) in enumerate(scrapes):
            metrics = EngineMetrics(running, waiting, kv, queries, hits)
            one_by_one.apply_scrape(f"r{i}", metrics, float(t))
        columns = (np.array(column) for column in zip(*scrapes, strict=True))
        batched.apply_scrapes(slots, *columns, float(t))
        for part in ("slots", "local", "scrapes", "calibration", "duty"):
            for name, array in vars(getattr(batched, part)).items():  # every per-slot array
                if isinstance(array, np.ndarray) and array.dtype != object:  # bit for bit
                    assert np.array_equal(getattr(getattr(one_by_one, part), name), array), name
        # Each replica has 2 local requests waiting: the engine's beyond them are foreign.
        foreign_waiting = [max(s[1] - 2, 0) for s in scrapes]
        assert batched.scrapes.foreign_waiting[slots].tolist() == foreign_waiting
        assert batched.scrapes.foreign_running[slots].tolist() == [
            max(s[0] + s[1] - 2 - f, 0) for s, f in zip(scrapes, foreign_waiting, strict=True)
        ]
        assert batched.scrapes.kv_usage[slots].tolist() == [min(max(s[2], 0), 1) for s in scrapes]
        for i, scrape in enumerate(scrapes):
            before = previous[i]
            if before is not None and (scrape[3] < before[3] or scrape[4] < before[4]):
                forgotten[i] = True
            previous[i] = scrape
            held = batched.prefix.num_blocks(int(slots[i]))
            assert held == one_by_one.prefix.num_blocks(int(slots[i]))
            assert (held == 0) == forgotten[i]
        assert batched.get("r0").scrape_s == float(t)


def test_batch_scrape_of_an_empty_slot_is_refused(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g", "a100-80g"])
    replicas.remove("r1")
    one = np.array([1])
    with pytest.raises(ValueError, match="every slot"):
        replicas.apply_scrapes(np.array([0, 1]), one, one, one * 0.5, one, one, 1.0)


def test_a_decision_priced_alone_holds_plain_floats(make_replicas: Factory) -> None:
    # round_robin reads no prediction, so the chosen replica is priced alone from its load;
    # with streams running there the load's numpy scalars once leaked into the decision and
    # GET /admin/snapshot failed to encode it.
    replicas = make_replicas(["a100-80g", "a100-80g"])
    for i in range(4):
        replicas.on_dispatch(RequestView(f"s{i}", MODEL, 2000, max_tokens=64), "r0", 0.0)
        replicas.on_dispatch(RequestView(f"t{i}", MODEL, 2000, max_tokens=64), "r1", 0.0)
        replicas.on_first_token(f"s{i}", 0.1)
        replicas.on_first_token(f"t{i}", 0.1)
    decision = build_policy("round_robin").schedule(RequestView("q", MODEL, 500), replicas, 0.2)
    times = (decision.predicted_ttft_s, decision.predicted_e2e_s)
    assert all(type(t) is float for t in times), [type(t) for t in times]
    assert decision.raw_times is not None
    assert all(type(getattr(decision.raw_times, f)) is float for f in ("wait_s", "prefill_s"))
