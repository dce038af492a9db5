"""Membership through an etcd that speaks only mutual TLS (``--client-cert-auth``), as
production etcd clusters do: the agent (``--etcd-ca-file``, ``--etcd-cert-file``,
``--etcd-key-file``) registers its engine and the gateway (``discovery.etcd.tls``) routes
to it; a gateway without a client certificate reports etcd unreachable and keeps
serving; bad TLS flags are one line and exit 2.

Real processes: etcd with certificates of throwaway CAs (``trustme``), ``isocost
engine``, ``isocost agent``, ``isocost serve``, the official ``openai`` client.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import trustme
from etcd_server import ETCD, EtcdServer, EtcdTls
from gateway_harness import admin_replicas, log_events, wait_for
from isocost_procs import ISOCOST, Proc, start_gateway_with, start_isocost

pytestmark = pytest.mark.skipif(ETCD is None, reason="no etcd binary (make test installs it)")

MODEL = "llama-3.1-8b"
PREFIX = "/isocost-tls"
TOKEN = "etcd-tls-token"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> EtcdTls:
    tmp = tmp_path_factory.mktemp("etcd-pki")
    ca = trustme.CA()  # one CA for both sides: etcd's own gateway dials it with its cert
    server = ca.issue_cert("127.0.0.1")
    client = ca.issue_cert("isocost")
    files = {
        "server_ca": ca.cert_pem,
        "client_ca": ca.cert_pem,
        "cert": server.cert_chain_pems[0],
        "key": server.private_key_pem,
        "client_cert": client.cert_chain_pems[0],
        "client_key": client.private_key_pem,
    }
    for name, blob in files.items():
        blob.write_to_path(str(tmp / f"{name}.pem"))
    return EtcdTls(**{name: tmp / f"{name}.pem" for name in files})


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory, tls: EtcdTls) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data", tls)
    server.start()
    yield server
    server.stop()


def gateway_yaml(etcd: EtcdServer, tls: str) -> str:
    return (
        f"discovery:\n  etcd: {{endpoints: ['{etcd.url}'], prefix: {PREFIX}, "
        f"probe_interval_ms: 200, max_backoff_ms: 500, timeout_ms: 1000, tls: {tls}}}\n"
        f"auth: {{admin_token: {TOKEN}}}\n"
    )


def test_agent_and_gateway_meet_through_an_mtls_etcd(
    tmp_path: Path, etcd: EtcdServer, tls: EtcdTls, procs: list[Proc]
) -> None:
    engine = start_isocost(["engine", "--port", "0", "--model", MODEL], "isocost engine")
    procs.append(engine)
    args = ["agent", "--engine", engine.url, "--etcd", etcd.url, "--name", "e1"]
    args += ["--prefix", PREFIX, "--ttl", "5", "--etcd-ca-file", str(tls.server_ca)]
    args += ["--etcd-cert-file", str(tls.client_cert), "--etcd-key-file", str(tls.client_key)]
    with (tmp_path / "agent.log").open("a") as log:
        procs.append(start_isocost(args, "isocost agent", stderr=log))
    with_cert = (
        f"{{ca_file: {tls.server_ca}, cert_file: {tls.client_cert}, key_file: {tls.client_key}}}"
    )
    gateway = start_gateway_with(gateway_yaml(etcd, with_cert), tmp_path, procs)
    wait_for(
        lambda: [r["name"] for r in admin_replicas(gateway.url, TOKEN)] == ["e1"],
        what="the agent's engine discovered over mTLS",
    )
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0) as client:
        answer = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert answer.usage is not None and answer.usage.completion_tokens == 2

    # the same etcd, a gateway that trusts it but has no certificate to show
    (tmp_path / "no-cert").mkdir()
    refused = start_gateway_with(
        gateway_yaml(etcd, f"{{ca_file: {tls.server_ca}}}"), tmp_path / "no-cert", procs
    )
    log = tmp_path / "no-cert" / "gateway.log"
    wait_for(lambda: log_events(log, "discovery_down"), what="etcd reported unreachable")
    assert admin_replicas(refused.url, TOKEN) == []
    assert "Traceback" not in log.read_text()


def _agent(*extra: str) -> subprocess.CompletedProcess[str]:
    args = [str(ISOCOST), "agent", "--engine", "http://127.0.0.1:9"]
    args += ["--etcd", "https://127.0.0.1:9", *extra]
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--etcd-ca-file", "/nonexistent/ca.pem"], "--etcd-ca-file"),
        (["--etcd-key-file", "/nonexistent/k.pem"], "--etcd-key-file"),
        (["--etcd-cert-file", "NOT_PEM"], "--etcd-cert-file"),
    ],
)
def test_bad_etcd_tls_flags_are_one_line_and_exit_2(
    tmp_path: Path, extra: list[str], flag: str
) -> None:
    (tmp_path / "not.pem").write_text("not a certificate\n")
    done = _agent(*[str(tmp_path / "not.pem") if a == "NOT_PEM" else a for a in extra])
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("error: ") and flag in lines[0], lines[0]
