"""control/: forecast, learned lead and capacity, desired replicas, guard, scale-in,
budgets, cheapest-first, drain plans, and config errors."""

from __future__ import annotations

import math
import re

import pytest

from isocost.control import (
    AutoscaleConfig,
    Autoscaler,
    CapacityEstimate,
    DemandForecast,
    HpaScaler,
    Observation,
    PoolConfig,
    PoolOffer,
    ReplicaStatus,
    WarmupLead,
    attainment_verdict,
    parse_autoscale_config,
    plan_changes,
    planned_capacity_rps,
)
from isocost.core.catalog import Catalog
from isocost.core.costmodel import CostModel
from isocost.core.errors import ConfigError
from isocost.core.planner import PlanRequest, plan
from isocost.core.slo import SloTargets

INTERVAL = 15.0


def _fleet(
    gpu: str, ready: int, pending: int = 0, draining: int = 0, ejected: int = 0
) -> list[ReplicaStatus]:
    states = ["ready"] * ready + ["pending"] * pending + ["draining"] * draining
    states += ["ejected"] * ejected
    return [
        ReplicaStatus(f"{gpu}-{i}", gpu, state, started_s=float(i), in_flight=i % 3)  # type: ignore[arg-type]
        for i, state in enumerate(states)
    ]


def _observe(
    now: float,
    rate: float,
    replicas: list[ReplicaStatus],
    queued: int = 0,
    attainment: float | None = None,
) -> Observation:
    return Observation(
        now=now,
        interval_s=INTERVAL,
        arrivals=round(rate * INTERVAL),
        queued=queued,
        attainment=attainment,
        settled=0 if attainment is None else 100,
        completions={},
        replicas=replicas,
    )


def _config(**overrides: object) -> AutoscaleConfig:
    settings: dict[str, object] = {
        "pools": [PoolConfig(gpu="a", min=2, max=40, cold_start_s=120.0)],
        "max_gpus": 1000,
        "interval_s": INTERVAL,
        "headroom": 0.2,
    }
    settings.update(overrides)
    return AutoscaleConfig(**settings)  # type: ignore[arg-type]


def _scaler(config: AutoscaleConfig | None = None, capacity: float = 1.0) -> Autoscaler:
    return Autoscaler(config or _config(), [PoolOffer("a", 1, 2.0, capacity)])


# -- forecast -----------------------------------------------------------------------


def test_the_season_predicts_tomorrows_ramp_before_it_starts() -> None:
    season = 3600.0
    forecast = DemandForecast(season, bucket_s=60)
    curve = [10.0] * 30 + [50.0] * 30  # a step at minute 30, yesterday
    for minute, rate in enumerate(curve):
        forecast.observe(minute * 60.0 - season, rate)
    forecast.observe(25 * 60.0, 10.0)  # today, 5 minutes before the step: still flat
    assert forecast.peak(25 * 60.0, 60.0) == pytest.approx(10.0)
    assert forecast.peak(25 * 60.0, 600.0) == pytest.approx(50.0)


def test_the_season_is_scaled_to_todays_level() -> None:
    forecast = DemandForecast(3600.0, bucket_s=60)
    for minute in range(60):
        forecast.observe(minute * 60.0 - 3600.0, 10.0 if minute < 30 else 20.0)
    forecast.observe(20 * 60.0, 15.0)  # today runs 1.5x yesterday
    assert forecast.peak(20 * 60.0, 900.0) == pytest.approx(30.0)


def test_a_burst_today_is_carried_as_it_is_not_multiplied_into_the_ramp() -> None:
    forecast = DemandForecast(3600.0, bucket_s=60)
    for minute in range(60):
        forecast.observe(minute * 60.0 - 3600.0, 10.0 if minute < 30 else 50.0)
    now = 15 * 60.0
    for _ in range(40):  # ten minutes as yesterday
        now += 15.0
        forecast.observe(now, 10.0)
    for _ in range(2):  # then a burst: twice the rate
        now += 15.0
        forecast.observe(now, 20.0)
    assert forecast.level is not None and forecast.level > 14.0
    excess = forecast.level - 10.0  # today runs as yesterday, plus the burst
    assert forecast.peak(now, 600.0) == pytest.approx(50.0 + excess)


def test_a_random_burst_yesterday_is_not_predicted_today() -> None:
    forecast = DemandForecast(3600.0, bucket_s=60, smooth_s=600)
    for minute in range(60):
        forecast.observe(minute * 60.0 - 3600.0, 40.0 if minute in (40, 41) else 10.0)
    forecast.observe(30 * 60.0, 10.0)
    assert forecast.peak(30 * 60.0, 900.0) == pytest.approx(10.0)


def test_without_a_season_the_trend_extrapolates() -> None:
    forecast = DemandForecast(86_400.0)
    for i in range(10):
        forecast.observe(i * 15.0, 10.0 + i)  # +1 req/s every 15 s
    assert forecast.slope() == pytest.approx(1 / 15)
    assert forecast.peak(135.0, 150.0) > forecast.level + 9  # level + slope x horizon


# -- learned lead and capacity ------------------------------------------------------------


def test_the_lead_is_the_prior_until_measured_then_covers_slow_starts() -> None:
    lead = WarmupLead({"a": 300.0})
    assert lead.lead_s("a") == 300.0 and not lead.measured("a")
    for seconds in (100.0, 140.0, 100.0, 140.0):
        lead.observe("a", seconds)
    assert lead.measured("a")
    assert 120.0 < lead.lead_s("a") < 200.0  # mean + 2 deviations, well under the prior


def test_capacity_moves_only_on_evidence() -> None:
    estimate = CapacityEstimate({"a": 1.0})
    estimate.observe("a", 0.5, met_target=True)  # met below the estimate: says nothing
    estimate.observe("a", 1.5, met_target=False)  # missed above it: says nothing
    assert estimate.rps("a") == 1.0
    estimate.observe("a", 0.6, met_target=False)  # missed below: too optimistic
    assert estimate.rps("a") < 1.0
    low = estimate.rps("a")
    estimate.observe("a", 1.2, met_target=True)  # met above: too pessimistic
    assert estimate.rps("a") > low


def test_the_planned_capacity_is_the_planners_figure() -> None:
    catalog = Catalog.builtin()
    cost = CostModel(catalog.model("llama-3.1-8b"), catalog.gpu("a100-80g"), 1)
    slo = SloTargets(ttft_s=1.0, tpot_s=0.05)
    figure = planned_capacity_rps(cost, 1500, 300, slo)
    option = plan(
        PlanRequest(
            cost.model,
            cost.gpu,
            context_tokens=1800,
            output_tokens=300,
            ttft_slo_s=1.0,
            tpot_slo_s=0.05,
        )
    ).options[0]
    assert figure == option.requests_per_s
    with pytest.raises(ValueError, match="meets the SLOs at no batch"):
        planned_capacity_rps(cost, 1500, 300, SloTargets(ttft_s=0.001, tpot_s=0.001))


# -- desired replicas -----------------------------------------------------------------


def test_desired_is_forecast_over_capacity_times_headroom() -> None:
    scaler = _scaler(capacity=2.0)
    decision = scaler.decide(_observe(15.0, 30.0, _fleet("a", 2)))
    assert decision.targets == {"a": math.ceil(30.0 * 1.2 / 2.0)}
    assert decision.start == {"a": 16} and decision.reason == "forecast"


class _KnownPeak:
    """A forecast that knows the peak ahead (what a benchmark's oracle stands in for)."""

    def __init__(self, peak: float) -> None:
        self.peak_rps = peak
        self.observed: list[tuple[float, float]] = []

    def observe(self, now: float, rate_rps: float) -> None:
        self.observed.append((now, rate_rps))

    def peak(self, now: float, horizon_s: float) -> float:
        return self.peak_rps

    def slope(self) -> float:
        return 0.0


def test_another_forecast_stands_in_for_the_seasonal_one() -> None:
    forecast = _KnownPeak(50.0)
    scaler = Autoscaler(_config(), [PoolOffer("a", 1, 2.0, 2.0)], [(-15.0, 4.0)], forecast)
    decision = scaler.decide(_observe(15.0, 10.0, _fleet("a", 2)))
    assert decision.forecast_rps == 50.0  # not today's 10 req/s
    assert decision.targets == {"a": math.ceil(50.0 * 1.2 / 2.0)}
    assert forecast.observed == [(-15.0, 4.0), (15.0, 10.0)]  # the history fed in first


def test_pending_replicas_count_so_a_ramp_is_not_ordered_twice() -> None:
    scaler = _scaler(capacity=2.0)
    decision = scaler.decide(_observe(15.0, 30.0, _fleet("a", 2, pending=16)))
    assert not decision.changes


def test_the_pool_bounds_and_the_gpu_budget_cap_the_fleet() -> None:
    scaler = _scaler(_config(max_gpus=10), capacity=1.0)
    decision = scaler.decide(_observe(15.0, 100.0, _fleet("a", 2)))
    assert decision.targets == {"a": 10}
    bounded = _scaler(capacity=1.0).decide(_observe(15.0, 1000.0, _fleet("a", 2)))
    assert bounded.targets == {"a": 40}
    floor = _scaler(capacity=1.0).decide(_observe(15.0, 0.0, _fleet("a", 0)))
    assert floor.targets == {"a": 2} and floor.reason == "bounds"


def test_ejected_replicas_are_replaced_within_the_max_and_budget_counting_them() -> None:
    need_10 = 10.0 / 1.2  # req/s that 10 replicas of 1 req/s cover with 20% headroom
    replaced = _scaler(capacity=1.0).decide(_observe(15.0, need_10, _fleet("a", 8, ejected=2)))
    assert replaced.start == {"a": 2} and replaced.drain == ()
    capped = _scaler(_config(pools=[PoolConfig(gpu="a", min=2, max=10)]), capacity=1.0)
    at_max = capped.decide(_observe(15.0, need_10, _fleet("a", 8, ejected=2)))
    assert not at_max.changes  # 8 serving + 2 held = the max
    budget = _scaler(_config(max_gpus=11), capacity=1.0)
    within = budget.decide(_observe(15.0, need_10, _fleet("a", 8, ejected=2)))
    assert within.start == {"a": 1}  # 9 + 2 held = 11 GPUs
    over = capped.decide(_observe(30.0, 0.5 * need_10, _fleet("a", 10, ejected=3)))
    assert over.drain == ()  # ejected ones past the max never drain a serving replica


def test_the_cheapest_goodput_is_added_first_and_the_dearest_removed_first() -> None:
    pools = [PoolConfig(gpu="cheap", max=4), PoolConfig(gpu="dear", max=20)]
    config = _config(pools=pools, scale_in_after_s=30.0, scale_down_cooldown_s=0.0)
    offers = [PoolOffer("dear", 1, 4.0, 1.0), PoolOffer("cheap", 1, 1.0, 1.0)]
    scaler = Autoscaler(config, offers)
    up = scaler.decide(_observe(15.0, 5.0, []))
    assert up.targets == {"cheap": 4, "dear": 2}  # 6 needed: the 4 cheap ones, then dear
    fleet = _fleet("cheap", 4) + _fleet("dear", 2)
    for i in range(2, 20):  # the level settles at 2 req/s, the fleet follows
        down = scaler.decide(_observe(15.0 * i, 2.0, fleet))
    assert down.targets == {"cheap": 3, "dear": 0}
    assert sorted(down.drain) == ["cheap-3", "dear-0", "dear-1"]  # idle, newest first


def test_the_usd_budget_stops_dear_replicas() -> None:
    pools = [PoolConfig(gpu="cheap", max=2), PoolConfig(gpu="dear", max=20)]
    config = _config(pools=pools, max_gpus=None, max_usd_per_hour=10.0)
    offers = [PoolOffer("cheap", 1, 1.0, 1.0), PoolOffer("dear", 1, 4.0, 1.0)]
    decision = Autoscaler(config, offers).decide(_observe(15.0, 20.0, []))
    assert decision.targets == {"cheap": 2, "dear": 2}  # 2 x $1 + 2 x $4 = $10


# -- reactive guard -------------------------------------------------------------------


def test_a_queue_that_keeps_growing_scales_up_beyond_the_forecast() -> None:
    scaler = _scaler(_config(guard_window_s=30.0, queue_per_replica=2.0), capacity=1.0)
    fleet = _fleet("a", 10)
    decisions = [
        scaler.decide(_observe(15.0 * i, 8.0, fleet, queued=30 + 20 * i)) for i in range(1, 5)
    ]
    assert decisions[0].reason == "hold"  # growth not sustained yet
    guarded = [d for d in decisions if d.reason == "guard"]
    assert guarded and guarded[0].targets["a"] > 10


def test_attainment_below_target_scales_up_now() -> None:
    scaler = _scaler(capacity=1.0)
    decision = scaler.decide(_observe(15.0, 8.0, _fleet("a", 10), attainment=0.5))
    assert decision.reason == "guard" and decision.targets["a"] == 12


def test_a_miss_counts_only_when_chance_cannot_explain_it() -> None:
    assert attainment_verdict(98, 100, 0.98) is True
    assert attainment_verdict(97, 100, 0.98) is None  # 3 misses: one window in five at 98.5%
    assert attainment_verdict(90, 100, 0.98) is False
    assert attainment_verdict(970, 1000, 0.98) is False  # more requests: a smaller gap is sure
    assert attainment_verdict(0, 49, 0.98) is None  # too few to say anything


def test_chance_misses_neither_scale_up_nor_lower_the_capacity() -> None:
    config = _config(attainment_target=0.98)
    for attainment, guarded in ((0.97, False), (0.9, True)):
        scaler = _scaler(config, capacity=1.0)
        observation = Observation(
            now=15.0,
            interval_s=INTERVAL,
            arrivals=round(4.0 * INTERVAL),
            queued=0,
            attainment=attainment,
            settled=100,
            completions={"a": round(0.4 * 10 * INTERVAL)},  # 0.4 req/s per replica
            replicas=_fleet("a", 10),
        )
        decision = scaler.decide(observation)
        assert (decision.reason == "guard") is guarded
        assert (scaler.capacity.rps("a") < 1.0) is guarded  # a miss at 0.4: too optimistic


def _missed(
    arrival_rps: float, served_rps: dict[str, float], fleet: list[ReplicaStatus]
) -> Observation:
    """An interval whose settled requests surely missed a 98% target."""
    return Observation(
        now=15.0,
        interval_s=INTERVAL,
        arrivals=round(arrival_rps * INTERVAL),
        queued=0,
        attainment=0.5,
        settled=100,
        completions={gpu: round(rps * INTERVAL) for gpu, rps in served_rps.items()},
        replicas=fleet,
    )


def test_a_miss_is_judged_at_the_load_offered_when_the_fleet_was_behind() -> None:
    config = _config(attainment_target=0.98)
    behind = _scaler(config, capacity=1.0)  # 10 replicas served 0.6 each, 15 req/s arrived
    behind.decide(_missed(15.0, {"a": 6.0}, _fleet("a", 10)))
    assert behind.capacity.rps("a") == 1.0  # offered 1.5 each: the miss says nothing
    slow = _scaler(config, capacity=1.0)  # as many arrived as were served: too optimistic
    slow.decide(_missed(6.0, {"a": 6.0}, _fleet("a", 10)))
    assert slow.capacity.rps("a") == pytest.approx(0.1 * 0.6 + 0.9 * 1.0)
    # two pools, the second twice the first's capacity: offered in that proportion
    config = _config(
        attainment_target=0.98,
        pools=[PoolConfig(gpu=g, min=1, max=40, cold_start_s=120.0) for g in ("a", "b")],
    )
    mixed = Autoscaler(config, [PoolOffer("a", 1, 2.0, 1.0), PoolOffer("b", 1, 4.0, 2.0)])
    fleet = _fleet("a", 5) + _fleet("b", 5)  # supply 15 req/s; 12 arrived: 0.8 and 1.6 each
    mixed.decide(_missed(12.0, {"a": 2.0, "b": 5.0}, fleet))
    assert mixed.capacity.rps("a") == pytest.approx(0.1 * 0.8 + 0.9 * 1.0)
    assert mixed.capacity.rps("b") == pytest.approx(0.1 * 1.6 + 0.9 * 2.0)


# -- scale-in, cool-downs -------------------------------------------------------------


def test_scale_in_waits_for_sustained_low_demand_and_the_cooldowns() -> None:
    config = _config(scale_in_after_s=60.0, scale_down_cooldown_s=45.0, scale_up_cooldown_s=0.0)
    scaler = _scaler(config, capacity=1.0)
    fleet = _fleet("a", 20)
    reasons = [scaler.decide(_observe(15.0 * i, 5.0, fleet)).reason for i in range(1, 7)]
    assert reasons[:4] == ["hold"] * 4  # low demand not yet sustained for 60 s
    assert "scale-in" in reasons[4:]
    # a short spike in the window keeps the fleet that served it
    spiky = _scaler(config, capacity=1.0)
    rates = [5.0, 15.0, 5.0, 5.0, 5.0, 5.0]
    last = None
    for i, rate in enumerate(rates, start=1):
        last = spiky.decide(_observe(15.0 * i, rate, fleet))
    assert last is not None and last.targets["a"] >= 15


def test_scale_in_keeps_what_the_forecast_wants_back_within_two_horizons() -> None:
    config = _config(season_s=3600.0, scale_in_after_s=60.0, scale_down_cooldown_s=0.0)
    # yesterday: 5 req/s, then 20 from minute 10; the horizon is 120 s lead + 15 s
    history = [(m * 60.0 - 3600.0, 5.0 if m < 10 else 20.0) for m in range(60)]
    flat = [(t, 5.0) for t, _ in history]
    targets = {}
    for name, past in (("rise", history), ("flat", flat)):
        scaler = Autoscaler(config, [PoolOffer("a", 1, 2.0, 1.0)], past)
        for now in range(15, 451, 15):  # to minute 7.5: the rise is 150 s away
            decision = scaler.decide(_observe(float(now), 5.0, _fleet("a", 30)))
        assert decision.reason == "scale-in"
        targets[name] = decision.targets["a"]
    assert targets["flat"] == math.ceil(5.0 * 1.2)
    assert 20.0 * 1.2 <= targets["rise"] < 30  # not drained only to be started again


def test_a_scale_up_starts_the_scale_in_cooldown() -> None:
    config = _config(scale_in_after_s=0.0, scale_down_cooldown_s=100.0)
    scaler = _scaler(config, capacity=1.0)
    scaler.decide(_observe(15.0, 20.0, _fleet("a", 2)))  # up to 24
    decision = scaler.decide(_observe(30.0, 1.0, _fleet("a", 24)))
    assert not decision.drain


def test_a_scale_up_adds_at_least_the_step() -> None:
    # 10 ready, 10.8 req/s needed (9 x 1.2): one replica covers it, the step asks for 3
    fine = _scaler(capacity=1.0).decide(_observe(15.0, 9.0, _fleet("a", 10)))
    assert fine.start == {"a": 1}
    stepped = _scaler(_config(scale_step=0.3), capacity=1.0)
    assert stepped.decide(_observe(15.0, 9.0, _fleet("a", 10))).start == {"a": 3}
    # a need beyond the step is met whole (28.8: 19 more), and the pool's max caps it
    big = _scaler(_config(scale_step=0.3), capacity=1.0)
    assert big.decide(_observe(15.0, 24.0, _fleet("a", 10))).start == {"a": 19}
    capped = _scaler(_config(scale_step=0.3), capacity=1.0)
    assert capped.decide(_observe(15.0, 33.0, _fleet("a", 39))).start == {"a": 1}


def _sizes_at_a_steady_rate(config: AutoscaleConfig, ready: int, rate: float) -> list[int]:
    """The fleet after each of 11 decisions at a steady ``rate``."""
    scaler = _scaler(config, capacity=1.0)
    sizes = []
    for i in range(1, 12):
        ready = scaler.decide(_observe(15.0 * i, rate, _fleet("a", ready))).targets["a"]
        sizes.append(ready)
    return sizes


def test_a_scale_in_waits_until_the_step_can_go() -> None:
    settings = {"scale_in_after_s": 30.0, "scale_down_cooldown_s": 0.0}
    stepped = _config(**settings, scale_step=0.3)
    # 20 ready, 17 needed (14 x 1.2 = 16.8): 3 spare, under the step (6): held
    assert _sizes_at_a_steady_rate(stepped, 20, 14.0) == [20] * 11
    assert _sizes_at_a_steady_rate(_config(**settings), 20, 14.0)[-1] == 17  # no step
    # 12 needed (9.47 x 1.2 = 11.4): 8 can go, more than the step, in one event
    sizes = _sizes_at_a_steady_rate(stepped, 20, 142 / 15)
    assert sizes[-1] == 12 and len(set(sizes)) == 2
    # near the pool's minimum (2) what is left above it goes, even if under the step
    assert _sizes_at_a_steady_rate(_config(**settings, scale_step=0.5), 3, 0.0)[-1] == 2


# -- HPA baseline ---------------------------------------------------------------------


def test_hpa_follows_the_kubernetes_formula_and_stabilizes_scale_down() -> None:
    hpa = HpaScaler("a", 1, 50, queue_target_per_replica=2.0, stabilization_s=300.0)
    up = hpa.decide(_observe(15.0, 0.0, _fleet("a", 10), queued=50))
    assert up.targets == {"a": 20}  # ceil(10 x (50 / 10) / 2) = 25, limited to double
    again = hpa.decide(_observe(30.0, 0.0, _fleet("a", 20), queued=50))
    assert again.targets == {"a": 25}
    tolerated = hpa.decide(_observe(30.0, 0.0, _fleet("a", 25), queued=52))
    assert not tolerated.changes  # ratio 1.04 is within the 10% tolerance
    held = hpa.decide(_observe(45.0, 0.0, _fleet("a", 25), queued=0))
    assert held.targets == {"a": 25}  # the window still remembers 25
    later = hpa.decide(_observe(400.0, 0.0, _fleet("a", 25), queued=0))
    assert later.targets == {"a": 1}


def test_hpa_scale_up_is_limited_to_double_or_plus_four() -> None:
    hpa = HpaScaler("a", 1, 100, queue_target_per_replica=1.0)
    assert hpa.decide(_observe(15.0, 0.0, _fleet("a", 2), queued=90)).targets == {"a": 6}


# -- drain plans ----------------------------------------------------------------------


def test_scale_in_cancels_pending_first_then_drains_the_least_busy() -> None:
    fleet = [
        ReplicaStatus("busy", "a", "ready", 0.0, in_flight=9),
        ReplicaStatus("idle", "a", "ready", 1.0, in_flight=0),
        ReplicaStatus("new", "a", "pending", 2.0),
    ]
    assert plan_changes(0.0, {"a": 1}, fleet).drain == ("new", "idle")


def test_a_pool_that_grows_takes_back_its_draining_replicas_first() -> None:
    fleet = _fleet("a", 2, draining=2)
    decision = plan_changes(0.0, {"a": 5}, fleet)
    assert len(decision.undrain) == 2 and decision.start == {"a": 1}


# -- config ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"pools": [{"gpu": "a", "min": 5, "max": 2}], "max_gpus": 8}, "min (5) > max (2)"),
        ({"pools": [{"gpu": "a", "max": 2}]}, "no budget"),
        (
            {"pools": [{"gpu": "a", "max": 2}], "max_gpus": 8, "actuator": "ssh"},
            "actuator: unknown; valid: simulator, local, command, kubernetes",
        ),
        ({"pools": [{"gpu": "a", "max": 2}], "max_gpus": 8, "colour": 1}, "unknown field"),
        ({"pools": [], "max_gpus": 8}, "at least one GPU pool"),
        (
            {"pools": [{"gpu": "a", "max": 2}], "max_gpus": 8, "scale_step": 1.5},
            "scale_step: must be in [0, 1)",
        ),
        (
            {"pools": [{"gpu": "a", "max": 2}], "max_gpus": 8, "guard_window_s": 0},
            "guard_window_s: must be > 0",
        ),
        (
            {"pools": [{"gpu": "a", "max": 2}], "max_gpus": 8, "guard_window_s": math.nan},
            "guard_window_s: must be a finite number > 0",
        ),
        (
            {"pools": [{"gpu": "a", "max": 2}], "max_gpus": 8, "interval_s": 0.0001},
            "interval_s: must be >= 0.1",
        ),
        (
            {"pools": [{"gpu": "a", "max": 2}], "max_usd_per_hour": math.inf},
            "max_usd_per_hour: must be a finite number > 0",
        ),
        (
            {"pools": [{"gpu": "a", "max": 2, "cold_start_s": math.nan}], "max_gpus": 8},
            "pools[0].cold_start_s: must be a finite number >= 0",
        ),
    ],
)
def test_bad_config_is_one_line_naming_the_key(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        parse_autoscale_config(raw, "autoscale.yaml")
    text = str(error.value)
    assert text.startswith("autoscale.yaml") and "\n" not in text
