"""Shadow policy evaluation on a real `isocost serve` in front of two `isocost engine`
processes, one of them slowed: the pool runs round_robin with equal_cost and
least_request as candidates, traffic comes through the official `openai` client; the
candidates' decisions are counted per request and the periodic twin replay (a real
`isocost sim --from-record` subprocess) predicts equal_cost's P99 TTFT below
round_robin's. A replay that runs past its time limit counts as failed and requests
are answered as ever."""

from __future__ import annotations

import json
import time
import urllib.request
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
CANDIDATES = ("equal_cost", "least_request")
REQUESTS = 48


def _engines(procs: list[Proc]) -> list[str]:
    for slowdown in (1.0, 4.0):
        args = ["engine", "--port", "0", "--model", MODEL, "--gpu", "a100-80g"]
        args += ["--output-dist", "max", "--time-scale", "0.05", "--slowdown", f"{slowdown:g}"]
        procs.append(start_isocost(args))
    return [p.url for p in procs]


def _gateway(procs: list[Proc], tmp: Path, shadow: str) -> Proc:
    config = tmp / "gateway.yaml"
    config.write_text(
        gateway_config(
            _engines(procs),
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


def _traffic(gateway: Proc, count: int) -> None:
    with (
        openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY) as client,
        ThreadPoolExecutor(4) as pool,
    ):
        list(pool.map(lambda i: _ask(client, i), range(count)))


def _shadow(gateway: Proc) -> dict[str, Any]:
    status, _, answer = http("GET", gateway.url + "/admin/snapshot", None, ADMIN)
    assert status == 200, answer
    assert isinstance(answer, dict)
    shadow = answer["shadow"][MODEL]
    assert isinstance(shadow, dict)
    return shadow


def _until(gateway: Proc, done: Any, timeout_s: float) -> dict[str, Any]:
    """The pool's shadow status once ``done(status)`` holds; fails at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        shadow = _shadow(gateway)
        if done(shadow):
            return shadow
        assert time.monotonic() < deadline, f"not reached in {timeout_s:g} s: {shadow}"
        time.sleep(0.2)


def _metrics(gateway: Proc, name: str) -> dict[str, float]:
    """``name``'s series: labels text -> value."""
    with urllib.request.urlopen(gateway.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        line.rsplit(" ", 1)[0].removeprefix(name): float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{")
    }


def test_candidates_are_counted_and_the_replay_predicts_the_better_one(
    tmp_path: Path, procs: list[Proc]
) -> None:
    shadow = "{policies: [equal_cost, least_request], interval_s: 2, min_requests: 20}"
    gateway = _gateway(procs, tmp_path, shadow)
    _traffic(gateway, REQUESTS)
    status = _until(
        gateway, lambda s: s["replay"] is not None and s["replay"]["requests"] == REQUESTS, 120
    )  # a replay may have run before the last requests ended

    assert status["running"] == "round_robin"
    assert status["replays"]["failed"] == 0 and status["last_error"] is None
    by_policy = {c["policy"]: c for c in status["candidates"]}
    assert set(by_policy) == set(CANDIDATES)
    for candidate in by_policy.values():
        assert candidate["decisions"] == REQUESTS
        assert 0 <= candidate["agreement"] <= 1
    better = by_policy["equal_cost"]
    assert better["ttft_p99_change"] < 0, status  # away from the slow replica
    decisions = _metrics(gateway, "isocost_shadow_decisions_total")
    for policy in CANDIDATES:
        assert sum(v for k, v in decisions.items() if f'policy="{policy}"' in k) == REQUESTS
    agreeing = decisions[f'{{agrees="yes",policy="equal_cost",pool="{MODEL}"}}']
    assert agreeing == round(better["agreement"] * REQUESTS)
    change = _metrics(gateway, "isocost_shadow_predicted_change_ratio")
    key = f'{{metric="ttft_p99",policy="equal_cost",pool="{MODEL}"}}'
    assert change[key] == better["ttft_p99_change"]
    assert _metrics(gateway, "isocost_shadow_replays_total")['{outcome="ok"}'] >= 1

    with urllib.request.urlopen(gateway.url + "/dashboard/dashboard.js", timeout=10) as page:
        assert "renderShadow(shadows[pool.model])" in page.read().decode()


def test_a_replay_past_its_time_limit_fails_and_requests_go_on(
    tmp_path: Path, procs: list[Proc]
) -> None:
    shadow = "{policies: [equal_cost], interval_s: 0.5, min_requests: 1, timeout_s: 0.001}"
    gateway = _gateway(procs, tmp_path, shadow)
    _traffic(gateway, 4)
    status = _until(gateway, lambda s: s["replays"]["failed"] >= 2, timeout_s=60)
    assert status["replay"] is None and "time limit" in status["last_error"]
    _traffic(gateway, 4)  # answered as ever
    assert _metrics(gateway, "isocost_shadow_replays_total")['{outcome="failed"}'] >= 2
    assert _shadow(gateway)["candidates"][0]["decisions"] == 8
    lines = (tmp_path / "gateway.log").read_text().splitlines()
    failed = [json.loads(line) for line in lines if '"event": "shadow_replay_failed"' in line]
    assert len(failed) >= 2 and "time limit" in failed[0]["error"]
