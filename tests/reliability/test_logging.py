"""The gateway's stderr is one JSON object per line, with no key, token or prompt in it.

Requests aiohttp's HTTP parser rejects make aiohttp log the error with a traceback whose
message quotes the raw request bytes. A gateway (debug logging, so even the debug-level
parser errors are written) gets such requests over raw sockets, each carrying the API key,
the admin token or prompt bytes; then every line of its stderr must parse as one JSON
object and none may contain a secret or the prompt.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import rawhttp
from fake_upstream import start_fake_upstream
from gateway_harness import gateway_config, http, wait_for
from isocost_procs import Proc, start_isocost

from isocost.runtime.logs import JsonFormatter

API_KEY = "sk-logging-4b7e1c02"
ADMIN_TOKEN = "admin-logging-91d3"
PROMPT = "confidential-prompt-6a2f"


@dataclass
class Setup:
    gateway: Proc
    upstream: Proc
    log: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("logging")
    upstream = start_fake_upstream()
    config, log = tmp / "gateway.yaml", tmp / "gateway.log"
    config.write_text(
        gateway_config(
            [upstream.url],
            model="fake-model",
            admin_token=ADMIN_TOKEN,
            api_key=API_KEY,
            replica_fields="cost_model: llama-3.1-8b",
        )
    )
    with log.open("a") as sink:
        args = ["serve", "--config", str(config), "--port", "0", "--log-level", "debug"]
        gateway = start_isocost(args, stderr=sink)
    try:
        yield Setup(gateway, upstream, log)
    finally:
        gateway.stop()
        upstream.stop()


def _completion() -> bytes:
    return json.dumps({"model": "fake-model", "prompt": PROMPT, "max_tokens": 2}).encode()


KEY, TOKEN, BODY = API_KEY.encode(), ADMIN_TOKEN.encode(), _completion()
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
MALFORMED = {
    "control byte in the key": HEAD + b"Authorization: Bearer " + KEY + b"\x01\r\n\r\n",
    "control byte before the key": HEAD + b"Authorization: Bearer \x7f" + KEY + b"\r\n\r\n",
    "control byte in x-api-key": HEAD + b"X-Api-Key: " + KEY + b"\x00\r\n\r\n",
    "control byte in the admin token": (
        b"GET /admin/replicas HTTP/1.1\r\nX-Admin-Token: " + TOKEN + b"\x02\r\n\r\n"
    ),
    "over-long key": HEAD + b"Authorization: Bearer " + KEY + b"k" * 20000 + b"\r\n\r\n",
    "over-long header after the key": (
        HEAD + b"Authorization: Bearer " + KEY + b"\r\nX-Pad: " + b"p" * 20000 + b"\r\n\r\n"
    ),
    "bad header name": HEAD + b"Authorization: Bearer " + KEY + b"\r\nX-B\x01d: 1\r\n\r\n",
    "prompt in the request target": b"GET /" + PROMPT.encode() + b"\x00 HTTP/1.1\r\n\r\n",
    "prompt as a method": PROMPT.encode() + b" / HTTP/1.1\r\n\r\n",
    "body past its length (prompt as the next request)": (
        HEAD
        + b"Authorization: Bearer "
        + KEY
        + b"\r\nContent-Length: 10\r\n\r\n"
        + BODY[:10]
        + b"\x00"
        + BODY[10:]
        + b"\r\n\r\n"
    ),
    "broken chunked body": (
        HEAD
        + b"Authorization: Bearer "
        + KEY
        + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
        + PROMPT.encode()
        + b"\r\n"
        + BODY
        + b"\r\n0\r\n\r\n"
    ),
    "bad http version": b"GET /health HTTP/9." + PROMPT.encode() + b"\r\n\r\n",
}


def test_every_stderr_line_is_json_without_secrets_or_prompts(setup: Setup) -> None:
    url = setup.gateway.url
    status, _, _ = http("POST", url + "/v1/completions", _completion(), {
        "Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})  # fmt: skip
    assert status == 200
    for data in MALFORMED.values():
        answer = rawhttp.exchange(url, data)
        assert answer, data[:60]
        status, headers, error = rawhttp.parse(answer)
        assert 400 <= status < 500 and error is not None, answer[:300]
        assert headers["content-type"].startswith("application/json")
        for secret in (KEY, TOKEN, PROMPT.encode()):
            assert secret not in answer  # the refusal does not echo the request
    assert http("GET", url + "/health")[0] == 200

    def parser_errors_logged() -> bool:
        return setup.log.read_bytes().count(b"Error handling request") >= len(MALFORMED) - 2

    wait_for(parser_errors_logged, 30, "aiohttp's parser errors in the log")
    raw = setup.log.read_bytes()
    for secret in (KEY, TOKEN, PROMPT.encode()):
        assert secret not in raw, secret
    loggers = set()
    for line in raw.decode("utf-8").splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)  # one JSON object per line, tracebacks included
        assert isinstance(entry, dict) and {"ts", "level", "msg"} <= entry.keys(), line
        loggers.add(entry.get("logger", ""))
    assert any(name.startswith("aiohttp") for name in loggers), loggers
    assert any(name.startswith("isocost") for name in loggers), loggers


@pytest.mark.parametrize(
    "text",
    [
        f"Authorization: Bearer {API_KEY}",
        f"authorization={API_KEY}",
        f"headers {{'X-Api-Key': '{API_KEY}'}}",
        f"x-admin-token: {ADMIN_TOKEN}",
        f"Bearer {API_KEY}",
        f"Basic {API_KEY}",
    ],
)
def test_credentials_are_redacted_from_messages_fields_and_tracebacks(text: str) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("isocost.test_logging")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("seen %s", text, extra={"detail": text})
        try:
            raise ValueError(text)
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    for line in lines:
        assert isinstance(json.loads(line), dict)
        assert API_KEY not in line and ADMIN_TOKEN not in line
        assert "[redacted]" in line
    assert "ValueError" in json.loads(lines[1])["exc"]
