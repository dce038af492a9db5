"""Kubernetes discovery end to end, short of a cluster: `isocost serve` with the official
``kubernetes_asyncio`` client, reading a kubeconfig, against ``kube_api.KubeApi`` (the API's
EndpointSlice JSON with resourceVersions, bookmarks and 410 Gone), routing to real
`isocost engine` processes. Not run against a real cluster here (none can run on these
machines)."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

from gateway_harness import admin_replicas, wait_for
from isocost_procs import Proc, start_gateway_with, start_isocost
from kube_api import KubeApi

MODEL = "llama-3.1-8b"
ADMIN = {"Authorization": "Bearer admin-kube-0e7a"}
NAMESPACE = "inference"
SERVICE = {"kubernetes.io/service-name": "vllm"}


def start_gateway(tmp: Path, kube: KubeApi, procs: list[Proc]) -> Proc:
    kubeconfig = kube.write_kubeconfig(tmp / "kubeconfig", "kube-token-5d1")
    config = f"""
scrape_interval_ms: 100
discovery:
  kubernetes: {{namespace: {NAMESPACE}, service: vllm, port_name: http,
                kubeconfig: '{kubeconfig}', max_backoff_ms: 300}}
health: {{interval_ms: 100, timeout_ms: 300, open_ms: 300}}
auth: {{admin_token: {ADMIN["Authorization"].split()[1]}}}
"""
    return start_gateway_with(config, tmp, procs)


def start_engine(procs: list[Proc]) -> Proc:
    args = ["engine", "--port", "0", "--model", MODEL, "--gpu", "a100-80g"]
    engine = start_isocost(args, "isocost engine")
    procs.append(engine)
    return engine


def port_of(proc: Proc) -> int:
    return int(proc.url.rsplit(":", 1)[1])


def rows(gateway: Proc) -> dict[str, dict[str, Any]]:
    token = ADMIN["Authorization"].split()[1]
    return {row["name"]: row for row in admin_replicas(gateway.url, token)}


def healthy(gateway: Proc) -> list[str]:
    return sorted(name for name, row in rows(gateway).items() if row["state"] == "healthy")


def discovery_up(gateway: Proc) -> float | None:
    with urllib.request.urlopen(gateway.url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith('isocost_discovery_up{provider="kubernetes"}'):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_ready_endpoints_join_with_their_annotations_and_leave_when_not_ready(
    tmp_path: Path, kube: KubeApi, procs: list[Proc]
) -> None:
    engines = [start_engine(procs) for _ in range(2)]
    kube.put_slice(
        NAMESPACE, "vllm-a", port=port_of(engines[0]), endpoints=[("127.0.0.1", "pod-a", True)],
        labels=SERVICE, annotations={"isocost.io/model": MODEL},
    )  # fmt: skip
    kube.put_slice(
        NAMESPACE, "vllm-b", port=port_of(engines[1]),
        endpoints=[("127.0.0.1", "pod-b", True), ("127.0.0.9", "pod-c", False)],
        labels={**SERVICE, "isocost.io/gpu": "h100-80g"},
        annotations={"isocost.io/model": MODEL, "isocost.io/tensor-parallel": "2"},
    )  # fmt: skip
    kube.put_slice(  # another Service's slice: not ours
        NAMESPACE, "other-a", port=9, endpoints=[("127.0.0.7", "pod-x", True)],
        labels={"kubernetes.io/service-name": "other"},
    )  # fmt: skip
    gateway = start_gateway(tmp_path, kube, procs)
    wait_for(lambda: healthy(gateway) == ["pod-a", "pod-b"], 10, "both pods routable")
    b = rows(gateway)["pod-b"]
    assert (b["url"], b["gpu"], b["tensor_parallel"]) == (engines[1].url, "h100-80g", 2)
    assert kube.authorization == {"Bearer kube-token-5d1"}  # the kubeconfig's user
    assert kube.lists[0]["labelSelector"] == "kubernetes.io/service-name=vllm"

    kube.put_slice(  # pod-b's readiness probe fails
        NAMESPACE, "vllm-b", port=port_of(engines[1]), endpoints=[("127.0.0.1", "pod-b", False)],
        labels=SERVICE, annotations={"isocost.io/model": MODEL},
    )  # fmt: skip
    wait_for(lambda: list(rows(gateway)) == ["pod-a"], 5, "pod-b drained and removed")
    kube.delete_slice(NAMESPACE, "vllm-a")
    wait_for(lambda: rows(gateway) == {}, 5, "pod-a removed with its slice")
    assert len(kube.lists) == 1  # one list, then the watch carried every change


def test_bookmarks_move_the_watch_on_and_410_gone_lists_again(
    tmp_path: Path, kube: KubeApi, procs: list[Proc]
) -> None:
    engine = start_engine(procs)
    kube.put_slice(
        NAMESPACE, "vllm-a", port=port_of(engine), endpoints=[("127.0.0.1", "pod-a", True)],
        labels=SERVICE, annotations={"isocost.io/model": MODEL},
    )  # fmt: skip
    gateway = start_gateway(tmp_path, kube, procs)
    wait_for(lambda: healthy(gateway) == ["pod-a"], 10, "pod-a routable")
    wait_for(lambda: len(kube.watches) == 1, 5, "the watch after the list")
    assert kube.watches[0]["allowWatchBookmarks"] in ("true", "True")  # both parse as true

    moved_to = kube.bump()  # the cluster's version moves; only a bookmark tells the client
    wait_for(lambda: moved_to in kube.bookmarks_sent, 5, "a bookmark at the new version")
    kube.cut_watches()
    wait_for(lambda: len(kube.watches) >= 2, 5, "a new watch")
    assert int(kube.watches[-1]["resourceVersion"]) >= moved_to

    kube.go_down()  # while away: pod-a goes, pod-b comes, the history is compacted
    wait_for(lambda: discovery_up(gateway) == 0, 10, "the API seen down")
    kube.delete_slice(NAMESPACE, "vllm-a")
    kube.put_slice(
        NAMESPACE, "vllm-b", port=port_of(engine), endpoints=[("127.0.0.1", "pod-b", True)],
        labels=SERVICE, annotations={"isocost.io/model": MODEL},
    )  # fmt: skip
    kube.compact()
    assert healthy(gateway) == ["pod-a"]  # the last known membership stands
    kube.come_up()  # a list of the new state, then a watch: nothing stale
    wait_for(lambda: healthy(gateway) == ["pod-b"], 10, "pod-b only")
    wait_for(lambda: discovery_up(gateway) == 1, 5, "the API seen up")
    assert len(kube.lists) >= 2


def test_a_watch_from_a_compacted_version_gets_410_and_the_provider_relists(
    tmp_path: Path, kube: KubeApi, procs: list[Proc]
) -> None:
    engine = start_engine(procs)
    gateway = start_gateway(tmp_path, kube, procs)
    wait_for(lambda: len(kube.watches) == 1, 10, "the first watch")
    kube.put_slice(
        NAMESPACE, "vllm-a", port=port_of(engine), endpoints=[("127.0.0.1", "pod-a", True)],
        labels=SERVICE, annotations={"isocost.io/model": MODEL},
    )  # fmt: skip
    wait_for(lambda: healthy(gateway) == ["pod-a"], 5, "pod-a from the watch")
    kube.compact()  # ends the watch; the re-watch from its last version gets 410
    wait_for(lambda: len(kube.lists) == 2, 5, "a second list after 410 Gone")
    assert healthy(gateway) == ["pod-a"]
    log = (tmp_path / "gateway.log").read_text()
    assert '"discovery_relist"' in log and '"discovery_down"' not in log
