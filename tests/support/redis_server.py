"""A real Redis server for tests: 127.0.0.1, a free port, a temporary dir, no persistence.

``RedisServer.start`` waits until it answers PING; ``kill`` (SIGKILL) and ``start`` again
listen on the same port, as a crashed and restarted bus server does. Tests that need it
are skipped where no ``redis-server`` binary is installed (``make redis`` installs
Debian's).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

from isocost_procs import free_port
from servers import crash, spawn_server

REDIS_SERVER = shutil.which("redis-server")


class RedisServer:
    def __init__(self, work_dir: Path) -> None:
        assert REDIS_SERVER is not None, "no redis-server binary"
        work_dir.mkdir(parents=True, exist_ok=True)
        self.work_dir = work_dir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.popen: subprocess.Popen[bytes] | None = None
        self.log = work_dir / "redis.log"

    def start(self, timeout_s: float = 10) -> None:
        assert REDIS_SERVER is not None
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--dir", str(self.work_dir), "--save", "", "--appendonly", "no"]
        self.popen = spawn_server(args, self.log, self._pong, timeout_s)

    def _pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def publish(self, channel: str, payload: bytes) -> None:
        """``payload`` on ``channel``, as a misbehaving peer would send it."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
            command = b"*3\r\n$7\r\nPUBLISH\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (
                len(channel),
                channel.encode(),
                len(payload),
                payload,
            )
            sock.sendall(command)
            assert sock.recv(64).startswith(b":")  # the count of receivers

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        crash(self.popen)
