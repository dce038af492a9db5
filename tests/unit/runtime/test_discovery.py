"""Discovery's pure parts: the registration record, the membership merge, the config."""

from __future__ import annotations

import pytest

from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError
from isocost.runtime.config import GatewayConfig, PoolConfig, ReplicaConfig, parse_config
from isocost.runtime.discovery.etcd import replicas_prefix
from isocost.runtime.discovery.membership import Membership
from isocost.runtime.discovery.records import Malformed, Registration, decode_registration
from isocost.runtime.etcd import prefix_end

MODEL = "llama-3.1-8b"


def record(name: str, port: int, **fields: object) -> Registration:
    return Registration(name=name, url=f"http://10.0.0.1:{port}", models=[MODEL], **fields)  # type: ignore[arg-type]


def test_a_record_round_trips_and_maps_to_a_replica_entry() -> None:
    original = record("a", 8000, gpu="h100-80g", tp=2, groups=["x"], weight=2.0)
    decoded = decode_registration(original.encode())
    assert decoded == original
    assert decoded.replica_config() == ReplicaConfig(
        url="http://10.0.0.1:8000", name="a", gpu="h100-80g", tp=2, weight=2.0, groups=["x"]
    )


def test_unknown_fields_are_tolerated_and_bad_records_say_why() -> None:
    newer = b'{"name": "a", "url": "http://h:1", "models": ["m"], "zone": "eu-1"}'
    assert isinstance(decode_registration(newer), Registration)
    for value, reason in [
        (b"{nope", "not JSON"),
        (b'{"name": "a", "models": ["m"]}', "url"),
        (b'{"name": "a", "url": "http://h:1", "models": ["m"], "tp": "two"}', "tp"),
        (b'{"name": "a", "url": "http://h:1", "models": ["m"], "state": "gone"}', "state"),
    ]:
        result = decode_registration(value)
        assert isinstance(result, Malformed) and reason in result.reason, result


def test_members_join_the_pool_of_their_model_or_a_new_one() -> None:
    base = GatewayConfig(
        pools=[PoolConfig(model=MODEL, replicas=[ReplicaConfig(url="http://s:1")])]
    )
    membership = Membership(Catalog.builtin())
    other = Registration(name="o", url="http://10.0.0.9:1", models=["qwen2.5-7b"])
    membership.replace("etcd", {"k/a": record("a", 8000), "k/o": other})
    merged, refused = membership.merge(base)
    assert refused == []
    assert [(p.model, [r.url for r in p.replicas]) for p in merged.pools] == [
        (MODEL, ["http://s:1", "http://10.0.0.1:8000"]),
        ("qwen2.5-7b", ["http://10.0.0.9:1"]),
    ]
    assert [m.key for m in membership.members] == ["k/a", "k/o"]


def test_clashes_and_bad_references_are_refused_once_per_reason() -> None:
    base = GatewayConfig(
        pools=[PoolConfig(model=MODEL, replicas=[ReplicaConfig(url="http://10.0.0.1:8000")])]
    )
    membership = Membership(Catalog.builtin())
    records = {
        "dup-of-file": record("x", 8000),
        "gpu": record("g", 8001, gpu="abacus-1"),
        "first": record("same", 8002),
        "second": record("same", 8003),
        "broken": Malformed("not JSON"),
        "fine": record("fine", 8004),
    }
    membership.replace("etcd", records)
    _, refused = membership.merge(base)
    assert sorted(r.key for r in refused) == ["broken", "dup-of-file", "gpu", "second"]
    assert [m.key for m in membership.members] == ["first", "fine"]  # in registration order
    _, again = membership.merge(base)
    assert again == []  # the same reasons: nothing new to log
    membership.replace("etcd", {**records, "gpu": record("g", 8001, gpu="a100-80g")})
    _, fixed = membership.merge(base)
    assert fixed == [] and "gpu" in [m.key for m in membership.members]
    membership.replace("etcd", records)
    _, broken_again = membership.merge(base)
    assert [r.key for r in broken_again] == ["gpu"]


def test_a_caller_may_refuse_a_url() -> None:
    membership = Membership(Catalog.builtin())
    membership.replace("etcd", {"k": record("a", 8000)})

    def refuse(url: str) -> None:
        raise ValueError(f"{url} is this gateway")

    _, refused = membership.merge(GatewayConfig(), refuse)
    assert [r.reason for r in refused] == ["http://10.0.0.1:8000 is this gateway"]


def test_providers_are_merged_in_name_order() -> None:
    membership = Membership(Catalog.builtin())
    membership.replace("kubernetes", {"k": record("a", 8000)})
    membership.replace("etcd", {"k": record("b", 8000)})
    membership.merge(GatewayConfig())
    assert [(m.provider, m.record.name) for m in membership.members] == [("etcd", "b")]


def test_discovery_config_is_checked_with_the_key_named() -> None:
    config = parse_config("discovery:\n  etcd: {endpoints: ['http://127.0.0.1:2379']}\n", "g")
    assert config.discovery.etcd is not None and config.discovery.etcd.prefix == "/isocost"
    for text, key in [
        ("discovery:\n  etcd: {endpoints: []}\n", "discovery.etcd.endpoints"),
        ("discovery:\n  etcd: {endpoints: ['tcp://h:1']}\n", "discovery.etcd.endpoints[0]"),
        ("discovery:\n  etcd: {endpoints: ['http://h:1'], prefix: x}\n", "discovery.etcd.prefix"),
        ("discovery:\n  etcd: {endpoints: ['http://h:1'], zone: a}\n", "discovery.etcd"),
        ("discovery:\n  kubernetes: {namespace: a}\n", "discovery.kubernetes"),
        ("discovery:\n  consul: {}\n", "discovery"),
    ]:
        with pytest.raises(ConfigError) as info:
            parse_config(text, "g")
        assert info.value.key == key, (text, info.value)


def test_key_ranges_cover_exactly_the_prefix() -> None:
    assert replicas_prefix("/isocost/") == "/isocost/replicas/"
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff") == b"\0"


def test_an_endpoint_slice_maps_ready_addresses_with_its_annotations() -> None:
    from isocost.runtime.config import KubernetesDiscoveryConfig
    from isocost.runtime.discovery.kubernetes import slice_records

    settings = KubernetesDiscoveryConfig(namespace="ns", service="vllm", port_name="http")
    endpoint_slice = {
        "metadata": {
            "name": "vllm-x",
            "namespace": "ns",
            "labels": {"isocost.io/gpu": "h100-80g"},
            "annotations": {"isocost.io/model": MODEL, "isocost.io/groups": "a,b"},
        },
        "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}],
        "endpoints": [
            {"addresses": ["10.1.0.5"], "conditions": {"ready": True},
             "targetRef": {"name": "pod-1"}},
            {"addresses": ["10.1.0.6"], "conditions": {"ready": False}},
            {"addresses": ["fd00::7"], "conditions": {}},
        ],
    }  # fmt: skip
    records = slice_records(endpoint_slice, settings)
    assert sorted(records) == ["ns/vllm-x/10.1.0.5:8000", "ns/vllm-x/[fd00::7]:8000"]
    first = records["ns/vllm-x/10.1.0.5:8000"]
    assert isinstance(first, Registration)
    assert (first.name, first.url, first.gpu, first.groups) == (
        "pod-1", "http://10.1.0.5:8000", "h100-80g", ["a", "b"]
    )  # fmt: skip
    no_model = {**endpoint_slice, "metadata": {"name": "s"}}
    reasons = [getattr(r, "reason", "") for r in slice_records(no_model, settings).values()]
    assert len(reasons) == 2 and all("model" in reason for reason in reasons)
    weight = {"isocost.io/model": MODEL, "isocost.io/weight": "heavy"}
    bad_weight = {**endpoint_slice, "metadata": {"name": "s", "annotations": weight}}
    (only,) = slice_records(bad_weight, settings).values()
    assert isinstance(only, Malformed) and "heavy" in only.reason
    no_port = slice_records({**endpoint_slice, "ports": []}, settings)
    assert [type(r) for r in no_port.values()] == [Malformed]
