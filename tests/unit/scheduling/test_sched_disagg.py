"""Prefill/decode pair choice: when a request splits, where each leg goes, and fallbacks."""

from __future__ import annotations

import pytest
from conftest import MODEL, cost_model

from isocost.core.links import BUILTIN_LINKS, kv_transfer_s, link
from isocost.scheduling.contract import ReplicaSpec, RequestView, Role
from isocost.scheduling.decision import Outcome
from isocost.scheduling.disagg import DisaggMode, PairDecision, choose_pair, prefill_leg_id
from isocost.scheduling.policies import build_policy
from isocost.scheduling.state import ReplicaSet

IB = link("infiniband")
LONG, SHORT = 16_000, 200


def _fleet(roles: dict[str, Role]) -> ReplicaSet:
    replicas = ReplicaSet(factor_alpha=0.0)
    for name, role in roles.items():
        replicas.add(ReplicaSpec(name, MODEL, cost_model("a100-80g"), role=role))
    return replicas


def _busy(replicas: ReplicaSet, replica: str, streams: int, hashes: tuple[int, ...] = ()) -> None:
    """``streams`` requests decoding on ``replica`` (2k tokens of context each)."""
    for i in range(streams):
        name = f"{replica}-run{i}"
        replicas.on_dispatch(RequestView(name, MODEL, 2000, block_hashes=hashes), replica, 0.0)
        replicas.on_first_token(name, 0.0)


def _request(prompt: int, hashes: tuple[int, ...] = ()) -> RequestView:
    return RequestView("q", MODEL, prompt, block_hashes=hashes, max_tokens=256)


def _choose(replicas: ReplicaSet, request: RequestView, mode: DisaggMode) -> PairDecision:
    return choose_pair(build_policy("equal_cost"), request, replicas, 0.0, mode=mode, link=IB)


def _pd_fleet(streams: int = 24) -> ReplicaSet:
    replicas = _fleet({"p0": "prefill", "d0": "decode", "d1": "decode"})
    for name in ("d0", "d1"):
        _busy(replicas, name, streams)
    return replicas


def test_long_uncached_prompt_beside_running_streams_splits() -> None:
    replicas = _pd_fleet()
    pair = _choose(replicas, _request(LONG), DisaggMode.CONDITIONAL)

    assert pair.disaggregated
    assert pair.prefill is not None and pair.prefill.replica_id == "p0"
    assert pair.decision.outcome is Outcome.ADMIT and pair.decision.replica_id in ("d0", "d1")
    assert pair.split_cost_s < pair.colocated_cost_s
    kv_bytes = cost_model("a100-80g").kv_bytes_per_token
    assert pair.transfer_tokens == LONG
    assert pair.transfer_s == pytest.approx(kv_transfer_s(LONG, kv_bytes, IB))
    assert pair.prefill_request is not None
    assert pair.prefill_request.request_id == prefill_leg_id("q")
    assert pair.prefill_request.max_tokens == 1
    assert pair.decode_request.kv_ready_tokens == LONG - 1


def test_short_prompt_prefills_where_it_decodes() -> None:
    replicas = _pd_fleet(streams=0)
    pair = _choose(replicas, _request(SHORT), DisaggMode.CONDITIONAL)

    assert not pair.disaggregated
    assert pair.decision.replica_id in ("d0", "d1")  # never on the prefill-only replica
    assert pair.colocated_cost_s <= pair.split_cost_s < float("inf")


def test_large_prefix_hit_on_a_decode_replica_prefills_there() -> None:
    prompt = tuple(range(LONG // 16))
    replicas = _fleet({"p0": "prefill", "d0": "decode", "d1": "decode"})
    _busy(replicas, "d0", 12)
    _busy(replicas, "d1", 12, hashes=prompt[:-60])  # d1 holds all but ~1k tokens of it

    pair = _choose(replicas, _request(LONG, prompt), DisaggMode.CONDITIONAL)

    assert not pair.disaggregated
    assert pair.decision.replica_id == "d1"
    assert pair.decision.cached_tokens == (len(prompt) - 60) * 16


def test_pd_splits_even_a_short_prompt_and_colocated_never_splits() -> None:
    assert _choose(_pd_fleet(), _request(SHORT), DisaggMode.PD).disaggregated
    pair = _choose(_pd_fleet(), _request(LONG), DisaggMode.COLOCATED)
    assert not pair.disaggregated and pair.decision.replica_id in ("d0", "d1")


@pytest.mark.parametrize("mode", [DisaggMode.PD, DisaggMode.CONDITIONAL])
def test_no_live_prefill_replica_runs_colocated(mode: DisaggMode) -> None:
    replicas = _pd_fleet()
    replicas.set_health("p0", False)
    pair = _choose(replicas, _request(LONG), mode)
    assert not pair.disaggregated
    assert pair.decision.outcome is Outcome.ADMIT and pair.decision.replica_id in ("d0", "d1")

    only_both = _fleet({"b0": "both"})  # P and D would be one replica: no pair exists
    pair = _choose(only_both, _request(LONG), mode)
    assert not pair.disaggregated and pair.decision.replica_id == "b0"


def test_legs_in_the_shadow_queue_the_prefill_on_p_and_reserve_kv_on_d() -> None:
    replicas = _pd_fleet()
    pair = _choose(replicas, _request(LONG), DisaggMode.PD)
    assert pair.prefill is not None and pair.prefill_request is not None
    d = pair.decision.replica_id
    assert d is not None
    p_slot, d_slot = replicas.get("p0").slot, replicas.get(d).slot
    before = float(replicas.local.kv_tokens[d_slot])

    replicas.on_dispatch(pair.prefill_request, "p0", 0.0, decision=pair.prefill)
    replicas.on_dispatch(pair.decode_request, d, 0.0, decision=pair.decision)

    assert replicas.local.queued_prefill_tokens[p_slot] == LONG
    assert replicas.local.queued_prefill_tokens[d_slot] == 1  # the last prompt token
    assert replicas.local.kv_tokens[d_slot] - before == LONG
    # D's first token comes after P's prefill and the transfer: its prediction says so
    assert pair.decision.predicted_ttft_s is not None and pair.prefill.predicted_ttft_s
    assert pair.decision.predicted_ttft_s > pair.prefill.predicted_ttft_s + pair.transfer_s
    # the one-token prefill leg teaches the estimator nothing about the request's class
    replicas.on_complete(pair.prefill_request.request_id, 1.0, output_tokens=1)
    assert replicas.estimator.expected_tokens(MODEL, "default", None) == 256


def test_prefill_only_replicas_never_serve_whole_requests() -> None:
    replicas = _fleet({"p0": "prefill", "d0": "decode"})
    _busy(replicas, "d0", 60)
    pair = _choose(replicas, _request(SHORT), DisaggMode.COLOCATED)
    assert pair.decision.replica_id == "d0"


def test_kv_transfer_time_grows_with_tokens_and_falls_with_bandwidth() -> None:
    kv_bytes = cost_model("a100-80g").kv_bytes_per_token
    assert kv_transfer_s(0, kv_bytes, IB) == 0.0
    times = [kv_transfer_s(8192, kv_bytes, BUILTIN_LINKS[k]) for k in ("nvlink", "infiniband")]
    times += [kv_transfer_s(8192, kv_bytes, BUILTIN_LINKS[k]) for k in ("roce", "tcp")]
    assert times == sorted(times) and times[0] > 0
    one, two = kv_transfer_s(4096, kv_bytes, IB), kv_transfer_s(8192, kv_bytes, IB)
    assert two - IB.latency_s == pytest.approx(2 * (one - IB.latency_s))
    with pytest.raises(KeyError, match="valid: nvlink"):
        link("carrier-pigeon")


def test_a_replica_role_must_be_known() -> None:
    with pytest.raises(ValueError, match="role"):
        ReplicaSpec("x", MODEL, cost_model("a100-80g"), role="verify")  # type: ignore[arg-type]


def test_a_decode_leg_is_admitted_where_a_prompt_would_stall_too_many_streams() -> None:
    replicas = _fleet({"d0": "decode"})
    _busy(replicas, "d0", 20)
    policy = build_policy("equal_cost")
    tight = RequestView("q", MODEL, 4000, max_tokens=256, tpot_target_s=0.05)
    refused = policy.schedule(tight, replicas, 0.0)
    handed = policy.schedule(
        RequestView("q", MODEL, 4000, max_tokens=256, tpot_target_s=0.05, kv_ready_tokens=3999),
        replicas,
        0.0,
    )
    assert refused.outcome is Outcome.REJECT
    assert handed.outcome is Outcome.ADMIT and handed.cached_tokens == 3999
