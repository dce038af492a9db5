"""A discovery change costs what changed: replicas joining or leaving in bulk cost linear
work, and a change beside many members builds no cost model for those that stay.

The audit saw a deleterange of 1,000 registrations freeze the gateway's event loop for
seconds (each removal recomputed its pool's roles over every replica) and every change
re-price the whole fleet. Tests never assert wall-clock speed: the work is counted as
Python function calls (``sys.setprofile``), which is deterministic, and compared between
a fleet and one twice its size.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from isocost.core import costmodel
from isocost.core.catalog import Catalog
from isocost.gateway.lifecycle import Gateway
from isocost.runtime.config import parse_config
from isocost.runtime.discovery.records import Registration

MODEL = "llama-3.1-8b"
N = 200
QUIET = "scrape_interval_ms: 600000\nhealth: {interval_ms: 600000}\n"  # no probe meanwhile


def count_calls(action: Callable[[], None], only: Callable[[FrameType], bool] | None = None) -> int:
    """Python function calls made by ``action`` (those ``only`` accepts, if given)."""
    count = 0

    def profile(frame: FrameType, event: str, _: Any) -> None:
        nonlocal count
        if event == "call" and (only is None or only(frame)):
            count += 1

    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    return count


def registrations(n: int, host: str = "127.0.0.1") -> dict[str, Registration]:
    return {
        f"/isocost/replicas/{host}-{i:05d}": Registration(
            name=f"{host}-{i}", url=f"http://{host}:{20000 + i}", models=[MODEL]
        )
        for i in range(n)
    }


def with_gateway(scenario: Callable[[Gateway], None]) -> None:
    async def main() -> None:
        gateway = Gateway(parse_config(QUIET, "t"), Catalog.builtin())
        await gateway.start()
        try:
            scenario(gateway)
        finally:
            await gateway.stop()

    asyncio.run(main())


def apply(gateway: Gateway, records: dict[str, Registration]) -> None:
    """What a provider's report leads to, applied now rather than after the settling delay."""
    gateway.membership.replace("etcd", records)
    gateway._apply_discovered()


def test_bulk_joins_and_leaves_cost_linear_work() -> None:
    costs: dict[int, tuple[int, int]] = {}

    def scenario(gateway: Gateway) -> None:
        for n in (N, 2 * N):
            join = count_calls(functools.partial(apply, gateway, registrations(n)))
            assert len(gateway.replicas) == n
            leave = count_calls(functools.partial(apply, gateway, {}))  # one deleterange
            assert not gateway.replicas
            costs[n] = (join, leave)

    with_gateway(scenario)
    (join, leave), (join2, leave2) = costs[N], costs[2 * N]
    assert join2 / join < 2.25, costs  # quadratic: 2.5 and growing with N
    assert leave2 / leave < 2.25, costs  # quadratic: over 3


def test_a_change_beside_many_members_prices_only_the_newcomers() -> None:
    def is_cost_model(frame: FrameType) -> bool:
        code = frame.f_code
        return code.co_name == "__init__" and code.co_filename == costmodel.__file__

    def scenario(gateway: Gateway) -> None:
        members = registrations(N)
        apply(gateway, members)
        newcomers = registrations(3, host="127.0.0.2")
        change = functools.partial(apply, gateway, members | newcomers)
        built = count_calls(change, is_cost_model)
        assert len(gateway.replicas) == N + 3
        assert 3 <= built <= 2 * 3  # checked, then priced by the router: none of the N

    with_gateway(scenario)
