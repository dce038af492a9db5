"""The registration record (DESIGN §7): what ``isocost agent`` writes under
``<prefix>/replicas/<name>`` and what Kubernetes annotations map to.

Unknown fields are kept out of the way, not refused, so that a newer agent's record still
registers with an older gateway; a record that is not JSON, lacks ``url`` or ``models``,
or has a field of the wrong type is ``Malformed`` with the reason, and is skipped.
``check_registration`` is what a gateway then requires of a record's content, and what
``isocost agent`` checks before it registers, so that no agent reports "registered" for a
record every gateway refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec

from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError
from isocost.core.jsontext import UNDECODABLE
from isocost.runtime.config import ReplicaConfig, check_replica, normalize_replica_url

__all__ = [
    "MAX_MODEL_NAME",
    "Malformed",
    "Registration",
    "check_registration",
    "decode_registration",
]

# Served model names are short (a Hugging Face id is at most 96 characters, vLLM's
# --served-model-name is whatever the operator types); a longer one is a broken or hostile
# record, and one past the file system's 255-byte name limit cannot even be looked up as
# a local model folder.
MAX_MODEL_NAME = 256


class Registration(msgspec.Struct, frozen=True, omit_defaults=True):
    """One replica as it registers itself."""

    name: str
    url: str
    models: list[str]
    gpu: str = "a100-80g"
    tp: int = 1
    groups: list[str] = []
    weight: float = 1.0
    usd_per_hour: float | None = None
    cost_model: str | None = None  # catalog model or HF folder, when the served name is not
    engine: str = "unknown"  # vllm | sglang | isocost, as the agent detected it
    release: str = ""  # digest of model + engine version + serving arguments
    state: Literal["serving", "draining"] = "serving"

    @property
    def model(self) -> str:
        """The pool it joins: its first served model name."""
        return self.models[0]

    @property
    def draining(self) -> bool:
        return self.state == "draining"

    def replica_config(self) -> ReplicaConfig:
        """The config-file entry this record stands for."""
        return ReplicaConfig(
            url=self.url,
            name=self.name,
            gpu=self.gpu,
            cost_model=self.cost_model,
            tp=self.tp,
            weight=self.weight,
            usd_per_hour=self.usd_per_hour,
            groups=list(self.groups),
        )

    def encode(self) -> bytes:
        return msgspec.json.encode(self)


@dataclass(frozen=True, slots=True)
class Malformed:
    """A record that cannot be a replica, and why (one log line, one counted rejection)."""

    reason: str


def decode_registration(value: bytes) -> Registration | Malformed:
    """``value`` as a registration, or why it is not one."""
    try:
        record = msgspec.json.decode(value, type=Registration)
    except msgspec.ValidationError as exc:
        return Malformed(str(exc))
    except UNDECODABLE as exc:
        return Malformed(f"not JSON: {exc}")
    return record


def check_registration(record: Registration, catalog: Catalog, *, source: str = "") -> str:
    """The record's normalized URL, or a ConfigError (key ``registration.<field>``) for
    what a gateway refuses: no model, or one named longer than ``MAX_MODEL_NAME``, and every
    check of a config-file replica entry (``check_replica``: name, URL, tp, weight, price,
    catalog GPU and cost model). ``source`` begins the message (default: the record's name)."""
    source = source or f"registration {record.name}"
    if not record.models or not all(record.models):
        raise ConfigError(source, "must name at least one model", key="registration.models")
    if any(len(model) > MAX_MODEL_NAME for model in record.models):
        raise ConfigError(
            source,
            f"a model name is longer than {MAX_MODEL_NAME} characters",
            key="registration.models",
        )
    check_replica(record.replica_config(), record.model, catalog, source=source, key="registration")
    return normalize_replica_url(record.url)
