"""A server's address refused as bad input: one line and exit 2, as ``picker`` does.

Binding is the last step before a server says it is ready, and the OS refuses it with an
``OSError`` (the port is taken, the address is not this host's or not an address). Before
the server is ready, such an error is the user's ``--host`` or ``--port``; after it, it is
a failure of the running server and propagates as it would.
"""

from __future__ import annotations

import errno
import socket
from types import TracebackType
from typing import NoReturn

from isocost.cli._app import fail

__all__ = ["Listening"]


class Listening:
    """``with Listening(host, port) as listening:`` around starting a server whose ready
    callback sets ``listening.ready``."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.ready = False

    def probe(self, *, reuse_port: bool = False) -> None:
        """Bind the address and let it go at once, as the server will bind it (``reuse_port``:
        shared with sibling workers), so that a slow start-up (discovery, first scrapes)
        is not spent on an address that will be refused; the server's own bind decides."""
        try:
            for family, kind, proto, _, address in socket.getaddrinfo(
                self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            ):
                with socket.socket(family, kind, proto) as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    if reuse_port:
                        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                    probe.bind(address)
        except OSError as exc:
            self._refuse(exc)

    def __enter__(self) -> Listening:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, OSError) and not self.ready and _refused_bind(exc):
            self._refuse(exc)

    def _refuse(self, exc: OSError) -> NoReturn:
        fail(f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc}")


# What the OS answers a bind it refuses: taken, not this host's, not allowed, no address.
# Any other OSError before the server is ready (a replica unreachable, a file) is not the
# address's fault and is reported where it arises.
_BIND_ERRNOS = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES, errno.EINVAL})


def _refused_bind(exc: OSError) -> bool:
    return isinstance(exc, socket.gaierror) or exc.errno in _BIND_ERRNOS
