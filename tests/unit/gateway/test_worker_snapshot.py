"""``serve --workers``: the snapshot the port answers sums every worker's requests in
flight and queued into the answering worker's view (``sum_workers``), and names the
workers whose requests it could not count."""

from __future__ import annotations

from typing import Any

from isocost.gateway.workers import sum_workers


def _view(worker: int, in_flight: dict[str, int], queue: int, held: int = 0) -> dict[str, Any]:
    return {
        "worker": worker,
        "replicas": [{"name": n, "in_flight": k, "state": "healthy"} for n, k in in_flight.items()],
        "pools": [{"model": "m", "in_flight": sum(in_flight.values()), "queue_depth": queue,
                   "queue_held": held}],
    }  # fmt: skip


def test_requests_in_flight_and_queued_are_summed_over_the_workers() -> None:
    views = {1: _view(1, {"r0": 2, "r1": 0}, queue=3), 0: _view(0, {"r0": 1, "r1": 4}, 1, 2)}
    merged = sum_workers(views, missing=[])
    assert merged["worker"] == 1  # the answering worker's view otherwise
    assert {r["name"]: r["in_flight"] for r in merged["replicas"]} == {"r0": 3, "r1": 4}
    (pool,) = merged["pools"]
    assert (pool["in_flight"], pool["queue_depth"], pool["queue_held"]) == (7, 4, 2)
    assert merged["workers"] == {"answered": [0, 1], "missing": []}
    assert views[1]["replicas"][0]["in_flight"] == 2  # the worker's own view is not changed


def test_a_worker_that_did_not_answer_is_named() -> None:
    merged = sum_workers({0: _view(0, {"r0": 1}, queue=0)}, missing=[2, 1])
    assert merged["workers"] == {"answered": [0], "missing": [1, 2]}
    assert merged["replicas"][0]["in_flight"] == 1
