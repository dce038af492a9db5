"""The demo's local cluster: one ``isocost engine`` process serving every replica, and one
``isocost serve`` gateway in front of it, configured with each replica's GPU.

The gateway is told the GPU of every replica (so its cost model knows an L20 from an H100)
but not which replica is slowed: that it must learn from observed latencies, as it would
with a throttled or faulty node in production.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import msgspec

from isocost.runtime.config import (
    AuthConfig,
    GatewayConfig,
    HealthConfig,
    PoolConfig,
    ReplicaConfig,
    SloConfig,
)
from isocost.runtime.processes import Service, ServiceError, Services

__all__ = [
    "ADMIN_TOKEN_ENV",
    "DEFAULT_LAYOUT",
    "Cluster",
    "ClusterSettings",
    "DemoReplica",
    "start_cluster",
]

ADMIN_TOKEN_ENV = "ISOCOST_DEMO_ADMIN_TOKEN"
_START_TIMEOUT_S = 120.0  # two busy cores may take a while to import and bind


@dataclass(frozen=True, slots=True)
class DemoReplica:
    """One simulated replica: its name in the gateway, its GPU, and a hidden slowdown."""

    name: str
    gpu: str
    slowdown: float = 1.0


DEFAULT_LAYOUT: tuple[DemoReplica, ...] = (
    DemoReplica("h100-0", "h100-80g"),
    DemoReplica("h100-1", "h100-80g"),
    DemoReplica("a100-0", "a100-80g"),
    DemoReplica("a100-1", "a100-80g"),
    DemoReplica("a100-2", "a100-80g", slowdown=4.0),
    DemoReplica("l20-0", "l20-48g"),
    DemoReplica("l20-1", "l20-48g"),
    DemoReplica("l20-2", "l20-48g"),
)


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    """What every start of the cluster shares."""

    model: str
    layout: tuple[DemoReplica, ...]
    time_scale: float  # engine wall seconds per modelled second
    stream_interval: int  # output tokens per SSE chunk
    gateway_host: str
    gateway_port: int
    admin_token: str
    seed: int
    slo: SloConfig | None = None  # the gateway judges every answer by it (the dashboard)


@dataclass(frozen=True, slots=True)
class Cluster:
    """A running cluster: its two processes and the gateway's URL."""

    engines: Service
    gateway: Service
    url: str


def engine_args(settings: ClusterSettings) -> list[str]:
    """``isocost engine`` arguments: every replica in one process, each on its own port."""
    args = [
        "engine",
        "--port",
        "0",
        "--model",
        settings.model,
        "--time-scale",
        str(settings.time_scale),
        "--stream-interval",
        str(settings.stream_interval),
        "--output-dist",
        "max",
        "--seed",
        str(settings.seed),
    ]
    for replica in settings.layout:
        args += ["--replica-spec", f"gpu={replica.gpu},slowdown={replica.slowdown:g}"]
    return args


def gateway_config(settings: ClusterSettings, policy: str, urls: list[str]) -> GatewayConfig:
    """The gateway's config for the engines at ``urls`` (in layout order)."""
    replicas = [
        ReplicaConfig(url=url, name=replica.name, gpu=replica.gpu, cost_model=settings.model)
        for replica, url in zip(settings.layout, urls, strict=True)
    ]
    return GatewayConfig(
        pools=[PoolConfig(model=settings.model, replicas=replicas, slo=settings.slo)],
        policy=policy,
        scrape_interval_ms=200,
        health=HealthConfig(interval_ms=250),
        auth=AuthConfig(admin_token_env=ADMIN_TOKEN_ENV),
    )


def start_cluster(
    services: Services, settings: ClusterSettings, policy: str, run_dir: Path
) -> Cluster:
    """Engines, then a gateway routing with ``policy``; returns once every replica is
    routable. Logs and the gateway config go to ``run_dir``."""
    engines = services.start(f"engines-{policy}", engine_args(settings))
    urls = engines.wait_ready(len(settings.layout), _START_TIMEOUT_S)
    config_path = run_dir / f"gateway-{policy}.yaml"
    config_path.write_bytes(msgspec.yaml.encode(gateway_config(settings, policy, urls)))
    gateway = services.start(
        f"gateway-{policy}",
        [
            "serve",
            "--config",
            str(config_path),
            "--host",
            settings.gateway_host,
            "--port",
            str(settings.gateway_port),
            "--log-level",
            "warning",
        ],
        env={ADMIN_TOKEN_ENV: settings.admin_token},
    )
    url = gateway.wait_ready(1, _START_TIMEOUT_S)[0]
    _wait_routable(url, len(settings.layout), gateway)
    return Cluster(engines, gateway, url)


def _wait_routable(url: str, num_replicas: int, gateway: Service) -> None:
    """Poll the gateway's ``/health`` until it can route to every replica."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    routable = 0
    while time.monotonic() < deadline:
        if gateway.popen.poll() is not None:
            raise ServiceError(f"the gateway exited; its log ends with:\n{gateway.log_tail()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                routable = int(json.loads(response.read())["routable_replicas"])
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            routable = 0
        if routable >= num_replicas:
            return
        time.sleep(0.1)
    raise ServiceError(f"the gateway routes to {routable} of {num_replicas} replicas after waiting")
