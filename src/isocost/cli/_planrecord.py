"""``isocost plan --from-record DIR``: the cheapest fleet for a recording's traffic."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from rich.table import Table

from isocost.cli._app import console, fail

if TYPE_CHECKING:
    from isocost.core.catalog import Catalog
    from isocost.sim import FleetPlan, FleetTrial


def plan_from_record(
    directory: str,
    catalog: Catalog,
    *,
    ttft_slo_ms: float | None,
    tpot_slo_ms: float | None,
    target: float,
    growth: float,
    policy: str | None,
    gpus: str | None,
    max_replicas: int,
    pool: str | None,
    as_json: bool,
) -> None:
    """Sweep fleets by simulation and print the cheapest meeting the SLOs."""
    from isocost import sim as simulator
    from isocost.core.slo import SloTargets

    if ttft_slo_ms is None or tpot_slo_ms is None:
        fail("--from-record needs --ttft-slo-ms and --tpot-slo-ms")
    try:
        slo = SloTargets.from_ms(ttft_slo_ms, tpot_slo_ms, 0.0, share=target)
    except ValueError as exc:
        fail(f"SLO: {exc}")
    recording = simulator.load_recording(directory, pool)
    catalog = simulator.recorded_catalog(recording, catalog, directory)
    names = [catalog.gpu(g).id for g in (gpus or "").split(",") if g.strip()]
    if policy is not None:
        simulator.check_policies((policy,))
    result = simulator.plan_fleet(
        recording,
        catalog,
        slo,
        growth=growth,
        policy=policy,
        gpus=names,
        max_replicas=max_replicas,
    )
    if as_json:
        console.print_json(json.dumps(_as_dict(result), sort_keys=True))
        return
    _print(result, slo.share)


def _trial(t: FleetTrial) -> dict[str, Any]:
    s = t.summary
    return {
        "gpu": t.gpu,
        "tp": t.tp,
        "replicas": t.count,
        "slowdown": round(t.slowdown, 4),
        "usd_per_hour": round(t.usd_per_hour, 4),
        "usd_per_million_tokens": t.usd_per_million_tokens,
        "meets_slo": t.meets,
        "slo_attainment": s.slo_attainment,
        "ttft_p99_s": s.ttft_p99_s,
        "tpot_p99_s": s.tpot_p99_s,
    }


def _as_dict(result: FleetPlan) -> dict[str, Any]:
    return {
        "policy": result.policy,
        "growth": result.growth,
        "cheapest": _trial(result.cheapest) if result.cheapest else None,
        "one_smaller": _trial(result.smaller) if result.smaller else None,
        "per_gpu": [_trial(t) for t in result.best_per_gpu],
        "unmet": result.unmet,
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or seconds != seconds else f"{seconds * 1000:,.0f}"


def _print(result: FleetPlan, share: float) -> None:
    table = Table(title=f"fleets meeting the SLOs ({result.policy}, traffic x{result.growth:g})")
    for column in ("fleet", "$/h", "$/M tok", "SLO %", "TTFT p99", "TPOT p99"):
        table.add_column(column, justify="left" if column == "fleet" else "right")
    for t in result.best_per_gpu:
        per_m = t.usd_per_million_tokens
        table.add_row(
            f"{t.count} x {t.tp}x {t.gpu}",
            f"{t.usd_per_hour:,.2f}",
            "-" if per_m is None else f"{per_m:,.3f}",
            f"{100 * t.summary.slo_attainment:.1f}",
            _ms(t.summary.ttft_p99_s),
            _ms(t.summary.tpot_p99_s),
        )
    console.print(table)
    if result.unmet:
        console.print(f"miss the SLOs at the largest fleet tried: {', '.join(result.unmet)}")
    best, smaller = result.cheapest, result.smaller
    if best is None:
        fail("no fleet meets the SLOs: raise --max-replicas or relax the SLOs", code=1)
    per_m = best.usd_per_million_tokens
    console.print(
        f"cheapest: {best.count} x {best.tp}x {best.gpu}, ${best.usd_per_hour:,.2f}/h"
        + ("" if per_m is None else f", ${per_m:,.3f} per million tokens"),
        highlight=False,
    )
    if smaller is not None:
        console.print(
            f"one replica fewer ({smaller.count}): "
            f"{100 * smaller.summary.slo_attainment:.1f}% meet the SLOs "
            f"(target {100 * share:.0f}%)",
            highlight=False,
        )
