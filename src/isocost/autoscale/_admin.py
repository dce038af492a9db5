"""The gateway as the autoscaler sees it: its admin API and its ``/metrics`` counters."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from isocost.core.errors import IsocostError

__all__ = ["AdminClient", "GatewayError", "answered_by_replica", "slo_verdicts"]


class GatewayError(IsocostError):
    """The gateway refused or could not be reached."""


def answered_by_replica(metrics_text: str) -> dict[str, tuple[int, int]]:
    """``isocost_requests_total`` per replica label: (answered, of which status 200)."""
    counts: dict[str, tuple[int, int]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name != "isocost_requests_total":
                continue
            replica = sample.labels.get("replica", "")
            total, ok = counts.get(replica, (0, 0))
            value = int(sample.value)
            counts[replica] = (total + value, ok + value * (sample.labels.get("status") == "200"))
    return counts


def slo_verdicts(metrics_text: str) -> tuple[int, int]:
    """``isocost_slo_requests_total`` over every pool: (met, judged)."""
    met = judged = 0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "isocost_slo_requests_total":
                value = int(sample.value)
                judged += value
                met += value * (sample.labels.get("verdict") == "met")
    return met, judged


class AdminClient:
    """The admin API calls the autoscaler needs, each a ``GatewayError`` when refused."""

    def __init__(self, session: aiohttp.ClientSession, url: str, token: str) -> None:
        self.session = session
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}

    async def _call(self, method: str, path: str, body: object = None) -> Any:
        try:
            async with self.session.request(
                method, self.url + path, json=body, headers=self._headers
            ) as response:
                if response.status >= 300:
                    text = (await response.text())[:200]
                    raise GatewayError(f"{method} {path}: HTTP {response.status} {text}")
                if path == "/metrics":
                    return await response.text()
                return await response.json()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise GatewayError(f"{method} {path}: {exc or type(exc).__name__}") from None

    async def snapshot(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", "/admin/snapshot")
        return result

    async def metrics(self) -> str:
        text: str = await self._call("GET", "/metrics")
        return text

    async def add(self, model: str, replica: dict[str, Any]) -> None:
        await self._call("POST", "/admin/replicas", {"model": model, "replica": replica})

    async def drain(self, name: str) -> None:
        await self._call("POST", f"/admin/replicas/{name}/drain")

    async def undrain(self, name: str) -> None:
        await self._call("POST", f"/admin/replicas/{name}/undrain")

    async def remove(self, name: str) -> None:
        await self._call("DELETE", f"/admin/replicas/{name}")

    async def post_status(self, status: Mapping[str, Any]) -> None:
        await self._call("POST", "/admin/autoscaler", dict(status))
