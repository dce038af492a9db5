"""The registration record (DESIGN §7): what ``isocost agent`` writes under
``<prefix>/replicas/<name>`` and what Kubernetes annotations map to.

Unknown fields are kept out of the way, not refused, so that a newer agent's record still
registers with an older gateway; a record that is not JSON, lacks ``url`` or ``models``,
or has a field of the wrong type is ``Malformed`` with the reason, and is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec

from isocost.runtime.config import ReplicaConfig

__all__ = ["Malformed", "Registration", "decode_registration"]


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
    except msgspec.DecodeError as exc:
        return Malformed(f"not JSON: {exc}")
    if not record.models or not all(record.models):
        return Malformed("models must name at least one model")
    if not record.name:
        return Malformed("name must not be empty")
    return record
