"""The live autoscale loop on a fake gateway and a fake clock: scale-up with a measured
lead, scale-in that drains before it stops, retries that end undrained, dry runs; the
command and Kubernetes actuators on their real wire (a subprocess, ``KubeApi``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import stat
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from kube_api import KubeApi

from isocost.autoscale import (
    ActuatorError,
    AdminClient,
    AutoscaleLoop,
    CommandActuator,
    GatewayCounters,
    GatewayError,
    KubernetesActuator,
    ReplicaRow,
    read_counters,
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
        self.live: set[str] = set()  # autoscaler instances that still post their status
        self.url = "http://gateway.test"

    async def snapshot(self) -> dict[str, Any]:
        for row in self.rows.values():
            row["in_flight"] = max(0, row["in_flight"] - self.finish_per_read)
        rows = [{**row, "engine_waiting": 0} for row in self.rows.values()]
        return {
            "pools": [{"model": "m", "queue_depth": 0}],
            "replicas": rows,
            "autoscaler": {"live_instances": sorted(self.live)},
        }

    async def counters(self) -> GatewayCounters:
        return read_counters(
            "# TYPE isocost_requests_total counter\n"
            f'isocost_requests_total{{status="200",pool="m",replica="r0"}} {self.answered}\n'
            "# TYPE isocost_slo_requests_total counter\n"
            + "".join(
                f'isocost_slo_requests_total{{pool="m",verdict="{verdict}"}} {count}\n'
                for verdict, count in self.verdicts.items()
            )
        )

    async def drain(self, name: str, by: str) -> None:
        self.calls.append(("drain", name))
        self.rows[name].update(state="drained", drained_by=by)

    async def undrain(self, name: str) -> None:
        self.calls.append(("undrain", name))
        self.rows[name].update(state="healthy", drained_by=None)

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
        self.counts: list[tuple[str, int]] = []  # (replica stopped, the count it left)
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
        self.counts.append((name, desired))
        self.left.discard(name)

    async def draining(self, name: str, gpu: str) -> None:
        self.gateway.calls.append(("draining", name))

    async def inherited(self, rows: Sequence[ReplicaRow]) -> set[str]:
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
            assert mine == ["draining", "drain", "stop", "remove"]  # stop: none in flight
        assert list(gateway.rows) == ["r1"]  # the pool's min stays

    asyncio.run(scenario())


def test_each_stop_leaves_the_count_of_replicas_still_holding_machines() -> None:
    """The count a stop gives the actuator (a Deployment's replicas, a scale command's
    argument) is taken when the drain ends, not from the decision that began it: a
    replica that joined meanwhile is kept in it. From the decisions' target (1), each stop
    would have had the platform delete r3 or r2 beside its victim."""

    async def scenario() -> None:
        clock, gateway = Clock(), FakeGateway(["r0", "r1", "r2"])
        actuator = FakeActuator(gateway)
        loop = make_loop(gateway, actuator, clock)
        await _ticks(loop, gateway, clock, rps=0, n=4)  # r0 and r1 to drain, to min 1
        gateway.rows["r3"] = {"name": "r3", "gpu": GPU, "state": "healthy", "in_flight": 0}
        await _ticks(loop, gateway, clock, rps=0, n=1)  # r3 joined: to drain as well
        await loop.settle()
        assert actuator.counts == [("r0", 3), ("r1", 2), ("r3", 1)]

    asyncio.run(scenario())


def test_a_stop_that_keeps_failing_is_retried_reported_and_undrained() -> None:
    async def scenario() -> None:
        clock, gateway = Clock(), FakeGateway(["r0", "r1"])
        actuator = FakeActuator(gateway, failing_stops=99)
        loop = make_loop(gateway, actuator, clock)
        await _ticks(loop, gateway, clock, rps=0, n=5)
        await loop.settle()
        calls = [c for c, _ in gateway.calls]
        assert calls == ["draining", "drain", "stop", "stop", "stop", "undrain"]
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
            "instance": loop.instance,
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


def test_the_command_gets_the_desired_count_and_a_failure_says_how(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The count as the last argument and in the environment, with the GPU type; a stop
    also names its victim (never the caller's own variable of that name)."""
    monkeypatch.setenv("ISOCOST_STOP_REPLICA", "not-this-one")
    script = tmp_path / "scale.sh"
    record = tmp_path / "record"
    script.write_text(
        "#!/bin/sh\n"
        'echo "$1 $ISOCOST_DESIRED_REPLICAS $ISOCOST_GPU ${ISOCOST_STOP_REPLICA:--}"'
        f" >> {record}\n"
        '[ "$1" -le 2 ] || { echo "quota exceeded"; exit 3; }\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    actuator = CommandActuator(str(script))
    asyncio.run(actuator.start(GPU, 2))
    with pytest.raises(ActuatorError, match=r"scale\.sh 3 exited 3: quota exceeded"):
        asyncio.run(actuator.start(GPU, 3))
    asyncio.run(actuator.stop("10.0.0.7:8000", GPU, 1))
    assert record.read_text() == f"2 2 {GPU} -\n3 3 {GPU} -\n1 1 {GPU} 10.0.0.7:8000\n"


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


@contextlib.asynccontextmanager
async def _admin_serving(replicas: list[dict[str, Any]] | None) -> AsyncIterator[AdminClient]:
    """An AdminClient on a gateway's ``/admin/snapshot`` listing ``replicas`` (None: the
    gateway answers 503)."""

    async def snapshot(request: web.Request) -> web.Response:
        if replicas is None:
            return web.json_response({"error": {"message": "down"}}, status=503)
        return web.json_response({"pools": [], "replicas": replicas})

    app = web.Application()
    app.router.add_get("/admin/snapshot", snapshot)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None and server.sockets
    port = server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            yield AdminClient(session, f"http://127.0.0.1:{port}", "admin-token")
    finally:
        await runner.cleanup()


def test_kubernetes_patches_the_deployment_scale_and_reports_refusals(
    kube: tuple[KubeApi, Path],
) -> None:
    api, kubeconfig = kube
    api.deployments[("inference", "vllm")] = 1
    api.refuse_scale = 1

    async def scenario() -> None:
        async with _admin_serving([]) as admin:
            actuator = KubernetesActuator(admin, {GPU: "vllm"}, "inference", str(kubeconfig))
            try:
                with pytest.raises(ActuatorError, match="HTTP 409 Conflict"):
                    await actuator.start(GPU, 2)
                await actuator.start(GPU, 2)
                missing = KubernetesActuator(admin, {GPU: "nope"}, "inference", str(kubeconfig))
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


DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
LOWEST = "-2147483648"


def _pod_annotations(api: KubeApi, name: str) -> dict[str, str]:
    pod = api.objects["pods"][("inference", name)]
    annotations: dict[str, str] = pod["metadata"]["annotations"]
    return annotations


def test_a_kubernetes_scale_in_marks_the_drained_pod_for_deletion_first(
    kube: tuple[KubeApi, Path],
) -> None:
    """Before lowering the count, the drained replica's Pod (found by the IP of its URL)
    gets the lowest pod-deletion-cost, so the ReplicaSet controller deletes it and not a
    Pod serving streams. An earlier victim's mark on a Pod serving again is taken off; a
    mark on a Pod whose replica is drained (another scale-in on its way) or unknown to the
    gateway stays, and Pods of other Deployments are left alone. A refused scale leaves
    the mark for the retry, which does not patch again."""
    api, kubeconfig = kube
    api.deployments[("inference", "vllm")] = 5
    marks = ({}, {}, {DELETION_COST: LOWEST}, {DELETION_COST: LOWEST}, {DELETION_COST: LOWEST})
    for i, mark in enumerate(marks):
        api.put_pod("inference", f"vllm-{i}", ip=f"10.0.0.{i}", labels={"app": "vllm"},
                    annotations=mark)  # fmt: skip
    api.put_pod("inference", "other-0", ip="10.0.1.0", labels={"app": "other"},
                annotations={DELETION_COST: LOWEST})  # fmt: skip
    api.refuse_scale = 1
    states = ("healthy", "drained", "healthy", "drained")  # r1: the victim; none for vllm-4
    rows = [
        {"name": f"r{i}", "url": f"http://10.0.0.{i}:8000", "state": state, "in_flight": 0}
        for i, state in enumerate(states)
    ]

    async def scenario() -> None:
        async with _admin_serving(rows) as admin:
            actuator = KubernetesActuator(admin, {GPU: "vllm"}, "inference", str(kubeconfig))
            try:
                with pytest.raises(ActuatorError, match="HTTP 409 Conflict"):
                    await actuator.stop("r1", GPU, 4)
                assert _pod_annotations(api, "vllm-1") == {DELETION_COST: LOWEST}
                assert api.deployments[("inference", "vllm")] == 5
                patched = len(api.pod_patches)
                await actuator.stop("r1", GPU, 4)
                assert len(api.pod_patches) == patched  # marked already: nothing to patch
            finally:
                await actuator.close()

    asyncio.run(scenario())
    assert api.deployments[("inference", "vllm")] == 4
    assert _pod_annotations(api, "vllm-0") == {}
    assert _pod_annotations(api, "vllm-1") == {DELETION_COST: LOWEST}
    assert _pod_annotations(api, "vllm-2") == {}  # the earlier victim, serving again
    assert _pod_annotations(api, "vllm-3") == {DELETION_COST: LOWEST}  # another scale-in's
    assert _pod_annotations(api, "vllm-4") == {DELETION_COST: LOWEST}  # not in the gateway
    assert _pod_annotations(api, "other-0") == {DELETION_COST: LOWEST}
    assert sorted(name for name, _, _ in api.pod_patches) == ["vllm-1", "vllm-2"]
    for _, content_type, _ in api.pod_patches:
        assert content_type in {
            "application/merge-patch+json",
            "application/strategic-merge-patch+json",
        }


def test_a_kubernetes_drain_left_by_a_killed_autoscaler_is_finished_by_the_next(
    kube: tuple[KubeApi, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """The victim's Pod is marked as its drain begins, so an autoscaler started after one
    SIGKILLed mid-drain tells that drain from an operator's: it finishes it (waits until
    idle, lowers the count, removes the replica) and leaves the operator's drained. The
    count it sets keeps every Pod still holding a replica, the operator's drained one
    included (set from the two serving, it would have the controller delete a second Pod).
    A mark on a Pod whose replica serves (a victim undrained since) is taken off."""
    api, kubeconfig = kube
    api.deployments[("inference", "vllm")] = 4
    gateway = FakeGateway(["r0", "r1", "r2", "r3"])
    for i, row in enumerate(gateway.rows.values()):
        api.put_pod("inference", f"vllm-{i}", ip=f"10.0.0.{i}", labels={"app": "vllm"})
        row["url"] = f"http://10.0.0.{i}:8000"
    gateway.rows["r1"]["in_flight"] = 3
    gateway.rows["r2"]["state"] = "drained"  # an operator's

    async def scenario() -> None:
        async with _admin_serving(list(gateway.rows.values())) as admin:
            killed = KubernetesActuator(admin, {GPU: "vllm"}, "inference", str(kubeconfig))
            await killed.draining("r1", GPU)  # the killed autoscaler's last steps
            await gateway.drain("r1", "autoscale:0123456789ab")
            await killed.close()
            assert _pod_annotations(api, "vllm-1") == {DELETION_COST: LOWEST}
            api.put_pod("inference", "vllm-3", ip="10.0.0.3", labels={"app": "vllm"},
                        annotations={DELETION_COST: LOWEST})  # fmt: skip
            actuator = KubernetesActuator(admin, {GPU: "vllm"}, "inference", str(kubeconfig))
            loop = make_loop(gateway, actuator, Clock())
            try:
                await _ticks(loop, gateway, loop.clock, rps=1, n=2)  # type: ignore[arg-type]
                await loop.settle()
            finally:
                await actuator.close()

    with caplog.at_level(logging.INFO, logger="isocost.autoscale"):
        asyncio.run(scenario())
    assert "autoscale_drain_adopted" in [r.__dict__.get("event") for r in caplog.records]
    assert [body for _, _, body in api.scale_patches] == [{"spec": {"replicas": 3}}]
    assert "r1" not in gateway.rows and gateway.rows["r2"]["state"] == "drained"
    assert [call for call in gateway.calls if call[1] == "r2"] == []
    assert _pod_annotations(api, "vllm-1") == {DELETION_COST: LOWEST}
    assert _pod_annotations(api, "vllm-3") == {}  # the stale mark
    assert _pod_annotations(api, "vllm-2") == {}


@pytest.mark.parametrize("gateway", ["unreadable", "unknown replica"])
def test_a_kubernetes_scale_in_without_the_pod_still_lowers_the_count(
    kube: tuple[KubeApi, Path], gateway: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica whose Pod cannot be told (the gateway unreadable, a URL that is no Pod's
    IP) is one warning; the count is lowered and the controller picks the Pod."""
    api, kubeconfig = kube
    api.deployments[("inference", "vllm")] = 2
    api.put_pod("inference", "vllm-0", ip="10.0.0.0", labels={"app": "vllm"})
    rows = None if gateway == "unreadable" else [
        {"name": "r9", "url": "http://vllm.example:8000", "state": "healthy", "in_flight": 0}
    ]  # fmt: skip

    async def scenario() -> None:
        async with _admin_serving(rows) as admin:
            actuator = KubernetesActuator(admin, {GPU: "vllm"}, "inference", str(kubeconfig))
            try:
                await actuator.stop("r9", GPU, 1)
            finally:
                await actuator.close()

    with caplog.at_level(logging.WARNING, logger="isocost.autoscale"):
        asyncio.run(scenario())
    assert api.deployments[("inference", "vllm")] == 1
    assert api.pod_patches == []
    assert [r.__dict__.get("event") for r in caplog.records] == ["autoscale_pod_unknown"]


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
