"""Prefill/decode disaggregation live: `isocost serve` in front of `isocost engine`
replicas of roles prefill and decode, each role in its own engine process, on 127.0.0.1.

The engines speak vLLM's two-step protocol (``kv_transfer_params``); the gateway relays
it. A prefill replica started with ``--crash-after-handoff`` answers its prefill step and
then exits before the decode replica can pull the KV: the hand-off is lost at exactly that
point, every time, and the request must still be answered.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from gateway_harness import http, log_records, pd_gateway_config
from isocost_procs import Proc, start_isocost
from prometheus_client.parser import text_string_to_metric_families

MODEL = "llama-3.1-8b"
API_KEY = "sk-test-pd-2b7e41"
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
PROMPT = "a long enough prompt to fill some KV blocks " * 20


def start_engine(role: str, *extra: str) -> Proc:
    args = ["engine", "--port", "0", "--model", MODEL, "--gpu", "a100-80g", "--role", role]
    return start_isocost([*args, "--output-dist", "max", "--link", "roce", *extra], "isocost")


def start_gateway(tmp: Path, roles: dict[str, str], mode: str = "pd") -> Proc:
    """The gateway over ``roles`` (engine URL -> its role, and any more replica fields),
    disaggregating in ``mode``."""
    text = pd_gateway_config(
        roles, mode, model=MODEL, admin_token="admin-pd-token", api_key=API_KEY,
        pool="    kv_link: roce",
    )  # fmt: skip
    config = tmp / "gateway.yaml"
    config.write_text(text)
    with (tmp / "gateway.log").open("a") as log:
        return start_isocost(
            ["serve", "--config", str(config), "--port", "0"], "isocost serve", log
        )


def metric_samples(gateway: Proc, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of metric ``name`` (its full sample name) by sorted labels."""
    with urllib.request.urlopen(gateway.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                samples[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def pd_post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    return http("POST", url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})


@dataclass
class Fleet:
    prefill: Proc
    decode: Proc
    gateway: Proc
    log: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateway.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    prefill, decode = start_engine("prefill"), start_engine("decode")
    gateway = None
    tmp = tmp_path_factory.mktemp("pd")
    try:
        gateway = start_gateway(tmp, {prefill.url: "prefill", decode.url: "decode"})
        yield Fleet(prefill, decode, gateway, tmp / "gateway.log")
    finally:
        for proc in (gateway, decode, prefill):
            if proc is not None:
                proc.stop()


def replica_name(engine: Proc) -> str:
    return engine.url.removeprefix("http://")


# -- the engines' two-step protocol -------------------------------------------------------


def test_engines_speak_the_two_step_protocol(fleet: Fleet) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    status, _, prefilled = pd_post(
        fleet.prefill.url,
        "/v1/completions",
        body | {"kv_transfer_params": {"do_remote_decode": True}},
    )
    assert status == 200, prefilled
    params = prefilled["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert f"http://{params['remote_host']}:{params['remote_port']}" == fleet.prefill.url
    assert params["remote_num_tokens"] == prefilled["usage"]["prompt_tokens"]
    assert len(params["remote_block_ids"]) == -(-params["remote_num_tokens"] // 16)

    decode_body = body | {"max_tokens": 5, "kv_transfer_params": params}
    status, headers, decoded = pd_post(fleet.decode.url, "/v1/completions", decode_body)
    assert status == 200, decoded
    assert decoded["usage"]["prompt_tokens"] == prefilled["usage"]["prompt_tokens"]
    assert decoded["usage"]["completion_tokens"] == 5
    assert float(headers["x-isocost-kv-transfer-ms"]) > 0

    # pulled once: the prefill replica holds that KV no longer
    status, _, again = pd_post(fleet.decode.url, "/v1/completions", decode_body)
    assert status == 502 and again["error"]["code"] == "kv_transfer_failed", again


def test_each_role_refuses_the_other_half(fleet: Fleet) -> None:
    asks = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    status, _, answer = pd_post(
        fleet.prefill.url, "/v1/completions", body | {"kv_transfer_params": asks}
    )
    assert status == 400 and answer["error"]["param"] == "kv_transfer_params"
    status, _, answer = pd_post(
        fleet.decode.url,
        "/v1/completions",
        body | {"kv_transfer_params": {"do_remote_decode": True}},
    )
    assert status == 400 and answer["error"]["param"] == "kv_transfer_params"


# -- the gateway's relay --------------------------------------------------------------------


def test_gateway_serves_chat_and_completions_through_prefill_and_decode(fleet: Fleet) -> None:
    client = fleet.client()
    p_name, d_name = replica_name(fleet.prefill), replica_name(fleet.decode)
    before = metric_samples(fleet.gateway, "isocost_disaggregated_requests_total")
    split_key = (("disaggregated", "yes"), ("pool", MODEL))

    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=12
    )
    chat = raw.parse()
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 12
    assert raw.headers["x-isocost-replica"] == d_name
    assert raw.headers["x-isocost-prefill-replica"] == p_name

    raw_completion = client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=7
    )
    completion = raw_completion.parse()
    assert completion.choices[0].text
    assert completion.usage is not None and completion.usage.completion_tokens == 7
    assert raw_completion.headers["x-isocost-prefill-replica"] == p_name

    with client.chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    ) as streamed:
        assert streamed.headers["x-isocost-prefill-replica"] == p_name
        chunks = list(streamed.parse())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens == 20

    with client.completions.with_streaming_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=9, stream=True
    ) as streamed:
        assert streamed.headers["x-isocost-replica"] == d_name
        pieces = list(streamed.parse())
    assert "".join(p.choices[0].text for p in pieces if p.choices)
    assert pieces[-1].choices[0].finish_reason == "length"

    after = metric_samples(fleet.gateway, "isocost_disaggregated_requests_total")
    assert after[split_key] - before.get(split_key, 0.0) == 4
    transfers = metric_samples(fleet.gateway, "isocost_kv_transfer_seconds_count")
    assert transfers[(("replica", d_name),)] >= 4
    prefills = metric_samples(fleet.gateway, "isocost_pd_prefill_seconds_count")
    assert prefills[(("replica", p_name),)] >= 4
    log = log_records(fleet.log)
    split = [e for e in log if e.get("event") == "request" and e["disaggregated"]][-4:]
    assert [e["prefill_replica"] for e in split] == [p_name] * 4
    assert all(e["prefill_ms"] > 0 for e in split)
    chat_log, completion_log, chat_stream_log, completion_stream_log = split
    assert chat_log["kv_transfer_ms"] > 0  # a prompt D never saw: all of its KV moves
    # D caches the KV it pulled: the same prompt again moves only what D lacks
    assert chat_stream_log["kv_transfer_ms"] < chat_log["kv_transfer_ms"]
    assert completion_stream_log["kv_transfer_ms"] <= completion_log["kv_transfer_ms"]
    assert all(e["prefill_queue"] >= 0 and e["decode_queue"] >= 0 for e in split)
    depths = metric_samples(fleet.gateway, "isocost_pd_queue_depth")
    assert {labels for labels in depths} == {
        (("pool", MODEL), ("role", "prefill")),
        (("pool", MODEL), ("role", "decode")),
    }


@pytest.mark.parametrize(
    "params",
    [
        # a decode replica would pull KV from wherever the client says
        {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1},
        # a prefill replica would hold the prompt's KV for a transfer no one makes
        {"do_remote_decode": True},
    ],
)
def test_the_gateway_refuses_a_client_kv_transfer(fleet: Fleet, params: dict[str, Any]) -> None:
    """The gateway sets kv_transfer_params itself; a client's never reaches an engine."""
    with pytest.raises(openai.BadRequestError) as info:
        fleet.client().completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"kv_transfer_params": params}
        )
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == "kv_transfer_params", error


def test_decision_endpoint_names_both_replicas(fleet: Fleet) -> None:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]})
    status, _, decision = http("POST", fleet.gateway.url + "/v1/route", body.encode(), AUTH)
    assert status == 200, decision
    assert decision["disaggregated"] is True
    assert decision["replica_url"] == fleet.decode.url
    assert decision["prefill_replica_url"] == fleet.prefill.url
    assert decision["predicted_transfer_ms"] > 0


# -- a hand-off lost ------------------------------------------------------------------------


def test_prefill_replica_killed_mid_handoff_is_prefilled_again(
    tmp_path: Path, procs: list[Proc]
) -> None:
    """P answers the prefill step, then its process exits before D pulls: D's pull fails,
    and the gateway prefills the request again (here whole on D, the only other replica):
    answered, not lost, and counted."""
    prefill = start_engine("prefill", "--crash-after-handoff")
    decode = start_engine("decode")
    procs += [prefill, decode]
    gateway = start_gateway(tmp_path, {prefill.url: "prefill", decode.url: "decode"})
    procs.append(gateway)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0)

    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=6
    )
    answer = raw.parse()
    assert answer.usage is not None and answer.usage.completion_tokens == 6
    assert raw.headers["x-isocost-replica"] == replica_name(decode)
    assert "x-isocost-prefill-replica" not in raw.headers  # served whole, after the loss
    assert prefill.popen.wait(timeout=10) == 70  # it did die right after its hand-off

    failures = metric_samples(gateway, "isocost_pd_handoff_failures_total")
    assert failures == {(("pool", MODEL), ("stage", "transfer")): 1.0}
    lines = log_records(tmp_path / "gateway.log")
    requests = [line for line in lines if line.get("event") == "request"]
    assert [(r["status"], r["disaggregated"], r["handoff_failures"]) for r in requests] == [
        (200, False, 1)
    ]


def test_lost_handoff_is_prefilled_again_on_another_prefill_replica(
    tmp_path: Path, procs: list[Proc]
) -> None:
    """Two prefill replicas; the brain prefers the one on the faster GPU, which dies after
    its hand-off: the request is split again with the other prefill replica."""
    doomed = start_engine("prefill", "--crash-after-handoff")
    spare = start_engine("prefill")
    decode = start_engine("decode")
    procs += [doomed, spare, decode]
    roles = {
        doomed.url: "prefill, gpu: h200-141g",
        spare.url: "prefill, gpu: l40s-48g",
        decode.url: "decode",
    }
    gateway = start_gateway(tmp_path, roles)
    procs.append(gateway)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0)

    with client.completions.with_streaming_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, stream=True
    ) as streamed:
        assert streamed.headers["x-isocost-prefill-replica"] == replica_name(spare)
        assert streamed.headers["x-isocost-replica"] == replica_name(decode)
        pieces = list(streamed.parse())
    assert sum(bool(p.choices and p.choices[0].text) for p in pieces) == 5
    assert doomed.popen.wait(timeout=10) == 70
    failures = metric_samples(gateway, "isocost_pd_handoff_failures_total")
    assert failures == {(("pool", MODEL), ("stage", "transfer")): 1.0}


def test_prefill_step_failing_is_prefilled_again(tmp_path: Path, procs: list[Proc]) -> None:
    """A prefill replica that answers its step with a 500 gives no hand-off: counted, and
    the request is served whole on the decode replica."""
    prefill = start_engine("prefill", "--error-rate", "1")
    decode = start_engine("decode")
    procs += [prefill, decode]
    gateway = start_gateway(tmp_path, {prefill.url: "prefill", decode.url: "decode"})
    procs.append(gateway)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0)

    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    failures = metric_samples(gateway, "isocost_pd_handoff_failures_total")
    assert failures == {(("pool", MODEL), ("stage", "prefill")): 1.0}
