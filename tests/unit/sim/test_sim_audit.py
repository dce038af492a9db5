"""The admission audit: forked replays of SLO-admission rejections, checked against
independent reruns, and its precision and recall where the predictions are pessimistic
(replicas faster than the brain's cost model) and where they are right or optimistic."""

from __future__ import annotations

import math
from random import Random

import pytest

from isocost.core.catalog import Catalog
from isocost.core.slo import SloTargets
from isocost.scheduling.policies import build_policy
from isocost.sim import (
    AdmissionAudit,
    AdmissionAuditor,
    ClusterConfig,
    ClusterEvent,
    ForcedAdmission,
    ReplicaGroup,
    SimPlan,
    SimRecord,
    Simulator,
    WorkloadChoice,
    json_rows,
    load_requests,
    resolve_cluster,
    run_plan,
    served_model,
)
from isocost.sim._core import AdmissionHook
from isocost.workload import Segment, SyntheticSpec, WorkloadRequest

CATALOG = Catalog.builtin()
SLO = SloTargets(ttft_s=1.0, tpot_s=0.1)


def _burst(count: int, prompt: int) -> list[WorkloadRequest]:
    """``count`` unrelated prompts, 20 ms apart: more than two replicas clear in time."""
    return [WorkloadRequest(i, 0.02 * i, prompt, 50, (Segment(i, prompt),)) for i in range(count)]


def _cluster(slowdown: float) -> ClusterConfig:
    group = ReplicaGroup(gpu="a100-80g", model="llama-3.1-8b", count=2, slowdown=slowdown)
    return ClusterConfig(replicas=[group])


def _run(
    cluster: ClusterConfig,
    requests: list[WorkloadRequest],
    hook: AdmissionHook | None,
    slo: SloTargets = SLO,
) -> list[SimRecord]:
    simulator = Simulator(
        cluster,
        resolve_cluster(cluster, CATALOG),
        build_policy("equal_cost", rng=Random(0)),
        requests,
        model=served_model(cluster),
        slo=slo,
        audit=hook,
    )
    return simulator.run().records


def _audited(
    cluster: ClusterConfig, requests: list[WorkloadRequest], slo: SloTargets = SLO
) -> tuple[AdmissionAudit, list[SimRecord], AdmissionAuditor]:
    auditor = AdmissionAuditor(slo)
    records = _run(cluster, requests, auditor, slo)
    return auditor.summary(records), records, auditor


def _met(record: SimRecord, times: tuple[float, float], slo: SloTargets = SLO) -> bool:
    ttft, e2e = times
    output = record.request.output_tokens
    return slo.met(record.request.prompt_tokens, ttft, (e2e - ttft) / (output - 1))


def test_replicas_faster_than_predicted_make_false_rejections_the_audit_counts() -> None:
    # slowdown 0.5: every step takes half what the brain's cost model predicts
    audit, records, _ = _audited(_cluster(0.5), _burst(60, 3000))
    rejected = [r for r in records if r.rejected == "deadline"]
    assert rejected and audit.rejections == len(rejected)
    assert all(r.counterfactual is not None for r in rejected)
    would_meet = [r for r in rejected if _met(r, r.counterfactual or (math.nan, math.nan))]
    assert audit.false_rejections == len(would_meet) - audit.true_for_others
    assert audit.false_rejections > len(rejected) // 2
    assert audit.true_rejections - audit.true_for_others == len(rejected) - len(would_meet)
    assert audit.precision is not None and audit.precision < 0.5
    assert audit.false_rejection_share == pytest.approx(len(would_meet) / 60)
    # In a burst each one admitted delays those arriving behind it: the balance shows it.
    assert audit.would_meet == len(would_meet)
    assert audit.later_lost > audit.later_saved >= 0
    assert audit.later_net_cost == (audit.later_lost - audit.later_saved) / len(would_meet)
    assert audit.later_net_se is not None and 0 < audit.later_net_se < audit.later_net_cost
    assert sum(c.rejections for c in audit.by_reason) == audit.rejections
    assert sum(c.false_rejections for c in audit.by_reason) == audit.false_rejections


def test_rejections_are_all_right_where_replicas_are_slower_than_predicted() -> None:
    audit, records, _ = _audited(_cluster(2.0), _burst(60, 3000))
    assert audit.rejections > 10
    assert audit.true_rejections == audit.rejections and audit.precision == 1.0
    missed = [r for r in records if r.rejected is None and not _met(r, _seen(r))]
    assert audit.admitted_missed == len(missed)
    assert audit.recall == pytest.approx(audit.rejections / (audit.rejections + len(missed)))


def test_prompts_no_replica_can_prefill_in_time_are_true_rejections() -> None:
    slo = SloTargets(ttft_s=0.3, tpot_s=0.1)  # a 9,000-token prefill alone takes ~0.8 s
    requests = [WorkloadRequest(i, float(i), 9000 if i % 2 else 300, 20, (Segment(i, 9000
                if i % 2 else 300),)) for i in range(10)]  # fmt: skip
    audit, records, _ = _audited(_cluster(1.0), requests, slo)
    assert [r.request.request_id for r in records if r.rejected] == [1, 3, 5, 7, 9]
    assert audit.true_rejections == audit.rejections == 5 and audit.admitted_missed == 0
    assert (audit.precision, audit.recall) == (1.0, 1.0)
    assert all("ttft" in c.reason.split("+") for c in audit.by_reason)  # too long to prefill


def test_a_rejection_that_keeps_the_streams_beside_it_on_target_is_true() -> None:
    """A 16,000-token prefill would stretch the inter-token time of 40 streams decoding
    near their 20 ms target: admitted, it meets its own SLOs, they miss theirs."""
    slo = SloTargets(ttft_s=5.0, tpot_s=0.02)
    requests = [WorkloadRequest(i, 0.01 * i, 200, 300, (Segment(i, 200),)) for i in range(40)]
    requests += [WorkloadRequest(100 + j, 1.0 + 0.5 * j, 16_000, 20, (Segment(100 + j, 16_000),))
                 for j in range(4)]  # fmt: skip
    audit, records, auditor = _audited(_cluster(1.0), requests, slo)
    protective = [r for r in records if r.counterfactual is not None]
    assert protective and audit.true_for_others == audit.true_rejections == len(protective)
    for record in protective:
        # held on arrival (its deadline allowed a wait), refused once it no longer did:
        # replayed as admitted when it was held
        assert record.held_s == record.request.arrival_s and record.rejected == "deadline"
        assert _met(record, record.counterfactual or (math.nan, math.nan), slo)
        assert any(not met for _, met in auditor.beside[record.request.request_id])
    assert audit.false_rejections == 0
    assert [(c.reason, c.false_rejections) for c in audit.by_reason] == [
        ("victims", 0)
    ]  # its own TTFT and TPOT were predicted fine: refused for the streams alone


def test_a_request_held_until_the_streams_ended_is_no_rejection() -> None:
    """The same 16,000-token prefill against 40 streams of 60 tokens: held on arrival,
    admitted once they end, in time; the audit counts no rejection."""
    slo = SloTargets(ttft_s=5.0, tpot_s=0.02)
    requests = [WorkloadRequest(i, 0.01 * i, 200, 60, (Segment(i, 200),)) for i in range(40)]
    requests.append(WorkloadRequest(100, 1.0, 16_000, 20, (Segment(100, 16_000),)))
    audit, records, _ = _audited(_cluster(1.0), requests, slo)
    long_prompt = records[-1]
    assert long_prompt.held_s == 1.0 and long_prompt.rejected is None
    assert long_prompt.counterfactual is None and _met(long_prompt, _seen(long_prompt), slo)
    streams_end = max(r.finished_s or math.inf for r in records[:-1])
    assert long_prompt.first_token_s is not None and long_prompt.first_token_s > streams_end
    assert audit.rejections == 0 and all(_met(r, _seen(r), slo) for r in records)
    cluster = _cluster(1.0)
    plan = SimPlan(
        cluster=cluster,
        replicas=tuple(resolve_cluster(cluster, CATALOG)),
        requests=requests,
        policies=("equal_cost",),
        slo=slo,
        jobs=1,
    )
    row = json_rows(run_plan(plan))[0]
    assert (row["held"], row["held_admitted"], row["rejected"]) == (1, 1, 0)


def _seen(record: SimRecord) -> tuple[float, float]:
    if record.first_token_s is None or record.finished_s is None:
        return math.nan, math.nan
    return (
        record.first_token_s - record.request.arrival_s,
        record.finished_s - record.request.arrival_s,
    )


def test_a_forked_replay_is_a_rerun_that_admits_the_request() -> None:
    """Every audited rejection's TTFT and E2E equal, to the bit, those of an independent
    run admitting just that request, on a cluster with scrapes, sessions and a failure;
    so do the outcomes of the requests beside it and after it."""
    cluster = ClusterConfig(
        replicas=[
            ReplicaGroup(gpu="a100-80g", model="llama-3.1-8b", name="a", count=2, slowdown=0.6),
            ReplicaGroup(gpu="l20-48g", model="llama-3.1-8b", name="b"),
        ],
        events=[
            ClusterEvent(at_s=3.0, replica="a-1", action="fail"),
            ClusterEvent(at_s=5.0, replica="a-1", action="recover"),
        ],
        scrape_interval_ms=100,
    )
    choice = WorkloadChoice(
        synthetic=SyntheticSpec(name="multi-turn", sessions=24, turns=3, system_tokens=3000),
        rate_rps=6.0,
        seed=2,
    )
    requests = load_requests(choice)
    audit, records, auditor = _audited(cluster, requests)
    audited = [r for r in records if r.counterfactual is not None]
    assert audit.rejections == len(audited) >= 3
    assert sum(len(auditor.beside[r.request.request_id]) for r in audited) >= 3
    assert sum(len(auditor.after[r.request.request_id]) for r in audited) >= 3
    for record in audited:
        rerun = _run(cluster, requests, ForcedAdmission(record.request.request_id))
        forced = rerun[records.index(record)]
        assert forced.rejected is None
        assert _seen(forced) == record.counterfactual
        assert not math.isnan(record.counterfactual[0])
        by_id = {r.request.request_id: r for r in rerun}
        request_id = record.request.request_id
        for other, met in auditor.beside[request_id] + auditor.after[request_id]:
            assert _met(by_id[other], _seen(by_id[other])) == met


def test_the_audit_rides_in_the_json_byte_for_byte() -> None:
    cluster = _cluster(0.5)
    plan = SimPlan(
        cluster=cluster,
        replicas=tuple(resolve_cluster(cluster, CATALOG)),
        requests=_burst(40, 3000),
        policies=("equal_cost", "round_robin"),
        slo=SLO,
        jobs=1,
        audit_admission=True,
    )
    rows = json_rows(run_plan(plan))
    assert rows == json_rows(run_plan(plan))
    audit = rows[0]["admission_audit"]
    assert audit["rejections"] == rows[0]["rejected_by_reason"]["deadline"] > 0
    assert rows[1]["admission_audit"]["rejections"] == 0  # round_robin admits everything
    assert "admission_audit" not in rows[2]  # the oracle
    plain = json_rows(run_plan(SimPlan(**{**_fields(plan), "audit_admission": False})))
    assert all("admission_audit" not in row for row in plain)
    assert [{k: v for k, v in row.items() if k != "admission_audit"} for row in rows] == plain


def _fields(plan: SimPlan) -> dict[str, object]:
    return {name: getattr(plan, name) for name in plan.__dataclass_fields__}
