"""Gateway YAML: defaults, unknown keys and bad values rejected with the key named, and the
references ``serve`` and ``sim --config`` both resolve."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec
import pytest

from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError, IsocostError
from isocost.runtime.config import (
    GENERIC_PRIOR_MODEL,
    GatewayConfig,
    PoolConfig,
    ReplicaConfig,
    check_references,
    check_replica,
    normalize_replica_url,
    parse_config,
    priced_as_generic,
    replica_cost_model,
    replica_name,
)
from isocost.scheduling.policies import build_policy

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "gateway.yaml"


def test_minimal_config_has_defaults() -> None:
    config = parse_config(
        "pools:\n  - model: m\n    replicas: [{url: 'http://10.0.0.5:8000/'}]\n", "g.yaml"
    )
    replica = config.pools[0].replicas[0]
    assert (replica.gpu, replica.tp, replica.weight) == ("a100-80g", 1, 1.0)
    assert config.policy == "equal_cost" and config.scrape_interval_ms == 200
    assert config.limits.max_retries == 2 and config.auth.api_keys == []


def test_the_shipped_example_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ISOCOST_ADMIN_TOKEN", "TEAM_A_KEY", "TEAM_B_KEY"):
        monkeypatch.setenv(name, "x")
    config = parse_config(EXAMPLE.read_text(), str(EXAMPLE))
    assert config.pools and config.scheduling.policies
    for pool in config.pools:
        policy = build_policy(pool.policy or config.policy, config=config.scheduling)
        assert policy.name == (pool.policy or config.policy)


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        (
            "pools: [{model: m, replicas: [{url: 'http://a:1', gpuu: x}]}]",
            "pools[0].replicas[0]",
            "gpuu",
        ),
        ("limitz: {}", None, "limitz"),
        ("pools: [{model: m, replicas: [{url: 'ftp://a:1'}]}]", "pools[0].replicas[0].url", "http"),
        (
            "pools: [{model: m, replicas: [{url: 'http://a:1/v1'}]}]",
            "pools[0].replicas[0].url",
            "path",
        ),
        (
            "pools: [{model: m, replicas: [{url: 'http://a:1'}, {url: 'http://a:1/'}]}]",
            "pools[0].replicas[1].url",
            "twice",
        ),
        ("pools: [{model: m}, {model: m}]", "pools[1].model", "duplicate"),
        (
            "pools: [{model: m, replicas: [{url: 'http://a:1', weight: 0}]}]",
            "pools[0].replicas[0].weight",
            "> 0",
        ),
        (
            "pools: [{model: m, replicas: [{url: 'http://a:1', tp: 0}]}]",
            "pools[0].replicas[0].tp",
            ">= 1",
        ),
        (
            "pools: [{model: m, replicas: [{url: 'http://a:1', tensor_parallel: 2}]}]",
            "pools[0].replicas[0].tensor_parallel",
            "tensor_parallel was renamed tp",
        ),
        (
            "pools: [{model: m, replicas: [{url: 'http://a:1', name: x}]},"
            " {model: n, replicas: [{url: 'http://b:1', name: x}]}]",
            "pools[1].replicas[0].name",
            "'x' is listed twice",
        ),
        (
            "pools: [{model: m, replicas: [{url: 'http://a:1', name: 'b:1'}, {url: 'http://b:1'}]}]",
            "pools[0].replicas[1].name",
            "'b:1' is listed twice",
        ),
        (
            "pools: [{model: m, replicas: [{url: 'http://a:1', max_queue: 0}]}]",
            "pools[0].replicas[0].max_queue",
            ">= 1",  # 0 waiting allowed: a replica that never takes work
        ),
        (
            "pools: [{model: m, replicas: [{url: 'http://a:1', name: 'a/b'}]}]",
            "pools[0].replicas[0].name",
            "letters, digits",  # a name in an admin URL path
        ),
        (
            f"pools: [{{model: m, replicas: [{{url: 'http://a:1', name: {'n' * 254}}}]}}]",
            "pools[0].replicas[0].name",
            "1-253",  # past aiohttp's request-line limit, a name no admin call could reach
        ),
        ("pools: [{model: m, kv_link: wifi}]", "pools[0].kv_link", "infiniband"),
        ("pools: [{model: m, disaggregation: always}]", "pools[0].disaggregation", "pd"),
        ("limits: {max_body_bytes: 0}", "limits.max_body_bytes", "> 0"),
        # NaN passes "> 0" checks: a timeout that never fires
        ("limits: {idle_timeout_ms: .nan}", "limits.idle_timeout_ms", "finite"),
        ("limits: {queue_timeout_ms: .inf}", "limits.queue_timeout_ms", "finite"),
        ("pools: [{model: m, slo: {ttft_ms: .nan}}]", "pools[0].slo.ttft_ms", "finite"),
        ("health: {open_ms: .nan}", "health.open_ms", "finite"),
        ("scrape_interval_ms: .nan", "scrape_interval_ms", "finite"),
        (
            "auth: {api_keys: [{name: a, key: k1}, {name: a, key: k2}]}",
            "auth.api_keys[1].name",
            "listed twice",  # budgets and metrics go by the name
        ),
        ("limits: {max_tokens: many}", "limits.max_tokens", "int"),
        ("health: {min_success_rate: 2}", "health.min_success_rate", "[0, 1]"),
        ("auth: {api_keys: [{name: a}]}", "auth.api_keys[0]", "exactly one"),
        ("tracing: {otlp_endpoint: 'grpc://c:4317'}", "tracing.otlp_endpoint", "http://"),
        (
            "tracing: {otlp_endpoint: 'http://c:4318', sample_ratio: 2}",
            "tracing.sample_ratio",
            "[0, 1]",
        ),
        ("tracing: {otlp_endpoint: 'http://c:4318', color: red}", "color", "unknown"),
        (
            "auth: {api_keys: [{name: a, key: k, priority: 2, max_priority: 1}]}",
            "auth.api_keys[0].max_priority",
            "at least the key's priority",
        ),
        ("auth: {admin_token_env: ISOCOST_TEST_UNSET_VAR}", "auth.admin_token_env", "unset"),
        ("pools: [oops", None, "YAML"),
    ],
)
def test_errors_name_the_key(text: str, key: str | None, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "g.yaml")
    message = str(info.value)
    assert message.startswith("g.yaml")
    assert fragment in message
    if key is not None:
        assert key in message


@pytest.mark.parametrize(
    ("url", "normalized"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://host/", "http://host:80"),
        ("https://Host:8443", "https://host:8443"),
        ("http://[::1]:9000", "http://[::1]:9000"),
        ("http://vllm-0.vllm.default.svc.cluster.local:8000", None),
        ("http://engine_a:8000", None),  # Docker Compose service names may hold "_"
    ],
)
def test_replica_urls_are_normalized(url: str, normalized: str | None) -> None:
    assert normalize_replica_url(url) == (normalized or url)


@pytest.mark.parametrize(
    "url",
    [
        "http://user:pw@h:1",
        "http://h:1?x=1",
        "file:///etc/passwd",
        "http://:80",
        "http://h:99999",
        "http://h:0",  # once stored as port 80
        # shorthand IPv4 that resolvers may take and the HTTP client refuses at every try
        "http://127.1:8000",
        "http://2130706433:8000",
        "http://0:8000",
        "http://-h-:8000",
        "http://a..b:8000",
    ],
)
def test_bad_replica_urls(url: str) -> None:
    with pytest.raises(ValueError):
        normalize_replica_url(url)


def test_the_example_parses_without_its_secrets_when_asked() -> None:
    """The simulator reads the file but sends nothing: unset ``*_env`` variables are fine."""
    config = parse_config(EXAMPLE.read_text(), str(EXAMPLE), secrets=False)
    assert config.auth.admin_token_env == "ISOCOST_ADMIN_TOKEN"
    with pytest.raises(ConfigError, match="unset"):
        parse_config("auth: {admin_token_env: ISOCOST_TEST_UNSET_VAR}", "g.yaml")


def test_replica_name_defaults_to_host_and_port() -> None:
    config = parse_config("pools: [{model: m, replicas: [{url: 'http://H:80/'}]}]", "g.yaml")
    assert replica_name(config.pools[0].replicas[0]) == "h:80"


def test_the_shipped_example_resolves_its_references() -> None:
    config = parse_config(EXAMPLE.read_text(), str(EXAMPLE), secrets=False)
    check_references(config, Catalog.builtin())


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("pools: [{model: m, policy: nope}]", "unknown policy 'nope'"),
        ("policy: nope", "unknown policy 'nope'"),
        (
            "scheduling: {policies: [{name: p, scorers: [{plugin: no-such-scorer}]}]}",
            "no-such-scorer",
        ),
        ("pools: [{model: llama-3.1-8b, replicas: [{url: 'http://a:1', gpu: a101}]}]", "a101"),
        (
            "pools: [{model: m, replicas: [{url: 'http://a:1', cost_model: no-such-model}]}]",
            "no-such-model",
        ),
    ],
)
def test_unknown_references_are_errors(text: str, fragment: str) -> None:
    config = parse_config(text, "g.yaml")
    with pytest.raises(IsocostError, match=fragment):
        check_references(config, Catalog.builtin())


@pytest.mark.parametrize("text", ["", "\n", "# all commented out\n# pools: []\n"])
def test_an_empty_or_comment_only_file_is_the_empty_config(text: str) -> None:
    assert parse_config(text, "g.yaml") == GatewayConfig()


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"url": "ftp://a:1"}, "url"),
        ({"tp": 0}, "tp"),
        ({"weight": 0.0}, "weight"),
        ({"weight": math.nan}, "weight"),
        ({"max_queue": -1}, "max_queue"),
        ({"usd_per_hour": -0.5}, "usd_per_hour"),
        ({"usd_per_hour": math.inf}, "usd_per_hour"),
        ({"api_key_env": "ISOCOST_TEST_UNSET_VAR"}, "api_key_env"),
        ({"gpu": "a101"}, "gpu"),
        ({"cost_model": "no-such-model"}, "cost_model"),
    ],
)
def test_check_replica_names_the_field_as_the_file_would(
    fields: dict[str, Any], field: str
) -> None:
    replica = ReplicaConfig(**{"url": "http://a:1", **fields})
    with pytest.raises(ConfigError) as raised:
        check_replica(replica, "llama-3.1-8b", Catalog.builtin(), source="add", key="replica")
    assert raised.value.key == f"replica.{field}"
    # the file gets the very same check, under the entry's own key
    pool = PoolConfig(model="llama-3.1-8b", replicas=[replica])
    text = msgspec.yaml.encode(GatewayConfig(pools=[pool])).decode()
    with pytest.raises(ConfigError) as in_file:
        check_references(parse_config(text, "g.yaml"), Catalog.builtin())
    assert in_file.value.key == f"pools[0].replicas[0].{field}"


def test_check_replica_passes_a_good_entry() -> None:
    replica = ReplicaConfig(url="http://a:1", gpu="h100-80g", tp=2, usd_per_hour=3.0)
    check_replica(replica, "llama-3.1-8b", Catalog.builtin(), source="add", key="replica")


def test_a_served_model_in_no_catalog_is_priced_as_the_generic_prior() -> None:
    config = parse_config("pools: [{model: org/Unknown-7B, replicas: [{url: 'http://a:1'}]}]", "g")
    catalog = Catalog.builtin()
    check_references(config, catalog)  # routes rather than being refused
    replica = config.pools[0].replicas[0]
    assert priced_as_generic(replica, "org/Unknown-7B", catalog)
    assert replica_cost_model(replica, "org/Unknown-7B", catalog).model.id == GENERIC_PRIOR_MODEL
    assert not priced_as_generic(replica, "llama-3.1-8b", catalog)
    named = ReplicaConfig(url="http://a:1", cost_model="qwen2.5-7b")
    assert not priced_as_generic(named, "org/Unknown-7B", catalog)
