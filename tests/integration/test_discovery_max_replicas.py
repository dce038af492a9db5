"""``discovery.max_replicas`` end to end, for each provider: a real `isocost serve` following
a real etcd, and one following ``kube_api.KubeApi`` through the official client, in front
of real `isocost engine` replicas. A flood past the bound leaves the gateway with the bound's
worth of replicas, the ones it already routed to among them, one warning per change of the
number ignored (not one per watch event or re-list) and that number on
``isocost_discovery_dropped``. Every wait polls against a deadline."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from etcd_server import ETCD, EtcdServer
from gateway_harness import http, log_events, metric_value, wait_for
from isocost_procs import Proc, spawn_ready, start_gateway_with
from kube_api import KubeApi
from test_discovery_kubernetes import ADMIN, MODEL, NAMESPACE, SERVICE, healthy, rows

from isocost.runtime.discovery.records import Registration

PREFIX = "/isocost-bound"


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    if ETCD is None:
        pytest.skip("no etcd binary (make test installs it)")
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    yield server
    server.stop()


def start_engines(procs: list[Proc], count: int) -> list[str]:
    """One `isocost engine` process serving ``count`` replicas; their URLs."""
    args = ["engine", "--port", "0", "--replicas", str(count), "--model", MODEL]
    popen, urls = spawn_ready(args, "isocost engine", count)
    procs.append(Proc(popen, urls[0]))
    return urls


def start_gateway(tmp: Path, discovery: str, procs: list[Proc]) -> Proc:
    config = f"""
scrape_interval_ms: 100
discovery:
{discovery}
health: {{interval_ms: 100, timeout_ms: 300, open_ms: 300}}
auth: {{admin_token: {ADMIN["Authorization"].split()[1]}}}
"""
    return start_gateway_with(config, tmp, procs)


def names(gateway: Proc) -> list[str]:
    return sorted(rows(gateway))


def gauge(gateway: Proc, series: str) -> float | None:
    return metric_value(gateway.url, series)


def served_by(gateway: Proc, requests: int) -> set[str]:
    """The replicas that answered ``requests`` completions, each answered 200."""
    body = json.dumps({"model": MODEL, "prompt": "Which replica?", "max_tokens": 2}).encode()
    replicas = set()
    for _ in range(requests):
        status, headers, answer = http(
            "POST", gateway.url + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        assert status == 200, answer
        replicas.add(headers["x-isocost-replica"])
    return replicas


def limit_events(tmp: Path) -> list[dict[str, Any]]:
    """The gateway's log lines about the bound, in order."""
    return log_events(tmp / "gateway.log", "discovery_over_limit")


def test_an_etcd_flood_past_the_bound_keeps_the_replicas_routed_to(
    tmp_path: Path, etcd: EtcdServer, procs: list[Proc]
) -> None:
    urls = start_engines(procs, 6)
    gateway = start_gateway(
        tmp_path,
        f"  max_replicas: 3\n  etcd: {{endpoints: ['{etcd.url}'], prefix: {PREFIX},"
        " probe_interval_ms: 200, max_backoff_ms: 500, timeout_ms: 500}",
        procs,
    )
    dropped = 'isocost_discovery_dropped{provider="etcd"}'

    def put(*records: tuple[str, str, str], weight: float = 1.0) -> dict[str, Any]:
        """(key, name, url) records written in one transaction: one revision, one event."""
        puts = [
            {
                "request_put": {
                    "key": base64.b64encode(f"{PREFIX}/replicas/{key}".encode()).decode(),
                    "value": base64.b64encode(
                        Registration(name=name, url=url, models=[MODEL], weight=weight).encode()
                    ).decode(),
                }
            }
            for key, name, url in records
        ]
        return etcd.call("/v3/kv/txn", {"success": puts})

    put(("z-r0", "r0", urls[0]))
    put(("z-r1", "r1", urls[1]))
    wait_for(lambda: healthy(gateway) == ["r0", "r1"], 10, "r0 and r1 routable")
    assert served_by(gateway, 6) <= {"r0", "r1"}
    assert limit_events(tmp_path) == []

    # 4 more at once, their keys sorting before the incumbents': 6 registered, bound 3
    put(*((f"a{i}", f"a{i}", urls[2 + i]) for i in range(4)))
    wait_for(lambda: gauge(gateway, dropped) == 3, 5, "3 registrations ignored")
    wait_for(lambda: healthy(gateway) == ["a0", "r0", "r1"], 5, "a0 joined, r0 and r1 kept")
    assert names(gateway) == ["a0", "r0", "r1"]
    assert gauge(gateway, 'isocost_discovery_replicas{provider="etcd"}') == 3
    assert served_by(gateway, 12) <= {"a0", "r0", "r1"}
    (warning,) = limit_events(tmp_path)
    assert (warning["level"], warning["dropped"], warning["max_replicas"]) == ("warning", 3, 3)

    put(("a3", "a3", urls[5]))  # events that leave the count as it is: no log line
    put(("z-r1", "r1", urls[1]), weight=2.0)
    wait_for(lambda: rows(gateway)["r1"]["weight"] == 2.0, 5, "r1's new weight applied")
    assert len(limit_events(tmp_path)) == 1
    etcd.call(
        "/v3/kv/deleterange",
        {"key": base64.b64encode(f"{PREFIX}/replicas/z-r0".encode()).decode()},
    )  # r0 leaves: the first registered of those ignored takes its place
    wait_for(lambda: names(gateway) == ["a0", "a1", "r1"], 5, "a1 in r0's place")
    wait_for(lambda: gauge(gateway, dropped) == 2, 5, "2 registrations ignored")
    assert [e["dropped"] for e in limit_events(tmp_path)] == [3, 2]
    assert "Traceback" not in (tmp_path / "gateway.log").read_text()


def test_a_kubernetes_relist_past_the_bound_keeps_the_replicas_routed_to(
    tmp_path: Path, kube: KubeApi, procs: list[Proc]
) -> None:
    ports = [int(url.rsplit(":", 1)[1]) for url in start_engines(procs, 5)]
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", "kube-token-b0d")

    def put_slice(name: str, port: int) -> None:
        kube.put_slice(
            NAMESPACE, f"vllm-{name}", port=port, endpoints=[("127.0.0.1", f"pod-{name}", True)],
            labels=SERVICE, annotations={"isocost.io/model": MODEL},
        )  # fmt: skip

    put_slice("y", ports[0])
    put_slice("z", ports[1])
    gateway = start_gateway(
        tmp_path,
        f"  max_replicas: 2\n  kubernetes: {{namespace: {NAMESPACE}, service: vllm,"
        f" port_name: http, kubeconfig: '{kubeconfig}', max_backoff_ms: 300}}",
        procs,
    )
    dropped = 'isocost_discovery_dropped{provider="kubernetes"}'
    wait_for(lambda: healthy(gateway) == ["pod-y", "pod-z"], 10, "pod-y and pod-z routable")
    assert served_by(gateway, 6) <= {"pod-y", "pod-z"}

    # While the API is away a selector's worth of endpoints appears; the list that follows
    # names them first, as an API server lists slices by name.
    kube.go_down()
    wait_for(lambda: gauge(gateway, 'isocost_discovery_up{provider="kubernetes"}') == 0, 10,
             "the API seen down")  # fmt: skip
    kube.delete_slice(NAMESPACE, "vllm-y")
    kube.delete_slice(NAMESPACE, "vllm-z")
    for name, port in zip("abc", ports[2:], strict=True):
        put_slice(name, port)
    put_slice("y", ports[0])
    put_slice("z", ports[1])
    lists = len(kube.lists)
    kube.come_up()
    wait_for(lambda: gauge(gateway, dropped) == 3, 10, "3 endpoints ignored after the list")
    assert len(kube.lists) == lists + 1
    assert names(gateway) == ["pod-y", "pod-z"]
    assert served_by(gateway, 12) <= {"pod-y", "pod-z"}
    (warning,) = limit_events(tmp_path)
    assert (warning["dropped"], warning["max_replicas"]) == (3, 2)

    kube.compact()  # a 410 Gone, so another list: the same replicas, no second warning
    wait_for(lambda: len(kube.lists) == lists + 2, 5, "a list after 410 Gone")
    kube.put_slice(
        NAMESPACE, "vllm-z", port=ports[1], endpoints=[("127.0.0.1", "pod-z", True)],
        labels={**SERVICE, "isocost.io/gpu": "h100-80g"}, annotations={"isocost.io/model": MODEL},
    )  # fmt: skip
    wait_for(lambda: rows(gateway)["pod-z"]["gpu"] == "h100-80g", 5, "pod-z's change applied")
    assert names(gateway) == ["pod-y", "pod-z"]
    assert len(limit_events(tmp_path)) == 1

    kube.delete_slice(NAMESPACE, "vllm-y")  # pod-y leaves: pod-a, listed first, takes over
    wait_for(lambda: healthy(gateway) == ["pod-a", "pod-z"], 5, "pod-a in pod-y's place")
    wait_for(lambda: gauge(gateway, dropped) == 2, 5, "2 endpoints ignored")
    kube.delete_slice(NAMESPACE, "vllm-b")
    wait_for(lambda: gauge(gateway, dropped) == 1, 5, "1 endpoint ignored")
    kube.delete_slice(NAMESPACE, "vllm-c")
    wait_for(lambda: gauge(gateway, dropped) == 0, 5, "nothing ignored")
    assert names(gateway) == ["pod-a", "pod-z"]
    assert [e["dropped"] for e in limit_events(tmp_path)] == [3, 2, 1]
    log = (tmp_path / "gateway.log").read_text()
    assert log.count('"discovery_within_limit"') == 1
