"""YAML from outside (a file given on the command line): one error for what is no YAML."""

from __future__ import annotations

import yaml

from isocost.core.errors import ConfigError

__all__ = ["load_yaml"]


def load_yaml(text: str, source: str) -> object:
    """``text`` decoded; ConfigError naming ``source`` for what is no YAML, nesting too
    deep included (PyYAML then raises RecursionError, no YAMLError)."""
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as exc:
        raise ConfigError(source, f"not valid YAML: {exc}") from None
