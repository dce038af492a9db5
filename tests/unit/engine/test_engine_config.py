"""Replica specs: strings, YAML files, defaults, and errors that name the key."""

from __future__ import annotations

import pytest

from isocost.core.errors import ConfigError
from isocost.engine.config import (
    EngineReplicaConfig,
    Faults,
    parse_replica_spec,
    parse_replicas_yaml,
    resolve_replicas,
)

DEFAULT = EngineReplicaConfig("h100-80g", "llama-3.1-8b", 1, "llama-3.1-8b", None, Faults())


def test_spec_strings_override_the_defaults_field_by_field() -> None:
    (spec,) = resolve_replicas(DEFAULT, 1, ["gpu=l40s-48g, tp=2, slowdown=3"])
    assert (spec.gpu, spec.model, spec.tp, spec.faults.slowdown) == (
        "l40s-48g",
        "llama-3.1-8b",
        2,
        3.0,
    )


def test_a_new_model_is_served_under_its_own_name_unless_named() -> None:
    a, b = resolve_replicas(
        DEFAULT, 1, ["model=qwen2.5-7b", "model=qwen2.5-7b,served_model_name=q"]
    )
    assert (a.served_model_name, b.served_model_name) == ("qwen2.5-7b", "q")


def test_yaml_entries_come_first_and_copies_fill_without_specs() -> None:
    text = "replicas:\n  - {gpu: a100-80g, max_waiting: 4}\n  - {num_gpu_blocks: 64}\n"
    specs = resolve_replicas(DEFAULT, 1, ["tp=4"], text, "r.yaml")
    assert [s.gpu for s in specs] == ["a100-80g", "h100-80g", "h100-80g"]
    assert specs[0].faults.max_waiting == 4 and specs[1].num_gpu_blocks == 64
    assert specs[2].tp == 4
    assert resolve_replicas(DEFAULT, 3, []) == [DEFAULT] * 3


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpu", "expected key=value"),
        ("colour=red", "colour"),
        ("tp=two", "tp"),
        ("tp=0", "tp: must be >= 1"),
        ("error_rate=2", "error_rate: must be between 0 and 1"),
    ],
)
def test_bad_spec_strings_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_replica_spec(text)


def test_bad_yaml_names_the_file_and_entry() -> None:
    with pytest.raises(ConfigError, match=r"r.yaml.*gpus"):
        parse_replicas_yaml("replicas:\n  - {gpus: x}\n", "r.yaml")
    with pytest.raises(ConfigError, match=r"r.yaml: replicas\[1\]: slowdown"):
        parse_replicas_yaml("replicas: [{}, {slowdown: 0}]", "r.yaml")
    with pytest.raises(ConfigError, match="no replicas"):
        parse_replicas_yaml("replicas: []", "r.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_replicas_yaml("replicas: [", "r.yaml")


def test_replica_count_must_match_the_specs() -> None:
    with pytest.raises(ConfigError, match="--replicas"):
        resolve_replicas(DEFAULT, 3, ["tp=1", "tp=2"])
