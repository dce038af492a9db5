"""Security of `isocost serve`: tokens, keys, budgets, secret-free logs, no stray upstreams.

One gateway with debug logging in front of two engines; a "canary" HTTP server on another
port stands for a host that is not a configured replica: no request may ever reach it.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from unittest import mock

import pytest
from cluster import ADMIN_TOKEN, API_KEY, AUTH, MODEL, Cluster, http, start_cluster

from isocost.gateway.auth import Authenticator
from isocost.runtime.config import ApiKeyConfig, AuthConfig

LIMITED_KEY = "sk-limited-key-0a9c77"
ADMIN_ROUTES = [
    ("GET", "/admin/replicas"),
    ("POST", "/admin/replicas"),
    ("DELETE", "/admin/replicas/any"),
    ("POST", "/admin/replicas/any/drain"),
    ("POST", "/admin/replicas/any/undrain"),
    ("POST", "/admin/policy"),
    ("GET", "/admin/snapshot"),
]


class Canary:
    """An HTTP server that counts every request it gets (it must get none)."""

    def __init__(self) -> None:
        hits: list[str] = []
        self.hits = hits

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                hits.append(self.path)
                self.send_response(200)
                self.end_headers()

            do_GET = do_POST = _any

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    keys = f"    - {{name: limited, key: {LIMITED_KEY}, requests_per_minute: 3}}"
    cluster = start_cluster(
        tmp_path_factory.mktemp("security"), 2, keys=keys, gateway_args=("--log-level", "debug")
    )
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def canary() -> Iterator[Canary]:
    server = Canary()
    try:
        yield server
    finally:
        server.close()


def completion(model: str = MODEL) -> bytes:
    return json.dumps({"model": model, "prompt": "hello", "max_tokens": 4}).encode()


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {ADMIN_TOKEN}x"},
        {"Authorization": f"Bearer {ADMIN_TOKEN[:-1]}"},
        {"Authorization": f"Basic {ADMIN_TOKEN}"},
        {"X-Admin-Token": "wrong"},
        {"Authorization": f"Bearer {API_KEY}"},  # an API key is not an admin token
    ],
)
def test_admin_rejects_missing_or_wrong_tokens(
    cluster: Cluster, method: str, path: str, headers: dict[str, str]
) -> None:
    body = b"{}" if method == "POST" else None
    status, _, answer = http(method, cluster.gateway.url + path, body, headers)
    assert status == 401
    assert answer["error"]["code"] == "invalid_admin_token"


def test_tokens_and_keys_are_compared_in_constant_time() -> None:
    auth = Authenticator(
        AuthConfig(admin_token="admin-secret", api_keys=[ApiKeyConfig(name="a", key="k-secret")]),
        now=0.0,
    )
    with mock.patch("hmac.compare_digest", wraps=__import__("hmac").compare_digest) as spy:
        assert auth.is_admin("admin-secret") and not auth.is_admin("admin-secreT")
        assert auth.key_for("k-secret") is not None and auth.key_for("k-secreT") is None
    assert spy.call_count == 4


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": API_KEY}]
)
def test_api_key_required(cluster: Cluster, headers: dict[str, str]) -> None:
    headers = {**headers, "Content-Type": "application/json"}
    status, _, answer = http("POST", cluster.gateway.url + "/v1/completions", completion(), headers)
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"


def test_per_key_request_budget_is_enforced_with_retry_after(cluster: Cluster) -> None:
    headers = {"Authorization": f"Bearer {LIMITED_KEY}", "Content-Type": "application/json"}
    statuses = []
    for _ in range(5):
        status, got, _ = http(
            "POST", cluster.gateway.url + "/v1/completions", completion(), headers
        )
        statuses.append(status)
        if status == 429:
            assert float(got["Retry-After"]) > 0
    assert statuses[:3] == [200, 200, 200] and statuses[3:] == [429, 429]
    # another key's budget is untouched
    assert http("POST", cluster.gateway.url + "/v1/completions", completion(), AUTH)[0] == 200


def test_keys_and_tokens_never_reach_the_log(cluster: Cluster) -> None:
    url = cluster.gateway.url
    http("POST", url + "/v1/completions", completion(), AUTH)
    http("POST", url + "/v1/completions", completion("no-such-model"), AUTH)
    wrong = {"Authorization": "Bearer sk-guess-123456", "Content-Type": "application/json"}
    http("POST", url + "/v1/completions", completion(), wrong)
    http("GET", url + "/admin/replicas", None, {"Authorization": f"Bearer {ADMIN_TOKEN}"})
    http("GET", url + "/admin/replicas", None, {"X-Admin-Token": "admin-guess-654321"})
    log = cluster.log.read_text()
    assert '"event": "request"' in log  # the requests were logged, with their key's name
    assert '"key": "team-a"' in log
    for secret in (API_KEY, LIMITED_KEY, ADMIN_TOKEN, "sk-guess-123456", "admin-guess-654321"):
        assert secret not in log


def _raw(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("path", ["/v1/route?kind=completion", "/v1/completions"])
def test_no_request_reaches_a_host_that_is_not_a_replica(
    cluster: Cluster, canary: Canary, path: str
) -> None:
    url = cluster.gateway.url
    canary_host = canary.url.removeprefix("http://")
    attempts = [
        ({}, completion(canary.url)),
        ({}, completion(f"{canary.url}/v1/completions")),
        ({"Host": canary_host}, completion()),
        ({"X-Forwarded-Host": canary_host, "X-Forwarded-Proto": "http"}, completion()),
        ({"Forwarded": f"host={canary_host}"}, completion()),
        ({"X-Isocost-Class": canary.url, "X-Session-Id": canary.url}, completion()),
    ]
    for headers, body in attempts:
        status, got, answer = http("POST", url + path, body, {**AUTH, **headers})
        assert status in (200, 404), answer
        if status == 200 and path.startswith("/v1/route"):
            assert answer["replica_url"] in cluster.engine_urls
        if status == 200 and path == "/v1/completions":
            assert got["x-isocost-replica"]
    # an absolute URL as the request target, and a path that names another authority
    body = completion()
    head = (
        f"Content-Type: application/json\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
    )
    for target in (f"{canary.url}{path}", f"//{canary_host}{path}"):
        request = f"POST {target} HTTP/1.1\r\nHost: {canary_host}\r\n{head}\r\n".encode() + body
        answer = _raw(url, request)
        assert answer.startswith(b"HTTP/1.1 "), answer[:100]
    assert canary.hits == []


def test_upstream_host_comes_from_config_not_from_client_model_names(
    cluster: Cluster, tmp_path: Path
) -> None:
    # the only way to add an upstream is the admin API (with the token) or the config file
    status, _, answer = http(
        "POST",
        cluster.gateway.url + "/admin/replicas",
        json.dumps({"model": MODEL, "replica": {"url": "http://127.0.0.1:1"}}).encode(),
        {"Content-Type": "application/json"},
    )
    assert status == 401
    status, _, answer = http("GET", cluster.gateway.url + "/v1/models", None, AUTH)
    assert [m["id"] for m in answer["data"]] == [MODEL]
