"""The live autoscale loop on a fake gateway and a fake clock: scale-up with a measured
lead, scale-in that drains before it stops, retries that end undrained, dry runs; the
command and Kubernetes actuators on their real wire (a subprocess, ``KubeApi``)."""

from __future__ import annotations

import asyncio
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from kube_api import KubeApi

from isocost.autoscale import (
    ActuatorError,
    AutoscaleLoop,
    CommandActuator,
    GatewayError,
    KubernetesActuator,
)
from isocost.control import AutoscaleConfig, Autoscaler, PoolConfig, PoolOffer

GPU = "a100-80g"
CONFIG = AutoscaleConfig(
    pools=[PoolConfig(gpu=GPU, min=1, max=3, cold_start_s=5)],
    interval_s=1.0,
    max_gpus=8,
    scale_up_cooldown_s=0,
    scale_down_cooldown_s=0,
    scale_in_after_s=3,
    drain_deadline_s=30,
)
OFFERS = [PoolOffer(GPU, 1, 2.0, capacity_rps=1.0)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept.append(seconds)
        await asyncio.sleep(0)


class FakeGateway:
    """Replica rows, ``isocost_requests_total`` and ``isocost_slo_requests_total``
    counters; records admin calls."""

    def __init__(self, names: list[str]) -> None:
        self.rows = {n: {"name": n, "gpu": GPU, "state": "healthy", "in_flight": 0} for n in names}
        self.answered = 0
        self.verdicts = {"met": 0, "missed": 0}  # isocost_slo_requests_total
        self.calls: list[tuple[str, str]] = []
        self.finish_per_read = 1  # in-flight requests that end per snapshot read
        self.statuses: list[dict[str, Any]] = []  # POST /admin/autoscaler
        self.refuse_status = False

    async def snapshot(self) -> dict[str, Any]:
        for row in self.rows.values():
            row["in_flight"] = max(0, row["in_flight"] - self.finish_per_read)
        rows = [{**row, "engine_waiting": 0} for row in self.rows.values()]
        return {"pools": [{"model": "m", "queue_depth": 0}], "replicas": rows}

    async def metrics(self) -> str:
        return (
            "# TYPE isocost_requests_total counter\n"
            f'isocost_requests_total{{status="200",pool="m",replica="r0"}} {self.answered}\n'
            "# TYPE isocost_slo_requests_total counter\n"
            + "".join(
                f'isocost_slo_requests_total{{pool="m",verdict="{verdict}"}} {count}\n'
                for verdict, count in self.verdicts.items()
            )
        )

    async def drain(self, name: str) -> None:
        self.calls.append(("drain", name))
        self.rows[name]["state"] = "drained"

    async def undrain(self, name: str) -> None:
        self.calls.append(("undrain", name))
        self.rows[name]["state"] = "healthy"

    async def remove(self, name: str) -> None:
        self.calls.append(("remove", name))
        del self.rows[name]

    async def post_status(self, status: Mapping[str, Any]) -> None:
        if self.refuse_status:
            raise GatewayError("POST /admin/autoscaler: HTTP 404")
        self.statuses.append(dict(status))


class FakeActuator:
    def __init__(self, gateway: FakeGateway, failing_stops: int = 0) -> None:
        self.gateway = gateway
        self.started: list[int] = []
        self.stopped: list[str] = []
        self.failing_stops = failing_stops
        self.left: set[str] = set()  # what an earlier autoscaler started, still running

    async def start(self, gpu: str, desired: int) -> None:
        self.started.append(desired)

    async def stop(self, name: str, gpu: str, desired: int) -> None:
        self.gateway.calls.append(("stop", name))
        row = self.gateway.rows.get(name)  # None: one the gateway never listed
        assert row is None or row["in_flight"] == 0, "stopped with requests in flight"
        if self.failing_stops:
            self.failing_stops -= 1
            raise ActuatorError("stop refused")
        self.stopped.append(name)
        self.left.discard(name)

    def inherited(self) -> set[str]:
        return set(self.left)

    async def close(self) -> None:
        pass


def make_loop(
    gateway: FakeGateway, actuator: FakeActuator, clock: Clock, dry_run: bool = False
) -> AutoscaleLoop:
    return AutoscaleLoop(
        Autoscaler(CONFIG, OFFERS),
        CONFIG,
        OFFERS,
        gateway,
        actuator,
        clock=clock,
        sleep=clock.sleep,
        dry_run=dry_run,
        attempts=3,
    )


async def _ticks(loop: AutoscaleLoop, gateway: FakeGateway, clock: Clock, rps: int, n: int) -> None:
    for _ in range(n):
        gateway.answered += rps
        clock.now += CONFIG.interval_s
        await loop.tick()


def test_load_starts_replicas_and_their_appearance_is_the_measured_lead() -> None:
    async def scenario() -> None:
        clock, gateway = Clock(), FakeGateway(["r0"])
        actuator = FakeActuator(gateway)
        loop = make_loop(gateway, actuator, clock)
        await _ticks(loop, gateway, clock, rps=0, n=1)  # the counter's first reading
        await _ticks(loop, gateway, clock, rps=10, n=1)
        await loop.settle()
        assert actuator.started == [3, 3]  # two more, to the pool's max
        tick = await loop.tick()
        assert tick.count("pending") == 2 and tick.decision.start == {}
        clock.now += 2.5
        gateway.rows["r1"] = {"name": "r1", "gpu": GPU, "state": "healthy", "in_flight": 0}
        tick = await loop.tick()
        assert loop.leads == [(GPU, 2.5)]
        assert (tick.count("ready"), tick.count("pending")) == (2, 1)
        assert loop.scaler.lead.measured(GPU)  # type: ignore[attr-defined]
        assert tick.gpu_hours > 0 and tick.usd == pytest.approx(tick.gpu_hours * 2.0)

    asyncio.run(scenario())


def test_scale_in_drains_waits_for_idle_then_stops_and_removes() -> None:
    async def scenario() -> None:
        clock, gateway = Clock(), FakeGateway(["r0", "r1", "r2"])
        gateway.rows["r2"]["in_flight"] = 4
        gateway.rows["r1"]["in_flight"] = 6
        actuator = FakeActuator(gateway)
        loop = make_loop(gateway, actuator, clock)
        await _ticks(loop, gateway, clock, rps=0, n=6)
        await loop.settle()
        assert sorted(actuator.stopped) == ["r0", "r2"]  # the least busy go
        for name in ("r0", "r2"):
            mine = [call for call, who in gateway.calls if who == name]
            assert mine == ["drain", "stop", "remove"]  # stop asserts nothing was in flight
        assert list(gateway.rows) == ["r1"]  # the pool's min stays

    asyncio.run(scenario())


def test_a_stop_that_keeps_failing_is_retried_reported_and_undrained() -> None:
    async def scenario() -> None:
        clock, gateway = Clock(), FakeGateway(["r0", "r1"])
        actuator = FakeActuator(gateway, failing_stops=99)
        loop = make_loop(gateway, actuator, clock)
        await _ticks(loop, gateway, clock, rps=0, n=5)
        await loop.settle()
        assert [c for c, _ in gateway.calls] == ["drain", "stop", "stop", "stop", "undrain"]
        assert all(row["state"] == "healthy" for row in gateway.rows.values())
        failures = loop.metrics.registry.get_sample_value(
            "isocost_autoscale_failures_total", {"action": "stop"}
        )
        assert failures == 3
        assert clock.slept == [0.5, 1.0]  # the backoff between the attempts

    asyncio.run(scenario())


def test_each_tick_posts_its_status_and_a_refusal_does_not_stop_the_loop() -> None:
    async def scenario() -> None:
        clock, gateway = Clock(), FakeGateway(["r0"])
        loop = make_loop(gateway, FakeActuator(gateway), clock)
        await _ticks(loop, gateway, clock, rps=0, n=1)
        await _ticks(loop, gateway, clock, rps=10, n=1)  # starts two
        await loop.settle()
        tick = await loop.tick()
        last = gateway.statuses[-1]
        assert len(gateway.statuses) == 3
        assert last == {
            "desired": sum(tick.decision.targets.values()),
            "ready": 1,
            "pending": 2,
            "draining": 0,
            "ejected": 0,
            "forecast_rps": round(tick.decision.forecast_rps, 4),
            "interval_s": CONFIG.interval_s,
            "dry_run": False,
        }
        assert last["desired"] == 3 and last["forecast_rps"] > 0
        gateway.refuse_status = True
        await loop.tick()
        failures = loop.metrics.registry.get_sample_value(
            "isocost_autoscale_failures_total", {"action": "status"}
        )
        assert failures == 1 and len(gateway.statuses) == 3

    asyncio.run(scenario())


def test_dry_run_decides_but_changes_nothing() -> None:
    async def scenario() -> None:
        clock, gateway = Clock(), FakeGateway(["r0"])
        actuator = FakeActuator(gateway)
        loop = make_loop(gateway, actuator, clock, dry_run=True)
        await _ticks(loop, gateway, clock, rps=0, n=1)
        gateway.answered += 10
        clock.now += 1
        tick = await loop.tick()
        assert tick.decision.start == {GPU: 2}
        assert actuator.started == [] and gateway.calls == []

    asyncio.run(scenario())


def test_the_command_gets_the_desired_count_and_a_failure_says_how(tmp_path: Path) -> None:
    script = tmp_path / "scale.sh"
    record = tmp_path / "record"
    script.write_text(
        f'#!/bin/sh\necho "$1 $ISOCOST_DESIRED_REPLICAS $ISOCOST_GPU" >> {record}\n'
        '[ "$1" -le 2 ] || { echo "quota exceeded"; exit 3; }\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    actuator = CommandActuator(str(script))
    asyncio.run(actuator.start(GPU, 2))
    with pytest.raises(ActuatorError, match=r"scale\.sh 3 exited 3: quota exceeded"):
        asyncio.run(actuator.start(GPU, 3))
    assert record.read_text() == f"2 2 {GPU}\n3 3 {GPU}\n"


def test_a_failing_scale_command_is_retried_reported_and_forgotten(tmp_path: Path) -> None:
    script = tmp_path / "scale.sh"
    script.write_text("#!/bin/sh\necho 'API refused'; exit 1\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)

    async def scenario() -> None:
        clock, gateway = Clock(), FakeGateway(["r0"])
        loop = make_loop(gateway, FakeActuator(gateway), clock)
        loop.actuator = CommandActuator(str(script))
        await _ticks(loop, gateway, clock, rps=0, n=1)
        await _ticks(loop, gateway, clock, rps=10, n=1)
        await loop.settle()
        failures = loop.metrics.registry.get_sample_value(
            "isocost_autoscale_failures_total", {"action": "start"}
        )
        assert failures == 2 * 3  # two starts, three attempts each
        tick = await loop.tick()
        assert tick.count("pending") == 0 and tick.decision.start == {GPU: 2}  # asks again
        await loop.settle()

    asyncio.run(scenario())


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[tuple[KubeApi, Path]]:
    api = KubeApi()
    api.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""
apiVersion: v1
kind: Config
clusters: [{{name: t, cluster: {{server: 'http://127.0.0.1:{api.port}'}}}}]
users: [{{name: t, user: {{token: kube-token-a9}}}}]
contexts: [{{name: t, context: {{cluster: t, user: t}}}}]
current-context: t
""")
    yield api, kubeconfig
    api.close()


def test_kubernetes_patches_the_deployment_scale_and_reports_refusals(
    kube: tuple[KubeApi, Path],
) -> None:
    api, kubeconfig = kube
    api.deployments[("inference", "vllm")] = 1
    api.refuse_scale = 1

    async def scenario() -> None:
        actuator = KubernetesActuator({GPU: "vllm"}, "inference", str(kubeconfig))
        try:
            with pytest.raises(ActuatorError, match="HTTP 409 Conflict"):
                await actuator.start(GPU, 2)
            await actuator.start(GPU, 2)
            missing = KubernetesActuator({GPU: "nope"}, "inference", str(kubeconfig))
            with pytest.raises(ActuatorError, match="HTTP 404"):
                await missing.stop("r1", GPU, 1)
            await missing.close()
        finally:
            await actuator.close()

    asyncio.run(scenario())
    assert api.deployments[("inference", "vllm")] == 2
    assert len(api.scale_patches) == 2  # the refused one, then the one that took
    name, content_type, body = api.scale_patches[-1]
    assert (name, body) == ("vllm", {"spec": {"replicas": 2}})
    assert content_type in {
        "application/merge-patch+json",
        "application/strategic-merge-patch+json",
    }
    assert api.authorization == {"Bearer kube-token-a9"}


@pytest.mark.parametrize("verdict", ["met", "missed"])
def test_the_gateways_slo_verdicts_drive_the_reactive_guard(verdict: str) -> None:
    """At a rate one replica's capacity covers, answers that miss their SLO still scale up
    (the gateway's verdicts are the attainment); answers that meet it change nothing."""

    async def scenario() -> None:
        clock, gateway = Clock(), FakeGateway(["r0"])
        actuator = FakeActuator(gateway)
        loop = make_loop(gateway, actuator, clock)
        await _ticks(loop, gateway, clock, rps=0, n=1)
        gateway.verdicts[verdict] += 60  # more than the guard needs to trust it
        await _ticks(loop, gateway, clock, rps=0, n=1)
        await loop.settle()
        assert actuator.started == ([] if verdict == "met" else [2])

    asyncio.run(scenario())
