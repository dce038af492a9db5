"""Evidence the shadow state learns from: requests still waiting, restarts, recoveries."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import MODEL, Factory, cost_model

from isocost.scheduling.calibration import FRESHNESS_TAU_S
from isocost.scheduling.contract import EngineMetrics, ReplicaSpec, RequestView
from isocost.scheduling.policies import build_policy, parse_scheduling_yaml
from isocost.scheduling.state import ReplicaSet

SLOTS = np.array([0, 1], dtype=np.int64)
NO_EXPLORE = parse_scheduling_yaml(
    """
policies:
  - name: equal_cost_noexplore
    scorers: [{plugin: blind, weight: 1.0}]
plugins:
  - name: blind
    type: equal-cost-scorer
    parameters: {explore_slack: 0.0}
""",
    "test",
)


def _dispatch(
    replicas: ReplicaSet, name: str, replica: str, now: float, prompt: int = 1000
) -> None:
    replicas.on_dispatch(RequestView(name, MODEL, prompt, max_tokens=128), replica, now)


def test_waiting_past_the_prediction_raises_the_ttft_factor(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g", "a100-80g"])
    _dispatch(replicas, "old", "r0", 0.0)
    _dispatch(replicas, "young", "r0", 0.5)
    predicted = replicas.get("r0").in_flight["old"].predicted_ttft_s
    assert 0.0 < predicted < 0.5

    # Before its prediction has passed, waiting proves nothing.
    assert replicas.calibration.ttft_factor_at(predicted / 2, SLOTS).tolist() == [1.0, 1.0]
    # Ten predictions later the oldest waiting request proves r0 is at least 10x slow.
    factors = replicas.calibration.ttft_factor_at(10 * predicted, SLOTS)
    assert np.isclose(factors[0], 10.0) and factors[1] == 1.0
    # Unbounded waiting is capped like any observation.
    assert replicas.calibration.ttft_factor_at(1e6, SLOTS)[0] == 20.0

    # The oldest answers: the evidence moves to the next one (dispatched at 0.5 s).
    replicas.on_first_token("old", 10 * predicted)
    young = replicas.get("r0").in_flight["young"].predicted_ttft_s
    learned = replicas.calibration.ttft_factor[0]
    assert learned > 1.0  # learned from the answer as before
    at = 0.5 + 5 * young
    assert np.isclose(replicas.calibration.ttft_factor_at(at, SLOTS)[0], max(learned, 5.0))
    # No request waiting: the learned factor alone.
    replicas.on_complete("young", at, ok=False)
    assert replicas.calibration.ttft_factor_at(1e6, SLOTS)[0] == learned


def test_equal_cost_stops_sending_to_a_replica_that_has_not_answered(
    make_replicas: Factory,
) -> None:
    replicas = make_replicas(["a100-80g", "a100-80g"], factor_alpha=0.0)
    for i in range(8):  # r1 streams eight chats; q would stall them with its prefill
        _dispatch(replicas, f"chat{i}", "r1", 0.0)
        replicas.on_first_token(f"chat{i}", 0.1)
    _dispatch(replicas, "stuck", "r0", 0.0)  # r0 got one request and has not answered
    policy = build_policy("equal_cost")

    soon = policy.schedule(RequestView("q0", MODEL, 1000, max_tokens=128), replicas, 0.1)
    assert soon.replica_id == "r0"  # one short queued prefill: cheaper than stalling eight
    late = policy.schedule(RequestView("q1", MODEL, 1000, max_tokens=128), replicas, 3.0)
    # 3 s for a ~0.1 s prediction: r0 is >= 20x slow (capped) as far as anyone can tell.
    assert late.replica_id == "r1"


def _warm(replicas: ReplicaSet, blocks: tuple[int, ...]) -> None:
    replicas.on_dispatch(RequestView("warm", MODEL, 3200, block_hashes=blocks), "r0", 0.0)
    replicas.on_complete("warm", 1.0, output_tokens=10)


def test_recovered_replica_forgets_its_prefixes(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g", "a100-80g"])
    blocks = tuple(range(1, 200))
    _warm(replicas, blocks)
    replicas.set_health("r0", True)  # healthy -> healthy: nothing happened
    assert replicas.prefix.match_replica(0, blocks) == 199
    replicas.set_health("r0", False)
    assert replicas.prefix.match_replica(0, blocks) == 199  # kept while down
    replicas.set_health("r0", True)  # came back, maybe restarted with an empty cache
    assert replicas.prefix.match_replica(0, blocks) == 0
    assert replicas.prefix.num_blocks(0) == 0
    replicas.on_dispatch(RequestView("again", MODEL, 3200, block_hashes=blocks), "r0", 2.0)
    assert replicas.prefix.match_replica(0, blocks) == 199  # and learns again


def test_prefix_counters_going_back_forget_the_replicas_prefixes(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g", "a100-80g"])
    blocks = tuple(range(1, 200))
    _warm(replicas, blocks)
    replicas.on_dispatch(RequestView("other", MODEL, 3200, block_hashes=blocks), "r1", 0.0)

    def scrape(replica: str, queries: int, hits: int, now: float) -> None:
        metrics = EngineMetrics(0, 0, 0.1, prefix_cache_queries=queries, prefix_cache_hits=hits)
        replicas.apply_scrape(replica, metrics, now)

    scrape("r0", 5000, 3000, 1.0)
    scrape("r0", 9000, 6000, 2.0)  # counters grow: same engine
    assert replicas.prefix.match_replica(0, blocks) == 199
    scrape("r0", 400, 0, 3.0)  # counters went back: the engine restarted
    assert replicas.prefix.match_replica(0, blocks) == 0
    assert replicas.prefix.match_replica(1, blocks) == 199  # the other replica keeps its own
    scrape("r1", 100, 50, 3.0)
    scrape("r1", 100, 40, 4.0)  # hits alone going back is a restart too
    assert replicas.prefix.match_replica(1, blocks) == 0


def _answer_after(replicas: ReplicaSet, name: str, now: float, times_predicted: float) -> float:
    """Dispatch ``name`` to the idle r0 at ``now``; its first token comes that many
    predictions later; returns when."""
    _dispatch(replicas, name, "r0", now)
    done = now + times_predicted * replicas.get("r0").in_flight[name].predicted_ttft_s
    replicas.on_first_token(name, done)
    replicas.on_complete(name, done, ok=False)
    return done


def test_one_outlier_barely_moves_a_factor_a_steady_slowdown_is_learned(
    make_replicas: Factory,
) -> None:
    replicas = make_replicas(["a100-80g", "a100-80g"])  # factor_alpha 0.1
    now = _answer_after(replicas, "stall", 0.0, 20.0)  # a stall the model did not foresee
    # Geometric, and one observation counts as at most 2x off: their class moves by
    # 2 ** 0.1 = 1.07 (an arithmetic EWMA would jump to 2.9 and make an identical replica
    # look three times slower than its twin) and the twin with it; r0's own deviation is
    # that 2x over its class, shrunk to a third by the prior (one observation of three).
    factors = replicas.calibration.ttft_factor
    assert np.isclose(factors[1], 2.0**0.1)
    assert np.isclose(factors[0], 2.0 ** (0.1 + 0.9 / 3))
    # Consistently 4x slow: nearly learned from six answers (the plain mean of its first
    # observations, not an EWMA's slow start).
    for i in range(6):
        now = _answer_after(replicas, f"slow{i}", now, 4.0)
    assert replicas.calibration.ttft_factor[0] > 3.5
    for i in range(54):
        now = _answer_after(replicas, f"steady{i}", now, 4.0)
    assert 3.8 < replicas.calibration.ttft_factor[0] < 4.2  # within 5%


def test_a_replica_slow_to_answer_is_priced_slow_between_tokens_until_its_streams_show(
    make_replicas: Factory,
) -> None:
    """A degraded node is slow at everything, and its first tokens show it long before
    its streams end: until they do, its ITL factor borrows its TTFT deviation."""
    replicas = make_replicas(["a100-80g", "a100-80g"])
    now = 0.0
    for i in range(8):  # r0 answers 4x slower than r1
        now = _answer_after(replicas, f"slow{i}", now, 4.0)
        _dispatch(replicas, f"fast{i}", "r1", now)
        now += replicas.get("r1").in_flight[f"fast{i}"].predicted_ttft_s
        replicas.on_first_token(f"fast{i}", now)
        replicas.on_complete(f"fast{i}", now, ok=False)
    calibration = replicas.calibration
    slower = calibration.ttft_factor[0] / calibration.ttft_factor[1]
    assert slower > 2.5
    # No stream has shown a token gap yet: r0 is as much slower between tokens.
    assert calibration.itl_factor[0] / calibration.itl_factor[1] == pytest.approx(slower)
    for i in range(20):  # its streams then show it is as fast as its class between tokens
        name = f"stream{i}"
        _dispatch(replicas, name, "r0", now, prompt=200)
        now += calibration.ttft_factor[0] * replicas.get("r0").in_flight[name].predicted_ttft_s
        replicas.on_first_token(name, now)
        step = replicas.get("r0").in_flight[name].predicted_step_s
        for _ in range(16):
            now += step
            replicas.on_tokens(name, 1, now)
        replicas.on_complete(name, now, output_tokens=17)
    assert calibration.itl_factor[0] == pytest.approx(1.0, abs=0.1)


def test_a_replica_added_to_a_warm_pool_starts_from_its_class(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g", "a100-80g"])
    now = 0.0
    for i in range(40):  # the A100s prove 3x slow, r0 and r1 alike
        now = _answer_after(replicas, f"slow{i}", now, 3.0)
        replicas.on_dispatch(RequestView(f"b{i}", MODEL, 1000, max_tokens=128), "r1", now)
        done = now + 3.0 * replicas.get("r1").in_flight[f"b{i}"].predicted_ttft_s
        replicas.on_first_token(f"b{i}", done)
        replicas.on_complete(f"b{i}", done, ok=False)
        now = done
    learned = replicas.calibration.ttft_factor[0]
    assert 2.7 < learned < 3.3
    replicas.add(ReplicaSpec("r2", MODEL, cost_model("a100-80g")))
    replicas.add(ReplicaSpec("r3", MODEL, cost_model("h100-80g")))
    factors = replicas.calibration.ttft_factor
    assert np.isclose(factors[2], learned, rtol=0.1)  # its class's figure, not 1.0
    # A new class starts from what the whole pool learned: the catalog is off for all alike.
    assert 2.5 < factors[3] < 3.1


def test_the_prediction_error_is_measured_against_the_factor_in_use(
    make_replicas: Factory,
) -> None:
    replicas = make_replicas(["a100-80g", "a100-80g"])
    now = _answer_after(replicas, "first", 0.0, 2.0)  # predicted with factor 1: 50% off
    assert np.isclose(replicas.calibration.ttft_error[0], 0.5)
    for i in range(200):
        now = _answer_after(replicas, f"steady{i}", now, 2.0)
    # learned: the recent predictions are close (the EWMA of the error has forgotten the start)
    assert replicas.calibration.ttft_error[0] < 0.05
    assert replicas.get("r0").ttft_error == replicas.calibration.ttft_error[0]


def test_equal_cost_measures_again_a_replica_it_has_not_used_for_long(
    make_replicas: Factory,
) -> None:
    replicas = make_replicas(["a100-80g", "a100-80g"])
    now = 0.0
    for i in range(10):  # r0 looked 1.3x slow once
        now = _answer_after(replicas, f"slow{i}", now, 1.3)
    policy = build_policy("equal_cost")
    soon = policy.schedule(RequestView("q0", MODEL, 1000, max_tokens=128), replicas, now)
    assert soon.replica_id == "r1"  # dearer than its idle twin
    # Nothing was sent to r0 for longer than the freshness horizon: what it showed is old,
    # and it is within the exploration slack of its twin.
    later = now + FRESHNESS_TAU_S + 1.0
    replicas.on_dispatch(RequestView("keep", MODEL, 10, max_tokens=1), "r1", later - 1.0)
    replicas.on_complete("keep", later - 0.5, output_tokens=1)
    probe = policy.schedule(RequestView("q1", MODEL, 1000, max_tokens=128), replicas, later)
    assert probe.replica_id == "r0"
    blind = build_policy("equal_cost_noexplore", config=NO_EXPLORE)
    q2 = RequestView("q2", MODEL, 1000, max_tokens=128)
    assert blind.schedule(q2, replicas, later).replica_id == "r1"


def test_tokens_sent_in_bursts_teach_the_itl_factor_what_they_took(
    make_replicas: Factory,
) -> None:
    """An engine 3x slower than its model between tokens whose server sends them in
    bursts: four tokens at a time, each in its own chunk at the same instant (a starved
    API server). Learnt gap by gap, three of four gaps are 0 and the fourth holds four
    tokens' time; learnt by window, the factor is what the tokens took."""
    replicas = make_replicas(["a100-80g", "a100-80g"], factor_alpha=0.2)
    now = 0.0
    for i in range(20):
        name = f"s{i}"
        _dispatch(replicas, name, "r0", now, prompt=200)
        now += 0.05
        replicas.on_first_token(name, now)
        step = replicas.get("r0").in_flight[name].predicted_step_s
        for _ in range(16):  # 64 tokens in bursts of four
            now += 4 * 3.0 * step
            for _ in range(4):
                replicas.on_tokens(name, 1, now)
        replicas.on_complete(name, now, output_tokens=65)
    assert 2.6 < replicas.calibration.itl_factor[0] < 3.4
