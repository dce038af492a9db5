"""TLS to https:// replicas: the context the gateway's one client session verifies their
certificates with (``upstream_tls`` in the config), and presents its own where they ask
for one. Built at start from files, so a missing or bad file is one line and exit 2
before any port opens, never a handshake error on the first request."""

from __future__ import annotations

import ssl
from pathlib import Path

from isocost.core.errors import ConfigError
from isocost.runtime.config import UpstreamTlsConfig

__all__ = ["upstream_ssl"]


def upstream_ssl(tls: UpstreamTlsConfig, source: str) -> ssl.SSLContext | bool:
    """The context for ``tls``; True (the system's store, aiohttp's default) when it names
    no file."""
    files = {
        field: str(Path(path).expanduser())
        for field in ("ca_file", "cert_file", "key_file")
        if (path := getattr(tls, field)) is not None
    }
    if not files:
        return True
    for field, path in files.items():
        try:
            Path(path).open("rb").close()
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise ConfigError(source, f"{path}: {reason}", key=f"upstream_tls.{field}") from None
    field = "ca_file"
    try:
        context = ssl.create_default_context(cafile=files.get("ca_file"))
        if "cert_file" in files:
            field = "cert_file"
            context.load_cert_chain(files["cert_file"], files.get("key_file"))
    except ssl.SSLError as exc:  # not PEM, no certificate in it, a key not the cert's
        raise ConfigError(
            source, f"cannot be used: {exc.reason or exc}", key=f"upstream_tls.{field}"
        ) from None
    return context
