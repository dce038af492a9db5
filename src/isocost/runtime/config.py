"""The gateway's YAML configuration, decoded with msgspec (unknown keys are errors).

``isocost serve`` runs it and ``isocost sim --config`` simulates it as is (the pools,
replicas, scheduling section and queue limits), so both read it here, below either.

A full file, every key optional except ``pools[].model`` and ``replicas[].url``::

    policy: equal_cost                # default policy profile for pools that name none
    scrape_interval_ms: 200           # replica /metrics scrape period
    pools:
      - model: llama-3.1-8b           # the model name clients send
        policy: equal_cost            # a scheduling policy name
        tokenizer: /models/llama/     # tokenizer.json (or its folder): exact prompt tokens
        disaggregation: conditional   # colocated | pd | conditional: with prefill-role
                                      # replicas, split a request into a prefill on P and
                                      # its decode on D (always, or where cheaper)
        kv_link: infiniband           # nvlink | infiniband | roce | tcp: P -> D KV pulls
        shadow:                       # candidate policies evaluated beside the running one
          policies: [equal_cost]      # their decisions are computed, never acted on
          interval_s: 60              # a twin replay of the recent window this often
          window_s: 300               # ... of the requests finished in the last window_s
          max_requests: 2000          # ... at most this many (the latest)
          min_requests: 50            # fewer in the window: the replay is skipped
          timeout_s: 120              # a replay running longer is killed (failed)
        replicas:
          - url: http://10.0.0.5:8000
            name: a100-0              # defaults to host:port
            gpu: a100-80g             # catalog GPU id, for the cost model
            cost_model: llama-3.1-8b  # catalog model id or HF config path (default: pool model)
            tp: 1                     # tensor-parallel GPUs (formerly tensor_parallel)
            weight: 1.0               # relative capacity share, > 0
            usd_per_hour: 1.8         # default: the catalog price x tp
            api_key_env: ENGINE_KEY   # bearer token the replica expects, read from the env
            groups: [a100]            # route groups it belongs to (see routes)
            max_queue: 128            # engine-waiting requests beyond which it takes no work
            role: both                # prefill | decode | both (P/D disaggregation)
            kv_events: tcp://10.0.0.5:5557  # the engine's KV-cache event publisher (vLLM's
                                      # --kv-events-config endpoint): evictions known
    scheduling:                       # isocost.scheduling.policies' config: plugin instances,
      policies:                       # policy profiles (added to the built-ins) and routes
        - name: cost_with_affinity
          scorers: [{plugin: equal-cost-scorer, weight: 1.0},
                    {plugin: session-affinity-scorer, weight: 0.2}]
          admission: {slo: true}
      routes:                         # route classes; first match wins, or x-isocost-class
        - {name: long-context, min_prompt_tokens: 32000, groups: [[h200], []]}
    limits:
      max_body_bytes: 4194304
      max_prompt_tokens: 131072
      max_tokens: 32768
      connect_timeout_ms: 1000
      body_timeout_ms: 30000          # to receive a request's headers, and its body (408)
      keepalive_timeout_ms: 30000     # an idle client connection is closed (read at start)
      idle_timeout_ms: 60000          # until a stream's headers, and between two chunks
      total_timeout_ms: 1800000       # whole request, suits long streams
      max_response_bytes: 67108864    # a replica's whole answer (or one stream line); 502 beyond
      max_retries: 2
      retry_backoff_ms: 20
      max_queue: 1024                 # gateway queue per pool (requests waiting for a replica)
      queue_timeout_ms: 30000         # longest wait there when the request has no deadline
    health:
      interval_ms: 500
      timeout_ms: 1000
      failure_threshold: 3            # consecutive failures that open the circuit
      min_success_rate: 0.5           # over the last window_size outcomes
      window_size: 20
      open_ms: 1000                   # first cool-down; doubles per failed probe, max 30 s
    auth:
      admin_token_env: ISOCOST_ADMIN_TOKEN
      api_keys:
        - name: team-a                # what logs and metrics show; the key never is
          key_env: TEAM_A_KEY
          requests_per_minute: 600
          tokens_per_minute: 200000
    discovery:                        # replicas that register themselves, beside pools
      max_replicas: 1024              # per provider: past it, registrations are ignored
      etcd:                           # `isocost agent` registrations (see runtime.discovery)
        endpoints: [http://10.0.0.2:2379]
        prefix: /isocost              # keys <prefix>/replicas/<name>
        timeout_ms: 2000              # per etcd call
        probe_interval_ms: 1000       # liveness probe of etcd while the watch is idle
        max_backoff_ms: 5000          # longest wait between reconnection attempts
        tls: {ca_file: /etc/etcd/ca.pem, cert_file: /etc/etcd/client.pem,
              key_file: /etc/etcd/client.key}  # https:// endpoints: as upstream_tls
      kubernetes:                     # ready endpoints of EndpointSlices, isocost.io/* annotations
        namespace: inference
        service: vllm                 # or label_selector: app=vllm, or inference_pool: NAME
                                      # (its selector's ready Pods on its targetPorts)
        port_name: http               # or port: 8000 (default: the slice's first port)
        model: llama-3.1-8b           # default: the isocost.io/model annotation
        kubeconfig: ~/.kube/config    # default: in-cluster, else the default kubeconfig
    state_bus:                        # gateways sharing their in-flight view (runtime.bus)
      url: redis://10.0.0.3:6379      # or nats://10.0.0.3:4222; or --state-bus URL; read
                                      # at start
      channel: isocost:state          # gateways of one cluster share a channel
      heartbeat_ms: 500               # liveness and view publication period
      peer_timeout_ms: 2000           # a peer silent this long is forgotten; the bus too
      max_backoff_ms: 2000            # longest wait between reconnection attempts
    upstream_tls:                     # TLS to https:// replicas (probes, scrapes, requests);
      ca_file: /etc/isocost/ca.pem    # the CA their certificates chain to (default: the
                                      # system's store); read at start
      cert_file: /etc/isocost/gw.pem  # a client certificate, where they require one (mTLS)
      key_file: /etc/isocost/gw.key   # its key (default: in cert_file)
    tracing:                          # OpenTelemetry spans of each request (gateway.tracing)
      otlp_endpoint: http://otel-collector:4318  # OTLP/HTTP; read at start
      service_name: isocost-gateway
      sample_ratio: 1.0               # of the traces the gateway starts itself

Secrets are read from environment variables (``*_env``) or given inline (``admin_token``,
``key``) for tests; they never appear in logs.

Replica names (``name``, else ``host:port``) are unique across the file. Beyond the file's
own shape, ``check_references`` resolves what it names in the registries (policies and
their plugins, catalog GPUs and models): ``serve`` and ``sim --config`` call both, so a bad
file gets the same one-line error from either.
"""

from __future__ import annotations

import math
import os
import re
from urllib.parse import urlsplit

import msgspec

from isocost.core.bounds import NON_NEGATIVE, POSITIVE, SHARE, check_fields
from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.core.errors import ConfigError, IsocostError
from isocost.core.hosts import is_host, is_port
from isocost.core.links import LINK_KINDS
from isocost.core.slo import SloTargets
from isocost.files import is_model_path, resolve_model
from isocost.scheduling.contract import Role
from isocost.scheduling.disagg import DisaggMode
from isocost.scheduling.policies import SchedulingConfig, build_policy

__all__ = [
    "GENERIC_PRIOR_MODEL",
    "MAX_DISCOVERED_REPLICAS",
    "ApiKeyConfig",
    "AuthConfig",
    "DiscoveryConfig",
    "EtcdDiscoveryConfig",
    "GatewayConfig",
    "HealthConfig",
    "KubernetesDiscoveryConfig",
    "LimitsConfig",
    "PoolConfig",
    "ReplicaConfig",
    "ShadowConfig",
    "SloConfig",
    "StateBusConfig",
    "TracingConfig",
    "check_references",
    "check_replica",
    "check_state_bus",
    "normalize_replica_url",
    "parse_config",
    "priced_as_generic",
    "redacted",
    "replica_cost_model",
    "replica_name",
]

# The shape a served model in no catalog is priced as until calibration corrects it: a
# mid-size dense model, so that neither its prefill nor its decode starts out negligible.
GENERIC_PRIOR_MODEL = "llama-3.1-8b"
_ZMQ_ENDPOINT = re.compile(r"tcp://[^\s:/]+:\d{1,5}|ipc://\S+")
# A name goes into admin URL paths, Prometheus labels and logs: no slash or space, and no
# longer than a Kubernetes pod name (253), whose names discovery gives replicas.
_REPLICA_NAME = re.compile(r"[A-Za-z0-9._:@\[\]-]{1,253}")
# The GPUs one replica may span: eight nodes of eight, twice the largest single replicas
# served today (DeepSeek-V3/R1 or Llama-3.1-405B over two to four 8-GPU nodes). A larger
# tp is a typo or a hostile record: the cost model would price the replica as nearly free
# and send it all the traffic.
_MAX_TP = 64
# The replicas one discovery provider may add by default: the largest fleet the scheduling
# benchmarks measure (1,024). Past it, a scrape, a probe, a prefix index and a shadow row
# per replica would melt the gateway down on one wrong selector or a registration loop,
# instead of leaving it routing to the replicas it has.
MAX_DISCOVERED_REPLICAS = 1024


class ReplicaConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    url: str
    name: str | None = None
    gpu: str = "a100-80g"
    cost_model: str | None = None
    tp: int = 1
    weight: float = 1.0
    usd_per_hour: float | None = None
    api_key_env: str | None = None
    groups: list[str] = []
    max_queue: int = 128
    kv_events: str | None = None  # ZMQ endpoint of the engine's KV-cache event publisher
    role: Role = "both"  # prefill/decode disaggregation (``scheduling.contract.Role``)


class SloConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A pool's service-level objective, judged per answer (``core.slo``): a request's
    ``x-deadline-ms`` / ``x-tpot-ms`` (or llm-d's SLO headers) replace these for it."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    ttft_per_1k_ms: float = 0.0

    def targets(self) -> SloTargets:
        return SloTargets.from_ms(self.ttft_ms, self.tpot_ms, self.ttft_per_1k_ms)


class ShadowConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Candidate policies a pool evaluates beside its running one (``gateway.shadow``):
    decisions computed per request, and a twin replay of the recent traffic."""

    policies: list[str]
    interval_s: float = 60.0
    window_s: float = 300.0
    max_requests: int = 2000
    min_requests: int = 50
    timeout_s: float = 120.0


class PoolConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    model: str
    replicas: list[ReplicaConfig] = []
    policy: str | None = None
    resume: bool = True  # a stream broken mid-way goes on on another replica
    tokenizer: str | None = None  # tokenizer.json, or a folder holding one
    slo: SloConfig | None = None  # per-answer verdicts in isocost_slo_requests_total
    disaggregation: str = DisaggMode.CONDITIONAL.value  # ``DisaggMode``: with P/D roles
    kv_link: str = "tcp"  # the link kind KV hand-offs travel (``core.links``)
    shadow: ShadowConfig | None = None  # candidate policies evaluated, never acted on


class LimitsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    max_body_bytes: int = 4 * 1024 * 1024
    max_prompt_tokens: int = 131072
    max_tokens: int = 32768
    connect_timeout_ms: float = 1000
    body_timeout_ms: float = 30000
    keepalive_timeout_ms: float = 30000
    idle_timeout_ms: float = 60000
    total_timeout_ms: float = 1_800_000
    max_response_bytes: int = 64 * 1024 * 1024
    max_retries: int = 2
    retry_backoff_ms: float = 20
    max_queue: int = 1024
    queue_timeout_ms: float = 30000


class HealthConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    interval_ms: float = 500
    timeout_ms: float = 1000
    failure_threshold: int = 3
    min_success_rate: float = 0.5
    window_size: int = 20
    open_ms: float = 1000


class ApiKeyConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    key: str | None = None
    key_env: str | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    priority: int = 0  # of its requests that send no x-priority
    max_priority: int | None = None  # the highest x-priority it may send (None: priority)
    max_in_flight: int | None = None  # its requests at once, over every gateway on the bus


class AuthConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    admin_token: str | None = None
    admin_token_env: str | None = None
    api_keys: list[ApiKeyConfig] = []


class TlsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """PEM files for a TLS client (``runtime.tls``): the CA the server's certificate
    chains to (default: the system's store), and a client certificate where the server
    requires one (its key in ``key_file`` or in ``cert_file``)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None


class EtcdDiscoveryConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    endpoints: list[str]
    prefix: str = "/isocost"
    timeout_ms: float = 2000
    probe_interval_ms: float = 1000
    max_backoff_ms: float = 5000
    tls: TlsConfig = TlsConfig()  # for https:// endpoints


# A Kubernetes object name (DNS-1123 subdomain): what a ``metadata.name=`` field selector holds.
_OBJECT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class KubernetesDiscoveryConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    namespace: str = "default"
    service: str | None = None
    label_selector: str | None = None
    # The InferencePool (inference.networking.k8s.io/v1) whose selector picks the pods and
    # whose targetPorts give their ports; instead of service/label_selector and port.
    inference_pool: str | None = None
    port: int | None = None
    port_name: str | None = None
    model: str | None = None
    kubeconfig: str | None = None
    max_backoff_ms: float = 5000


class DiscoveryConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    max_replicas: int = MAX_DISCOVERED_REPLICAS  # per provider
    etcd: EtcdDiscoveryConfig | None = None
    kubernetes: KubernetesDiscoveryConfig | None = None


class StateBusConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    url: str
    channel: str = "isocost:state"
    heartbeat_ms: float = 500
    peer_timeout_ms: float = 2000
    max_backoff_ms: float = 2000


class TracingConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """OpenTelemetry traces of the gateway's requests, sent over OTLP/HTTP (JSON)."""

    otlp_endpoint: str  # the collector's base URL; spans go to <endpoint>/v1/traces
    service_name: str = "isocost-gateway"
    sample_ratio: float = 1.0  # of traces the gateway starts; a caller's decision is kept


class CalibrationConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # Fit each replica's prefill terms (per chunk, token, attention pair and request) to
    # its TTFTs instead of one TTFT factor (``scheduling.prefillfit``).
    prefill_fit: bool = False


class GatewayConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    pools: list[PoolConfig] = []
    policy: str = "equal_cost"
    scrape_interval_ms: float = 200
    scheduling: SchedulingConfig = SchedulingConfig()
    limits: LimitsConfig = LimitsConfig()
    health: HealthConfig = HealthConfig()
    auth: AuthConfig = AuthConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    state_bus: StateBusConfig | None = None
    calibration: CalibrationConfig = CalibrationConfig()
    upstream_tls: TlsConfig = TlsConfig()
    tracing: TracingConfig | None = None


_PATH_RE = re.compile(r"\$((?:\.[A-Za-z_]\w*|\[\d+\])+)")
_UNKNOWN_RE = re.compile(r"unknown field `(\w+)`")
_RENAMED = {"tensor_parallel": "tp"}  # old key -> its name now


def _key_of(message: str) -> str | None:
    """msgspec's ``$.pools[0].replicas[1].gpu`` path as ``pools[0].replicas[1].gpu``."""
    found = _PATH_RE.search(message)
    return found.group(1).lstrip(".") if found else None


def normalize_replica_url(url: str) -> str:
    """``http(s)://host:port`` with no path, query or credentials; ValueError otherwise."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{url!r} must start with http:// or https://")
    if not parts.hostname or parts.username or parts.password:
        raise ValueError(f"{url!r} must name a host and no credentials")
    if parts.query or parts.fragment or parts.path not in ("", "/"):
        raise ValueError(f"{url!r} must be scheme://host:port only, without a path")
    if not is_host(parts.hostname):
        raise ValueError(f"{url!r} must name a DNS host name or an IP address")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{url!r} has an invalid port") from None
    if port == 0:
        raise ValueError(f"{url!r} has an invalid port")
    port = port or (443 if parts.scheme == "https" else 80)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{port}"


def replica_name(replica: ReplicaConfig) -> str:
    """The replica's name: ``name``, else the ``host:port`` of its URL."""
    if replica.name:
        return replica.name
    parts = urlsplit(normalize_replica_url(replica.url))
    return f"{parts.hostname}:{parts.port}"


def parse_config(text: str, source: str, *, secrets: bool = True) -> GatewayConfig:
    """Decode and check ``text``; a ConfigError names ``source`` and the offending key.
    ``secrets``: also require every ``*_env`` variable to be set (the simulator, which
    sends nothing anywhere, passes False)."""
    try:
        # an empty or comment-only file is the empty mapping
        config = msgspec.yaml.decode(text or "{}", type=GatewayConfig | None) or GatewayConfig()
    except msgspec.ValidationError as exc:
        key = _key_of(str(exc))
        unknown = _UNKNOWN_RE.search(str(exc))
        if unknown is not None and unknown.group(1) in _RENAMED:
            old = unknown.group(1)
            where = f"{key}.{old}" if key else old
            raise ConfigError(source, f"{old} was renamed {_RENAMED[old]}", key=where) from None
        raise ConfigError(source, str(exc), key=key) from None
    except msgspec.DecodeError as exc:
        raise ConfigError(source, f"not valid YAML: {exc}") from None
    _check(config, source, secrets)
    return config


def priced_as_generic(replica: ReplicaConfig, pool_model: str, catalog: Catalog) -> bool:
    """Whether ``replica`` serves a model that is in no catalog and no local folder, with no
    ``cost_model`` named: it is priced as ``GENERIC_PRIOR_MODEL`` and calibration (pooled
    per hardware class) learns how far off that is, rather than the replica being refused."""
    return (
        replica.cost_model is None
        and pool_model.lower() not in catalog.models
        and not is_model_path(pool_model)
    )


def replica_cost_model(replica: ReplicaConfig, pool_model: str, catalog: Catalog) -> CostModel:
    """The cost model of ``replica``: its ``cost_model`` (else its pool's model, else the
    generic prior: ``priced_as_generic``) on ``tp`` of its GPU; an unknown ``cost_model``
    or GPU names the valid ones."""
    if priced_as_generic(replica, pool_model, catalog):
        model = catalog.model(GENERIC_PRIOR_MODEL)
    else:
        model = resolve_model(replica.cost_model or pool_model, catalog)
    return CostModel(model, catalog.gpu(replica.gpu), replica.tp)


def check_references(config: GatewayConfig, catalog: Catalog, source: str = "config") -> None:
    """Raise IsocostError if ``config`` names an unknown policy, plugin or cost model."""
    names = {p.name for p in config.scheduling.policies} | {config.policy}
    names.update(pool.policy for pool in config.pools if pool.policy)
    names.update(name for pool in config.pools if pool.shadow for name in pool.shadow.policies)
    for name in sorted(names):
        build_policy(name, config=config.scheduling, source="scheduling")
    for i, pool in enumerate(config.pools):
        for j, replica in enumerate(pool.replicas):
            _check_replica_references(
                replica, pool.model, catalog, source, f"pools[{i}].replicas[{j}]"
            )


def check_replica(
    replica: ReplicaConfig, pool_model: str, catalog: Catalog, *, source: str, key: str
) -> None:
    """Every check the config file makes of one replica entry (``parse_config``'s and
    ``check_references``'), for one added at run time: a ConfigError naming ``key``.field.
    Uniqueness among the replicas already running is the caller's to check."""
    _check_replica_fields(replica, source, key, secrets=True)
    _check_replica_references(replica, pool_model, catalog, source, key)


def _check_replica_fields(replica: ReplicaConfig, source: str, key: str, *, secrets: bool) -> None:
    def bad(field: str, message: str) -> ConfigError:
        return ConfigError(source, message, key=f"{key}.{field}")

    try:
        normalize_replica_url(replica.url)
    except ValueError as exc:
        raise bad("url", str(exc)) from None
    if replica.tp < 1:
        raise bad("tp", "must be >= 1")
    if replica.tp > _MAX_TP:
        raise bad("tp", f"must be <= {_MAX_TP} (the GPUs one replica spans)")
    if not replica.weight > 0 or not math.isfinite(replica.weight):
        raise bad("weight", "must be > 0")
    if replica.max_queue < 1:
        raise bad("max_queue", "must be >= 1 (a replica takes work while fewer wait)")
    if replica.name is not None and not _REPLICA_NAME.fullmatch(replica.name):
        raise bad("name", "must be 1-253 letters, digits and . _ : @ [ ] -")
    usd = replica.usd_per_hour
    if usd is not None and (not usd >= 0 or not math.isfinite(usd)):
        raise bad("usd_per_hour", "must be >= 0")
    env = replica.api_key_env
    if secrets and env is not None and env not in os.environ:
        raise bad("api_key_env", f"environment variable {env} unset")
    events = replica.kv_events
    if events is not None and not _ZMQ_ENDPOINT.fullmatch(events):
        raise bad("kv_events", "must be a ZMQ endpoint tcp://HOST:PORT or ipc://PATH")


def _check_replica_references(
    replica: ReplicaConfig, pool_model: str, catalog: Catalog, source: str, key: str
) -> None:
    try:
        catalog.gpu(replica.gpu)
    except IsocostError as exc:
        raise ConfigError(source, str(exc), key=f"{key}.gpu") from None
    try:
        replica_cost_model(replica, pool_model, catalog)
    except IsocostError as exc:
        raise ConfigError(source, str(exc), key=f"{key}.cost_model") from None


def _check(config: GatewayConfig, source: str, secrets: bool) -> None:
    def bad(key: str, message: str) -> ConfigError:
        return ConfigError(source, message, key=key)

    seen_models: set[str] = set()
    seen_urls: set[str] = set()
    seen_names: set[str] = set()
    for i, pool in enumerate(config.pools):
        if pool.model in seen_models:
            raise bad(f"pools[{i}].model", f"duplicate pool for model {pool.model!r}")
        seen_models.add(pool.model)
        if pool.slo is not None:
            if pool.slo.ttft_ms is None and pool.slo.tpot_ms is None:
                raise bad(f"pools[{i}].slo", "give ttft_ms, tpot_ms or both")
            check_fields(pool.slo, _SLO_BOUNDS, source, f"pools[{i}].slo")
        modes = [mode.value for mode in DisaggMode]
        if pool.disaggregation not in modes:
            raise bad(f"pools[{i}].disaggregation", f"must be one of {', '.join(modes)}")
        if pool.kv_link not in LINK_KINDS:
            raise bad(f"pools[{i}].kv_link", f"must be one of {', '.join(LINK_KINDS)}")
        if pool.shadow is not None:
            _check_shadow(pool.shadow, pool.policy or config.policy, source, f"pools[{i}].shadow")
        for j, replica in enumerate(pool.replicas):
            key = f"pools[{i}].replicas[{j}]"
            _check_replica_fields(replica, source, key, secrets=secrets)
            url = normalize_replica_url(replica.url)
            if url in seen_urls:
                raise bad(f"{key}.url", f"replica {url} is listed twice")
            seen_urls.add(url)
            name = replica_name(replica)
            if name in seen_names:
                raise bad(f"{key}.name", f"a replica named {name!r} is listed twice")
            seen_names.add(name)
    check_fields(config.limits, _LIMITS_BOUNDS, source, "limits")
    check_fields(config.health, _HEALTH_BOUNDS, source, "health")
    check_fields(config, {"scrape_interval_ms": POSITIVE}, source)
    _check_discovery(config.discovery, source)
    if config.state_bus is not None:
        check_state_bus(config.state_bus, source)
    if config.tracing is not None:
        _check_tracing(config.tracing, source)
    auth = config.auth
    env = auth.admin_token_env
    if secrets and env is not None and env not in os.environ:
        raise bad("auth.admin_token_env", f"environment variable {env} unset")
    key_names: set[str] = set()
    for i, api_key in enumerate(auth.api_keys):
        key = f"auth.api_keys[{i}]"
        if (api_key.key is None) == (api_key.key_env is None):
            raise bad(key, "give exactly one of key and key_env")
        if secrets and api_key.key_env is not None and api_key.key_env not in os.environ:
            raise bad(f"{key}.key_env", f"environment variable {api_key.key_env} unset")
        check_fields(api_key, _KEY_BOUNDS, source, key)
        if api_key.max_priority is not None and api_key.max_priority < api_key.priority:
            raise bad(f"{key}.max_priority", "must be at least the key's priority")
        if api_key.name in key_names:  # its budgets and metrics go by its name
            raise bad(f"{key}.name", f"a key named {api_key.name!r} is listed twice")
        key_names.add(api_key.name)


# Every number in a gateway config is finite (NaN passes a "> 0" check and then turns a
# timeout into none at all); these are the ranges.
_SLO_BOUNDS = {"ttft_ms": POSITIVE, "tpot_ms": POSITIVE, "ttft_per_1k_ms": NON_NEGATIVE}
_LIMITS_BOUNDS = {
    field: NON_NEGATIVE if field in ("max_retries", "max_queue") else POSITIVE
    for field in LimitsConfig.__struct_fields__
}
_HEALTH_BOUNDS = {
    field: SHARE if field == "min_success_rate" else POSITIVE
    for field in HealthConfig.__struct_fields__
}
_KEY_BOUNDS = {
    "requests_per_minute": POSITIVE,
    "tokens_per_minute": POSITIVE,
    "max_in_flight": POSITIVE,
}


def _check_shadow(shadow: ShadowConfig, running: str, source: str, key: str) -> None:
    """ConfigError naming the first bad ``shadow`` field of a pool running ``running``
    (unknown policy names are ``check_references``')."""
    if not shadow.policies:
        raise ConfigError(source, "name at least one candidate policy", key=f"{key}.policies")
    if running in shadow.policies:
        raise ConfigError(
            source,
            f"{running} is the pool's running policy, not a candidate",
            key=f"{key}.policies",
        )
    if len(set(shadow.policies)) != len(shadow.policies):
        raise ConfigError(source, "a candidate is listed twice", key=f"{key}.policies")
    for field in ("interval_s", "window_s", "max_requests", "min_requests", "timeout_s"):
        value = getattr(shadow, field)
        if not value > 0 or not math.isfinite(value):
            raise ConfigError(source, "must be positive", key=f"{key}.{field}")
    if shadow.min_requests > shadow.max_requests:
        raise ConfigError(source, "must not exceed max_requests", key=f"{key}.min_requests")


def _check_discovery(discovery: DiscoveryConfig, source: str) -> None:
    etcd, kube = discovery.etcd, discovery.kubernetes
    if discovery.max_replicas < 1:
        raise ConfigError(
            source, "must be >= 1 (replicas each provider may add)", key="discovery.max_replicas"
        )
    if etcd is not None:
        if not etcd.endpoints:
            raise ConfigError(source, "give at least one endpoint", key="discovery.etcd.endpoints")
        for i, endpoint in enumerate(etcd.endpoints):
            try:
                normalize_replica_url(endpoint)
            except ValueError as exc:
                raise ConfigError(source, str(exc), key=f"discovery.etcd.endpoints[{i}]") from None
        if not etcd.prefix.startswith("/"):
            raise ConfigError(source, "must start with /", key="discovery.etcd.prefix")
        for field in ("timeout_ms", "probe_interval_ms", "max_backoff_ms"):
            if not getattr(etcd, field) > 0:
                raise ConfigError(source, "must be positive", key=f"discovery.etcd.{field}")
    if kube is not None:
        if kube.inference_pool is not None:
            _check_inference_pool(kube, source)
        elif (kube.service is None) == (kube.label_selector is None):
            raise ConfigError(
                source,
                "give exactly one of service, label_selector and inference_pool",
                key="discovery.kubernetes",
            )
        if kube.port is not None and not is_port(kube.port):
            raise ConfigError(source, "must be within 1..65535", key="discovery.kubernetes.port")
        if not kube.max_backoff_ms > 0:
            raise ConfigError(source, "must be positive", key="discovery.kubernetes.max_backoff_ms")


def _check_inference_pool(kube: KubernetesDiscoveryConfig, source: str) -> None:
    """The pool names its pods and ports: a key that names them too is a contradiction."""
    key = "discovery.kubernetes.inference_pool"
    name = kube.inference_pool or ""
    if len(name) > 253 or not _OBJECT_NAME.fullmatch(name):
        raise ConfigError(source, f"{name[:100]!r} is not a Kubernetes object name", key=key)
    for field in ("service", "label_selector", "port", "port_name"):
        if getattr(kube, field) is not None:
            raise ConfigError(
                source,
                f"cannot be given with {field}: the InferencePool's selector and targetPorts"
                " pick the pods and their ports",
                key=key,
            )


REDIS_SCHEMES = ("redis", "rediss")  # the state bus's transports (runtime.bus_transport)
NATS_SCHEMES = ("nats", "tls")


def check_state_bus(bus: StateBusConfig, source: str) -> None:
    """ConfigError naming the first bad ``state_bus`` field."""
    _check_url(bus.url, (*REDIS_SCHEMES, *NATS_SCHEMES), source, "state_bus.url",
               "redis://host:port or nats://host:port")  # fmt: skip
    if not bus.channel:
        raise ConfigError(source, "must not be empty", key="state_bus.channel")
    for field in ("heartbeat_ms", "peer_timeout_ms", "max_backoff_ms"):
        if not getattr(bus, field) > 0:
            raise ConfigError(source, "must be positive", key=f"state_bus.{field}")
    if not bus.peer_timeout_ms > bus.heartbeat_ms:
        raise ConfigError(source, "must exceed heartbeat_ms", key="state_bus.peer_timeout_ms")


def _check_tracing(tracing: TracingConfig, source: str) -> None:
    """ConfigError naming the first bad ``tracing`` field."""
    _check_url(tracing.otlp_endpoint, ("http", "https"), source, "tracing.otlp_endpoint",
               "http://host:port or https://host:port")  # fmt: skip
    if not tracing.service_name:
        raise ConfigError(source, "must not be empty", key="tracing.service_name")
    check_fields(tracing, {"sample_ratio": SHARE}, source, "tracing")


def _check_url(url: str, schemes: tuple[str, ...], source: str, key: str, form: str) -> None:
    """ConfigError at ``key`` unless ``url`` has one of ``schemes`` and a host."""
    parts = urlsplit(url)
    if parts.scheme not in schemes or not parts.hostname:
        raise ConfigError(source, f"{redacted(url)!r} must be {form}", key=key)


def redacted(url: str) -> str:
    """``url`` without its credentials, fit for logs."""
    parts = urlsplit(url)
    if parts.password is None and parts.username is None:
        return url
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
