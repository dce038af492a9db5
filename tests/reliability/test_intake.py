"""Request intake of `isocost serve` under hostile input: output caps, header bytes, deep JSON.

One gateway in front of a fake upstream (tests/support/fake_upstream.py), with a metered
key; raw sockets send the header bytes no client library would. ``isocost engine`` gets
the deep-JSON bodies too (it shares the one request decoder).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import rawhttp
from aiohttp.test_utils import TestClient, TestServer
from fake_upstream import set_mode, start_fake_upstream
from gateway_harness import gateway_config, http
from isocost_procs import Proc, start_isocost

import isocost.gateway.body
from isocost.core.catalog import Catalog
from isocost.gateway.app import build_app
from isocost.gateway.server import load_gateway
from isocost.runtime.config import parse_config

MODEL = "fake-model"
API_KEY = "sk-intake-5f1e9a77"
METERED_KEY = "sk-metered-0c3d2b19"
ADMIN_TOKEN = "admin-intake-8e2a"
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
MAX_TOKENS = 64
ENDPOINTS = ["/v1/completions", "/v1/chat/completions"]


@dataclass
class Setup:
    gateway: Proc
    upstream: Proc
    engine: Proc


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("intake")
    upstream = start_fake_upstream()
    engine = start_isocost(["engine", "--port", "0", "--model", "llama-3.1-8b"])
    config = tmp / "gateway.yaml"
    config.write_text(
        gateway_config(
            [upstream.url],
            model=MODEL,
            admin_token=ADMIN_TOKEN,
            api_key=API_KEY,
            replica_fields="cost_model: llama-3.1-8b",
            max_tokens=MAX_TOKENS,
            keys="\n".join(
                f"    - {{name: {field}, key: {METERED_KEY}-{field}, tokens_per_minute: 300}}"
                for field in ("max_tokens", "max_completion_tokens", "uncapped")
            ),
        )
    )
    with (tmp / "gateway.log").open("a") as log:
        gateway = start_isocost(["serve", "--config", str(config), "--port", "0"], stderr=log)
    try:
        yield Setup(gateway, upstream, engine)
    finally:
        for proc in (gateway, upstream, engine):
            proc.stop()


def body(path: str, **fields: object) -> bytes:
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {}
    prompt = prompt or {"prompt": "hi"}
    return json.dumps({"model": MODEL, **prompt, **fields}).encode()


# -- output caps: the field the engine runs is the one checked and charged -------------


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_output_cap_limit_holds_for_either_field(setup: Setup, path: str, field: str) -> None:
    url = setup.gateway.url + path
    status, _, answer = http("POST", url, body(path, **{field: MAX_TOKENS + 1}), AUTH)
    assert status == 400, answer
    assert answer["error"]["code"] == "max_tokens_exceeded"
    assert answer["error"]["param"] == field
    assert http("POST", url, body(path, **{field: MAX_TOKENS}), AUTH)[0] == 200


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize(("small", "large"), [(1, MAX_TOKENS), (MAX_TOKENS, 10**6)])
def test_output_cap_fields_that_disagree_are_refused(
    setup: Setup, path: str, small: int, large: int
) -> None:
    url = setup.gateway.url + path
    for fields in (
        {"max_tokens": small, "max_completion_tokens": large},
        {"max_tokens": large, "max_completion_tokens": small},
    ):
        status, _, answer = http("POST", url, body(path, **fields), AUTH)
        assert status == 400, answer
        assert answer["error"]["param"] == "max_completion_tokens"
    both = {"max_tokens": small, "max_completion_tokens": small}
    assert http("POST", url, body(path, **both), AUTH)[0] == 200


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_output_cap_is_charged_to_the_key_token_budget(setup: Setup, field: str) -> None:
    # 300 tokens per minute; each request asks for 60 output tokens (+1 prompt token)
    headers = {**AUTH, "Authorization": f"Bearer {METERED_KEY}-{field}"}
    url = setup.gateway.url + "/v1/completions"
    statuses = [http("POST", url, body(url, **{field: 60}), headers)[0] for _ in range(8)]
    assert 429 in statuses, statuses
    assert statuses[0] == 200


def test_an_uncapped_answer_is_charged_to_the_key_token_budget_once_known(
    setup: Setup,
) -> None:
    # 300 tokens per minute; a chat without a cap pays its prompt up front, its output after
    headers = {**AUTH, "Authorization": f"Bearer {METERED_KEY}-uncapped"}
    url = setup.gateway.url + "/v1/chat/completions"
    set_mode(setup.upstream.url, completion_tokens=1000)
    try:
        assert http("POST", url, body(url), headers)[0] == 200
    finally:
        set_mode(setup.upstream.url, completion_tokens=2)
    status, got, answer = http("POST", url, body(url), headers)
    assert status == 429, answer
    assert float(got["Retry-After"]) > 0


# -- header bytes that are no UTF-8 ------------------------------------------------------

LATIN1 = b"caf\xe9-\xff"


def send(setup: Setup, method: str, path: str, headers: dict[str, bytes | str]) -> tuple:
    data = b"" if method == "GET" else body(path, max_tokens=4)
    answer = rawhttp.exchange(setup.gateway.url, rawhttp.request(method, path, headers, data))
    return rawhttp.parse(answer)


@pytest.mark.parametrize(
    ("path", "headers", "expected"),
    [
        ("/v1/completions", {"Authorization": b"Bearer " + LATIN1}, 401),
        ("/v1/completions", {"Authorization": b"Bearer " + API_KEY.encode() + b"\xe9"}, 401),
        ("/v1/completions", {"Authorization": LATIN1}, 401),
        ("/v1/models", {"Authorization": b"Bearer " + LATIN1}, 401),
        ("/admin/replicas", {"Authorization": b"Bearer " + LATIN1}, 401),
        ("/admin/replicas", {"X-Admin-Token": LATIN1}, 401),
        ("/admin/replicas", {"X-Admin-Token": ADMIN_TOKEN.encode() + b"\xe9"}, 401),
    ],
)
def test_undecodable_credentials_are_wrong_credentials(
    setup: Setup, path: str, headers: dict[str, bytes | str], expected: int
) -> None:
    method = "POST" if path.startswith("/v1/c") else "GET"
    status, got, answer = send(setup, method, path, headers)
    assert status == expected, answer
    assert got["content-type"].startswith("application/json")
    assert answer["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/route"])
def test_undecodable_session_ids_route_by_their_bytes(setup: Setup, path: str) -> None:
    headers: dict[str, bytes | str] = {**AUTH, "X-Session-Id": LATIN1}
    query = "?kind=completion" if path == "/v1/route" else ""
    data = body(path if path != "/v1/route" else "/v1/completions", max_tokens=4)
    for _ in range(2):  # the second finds the affinity the first left
        answer = rawhttp.exchange(
            setup.gateway.url, rawhttp.request("POST", path + query, headers, data)
        )
        status, _, parsed = rawhttp.parse(answer)
        assert status == 200, parsed


@pytest.mark.parametrize(
    "name", ["X-Priority", "X-Deadline-Ms", "X-Tpot-Ms", "X-Isocost-Class", "X-Request-Id"]
)
@pytest.mark.parametrize("value", [LATIN1, b"\xc3\x28", b"ok" + b"\x80" * 300])
def test_undecodable_routing_headers_get_400(setup: Setup, name: str, value: bytes) -> None:
    status, got, answer = send(setup, "POST", "/v1/completions", {**AUTH, name: value})
    assert status == 400, answer
    assert got["content-type"].startswith("application/json")
    assert answer["error"]["code"] == "bad_header"


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": b"Bearer " + API_KEY.encode() + b"\x01"},  # a control byte
        {"Authorization": b"Bearer \x7f" + API_KEY.encode()},
        {"X-Session-Id": b"a\x00b"},
        {"Authorization": b"Bearer " + b"k" * 20000},  # over aiohttp's field limit
        {"X-Session-Id": b"s" * 20000},
        {"X-Isocost-Class": b"\xe9" * 9000},
    ],
)
def test_hostile_header_bytes_never_get_a_5xx(
    setup: Setup, headers: dict[str, bytes | str]
) -> None:
    status, _, _ = send(
        setup, "POST", "/v1/completions", {"Content-Type": "application/json", **headers}
    )
    assert 400 <= status < 500
    assert http("GET", setup.gateway.url + "/health")[0] == 200


# -- JSON nested too deeply --------------------------------------------------------------

DEEP = b"[" * 5000 + b"]" * 5000


def deep_bodies(chat: bool) -> list[bytes]:
    head = b'{"model": "%s", ' % MODEL.encode()
    prompt = b'"messages": [{"role": "user", "content": "hi"}]' if chat else b'"prompt": "hi"'
    return [
        head + prompt + b', "extra": ' + DEEP + b"}",  # a field nobody reads
        head + prompt + b', "n": ' + DEEP + b"}",
        head + prompt + b', "stream_options": {"x": ' + DEEP + b"}}",
        head + (b'"messages": ' if chat else b'"prompt": ') + DEEP + b"}",
        b'{"model": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3000 + b"}",
    ]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("which", range(5))
def test_deep_json_gets_400_from_the_gateway_and_the_engine(
    setup: Setup, path: str, which: int
) -> None:
    data = deep_bodies("chat" in path)[which]
    for url in (setup.gateway.url, setup.engine.url):
        request = data.replace(MODEL.encode(), b"llama-3.1-8b") if url == setup.engine.url else data
        status, got, answer = http("POST", url + path, request, AUTH)
        assert status == 400, (url, answer)
        assert got["Content-Type"].startswith("application/json")
        assert answer["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/admin/replicas", "/admin/policy"])
def test_deep_json_gets_400_from_the_admin_api(setup: Setup, path: str) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}
    for data in (DEEP, b'{"model": ' + DEEP + b"}"):
        status, got, answer = http("POST", setup.gateway.url + path, data, headers)
        assert status == 400, answer
        assert got["Content-Type"].startswith("application/json")


# -- limits before hashing ---------------------------------------------------------------


def test_refused_prompts_are_never_hashed(tmp_path: Path) -> None:
    """In process, to count calls: a prompt over ``max_prompt_tokens`` or a request over
    ``max_tokens`` is refused before its block hashes are computed."""
    text = gateway_config(
        ["http://127.0.0.1:9"],
        model=MODEL,
        admin_token=ADMIN_TOKEN,
        api_key=API_KEY,
        replica_fields="cost_model: llama-3.1-8b",
        max_tokens=MAX_TOKENS,
        max_body_bytes=1 << 20,
    )
    gateway = load_gateway(parse_config(text, "test"), Catalog.builtin(), None)
    long_prompt = "word " * 40_000  # ~50,000 tokens, over max_prompt_tokens (8000)

    async def run() -> list[int]:
        client = TestClient(TestServer(build_app(gateway)))
        await client.start_server()
        try:
            statuses = []
            for path in ENDPOINTS:
                refused = [
                    body(path, prompt=long_prompt)
                    if "chat" not in path
                    else json.dumps(
                        {"model": MODEL, "messages": [{"role": "user", "content": long_prompt}]}
                    ).encode(),
                    body(path, max_tokens=MAX_TOKENS + 1),
                    body(path, max_completion_tokens=MAX_TOKENS + 1),
                ]
                for data in refused:
                    response = await client.post(path, data=data, headers=AUTH)
                    statuses.append(response.status)
            return statuses
        finally:
            await client.close()

    spy = mock.patch.object(
        isocost.gateway.body, "text_block_hashes", wraps=isocost.gateway.body.text_block_hashes
    )
    with spy as hashes:
        statuses = asyncio.run(run())
    assert statuses == [400] * 6
    assert hashes.call_count == 0
