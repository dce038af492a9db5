"""`isocost engine` as a real process on 127.0.0.1, driven by the official openai client
and read back through prometheus_client's parser.

One module-wide process serves two replicas: ``llama-3.1-8b`` on an H100 with its full KV
cache, and ``small-kv`` with 64 KV blocks (1,024 tokens) to force queueing and preemption.
Latency figures are read from the engine's histograms: with the replica idle between
sequential requests, each TTFT is exactly a modelled step time times ``--time-scale``.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from isocost_procs import NotReady, ready_urls
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer, models, pre_tokenizers

from isocost.core.catalog import Catalog
from isocost.engine.tokens import ApproxTokenizer, render_chat

ROOT = Path(__file__).resolve().parents[2]
ISOCOST = ROOT / ".venv" / "bin" / "isocost"
TIME_SCALE = 0.05
MODEL = "llama-3.1-8b"
TOKENS = ApproxTokenizer(Catalog.builtin().model(MODEL).vocab_size)


@dataclass
class Engine:
    proc: subprocess.Popen[str]
    urls: list[str]


def _start(*args: str, replicas: int) -> Engine:
    """Start `isocost engine`; wait until each replica printed its ready line."""
    proc = subprocess.Popen(
        [str(ISOCOST), "engine", "--host", "127.0.0.1", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        urls = ready_urls(proc, "isocost engine: replica ", count=replicas)
    except NotReady:
        _, err = proc.communicate(timeout=20)
        raise AssertionError(f"engine did not start: {err}") from None
    return Engine(proc, urls)


def _stop(engine: Engine) -> int:
    """SIGTERM unless it already exited; its exit code."""
    if engine.proc.poll() is None:
        engine.proc.send_signal(signal.SIGTERM)
    code = engine.proc.wait(timeout=20)
    assert engine.proc.stdout is not None and engine.proc.stderr is not None
    engine.proc.stdout.close()
    engine.proc.stderr.close()
    return code


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    running = _start(
        "--time-scale", str(TIME_SCALE), "--seed", "1",
        "--replica-spec", "gpu=h100-80g",
        "--replica-spec", "num_gpu_blocks=64,served_model_name=small-kv",
        replicas=2,
    )  # fmt: skip
    try:
        yield running
    finally:
        assert _stop(running) == 0  # SIGTERM is a clean shutdown


_CLIENTS: dict[tuple[str, float], openai.OpenAI] = {}


def _client(url: str, timeout: float = 30.0) -> openai.OpenAI:
    """One openai client per URL and timeout, closed when the module's tests end."""
    key = (url, timeout)
    if key not in _CLIENTS:
        _CLIENTS[key] = openai.OpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout
        )
    return _CLIENTS[key]


@pytest.fixture(scope="module", autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    for client in _CLIENTS.values():
        client.close()
    _CLIENTS.clear()


def _metrics(url: str) -> dict[str, float]:
    """Every sample on /metrics by name (+ ``le``/``finished_reason`` label when present)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = s.labels.get("le") or s.labels.get("finished_reason")
            samples[s.name + (f"[{extra}]" if extra else "")] = s.value
            assert s.labels["engine"] == "0"
            if s.name == "vllm:cache_config_info":
                samples["num_gpu_blocks"] = float(s.labels["num_gpu_blocks"])
            else:
                assert s.labels["model_name"]
    return samples


def _post(url: str, body: bytes | dict[str, object]) -> tuple[int, dict[str, object], str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read()), ""
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers.get("Retry-After", "")


def _set_faults(url: str, **faults: object) -> None:
    status, body, _ = _post(f"{url}/admin/fault", faults)
    assert status == 200, body


# -- OpenAI API --------------------------------------------------------------------------


def test_completions_report_exact_usage(engine: Engine) -> None:
    prompt = "The quick brown fox jumps over the lazy dog"
    reply = _client(engine.urls[0]).completions.create(
        model=MODEL, prompt=prompt, max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert reply.object == "text_completion" and reply.model == MODEL
    assert reply.choices[0].finish_reason == "length"
    assert len(TOKENS.encode(reply.choices[0].text)) == 7
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(TOKENS.encode(prompt))
    assert reply.usage.completion_tokens == 7
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 7


def test_chat_stream_ends_with_a_usage_chunk_and_done(engine: Engine) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chunks = list(
        _client(engine.urls[0]).chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    prompt = render_chat([(m["role"], m["content"]) for m in messages])
    assert usage.prompt_tokens == len(TOKENS.encode(prompt))
    assert usage.completion_tokens == len(TOKENS.encode(text)) == 12


def test_a_chat_stream_opens_with_its_first_token_as_vllms_does(engine: Engine) -> None:
    """vLLM sends a chat stream's opening (the assistant role, no text) once the first
    token is made, right before it: a gateway or client that times the first event sees
    the TTFT. A long prompt's prefill sets the two apart if the opening went out before."""
    url, prompt = engine.urls[0], " ".join(f"w{i}" for i in range(12_000))
    before = _metrics(url)
    stream = _client(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2, stream=True
    )
    with stream:
        chunks = iter(stream)
        opening = next(chunks)
        opened_at = time.monotonic()
        first = next(chunks)
        first_at = time.monotonic()
        list(chunks)
    assert opening.choices[0].delta.role == "assistant" and not opening.choices[0].delta.content
    assert first.choices[0].delta.content
    after = _metrics(url)
    assert after["vllm:time_to_first_token_seconds_count"] == (
        before["vllm:time_to_first_token_seconds_count"] + 1
    )
    ttft_s = after["vllm:time_to_first_token_seconds_sum"]
    ttft_s -= before["vllm:time_to_first_token_seconds_sum"]
    assert ttft_s > 0.03 and first_at - opened_at < ttft_s / 4, (first_at - opened_at, ttft_s)


def test_chat_non_stream_and_completion_stream(engine: Engine) -> None:
    client = _client(engine.urls[0])
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=5
    )
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant" and chat.usage is not None
    produced = chat.usage.completion_tokens
    assert 1 <= produced <= 5
    assert len(TOKENS.encode(chat.choices[0].message.content or "")) == produced
    assert chat.choices[0].finish_reason == ("length" if produced == 5 else "stop")
    chunks = list(client.completions.create(model=MODEL, prompt="Once", max_tokens=4, stream=True))
    assert all(c.usage is None for c in chunks)
    assert len(TOKENS.encode("".join(c.choices[0].text for c in chunks))) <= 4
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_output_lengths_without_ignore_eos_vary_within_max_tokens(engine: Engine) -> None:
    client = _client(engine.urls[0])
    lengths = set()
    for _ in range(12):
        reply = client.completions.create(model=MODEL, prompt="Tell a story", max_tokens=300)
        assert reply.usage is not None
        lengths.add(reply.usage.completion_tokens)
    assert len(lengths) > 3 and max(lengths) <= 300 and min(lengths) >= 1


def test_models_health_and_the_served_name(engine: Engine) -> None:
    assert [m.id for m in _client(engine.urls[0]).models.list()] == [MODEL]
    assert [m.id for m in _client(engine.urls[1]).models.list()] == ["small-kv"]
    with urllib.request.urlopen(f"{engine.urls[0]}/health", timeout=10) as response:
        assert response.status == 200


# -- metrics, prefix cache, KV pressure ----------------------------------------------------


def test_running_waiting_and_kv_usage_move_with_load_then_drain(engine: Engine) -> None:
    url = engine.urls[1]  # 64 KV blocks: three 300-token prompts fit, the rest wait
    before = _metrics(url)
    assert before["num_gpu_blocks"] == 64
    client = _client(url)
    peaks = {"running": 0.0, "waiting": 0.0, "kv": 0.0}

    def one(i: int) -> int:
        prompt = " ".join(f"request{i} word{j}" for j in range(60))  # 300 tokens
        reply = client.completions.create(
            model="small-kv", prompt=prompt, max_tokens=600, extra_body={"ignore_eos": True}
        )
        assert reply.usage is not None
        return reply.usage.completion_tokens

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(one, i) for i in range(6)]
        while not all(f.done() for f in futures):  # sample the gauges until all finished
            now = _metrics(url)
            peaks["running"] = max(peaks["running"], now["vllm:num_requests_running"])
            peaks["waiting"] = max(peaks["waiting"], now["vllm:num_requests_waiting"])
            peaks["kv"] = max(peaks["kv"], now["vllm:kv_cache_usage_perc"])
    assert [f.result() for f in futures] == [600] * 6  # KV full: no crash, no deadlock
    after = _metrics(url)
    assert peaks["running"] >= 2 and peaks["waiting"] >= 1 and peaks["kv"] > 0.5
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == after["vllm:gpu_cache_usage_perc"] == 0
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated == 3600
    assert (
        after["vllm:request_success_total[length]"] - before["vllm:request_success_total[length]"]
        == 6
    )
    assert after["vllm:num_preemptions_total"] >= before["vllm:num_preemptions_total"]
    assert after["vllm:e2e_request_latency_seconds_count"] >= 6


def test_a_client_leaving_mid_stream_aborts_its_request(engine: Engine) -> None:
    url = engine.urls[0]
    before = _metrics(url)["vllm:request_success_total[abort]"]
    stream = _client(url).completions.create(
        model=MODEL,
        prompt="never mind",
        max_tokens=100_000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert next(iter(stream)).choices
    stream.close()
    deadline = time.monotonic() + 20
    while (now := _metrics(url))["vllm:request_success_total[abort]"] == before:
        assert time.monotonic() < deadline, "the engine never noticed the client left"
    assert now["vllm:num_requests_running"] == 0 and now["vllm:kv_cache_usage_perc"] == 0


def _ttft_and_hits(url: str, prompt: str) -> tuple[float, float]:
    """(served TTFT, prefix-cache hit tokens) of one request on an idle replica."""
    before = _metrics(url)
    _client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    after = _metrics(url)
    assert after["vllm:time_to_first_token_seconds_count"] == (
        before["vllm:time_to_first_token_seconds_count"] + 1
    )
    ttft = after["vllm:time_to_first_token_seconds_sum"]
    ttft -= before["vllm:time_to_first_token_seconds_sum"]
    return ttft, after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]


def _text_of_tokens(seed: str, tokens: int) -> str:
    words: list[str] = []
    while len(TOKENS.encode("".join(words))) < tokens:
        words.append(f" {seed}{len(words)}")
    return "".join(words)


def test_a_shared_4000_token_prefix_hits_the_cache_and_lowers_ttft(engine: Engine) -> None:
    url = engine.urls[0]
    shared = _text_of_tokens("doc", 4000)
    _, cold_hits = _ttft_and_hits(url, shared + " What is the first point?")
    warm_ttft, warm_hits = _ttft_and_hits(url, shared + " And the second one?")
    other = _text_of_tokens("zed", len(TOKENS.encode(shared)))
    cold_ttft, other_hits = _ttft_and_hits(url, other + " And the second one?")
    assert cold_hits == other_hits == 0
    assert warm_hits >= 3984  # every full 16-token block of the shared prefix
    assert warm_ttft < cold_ttft / 4


# -- bad input and faults --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (b"{not json", 400, None, "invalid_json"),
        ({"model": MODEL}, 400, "prompt", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens", None),
        ({"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream", "invalid_value"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt", None),
        ({"model": "gpt-5", "prompt": "hi"}, 404, "model", "model_not_found"),
    ],
)
def test_bad_completion_requests_get_openai_errors(
    engine: Engine, body: bytes | dict[str, object], status: int, param: str | None, code: str
) -> None:
    got, reply, _ = _post(f"{engine.urls[0]}/v1/completions", body)
    assert got == status
    error = reply["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code) and error["message"]


def test_prompts_beyond_the_context_are_rejected(engine: Engine) -> None:
    client = _client(engine.urls[1])  # small-kv holds 1,024 tokens per request at most
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024"):
        client.chat.completions.create(
            model="small-kv", messages=[{"role": "user", "content": "word " * 1500}]
        )
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="small-kv", prompt="hi", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=MODEL, prompt="hi")


def test_faults_fail_refuse_slow_down_and_hang_until_cleared(engine: Engine) -> None:
    url = engine.urls[0]
    client = _client(url)
    prompt = "a fixed prompt for timing faults"
    try:
        _set_faults(url, error_rate=1.0)
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        _set_faults(url, max_waiting=0)
        status, body, retry_after = _post(
            f"{url}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        )
        assert (status, retry_after) == (503, "1") and "error" in body
        _set_faults(url)
        base_ttft, _ = _ttft_and_hits(url, prompt)
        _set_faults(url, slowdown=4.0)
        slow_ttft, _ = _ttft_and_hits(url, prompt)
        assert slow_ttft == pytest.approx(4 * base_ttft, rel=1e-6)
        _set_faults(url, hang=True)
        with pytest.raises(openai.APITimeoutError):
            _client(url, timeout=0.5).completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        with urllib.request.urlopen(f"{url}/admin/fault", timeout=10) as response:
            assert json.loads(response.read())["hang"] is True
    finally:
        _set_faults(url)
    assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=1).choices


@pytest.mark.parametrize(("faults", "param"), [({"slowdown": 0}, "slowdown"), ({"bogus": 1}, None)])
def test_bad_fault_settings_are_rejected(
    engine: Engine, faults: dict[str, object], param: str | None
) -> None:
    status, body, _ = _post(f"{engine.urls[0]}/admin/fault", faults)
    assert status == 400 and isinstance(body["error"], dict)
    assert body["error"]["param"] == param


# -- process-level: heterogeneous replicas, exact tokenizer, stream interval, crash ---------


def test_yaml_replicas_exact_tokenizer_stream_interval_and_crash(tmp_path: Path) -> None:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "again": 3}
    exact = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    exact.pre_tokenizer = pre_tokenizers.Whitespace()
    exact.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "replicas.yaml").write_text(
        "replicas:\n"
        "  - {gpu: a100-80g, served_model_name: big}\n"
        "  - {gpu: l40s-48g, model: qwen2.5-7b, slowdown: 2}\n"
    )
    running = _start(
        "--replicas-file", str(tmp_path / "replicas.yaml"),
        "--tokenizer", str(tmp_path / "tokenizer.json"),
        "--stream-interval", "5", "--time-scale", str(TIME_SCALE),
        replicas=2,
    )  # fmt: skip
    try:
        assert [m.id for m in _client(running.urls[0]).models.list()] == ["big"]
        assert [m.id for m in _client(running.urls[1]).models.list()] == ["qwen2.5-7b"]
        reply = _client(running.urls[0]).completions.create(
            model="big", prompt="hello world hello again", max_tokens=1
        )
        assert reply.usage is not None and reply.usage.prompt_tokens == 4
        chunks = list(
            _client(running.urls[1]).completions.create(
                model="qwen2.5-7b",
                prompt="hello",
                max_tokens=23,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        sizes = [len(TOKENS.encode(c.choices[0].text)) for c in chunks if c.choices[0].text]
        assert sum(sizes) == 23 and all(size >= 5 for size in sizes[:-1])
        status, _, _ = _post(f"{running.urls[1]}/admin/fault", {"crash": True})
        assert status == 200
        assert running.proc.wait(timeout=20) == 70
    finally:
        _stop(running)


def test_sigterm_ends_open_streams_and_exits_0() -> None:
    running = _start("--time-scale", "1", replicas=1)
    try:
        stream = _client(running.urls[0]).completions.create(
            model=MODEL,
            prompt="go",
            max_tokens=100_000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        assert next(chunks).choices
        running.proc.send_signal(signal.SIGTERM)
        assert running.proc.wait(timeout=20) == 0
        rest = list(chunks)  # the stream stops early: no finish_reason, no [DONE]
        assert all(c.choices[0].finish_reason is None for c in rest)
        stream.close()
    finally:
        _stop(running)


def test_identical_replicas_are_independent() -> None:
    running = _start(
        "--replicas", "3", "--served-model-name", "m", "--time-scale", "0.01", replicas=3
    )
    try:
        assert len(set(running.urls)) == 3
        for url in running.urls:
            assert [m.id for m in _client(url).models.list()] == ["m"]
        _client(running.urls[2]).completions.create(
            model="m", prompt="only here", max_tokens=3, extra_body={"ignore_eos": True}
        )
        generated = [_metrics(url)["vllm:generation_tokens_total"] for url in running.urls]
        assert generated == [0, 0, 3]
    finally:
        assert _stop(running) == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--time-scale", "0"], "--time-scale: must be > 0"),
        (["--replica-spec", "colour=red"], "colour"),
        (["--gpu", "h100"], "unknown GPU"),
        (["--error-rate", "3"], "--error-rate: must be between 0 and 1"),
        (["--tokenizer", "/nonexistent/tokenizer.json"], "tokenizer.json: no such file"),
        (["--kv-events-port", "65536"], "--kv-events-port: must leave a TCP port"),
    ],
)
def test_bad_flags_exit_2_with_one_line(args: list[str], message: str) -> None:
    run = subprocess.run(
        [str(ISOCOST), "engine", "--port", "0", *args], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2
    assert message in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_a_kv_events_port_in_use_exits_2_with_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            [str(ISOCOST), "engine", "--port", "0", "--kv-events-port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert run.returncode == 2
    assert f"--kv-events-port: tcp://127.0.0.1:{port}: Address already in use" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
