"""Fair turns between API keys in the gateway queue, end to end: a real `isocost engine`
that runs one request at a time, `isocost serve` in front with a replica queue cap of
one (so the rest wait in the gateway's queue), and the official `openai` client.

One key floods the gateway with streamed requests; once its backlog waits in the queue,
a second key sends one request. Checked: the second key's request is served at the next
turn, ahead of most of the flood that was queued before it (first come, first served,
it would be last), and `isocost_queue_depth_by_key` shows whose backlog it is; the same
with the flow named by GAIE's `x-gateway-inference-fairness-id` header on a gateway
without keys.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from gateway_harness import metric_value, wait_for
from isocost_procs import Proc, start_gateway_with, start_isocost

MODEL = "llama-3.1-8b"
FLOOD = 10
KEYS = {"bulk": "secret-bulk", "light": "secret-light"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """One replica running one sequence at a time, ~30 ms a request."""
    args = ["engine", "--port", "0", "--model", MODEL, "--gpu", "h100-80g"]
    proc = start_isocost([*args, "--max-num-seqs", "1"], "isocost engine")
    yield proc
    proc.stop(signal.SIGKILL)


def gateway(engine: Proc, tmp: Path, procs: list[Proc], *, keys: bool) -> Proc:
    entries = "\n".join(f"    - {{name: {n}, key: {k}}}" for n, k in KEYS.items())
    auth = f"auth:\n  api_keys:\n{entries}\n" if keys else ""
    config = f"""
pools:
  - model: {MODEL}
    replicas: [{{url: '{engine.url}', max_queue: 1}}]
limits: {{max_queue: 64, queue_timeout_ms: 60000}}
{auth}"""
    return start_gateway_with(config, tmp, procs)


def served_order(target: Proc, flood: dict[str, str], newcomer: dict[str, str]) -> list[str]:
    """Send ``FLOOD`` streamed requests as ``flood`` (api key, headers), wait until most
    wait in the gateway queue, then one as ``newcomer``; the order their streams ended."""
    ended: list[str] = []
    lock = threading.Lock()

    def ask(name: str, who: dict[str, str]) -> None:
        with openai.OpenAI(
            base_url=target.url + "/v1",
            api_key=who.get("key", "none"),
            default_headers=who.get("headers"),  # type: ignore[arg-type]
            max_retries=0,
            timeout=60,
        ) as client:
            stream = client.completions.create(
                model=MODEL, prompt="Take your turn.", max_tokens=24, stream=True
            )
            for _ in stream:
                pass
        with lock:
            ended.append(name)

    threads = [
        threading.Thread(target=ask, args=(f"bulk{i}", flood), daemon=True) for i in range(FLOOD)
    ]
    for thread in threads:
        thread.start()
    depth = f'isocost_queue_depth{{pool="{MODEL}"}}'
    wait_for(lambda: (metric_value(target.url, depth) or 0) >= FLOOD - 3, 10, "a queued flood")
    if "key" in flood:  # who fills the queue, by key
        by_key = f'isocost_queue_depth_by_key{{key="bulk",pool="{MODEL}"}}'
        assert (metric_value(target.url, by_key) or 0) >= FLOOD - 3
    newcomer_thread = threading.Thread(target=ask, args=("light", newcomer), daemon=True)
    newcomer_thread.start()
    for thread in [*threads, newcomer_thread]:
        thread.join(timeout=60)
    assert len(ended) == FLOOD + 1, ended
    return ended


@pytest.mark.parametrize("keys", [True, False], ids=["api-keys", "fairness-header"])
def test_a_second_flow_is_served_at_the_next_turn_not_behind_the_flood(
    engine: Proc, tmp_path: Path, procs: list[Proc], keys: bool
) -> None:
    target = gateway(engine, tmp_path, procs, keys=keys)
    if keys:
        flood, newcomer = {"key": KEYS["bulk"]}, {"key": KEYS["light"]}
    else:
        header = "x-gateway-inference-fairness-id"
        flood, newcomer = {"headers": {header: "batch"}}, {"headers": {header: "chat"}}
    ended = served_order(target, flood, newcomer)
    behind = len(ended) - 1 - ended.index("light")
    # Queued: about FLOOD - 2 of the flood (one runs, one waits at the replica). First
    # come, first served would end the newcomer last (behind == 0).
    assert behind >= FLOOD - 5, ended
