"""Evidence the shadow state learns from: requests still waiting, restarts, recoveries."""

from __future__ import annotations

import numpy as np
from conftest import MODEL, Factory

from isocost.scheduling.contract import EngineMetrics, RequestView
from isocost.scheduling.policies import build_policy
from isocost.scheduling.state import ReplicaSet

SLOTS = np.array([0, 1], dtype=np.int64)


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
    # Geometric: 20 ** 0.1 = 1.35 (an arithmetic EWMA would jump to 2.9 and make an
    # identical replica look three times slower than its twin).
    assert np.isclose(replicas.calibration.ttft_factor[0], 20.0**0.1)
    for i in range(60):  # consistently 4x slow
        now = _answer_after(replicas, f"slow{i}", now, 4.0)
    assert 3.8 < replicas.calibration.ttft_factor[0] < 4.0
