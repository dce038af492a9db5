"""Disaggregated serving in the pure engine: pulled prompt tokens after a preemption, held
KV blocks and their expiry, and the replica roles and links of the engine config."""

from __future__ import annotations

import dataclasses

import pytest

from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.core.errors import ConfigError
from isocost.engine import EngineEvent, EngineModel, RequestSpec
from isocost.engine.config import EngineReplicaConfig, Faults, parse_replica_spec
from isocost.engine.handoff import KvHandoffs, handoff_params
from isocost.prefix.hashing import token_block_hashes

CATALOG = Catalog.builtin()
PROMPT = list(range(2000))


def _model(num_blocks: int | None = None) -> EngineModel:
    cost = CostModel(CATALOG.model("llama-3.1-8b"), CATALOG.gpu("h100-80g"), 1)
    return EngineModel(cost, num_blocks=num_blocks)


def _drain(model: EngineModel) -> list[EngineEvent]:
    events: list[EngineEvent] = []
    while (t := model.next_event_time()) is not None:
        events += model.advance_to(t)
    return events


def test_held_blocks_count_as_used_until_pulled() -> None:
    model = _model()
    handoffs = KvHandoffs(model, hold_timeout_s=30.0)
    held = handoffs.hold("r1", 100, now_s=0.0)
    assert held is not None and len(held.block_ids) == 7  # ceil(100 / 16)
    assert model.pool.num_used == 7
    assert handoffs.pull("r1", now_s=1.0) == held
    assert model.pool.num_used == 0
    assert handoffs.pull("r1", now_s=1.0) is None  # once only


def test_held_blocks_expire_after_the_timeout() -> None:
    model = _model()
    handoffs = KvHandoffs(model, hold_timeout_s=30.0)
    handoffs.hold("early", 100, now_s=0.0)
    handoffs.hold("late", 100, now_s=10.0)
    assert handoffs.next_expiry_s() == 30.0
    assert handoffs.expire(29.9) == 0
    assert handoffs.expire(30.0) == 1
    assert handoffs.pull("early", now_s=30.0) is None
    assert len(handoffs) == 1 and model.pool.num_used == 7
    assert handoffs.pull("late", now_s=39.0) is not None
    assert handoffs.num_expired == 1


def test_holding_never_starves_the_largest_request() -> None:
    model = _model(num_blocks=600)  # the largest request (its whole context) needs all
    handoffs = KvHandoffs(model)
    assert handoffs.hold("r1", 100, now_s=0.0) is None
    assert model.pool.num_used == 0


def test_handoff_params_are_vllms_fields() -> None:
    held = KvHandoffs(_model()).hold("req-7", 40, now_s=0.0)
    assert held is not None
    params = handoff_params(held, "engine-a", "10.0.0.5", 8100, 2)
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [0, 1, 2],
        "remote_engine_id": "engine-a",
        "remote_request_id": "req-7",
        "remote_host": "10.0.0.5",
        "remote_port": 8100,
        "tp_size": 2,
        "remote_num_tokens": 40,
    }


def test_replica_spec_takes_role_and_link() -> None:
    default = EngineReplicaConfig("h100-80g", "llama-3.1-8b", 1, "llama-3.1-8b", None, Faults())
    resolved = default.with_overrides(parse_replica_spec("role=decode,link=infiniband"))
    assert dataclasses.astuple(resolved)[-2:] == ("decode", "infiniband")
    assert default.with_overrides(parse_replica_spec("tp=2")).role == "both"


@pytest.mark.parametrize(("text", "key"), [("role=producer", "role"), ("link=wifi", "link")])
def test_replica_spec_refuses_unknown_role_or_link(text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        parse_replica_spec(text)


def test_a_preempted_pull_recomputes_its_prompt() -> None:
    """Preemption frees the pulled KV with the blocks: re-admitted, the prompt is
    computed here (vLLM recomputes a preempted remote-prefilled request too)."""
    model = _model(num_blocks=20)  # 320 tokens: two 100 + 200 requests cannot both finish
    local = RequestSpec("local", 100, 200, tuple(token_block_hashes(PROMPT[:100], 16)))
    pulled = RequestSpec("pulled", 100, 200, (), kv_ready_tokens=100)
    model.submit(local, 0.0)
    state = model.submit(pulled, 0.0)
    assert state.num_kv_ready_tokens == 100
    _drain(model)
    assert state.num_preemptions >= 1 and state.num_kv_ready_tokens == 0
    assert state.num_output_tokens == 200
