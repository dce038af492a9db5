"""A recording as the simulator's workload and fleet: calibration as slowdown, what-if
failures, and the fleet planner's cheapest fleet (it meets the SLOs, one fewer does not)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from random import Random

import msgspec
import pytest

from isocost.core.catalog import Catalog, gpus_catalog_yaml
from isocost.core.costmodel import CostModel
from isocost.core.errors import ConfigError
from isocost.core.slo import SloTargets
from isocost.runtime.recording import (
    FLEET_FILE,
    FleetFile,
    FleetPool,
    FleetReplica,
    RecordedRequest,
)
from isocost.scheduling.policies import build_policy
from isocost.sim import (
    ClusterConfig,
    ReplicaGroup,
    SimPlan,
    SimReplica,
    Simulator,
    light_requests,
    load_recording,
    plan_fleet,
    recorded_catalog,
    recorded_cluster,
    resolve_cluster,
    run_plan,
)
from isocost.workload import parse_trace

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "traces"
TRACE = FIXTURE / "mooncake_conversation_head.jsonl"
MODEL = "llama-3.1-8b"
SLO = SloTargets.from_ms(1000, 100, 250.0, share=0.9)  # long prompts get longer


def _record(directory: Path, factors: tuple[float, float], requests: int = 60) -> Path:
    """A recording of the fixture trace's first ``requests`` on two A100 replicas that
    learned ``factors`` (TTFT, ITL), plus one request of another pool."""
    directory.mkdir()
    lines = TRACE.read_text().splitlines()[:requests]
    rows = [
        {**row, "model": MODEL, "status": 200, "output_tokens": row["output_length"], "e2e_ms": 1}
        for row in map(json.loads, lines)
    ]  # no TTFT recorded: nothing to fit, the gateway's factors stand
    rows.append({**rows[0], "model": "other-model"})
    (directory / "trace-000000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    replicas = [
        FleetReplica(name, "a100-80g", MODEL, ttft_factor=factors[0], itl_factor=factors[1])
        for name in ("10.0.0.1:8000", "10.0.0.2:8000")
    ]
    fleet = FleetFile(pools=[FleetPool(MODEL, "round_robin", replicas)])
    (directory / FLEET_FILE).write_bytes(msgspec.json.encode(fleet))
    return directory


def _replay(directory: Path) -> float:
    recording = load_recording(str(directory), None)
    cluster, replicas = recorded_cluster(recording, Catalog.builtin(), "test")
    plan = SimPlan(cluster, tuple(replicas), recording.requests, ("round_robin",), SLO, jobs=1)
    return run_plan(plan).runs[0].summary.e2e_p50_s


def test_the_recorded_fleet_runs_at_its_learned_slowdown(tmp_path: Path) -> None:
    recording = load_recording(str(_record(tmp_path / "rec", (4.0, 1.0))), None)
    assert len(recording.requests) == 60  # the other pool's request is not replayed
    cluster, replicas = recorded_cluster(recording, Catalog.builtin(), "test")
    assert [r.replica_id for r in replicas] == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert [r.slowdown for r in replicas] == [pytest.approx(2.0)] * 2
    assert cluster.served_model == MODEL
    slow = _replay(tmp_path / "rec")
    fast = _replay(_record(tmp_path / "fast", (1.0, 1.0)))
    assert slow > 1.5 * fast


def test_a_failure_what_if_is_an_event_on_a_recorded_replica(tmp_path: Path) -> None:
    recording = load_recording(str(_record(tmp_path / "rec", (1.0, 1.0))), None)
    cluster, _ = recorded_cluster(
        recording, Catalog.builtin(), "test", failures=[("10.0.0.2:8000", 5.0)]
    )
    (event,) = cluster.events
    assert (event.replica, event.at_s, event.action) == ("10.0.0.2:8000", 5.0, "fail")
    with pytest.raises(ConfigError, match=r"10\.0\.0\.1:8000, 10\.0\.0\.2:8000"):
        recorded_cluster(recording, Catalog.builtin(), "test", failures=[("nope", 1.0)])


def test_the_gpus_a_gateway_described_replay_unless_the_replay_describes_them(
    tmp_path: Path,
) -> None:
    """Built-in < what the recording's gateway described < the replay's own --catalog."""
    shipped = Catalog.builtin()
    site = dataclasses.replace(shipped.gpu("a100-80g"), id="a100-site", bf16_flops=2e14)
    tuned = dataclasses.replace(shipped.gpu("l20-48g"), step_overhead_s=0.009)  # same id
    directory = _record(tmp_path / "rec", (1.0, 1.0))
    fleet = msgspec.json.decode((directory / FLEET_FILE).read_bytes(), type=FleetFile)
    fleet = msgspec.structs.replace(fleet, catalog=gpus_catalog_yaml([site, tuned]))
    (directory / FLEET_FILE).write_bytes(msgspec.json.encode(fleet))
    recording = load_recording(str(directory), None)

    replayed = recorded_catalog(recording, shipped, "rec")
    assert replayed.gpu("a100-site").bf16_flops == site.bf16_flops
    assert replayed.gpu("l20-48g").step_overhead_s == tuned.step_overhead_s
    assert replayed.gpu("h100-80g") == shipped.gpu("h100-80g")
    own = dataclasses.replace(site, bf16_flops=3e14)
    given = shipped.merged(gpus_catalog_yaml([own]), "mine.yaml")
    assert recorded_catalog(recording, given, "rec").gpu("a100-site").bf16_flops == 3e14
    assert recorded_catalog(load_recording(str(_record(tmp_path / "plain", (1.0, 1.0))), None),
                            shipped, "plain") is shipped  # fmt: skip


def test_a_directory_without_a_fleet_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"fleet\.json"):
        load_recording(str(tmp_path), None)


@pytest.mark.parametrize(
    ("factors", "key", "message"),
    [
        ((1.0, -1.0), "pools[0].replicas[0].itl_factor", "must be > 0"),
        ((0.0, 1.0), "pools[0].replicas[0].ttft_factor", "must be > 0"),
    ],
)
def test_a_fleet_with_a_factor_out_of_range_is_refused_when_read(
    tmp_path: Path, factors: tuple[float, float], key: str, message: str
) -> None:
    """The replica's slowdown is the square root of their product: none below 0, and a
    replica of slowdown 0 would take no time at all."""
    directory = _record(tmp_path / "r", factors)
    with pytest.raises(ConfigError) as error:
        load_recording(str(directory), None)
    assert str(error.value) == f"{directory / FLEET_FILE}: {key}: {message}"


def test_a_fleet_with_a_key_it_does_not_know_is_refused(tmp_path: Path) -> None:
    directory = _record(tmp_path / "r", (1.0, 1.0))
    fleet = json.loads((directory / FLEET_FILE).read_text())
    (directory / FLEET_FILE).write_text(json.dumps({**fleet, "bogus": 1}))
    with pytest.raises(ConfigError, match="unknown field `bogus`"):
        load_recording(str(directory), None)


def test_the_cheapest_fleet_meets_the_slos_and_one_fewer_does_not(tmp_path: Path) -> None:
    recording = load_recording(str(_record(tmp_path / "rec", (1.0, 1.0))), None)
    result = plan_fleet(recording, Catalog.builtin(), SLO, gpus=["a100-80g"], max_replicas=32)
    best, smaller = result.cheapest, result.smaller
    assert best is not None and smaller is not None and best.count > 1
    assert best.meets and best.summary.slo_attainment >= 0.9
    assert not smaller.meets and smaller.count == best.count - 1
    assert best.usd_per_hour == pytest.approx(best.count * 1.6)  # the catalog's A100 price
    assert best.usd_per_million_tokens is not None and best.usd_per_million_tokens > 0
    grown = plan_fleet(recording, Catalog.builtin(), SLO, growth=2.0, gpus=["a100-80g"])
    assert grown.cheapest is not None and grown.cheapest.count > best.count


def _simulated_recording(directory: Path, replicas: list[SimReplica]) -> Path:
    """A "live" run simulated on ``replicas`` (round robin, the fixture trace's first 60
    requests), recorded as the gateway records, its fleet at the gateway's defaults
    (A100s, factors 1.0)."""
    cluster = ClusterConfig(
        replicas=[ReplicaGroup(gpu="a100-80g", model=MODEL, name=r.replica_id) for r in replicas],
        served_model=MODEL,
    )
    lines = [json.loads(line) for line in TRACE.read_text().splitlines()[:60]]
    requests = parse_trace([json.dumps(row) for row in lines], "fixture")
    policy = build_policy("round_robin", rng=Random(0))
    live = Simulator(cluster, replicas, policy, requests, model=MODEL).run()
    directory.mkdir()
    rows = []
    for record in live.records:
        assert record.first_token_s is not None and record.finished_s is not None
        arrival = record.request.arrival_s
        rows.append(
            RecordedRequest(
                timestamp=arrival * 1000,
                input_length=record.request.prompt_tokens,
                output_length=record.request.output_tokens,
                hash_ids=lines[record.request.request_id]["hash_ids"],
                model=MODEL,
                status=200,
                replica=record.replica_id,
                output_tokens=record.output_tokens,
                ttft_ms=(record.first_token_s - arrival) * 1000,
                e2e_ms=(record.finished_s - arrival) * 1000,
            )
        )
    (directory / "trace-000000.jsonl").write_bytes(
        b"".join(msgspec.json.encode(row) + b"\n" for row in rows)
    )
    fleet = [FleetReplica(r.replica_id, "a100-80g", MODEL) for r in replicas]
    (directory / FLEET_FILE).write_bytes(
        msgspec.json.encode(FleetFile(pools=[FleetPool(MODEL, "round_robin", fleet)]))
    )
    return directory


def _a100s(**slowdowns: float) -> list[SimReplica]:
    groups = [
        ReplicaGroup(gpu="a100-80g", model=MODEL, name=name, slowdown=slowdown)
        for name, slowdown in slowdowns.items()
    ]
    replicas = resolve_cluster(ClusterConfig(replicas=groups), Catalog.builtin())
    return [dataclasses.replace(r, replica_id=r.replica_id[:-2]) for r in replicas]


def _fitted(directory: Path, *, fit_prefill: bool = True) -> dict[str, tuple[float, float]]:
    """Per replica, the fitted (slowdown, prefill overhead in ms)."""
    recording = load_recording(str(directory), None)
    _, fitted = recorded_cluster(recording, Catalog.builtin(), "test", fit_prefill=fit_prefill)
    return {r.replica_id: (r.slowdown, 1000 * r.cost_model.gpu.prefill_overhead_s) for r in fitted}


def test_slowdowns_are_fitted_to_what_the_replicas_showed(tmp_path: Path) -> None:
    """A "live" run simulated with one replica 2.5x slow, recorded with the gateway's
    factors at 1.0: the fit finds both speeds again, and the prefill overhead the A100
    has (3 ms) on both."""
    directory = _simulated_recording(tmp_path / "rec", _a100s(fast=1.0, slow=2.5))
    recording = load_recording(str(directory), None)
    _, unfitted = recorded_cluster(recording, Catalog.builtin(), "test", fit=False)
    assert [r.slowdown for r in unfitted] == [1.0, 1.0]
    found = _fitted(directory)
    assert {name: slowdown for name, (slowdown, _) in found.items()} == {
        "fast": pytest.approx(1.0, rel=0.1),
        "slow": pytest.approx(2.5, rel=0.1),
    }
    assert [overhead for _, overhead in found.values()] == [pytest.approx(3.0, abs=1.0)] * 2


def test_a_prefill_dearer_than_the_gpus_is_fitted_from_light_requests(tmp_path: Path) -> None:
    """A "live" replica whose every prefill chunk costs 60 ms more than the recorded GPU's
    (a CPU-like engine: decode steps as the A100's, prefill not): the fit finds that
    overhead from the requests that met it least loaded, and leaves both speeds alone."""
    fast, dear = _a100s(fast=1.0, dear=1.0)
    gpu = dataclasses.replace(dear.cost_model.gpu, prefill_overhead_s=0.063)
    dear = dataclasses.replace(dear, cost_model=CostModel(dear.cost_model.model, gpu))
    directory = _simulated_recording(tmp_path / "rec", [fast, dear])
    recording = load_recording(str(directory), None)
    light = light_requests(recording.outcomes)
    assert sorted(light) == ["dear", "fast"] and all(len(v) >= 3 for v in light.values())
    found = _fitted(directory)
    assert found["dear"][1] == pytest.approx(63.0, rel=0.15)
    assert found["fast"][1] == pytest.approx(3.0, abs=1.0)
    assert [slowdown for slowdown, _ in found.values()] == [pytest.approx(1.0, rel=0.1)] * 2
    # Not asked: the recorded GPU's overhead stays (the default of sim --from-record).
    assert [ms for _, ms in _fitted(directory, fit_prefill=False).values()] == [3.0, 3.0]
