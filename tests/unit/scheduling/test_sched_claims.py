"""Claims: the replica a held request waits for, and equal-cost keeping new streams off it."""

from __future__ import annotations

import numpy as np
from conftest import MODEL, Factory

from isocost.scheduling.claims import Claims
from isocost.scheduling.contract import RequestView
from isocost.scheduling.decision import Outcome
from isocost.scheduling.policies import build_policy


def test_claims_add_up_per_slot_leave_out_the_asker_and_end() -> None:
    claims = Claims()
    assert claims.pending_prefill_s(0.0, np.array([0, 1]), "a") is None
    claims.claim("a", 1, 2.0, until_s=10.0, now=0.0)
    claims.claim("b", 1, 3.0, until_s=5.0, now=0.0)
    claims.claim("c", 0, 1.0, until_s=10.0, now=0.0)
    claims.claim("c", 2, 4.0, until_s=10.0, now=0.0)  # held again: the newer claim stands
    pending = claims.pending_prefill_s(0.0, np.array([0, 1, 2]), "a")
    assert pending is not None and pending.tolist() == [0.0, 3.0, 4.0]  # "a"'s own left out
    later = claims.pending_prefill_s(6.0, np.array([1, 2]), "x")  # "b" is past its deadline
    assert later is not None and later.tolist() == [2.0, 4.0] and len(claims) == 2
    claims.release("a")
    claims.release("a")
    assert claims.pending_prefill_s(6.0, np.array([0, 1]), "x") is None  # only "c", on 2
    assert claims.pending_prefill_s(6.0, np.array([], dtype=np.int64), "x") is None
    assert claims.pending_prefill_s(11.0, np.array([2]), "x") is None and len(claims) == 0
    claims.claim("d", 0, 1.0, until_s=20.0, now=11.0)
    claims.claim("e", 0, 1.0, until_s=30.0, now=25.0)  # a new claim drops the ones past
    assert len(claims) == 1  # their deadline, read or not


def _stream(replicas_set: object, name: str, replica: str, prompt: int = 500) -> None:
    request = RequestView(name, MODEL, prompt, max_tokens=64)
    replicas_set.on_dispatch(request, replica, 0.0)  # type: ignore[attr-defined]
    replicas_set.on_first_token(name, 0.0)  # type: ignore[attr-defined]


def test_equal_cost_keeps_new_streams_off_the_replica_a_held_prompt_waits_for(
    make_replicas: Factory,
) -> None:
    replicas = make_replicas(["a100-80g"] * 2, factor_alpha=0.0)
    policy = build_policy("equal_cost")
    for name, replica in (("s0", "r0"), ("s1", "r0"), ("s2", "r1"), ("s3", "r1"), ("s4", "r1")):
        _stream(replicas, name, replica)
    alone = replicas.predict_one(0, 0.0, 30_000, 0, 64)
    long_prompt = RequestView(
        "long",
        MODEL,
        30_000,
        max_tokens=64,
        deadline_s=2.0 * alone.ttft_s,
        tpot_target_s=1.2 * alone.step_s,  # its own; the streams' only unstalled
    )
    short = RequestView("short", MODEL, 500, max_tokens=64)
    assert policy.schedule(short, replicas, 0.0).replica_id == "r0"  # fewer streams there
    held = policy.schedule(long_prompt, replicas, 0.0)
    assert held.outcome is Outcome.QUEUE and held.held
    assert len(policy.claims) == 1  # r0: two streams to wait for, not three
    steered = policy.schedule(short, replicas, 0.0)
    assert steered.replica_id == "r1"  # r0 owes the held prompt's prefill
    # another policy's claims are its own: a fresh equal_cost still goes to r0
    assert build_policy("equal_cost").schedule(short, replicas, 0.0).replica_id == "r0"
    replicas.on_complete("s0", 0.1, ok=True, output_tokens=64)
    admitted = policy.schedule(long_prompt, replicas, 0.1)
    assert (admitted.outcome, admitted.replica_id, len(policy.claims)) == (Outcome.ADMIT, "r0", 0)
