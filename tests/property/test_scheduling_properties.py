"""Properties of every built-in policy on random fleets: eligibility and determinism."""

from __future__ import annotations

from random import Random

from hypothesis import given, settings
from hypothesis import strategies as st

from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.scheduling.contract import ReplicaSpec, RequestView
from isocost.scheduling.decision import Decision, Outcome
from isocost.scheduling.policies import BUILTIN_POLICIES, build_policy
from isocost.scheduling.state import ReplicaSet

_CATALOG = Catalog.builtin()
_COST_MODELS = [
    CostModel(_CATALOG.model("llama-3.1-8b"), _CATALOG.gpu(g))
    for g in ("a100-80g", "h100-80g", "l40s-48g")
]

_replica = st.tuples(
    st.integers(0, 2),  # cost model
    st.booleans(),  # healthy
    st.booleans(),  # draining
    st.integers(1, 4),  # max_queue
    st.integers(0, 5),  # requests already waiting
    st.sampled_from(["m", "other"]),  # served model
)
_request = st.tuples(
    st.integers(1, 9000),  # prompt tokens
    st.lists(st.integers(0, 3), max_size=6),  # blocks, from a small alphabet: shared prefixes
    st.one_of(st.none(), st.integers(1, 5)),  # session
    st.one_of(st.none(), st.floats(0.01, 30.0)),  # deadline
)


def _fleet(spec: list[tuple[int, bool, bool, int, int, str]]) -> ReplicaSet:
    replicas = ReplicaSet()
    for i, (cm, healthy, draining, cap, waiting, model) in enumerate(spec):
        replicas.add(ReplicaSpec(f"r{i}", model, _COST_MODELS[cm], max_queue=cap))
        for j in range(waiting):
            replicas.on_dispatch(RequestView(f"pre{i}-{j}", model, 100 * (j + 1)), f"r{i}", 0.0)
        replicas.set_health(f"r{i}", healthy)
        replicas.set_draining(f"r{i}", draining)
    return replicas


def _request_view(i: int, r: tuple[int, list[int], int | None, float | None]) -> RequestView:
    prompt, blocks, session, deadline = r
    chained = tuple(hash(tuple(blocks[: k + 1])) & (2**63 - 1) for k in range(len(blocks)))
    return RequestView(
        f"q{i}",
        "m",
        prompt,
        block_hashes=chained,
        max_tokens=128,
        session_key=None if session is None else f"s{session}",
        deadline_s=deadline,
    )


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    spec=st.lists(_replica, min_size=1, max_size=8),
    requests=st.lists(_request, min_size=1, max_size=12),
    policy_name=st.sampled_from(sorted(BUILTIN_POLICIES)),
)
def test_admitted_requests_go_only_to_eligible_replicas(
    spec: list[tuple[int, bool, bool, int, int, str]],
    requests: list[tuple[int, list[int], int | None, float | None]],
    policy_name: str,
) -> None:
    replicas = _fleet(spec)
    policy = build_policy(policy_name, rng=Random(3))
    replicas.add_listener(policy)
    for i, r in enumerate(requests):
        request = _request_view(i, r)
        eligible = {
            s.replica_id
            for s in replicas
            if s.spec.model == "m"
            and s.healthy
            and not s.draining
            and s.num_waiting < s.spec.max_queue
        }
        decision = policy.schedule(request, replicas, 0.0)
        if decision.outcome is Outcome.ADMIT:
            assert decision.replica_id in eligible
            assert decision.explanation is not None
            assert decision.replica_id in decision.explanation.replica_ids
            assert set(decision.explanation.replica_ids) <= eligible
            for scores in decision.explanation.scores.values():
                assert ((scores >= 0.0) & (scores <= 1.0)).all()
            replicas.on_dispatch(request, decision.replica_id, 0.0)
        elif not eligible:
            assert decision.outcome in (Outcome.QUEUE, Outcome.REJECT)
        else:  # replicas have room: only an SLO rejection may refuse
            assert decision.outcome is Outcome.REJECT and request.deadline_s is not None


def _run(
    policy_name: str, seed: int, requests: list[tuple[int, list[int], int | None, float | None]]
) -> list[Decision]:
    replicas = _fleet([(i % 3, True, False, 64, 0, "m") for i in range(6)])
    policy = build_policy(policy_name, rng=Random(seed))
    replicas.add_listener(policy)
    decisions = []
    for i, r in enumerate(requests):
        request = _request_view(i, r)
        decision = policy.schedule(request, replicas, 0.1 * i)
        decisions.append(decision)
        if decision.replica_id is not None:
            replicas.on_dispatch(request, decision.replica_id, 0.1 * i)
        if i % 3 == 2:
            replicas.on_complete(f"q{i - 2}", 0.1 * i, output_tokens=50)
    return decisions


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    requests=st.lists(_request, min_size=1, max_size=15),
    policy_name=st.sampled_from(sorted(BUILTIN_POLICIES)),
    seed=st.integers(0, 2**32),
)
def test_decisions_are_deterministic_for_a_seed(
    requests: list[tuple[int, list[int], int | None, float | None]], policy_name: str, seed: int
) -> None:
    first, second = _run(policy_name, seed, requests), _run(policy_name, seed, requests)
    assert [(d.outcome, d.replica_id, d.predicted_ttft_s) for d in first] == [
        (d.outcome, d.replica_id, d.predicted_ttft_s) for d in second
    ]
