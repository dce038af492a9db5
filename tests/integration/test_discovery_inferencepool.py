"""Kubernetes discovery from an InferencePool, end to end short of a cluster: `isocost serve`
with ``discovery.kubernetes.inference_pool``, the official ``kubernetes_asyncio`` client and
a kubeconfig, against ``kube_api.KubeApi`` (InferencePool and Pod JSON with
resourceVersions, selectors, bookmarks and 410 Gone), routing to real `isocost engine`
processes on loopback addresses (a Pod's IP). The provider reads the pool's selector and
target ports, then the Pods they pick. Not run against a real cluster here."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from gateway_harness import http, log_events, wait_for
from isocost_procs import Proc, free_port, start_gateway_with, start_isocost
from kube_api import PODS, POOLS, KubeApi
from test_discovery_kubernetes import ADMIN, MODEL, NAMESPACE, discovery_up, healthy, rows

from isocost.core.errors import ConfigError
from isocost.runtime.config import KubernetesDiscoveryConfig, parse_config
from isocost.runtime.discovery.kube_records import PoolTarget, pod_records, pool_target
from isocost.runtime.discovery.records import Malformed, Registration

POOL = "llama"
VLLM = {"app": "vllm"}
ANNOTATIONS = {"isocost.io/model": MODEL}


def start_gateway(tmp: Path, kube: KubeApi, procs: list[Proc]) -> Proc:
    kubeconfig = kube.write_kubeconfig(tmp / "kubeconfig", "kube-token-pool")
    config = f"""
scrape_interval_ms: 100
discovery:
  kubernetes: {{namespace: {NAMESPACE}, inference_pool: {POOL},
                kubeconfig: '{kubeconfig}', max_backoff_ms: 300}}
health: {{interval_ms: 100, timeout_ms: 300, open_ms: 300}}
auth: {{admin_token: {ADMIN["Authorization"].split()[1]}}}
"""
    return start_gateway_with(config, tmp, procs)


def start_engine(procs: list[Proc], host: str, port: int) -> Proc:
    """An engine at ``host:port``, as a model server Pod at its IP and target port."""
    args = ["engine", "--host", host, "--port", str(port), "--model", MODEL, "--gpu", "a100-80g"]
    engine = start_isocost(args, "isocost engine")
    procs.append(engine)
    return engine


def events(tmp: Path, name: str) -> list[dict[str, Any]]:
    """The gateway's log records of event ``name``."""
    return log_events(tmp / "gateway.log", name)


def urls(gateway: Proc) -> dict[str, str]:
    return {name: row["url"] for name, row in rows(gateway).items()}


def start_two_tiers(tmp_path: Path, kube: KubeApi, procs: list[Proc]) -> tuple[int, Proc]:
    """Engines on 127.0.0.1 and 127.0.0.2 (one port), Pods ``pod-a`` (tier a) and
    ``pod-b`` (tier b) over them, the pool selecting tier a, and a gateway following it."""
    port = free_port()
    start_engine(procs, "127.0.0.1", port)
    start_engine(procs, "127.0.0.2", port)
    kube.put_pool(NAMESPACE, POOL, match_labels={**VLLM, "tier": "a"}, ports=[port])
    kube.put_pod(NAMESPACE, "pod-a", ip="127.0.0.1", labels={**VLLM, "tier": "a"},
                 annotations=ANNOTATIONS)  # fmt: skip
    kube.put_pod(NAMESPACE, "pod-b", ip="127.0.0.2", labels={**VLLM, "tier": "b"},
                 annotations=ANNOTATIONS)  # fmt: skip
    return port, start_gateway(tmp_path, kube, procs)


def test_ready_pods_of_the_pool_join_with_their_annotations_and_leave_when_not_ready(
    tmp_path: Path, kube: KubeApi, procs: list[Proc]
) -> None:
    port = free_port()
    start_engine(procs, "127.0.0.1", port)
    start_engine(procs, "127.0.0.2", port)
    kube.put_pool(NAMESPACE, POOL, match_labels=VLLM, ports=[port])
    kube.put_pool(NAMESPACE, "other-pool", match_labels={"app": "other"}, ports=[9])
    gpu = {"isocost.io/gpu": "h100-80g", "isocost.io/tensor-parallel": "2"}
    kube.put_pod(NAMESPACE, "pod-a", ip="127.0.0.1", labels=VLLM, annotations=ANNOTATIONS | gpu)
    kube.put_pod(NAMESPACE, "pod-b", ip="127.0.0.2", labels=VLLM, annotations=ANNOTATIONS)
    kube.put_pod(NAMESPACE, "pod-starting", ip="127.0.0.3", labels=VLLM, ready=False)
    kube.put_pod(NAMESPACE, "pod-pending", ip=None, labels=VLLM, phase="Pending", ready=False)
    kube.put_pod(NAMESPACE, "pod-leaving", ip="127.0.0.4", labels=VLLM, deleting=True)
    kube.put_pod(NAMESPACE, "pod-other", ip="127.0.0.5", labels={"app": "other"})
    gateway = start_gateway(tmp_path, kube, procs)
    wait_for(lambda: healthy(gateway) == ["pod-a", "pod-b"], 15, "both ready pods routable")
    assert list(rows(gateway)) == ["pod-a", "pod-b"]  # not ready, pending, leaving, other: none
    a = rows(gateway)["pod-a"]
    assert (a["url"], a["gpu"], a["tensor_parallel"]) == (f"http://127.0.0.1:{port}", "h100-80g", 2)
    assert kube.authorization == {"Bearer kube-token-pool"}
    (pool_list,) = kube.queried(POOLS, "list")
    assert pool_list["fieldSelector"] == f"metadata.name={POOL}"
    (pod_list,) = kube.queried(PODS, "list")
    assert pod_list["labelSelector"] == "app=vllm"
    assert kube.queried(PODS, "watch")[0]["allowWatchBookmarks"] in ("true", "True")

    kube.put_pod(NAMESPACE, "pod-b", ip="127.0.0.2", labels=VLLM, ready=False)  # probe fails
    wait_for(lambda: list(rows(gateway)) == ["pod-a"], 10, "pod-b drained and removed")
    kube.put_pod(NAMESPACE, "pod-b", ip="127.0.0.2", labels=VLLM, annotations=ANNOTATIONS)
    wait_for(lambda: healthy(gateway) == ["pod-a", "pod-b"], 10, "pod-b ready again")
    kube.put_pod(NAMESPACE, "pod-a", ip="127.0.0.1", labels=VLLM, deleting=True)
    kube.delete(PODS, NAMESPACE, "pod-a")
    wait_for(lambda: list(rows(gateway)) == ["pod-b"], 10, "pod-a gone with its pod")
    assert len(kube.queried(PODS, "list")) == 1  # one list, then the watch carried it all
    assert discovery_up(gateway) == 1


def test_the_api_server_gone_under_load_leaves_the_pools_replicas_serving(
    tmp_path: Path, kube: KubeApi, procs: list[Proc]
) -> None:
    """The API server goes away while requests flow: discovery is reported down, the last
    known Pods keep serving (every request answered), and what changed meanwhile (the
    pool's selector) is followed once it is back."""
    port, gateway = start_two_tiers(tmp_path, kube, procs)
    wait_for(lambda: healthy(gateway) == ["pod-a"], 15, "pod-a routable")
    statuses: list[int] = []
    stop = threading.Event()
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()

    def send() -> None:
        while not stop.is_set():
            status, _, _ = http("POST", gateway.url + "/v1/completions", body,
                                {"Content-Type": "application/json"})  # fmt: skip
            statuses.append(status)

    senders = [threading.Thread(target=send) for _ in range(3)]
    for sender in senders:
        sender.start()
    try:
        kube.go_down()
        wait_for(lambda: discovery_up(gateway) == 0, 10, "the API seen down")
        kube.put_pool(NAMESPACE, POOL, match_labels={**VLLM, "tier": "b"}, ports=[port])
        served = len(statuses)
        wait_for(lambda: len(statuses) >= served + 20, 10, "requests served while it is down")
        assert healthy(gateway) == ["pod-a"]  # the last known membership stands
        kube.come_up()
        wait_for(lambda: healthy(gateway) == ["pod-b"], 15, "the new selector followed")
        wait_for(lambda: discovery_up(gateway) == 1, 5, "the API seen up")
    finally:
        stop.set()
        for sender in senders:
            sender.join(timeout=30)
    assert statuses and set(statuses) == {200}, sorted(set(statuses))


def test_two_target_ports_are_two_replicas_per_pod_and_follow_the_pools_ports(
    tmp_path: Path, kube: KubeApi, procs: list[Proc]
) -> None:
    """Several target ports are several endpoints per Pod (data-parallel ranks, say)."""
    first, second = free_port(), free_port()
    start_engine(procs, "127.0.0.1", first)
    start_engine(procs, "127.0.0.1", second)
    kube.put_pool(NAMESPACE, POOL, match_labels=VLLM, ports=[first, second])
    kube.put_pod(NAMESPACE, "pod-a", ip="127.0.0.1", labels=VLLM, annotations=ANNOTATIONS)
    gateway = start_gateway(tmp_path, kube, procs)
    ranks = [f"pod-a:{first}", f"pod-a:{second}"]
    wait_for(lambda: healthy(gateway) == sorted(ranks), 15, "one replica per target port")
    assert urls(gateway) == {
        f"pod-a:{first}": f"http://127.0.0.1:{first}",
        f"pod-a:{second}": f"http://127.0.0.1:{second}",
    }

    kube.put_pool(NAMESPACE, POOL, match_labels=VLLM, ports=[second])  # one port: the pod
    wait_for(
        lambda: urls(gateway) == {"pod-a": f"http://127.0.0.1:{second}"},
        10,
        "one replica, named after its pod",
        state=lambda: urls(gateway),
    )


def test_the_set_follows_the_pools_selector_and_the_pods_labels(
    tmp_path: Path, kube: KubeApi, procs: list[Proc]
) -> None:
    port, gateway = start_two_tiers(tmp_path, kube, procs)
    wait_for(lambda: healthy(gateway) == ["pod-a"], 15, "tier a only")

    kube.put_pool(NAMESPACE, POOL, match_labels={**VLLM, "tier": "b"}, ports=[port])
    wait_for(lambda: list(rows(gateway)) == ["pod-b"], 10, "pod-a drained, pod-b joined")
    wait_for(lambda: healthy(gateway) == ["pod-b"], 10, "pod-b routable")
    assert kube.queried(PODS, "list")[-1]["labelSelector"] == "app=vllm,tier=b"

    kube.put_pod(NAMESPACE, "pod-a", ip="127.0.0.1", labels={**VLLM, "tier": "b"},
                 annotations=ANNOTATIONS)  # fmt: skip  # relabelled into the pool
    wait_for(lambda: healthy(gateway) == ["pod-a", "pod-b"], 10, "pod-a selected again")
    kube.put_pod(NAMESPACE, "pod-b", ip="127.0.0.2", labels={**VLLM, "tier": "c"},
                 annotations=ANNOTATIONS)  # fmt: skip  # relabelled out of it
    wait_for(lambda: list(rows(gateway)) == ["pod-a"], 10, "pod-b no longer selected")
    assert len(kube.queried(PODS, "list")) == 2  # a list per selector; labels came by watch


def test_no_pool_is_no_replicas_with_one_warning_until_it_exists(
    tmp_path: Path, kube: KubeApi, procs: list[Proc]
) -> None:
    port = free_port()
    start_engine(procs, "127.0.0.1", port)
    kube.put_pod(NAMESPACE, "pod-a", ip="127.0.0.1", labels=VLLM, annotations=ANNOTATIONS)
    gateway = start_gateway(tmp_path, kube, procs)
    wait_for(lambda: len(kube.queried(POOLS, "watch")) == 1, 15, "the pool watched")
    wait_for(lambda: discovery_up(gateway) == 1, 10, "a missing pool is no outage")
    assert rows(gateway) == {} and kube.queried(PODS, "list") == []
    (missing,) = events(tmp_path, "discovery_pool_missing")
    assert missing["pool"] == f"{NAMESPACE}/inferencepools/{POOL}"

    kube.put_pool(NAMESPACE, POOL, match_labels=VLLM, ports=[port])
    wait_for(lambda: healthy(gateway) == ["pod-a"], 10, "the pool's pod, once it exists")
    assert len(events(tmp_path, "discovery_pool_found")) == 1

    kube.delete(POOLS, NAMESPACE, POOL)
    wait_for(lambda: rows(gateway) == {}, 10, "every replica drained with the pool")
    assert len(events(tmp_path, "discovery_pool_missing")) == 2  # one per absence
    kube.cut_watches()  # a new watch of a still missing pool: no second warning
    wait_for(lambda: len(kube.queried(POOLS, "watch")) >= 2, 10, "the pool watched again")
    kube.compact()  # 410 Gone: a list, the pool still missing, no warning either
    wait_for(lambda: len(kube.queried(POOLS, "list")) >= 2, 10, "the pool listed again")
    kube.put_pool(NAMESPACE, POOL, match_labels=VLLM, ports=[port])
    wait_for(lambda: healthy(gateway) == ["pod-a"], 10, "back with the recreated pool")
    assert len(events(tmp_path, "discovery_pool_missing")) == 2
    assert discovery_up(gateway) == 1 and not events(tmp_path, "discovery_down")


def test_junk_pods_and_a_junk_pool_are_malformed_alone(
    tmp_path: Path, kube: KubeApi, procs: list[Proc]
) -> None:
    port = free_port()
    start_engine(procs, "127.0.0.1", port)
    kube.put_pool(NAMESPACE, POOL, match_labels=VLLM, ports=[port])
    kube.put_pod(NAMESPACE, "pod-a", ip="127.0.0.1", labels=VLLM, annotations=ANNOTATIONS)
    kube.put_pod(NAMESPACE, "no-ip", ip=None, labels=VLLM, annotations=ANNOTATIONS)
    kube.put_pod(NAMESPACE, "bad-ip", ip="10.0.0.1/x", labels=VLLM, annotations=ANNOTATIONS)
    bad_tp = ANNOTATIONS | {"isocost.io/tensor-parallel": "two"}
    kube.put_pod(NAMESPACE, "bad-tp", ip="127.0.0.2", labels=VLLM, annotations=bad_tp)
    gateway = start_gateway(tmp_path, kube, procs)
    wait_for(lambda: healthy(gateway) == ["pod-a"], 15, "pod-a routable beside the junk")
    skipped = f"{NAMESPACE}/pods/"
    wait_for(
        lambda: (
            sorted(e["key"] for e in events(tmp_path, "registration_skipped"))
            == [skipped + "bad-ip", skipped + "bad-tp", skipped + "no-ip"]
        ),
        10,
        "each junk pod skipped, alone",
        state=lambda: events(tmp_path, "registration_skipped"),
    )

    bad_pool = {
        "kind": POOLS.kind, "apiVersion": POOLS.api_version,
        "metadata": {"name": POOL, "namespace": NAMESPACE},
        "spec": {"selector": {"matchLabels": VLLM}, "targetPorts": [{"number": 0}]},
    }  # fmt: skip
    kube.put_raw(POOLS, NAMESPACE, POOL, bad_pool)
    wait_for(lambda: rows(gateway) == {}, 10, "a pool that names no port: no replicas")
    (pool_skipped,) = [
        e for e in events(tmp_path, "registration_skipped") if "inferencepools" in e["key"]
    ]
    assert "target port 0" in pool_skipped["error"]
    kube.put_pool(NAMESPACE, POOL, match_labels=VLLM, ports=[port])
    wait_for(lambda: healthy(gateway) == ["pod-a"], 10, "pod-a back with a sound pool")
    log = (tmp_path / "gateway.log").read_text()
    assert "Traceback" not in log and not events(tmp_path, "discovery_bad_event")


# -- the records, in process ----------------------------------------------------------------

SETTINGS = KubernetesDiscoveryConfig(namespace=NAMESPACE, inference_pool=POOL)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"selector": {"matchLabels": {"b": "2", "a": "1"}}, "targetPorts": [{"number": 80}]},
         PoolTarget("a=1,b=2", (80,))),
        ({"selector": {"matchLabels": VLLM}, "targetPorts": [{"number": 80}, {"number": 81},
                                                              {"number": 80}]},
         PoolTarget("app=vllm", (80, 81))),
        ({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 80}]}, None),
        ({"selector": {"matchLabels": {"app": "x,evil=1"}}, "targetPorts": [{"number": 80}]},
         None),
        ({"selector": {"matchLabels": {"app": 7}}, "targetPorts": [{"number": 80}]}, None),
        ({"selector": "app=vllm", "targetPorts": [{"number": 80}]}, None),
        ({"selector": {"matchLabels": VLLM}, "targetPorts": []}, None),
        ({"selector": {"matchLabels": VLLM}, "targetPorts": [{"number": "80"}]}, None),
        ({"selector": {"matchLabels": VLLM}, "targetPorts": {"number": 80}}, None),
        ({"selector": {"matchLabels": VLLM}, "targetPorts": [None]}, None),
    ],
)  # fmt: skip
def test_a_pool_names_its_selector_and_ports_or_is_malformed(
    spec: dict[str, Any], expected: PoolTarget | None
) -> None:
    target = pool_target({"metadata": {"name": POOL}, "spec": spec})
    assert target == expected if expected is not None else isinstance(target, Malformed)


def _pod(**status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": NAMESPACE, "annotations": ANNOTATIONS},
        "status": {"phase": "Running", "podIP": "10.0.0.1",
                   "conditions": [{"type": "Ready", "status": "True"}], **status},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("pod", "registered", "malformed"),
    [
        (_pod(), ["p"], 0),
        (_pod(podIP="fd00::1"), ["p"], 0),
        (_pod(phase="Succeeded"), [], 0),
        (_pod(conditions=[{"type": "Ready", "status": "False"}]), [], 0),
        (_pod(conditions=[{"type": "Ready", "status": True}]), [], 0),
        (_pod(conditions="Ready"), [], 0),
        (_pod(conditions=[None, 5, {"type": "Ready", "status": "True"}]), ["p"], 0),
        ({**_pod(), "metadata": {"name": "p", "deletionTimestamp": "2025-01-01T00:00:00Z"}}, [], 0),
        (_pod(podIP=None), [], 1),
        (_pod(podIP="evil.example.com"), [], 1),
        (
            {
                **_pod(),
                "metadata": {"name": "p", "annotations": {**ANNOTATIONS, "isocost.io/weight": "x"}},
            },
            [],
            1,
        ),
        ({**_pod(), "metadata": {"name": "p", "labels": {"isocost.io/model": MODEL}}}, ["p"], 0),
        ({**_pod(), "metadata": ["p"]}, [], 1),
        ({"metadata": {"name": "p"}, "status": "Running"}, [], 0),
    ],
)
def test_a_pod_is_a_replica_when_running_and_ready_or_malformed_alone(
    pod: dict[str, Any], registered: list[str], malformed: int
) -> None:
    records = pod_records(pod, (8000,), SETTINGS).values()
    assert [r.name for r in records if isinstance(r, Registration)] == registered
    assert sum(isinstance(r, Malformed) for r in records) == malformed


def test_a_pod_has_a_replica_per_target_port() -> None:
    records = pod_records(_pod(), (8000, 8001), SETTINGS)
    assert {key: (r.name, r.url) for key, r in records.items() if isinstance(r, Registration)} == {
        f"{NAMESPACE}/pods/p:8000": ("p:8000", "http://10.0.0.1:8000"),
        f"{NAMESPACE}/pods/p:8001": ("p:8001", "http://10.0.0.1:8001"),
    }


@pytest.mark.parametrize(
    "kube_section",
    [
        "{inference_pool: llama, service: vllm}",
        "{inference_pool: llama, label_selector: app=vllm}",
        "{inference_pool: llama, port: 8000}",
        "{inference_pool: llama, port_name: http}",
        "{inference_pool: Llama_1}",
        "{inference_pool: 'llama,metadata.name=x'}",
    ],
)
def test_an_inference_pool_beside_what_it_names_is_a_config_error(kube_section: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(f"discovery:\n  kubernetes: {kube_section}\n", "g")
    assert info.value.key == "discovery.kubernetes.inference_pool"
