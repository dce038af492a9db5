"""What a host in a URL may be, wherever a URL is built from what someone else wrote (a
replica URL in a config or a registration, a KV pull address in a client's request).

An IP literal, or a DNS name: dot-separated labels of letters, digits, hyphens (not at a
label's ends) and underscores (Docker Compose service names hold them), 253 characters
at most, the last label not all digits. That refuses the shorthand IPv4 forms
(``127.1``, ``2130706433``, ``0``) some resolvers take and the HTTP client refuses at
every try, and anything that could carry a port, a path, user info or an IPv6 zone.
"""

from __future__ import annotations

import ipaddress
import re
from typing import TypeGuard

__all__ = ["is_host", "is_port"]

_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
_MAX_NAME_CHARS = 253
_MAX_PORT = 65535


def is_host(text: str) -> bool:
    """``text`` names a host as above."""
    if "%" in text:  # an IPv6 zone, which may hold any character
        return False
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        pass
    labels = text.rstrip(".").split(".")
    return (
        len(text) <= _MAX_NAME_CHARS
        and all(_LABEL.fullmatch(label) for label in labels)
        and not labels[-1].isdigit()
    )


def is_port(value: object) -> TypeGuard[int]:
    """``value`` is a TCP port a URL can name: an integer (not a bool) in 1..65535."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= _MAX_PORT
