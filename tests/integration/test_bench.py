"""`isocost bench` as a real subprocess against a real OpenAI-style SSE server on 127.0.0.1.

The server is this file run as a script (``python test_bench.py MODE``): an aiohttp app
that streams one chunk per requested token, reports usage, logs what it received, and in
``garbage`` mode answers in six different broken ways, in turn.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
ISOCOST = Path(sys.executable).with_name("isocost")  # the venv running the tests
FIXTURES = ROOT / "tests" / "fixtures" / "traces"
MODEL = "fake-model"
API_KEY = "sk-bench-test"
SERVICE_S = 0.05  # each answer takes this long, so requests overlap under load

# --------------------------------------------------------------------------- the server


def _serve(mode: str) -> None:
    from aiohttp import web

    seen: list[dict[str, Any]] = []
    active = {"now": 0, "max": 0}
    started = time.monotonic()

    async def models(request: web.Request) -> web.Response:
        if mode == "keyed" and request.headers.get("authorization") != f"Bearer {API_KEY}":
            return web.json_response({"error": {"message": "no key"}}, status=401)
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def log(_: web.Request) -> web.Response:
        return web.json_response({"requests": seen, "max_active": active["max"]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        entry: dict[str, Any] = {
            "prompt": body.get("prompt") or body["messages"][-1]["content"],
            "session": request.headers.get("x-session-id"),
            "deadline_ms": request.headers.get("x-deadline-ms"),
            "tpot_ms": request.headers.get("x-tpot-ms"),
            "max_tokens": body["max_tokens"],
            "received_s": time.monotonic() - started,
        }
        seen.append(entry)
        index = len(seen) - 1
        active["now"] += 1
        active["max"] = max(active["max"], active["now"])
        try:
            return await _answer(request, body, entry, mode, index)
        finally:
            active["now"] -= 1
            entry["finished_s"] = time.monotonic() - started

    async def _answer(
        request: web.Request, body: dict[str, Any], entry: dict[str, Any], mode: str, index: int
    ) -> web.StreamResponse:
        fault = index % 6 if mode == "garbage" else 0
        if fault == 1:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        usage = {
            "prompt_tokens": len(entry["prompt"].split()),
            "completion_tokens": body["max_tokens"],
        }
        await asyncio.sleep(SERVICE_S)
        if not body.get("stream"):
            return web.json_response(
                {"choices": [{"text": " tok" * body["max_tokens"]}], "usage": usage}
            )
        response = web.StreamResponse(
            headers={"content-type": "text/event-stream", "x-isocost-replica": "fake-0"}
        )
        await response.prepare(request)

        async def send(data: str) -> None:
            await response.write(f"data: {data}\n\n".encode())

        for i in range(body["max_tokens"]):
            if fault == 2 and i == 1:
                await response.write(b"<html>proxy error</html>\n")
                return response
            if fault == 3 and i == 1:
                await send("{not json")
                return response
            if fault == 4 and i == 1:
                return response  # hang up: no [DONE]
            if fault == 5 and i == 1:
                await send(json.dumps({"error": {"message": "engine died"}}))
                return response
            await send(json.dumps({"choices": [{"index": 0, "text": " tok"}]}))
            await asyncio.sleep(0.002)
        await send(json.dumps({"choices": [], "usage": usage}))
        await send("[DONE]")
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/log", log)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)

    async def main() -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        print(port, flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


# --------------------------------------------------------------------------- fixtures


def _start_server(mode: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, __file__, mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())  # printed once the socket listens
    return proc, f"http://127.0.0.1:{port}"


def _running(mode: str) -> Iterator[str]:
    proc, url = _start_server(mode)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


@pytest.fixture
def server() -> Iterator[str]:
    yield from _running("ok")


@pytest.fixture
def garbage_server() -> Iterator[str]:
    yield from _running("garbage")


@pytest.fixture
def keyed_server() -> Iterator[str]:
    yield from _running("keyed")


def _server_log(url: str) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(f"{url}/log", timeout=10) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ISOCOST), "bench", *args], capture_output=True, text=True, timeout=120
    )


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --------------------------------------------------------------------------- tests


def test_trace_replay_keeps_shared_prefixes_end_to_end(server: str, tmp_path: Path) -> None:
    records, summary = tmp_path / "r.jsonl", tmp_path / "s.json"
    run = _bench(
        "--url", server, "--trace", str(FIXTURES / "mooncake_conversation_head.jsonl"),
        "--speedup", "1000", "--max-requests", "12", "--max-tokens", "5",
        "--records", str(records), "--json", str(summary),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = json.loads(summary.read_text())
    assert (result["requests"], result["completed"], result["errors"]) == (12, 12, 0)
    assert result["model"] == MODEL
    assert result["completed_by_replica"] == {"fake-0": 12}
    assert result["output_tokens_per_s"] > 0 and result["goodput_rps"] > 0
    for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p99_s", "e2e_p99_s"):
        assert result[key] > 0
    lines = _records(records)
    assert [r["request_id"] for r in lines] == list(range(12))
    for r in lines:
        assert r["output_tokens"] == 5 and len(r["chunk_times_s"]) == 5
        assert r["replica"] == "fake-0"
        assert r["intended_s"] <= r["sent_s"] <= r["first_token_s"] <= r["end_s"]
        # the server counts one token per word: the rendered prompt has the planned length
        assert r["usage_prompt_tokens"] == r["prompt_tokens"]
    prompts = [e["prompt"].split(" ") for e in _server_log(server)["requests"]]
    by_length = {len(p): p for p in prompts}
    first, second = by_length[6758], by_length[7322]  # hash_ids [0, 1, ...] and [0, 14, ...]
    assert first[:512] == second[:512]
    assert first[512:1024] != second[512:1024]


def test_send_slo_gives_each_request_its_targets_for_slo_admission(
    server: str, tmp_path: Path
) -> None:
    records = tmp_path / "r.jsonl"
    run = _bench(
        "--url", server, "--trace", str(FIXTURES / "mooncake_conversation_head.jsonl"),
        "--speedup", "1000", "--max-requests", "4", "--max-tokens", "3",
        "--slo-ttft-ms", "500", "--slo-ttft-per-1k-ms", "100", "--slo-tpot-ms", "40",
        "--send-slo", "--records", str(records),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    sent = {r["prompt_tokens"] for r in _records(records)}
    seen = _server_log(server)["requests"]
    assert {len(e["prompt"].split(" ")) for e in seen} == sent
    for entry in seen:  # the TTFT target grows with the prompt, as the goodput judges it
        tokens = len(entry["prompt"].split(" "))
        assert float(entry["deadline_ms"]) == pytest.approx(500 + 100 * tokens / 1000)
        assert entry["tpot_ms"] == "40"
    plain = _bench(
        "--url", server, "--workload", "mix", "--rate", "400", "--max-requests", "2",
        "--slo-ttft-ms", "500",
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    assert [e["deadline_ms"] for e in _server_log(server)["requests"][-2:]] == [None, None]
    lonely = _bench("--url", server, "--workload", "mix", "--rate", "4", "--send-slo")
    assert lonely.returncode == 2 and lonely.stdout + lonely.stderr == (
        "error: bench options: --send-slo needs --slo-ttft-ms or --slo-tpot-ms\n"
    )


def test_open_loop_does_not_wait_for_answers(server: str, tmp_path: Path) -> None:
    summary = tmp_path / "s.json"
    run = _bench(
        "--url", server, "--workload", "mix", "--rate", "400", "--max-requests", "30",
        "--max-tokens", "20", "--json", str(summary),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    # 30 arrivals at 400/s come faster than one answer takes (> 20 x 2 ms + 50 ms)
    assert _server_log(server)["max_active"] > 5
    assert json.loads(summary.read_text())["completed"] == 30


def test_duration_bounds_the_arrivals(server: str, tmp_path: Path) -> None:
    records = tmp_path / "r.jsonl"
    run = _bench(
        "--url", server, "--workload", "mix", "--rate", "40", "--duration", "0.5",
        "--max-tokens", "2", "--records", str(records),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = _records(records)
    assert len(lines) > 5 and max(r["intended_s"] for r in lines) < 0.5
    assert len(_server_log(server)["requests"]) == len(lines)


def test_ctrl_c_stops_the_run_and_still_reports(server: str, tmp_path: Path) -> None:
    summary = tmp_path / "s.json"
    proc = subprocess.Popen(
        [
            str(ISOCOST), "bench", "--url", server, "--workload", "mix", "--rate", "20",
            "--max-requests", "100000", "--max-tokens", "50", "--json", str(summary),
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while len(_server_log(server)["requests"]) < 5:  # poll until the run is under way
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "stopped by Ctrl-C" in out
    result = json.loads(summary.read_text())
    assert 5 <= result["requests"] < 100000
    assert result["completed"] + result["errors_by_kind"].get("cancelled", 0) == result["requests"]


def test_closed_loop_holds_its_concurrency(server: str, tmp_path: Path) -> None:
    run = _bench(
        "--url", server, "--workload", "shared-prefix", "--concurrency", "2",
        "--groups", "2", "--prompts-per-group", "5", "--system-tokens", "600",
        "--max-tokens", "3", "--no-stream", "--chat",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    log = _server_log(server)
    assert log["max_active"] == 2 and len(log["requests"]) == 10
    systems = {tuple(e["prompt"].split(" ")[:600]) for e in log["requests"]}
    assert len(systems) == 2, "two groups, two shared system prompts"


def test_multi_turn_sends_history_and_session_ids_in_order(server: str, tmp_path: Path) -> None:
    run = _bench(
        "--url", server, "--workload", "multi-turn", "--rate", "20", "--sessions", "3",
        "--turns", "3", "--think-time", "0", "--system-tokens", "64",
        "--question-tokens", "16", "--output-tokens", "4",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    entries = _server_log(server)["requests"]
    assert len(entries) == 9
    for session in {e["session"] for e in entries}:
        assert session is not None
        turns = [e for e in entries if e["session"] == session]
        assert len(turns) == 3
        for before, after in itertools.pairwise(turns):
            assert after["prompt"].startswith(before["prompt"])
            assert after["received_s"] >= before["finished_s"], "a turn waits for the last"


def test_garbage_answers_are_counted_by_kind_and_the_run_goes_on(
    garbage_server: str, tmp_path: Path
) -> None:
    summary, records = tmp_path / "s.json", tmp_path / "r.jsonl"
    run = _bench(
        "--url", garbage_server, "--workload", "mix", "--concurrency", "1",
        "--max-requests", "12", "--max-tokens", "4", "--json", str(summary),
        "--records", str(records),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = json.loads(summary.read_text())
    assert result["errors_by_kind"] == {
        "bad_json": 2,
        "bad_sse": 2,
        "http_500": 2,
        "stream_error": 2,
        "truncated": 2,
    }
    assert (result["requests"], result["completed"], result["errors"]) == (12, 2, 10)
    statuses = {r["error_kind"]: r["status"] for r in _records(records)}
    assert statuses["http_500"] == 500 and statuses["bad_sse"] == 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_api_key_reaches_the_model_listing(keyed_server: str, tmp_path: Path) -> None:
    """A keyed gateway refuses /v1/models without the key: bench must send it there too."""
    out = tmp_path / "keyed.json"
    args = ("--url", keyed_server, "--workload", "mix", "--rate", "50", "--max-requests", "3",
            "--max-tokens", "2", "--max-prompt-tokens", "200", "--json", str(out))  # fmt: skip
    refused = _bench(*args)
    assert refused.returncode == 2 and "without a model list" in refused.stderr
    done = _bench(*args, "--api-key", API_KEY)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["completed"] == 3


def test_unreachable_url_is_one_line_before_the_run(tmp_path: Path) -> None:
    summary = tmp_path / "s.json"
    run = _bench(
        "--url", f"http://127.0.0.1:{_free_port()}", "--workload", "mix", "--rate", "1",
        "--max-requests", "3", "--json", str(summary),
    )  # fmt: skip
    assert run.returncode == 2
    assert run.stderr.startswith("error: cannot reach http://127.0.0.1:")
    assert len(run.stderr.strip().splitlines()) == 1
    assert not summary.exists()


def test_unparsable_trace_names_file_and_line(server: str, tmp_path: Path) -> None:
    trace = tmp_path / "broken.jsonl"
    good = (FIXTURES / "mooncake_conversation_head.jsonl").read_text().splitlines()[:2]
    trace.write_text("\n".join([*good, '{"timestamp": 3, "input_length": 12', ""]))
    run = _bench("--url", server, "--trace", str(trace))
    assert run.returncode == 2
    assert f"{trace}:3:" in run.stderr and "Traceback" not in run.stderr
    assert _server_log(server)["requests"] == []


def test_compare_prints_runs_side_by_side_and_plots(server: str, tmp_path: Path) -> None:
    paths = []
    for label, tokens in (("short", "2"), ("long", "8")):
        path = tmp_path / f"{label}.json"
        run = _bench(
            "--url", server, "--workload", "mix", "--concurrency", "4", "--max-requests", "8",
            "--max-tokens", tokens, "--label", label, "--json", str(path),
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        paths.append(str(path))
    plot = tmp_path / "cmp.png"
    run = _bench("compare", *paths, "--plot", str(plot))
    assert run.returncode == 0, run.stderr
    assert "short" in run.stdout and "long" in run.stdout and "goodput" in run.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    run = _bench("compare", str(bad))
    assert run.returncode == 2 and str(bad) in run.stderr


def test_python_api_returns_records_and_summary(server: str) -> None:
    from random import Random

    from isocost.bench import BenchOptions, run_bench
    from isocost.workload import poisson_arrivals, shared_prefix

    rng = Random(0)
    requests = shared_prefix(rng, poisson_arrivals(rng, 200.0), 2, 3, 100, 10, 4)
    options = BenchOptions(stream=True, label="api", slo_ttft_ms=10_000)
    result = asyncio.run(run_bench(server + "/v1", requests, options))
    assert [r.request_id for r in result.records] == list(range(6))
    assert all(r.ok and r.output_tokens == 4 for r in result.records)
    assert (result.summary.completed, result.summary.model) == (6, MODEL)
    assert result.summary.goodput_rps == result.summary.throughput_rps > 0


def test_several_urls_share_the_requests_round_robin(server: str, tmp_path: Path) -> None:
    other = _running("ok")
    second = next(other)
    try:
        summary = tmp_path / "s.json"
        run = _bench(
            "--url", server, "--url", second + "/v1", "--workload", "mix", "--rate", "400",
            "--max-requests", "9", "--max-tokens", "2", "--json", str(summary),
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        counts = [len(_server_log(url)["requests"]) for url in (server, second)]
        assert counts == [5, 4]  # in sending order: first, second, first, ...
        assert json.loads(summary.read_text())["url"] == f"{server},{second}"
    finally:
        other.close()


if __name__ == "__main__":
    _serve(sys.argv[1])
