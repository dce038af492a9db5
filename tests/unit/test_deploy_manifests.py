"""deploy/ checked offline (no cluster, Prometheus or Grafana runs here): the Kubernetes
manifests agree with each other and with the picker's config, the alert rules fire only
on sustained states, and every expression names metrics that isocost exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from isocost.autoscale import LoopMetrics
from isocost.gateway.metrics import GatewayMetrics
from isocost.runtime.config import parse_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
_DURATION = re.compile(r"^(\d+)([smh])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600}


def _documents(name: str) -> dict[str, dict[str, Any]]:
    """The manifests of ``deploy/kubernetes/<name>``, by kind."""
    docs = yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text())
    return {doc["kind"]: doc for doc in docs}


@pytest.fixture(scope="module")
def picker() -> dict[str, dict[str, Any]]:
    return _documents("picker.yaml")


@pytest.fixture(scope="module")
def pool() -> dict[str, dict[str, Any]]:
    return _documents("inferencepool.yaml")


def _exported_metrics() -> set[str]:
    """The gateway's (and picker's) series and ``isocost autoscale``'s own."""
    registries = (GatewayMetrics().registry, LoopMetrics().registry)
    return {family.name for registry in registries for family in registry.collect()}


def _metric_names(expr: str) -> set[str]:
    """The isocost series an expression reads, as their family names."""
    names = re.findall(r"\bisocost_[a-z0-9_]+", expr)
    return {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in names}


def grants(role: dict[str, Any], group: str, resource: str, verbs: set[str]) -> bool:
    """``role`` lets its subjects use ``verbs`` on ``resource`` of API group ``group``."""
    return any(
        group in rule["apiGroups"] and resource in rule["resources"] and verbs <= set(rule["verbs"])
        for rule in role["rules"]
    )


def test_picker_config_is_a_valid_isocost_config(
    picker: dict[str, dict[str, Any]], pool: dict[str, dict[str, Any]]
) -> None:
    text = picker["ConfigMap"]["data"]["gateway.yaml"]
    config = parse_config(text, "deploy/kubernetes/picker.yaml")
    kubernetes = config.discovery.kubernetes
    assert kubernetes is not None
    meta = pool["InferencePool"]["metadata"]
    # the picker reads the very pool the route sends to: its selector and ports are the pool's
    assert (kubernetes.inference_pool, kubernetes.namespace) == (meta["name"], meta["namespace"])


def test_manifests_point_at_each_other(
    picker: dict[str, dict[str, Any]], pool: dict[str, dict[str, Any]]
) -> None:
    deployment, service = picker["Deployment"], picker["Service"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels
    assert service["spec"]["selector"] == labels
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    grpc_port = int(args[args.index("--port") + 1])
    assert container["readinessProbe"]["grpc"] == {"port": grpc_port, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": grpc_port, "service": "liveness"}
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    ref = pool["InferencePool"]["spec"]["endpointPickerRef"]
    assert (ref["name"], ref["port"]["number"]) == (service["metadata"]["name"], ports["grpc"])
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    (backend,) = pool["HTTPRoute"]["spec"]["rules"][0]["backendRefs"]
    assert (backend["kind"], backend["name"]) == (
        "InferencePool",
        pool["InferencePool"]["metadata"]["name"],
    )
    role = picker["Role"]
    assert role["metadata"]["namespace"] == pool["InferencePool"]["metadata"]["namespace"]
    # what the provider calls in inference_pool mode: list and watch of both collections
    assert grants(role, "inference.networking.k8s.io", "inferencepools", {"list", "watch"})
    assert grants(role, "", "pods", {"list", "watch"})
    assert picker["RoleBinding"]["roleRef"]["name"] == role["metadata"]["name"]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert picker["RoleBinding"]["subjects"][0]["name"] == account


def test_alerts_fire_on_sustained_states_of_exported_metrics() -> None:
    groups = yaml.safe_load((DEPLOY / "monitoring" / "alerts.yaml").read_text())["groups"]
    exported = _exported_metrics()
    rules = [rule for group in groups for rule in group["rules"]]
    assert rules
    for rule in rules:
        match = _DURATION.match(rule["for"])
        assert match, rule["alert"]
        assert int(match[1]) * _SECONDS[match[2]] >= 30, rule["alert"]
        names = _metric_names(rule["expr"])
        assert names and names <= exported, (rule["alert"], names - exported)
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}


def test_dashboard_plots_exported_metrics() -> None:
    dashboard = json.loads((DEPLOY / "monitoring" / "grafana-dashboard.json").read_text())
    exported = _exported_metrics()
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert exprs
    for expr in exprs:
        names = _metric_names(expr)
        assert names and names <= exported, (expr, names - exported)
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
