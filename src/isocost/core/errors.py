"""Error hierarchy shared by every layer.

::

    IsocostError
    ├── UnknownEntryError      a model, GPU, policy or plugin name not in its registry
    │   └── UnknownConfigEntryError   the same, inside a config file (scheduling.policies)
    ├── ConfigError            a malformed catalog, config.json or YAML file (names file + key)
    ├── DoesNotFitError        a model that cannot be placed on the requested hardware
    ├── ProfileError           profile: measurements a catalog entry cannot be fitted to
    ├── EndpointError          bench: the endpoint under test cannot be reached or misbehaves
    ├── DrillError             drill: a fault drill that cannot run as asked
    ├── GatewayError           autoscale: the gateway's admin API refused or is unreachable
    ├── ActuatorError          autoscale: a replica could not be started or stopped
    └── ServiceError           runtime: a local child process that does not come up

The subclasses outside ``core`` live with the layer that raises them; this tree is kept in
step with them by a test (tests/unit/test_errors.py).

Hot-path outcomes (no candidate replica, a rejected request) are values, not exceptions;
these errors are for bad input at the edges. The CLI turns each into a one-line message and
exit code 2; the gateway maps them to OpenAI-style JSON.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["ConfigError", "DoesNotFitError", "IsocostError", "UnknownEntryError"]


class IsocostError(Exception):
    """Base of every error isocost raises on purpose."""


class UnknownEntryError(IsocostError, LookupError):
    """A name that is not in a registry; the message lists the closest valid names."""

    def __init__(self, kind: str, name: str, valid: Iterable[str]) -> None:
        self.kind = kind
        self.name = name
        self.valid = sorted(valid)
        close = difflib.get_close_matches(name.lower(), self.valid, n=3, cutoff=0.5)
        if close:
            hint = "did you mean " + ", ".join(close) + "?"
        else:
            hint = "valid: " + ", ".join(self.valid)
        super().__init__(f"unknown {kind} {name!r}; {hint}")


class ConfigError(IsocostError, ValueError):
    """Malformed input file; the message names the file and, when known, the key."""

    def __init__(self, source: str, message: str, key: str | None = None) -> None:
        self.source = source
        self.key = key
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {message}")


class DoesNotFitError(IsocostError):
    """A model whose weights (plus minimal KV) exceed what the requested GPUs can hold."""
