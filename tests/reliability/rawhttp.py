"""Raw HTTP/1.1 over a socket, for requests no HTTP client library would send.

``exchange`` sends bytes and reads until the server closes; ``parse`` splits an answer
into status, headers and body (the first answer when several came, e.g. after a
``100 Continue``).
"""

from __future__ import annotations

import json
import socket
from typing import Any


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def connect(url: str, timeout_s: float = 20) -> socket.socket:
    return socket.create_connection(address(url), timeout=timeout_s)


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes (or resets) the connection."""
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def exchange(url: str, data: bytes, timeout_s: float = 20) -> bytes:
    with connect(url, timeout_s) as sock:
        sock.sendall(data)
        return read_all(sock)


def parse(answer: bytes) -> tuple[int, dict[str, str], Any]:
    """Status, headers (lower-case names) and JSON body (None when not JSON)."""
    while answer.startswith(b"HTTP/1.1 1"):  # an interim answer (100 Continue)
        answer = answer.split(b"\r\n\r\n", 1)[1]
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    try:
        parsed = json.loads(body) if body else None
    except ValueError:
        parsed = None
    return status, headers, parsed


def request(method: str, path: str, headers: dict[str, bytes | str], body: bytes = b"") -> bytes:
    """The bytes of one request with ``Connection: close`` and a Content-Length."""
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1"]
    for name, value in {**headers, "Content-Length": str(len(body))}.items():
        raw = value.encode() if isinstance(value, str) else value
        lines.append(name.encode() + b": " + raw)
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + body
