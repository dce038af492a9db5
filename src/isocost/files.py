"""The file-reading edge under the pure layers: catalogs, model configs, traces.

The pure layers parse text; this module is where paths become text, so that errors name
the file. Everything above (engine, sim, gateway, bench, cli) reads files through here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError
from isocost.core.models import ModelSpec, model_from_hf_config
from isocost.workload import TraceFormat, WorkloadRequest, parse_trace

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["load_catalog", "load_trace", "read_text", "read_tokenizer", "resolve_model"]


def read_text(path: str | Path) -> str:
    """The file's text, or a ConfigError naming it (missing, unreadable, not UTF-8)."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(p), "no such file") from None
    except IsADirectoryError:
        raise ConfigError(str(p), "is a directory, expected a file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(str(p), f"not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(str(p), exc.strerror or "cannot be read") from None


def read_tokenizer(path: str | Path) -> Tokenizer:
    """A Hugging Face tokenizer from ``tokenizer.json`` or a model folder holding one; a
    ConfigError naming the file when it is missing or no tokenizer, or when the optional
    ``tokenizers`` package is not installed."""
    p = Path(path).expanduser()
    if _is_dir(p):
        p = p / "tokenizer.json"
    text = read_text(p)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(
            str(p), "needs the tokenizers package: pip install 'isocost[tokenizer]'"
        ) from None
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises bare Exceptions on bad files
        raise ConfigError(str(p), f"not a tokenizer.json: {exc}") from None


def load_catalog(paths: list[str] | None = None) -> Catalog:
    """The built-in catalog merged with each user YAML catalog in ``paths``, in order."""
    catalog = Catalog.builtin()
    for path in paths or []:
        catalog = catalog.merged(read_text(path), path)
    return catalog


def _is_dir(p: Path) -> bool:
    """Whether ``p`` is a folder. A name the system cannot look up at all (a component
    over 255 bytes: ENAMETOOLONG; a loop; no permission) is none: names come from config
    files and registrations, and one bad name must be refused, not raise OSError."""
    try:
        return p.is_dir()
    except OSError:
        return False


def is_model_path(name: str) -> bool:
    """Whether ``name`` names a local model folder or ``config.json`` rather than a catalog id."""
    p = Path(name)
    return _is_dir(p) or p.suffix == ".json" or name.startswith((".", "/"))


def resolve_model(name: str, catalog: Catalog) -> ModelSpec:
    """A catalog id, or a local Hugging Face model folder / ``config.json`` path."""
    p = Path(name)
    if is_model_path(name):
        folder = _is_dir(p) or not p.suffix
        config = p / "config.json" if folder else p
        model_id = (p if folder else p.parent).name or str(p)
        return model_from_hf_config(read_text(config), str(config), model_id)
    return catalog.model(name)


def load_trace(path: str | Path, trace_format: TraceFormat | None = None) -> list[WorkloadRequest]:
    """A trace file's requests in arrival order; errors name the file and line."""
    return parse_trace(read_text(path).splitlines(), str(path), trace_format)
