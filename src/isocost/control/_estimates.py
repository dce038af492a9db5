"""What the autoscaler learns per GPU type: the warm-up lead and the capacity per replica.

* **Lead**: the measured time from "start replica" to "routable" (weights, kernels, warm-up),
  as ``mean + 2 x mean absolute deviation`` of what was seen, so that a slow start now and
  then is planned for; the pool's configured cold start until one is measured.
* **Capacity**: requests/s one replica sustains at the SLOs. The prior is the planner's
  operating point (``core.planner``) at the workload's mean lengths (a mean hides the long
  prompts, so it is often optimistic). Each interval with enough settled requests corrects
  it: replicas that missed the attainment target at a load below the estimate show it too
  high, replicas that met it at a load above show it too low; either moves it toward that
  load. A load that met the target below the estimate, or missed it above, says nothing.
  The load of a miss is the larger of what was served and what was offered (the caller's
  ``Autoscaler``): a backlog's misses settle after the ramp that caused them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from isocost.core.costmodel import CostModel
from isocost.core.planner import PlanRequest, plan
from isocost.core.slo import SloTargets

__all__ = ["CapacityEstimate", "WarmupLead", "planned_capacity_rps"]

_ALPHA = 0.3  # lead: weight of the newest start
_CAPACITY_ALPHA = 0.1  # capacity: weight of the newest interval


class WarmupLead:
    def __init__(self, priors_s: Mapping[str, float]) -> None:
        self._priors = dict(priors_s)
        self._mean: dict[str, float] = {}
        self._deviation: dict[str, float] = {}

    def observe(self, gpu: str, seconds: float) -> None:
        """A replica of ``gpu`` became routable ``seconds`` after it was started."""
        mean = self._mean.get(gpu)
        if mean is None:
            self._mean[gpu], self._deviation[gpu] = seconds, 0.0
            return
        self._deviation[gpu] = _ALPHA * abs(seconds - mean) + (1 - _ALPHA) * self._deviation[gpu]
        self._mean[gpu] = _ALPHA * seconds + (1 - _ALPHA) * mean

    def lead_s(self, gpu: str) -> float:
        mean = self._mean.get(gpu)
        if mean is None:
            return self._priors[gpu]
        return mean + 2 * self._deviation[gpu]

    def measured(self, gpu: str) -> bool:
        return gpu in self._mean


def planned_capacity_rps(
    cost: CostModel, prompt_tokens: int, output_tokens: int, slo: SloTargets
) -> float:
    """The planner's requests/s per replica of ``cost`` at the SLOs, for requests of these
    mean lengths; ValueError when no batch meets them."""
    ttft = slo.ttft_target_s(prompt_tokens)
    result = plan(
        PlanRequest(
            model=cost.model,
            gpu=cost.gpu,
            weight_dtype=cost.weight_dtype,
            kv_dtype=cost.kv_dtype,
            context_tokens=prompt_tokens + output_tokens,
            output_tokens=output_tokens,
            ttft_slo_s=None if math.isinf(ttft) else ttft,
            tpot_slo_s=None if math.isinf(slo.tpot_s) else slo.tpot_s,
            gpu_memory_utilization=cost.limits.gpu_memory_utilization,
        )
    )
    option = next(o for o in result.options if o.tensor_parallel == cost.tensor_parallel)
    if not option.meets_slos:
        raise ValueError(
            f"{cost.model.id} on {cost.tensor_parallel}x {cost.gpu.id} meets the SLOs at no batch"
        )
    return option.requests_per_s


class CapacityEstimate:
    def __init__(self, planned_rps: Mapping[str, float]) -> None:
        self._rps = dict(planned_rps)

    def observe(self, gpu: str, rps_per_replica: float, met_target: bool) -> None:
        """One ``gpu`` replica completed ``rps_per_replica`` in an interval whose SLO
        attainment met the target, or not."""
        estimate = self._rps[gpu]
        if (rps_per_replica < estimate) != met_target:
            self._rps[gpu] = _CAPACITY_ALPHA * rps_per_replica + (1 - _CAPACITY_ALPHA) * estimate

    def rps(self, gpu: str) -> float:
        return self._rps[gpu]
