"""A real etcd server for tests: 127.0.0.1, free ports, a temporary data dir.

``EtcdServer.start`` waits for ``/health``; ``kill`` (SIGKILL) and ``start`` again on the
same ports and data keep the store (leases included), as an etcd restart does; ``stop``
ends it for good. Tests that need it are skipped where no ``etcd`` binary is installed
(``make test`` installs Debian's ``etcd-server``).
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isocost_procs import free_port
from servers import crash, spawn_server

ETCD = shutil.which("etcd")


@dataclass(frozen=True)
class EtcdTls:
    """The server's certificate and key, and the CA its clients' certificates must chain
    to (etcd's ``--client-cert-auth``); the client's own, for the fixture's calls."""

    cert: Path
    key: Path
    client_ca: Path
    server_ca: Path
    client_cert: Path
    client_key: Path


class EtcdServer:
    def __init__(self, data_dir: Path, tls: EtcdTls | None = None) -> None:
        assert ETCD is not None, "no etcd binary"
        self.data_dir = data_dir
        self.tls = tls
        self.client_port, self.peer_port = free_port(), free_port()
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.client_port}"
        self.popen: subprocess.Popen[bytes] | None = None
        self.log = data_dir.with_suffix(".log")

    def start(self, timeout_s: float = 30) -> None:
        assert ETCD is not None
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [ETCD, "--name", "test", "--data-dir", str(self.data_dir)]
        args += ["--listen-client-urls", self.url, "--advertise-client-urls", self.url]
        args += ["--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer]
        args += ["--initial-cluster", f"test={peer}"]
        # a short election: a restarted etcd extends every lease by it (a single node)
        args += ["--heartbeat-interval", "50", "--election-timeout", "500"]
        if self.tls is not None:
            args += ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key)]
            args += ["--trusted-ca-file", str(self.tls.client_ca), "--client-cert-auth"]
        self.popen = spawn_server(args, self.log, self._answers, timeout_s)

    def _answers(self) -> bool:
        try:
            return bool(self.call("/v3/maintenance/status", {}).get("header"))
        except (OSError, urllib.error.URLError):
            return False

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), method="POST"
        )
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=str(self.tls.server_ca))
            context.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        with urllib.request.urlopen(request, timeout=2, context=context) as resp:
            result: dict[str, Any] = json.loads(resp.read())
            return result

    def kill(self) -> None:
        """SIGKILL, as a crash: the data dir stays for ``start``."""
        crash(self.popen)

    def stop(self) -> None:
        self.kill()
