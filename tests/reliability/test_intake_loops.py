"""Routing loops: `isocost serve` never takes itself as a replica, and counts gateway hops.

A replica URL that is the gateway's own listen address is refused at start, by the admin
API and on reload; two gateways listing each other answer 508 Loop Detected after a few
hops instead of forwarding round and round; the hop count reaches replicas as
``x-isocost-hops``.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fake_upstream import received, start_fake_upstream
from gateway_harness import gateway_config, http, wait_for
from isocost_procs import ISOCOST, Proc, free_port, start_isocost

from isocost.gateway.loops import MAX_HOPS

API_KEY = "sk-loops-71c0e2aa"
ADMIN_TOKEN = "admin-loops-5d2e"
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}
KEY_ENV = "ISOCOST_TEST_LOOP_KEY"  # the key one gateway sends the other


def config(urls: list[str], fields: str = "") -> str:
    extra = f", {fields}" if fields else ""
    return gateway_config(
        urls,
        model="fake-model",
        admin_token=ADMIN_TOKEN,
        api_key=API_KEY,
        replica_fields=f"cost_model: llama-3.1-8b{extra}",
    )


def serve(tmp: Path, name: str, text: str, port: int = 0) -> Proc:
    path = tmp / f"{name}.yaml"
    path.write_text(text)
    with (tmp / f"{name}.log").open("a") as log:
        args = ["serve", "--config", str(path), "--port", str(port)]
        return start_isocost(args, stderr=log)


@dataclass
class Setup:
    gateway: Proc
    upstream: Proc
    config: Path
    log: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("loops")
    upstream = start_fake_upstream()
    gateway = serve(tmp, "gateway", config([upstream.url]))
    try:
        yield Setup(gateway, upstream, tmp / "gateway.yaml", tmp / "gateway.log")
    finally:
        gateway.stop()
        upstream.stop()


def own_forms(url: str) -> list[str]:
    port = url.rsplit(":", 1)[1]
    hosts = ["127.0.0.1", "localhost", "0.0.0.0", "LOCALHOST", "[::1]", "[0:0:0:0:0:0:0:1]"]
    hosts.append("[::ffff:127.0.0.1]")  # IPv4-mapped: connects to 127.0.0.1
    return [f"http://{host}:{port}" for host in hosts] + [url + "/"]


@pytest.mark.parametrize("form", range(8))  # see own_forms
def test_the_admin_api_refuses_the_gateway_own_address(setup: Setup, form: int) -> None:
    url = own_forms(setup.gateway.url)[form]
    replica = {"url": url, "cost_model": "llama-3.1-8b"}  # valid but for its address
    add = json.dumps({"model": "fake-model", "replica": replica}).encode()
    status, _, answer = http("POST", setup.gateway.url + "/admin/replicas", add, ADMIN)
    assert status == 400, answer
    assert "own address" in answer["error"]["message"]
    _, _, listing = http("GET", setup.gateway.url + "/admin/replicas", None, ADMIN)
    assert [row["url"] for row in listing["replicas"]] == [setup.upstream.url]


def test_a_reload_listing_the_gateway_itself_is_refused(setup: Setup) -> None:
    before = setup.log.read_text().count("config rejected")
    setup.config.write_text(config([setup.upstream.url, own_forms(setup.gateway.url)[1]]))
    wait_for(lambda: setup.log.read_text().count("config rejected") > before, 20, "rejection")
    _, _, listing = http("GET", setup.gateway.url + "/admin/replicas", None, ADMIN)
    assert [row["url"] for row in listing["replicas"]] == [setup.upstream.url]
    setup.config.write_text(config([setup.upstream.url]))


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "0.0.0.0"])
def test_start_refuses_a_config_listing_the_gateway_itself(tmp_path: Path, host: str) -> None:
    port = free_port()
    path = tmp_path / "self.yaml"
    path.write_text(config([f"http://{host}:{port}"]))
    done = subprocess.run(
        [ISOCOST, "serve", "--config", str(path), "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "own address" in done.stderr, done.stderr[-500:]


def test_forwarded_requests_carry_the_hop_count(setup: Setup) -> None:
    body = json.dumps({"model": "fake-model", "prompt": "hi", "max_tokens": 2}).encode()
    url = setup.gateway.url + "/v1/completions"
    assert http("POST", url, body, AUTH)[0] == 200
    assert http("POST", url, body, {**AUTH, "x-isocost-hops": str(MAX_HOPS)})[0] == 200
    hops = [entry["headers"].get("x-isocost-hops") for entry in received(setup.upstream.url)]
    assert hops[-2:] == ["1", str(MAX_HOPS + 1)]


@pytest.mark.parametrize(
    ("value", "status"), [(str(MAX_HOPS + 1), 508), ("99999", 508), ("-1", 400), ("x", 400)]
)
def test_too_many_or_bad_hops_are_refused_without_forwarding(
    setup: Setup, value: str, status: int
) -> None:
    body = json.dumps({"model": "fake-model", "prompt": "hi", "max_tokens": 2}).encode()
    seen = len(received(setup.upstream.url))
    got, headers, answer = http(
        "POST", setup.gateway.url + "/v1/completions", body, {**AUTH, "x-isocost-hops": value}
    )
    assert got == status, answer
    assert headers["Content-Type"].startswith("application/json")
    assert len(received(setup.upstream.url)) == seen


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_two_gateways_listing_each_other_answer_508(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    monkeypatch.setenv(KEY_ENV, API_KEY)  # each forwards with the other's key
    port_a, port_b = free_port(), free_port()
    url_a, url_b = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
    fields = f"api_key_env: {KEY_ENV}"
    gateway_a = serve(tmp_path, "a", config([url_b], fields), port_a)
    try:
        gateway_b = serve(tmp_path, "b", config([url_a], fields), port_b)
        try:
            chat = "chat" in path
            prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
            body = json.dumps({"model": "fake-model", "max_tokens": 2, **prompt}).encode()
            for url in (url_a, url_b):  # each sees the other healthy
                wait_for(lambda u=url: http("GET", u + "/health")[2]["routable_replicas"] == 1)
            status, _, answer = http("POST", url_a + path, body, AUTH, timeout_s=60)
            assert status == 508, answer
            assert answer["error"]["code"] == "loop_detected"
            # each gateway passed the request on at most MAX_HOPS times, and both stay up
            assert http("GET", url_a + "/health")[0] == http("GET", url_b + "/health")[0] == 200
        finally:
            gateway_b.stop()
    finally:
        gateway_a.stop()
        os.environ.pop(KEY_ENV, None)
