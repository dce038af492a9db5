"""Named policies: canned plugin profiles, their YAML form, and ``build_policy``.

A scheduling config declares plugin instances once, composes them into named policy
profiles by reference with weights, and may add route classes (``scheduling.routes``)::

    plugins:                       # optional: instances with non-default parameters
      - name: eager-cost
        type: equal-cost-scorer
        parameters: {lambda_delay: 0.5, affinity_slack: 0.5}
    policies:
      - name: my_policy
        description: equal-cost with a softer delay price
        filters: [kv-headroom-filter]      # instance names or plugin types
        scorers:
          - {plugin: eager-cost, weight: 1.0}
        picker: max-score-picker
        admission: {slo: true, min_available_fraction: 0.25, retry_after_s: 1.0}
    routes:
      - {name: long-context, min_prompt_tokens: 32000, groups: [[h200], []]}

A reference that is neither a declared instance nor a plugin type, or an unknown policy
name, raises ``UnknownConfigEntryError`` naming the key and listing what is valid; unknown
keys anywhere raise ``ConfigError`` with the key path. User policies are added to the
built-in ones (``BUILTIN_POLICIES``; ``isocost policies --yaml`` prints them in this
format): the peers' policies, equal_cost, and each peer again as ``<peer>_slo`` with
equal_cost's SLO admission (``SLO_BASELINES``). A user policy with a built-in name
replaces it. Every ``build_policy`` call makes fresh plugin instances, so stateful plugins
are never shared between policies.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from random import Random
from typing import Any

import msgspec
import yaml

from isocost.core.bounds import NON_NEGATIVE, POSITIVE, SHARE, check_fields
from isocost.core.errors import ConfigError, UnknownEntryError
from isocost.core.yamltext import load_yaml
from isocost.scheduling.framework import AdmissionSettings, Policy
from isocost.scheduling.interface import Filter, Picker, Scorer
from isocost.scheduling.plugins import PLUGIN_TYPES
from isocost.scheduling.routes import RouteRule, RouteTable

__all__ = [
    "BUILTIN_POLICIES",
    "SLO_BASELINES",
    "AdmissionDecl",
    "PluginDecl",
    "PolicyProfile",
    "SchedulingConfig",
    "ScorerRef",
    "UnknownConfigEntryError",
    "build_policy",
    "config_to_yaml",
    "parse_scheduling_yaml",
]


class UnknownConfigEntryError(UnknownEntryError):
    """An unknown policy or plugin reference; the message names the key and every valid name."""

    def __init__(
        self, kind: str, name: str, valid: Iterable[str], source: str, key: str | None = None
    ) -> None:
        super().__init__(kind, name, valid)
        self.source = source
        self.key = key
        where = f"{source}: {key}" if key else source
        self.args = (f"{where}: unknown {kind} {name!r}; valid: {', '.join(self.valid)}",)


class PluginDecl(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    type: str
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)


class ScorerRef(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    plugin: str
    weight: float = 1.0


class AdmissionDecl(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    slo: bool = False
    min_available_fraction: float = 0.0
    retry_after_s: float = 1.0
    hold: bool = True


_ADMISSION_BOUNDS = {"min_available_fraction": SHARE, "retry_after_s": POSITIVE}
_ROUTE_BOUNDS = {
    field: NON_NEGATIVE
    for field in ("min_prompt_tokens", "max_prompt_tokens", "min_max_tokens", "max_max_tokens")
}


class PolicyProfile(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    description: str = ""
    filters: list[str] = msgspec.field(default_factory=list)
    scorers: list[ScorerRef] = msgspec.field(default_factory=list)
    picker: str = "max-score-picker"
    admission: AdmissionDecl = msgspec.field(default_factory=AdmissionDecl)


class SchedulingConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    plugins: list[PluginDecl] = msgspec.field(default_factory=list)
    policies: list[PolicyProfile] = msgspec.field(default_factory=list)
    routes: list[RouteRule] = msgspec.field(default_factory=list)


def _profile(
    name: str,
    description: str,
    scorers: Mapping[str, float] | None = None,
    picker: str = "max-score-picker",
    admission: AdmissionDecl | None = None,
) -> PolicyProfile:
    return PolicyProfile(
        name=name,
        description=description,
        scorers=[ScorerRef(k, v) for k, v in (scorers or {}).items()],
        picker=picker,
        admission=admission or AdmissionDecl(),
    )


_PEERS = (
    _profile("round_robin", "each eligible replica in turn", picker="round-robin-picker"),
    _profile("random", "uniformly random, weighted by replica weight", picker="random-picker"),
    _profile("least_request", "fewest requests in flight", {"least-request-scorer": 1.0}),
    _profile(
        "power_of_two",
        "fewer requests in flight of two random replicas",
        {"least-request-scorer": 1.0},
        picker="power-of-two-picker",
    ),
    _profile("session", "rendezvous hash of the session key", {"session-affinity-scorer": 1.0}),
    _profile(
        "prefix",
        "longest cached prefix, then fewest requests",
        {"prefix-cache-scorer": 1.0, "least-request-scorer": 0.01},
    ),
    _profile(
        "sglang_cache_aware",
        "SGLang router cache_aware: prefix tree match, shortest queue when imbalanced",
        {"sglang-cache-aware-scorer": 1.0},
    ),
    _profile(
        "llmd_default",
        "llm-d: queue 2, KV utilisation 2, prefix cache 3",
        {"queue-scorer": 2.0, "kv-cache-utilization-scorer": 2.0, "prefix-cache-scorer": 3.0},
    ),
    _profile(
        "dynamo_kv",
        "Dynamo KV router: new prefill blocks + active blocks",
        {"dynamo-kv-scorer": 1.0},
    ),
)
_EQUAL_COST = _profile(
    "equal_cost",
    "least predicted completion cost to the request and to everyone else",
    {"equal-cost-scorer": 1.0},
    admission=AdmissionDecl(slo=True),
)


def _with_slo_admission(peer: PolicyProfile) -> PolicyProfile:
    """``peer``'s plugins behind equal_cost's SLO admission, so that a comparison credits
    routing to the routing and admission to the admission (DESIGN §6)."""
    return msgspec.structs.replace(
        peer,
        name=f"{peer.name}_slo",
        description=f"{peer.description} + SLO admission",
        admission=msgspec.structs.replace(peer.admission, slo=True),
    )


_SLO_TWINS = tuple(map(_with_slo_admission, _PEERS))
SLO_BASELINES: tuple[str, ...] = tuple(p.name for p in _SLO_TWINS)
"""The ``<peer>_slo`` policies: each peer with equal_cost's admission, its honest baseline."""
BUILTIN_POLICIES: dict[str, PolicyProfile] = {
    p.name: p for p in (*_PEERS, _EQUAL_COST, *_SLO_TWINS)
}


def parse_scheduling_yaml(text: str, source: str) -> SchedulingConfig:
    """Decode a scheduling config (YAML text read from ``source``) and check every reference."""
    raw = load_yaml(text, source)
    try:
        config = msgspec.convert(raw if raw is not None else {}, SchedulingConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(source, str(exc)) from None
    _check(config, source)
    return config


def config_to_yaml(config: SchedulingConfig) -> str:
    """The YAML form of ``config`` (what ``parse_scheduling_yaml`` reads back)."""
    data = msgspec.to_builtins(config)
    return yaml.safe_dump(data, sort_keys=False)


def build_policy(
    name: str,
    *,
    config: SchedulingConfig | None = None,
    rng: Random | None = None,
    source: str = "policy",
) -> Policy:
    """A fresh ``Policy`` for ``name`` from ``config`` (plus the built-ins)."""
    config = config or SchedulingConfig()
    profiles = {**BUILTIN_POLICIES, **{p.name: p for p in config.policies}}
    profile = profiles.get(name)
    if profile is None:
        raise UnknownConfigEntryError("policy", name, profiles, source)
    position = next((i for i, p in enumerate(config.policies) if p.name == name), None)
    key = f"policies[{position}]" if position is not None else f"policy {name}"
    declared = {d.name: d for d in config.plugins}

    def make(ref: str, field: str, kind: str) -> object:
        decl = declared.get(ref)
        type_name = decl.type if decl is not None else ref
        entry = PLUGIN_TYPES.get(type_name)
        if entry is None or entry.kind != kind:
            valid = [d.name for d in config.plugins] + [
                t for t, e in PLUGIN_TYPES.items() if e.kind == kind
            ]
            raise UnknownConfigEntryError(f"{kind} plugin", ref, valid, source, f"{key}.{field}")
        params = decl.parameters if decl is not None else {}
        return entry.create(params, source, f"{key}.{field}")

    filters: list[Filter] = [
        make(f, f"filters[{i}]", "filter")  # type: ignore[misc]
        for i, f in enumerate(profile.filters)
    ]
    for i, s in enumerate(profile.scorers):
        check_fields(s, {"weight": NON_NEGATIVE}, source, f"{key}.scorers[{i}]")
    scorers: list[tuple[str, Scorer, float]] = [
        (s.plugin, make(s.plugin, f"scorers[{i}].plugin", "scorer"), s.weight)  # type: ignore[misc]
        for i, s in enumerate(profile.scorers)
    ]
    picker: Picker = make(profile.picker, "picker", "picker")  # type: ignore[assignment]
    a = profile.admission
    check_fields(a, _ADMISSION_BOUNDS, source, f"{key}.admission")
    return Policy(
        name,
        filters=filters,
        scorers=scorers,
        picker=picker,
        admission=AdmissionSettings(a.slo, a.min_available_fraction, a.retry_after_s, a.hold),
        routes=RouteTable.of(config.routes),
        rng=rng,
    )


def _check(config: SchedulingConfig, source: str) -> None:
    """Names once each, numbers in range, and every policy built once, so that bad
    references fail at load, not at first use."""
    for kind, names in (
        ("plugins", [d.name for d in config.plugins]),
        ("policies", [p.name for p in config.policies]),
        ("routes", [r.name for r in config.routes]),
    ):
        for i, name in enumerate(names):
            if not name or name in names[:i]:  # references go by name
                problem = "must not be empty" if not name else "is listed twice"
                raise ConfigError(source, f"name {name!r} {problem}", f"{kind}[{i}].name")
    for i, route in enumerate(config.routes):
        check_fields(route, _ROUTE_BOUNDS, source, f"routes[{i}]")
    for i, decl in enumerate(config.plugins):
        entry = PLUGIN_TYPES.get(decl.type)
        if entry is None:
            raise UnknownConfigEntryError(
                "plugin type", decl.type, PLUGIN_TYPES, source, f"plugins[{i}].type"
            )
        entry.create(decl.parameters, source, f"plugins[{i}].parameters")
    for profile in config.policies:
        build_policy(profile.name, config=config, source=source)
