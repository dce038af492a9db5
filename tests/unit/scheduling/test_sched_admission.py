"""Admission: eligibility outcomes, SLO rejection, shedding, route tiers, the gateway queue."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import MODEL, Factory, cost_model

from isocost.scheduling.contract import ReplicaSpec, RequestView
from isocost.scheduling.decision import Outcome, RejectReason
from isocost.scheduling.dispatch import RequestQueue
from isocost.scheduling.policies import build_policy, parse_scheduling_yaml
from isocost.scheduling.predict import MAX_TPOT_VICTIMS, max_stall_s, tpot_victims
from isocost.scheduling.state import ReplicaSet


def _req(i: int, prompt: int = 500, **kwargs: object) -> RequestView:
    return RequestView(f"q{i}", MODEL, prompt, max_tokens=64, **kwargs)  # type: ignore[arg-type]


def test_unknown_model_unavailable_and_queue_outcomes(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"] * 2, max_queue=2)
    policy = build_policy("least_request")
    other = policy.schedule(RequestView("x", "other-model", 10), replicas, 0.0)
    assert (other.outcome, other.reason) == (Outcome.REJECT, RejectReason.NO_REPLICA)
    for i in range(4):  # fill both queues to their cap
        decision = policy.schedule(_req(i), replicas, 0.0)
        assert decision.replica_id is not None
        replicas.on_dispatch(_req(i), decision.replica_id, 0.0)
    assert policy.schedule(_req(9), replicas, 0.0).outcome is Outcome.QUEUE
    replicas.on_first_token("q0", 0.1)  # one leaves the waiting queue: room again
    assert policy.schedule(_req(9), replicas, 0.1).outcome is Outcome.ADMIT
    replicas.set_health("r0", False)
    replicas.set_draining("r1", True)
    down = policy.schedule(_req(9), replicas, 0.1)
    assert (down.outcome, down.reason) == (Outcome.REJECT, RejectReason.UNAVAILABLE)
    assert down.retry_after_s == 1.0


def test_slo_admission_rejects_with_a_predicted_retry_after(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"], factor_alpha=0.0)
    policy = build_policy("equal_cost")
    for i in range(6):  # 6 x 8k-token prompts queued: seconds of prefill ahead
        replicas.on_dispatch(_req(100 + i, prompt=8000), "r0", 0.0)
    late = policy.schedule(_req(1, deadline_s=0.5), replicas, 0.0)
    assert (late.outcome, late.reason) == (Outcome.REJECT, RejectReason.DEADLINE)
    assert late.retry_after_s is not None and late.retry_after_s > 1.0
    relaxed = policy.schedule(_req(2, deadline_s=60.0), replicas, 0.0)
    assert relaxed.outcome is Outcome.ADMIT
    assert relaxed.predicted_ttft_s is not None and 0.5 < relaxed.predicted_ttft_s < 60.0
    loose = build_policy("least_request").schedule(_req(1, deadline_s=0.5), replicas, 0.0)
    assert loose.outcome is Outcome.ADMIT


@pytest.mark.parametrize("peer", ["llmd_default", "round_robin", "sglang_cache_aware"])
def test_a_peers_slo_twin_rejects_what_the_peer_admits(make_replicas: Factory, peer: str) -> None:
    replicas = make_replicas(["a100-80g"] * 2, factor_alpha=0.0)
    for i in range(6):  # seconds of 8k-token prefill queued on each replica
        replicas.on_dispatch(_req(100 + i, prompt=8000), f"r{i % 2}", 0.0)
    impossible = _req(1, deadline_s=0.5)
    plain = build_policy(peer).schedule(impossible, replicas, 0.0)
    assert plain.outcome is Outcome.ADMIT
    twin = build_policy(f"{peer}_slo").schedule(impossible, replicas, 0.0)
    assert (twin.outcome, twin.reason) == (Outcome.REJECT, RejectReason.DEADLINE)
    assert twin.retry_after_s is not None and twin.retry_after_s > 0.5
    relaxed = build_policy(f"{peer}_slo").schedule(_req(2, deadline_s=60.0), replicas, 0.0)
    assert relaxed.outcome is Outcome.ADMIT


def test_global_shed_when_too_few_replicas_are_available(make_replicas: Factory) -> None:
    config = parse_scheduling_yaml(
        "policies:\n  - name: guarded\n    scorers: [{plugin: least-request-scorer}]\n"
        "    admission: {min_available_fraction: 0.5, retry_after_s: 3}\n",
        "test",
    )
    replicas = make_replicas(["a100-80g"] * 4)
    policy = build_policy("guarded", config=config)
    replicas.set_health("r0", False)
    assert policy.schedule(_req(0), replicas, 0.0).outcome is Outcome.ADMIT  # 3 of 4
    replicas.set_health("r1", False)
    assert policy.schedule(_req(0), replicas, 0.0).outcome is Outcome.ADMIT  # 2 of 4
    replicas.set_health("r2", False)
    shed = policy.schedule(_req(0), replicas, 0.0)
    assert (shed.reason, shed.retry_after_s) == (RejectReason.SHED, 3.0)


def test_route_classes_use_groups_with_fallback() -> None:
    replicas = ReplicaSet()
    replicas.add(ReplicaSpec("big", MODEL, cost_model("h200-141g"), groups=frozenset({"h200"})))
    replicas.add(ReplicaSpec("small", MODEL, cost_model("l40s-48g"), groups=frozenset({"l40s"})))
    config = parse_scheduling_yaml(
        "routes:\n"
        "  - {name: long-context, min_prompt_tokens: 32000, groups: [[h200], []]}\n"
        "  - {name: chat, stream: true, groups: [[l40s]]}\n"
        "policies:\n  - {name: p, picker: round-robin-picker}\n",
        "test",
    )
    policy = build_policy("p", config=config)
    long_prompt = RequestView("a", MODEL, 40_000)
    chat = RequestView("b", MODEL, 100, stream=True)
    for _ in range(3):
        assert policy.schedule(long_prompt, replicas, 0.0).replica_id == "big"
        decision = policy.schedule(chat, replicas, 0.0)
        assert (decision.replica_id, decision.route_class) == ("small", "chat")
    replicas.set_health("big", False)  # fallback tier: any replica
    fallback = policy.schedule(long_prompt, replicas, 0.0)
    assert fallback.replica_id == "small"
    assert fallback.explanation is not None and fallback.explanation.notes["route_tier"] == "1"
    replicas.set_health("small", False)
    assert policy.schedule(chat, replicas, 0.0).reason is RejectReason.UNAVAILABLE


def test_queue_orders_by_priority_then_deadline_then_arrival() -> None:
    queue = RequestQueue(10)
    queue.push(RequestView("low", MODEL, 1, arrival_s=0.0))
    queue.push(RequestView("late", MODEL, 1, priority=1, deadline_s=9.0, arrival_s=1.0))
    queue.push(RequestView("soon", MODEL, 1, priority=1, deadline_s=5.0, arrival_s=2.0))
    queue.push(RequestView("low2", MODEL, 1, arrival_s=0.5))
    order: list[str | None] = []
    for _ in range(5):
        head = queue.peek()
        order.append(head.request_id if head else None)
        if head is not None:
            assert queue.cancel(head.request_id)
    assert order == ["soon", "late", "low", "low2", None]


def test_full_queue_evicts_the_least_urgent_or_rejects_the_newcomer() -> None:
    queue = RequestQueue(2)
    assert queue.push(RequestView("a", MODEL, 1, arrival_s=0.0)).rejected is None
    assert queue.push(RequestView("b", MODEL, 1, arrival_s=1.0)).rejected is None
    newcomer = queue.push(RequestView("c", MODEL, 1, arrival_s=2.0))
    assert not newcomer.queued and newcomer.rejected is not None
    assert newcomer.rejected.request_id == "c"
    urgent = queue.push(RequestView("d", MODEL, 1, priority=5, arrival_s=3.0))
    assert urgent.queued and urgent.rejected is not None and urgent.rejected.request_id == "b"
    assert len(queue) == 2 and "b" not in queue


def drain(queue: RequestQueue) -> list[str]:
    """The queue's requests in the order they leave from its head, each served."""
    order: list[str] = []
    while (head := queue.peek()) is not None:
        assert queue.take(head.request_id)
        order.append(head.request_id)
    return order


def flood_then(queue: RequestQueue, flood: int, *others: str) -> None:
    """``flood`` requests of flow ``bulk`` queued at t=0, then one of each other flow."""
    for i in range(flood):
        queue.push(RequestView(f"bulk{i}", MODEL, 1, arrival_s=0.0, flow="bulk"))
    for i, flow in enumerate(others):
        queue.push(RequestView(f"{flow}0", MODEL, 1, arrival_s=1.0 + i, flow=flow))


def test_flows_take_turns_rather_than_the_first_flood_going_first() -> None:
    queue = RequestQueue(100)
    flood_then(queue, 4, "light")
    queue.push(RequestView("light1", MODEL, 1, arrival_s=2.0, flow="light"))
    assert drain(queue) == ["bulk0", "light0", "bulk1", "light1", "bulk2", "bulk3"]


def test_a_queue_counts_its_waiting_requests_by_flow() -> None:
    queue = RequestQueue(100)
    flood_then(queue, 3, "light")
    queue.push(RequestView("anon", MODEL, 1))
    assert queue.take("bulk0") and queue.cancel("light0")
    assert queue.flows() == {"bulk": 2, None: 1}


def test_a_flow_arriving_after_some_were_served_starts_at_the_current_turn() -> None:
    queue = RequestQueue(100)
    flood_then(queue, 6)
    for _ in range(3):
        head = queue.peek()
        assert head is not None and queue.take(head.request_id)
    for i in range(3):
        queue.push(RequestView(f"late{i}", MODEL, 1, arrival_s=5.0 + i, flow="late"))
    # next, then alternating: no credit for the turns it was not there for
    assert drain(queue) == ["late0", "bulk3", "late1", "bulk4", "late2", "bulk5"]


def test_priority_and_deadline_still_come_before_turns() -> None:
    queue = RequestQueue(100)
    flood_then(queue, 3, "light")
    queue.push(RequestView("vip", MODEL, 1, priority=1, arrival_s=9.0, flow="bulk"))
    queue.push(RequestView("due", MODEL, 1, deadline_s=20.0, arrival_s=9.5, flow="bulk"))
    assert drain(queue)[:4] == ["vip", "due", "bulk0", "light0"]


def test_a_full_queue_evicts_the_floods_last_turn_for_another_flow() -> None:
    queue = RequestQueue(3)
    flood_then(queue, 3)
    newcomer = queue.push(RequestView("light0", MODEL, 1, arrival_s=1.0, flow="light"))
    assert newcomer.queued and newcomer.rejected is not None
    assert newcomer.rejected.request_id == "bulk2"
    more = queue.push(RequestView("bulk3", MODEL, 1, arrival_s=2.0, flow="bulk"))
    assert not more.queued and more.rejected is not None and more.rejected.request_id == "bulk3"
    second = queue.push(RequestView("light1", MODEL, 1, arrival_s=3.0, flow="light"))
    assert second.rejected is not None and second.rejected.request_id == "light1"  # a tie
    assert drain(queue) == ["bulk0", "light0", "bulk1"]


def test_flows_whose_turns_are_past_are_forgotten_even_while_newcomers_are_refused() -> None:
    queue = RequestQueue(2)
    for name in ("a", "b"):
        queue.push(RequestView(name, MODEL, 1, priority=1, flow=name))
    for i in range(1000):  # each a flow of its own, each refused: the queue is full
        assert not queue.push(RequestView(f"x{i}", MODEL, 1, flow=f"x{i}")).queued
    assert len(queue._turn_ends) <= 2 * len(queue) + 17


def test_without_flows_the_order_is_arrival_whatever_was_served() -> None:
    queue = RequestQueue(10)
    queue.push(RequestView("b", MODEL, 1, arrival_s=1.0, flow="x"))
    assert queue.take("b") and not queue.take("b")
    for name, arrival in (("late", 3.0), ("early", 2.0)):
        queue.push(RequestView(name, MODEL, 1, arrival_s=arrival))
    assert drain(queue) == ["early", "late"]


def test_queue_expires_deadlines_and_cancels() -> None:
    queue = RequestQueue(5)
    queue.push(RequestView("x", MODEL, 1, deadline_s=1.0))
    queue.push(RequestView("y", MODEL, 1, deadline_s=10.0))
    queue.push(RequestView("z", MODEL, 1))
    assert queue.cancel("z") and not queue.cancel("z")
    assert [r.request_id for r in queue.expire(2.0)] == ["x"]
    head = queue.peek()
    assert head is not None and head.request_id == "y"
    assert queue.cancel("y") and queue.peek() is None and len(queue) == 0


def test_excluded_replicas_are_skipped_for_this_request_only(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"] * 2)
    policy = build_policy("round_robin")
    for _ in range(3):
        assert policy.schedule(_req(0), replicas, 0.0, exclude={"r0"}).replica_id == "r1"
    both_failed = policy.schedule(_req(0), replicas, 0.0, exclude={"r0", "r1", "gone"})
    assert both_failed.reason is RejectReason.UNAVAILABLE
    assert policy.schedule(_req(0), replicas, 0.0).replica_id == "r0"


def test_prefill_duty_stretches_the_predicted_inter_token_time_then_fades(
    make_replicas: Factory,
) -> None:
    replicas = make_replicas(["a100-80g"] * 2, factor_alpha=0.0)
    for i in range(3):  # 3 x 16k-token prompts: seconds of prefill chunks on r0
        replicas.on_dispatch(_req(100 + i, prompt=16_000), "r0", 0.0)
    busy = replicas.predict_one(0, 0.0, 500, 0, 64)
    idle = replicas.predict_one(1, 0.0, 500, 0, 64)
    assert idle.stall == 1.0
    assert busy.stall > 1.3  # a third of r0's next seconds go to prefill chunks
    _, busy_e2e = busy.corrected(1.0, 1.0)
    assert busy_e2e - busy.ttft_s == pytest.approx(64 * busy.step_s * busy.stall)
    later = replicas.predict_one(0, 100.0, 500, 0, 64)  # ten duty time constants on
    assert 1.0 <= later.stall < 1.001


def test_tpot_target_rejects_where_prefill_chunks_would_slow_the_streams(
    make_replicas: Factory,
) -> None:
    replicas = make_replicas(["a100-80g"], factor_alpha=0.0)
    policy = build_policy("equal_cost")
    for i in range(3):
        replicas.on_dispatch(_req(100 + i, prompt=16_000), "r0", 0.0)
        replicas.on_first_token(f"q{100 + i}", 0.0)  # streaming now: no queue ahead
    raw = replicas.predict_one(0, 0.0, 500, 0, 64)
    target = raw.step_s * (1.0 + raw.stall) / 2.0  # met by the step alone, not with stalls
    rejected = policy.schedule(_req(1, tpot_target_s=target), replicas, 0.0)
    assert (rejected.outcome, rejected.reason) == (Outcome.REJECT, RejectReason.DEADLINE)
    assert policy.schedule(_req(2, tpot_target_s=target), replicas, 100.0).outcome is Outcome.ADMIT


def test_a_long_prefill_is_kept_away_from_streams_it_would_stall(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"] * 2, factor_alpha=0.0)
    policy = build_policy("equal_cost")
    for i in (100, 101):  # two short streams decode on r0, r1 is idle
        replicas.on_dispatch(_req(i), "r0", 0.0)
        replicas.on_first_token(f"q{i}", 0.0)
    alone_step_s = replicas.predict_one(1, 0.0, 30_000, 0, 64).step_s
    # a target the new request meets on either replica; r0's streams keep it only unstalled
    long_prompt = _req(1, prompt=30_000, tpot_target_s=1.2 * alone_step_s)
    decision = policy.schedule(long_prompt, replicas, 0.0)
    assert decision.replica_id == "r1"
    replicas.set_health("r1", False)  # only r0 is left: its streams would likely miss
    alone = policy.schedule(long_prompt, replicas, 0.0)
    assert (alone.outcome, alone.reason) == (Outcome.REJECT, RejectReason.DEADLINE)
    no_target = policy.schedule(_req(2, prompt=30_000), replicas, 0.0)
    assert no_target.outcome is Outcome.ADMIT  # no TPOT target
    # one stream left: the stall risks at most one reply to serve this one, so it is admitted
    replicas.on_complete("q100", 0.5, ok=True, output_tokens=64)
    assert policy.schedule(long_prompt, replicas, 0.5).replica_id == "r0"


def test_a_prompt_that_would_stall_the_streams_is_held_while_its_deadline_allows(
    make_replicas: Factory,
) -> None:
    replicas = make_replicas(["a100-80g"], factor_alpha=0.0)
    policy = build_policy("equal_cost")
    for i in (100, 101):  # two short streams decode on the one replica
        replicas.on_dispatch(_req(i), "r0", 0.0)
        replicas.on_first_token(f"q{i}", 0.0)
    alone = replicas.predict_one(0, 0.0, 30_000, 0, 64)
    target = 1.2 * alone.step_s  # met by the request itself; the streams' only unstalled
    ttft_s = alone.ttft_s

    def long_prompt(deadline_s: float | None) -> RequestView:
        return _req(1, prompt=30_000, tpot_target_s=target, deadline_s=deadline_s)

    held = policy.schedule(long_prompt(2.0 * ttft_s), replicas, 0.0)
    assert (held.outcome, held.held, held.reason) == (Outcome.QUEUE, True, None)
    # no deadline to bound the wait, or holding turned off: refused at once, as before
    refused = policy.schedule(long_prompt(None), replicas, 0.0)
    assert (refused.outcome, refused.reason) == (Outcome.REJECT, RejectReason.DEADLINE)
    config = parse_scheduling_yaml(
        "policies:\n  - name: no_hold\n    scorers: [{plugin: equal-cost-scorer}]\n"
        "    admission: {slo: true, hold: false}\n",
        "test",
    )
    no_hold = build_policy("no_hold", config=config).schedule(
        long_prompt(2.0 * ttft_s), replicas, 0.0
    )
    assert (no_hold.outcome, no_hold.reason) == (Outcome.REJECT, RejectReason.DEADLINE)
    # a deadline no replica can meet: refused at once, holding would not help it
    hopeless = policy.schedule(long_prompt(0.5 * ttft_s), replicas, 0.0)
    assert (hopeless.outcome, hopeless.reason) == (Outcome.REJECT, RejectReason.DEADLINE)
    # one stream ended: the stall risks at most the one reply this one serves
    replicas.on_complete("q100", 0.2, ok=True, output_tokens=64)
    admitted = policy.schedule(long_prompt(2.0 * ttft_s), replicas, 0.2)
    assert (admitted.outcome, admitted.replica_id) == (Outcome.ADMIT, "r0")
    # held until too late: time enough went by that the prefill no longer fits
    late = policy.schedule(long_prompt(2.0 * ttft_s), replicas, 1.5 * ttft_s)
    assert (late.outcome, late.reason) == (Outcome.REJECT, RejectReason.DEADLINE)


def test_tpot_victims_count_the_streams_a_stall_pushes_past_the_target() -> None:
    running = np.array([0.0, 4.0, 4.0, 4.0, 4.0])
    stall = np.array([5.0, 0.0, 0.5, 5.0, 5.0])
    itl = np.array([0.0, 0.02, 0.02, 0.02, 0.1])  # the last streams are at the target already
    victims = tpot_victims(running, stall, itl, 0.1, 300.0)
    assert victims[0] == 0.0 and victims[1] == 0.0  # no streams; no stall
    # a 0.5 s stall ruins replies shorter than 0.5 / 0.08 = 6.25 tokens: few of mean 300
    assert victims[2] == pytest.approx(4.0 * -math.expm1(-6.25 / 300.0))
    assert victims[2] < victims[3] < 4.0  # a longer stall ruins longer replies too
    assert victims[4] == 4.0


def test_max_stall_is_the_stall_that_admission_allows_and_no_longer() -> None:
    running = np.array([0.0, 1.0, 2.0, 4.0, 40.0, 4.0])
    headroom = np.array([0.08, 0.08, 0.08, 0.08, 0.08, 0.0])  # the last at the target
    stall = max_stall_s(running, headroom, 300.0)
    assert np.isinf(stall[:2]).all()  # one stream or none: never more than one victim
    assert stall[5] == 0.0
    bounded = stall[2:5]
    itl = 0.1 - headroom[2:5]
    victims = tpot_victims(running[2:5], bounded, itl, 0.1, 300.0)
    assert victims == pytest.approx([MAX_TPOT_VICTIMS] * 3)
    assert bounded[0] > bounded[1] > bounded[2]  # more streams, less room for a prefill
    assert (tpot_victims(running[2:5], bounded * 1.01, itl, 0.1, 300.0) > MAX_TPOT_VICTIMS).all()


def test_predicted_times_are_plain_floats_for_json(make_replicas: Factory) -> None:
    """Decisions are encoded as JSON by /v1/route: numpy scalars must not leak into them."""
    replicas = make_replicas(["a100-80g"])
    replicas.on_dispatch(_req(100, prompt=4000), "r0", 0.0)
    decision = build_policy("session").schedule(_req(1, session_key="u"), replicas, 0.1)
    raw = decision.raw_times
    assert raw is not None
    for value in (raw.wait_s, raw.prefill_s, raw.step_s, raw.stall, decision.predicted_e2e_s):
        assert type(value) is float
