"""The cluster file: expansion into replicas, and errors that name the file and the key;
a gateway config's pool as a cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError, UnknownEntryError
from isocost.runtime.config import parse_config
from isocost.sim import (
    gateway_cluster,
    gateway_pool,
    parse_cluster_yaml,
    resolve_cluster,
    served_model,
    uniform_cluster,
)

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "cluster.yaml"


def test_the_example_expands_into_named_heterogeneous_replicas() -> None:
    config = parse_cluster_yaml(EXAMPLE.read_text(), str(EXAMPLE))
    replicas = resolve_cluster(config, Catalog.builtin())
    assert [r.replica_id for r in replicas][:2] == ["a100-0", "a100-1"]
    assert len(replicas) == 16 and replicas[-1].replica_id == "l20-3"
    assert {r.cost_model.gpu.id for r in replicas} == {"a100-80g", "l20-48g"}
    assert served_model(config) == "llama-3.1-8b"
    assert [e.action for e in config.events] == ["slowdown", "fail", "recover"]


_ONE = "replicas: [{gpu: a100-80g, model: llama-3.1-8b}]"


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
        (f"{_ONE}\nnetwork_delay_ms: .inf", "network_delay_ms: must be a finite number"),
        (_ONE.replace("}", ", slowdown: .inf}"), "replicas[0].slowdown: must be a finite"),
        (_ONE.replace("}", ", slowdown: 0}"), "replicas[0].slowdown: must be in [0.001, 1000]"),
        (_ONE.replace("}", ", usd_per_hour: -1}"), "replicas[0].usd_per_hour: must be >= 0"),
        ("replicas: [{gpu: a100-80g, model: llama-3.1-8b, count: 100000}]", "[1, 10000]"),
        (
            "replicas: [{gpu: a100-80g, model: llama-3.1-8b, count: 6000},"
            " {gpu: l20-48g, model: llama-3.1-8b, count: 6000}]",
            "replicas: 12,000, beyond the limit of 10,000",
        ),
        (
            f"{_ONE}\nevents: [{{at_s: .nan, replica: llama-3.1-8b-a100-80g-tp1-0, action: fail}}]",
            "events[0].at_s: must be a finite number",
        ),
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


GATEWAY = Path(__file__).resolve().parents[3] / "examples" / "gateway.yaml"


def test_a_gateway_pool_becomes_its_replicas_by_name_with_the_gateway_limits() -> None:
    gateway = parse_config(GATEWAY.read_text(), str(GATEWAY), secrets=False)
    pool = gateway_pool(gateway, "llama-3.1-70b", str(GATEWAY))
    cluster, replicas = gateway_cluster(
        gateway, pool, Catalog.builtin(), str(GATEWAY), network_delay_ms=2.0
    )
    assert [r.replica_id for r in replicas] == ["h100x4-0", "h100x4-1"]
    assert {(r.cost_model.model.id, r.cost_model.tensor_parallel) for r in replicas} == {
        ("llama-3.1-70b", 4)
    }
    assert served_model(cluster) == "llama-3.1-70b" and cluster.network_delay_ms == 2.0
    limits = gateway.limits
    assert (cluster.queue_size, cluster.queue_timeout_ms, cluster.max_retries) == (
        limits.max_queue,
        limits.queue_timeout_ms,
        limits.max_retries,
    )
    pool = gateway_pool(gateway, "llama-3.1-8b", str(GATEWAY))
    _, replicas = gateway_cluster(gateway, pool, Catalog.builtin(), str(GATEWAY))
    fast, _a100, l20 = replicas
    assert fast.groups == frozenset({"fast"}) and (l20.weight, l20.usd_per_hour) == (0.5, 0.9)


def test_a_gateway_file_with_several_pools_needs_one_named() -> None:
    gateway = parse_config(GATEWAY.read_text(), str(GATEWAY), secrets=False)
    with pytest.raises(ConfigError, match="name the one to simulate with --pool"):
        gateway_pool(gateway, None, "g.yaml")
    with pytest.raises(UnknownEntryError, match="--pool: unknown pool 'x'"):
        gateway_pool(gateway, "x", "g.yaml")


def test_a_gateway_pool_with_roles_is_simulated_as_the_gateway_splits_it() -> None:
    text = """
pools:
  - model: llama-3.1-8b
    disaggregation: pd
    kv_link: roce
    replicas:
      - {url: 'http://10.0.0.1:8000', name: p0, gpu: h100-80g, role: prefill}
      - {url: 'http://10.0.0.2:8000', name: d0, gpu: h100-80g, role: decode}
  - model: llama-3.1-70b
    disaggregation: pd
    replicas:
      - {url: 'http://10.0.0.3:8000', name: whole, gpu: h100-80g, tp: 4}
"""
    gateway = parse_config(text, "g.yaml", secrets=False)
    split, replicas = gateway_cluster(
        gateway, gateway_pool(gateway, "llama-3.1-8b", "g.yaml"), Catalog.builtin(), "g.yaml"
    )
    assert (split.disaggregation, split.link) == ("pd", "roce")
    assert [(r.replica_id, r.role) for r in replicas] == [("p0", "prefill"), ("d0", "decode")]
    whole, _ = gateway_cluster(
        gateway, gateway_pool(gateway, "llama-3.1-70b", "g.yaml"), Catalog.builtin(), "g.yaml"
    )
    assert whole.disaggregation is None  # every replica does both: never split, as live
