"""The cluster file: expansion into replicas, and errors that name the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError, UnknownEntryError
from isocost.sim import parse_cluster_yaml, resolve_cluster, served_model, uniform_cluster

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "cluster.yaml"


def test_the_example_expands_into_named_heterogeneous_replicas() -> None:
    config = parse_cluster_yaml(EXAMPLE.read_text(), str(EXAMPLE))
    replicas = resolve_cluster(config, Catalog.builtin())
    assert [r.replica_id for r in replicas][:2] == ["a100-0", "a100-1"]
    assert len(replicas) == 16 and replicas[-1].replica_id == "l20-3"
    assert {r.cost_model.gpu.id for r in replicas} == {"a100-80g", "l20-48g"}
    assert served_model(config) == "llama-3.1-8b"
    assert [e.action for e in config.events] == ["slowdown", "fail", "recover"]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("replicas: [{gpu: a100-80g, model: llama-3.1-8b, colour: red}]", "colour"),
        ("replicas: []", "replicas"),
        ("replicas: [{gpu: a100-80g, model: llama-3.1-8b, count: 0}]", "replicas[0].count"),
        ("replicas: [{gpu: a100-80g, model: llama-3.1-8b}]\nnetwork_delay_ms: -1", "network"),
        (
            "replicas: [{gpu: a100-80g, model: llama-3.1-8b}]\n"
            "events: [{at_s: 1, replica: nope, action: fail}]",
            "events[0].replica: unknown replica 'nope'; valid: llama-3.1-8b-a100-80g-tp1-0",
        ),
        (
            "replicas: [{gpu: a100-80g, model: llama-3.1-8b}]\n"
            "events: [{at_s: 1, replica: llama-3.1-8b-a100-80g-tp1-0, action: explode}]",
            "action",
        ),
        ("replicas: [{gpu: a100-80g", "not valid YAML"),
    ],
)
def test_bad_cluster_files_are_named_with_the_key(text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_cluster_yaml(text, "c.yaml")
    message = str(caught.value)
    assert message.startswith("c.yaml") and needle in message


def test_unknown_gpu_lists_the_catalog() -> None:
    config = uniform_cluster(2, "a100-81g", "llama-3.1-8b", 1)
    with pytest.raises(UnknownEntryError, match="a100-80g"):
        resolve_cluster(config, Catalog.builtin())


def test_a_model_that_does_not_fit_is_an_error() -> None:
    config = uniform_cluster(1, "rtx4090-24g", "llama-3.1-70b", 1)
    with pytest.raises(ConfigError, match="does not fit"):
        resolve_cluster(config, Catalog.builtin())
