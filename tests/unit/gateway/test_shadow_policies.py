"""Shadow policy evaluation: the ``shadow`` config, the window of recent requests, the
candidates' decisions beside the running policy's (same request, same state, the real
hooks), the predicted changes read off a replay, and a replay whose simulator fails or
overruns (real subprocesses) counted as failed, one with too few requests as skipped."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError, IsocostError
from isocost.gateway.body import RoutingView
from isocost.gateway.metrics import GatewayMetrics
from isocost.gateway.proxy import ForwardResult
from isocost.gateway.routing import GatewayRequest, Router
from isocost.gateway.shadow import (
    CandidateChange,
    ReplayFailed,
    Shadow,
    ShadowWindow,
    predicted_changes,
    run_replay,
)
from isocost.gateway.upstreams import Pool, Upstream
from isocost.runtime.config import HealthConfig, ReplicaConfig, check_references, parse_config
from isocost.runtime.recording import FleetFile, FleetPool, FleetReplica, RecordedRequest
from isocost.scheduling.contract import InFlight

MODEL = "llama-3.1-8b"


def _pool_yaml(shadow: str, policy: str = "round_robin") -> str:
    return f"pools: [{{model: m, policy: {policy}, shadow: {shadow}}}]"


@pytest.mark.parametrize(
    ("shadow", "key", "fragment"),
    [
        ("{policies: []}", "pools[0].shadow.policies", "at least one"),
        ("{policies: [round_robin]}", "pools[0].shadow.policies", "running policy"),
        ("{policies: [random, random]}", "pools[0].shadow.policies", "twice"),
        ("{policies: [random], interval_s: 0}", "pools[0].shadow.interval_s", "positive"),
        ("{policies: [random], window_s: -1}", "pools[0].shadow.window_s", "positive"),
        ("{policies: [random], max_requests: 0}", "pools[0].shadow.max_requests", "positive"),
        ("{policies: [random], timeout_s: .nan}", "pools[0].shadow.timeout_s", "positive"),
        (
            "{policies: [random], max_requests: 10, min_requests: 11}",
            "pools[0].shadow.min_requests",
            "max_requests",
        ),
        ("{policies: [random], intervall_s: 5}", "pools[0].shadow", "intervall_s"),
    ],
)
def test_bad_shadow_settings_name_the_key(shadow: str, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as caught:
        parse_config(_pool_yaml(shadow), "g.yaml")
    assert caught.value.key == key
    assert len(str(caught.value).splitlines()) == 1


def test_the_running_policy_is_the_file_default_when_the_pool_names_none() -> None:
    with pytest.raises(ConfigError, match="running policy"):
        parse_config("policy: random\npools: [{model: m, shadow: {policies: [random]}}]", "g")


def test_an_unknown_candidate_is_an_unknown_policy() -> None:
    config = parse_config(_pool_yaml("{policies: [equal_cost, nope]}"), "g.yaml")
    with pytest.raises(IsocostError, match="unknown policy 'nope'"):
        check_references(config, Catalog.builtin())


def test_defaults() -> None:
    shadow = parse_config(_pool_yaml("{policies: [equal_cost]}"), "g.yaml").pools[0].shadow
    assert shadow is not None
    assert (shadow.interval_s, shadow.window_s, shadow.max_requests) == (60, 300, 2000)


def _line(i: int) -> RecordedRequest:
    return RecordedRequest(
        timestamp=1000.0 * i,
        input_length=100,
        output_length=8,
        hash_ids=[i],
        model=MODEL,
        status=200,
        replica="r0",
        output_tokens=8,
        e2e_ms=50.0,
    )


def test_the_window_keeps_the_last_seconds_and_at_most_max_requests() -> None:
    window = ShadowWindow(window_s=10.0, max_requests=3)
    for i in range(5):
        window.add(100.0 + i, _line(i))
    assert [line.hash_ids for line in window.recent(105.0)] == [[2], [3], [4]]
    assert [line.hash_ids for line in window.recent(112.5)] == [[3], [4]]  # 102 is too old
    assert len(window) == 2
    grown = window.resized(window_s=100.0, max_requests=10)
    grown.add(113.0, _line(9))
    assert [line.hash_ids for line in grown.recent(113.0)] == [[3], [4], [9]]
    assert window.recent(200.0) == []


def test_changes_are_against_the_running_policys_replay() -> None:
    rows: list[dict[str, Any]] = [
        {"policy": "round_robin", "ttft_p99_s": 2.0, "goodput_rps": 4.0},
        {"policy": "equal_cost", "ttft_p99_s": 1.5, "goodput_rps": 5.0},
        {"policy": "random", "ttft_p99_s": None, "goodput_rps": 4.0},
        {"policy": "oracle", "ttft_p99_s": 0.1, "goodput_rps": 9.0},
    ]
    changes = predicted_changes(rows, "round_robin", ["equal_cost", "random"])
    assert changes == (
        CandidateChange("equal_cost", -0.25, 0.25),
        CandidateChange("random", None, 0.0),
    )
    with pytest.raises(ReplayFailed, match="least_request"):
        predicted_changes(rows, "round_robin", ["least_request"])


def _router() -> tuple[Router, Pool, GatewayMetrics]:
    metrics = GatewayMetrics()
    router = Router(
        Catalog.builtin(),
        metrics,
        on_idle=lambda replica: None,
        on_reject=lambda reason: None,
        queue_size=4,
        queue_timeout_s=5.0,
    )
    pool = Pool(MODEL, "round_robin")
    router.set_policy(pool, "round_robin")
    for port in (9, 10):
        replica = Upstream(ReplicaConfig(url=f"http://127.0.0.1:{port}"), MODEL, HealthConfig())
        router.add_replica(pool, replica)
        pool.replicas[replica.url] = replica
    return router, pool, metrics


def _request(pool: Pool, name: str) -> GatewayRequest:
    return GatewayRequest(
        request_id=name,
        view=RoutingView(MODEL, True, 8, None, 600, False, ()),
        pool=pool,
        arrived_at=time.monotonic(),
        session_key=None,
        priority=0,
        deadline_at=None,
        tpot_target_s=None,
        route_class=None,
        key_name=None,
    )


def test_candidates_decide_every_request_and_see_the_real_dispatches() -> None:
    router, pool, metrics = _router()
    candidate = router.build("least_request")
    seen: list[tuple[str, str]] = []

    def spy(hook: str) -> Any:
        def record(record: InFlight, now: float, *rest: object) -> None:
            seen.append((hook, record.replica_id))

        return record

    for hook in ("on_dispatch", "on_complete"):
        setattr(candidate, hook, spy(hook))
    router.candidates[MODEL] = {"least_request": candidate}

    async def scenario() -> list[str]:
        grants, chosen = [], []
        for i in range(6):  # held: round_robin's second pick is always the emptier one
            agreed = router.agreement[MODEL, "least_request", True]
            grants.append(await router.acquire(_request(pool, f"r{i}"), frozenset()))
            chosen.append(grants[-1].replica.name)
            if i % 2:  # least_request saw one more in flight on the other: the same pick
                assert router.agreement[MODEL, "least_request", True] == agreed + 1
        for grant in grants:
            router.release(grant, time.monotonic(), ok=True, output_tokens=8)
        return chosen

    chosen = asyncio.run(scenario())
    assert len(set(chosen)) == 2  # round_robin alternates
    agree = router.agreement[MODEL, "least_request", True]
    disagree = router.agreement[MODEL, "least_request", False]
    assert agree + disagree == 6
    for agrees, count in (("yes", agree), ("no", disagree)):  # ties fall either way
        labels = {"pool": MODEL, "policy": "least_request", "agrees": agrees}
        counted = _sample(metrics, "isocost_shadow_decisions_total", labels)
        assert (counted or 0.0) == count  # a label never counted has no series yet
    hooks = [("on_dispatch", name) for name in chosen] + [("on_complete", n) for n in chosen]
    assert seen == hooks  # the real dispatches and ends, in order


def _sample(metrics: GatewayMetrics, name: str, labels: dict[str, str]) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def _fleet() -> FleetFile:
    replica = FleetReplica("r0", "a100-80g", MODEL)
    return FleetFile(pools=[FleetPool(MODEL, "round_robin", [replica])])


def _exits(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def test_a_failing_simulator_is_a_failed_replay_with_its_last_line() -> None:
    failing = _exits("import sys; print('first', file=sys.stderr); sys.exit('no such pool')")
    with pytest.raises(ReplayFailed, match="exited 1: no such pool"):
        asyncio.run(run_replay([_line(0)], _fleet(), MODEL, ["round_robin"], 30.0, command=failing))


def test_a_replay_past_its_time_limit_is_killed() -> None:
    started = time.monotonic()
    with pytest.raises(ReplayFailed, match="time limit"):
        asyncio.run(
            run_replay(
                [_line(0)],
                _fleet(),
                MODEL,
                ["round_robin"],
                0.5,
                command=_exits("import time; time.sleep(60)"),
            )
        )
    assert time.monotonic() - started < 20


def test_a_window_with_too_few_requests_is_skipped_then_a_failure_counts() -> None:
    router, pool, metrics = _router()
    text = f"pools: [{{model: {MODEL}, policy: round_robin, shadow: {{policies: [random],"
    config = parse_config(text + " min_requests: 2}}]", "g.yaml")
    shadow = Shadow(router, metrics, _fleet, 16, command=_exits("raise SystemExit(3)"))

    async def scenario() -> list[str]:
        shadow.configure(config)
        outcomes = [await shadow.replay(MODEL)]
        for i in range(2):
            shadow.record(_request(pool, f"r{i}"), ForwardResult(200, output_tokens=8), 0.05)
        outcomes.append(await shadow.replay(MODEL))
        await shadow.stop()
        return outcomes

    assert asyncio.run(scenario()) == ["skipped", "failed"]
    status = shadow.status(time.monotonic())[MODEL]
    assert status["replays"] == {"ok": 0, "failed": 1, "skipped": 1}
    assert status["window_requests"] == 2 and "exited 3" in status["last_error"]
    assert status["replay"] is None and status["candidates"][0]["ttft_p99_change"] is None
    counts = [
        _sample(metrics, "isocost_shadow_replays_total", {"outcome": o})
        for o in ("failed", "skipped")
    ]
    assert counts == [1, 1]
    assert _sample(metrics, "isocost_shadow_replays_total", {"outcome": "ok"}) is None


# A stand-in simulator (a real subprocess): each candidate half the running policy's P99
# TTFT, goodput alike; it writes its rows where --json says, as `isocost sim` does.
_HALVES = _exits(
    "import json, sys; a = sys.argv; names = a[a.index('--policies') + 1].split(',');"
    " rows = [{'policy': p, 'ttft_p99_s': 1.0 if i else 2.0, 'goodput_rps': 3.0}"
    " for i, p in enumerate(names)];"
    " open(a[a.index('--json') + 1], 'w').write(json.dumps(rows))"
)


def _shadow_config(shadow: str) -> Any:
    text = f"pools: [{{model: {MODEL}, policy: round_robin, shadow: {shadow}}}]"
    return parse_config(text, "g.yaml")


def test_a_reload_keeps_the_window_and_predictions_of_the_same_candidates() -> None:
    router, pool, metrics = _router()
    shadow = Shadow(router, metrics, _fleet, 16, command=_HALVES)
    gauge = metrics.shadow_change

    def series() -> dict[tuple[str, ...], float]:
        return {
            tuple(s.labels.values()): s.value for family in gauge.collect() for s in family.samples
        }

    async def scenario() -> dict[str, Any]:
        shadow.configure(_shadow_config("{policies: [random], min_requests: 1}"))
        shadow.record(_request(pool, "r0"), ForwardResult(200, output_tokens=8), 0.05)
        assert await shadow.replay(MODEL) == "ok"
        assert series() == {
            (MODEL, "random", "ttft_p99"): -0.5,
            (MODEL, "random", "goodput"): 0.0,
        }
        shadow.configure(_shadow_config("{policies: [random], min_requests: 1, interval_s: 5}"))
        kept = shadow.status(time.monotonic())[MODEL]
        shadow.configure(_shadow_config("{policies: [least_request], min_requests: 1}"))
        assert series() == {}  # the dropped candidate's predictions are gone
        changed = shadow.status(time.monotonic())[MODEL]
        await shadow.stop()
        return {"kept": kept, "changed": changed}

    got = asyncio.run(scenario())
    kept, changed = got["kept"], got["changed"]
    assert kept["interval_s"] == 5 and kept["window_requests"] == 1
    assert kept["candidates"][0]["ttft_p99_change"] == -0.5 and kept["replay"]["requests"] == 1
    assert changed["replay"] is None and changed["window_requests"] == 1
    assert changed["replays"] == {"ok": 1, "failed": 0, "skipped": 0}


_STAND_IN = """
import asyncio, sys
from isocost.gateway.shadow import run_replay
from isocost.runtime.recording import FleetFile, FleetPool, FleetReplica, RecordedRequest

line = RecordedRequest(timestamp=0.0, input_length=100, output_length=8, hash_ids=[0],
                       model="m", status=200, replica="r0", output_tokens=8, e2e_ms=50.0)
fleet = FleetFile(pools=[FleetPool("m", "round_robin", [FleetReplica("r0", "a100-80g", "m")])])
sleeper = (sys.executable, "-c", "import os, sys, time; "
           "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)", sys.argv[1])
asyncio.run(run_replay([line], fleet, "m", ["round_robin"], 300.0, command=sleeper))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(2) is Linux's")
def test_a_replay_dies_with_its_gateway_even_sigkilled(tmp_path: Path) -> None:
    """A gateway SIGKILLed mid-replay (here a stand-in process running ``run_replay``)
    leaves no simulator behind: the kernel kills the replay with it."""
    pid_file = tmp_path / "replay.pid"
    gateway = subprocess.Popen([sys.executable, "-c", _STAND_IN, str(pid_file)])
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and gateway.poll() is None, "no replay started"
            time.sleep(0.05)
        replay = int(pid_file.read_text())
    finally:
        gateway.kill()
        gateway.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _alive(replay):
        assert time.monotonic() < deadline, f"replay {replay} outlived its gateway"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Running, and not a zombie (this test is not its parent: init reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
