"""Replica configs and fault settings for ``isocost engine``, parsed with msgspec.

A replica is described by flags (every replica alike), by repeated ``--replica-spec``
strings, or by a YAML file; each spec overrides the flags' defaults field by field::

    --replica-spec "gpu=h100-80g,model=llama-3.1-8b,tp=1,slowdown=3"

    # replicas.yaml
    replicas:
      - {gpu: h100-80g, model: llama-3.1-8b}
      - {gpu: l40s-48g, model: llama-3.1-8b, tp: 2, slowdown: 1.5, max_waiting: 32}
      - {role: prefill}                  # disaggregated: prefill only, hands its KV off
      - {role: decode, link: infiniband} # pulls KV over this link kind, then decodes

Unknown keys are errors that name the source and the key.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from isocost.core.errors import ConfigError
from isocost.core.links import LINK_KINDS

__all__ = [
    "MAX_SLOWDOWN",
    "ROLES",
    "EngineReplicaConfig",
    "Faults",
    "ReplicaOverrides",
    "parse_replica_spec",
    "parse_replicas_yaml",
    "resolve_replicas",
]


ROLES = ("both", "prefill", "decode")  # vLLM's kv_both, kv_producer, kv_consumer

# The step-time factor's bound, both ways: 1000x turns a 20 ms decode step into 20 s, past
# any client's timeout, so a larger factor only models a hang (that is ``hang``, which
# clears at once) while its step times grow toward float overflow; 1/1000 is a GPU far
# faster than any, which ``--time-scale`` models without faults.
MAX_SLOWDOWN = 1000.0


class Faults(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Injected misbehaviour of one replica (flags, spec fields or ``POST /admin/fault``).

    * ``slowdown``: every step takes this many times longer (>= 1 slows, < 1 speeds up;
      within ``1 / MAX_SLOWDOWN .. MAX_SLOWDOWN``);
    * ``error_rate``: share of completion requests answered with HTTP 500 (0..1);
    * ``hang``: accept requests but answer none until the fault is cleared;
    * ``crash``: exit the whole process at once (admin endpoint only);
    * ``max_waiting``: answer 503 + Retry-After while this many requests already wait;
    * ``crash_after_handoff``: exit the whole process right after answering a prefill
      that hands its KV off (before anyone pulls it: the hand-off is lost with it).
    """

    slowdown: float = 1.0
    error_rate: float = 0.0
    hang: bool = False
    crash: bool = False
    max_waiting: int | None = None
    crash_after_handoff: bool = False

    def problem(self) -> tuple[str, str] | None:
        """``(field, message)`` for the first invalid field, or None."""
        if not 1 / MAX_SLOWDOWN <= self.slowdown <= MAX_SLOWDOWN:
            return "slowdown", f"must be between {1 / MAX_SLOWDOWN:g} and {MAX_SLOWDOWN:g}"
        if not 0.0 <= self.error_rate <= 1.0:
            return "error_rate", "must be between 0 and 1"
        if self.max_waiting is not None and self.max_waiting < 0:
            return "max_waiting", "must be >= 0"
        return None


class ReplicaOverrides(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One replica's fields as written in a spec string or YAML entry (None = default)."""

    gpu: str | None = None
    model: str | None = None
    tp: int | None = None
    served_model_name: str | None = None
    num_gpu_blocks: int | None = None
    slowdown: float | None = None
    error_rate: float | None = None
    max_waiting: int | None = None
    role: str | None = None
    link: str | None = None


class _ReplicasFile(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    replicas: list[ReplicaOverrides]


@dataclass(frozen=True, slots=True)
class EngineReplicaConfig:
    """A fully resolved engine replica: hardware, model, name, starting faults, and its
    part in disaggregated serving (``role``; ``link``: the kind its KV pulls travel)."""

    gpu: str
    model: str
    tp: int
    served_model_name: str
    num_gpu_blocks: int | None
    faults: Faults
    role: str = "both"
    link: str = "tcp"

    def with_overrides(self, o: ReplicaOverrides) -> EngineReplicaConfig:
        model = o.model or self.model
        name = o.served_model_name or (model if o.model else self.served_model_name)
        faults = msgspec.structs.replace(
            self.faults,
            slowdown=self.faults.slowdown if o.slowdown is None else o.slowdown,
            error_rate=self.faults.error_rate if o.error_rate is None else o.error_rate,
            max_waiting=self.faults.max_waiting if o.max_waiting is None else o.max_waiting,
        )
        return EngineReplicaConfig(
            gpu=o.gpu or self.gpu,
            model=model,
            tp=self.tp if o.tp is None else o.tp,
            served_model_name=name,
            num_gpu_blocks=self.num_gpu_blocks if o.num_gpu_blocks is None else o.num_gpu_blocks,
            faults=faults,
            role=o.role or self.role,
            link=o.link or self.link,
        )


def _checked(overrides: ReplicaOverrides, source: str) -> ReplicaOverrides:
    if overrides.tp is not None and overrides.tp < 1:
        raise ConfigError(source, "must be >= 1", key="tp")
    if overrides.num_gpu_blocks is not None and overrides.num_gpu_blocks < 1:
        raise ConfigError(source, "must be >= 1", key="num_gpu_blocks")
    if overrides.role is not None and overrides.role not in ROLES:
        raise ConfigError(source, f"must be one of {', '.join(ROLES)}", key="role")
    if overrides.link is not None and overrides.link not in LINK_KINDS:
        raise ConfigError(source, f"must be one of {', '.join(LINK_KINDS)}", key="link")
    problem = Faults(
        slowdown=1.0 if overrides.slowdown is None else overrides.slowdown,
        error_rate=overrides.error_rate or 0.0,
        max_waiting=overrides.max_waiting,
    ).problem()
    if problem:
        raise ConfigError(source, problem[1], key=problem[0])
    return overrides


def parse_replica_spec(text: str) -> ReplicaOverrides:
    """``key=value,key=value`` into overrides; values are coerced to the field types."""
    source = f"--replica-spec {text!r}"
    fields: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(source, f"expected key=value, got {item!r}")
        fields[key.strip()] = value.strip()
    try:
        parsed = msgspec.convert(fields, ReplicaOverrides, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(source, str(exc)) from exc
    return _checked(parsed, source)


def parse_replicas_yaml(text: str, source: str) -> list[ReplicaOverrides]:
    """A ``replicas:`` list from YAML text read from ``source``."""
    try:
        parsed = msgspec.yaml.decode(text, type=_ReplicasFile)
    except msgspec.ValidationError as exc:
        raise ConfigError(source, str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise ConfigError(source, f"not valid YAML: {exc}") from exc
    if not parsed.replicas:
        raise ConfigError(source, "lists no replicas", key="replicas")
    return [_checked(r, f"{source}: replicas[{i}]") for i, r in enumerate(parsed.replicas)]


def resolve_replicas(
    default: EngineReplicaConfig,
    count: int,
    spec_strings: list[str],
    file_text: str | None = None,
    file_source: str = "",
) -> list[EngineReplicaConfig]:
    """The replicas to serve: the YAML file's entries then each ``--replica-spec``, each
    over ``default``; or ``count`` copies of ``default`` when neither is given."""
    overrides = parse_replicas_yaml(file_text, file_source) if file_text is not None else []
    overrides += [parse_replica_spec(text) for text in spec_strings]
    if not overrides:
        return [default] * count
    if count not in (1, len(overrides)):
        raise ConfigError("--replicas", f"is {count} but {len(overrides)} replica specs were given")
    return [default.with_overrides(o) for o in overrides]
