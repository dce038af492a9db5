"""Requests not streamed: no first token is ever seen, yet they leave the waiting queue.

The shadow state takes such a request to start at its predicted prefill end, or when a
scrape shows the engine running it; it never counts as a late first token (the evidence
that raises a replica's TTFT factor), so ``max_queue`` bounds waiting, not running, and
the TTFT factor learns only from first tokens seen.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import MODEL, Factory, cost_model
from hypothesis import given, settings
from hypothesis import strategies as st

from isocost.scheduling.contract import EngineMetrics, ReplicaSpec, RequestView
from isocost.scheduling.decision import Outcome
from isocost.scheduling.policies import build_policy
from isocost.scheduling.state import ReplicaSet

_LOCAL = ("waiting", "running", "queued_prefill_tokens", "context_tokens", "kv_tokens")


def _view(name: str, *, stream: bool, prompt_tokens: int = 1000) -> RequestView:
    return RequestView(name, MODEL, prompt_tokens, max_tokens=64, stream=stream)


def test_a_request_not_streamed_starts_at_its_predicted_prefill_end(
    make_replicas: Factory,
) -> None:
    replicas = make_replicas(["a100-80g"])
    slot = replicas.get("r0").slot
    record = replicas.on_dispatch(_view("q", stream=False), "r0", 0.0)
    start = record.predicted_start_s
    assert start is not None and start == pytest.approx(record.predicted_ttft_s)
    assert replicas.waiting(start / 2, slot) == 1  # read before its start: still waiting
    assert replicas.local.queued_prefill_tokens[slot] == 1000
    assert replicas.waiting(start, slot) == 0  # read at its start: it runs
    state = replicas.get("r0")
    assert (state.num_waiting, state.num_running) == (0, 1)
    assert record.started_s == start and record.first_token_s is None
    assert replicas.local.queued_prefill_tokens[slot] == 0
    assert replicas.local.context_tokens[slot] == 1000
    replicas.on_complete("q", start + 1.0, output_tokens=64)
    for name in _LOCAL:
        assert getattr(replicas.local, name)[slot] == 0, name


def test_a_streamed_request_waits_for_its_first_token(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"])
    record = replicas.on_dispatch(_view("q", stream=True), "r0", 0.0)
    assert record.predicted_start_s is None
    assert replicas.waiting(100.0, record.slot) == 1  # only its first token starts it
    replicas.on_first_token("q", 100.0)
    assert replicas.waiting(100.0, record.slot) == 0


def test_a_scrape_that_shows_them_running_starts_the_oldest(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"])
    records = [replicas.on_dispatch(_view(f"q{i}", stream=False), "r0", 0.0) for i in range(3)]
    replicas.on_dispatch(_view("s", stream=True), "r0", 0.0)
    early = min(r.predicted_start_s or 0.0 for r in records) / 10
    # The engine waits for two of our four: two of those not streamed have started.
    replicas.apply_scrape("r0", EngineMetrics(num_running=2, num_waiting=2, kv_usage=0.1), early)
    assert [r.started_s for r in records] == [early, early, None]
    state = replicas.get("r0")
    assert (state.num_waiting, state.num_running) == (2, 2)
    assert replicas.scrapes.foreign_waiting[state.slot] == 0  # the scrape is all ours
    assert replicas.scrapes.foreign_running[state.slot] == 0
    # An engine that shows all waiting starts none; the streamed one never starts by scrape.
    replicas.apply_scrape("r0", EngineMetrics(num_running=3, num_waiting=0, kv_usage=0.1), early)
    assert records[2].started_s == early and "s" in state.awaiting
    assert (state.num_waiting, state.num_running) == (1, 3)


def test_no_ttft_factor_rise_from_requests_not_streamed(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g", "a100-80g"], factor_alpha=0.5)
    key = np.array([0, 1])
    for i in range(8):
        replicas.on_dispatch(_view(f"n{i}", stream=False), "r0", 0.0)
        replicas.on_dispatch(_view(f"s{i}", stream=True), "r1", 0.0)
    factors = replicas.calibration.ttft_factor_at(60.0, key)  # a minute, no first token
    assert factors[0] == 1.0  # not streamed: no first token was due
    assert factors[1] == 20.0  # streamed: overdue, priced as slow at once
    # Their completions, decoding twice as slow as predicted, teach the ITL factor only.
    for i in range(8):
        record = replicas.get("r0").in_flight[f"n{i}"]
        start = record.predicted_start_s
        assert start is not None
        replicas.on_complete(f"n{i}", start + 2 * 63 * record.predicted_step_s, output_tokens=64)
    state = replicas.get("r0")
    assert state.ttft_factor == 1.0
    assert state.itl_factor == pytest.approx(2.0, rel=0.2)


@pytest.mark.parametrize("policy_name", ["equal_cost", "least_request", "round_robin"])
def test_max_queue_caps_waiting_not_running_requests_not_streamed(
    make_replicas: Factory, policy_name: str
) -> None:
    replicas = make_replicas(["a100-80g"], max_queue=4)
    policy = build_policy(policy_name)
    now = 0.0
    for i in range(32):
        view = _view(f"n{i}", stream=False)
        decision = policy.schedule(view, replicas, now)
        if decision.outcome is Outcome.QUEUE:  # four wait: the next waits for one to start
            now = min(r.predicted_start_s or np.inf for r in replicas.get("r0").unseen.values())
            decision = policy.schedule(view, replicas, now)
        assert decision.outcome is Outcome.ADMIT, (i, decision.reason)
        replicas.on_dispatch(view, "r0", now, decision=decision)
    replicas.waiting(now, 0)
    state = replicas.get("r0")
    assert state.num_running + state.num_waiting == 32 and state.num_waiting <= 4
    # Streamed requests with no first token do fill the queue: the fifth one queues.
    streamed = make_replicas(["a100-80g"], max_queue=4)
    for i in range(4):
        streamed.on_dispatch(_view(f"s{i}", stream=True), "r0", 0.0)
    assert policy.schedule(_view("s4", stream=True), streamed, 60.0).outcome is Outcome.QUEUE


def test_tokens_seen_of_a_request_not_streamed_count_once(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"])
    record = replicas.on_dispatch(_view("q", stream=False), "r0", 0.0)
    assert record.predicted_start_s is not None
    replicas.waiting(record.predicted_start_s, record.slot)  # started by prediction
    replicas.on_tokens("q", 5, record.predicted_start_s + 0.1)  # the caller saw tokens after all
    state = replicas.get("r0")
    assert (state.num_waiting, state.num_running) == (0, 1)
    assert replicas.local.context_tokens[record.slot] == 1005
    replicas.on_complete("q", record.predicted_start_s + 0.2, output_tokens=5)
    for name in _LOCAL:
        assert getattr(replicas.local, name)[record.slot] == 0, name


_step = st.tuples(
    st.sampled_from(["dispatch", "read", "scrape", "first", "complete", "fail"]),
    st.booleans(),  # streamed
    st.integers(0, 5),  # which request / engine waiting
    st.floats(0.0, 0.5),  # time passing
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_step, max_size=60))
def test_counts_stay_exact_with_mixed_streaming_and_scrapes(
    steps: list[tuple[str, bool, int, float]],
) -> None:
    replicas = ReplicaSet()
    replicas.add(ReplicaSpec("r0", MODEL, cost_model("a100-80g")))
    now, n = 0.0, 0
    open_ids: list[str] = []
    for action, stream, pick, dt in steps:
        now += dt
        if action == "dispatch":
            replicas.on_dispatch(_view(f"q{n}", stream=stream, prompt_tokens=500), "r0", now)
            open_ids.append(f"q{n}")
            n += 1
        elif action == "read":
            replicas.load(now, np.array([0]))
        elif action == "scrape":
            replicas.apply_scrape("r0", EngineMetrics(0, pick, 0.0), now)
        elif open_ids:
            request_id = open_ids[pick % len(open_ids)]
            if action == "first":
                replicas.on_first_token(request_id, now)
            else:
                replicas.on_complete(request_id, now, ok=action == "complete", output_tokens=3)
                open_ids.remove(request_id)
        state = replicas.get("r0")
        assert state.num_waiting >= 0 and state.num_running >= 0
        assert state.num_waiting + state.num_running == len(open_ids)
        assert set(state.unseen) | set(state.awaiting) <= set(open_ids)
    for request_id in list(open_ids):
        replicas.on_complete(request_id, now)
    for name in _LOCAL:
        assert getattr(replicas.local, name)[0] == pytest.approx(0.0, abs=1e-6), name
