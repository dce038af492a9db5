"""A real NATS server for tests: 127.0.0.1, a free port, its log in a temporary dir.

The same shape as ``RedisServer``: ``start`` waits until it greets a client (``INFO``),
``kill`` (SIGKILL) and ``start`` again listen on the same port, as a crashed and restarted
bus server does; ``publish`` sends raw bytes on a subject, as a misbehaving peer would.
Tests that need it are skipped where no ``nats-server`` binary is installed (``make nats``
installs Debian's).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

from isocost_procs import free_port
from servers import crash, spawn_server

NATS_SERVER = shutil.which("nats-server") or (
    "/usr/sbin/nats-server" if Path("/usr/sbin/nats-server").exists() else None
)


class NatsServer:
    def __init__(self, work_dir: Path) -> None:
        assert NATS_SERVER is not None, "no nats-server binary"
        work_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.popen: subprocess.Popen[bytes] | None = None
        self.log = work_dir / "nats.log"

    def start(self, timeout_s: float = 10) -> None:
        assert NATS_SERVER is not None
        args = [NATS_SERVER, "--addr", "127.0.0.1", "--port", str(self.port)]
        self.popen = spawn_server(args, self.log, self._greets, timeout_s)

    def _greets(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                return sock.recv(5) == b"INFO "
        except OSError:
            return False

    def publish(self, subject: str, payload: bytes) -> None:
        """``payload`` on ``subject`` over NATS's text protocol; returns once the server
        answered the PING after it, so the message is on its way to every subscriber."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
            reader = sock.makefile("rb")
            reader.readline()  # INFO
            sock.sendall(b'CONNECT {"verbose":false}\r\n')
            sock.sendall(b"PUB %s %d\r\n%s\r\nPING\r\n" % (subject.encode(), len(payload), payload))
            while not reader.readline().startswith(b"PONG"):
                pass

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        crash(self.popen)
