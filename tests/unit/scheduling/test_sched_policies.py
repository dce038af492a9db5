"""Baseline policies behave as their sources say; YAML profiles fail loudly on bad input."""

from __future__ import annotations

from collections import Counter
from random import Random
from typing import ClassVar

import numpy as np
import pytest
from conftest import MODEL, Factory

from isocost.core.errors import ConfigError, UnknownEntryError
from isocost.scheduling.contract import RequestView
from isocost.scheduling.framework import Policy
from isocost.scheduling.interface import Context
from isocost.scheduling.plugins import PLUGIN_TYPES
from isocost.scheduling.plugins.max_score import MaxScorePicker
from isocost.scheduling.policies import (
    BUILTIN_POLICIES,
    SLO_BASELINES,
    SchedulingConfig,
    build_policy,
    config_to_yaml,
    parse_scheduling_yaml,
)
from isocost.scheduling.timing import FloatArray


def _req(i: int, **kwargs: object) -> RequestView:
    return RequestView(f"q{i}", MODEL, 500, max_tokens=64, **kwargs)  # type: ignore[arg-type]


def test_round_robin_cycles_and_survives_a_missing_replica(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"] * 3)
    policy = build_policy("round_robin")
    picks = [policy.schedule(_req(i), replicas, 0.0).replica_id for i in range(4)]
    assert picks == ["r0", "r1", "r2", "r0"]
    replicas.set_health("r1", False)
    picks = [policy.schedule(_req(i), replicas, 0.0).replica_id for i in range(3)]
    assert picks == ["r2", "r0", "r2"]


def test_session_policy_is_sticky_and_spreads_sessions(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"] * 4)
    policy = build_policy("session")
    homes = {
        s: {
            policy.schedule(_req(i, session_key=f"s{s}"), replicas, 0.0).replica_id
            for i in range(5)
        }
        for s in range(40)
    }
    assert all(len(h) == 1 for h in homes.values())
    spread = Counter(next(iter(h)) for h in homes.values())
    assert len(spread) == 4  # 40 sessions land on every replica


def test_random_and_power_of_two_are_deterministic_for_a_seed(make_replicas: Factory) -> None:
    for name in ("random", "power_of_two"):
        runs = []
        for _ in range(2):
            replicas = make_replicas(["a100-80g"] * 5)
            policy = build_policy(name, rng=Random(42))
            picks = []
            for i in range(30):
                d = policy.schedule(_req(i), replicas, 0.0)
                assert d.replica_id is not None
                replicas.on_dispatch(_req(i), d.replica_id, 0.0)
                picks.append(d.replica_id)
            runs.append(picks)
        assert runs[0] == runs[1]
        assert len(set(runs[0])) > 1


def test_sglang_switches_to_shortest_queue_when_imbalanced(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"] * 2, max_queue=1000)
    blocks = tuple(range(1, 11))
    replicas.on_dispatch(RequestView("warm", MODEL, 160, block_hashes=blocks), "r0", 0.0)
    policy = build_policy("sglang_cache_aware")
    hit = RequestView("hit", MODEL, 160, block_hashes=blocks)
    assert policy.schedule(hit, replicas, 0.0).replica_id == "r0"  # cache match > 0.3
    cold = RequestView("cold", MODEL, 160, block_hashes=tuple(range(100, 110)))
    assert policy.schedule(cold, replicas, 0.0).replica_id == "r1"  # smallest tree
    for i in range(70):  # r0: 71 in flight vs 0 > 64 and > 1.5x: imbalanced
        replicas.on_dispatch(RequestView(f"x{i}", MODEL, 16), "r0", 0.0)
    assert policy.schedule(hit, replicas, 0.0).replica_id == "r1"


def test_dynamo_trades_overlap_against_active_blocks(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"] * 2)
    blocks = tuple(range(1, 65))  # 64 blocks = 1024 tokens
    replicas.on_dispatch(RequestView("warm", MODEL, 1024, block_hashes=blocks), "r0", 0.0)
    policy = build_policy("dynamo_kv")
    request = RequestView("q", MODEL, 1024, block_hashes=blocks)
    # r0: 0 new prefill blocks + 64 active + 64; r1: 64 new + 0 active + 64.  Tie -> hash;
    # one more active block on r0 tips it to r1.
    replicas.on_dispatch(RequestView("more", MODEL, 16), "r0", 0.0)
    assert policy.schedule(request, replicas, 0.0).replica_id == "r1"
    replicas.on_complete("more", 0.0, ok=False)
    replicas.on_complete("warm", 0.0, ok=False)  # r0 keeps the cached blocks, frees KV
    assert policy.schedule(request, replicas, 0.0).replica_id == "r0"


def test_llmd_weights_prefix_over_queue_and_kv(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"] * 2)
    blocks = tuple(range(1, 21))
    replicas.on_dispatch(RequestView("warm", MODEL, 320, block_hashes=blocks), "r0", 0.0)
    decision = build_policy("llmd_default").schedule(
        RequestView("q", MODEL, 320, block_hashes=blocks), replicas, 0.0
    )
    assert decision.replica_id == "r0"  # 3 * 1.0 prefix + 2 * 0 queue > 2 * 1 queue
    assert decision.explanation is not None
    assert set(decision.explanation.scores) == {
        "queue-scorer",
        "kv-cache-utilization-scorer",
        "prefix-cache-scorer",
    }


def test_a_decision_shows_what_it_read_about_each_candidate_as_it_read_it(
    make_replicas: Factory,
) -> None:
    """Explanation.inputs: what the policy read (cached prompt tokens, queued and running
    requests, predicted TTFT), copied at the decision; nothing it did not read."""
    replicas = make_replicas(["a100-80g"] * 2)
    blocks = tuple(range(1, 21))  # 20 blocks = 320 tokens
    replicas.on_dispatch(RequestView("warm", MODEL, 320, block_hashes=blocks), "r0", 0.0)
    request = RequestView("q", MODEL, 320, block_hashes=blocks)
    decision = build_policy("equal_cost").schedule(request, replicas, 0.0)
    assert decision.explanation is not None
    rows = {row["replica_id"]: row["inputs"] for row in decision.explanation.top()}
    assert {r: (v["cached_tokens"], v["waiting"], v["running"]) for r, v in rows.items()} == {
        "r0": (320.0, 1.0, 0.0),  # holds the prompt, and the request that put it there
        "r1": (0.0, 0.0, 0.0),
    }
    assert all(inputs["predicted_ttft_ms"] > 0 for inputs in rows.values())
    replicas.on_dispatch(RequestView("more", MODEL, 16), "r1", 0.0)  # the state moves on
    again = {row["replica_id"]: row["inputs"] for row in decision.explanation.top()}
    assert again == rows
    # Round robin reads nothing about the replicas, so it shows nothing; least_request
    # reads the queues alone.
    for policy, read in (("round_robin", set()), ("least_request", {"waiting", "running"})):
        explained = build_policy(policy).schedule(request, replicas, 0.0).explanation
        assert explained is not None
        shown = [row.get("inputs", {}) for row in explained.top()]
        assert [set(inputs) for inputs in shown] == [read, read], policy


def test_builtin_profiles_round_trip_through_yaml() -> None:
    builtin = SchedulingConfig(policies=list(BUILTIN_POLICIES.values()))
    parsed = parse_scheduling_yaml(config_to_yaml(builtin), "builtin.yaml")
    assert [p.name for p in parsed.policies] == list(BUILTIN_POLICIES)
    assert parsed == builtin


def test_unknown_policy_names_the_valid_ones() -> None:
    with pytest.raises(UnknownEntryError) as err:
        build_policy("equal-costs")
    message = str(err.value)
    assert "'equal-costs'" in message
    for name in BUILTIN_POLICIES:
        assert name in message


def test_unknown_plugin_type_names_key_and_valid_types() -> None:
    text = "plugins:\n  - {name: x, type: magic-scorer}\n"
    with pytest.raises(UnknownEntryError) as err:
        parse_scheduling_yaml(text, "my.yaml")
    message = str(err.value)
    assert message.startswith("my.yaml: plugins[0].type: unknown plugin type 'magic-scorer'")
    for type_name in PLUGIN_TYPES:
        assert type_name in message


def test_unknown_scorer_reference_names_the_key() -> None:
    text = "policies:\n  - name: p\n    scorers: [{plugin: queue-scorer}, {plugin: nope}]\n"
    with pytest.raises(UnknownEntryError, match=r"policies\[0\]\.scorers\[1\]\.plugin"):
        parse_scheduling_yaml(text, "my.yaml")


def test_a_scorer_used_as_picker_is_rejected() -> None:
    text = "policies:\n  - {name: p, picker: queue-scorer}\n"
    with pytest.raises(UnknownEntryError, match=r"picker.*max-score-picker"):
        parse_scheduling_yaml(text, "my.yaml")


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("policies:\n  - {name: p, colour: red}\n", "colour"),
        ("plugins:\n  - {name: e, type: equal-cost-scorer, parameters: {lambda: 1}}\n", "lambda"),
        (
            "plugins:\n  - {name: e, type: equal-cost-scorer, parameters: {affinity_slack: -1}}\n"
            "policies:\n  - {name: p, scorers: [{plugin: e}]}\n",
            "affinity_slack",
        ),
        ("routes:\n  - {name: r, min_tokens: 3}\n", "min_tokens"),
        # numbers a check of "> 0" lets through, names references cannot tell apart
        (
            "policies:\n  - {name: p, scorers: [{plugin: queue-scorer, weight: .nan}]}\n",
            r"policies\[0\]\.scorers\[0\]\.weight: must be a finite",
        ),
        (
            "policies:\n  - {name: p, scorers: [{plugin: queue-scorer, weight: -1}]}\n",
            r"scorers\[0\]\.weight: must be >= 0",
        ),
        (
            "policies:\n  - {name: p, admission: {slo: true, retry_after_s: .nan}}\n",
            r"admission\.retry_after_s: must be a finite",
        ),
        ("policies:\n  - {name: p}\n  - {name: p}\n", r"policies\[1\]\.name: .*listed twice"),
        ("policies:\n  - {name: ''}\n", r"policies\[0\]\.name: .*must not be empty"),
        ("routes:\n  - {name: r, max_prompt_tokens: -5}\n", r"routes\[0\]\.max_prompt_tokens"),
    ],
)
def test_bad_keys_and_values_are_config_errors(text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        parse_scheduling_yaml(text, "my.yaml")


def test_each_policy_gets_its_own_stateful_plugins(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"] * 3)
    first, second = build_policy("round_robin"), build_policy("round_robin")
    assert first.schedule(_req(0), replicas, 0.0).replica_id == "r0"
    assert second.schedule(_req(0), replicas, 0.0).replica_id == "r0"


class _WildScorer:
    """Returns NaN, +inf, -inf and 0.5 for four candidates."""

    type_name: ClassVar[str] = "wild-scorer"

    def score(self, ctx: Context) -> FloatArray:
        return np.array([np.nan, np.inf, -np.inf, 0.5])[: ctx.idx.size]


def test_scores_are_clamped_nan_counting_as_zero(make_replicas: Factory) -> None:
    replicas = make_replicas(["a100-80g"] * 4)
    policy = Policy("wild", scorers=[("wild", _WildScorer(), 2.0)], picker=MaxScorePicker())
    decision = policy.schedule(RequestView("q", MODEL, 100), replicas, 0.0)
    assert decision.explanation is not None
    assert decision.explanation.scores["wild"].tolist() == [0.0, 1.0, 0.0, 0.5]
    assert decision.explanation.total.tolist() == [0.0, 2.0, 0.0, 1.0]
    assert decision.replica_id == "r1"


def test_every_peer_has_an_slo_twin_with_its_plugins_and_slo_admission() -> None:
    peers = [p for name, p in BUILTIN_POLICIES.items() if name != "equal_cost"]
    peers = [p for p in peers if p.name not in SLO_BASELINES]
    assert len(peers) == 9 and len(SLO_BASELINES) == len(peers)
    for peer in peers:
        twin = BUILTIN_POLICIES[f"{peer.name}_slo"]
        assert twin.name in SLO_BASELINES
        assert not peer.admission.slo and twin.admission.slo
        assert (twin.filters, twin.scorers, twin.picker) == (
            peer.filters,
            peer.scorers,
            peer.picker,
        )
        assert twin.description == f"{peer.description} + SLO admission"
        built = build_policy(twin.name)
        assert built.admission.slo and not build_policy(peer.name).admission.slo
