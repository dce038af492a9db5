"""A gateway evaluating shadow policies in front of two `isocost engine` processes, one
slowed 8x, and streamed traffic through the official `openai` client: shared by the
integration test of shadow evaluation and the dashboard's browser test. 8x, not 4x: at
the engines' time scale a 4x replica's TTFT is a few milliseconds above the fast one's,
which a loaded machine's scheduling noise can hide from the live calibration, and one
fresh-clone run recorded a fleet whose replay put equal_cost 13% above round_robin.
Eight streams at a time, not four: with four, the slow replica never holds a queue under
round_robin, so the window's P99 (its worst request or two out of 48) is whichever
request a greedy policy happened to overflow onto the slow one; 6 of 6 windows put
equal_cost's P99 +6% to -32% of round_robin's, and one CI run +22%. With eight, 22
windows (14 beside a busy core) put it -4% to -56%."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
from gateway_harness import gateway_config, http
from isocost_procs import Proc, start_isocost

MODEL = "llama-3.1-8b"
API_KEY = "sk-test-shadow-5c2a"
ADMIN_TOKEN = "admin-shadow-token-81fe"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def start_shadowed_gateway(procs: list[Proc], tmp: Path, shadow: str) -> Proc:
    """Two engines (the second slowed 8x) behind `isocost serve`, the pool on round_robin
    with ``shadow`` (a YAML flow mapping) as its shadow settings; its log in tmp."""
    for slowdown in (1.0, 8.0):
        args = ["engine", "--port", "0", "--model", MODEL, "--gpu", "a100-80g"]
        args += ["--output-dist", "max", "--time-scale", "0.05", "--slowdown", f"{slowdown:g}"]
        procs.append(start_isocost(args))
    config = tmp / "gateway.yaml"
    config.write_text(
        gateway_config(
            [p.url for p in procs[-2:]],
            model=MODEL,
            admin_token=ADMIN_TOKEN,
            api_key=API_KEY,
            policy="round_robin",
            pool_fields=f"    shadow: {shadow}",
        )
    )
    with (tmp / "gateway.log").open("a") as log:
        gateway = start_isocost(
            ["serve", "--config", str(config), "--port", "0"], "isocost serve", log
        )
    procs.append(gateway)
    return gateway


def _ask(client: openai.OpenAI, i: int) -> None:
    messages = [{"role": "user", "content": f"question {i}: " + "how busy is it? " * 40}]
    with client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, stream=True
    ) as chunks:  # type: ignore[call-overload]
        pieces = [c.choices[0].delta.content for c in chunks if c.choices]
    assert "".join(p for p in pieces if p)


def send_traffic(gateway: Proc, count: int) -> None:
    """``count`` streamed chat completions, eight at a time, each answered."""
    with (
        openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY) as client,
        ThreadPoolExecutor(8) as pool,
    ):
        list(pool.map(lambda i: _ask(client, i), range(count)))


def shadow_status(gateway: Proc) -> dict[str, Any]:
    """The pool's ``shadow`` entry of ``/admin/snapshot``."""
    status, _, answer = http("GET", gateway.url + "/admin/snapshot", None, ADMIN)
    assert status == 200, answer
    shadow = answer["shadow"][MODEL]
    assert isinstance(shadow, dict)
    return shadow


def wait_for_shadow(
    gateway: Proc, done: Callable[[dict[str, Any]], bool], timeout_s: float
) -> dict[str, Any]:
    """The pool's shadow status once ``done(status)`` holds; fails at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        shadow = shadow_status(gateway)
        if done(shadow):
            return shadow
        assert time.monotonic() < deadline, f"not reached in {timeout_s:g} s: {shadow}"
        time.sleep(0.2)
