"""``isocost autoscale --plan``: each pool's offer from the planner's own JSON document,
and one-line errors for files that are not a plan or lack a pool's GPU."""

from __future__ import annotations

import json

import pytest

from isocost.autoscale import offers_from_plan
from isocost.control import PoolConfig
from isocost.core.catalog import Catalog
from isocost.core.errors import ConfigError
from isocost.core.planner import PlanRequest, plan


def plan_document(gpu: str) -> dict[str, object]:
    """What ``isocost plan --model llama-3.1-8b --gpu GPU --json`` prints."""
    catalog = Catalog.builtin()
    request = PlanRequest(
        model=catalog.model("llama-3.1-8b"),
        gpu=catalog.gpu(gpu),
        context_tokens=2048,
        output_tokens=256,
        ttft_slo_s=2.0,
        tpot_slo_s=0.1,
    )
    return plan(request).as_dict()


def test_each_pool_takes_the_plan_on_its_gpu() -> None:
    a100, h100 = plan_document("a100-80g"), plan_document("h100-80g")
    pools = [PoolConfig(gpu="h100-80g", max=4), PoolConfig(gpu="a100-80g", max=4)]
    offers = offers_from_plan(json.dumps([a100, h100]), "plans.json", pools)
    assert [o.gpu for o in offers] == ["h100-80g", "a100-80g"]
    for offer, document in zip(offers, (h100, a100), strict=True):
        assert offer.capacity_rps == document["requests_per_s_per_replica"]
        assert offer.gpus_per_replica == document["recommended_tensor_parallel"]
        assert offer.usd_per_hour == document["usd_per_hour_per_replica"]
    assert offers[0].capacity_rps != offers[1].capacity_rps


def test_a_single_document_serves_its_own_gpu() -> None:
    document = plan_document("a100-80g")
    (offer,) = offers_from_plan(json.dumps(document), "plan.json", [PoolConfig("a100-80g", 2)])
    assert offer.capacity_rps == document["requests_per_s_per_replica"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "plan.json: not JSON"),
        ('{"gpu": "a100-80g"}', "plan.json: not `isocost plan --json` output"),
        (json.dumps(plan_document("h100-80g")), "plan.json: pools[0]: no plan for a100-80g"),
        (
            json.dumps(plan_document("a100-80g") | {"requests_per_s_per_replica": 0}),
            "requests_per_s_per_replica must be > 0",
        ),
    ],
    ids=["not-json", "not-a-plan", "other-gpu", "zero-capacity"],
)
def test_a_bad_plan_is_one_line(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        offers_from_plan(text, "plan.json", [PoolConfig("a100-80g", 2)])
    assert message in str(error.value) and "\n" not in str(error.value)
