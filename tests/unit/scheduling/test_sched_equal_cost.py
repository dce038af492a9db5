"""Equal-cost on crafted states: where it disagrees with counting requests, and why."""

from __future__ import annotations

import heapq
from collections import Counter
from random import Random

from conftest import MODEL, Factory, cost_model

from isocost.scheduling.contract import ReplicaSpec, RequestView
from isocost.scheduling.framework import Policy
from isocost.scheduling.policies import build_policy, parse_scheduling_yaml
from isocost.scheduling.state import ReplicaSet


def _req(i: int, prompt: int = 1000, **kwargs: object) -> RequestView:
    return RequestView(f"q{i}", MODEL, prompt, max_tokens=256, **kwargs)  # type: ignore[arg-type]


def _running(
    replicas: ReplicaSet, replica: str, name: str, prompt: int, generated: int, route: str = ""
) -> None:
    replicas.on_dispatch(RequestView(name, MODEL, prompt, route_class=route or None), replica, 0.0)
    replicas.on_first_token(name, 0.0)
    replicas.on_tokens(name, generated, 0.0)


def test_two_long_generations_cost_more_than_twenty_short_ones(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g", "a100-80g"], factor_alpha=0.0)
    replicas.estimator.observe(MODEL, "long", 60_000)  # long-form generations run ~60k tokens
    for i in range(2):  # r0: two generations at 100k tokens of context, 20k more to go
        _running(replicas, "r0", f"long{i}", prompt=60_000, generated=40_000, route="long")
    for i in range(20):  # r1: twenty short chats
        _running(replicas, "r1", f"short{i}", prompt=200, generated=50)

    least = build_policy("least_request").schedule(_req(0), replicas, 0.0)
    equal = build_policy("equal_cost").schedule(_req(0), replicas, 0.0)

    assert least.replica_id == "r0"  # 2 < 20 requests
    # r0's every decode step reads 200k tokens of KV: joining it makes q's 256 tokens
    # ~2.3x slower, which outweighs stalling r1's twenty short chats for one prefill.
    assert equal.replica_id == "r1"
    assert equal.explanation is not None
    explanation = equal.explanation
    scores = dict(
        zip(explanation.replica_ids, explanation.scores["equal-cost-scorer"], strict=True)
    )
    assert scores["r1"] == 1.0 and scores["r0"] < 0.95


def test_heterogeneous_gpus_get_traffic_by_speed(make_replicas: Factory) -> None:
    counts: dict[str, Counter[str]] = {}
    for policy_name in ("least_request", "equal_cost"):
        replicas = make_replicas(["a100-80g", "h100-80g"], factor_alpha=0.0)
        policy = build_policy(policy_name)
        chosen: Counter[str] = Counter()
        for i in range(40):
            decision = policy.schedule(_req(i), replicas, 0.0)
            assert decision.replica_id is not None
            chosen[decision.replica_id] += 1
            replicas.on_dispatch(_req(i), decision.replica_id, 0.0)
        counts[policy_name] = chosen
    assert counts["least_request"]["r0"] == counts["least_request"]["r1"] == 20
    # The H100 prefills ~3x and decodes ~1.7x faster than the A100: it takes the larger share.
    assert counts["equal_cost"]["r1"] >= 1.5 * counts["equal_cost"]["r0"]


def _run_with_slow_replica(make_replicas: Factory, factor_alpha: float) -> tuple[float, float]:
    """A small event loop: r3 takes 3x its predicted time. Returns (r3's share, its factor)."""
    replicas = make_replicas(["a100-80g"] * 4, factor_alpha=factor_alpha)
    policy = build_policy("equal_cost")
    slowness = {"r0": 1.0, "r1": 1.0, "r2": 1.0, "r3": 3.0}
    events: list[tuple[float, int, str, str]] = []  # (time, seq, kind, request id)
    rng = Random(7)
    chosen: Counter[str] = Counter()
    now, seq = 0.0, 0
    for i in range(600):
        now += 0.08
        while events and events[0][0] <= now:
            t, _, kind, rid = heapq.heappop(events)
            if kind == "first":
                replicas.on_first_token(rid, t)
            else:
                replicas.on_complete(rid, t, output_tokens=128)
        request = _req(i, prompt=rng.randint(500, 3000))
        decision = policy.schedule(request, replicas, now)
        assert decision.replica_id is not None
        record = replicas.on_dispatch(request, decision.replica_id, now)
        slow = slowness[decision.replica_id]
        first = now + slow * record.predicted_ttft_s
        done = first + slow * 127 * record.predicted_step_s
        heapq.heappush(events, (first, seq, "first", request.request_id))
        heapq.heappush(events, (done, seq + 1, "done", request.request_id))
        seq += 2
        if i >= 200:
            chosen[decision.replica_id] += 1
    return chosen["r3"] / sum(chosen.values()), replicas.get("r3").ttft_factor


def test_slow_replica_learned_factor_lowers_its_share(make_replicas: Factory) -> None:
    share_blind, factor_blind = _run_with_slow_replica(make_replicas, factor_alpha=0.0)
    share_learned, factor_learned = _run_with_slow_replica(make_replicas, factor_alpha=0.1)
    assert factor_blind == 1.0
    assert factor_learned > 1.5  # it learned that r3 is slower than its spec
    assert share_learned < 0.8 * share_blind
    assert share_learned < 0.25  # less than a fair quarter


def _equal_cost_with(parameters: str) -> Policy:
    """equal_cost alone with its scorer's ``parameters`` (YAML flow mapping entries)."""
    config = parse_scheduling_yaml(
        f"""
plugins:
  - {{name: cost, type: equal-cost-scorer, parameters: {{{parameters}}}}}
policies:
  - {{name: tuned, scorers: [{{plugin: cost}}]}}
""",
        "test",
    )
    return build_policy("tuned", config=config)


def _sticky() -> Policy:
    """One preferred replica per session, so that "home" is unambiguous."""
    return _equal_cost_with("affinity_replicas: 1")


def _preferred(make_replicas: Factory, session: str) -> str:
    replicas = make_replicas(["a100-80g"] * 4, factor_alpha=0.0)
    decision = _sticky().schedule(_req(0, session_key=session), replicas, 0.0)
    assert decision.replica_id is not None
    return decision.replica_id


def test_affinity_holds_while_preferred_is_only_a_little_busier(make_replicas: Factory) -> None:
    home = _preferred(make_replicas, "user-1")
    replicas = make_replicas(["a100-80g"] * 4, factor_alpha=0.0)
    _running(replicas, home, "other", prompt=300, generated=10)  # a little busier than idle
    decision = _sticky().schedule(_req(1, session_key="user-1"), replicas, 0.0)
    assert decision.replica_id == home


def test_affinity_spills_when_preferred_replica_is_overloaded(make_replicas: Factory) -> None:
    home = _preferred(make_replicas, "user-1")
    replicas = make_replicas(["a100-80g"] * 4, factor_alpha=0.0, max_queue=8)
    for i in range(5):  # waiting >= 0.5 * max_queue: overloaded, though under its cap
        replicas.on_dispatch(RequestView(f"w{i}", MODEL, 50), home, 0.0)
    decision = _sticky().schedule(_req(1, session_key="user-1"), replicas, 0.0)
    assert decision.replica_id is not None and decision.replica_id != home


def test_affinity_spills_when_preferred_costs_more_than_the_slack(make_replicas: Factory) -> None:
    home = _preferred(make_replicas, "user-1")
    replicas = make_replicas(["a100-80g"] * 4, factor_alpha=0.0, max_queue=100)
    replicas.on_dispatch(RequestView("big", MODEL, 30_000), home, 0.0)  # 1 waiting, long prefill
    decision = _sticky().schedule(_req(1, session_key="user-1"), replicas, 0.0)
    assert decision.replica_id is not None and decision.replica_id != home


def test_cached_prefix_attracts_the_request(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"] * 3, factor_alpha=0.0)
    blocks = tuple(range(1, 200))  # 199 blocks of 16 tokens
    replicas.on_dispatch(RequestView("warm", MODEL, 3200, block_hashes=blocks), "r2", 0.0)
    replicas.on_complete("warm", 1.0, output_tokens=10)
    decision = build_policy("equal_cost").schedule(
        RequestView("q", MODEL, 3300, block_hashes=blocks, max_tokens=64), replicas, 2.0
    )
    assert decision.replica_id == "r2"
    assert decision.cached_tokens == 199 * 16


def _error_blind() -> Policy:
    return _equal_cost_with("max_error_slack: 0")


def _answer_off(
    replicas: ReplicaSet, replica: str, ttft_off: float, block_hashes: tuple[int, ...] = ()
) -> None:
    """Ten 400-token requests on ``replica`` whose first tokens come ``ttft_off`` times
    what was predicted (its TTFT error: ``|1 - ttft_off| / ttft_off``)."""
    for i in range(10):
        name = f"{replica}-warm{i}"
        request = RequestView(name, MODEL, 400, block_hashes=block_hashes)
        replicas.on_dispatch(request, replica, 0.0)
        predicted = replicas.get(replica).in_flight[name].predicted_ttft_s
        replicas.on_first_token(name, predicted * ttft_off)
        replicas.on_complete(name, 1.0, output_tokens=10)


def _holder_a_little_busier(make_replicas: Factory, ttft_off: float) -> ReplicaSet:
    """Two A100s: r1 holds the prompt's prefix and streams two long replies (about 10%
    dearer than idle r0 even so); r1's last TTFTs came ``ttft_off`` times what it
    predicted."""
    replicas = make_replicas(["a100-80g", "a100-80g"], factor_alpha=0.0)
    _answer_off(replicas, "r1", ttft_off, block_hashes=tuple(range(1, 21)))  # 20 blocks
    for i in range(2):
        _running(replicas, "r1", f"busy{i}", prompt=4000, generated=10)
    return replicas


def _asked(replicas: ReplicaSet, policy: Policy) -> str | None:
    request = RequestView("q", MODEL, 400, block_hashes=tuple(range(1, 21)), max_tokens=64)
    return policy.schedule(request, replicas, 2.0).replica_id


def test_a_cached_prefix_wins_a_cost_gap_smaller_than_the_prediction_error(
    make_replicas: Factory,
) -> None:
    # Priced exactly (TTFTs as predicted): the idle replica is cheaper, and wins.
    exact = _holder_a_little_busier(make_replicas, ttft_off=1.0)
    assert exact.get("r1").ttft_error < 0.01
    assert _asked(exact, build_policy("equal_cost")) == "r0"
    # TTFTs 2x what was predicted (error 50%): a gap that small says nothing, and the
    # replica that holds the prefix keeps it; blind to the error, equal-cost moves it.
    unsure = _holder_a_little_busier(make_replicas, ttft_off=2.0)
    assert unsure.get("r1").ttft_error > 0.4
    assert _asked(unsure, build_policy("equal_cost")) == "r1"
    assert _asked(unsure, _error_blind()) == "r0"


def _queue_or_streams(make_replicas: Factory, ttft_off: float, streams: int) -> ReplicaSet:
    """Two A100s whose last TTFTs came ``ttft_off`` times what they predicted: r0 has one
    request queued (400 tokens), r1 none but ``streams`` long replies streaming."""
    replicas = make_replicas(["a100-80g", "a100-80g"], factor_alpha=0.0)
    for replica in ("r0", "r1"):
        _answer_off(replicas, replica, ttft_off)
    replicas.on_dispatch(RequestView("queued", MODEL, 400), "r0", 2.0)
    for i in range(streams):
        _running(replicas, "r1", f"busy{i}", prompt=4000, generated=10)
    return replicas


def test_the_shorter_queue_wins_a_cost_gap_smaller_than_the_prediction_error(
    make_replicas: Factory,
) -> None:
    def asked(replicas: ReplicaSet, policy: Policy) -> str | None:
        return policy.schedule(
            RequestView("q", MODEL, 400, max_tokens=64), replicas, 2.0
        ).replica_id

    # Priced exactly: two streams on r1 cost more than one request queued on r0.
    assert (
        asked(_queue_or_streams(make_replicas, 1.0, streams=2), build_policy("equal_cost")) == "r0"
    )
    # Error 50%: the gap (~20%) says nothing, and the replica with no queue wins ...
    unsure = _queue_or_streams(make_replicas, 2.0, streams=2)
    assert asked(unsure, build_policy("equal_cost")) == "r1"
    assert asked(unsure, _error_blind()) == "r0"
    # ... but not a gap larger than the error: three streams cost ~75% more.
    busier = _queue_or_streams(make_replicas, 2.0, streams=3)
    assert asked(busier, build_policy("equal_cost")) == "r0"


def _long_prompts(policy: Policy, replicas: ReplicaSet, count: int, deadline_s: float) -> None:
    """Price ``count`` 30,000-token prompts (none dispatched): an A100 prefills one in
    about 4.5 s, an L20 in about 11 s."""
    for i in range(count):
        long_prompt = RequestView(f"long{i}", MODEL, 30_000, max_tokens=64, deadline_s=deadline_s)
        policy.schedule(long_prompt, replicas, 0.0)


def test_short_prompts_leave_the_fast_replicas_to_the_prompts_only_they_serve_in_time(
    make_replicas: Factory,
) -> None:
    short = RequestView("short", MODEL, 500, max_tokens=64, deadline_s=5.0)
    for weight, expected in ((3.0, "r1"), (0.0, "r0")):
        replicas = make_replicas(["a100-80g", "l20-48g"], factor_alpha=0.0)
        policy = _equal_cost_with(f"scarcity_weight: {weight}")
        assert policy.schedule(short, replicas, 0.0).replica_id == "r0"  # faster, and free
        # 9 s to the first token: only the A100 prefills these in time
        _long_prompts(policy, replicas, 10, deadline_s=9.0)
        assert policy.schedule(short, replicas, 0.0).replica_id == expected
    # a prompt either can serve in time, or neither, is nobody's exclusive demand
    replicas = make_replicas(["a100-80g", "l20-48g"], factor_alpha=0.0)
    policy = build_policy("equal_cost")
    _long_prompts(policy, replicas, 10, deadline_s=60.0)
    _long_prompts(policy, replicas, 10, deadline_s=1.0)
    assert policy.schedule(short, replicas, 0.0).replica_id == "r0"


def test_exclusive_demand_counts_a_request_once_and_fades(make_replicas: Factory) -> None:
    short = RequestView("short", MODEL, 500, max_tokens=64, deadline_s=60.0)
    replicas = make_replicas(["a100-80g", "l20-48g"], factor_alpha=0.0)
    policy = build_policy("equal_cost")
    long_prompt = RequestView("long", MODEL, 30_000, max_tokens=64, deadline_s=9.0)
    for _ in range(10):  # held and priced again at every wake: one request all the same
        policy.schedule(long_prompt, replicas, 0.0)
    assert policy.schedule(short, replicas, 0.0).replica_id == "r0"
    _long_prompts(policy, replicas, 10, deadline_s=9.0)
    assert policy.schedule(short, replicas, 0.0).replica_id == "r1"
    later = RequestView("later", MODEL, 500, max_tokens=64, deadline_s=600.0)
    assert policy.schedule(later, replicas, 300.0).replica_id == "r0"  # five minutes on


def test_a_replica_in_a_removed_ones_slot_starts_with_no_exclusive_demand(
    make_replicas: Factory,
) -> None:
    short = RequestView("short", MODEL, 500, max_tokens=64, deadline_s=5.0)
    replicas = make_replicas(["a100-80g", "l20-48g"], factor_alpha=0.0)
    policy = build_policy("equal_cost")
    _long_prompts(policy, replicas, 10, deadline_s=9.0)
    assert policy.schedule(short, replicas, 0.0).replica_id == "r1"  # r0 kept for the long
    replicas.remove("r0")
    fresh = replicas.add(ReplicaSpec("r2", MODEL, cost_model("a100-80g")))
    assert fresh.slot == 0  # r0's slot, which held its exclusive demand
    assert policy.schedule(short, replicas, 0.0).replica_id == "r2"


def _streams(replicas: ReplicaSet, counts: dict[str, int]) -> None:
    """``counts[replica]`` short replies running on each replica, 20 tokens in."""
    for replica, count in counts.items():
        for i in range(count):
            _running(replicas, replica, f"{replica}-stream{i}", 300, 20)


def _long_prompt_arrivals(policy: Policy, replicas: ReplicaSet, now: float = 0.0) -> None:
    """A minute's long prompts, 8,000 to 37,500 tokens, priced (none dispatched)."""
    for i in range(60):
        long_prompt = RequestView(f"long{i}", MODEL, 8_000 + 500 * i, tpot_target_s=0.1)
        policy.schedule(long_prompt, replicas, now)


def test_short_replies_gather_where_streams_run_when_long_prompts_need_the_room(
    make_replicas: Factory,
) -> None:
    short = RequestView("short", MODEL, 300, tpot_target_s=0.1)
    for weight, expected in ((3.0, "r0"), (0.0, "r1")):
        replicas = make_replicas(["a100-80g", "a100-80g"], factor_alpha=0.0)
        _streams(replicas, {"r0": 40, "r1": 8})
        policy = _equal_cost_with(f"headroom_weight: {weight}")
        assert policy.schedule(short, replicas, 0.0).replica_id == "r1"  # fewer streams
        # one more stream on r1 lowers the longest prefill it may take (~3.0 s -> 2.6 s)
        # far more than on r0 (0.54 s -> 0.52 s): prompts of ~20k tokens would be shut out
        _long_prompt_arrivals(policy, replicas)
        assert policy.schedule(short, replicas, 0.0).replica_id == expected
    # five minutes on, that demand has faded
    later = RequestView("later", MODEL, 300, tpot_target_s=0.1)
    replicas = make_replicas(["a100-80g", "a100-80g"], factor_alpha=0.0)
    _streams(replicas, {"r0": 40, "r1": 8})
    policy = build_policy("equal_cost")
    _long_prompt_arrivals(policy, replicas)
    assert policy.schedule(later, replicas, 300.0).replica_id == "r1"


def test_the_headroom_price_asks_room_only_of_much_shorter_prompts_with_a_tpot_target(
    make_replicas: Factory,
) -> None:
    def cost_scores(parameters: str, request: RequestView) -> list[float]:
        replicas = make_replicas(["a100-80g", "a100-80g"], factor_alpha=0.0)
        _streams(replicas, {"r0": 40, "r1": 8})
        policy = _equal_cost_with(parameters)
        _long_prompt_arrivals(policy, replicas)
        decision = policy.schedule(request, replicas, 0.0)
        assert decision.explanation is not None
        return [float(x) for x in decision.explanation.scores["cost"]]

    # 9,000 tokens: the prompts its stream would shut out of r1 (~20k tokens, as above)
    # are under four times its own
    mid = RequestView("mid", MODEL, 9_000, tpot_target_s=0.1)
    unpriced = cost_scores("headroom_weight: 0", mid)
    assert cost_scores("headroom_ratio: 4", mid) == unpriced
    assert cost_scores("headroom_ratio: 1", mid) != unpriced
    # no TPOT target: no stream of its own to keep under one, nothing asked of it
    untimed = RequestView("untimed", MODEL, 300)
    assert cost_scores("headroom_weight: 3", untimed) == cost_scores("headroom_weight: 0", untimed)


def test_long_prompt_demand_counts_a_request_once(make_replicas: Factory) -> None:
    short = RequestView("short", MODEL, 300, tpot_target_s=0.1)
    for distinct, expected in ((True, "r0"), (False, "r1")):
        replicas = make_replicas(["a100-80g", "a100-80g"], factor_alpha=0.0)
        _streams(replicas, {"r0": 40, "r1": 8})
        policy = build_policy("equal_cost")
        for i in range(60):  # held and priced again at every wake: one request all the same
            name = f"long{i}" if distinct else "long"
            policy.schedule(RequestView(name, MODEL, 18_000, tpot_target_s=0.1), replicas, 0.0)
        assert policy.schedule(short, replicas, 0.0).replica_id == expected
