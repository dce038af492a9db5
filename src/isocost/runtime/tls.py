"""TLS client contexts from PEM files (``TlsConfig``): to https:// replicas
(``upstream_tls``) and to etcd (``discovery.etcd.tls``, the agent's ``--etcd-*-file``),
verifying the server against a CA and presenting a client certificate where it asks for
one. Built at start, so a missing or bad file is one line and exit 2 before any port
opens, never a handshake error on the first request."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path

from isocost.core.errors import ConfigError
from isocost.runtime.config import TlsConfig

__all__ = ["client_ssl"]


def client_ssl(tls: TlsConfig, source: str, named: Callable[[str], str]) -> ssl.SSLContext | bool:
    """The context for ``tls``; True (the system's store, aiohttp's default) when it names
    no file. An error names ``source`` and the field as ``named`` calls it (a config key,
    a command-line flag)."""
    files = {
        field: str(Path(path).expanduser())
        for field in ("ca_file", "cert_file", "key_file")
        if (path := getattr(tls, field)) is not None
    }
    if not files:
        return True
    if "key_file" in files and "cert_file" not in files:
        message = f"give {named('cert_file')} too: the key is for a certificate"
        raise ConfigError(source, message, key=named("key_file"))
    for field, path in files.items():
        try:
            Path(path).open("rb").close()
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise ConfigError(source, f"{path}: {reason}", key=named(field)) from None
    field = "ca_file"
    try:
        context = ssl.create_default_context(cafile=files.get("ca_file"))
        if "cert_file" in files:
            field = "cert_file"
            context.load_cert_chain(files["cert_file"], files.get("key_file"))
    except ssl.SSLError as exc:  # not PEM, no certificate in it, a key not the cert's
        raise ConfigError(
            source, f"cannot be used: {exc.reason or exc}", key=named(field)
        ) from None
    return context
