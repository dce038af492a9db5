"""TLS to https:// replicas (``upstream_tls``): the gateway verifies them against the CA
the config names and presents its own certificate where they require one (mutual TLS);
a replica it cannot verify, or that refuses it, is an OpenAI-style error and a log line,
never a traceback; a TLS file that is missing or unusable is one line and exit 2 before
any port opens.

Real processes: HTTPS fake upstreams (``fake_upstream --tls-cert``) with certificates of a
throwaway CA (``trustme``), ``isocost serve`` with its config in ``tmp_path``, the
official ``openai`` client.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import trustme
from fake_upstream import start_fake_upstream
from gateway_harness import admin_replicas, log_events, wait_for
from isocost_procs import Proc, start_isocost

ISOCOST = Path(sys.executable).with_name("isocost")
MODEL = "llama-3.1-8b"
TOKEN = "tls-admin-token"


@dataclass
class Pki:
    ca: Path  # signs the replicas' certificates
    server: list[str]  # fake_upstream's arguments for its certificate and key
    client_ca: Path  # signs the gateway's client certificate
    client_cert: Path
    client_key: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    tmp = tmp_path_factory.mktemp("pki")
    ca, client_ca = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(tmp / "ca.pem"))
    client_ca.cert_pem.write_to_path(str(tmp / "client-ca.pem"))
    server = ca.issue_cert("127.0.0.1")
    server.private_key_pem.write_to_path(str(tmp / "server.key"))
    server.cert_chain_pems[0].write_to_path(str(tmp / "server.pem"))
    client = client_ca.issue_cert("isocost-gateway")
    client.private_key_pem.write_to_path(str(tmp / "client.key"))
    client.cert_chain_pems[0].write_to_path(str(tmp / "client.pem"))
    return Pki(
        ca=tmp / "ca.pem",
        server=["--tls-cert", str(tmp / "server.pem"), "--tls-key", str(tmp / "server.key")],
        client_ca=tmp / "client-ca.pem",
        client_cert=tmp / "client.pem",
        client_key=tmp / "client.key",
    )


def config_text(url: str, tls: str = "") -> str:
    return (
        f"auth: {{admin_token: {TOKEN}}}\n"
        f"health: {{interval_ms: 100, timeout_ms: 500, open_ms: 300}}\n"
        f"limits: {{max_retries: 0}}\n{tls}"
        f"pools:\n  - model: {MODEL}\n    replicas:\n      - {{url: '{url}', name: r0}}\n"
    )


def start_gateway(tmp_path: Path, text: str, procs: list[Proc]) -> tuple[Proc, Path]:
    config, log = tmp_path / "gateway.yaml", tmp_path / "gateway.log"
    config.write_text(text)
    with log.open("a") as sink:
        gateway = start_isocost(["serve", "--config", str(config), "--port", "0"], stderr=sink)
    procs.append(gateway)
    return gateway, log


def client(gateway: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


def row(gateway: Proc) -> dict[str, Any]:
    (only,) = admin_replicas(gateway.url, TOKEN)
    return only


def test_https_replicas_are_verified_against_the_configured_ca(
    pki: Pki, tmp_path: Path, procs: list[Proc]
) -> None:
    upstream = start_fake_upstream(tls=pki.server)
    procs.append(upstream)
    assert upstream.url.startswith("https://")
    gateway, log = start_gateway(
        tmp_path, config_text(upstream.url, f"upstream_tls: {{ca_file: {pki.ca}}}\n"), procs
    )
    with client(gateway) as openai_client:
        answer = openai_client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert answer.choices[0].text == "hello"
        stream = openai_client.completions.create(
            model=MODEL, prompt="hi", max_tokens=2, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == "hello"
    wait_for(
        lambda: row(gateway)["scrape_age_s"] is not None and row(gateway)["scrape_error"] is None,
        what="the replica's /metrics scraped over TLS",
    )
    assert "Traceback" not in log.read_text()


def test_a_replica_the_gateway_cannot_verify_is_an_error_not_a_traceback(
    pki: Pki, tmp_path: Path, procs: list[Proc]
) -> None:
    upstream = start_fake_upstream(tls=pki.server)
    procs.append(upstream)
    gateway, log = start_gateway(tmp_path, config_text(upstream.url), procs)  # system store
    with client(gateway) as refused, pytest.raises(openai.APIStatusError) as raised:
        refused.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert raised.value.status_code in (502, 503)
    assert isinstance(raised.value.body, dict) and raised.value.body.get("message")
    wait_for(
        lambda: row(gateway)["state"] == "ejected",
        what="the replica ejected",
        state=lambda: row(gateway),
    )
    assert "TLS: certificate verify failed" in str(row(gateway)["last_error"]), row(gateway)
    (ejected,) = log_events(log, "replica_ejected")
    assert ejected["replica"] == "r0" and "TLS: certificate verify failed" in ejected["error"]
    assert "Traceback" not in log.read_text()


def test_mutual_tls_presents_the_configured_client_certificate(
    pki: Pki, tmp_path: Path, procs: list[Proc]
) -> None:
    upstream = start_fake_upstream(tls=[*pki.server, "--tls-client-ca", str(pki.client_ca)])
    procs.append(upstream)
    with_cert = (
        f"upstream_tls: {{ca_file: {pki.ca}, cert_file: {pki.client_cert}, "
        f"key_file: {pki.client_key}}}\n"
    )
    gateway, _ = start_gateway(tmp_path, config_text(upstream.url, with_cert), procs)
    with client(gateway) as presenting:
        answer = presenting.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert answer.choices[0].text == "hello"
    # the same replica, a gateway with no client certificate: refused by the replica
    (tmp_path / "other").mkdir()
    other, log = start_gateway(
        tmp_path / "other",
        config_text(upstream.url, f"upstream_tls: {{ca_file: {pki.ca}}}\n"),
        procs,
    )
    with client(other) as refused, pytest.raises(openai.APIStatusError) as raised:
        refused.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert raised.value.status_code in (502, 503)
    # TLS 1.3: the replica checks the client's certificate after the handshake, so what
    # the gateway sees is a disconnect, not a TLS reason
    wait_for(lambda: log_events(log, "replica_ejected"), what="the replica ejected")
    assert "Traceback" not in log.read_text()


def _refusal(tmp_path: Path, tls: str) -> str:
    config = tmp_path / "gateway.yaml"
    config.write_text(config_text("https://127.0.0.1:9", tls))
    done = subprocess.run(
        [str(ISOCOST), "serve", "--config", str(config), "--port", "0"],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr[-2000:])
    assert lines[0].startswith("error: ") and "Traceback" not in done.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("tls", "words"),
    [
        ("{ca_file: /nonexistent/ca.pem}", ["upstream_tls.ca_file", "No such file"]),
        ("{ca_file: NOT_PEM}", ["upstream_tls.ca_file", "cannot be used"]),
        ("{cert_file: CLIENT_CERT, key_file: SERVER_KEY}", ["upstream_tls.cert_file"]),
        ("{key_file: CLIENT_KEY}", ["upstream_tls.key_file", "cert_file"]),
        ("{ca_file: CA, verify: false}", ["verify"]),
    ],
    ids=["missing", "not-pem", "key-of-another-cert", "key-without-cert", "unknown-key"],
)
def test_a_bad_tls_setting_is_one_line_and_exit_2(
    pki: Pki, tmp_path: Path, tls: str, words: list[str]
) -> None:
    (tmp_path / "not.pem").write_text("not a certificate\n")
    files = {
        "NOT_PEM": tmp_path / "not.pem",
        "CLIENT_CERT": pki.client_cert,
        "CLIENT_KEY": pki.client_key,
        "SERVER_KEY": Path(pki.server[3]),
        "CA": pki.ca,
    }
    for name, path in files.items():
        tls = tls.replace(name, str(path))
    line = _refusal(tmp_path, f"upstream_tls: {tls}\n")
    for word in words:
        assert word in line, line
    json.dumps(line)  # one plain line
