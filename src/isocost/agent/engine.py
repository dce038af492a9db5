"""What the agent reads from its engine over HTTP: vLLM, SGLang or ``isocost engine``.

* ready: ``GET /health`` answers 200 and ``GET /v1/models`` names a model (``not_ready``
  says which of them is still missing, for the agent's log);
* facts: the served models, the engine kind (``owned_by`` of ``/v1/models``, else the
  prefix of its metric names) and the release: a digest of the models (name, root, context
  length), the kind, the engine version (``GET /version`` where the engine has one) and
  its serving arguments as it exports them (vLLM's ``cache_config_info`` labels), so two
  releases of one model differ in the registry;
* load: running and waiting requests (the gateway's own parser, ``runtime.scrape``) and
  the outcomes of real requests (``request_outcomes``): the HTTP status classes of the
  OpenAI routes where the engine counts them (vLLM's ``http_requests_total``: 2xx
  successes, 5xx failures, 4xx the client's own), else its finished requests
  (``vllm:request_success_total`` by ``finished_reason``: ``stop`` and ``length`` are
  successes, anything else, e.g. ``abort``, a failure).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from isocost.core.jsontext import UNDECODABLE
from isocost.runtime.scrape import ScrapeError, parse_engine_metrics

__all__ = [
    "EngineDown",
    "EngineFacts",
    "EngineLoad",
    "engine_facts",
    "engine_load",
    "not_ready",
    "request_outcomes",
    "warm_up",
]

_KINDS = ("vllm", "sglang", "isocost")
_OK_REASONS = frozenset({"stop", "length"})
_SUCCESS = ("vllm:request_success_total", "vllm:request_success")
_HTTP = "http_requests_total"


class EngineDown(Exception):
    """The engine's port refuses connections: the process is gone."""


@dataclass(frozen=True, slots=True)
class EngineFacts:
    models: list[str]
    kind: str
    release: str


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int
    waiting: int
    ok: int
    failed: int


class _ModelList(msgspec.Struct):
    class _Model(msgspec.Struct):
        id: str
        owned_by: str = ""
        root: str | None = None
        max_model_len: int | None = None

    data: list[_Model]


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    try:
        async with session.get(url) as resp:
            return resp.status, await resp.read()
    except aiohttp.ClientConnectorError as exc:
        raise EngineDown(f"{url}: {exc}") from None


async def not_ready(session: aiohttp.ClientSession, base: str) -> str | None:
    """Why the engine is not ready yet, or None once ``/health`` answers 200 and
    ``/v1/models`` lists a model (EngineDown: its port is closed)."""
    status, _ = await _get(session, base + "/health")
    if status != 200:
        return f"/health answered HTTP {status}"
    status, body = await _get(session, base + "/v1/models")
    if status != 200:
        return f"/v1/models answered HTTP {status}"
    try:
        models = msgspec.json.decode(body, type=_ModelList).data
    except UNDECODABLE as exc:
        return f"/v1/models is not a model list: {exc}"
    return None if models else "/v1/models lists no model"


async def engine_facts(session: aiohttp.ClientSession, base: str) -> EngineFacts:
    _, body = await _get(session, base + "/v1/models")
    models = msgspec.json.decode(body, type=_ModelList).data
    _, metrics = await _get(session, base + "/metrics")
    text = metrics.decode(errors="replace")
    owners = {m.owned_by.lower() for m in models}
    kind = next((k for k in _KINDS if k in owners), None)
    if kind is None:
        kind = "sglang" if "sglang:" in text else "vllm" if "vllm:" in text else "unknown"
    version_status, version = await _get(session, base + "/version")
    serving: dict[str, Any] = {
        "kind": kind,
        "models": [[m.id, m.root, m.max_model_len] for m in models],
        "version": version.decode(errors="replace") if version_status == 200 else None,
        "serving_args": sorted(
            line.split("{", 1)[1].rsplit("}", 1)[0]
            for line in text.splitlines()
            if line.startswith("vllm:cache_config_info{")
        ),
    }
    digest = hashlib.sha256(json.dumps(serving, sort_keys=True).encode()).hexdigest()
    return EngineFacts([m.id for m in models], kind, digest[:16])


async def engine_load(session: aiohttp.ClientSession, base: str) -> EngineLoad:
    """The engine's load and finished-request counters; ScrapeError for a bad text."""
    status, body = await _get(session, base + "/metrics")
    if status != 200:
        raise ScrapeError(f"/metrics answered HTTP {status}")
    text = body.decode(errors="replace")
    scraped = parse_engine_metrics(text).metrics
    ok, failed = request_outcomes(text)
    return EngineLoad(scraped.num_running, scraped.num_waiting, ok, failed)


def _label(line: str, name: str) -> str | None:
    marker = f'{name}="'
    return line.split(marker, 1)[1].split('"', 1)[0] if marker in line else None


def request_outcomes(text: str) -> tuple[int, int]:
    """Cumulative (successful, failed) real requests in a ``/metrics`` text."""
    http = {"2": 0, "5": 0}
    finished = {True: 0, False: 0}
    seen_http = False
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name not in _SUCCESS and name != _HTTP:
            continue
        try:
            count = int(float(line.rsplit(" ", 1)[1]))
        except (ValueError, IndexError):
            continue
        if name == _HTTP:
            handler, status = _label(line, "handler") or "", _label(line, "status") or ""
            if handler.startswith("/v1/") and status[:1] in http:
                http[status[:1]] += count
                seen_http = True
        elif (reason := _label(line, "finished_reason")) is not None:
            finished[reason in _OK_REASONS] += count
    if seen_http:
        return http["2"], http["5"]
    return finished[True], finished[False]


async def warm_up(session: aiohttp.ClientSession, base: str, model: str, prompt: str) -> None:
    """One real completion before the engine takes traffic (compiles, fills caches)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 8}
    try:
        async with session.post(base + "/v1/completions", json=body) as resp:
            await resp.read()
            if resp.status != 200:
                raise aiohttp.ClientResponseError(
                    resp.request_info, (), status=resp.status, message="warm-up failed"
                )
    except aiohttp.ClientConnectorError as exc:
        raise EngineDown(f"{base}: {exc}") from None
