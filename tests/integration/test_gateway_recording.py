"""`isocost serve --record` in front of real `isocost engine` processes, driven by the
official `openai` client; the recording then replays in `isocost sim --from-record`; the
admin API starts and stops recording; a directory that cannot be written is refused, and
one that fails while recording stops the recording, never a request."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import openai
from gateway_harness import gateway_config, http
from isocost_procs import ISOCOST, Proc, start_isocost

from isocost.core.catalog import Catalog
from isocost.files import load_catalog

MODEL = "llama-3.1-8b"
API_KEY = "sk-test-record-7d1e"
ADMIN_TOKEN = "admin-record-token-3b9a"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}
SYSTEM = "You answer questions about the recorded cluster. " * 60  # ~ 750 tokens, shared


def _engines(procs: list[Proc], count: int) -> list[str]:
    for _ in range(count):
        args = ["engine", "--port", "0", "--model", MODEL, "--gpu", "a100-80g"]
        procs.append(start_isocost([*args, "--output-dist", "max", "--time-scale", "0.05"]))
    return [p.url for p in procs]


def _gateway(
    procs: list[Proc], tmp: Path, urls: list[str], *extra: str, replica_fields: str = ""
) -> Proc:
    config = tmp / "gateway.yaml"
    config.write_text(
        gateway_config(
            urls,
            model=MODEL,
            admin_token=ADMIN_TOKEN,
            api_key=API_KEY,
            policy="round_robin",
            replica_fields=replica_fields,
            key_fields="      max_priority: 1  # the requests ask for priority 1",
        )
    )
    with (tmp / "gateway.log").open("a") as log:
        gateway = start_isocost(
            ["serve", "--config", str(config), "--port", "0", *extra], "isocost serve", log
        )
    procs.append(gateway)
    return gateway


def _admin(gateway: Proc, method: str, path: str, body: object = None) -> dict[str, object]:
    data = None if body is None else json.dumps(body).encode()
    status, _, answer = http(method, gateway.url + path, data, ADMIN)
    assert status == 200, (status, answer)
    assert isinstance(answer, dict)
    return answer


def _ask(client: openai.OpenAI, i: int, *, stream: bool) -> None:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"question number {i}: how busy is replica {i % 3}?"},
    ]
    headers = {"x-session-id": f"user-{i % 2}", "x-priority": "1", "x-deadline-ms": "5000"}
    if stream:
        with client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, stream=True, extra_headers=headers
        ) as chunks:  # type: ignore[call-overload]
            pieces = [c.choices[0].delta.content for c in chunks if c.choices]
        assert "".join(p for p in pieces if p)
    else:
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, extra_headers=headers
        )  # type: ignore[call-overload]
        assert reply.usage is not None and reply.usage.completion_tokens == 6


def _metric(gateway: Proc, name: str) -> float:
    """The sum of ``name``'s series (one for an unlabelled metric)."""
    with urllib.request.urlopen(gateway.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + " ", name + "{"))
    ]
    assert values, f"{name} not exported"
    return sum(values)


def _wait(condition: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.05)


def test_recorded_traffic_replays_in_the_simulator(tmp_path: Path, procs: list[Proc]) -> None:
    record = tmp_path / "rec"
    gateway = _gateway(procs, tmp_path, _engines(procs, 2), "--record", str(record))
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY) as client:
        for i in range(12):
            _ask(client, i, stream=i % 3 != 0)
    assert _metric(gateway, "isocost_recording_active") == 1
    _wait(lambda: _metric(gateway, "isocost_requests_total") == 12)  # all accounted for
    status = _admin(gateway, "POST", "/admin/recording/stop")
    assert status["active"] is False and status["recorded"] == 12 and status["dropped"] == 0
    assert _metric(gateway, "isocost_recording_active") == 0

    written = b"".join(p.read_bytes() for p in sorted(record.glob("trace-*.jsonl")))
    assert SYSTEM[:40].encode() not in written and API_KEY.encode() not in written
    assert b"user-0" not in written  # sessions are salted hashes
    rows = [json.loads(line) for line in written.splitlines()]
    assert len(rows) == 12
    assert {r["status"] for r in rows} == {200} and {r["output_tokens"] for r in rows} == {6}
    assert len({r["hash_ids"][0] for r in rows}) == 1  # the shared system prompt
    assert len({r["session_id"] for r in rows}) == 2
    assert all(r["priority"] == 1 and r["deadline_ms"] == 5000 for r in rows)
    assert {r["replica"] for r in rows} == {u.split("//")[1] for u in (p.url for p in procs[:2])}
    fleet = json.loads((record / "fleet.json").read_text())
    (pool,) = fleet["pools"]
    assert pool["policy"] == "round_robin" and len(pool["replicas"]) == 2
    assert all(r["gpu"] == "a100-80g" and r["usd_per_hour"] > 0 for r in pool["replicas"])

    out = tmp_path / "replay.json"
    run = subprocess.run(
        [ISOCOST, "sim", "--from-record", str(record), "--jobs", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    replayed = json.loads(out.read_text())
    (result,) = [r for r in replayed if r["policy"] == "round_robin"]
    assert result["completed"] == 12

    args = ["--ttft-slo-ms", "5000", "--tpot-slo-ms", "200", "--gpus", "a100-80g,h100-80g"]
    planned = subprocess.run(
        [ISOCOST, "plan", "--from-record", str(record), *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert planned.returncode == 0, planned.stderr
    cheapest = json.loads(planned.stdout)["cheapest"]
    assert cheapest["meets_slo"] and cheapest["gpu"] in ("a100-80g", "h100-80g")
    table = subprocess.run(
        [ISOCOST, "plan", "--from-record", str(record), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert table.returncode == 0 and "cheapest: " in table.stdout, table.stderr


def test_a_gpu_only_the_gateways_catalog_describes_is_recorded_with_the_fleet(
    tmp_path: Path, procs: list[Proc]
) -> None:
    """A replica on a GPU from the gateway's ``--catalog`` (an ``isocost profile`` entry,
    say): the recording carries its figures, so it replays where that file is not."""
    catalog = tmp_path / "site.yaml"
    catalog.write_text(
        "gpus:\n  - {id: a100-site, memory_gib: 80, hbm_bandwidth_gb_s: 1500, "
        "bf16_tflops: 250, usd_per_hour: 1.1, step_overhead_ms: 3.5}\n"
    )
    record = tmp_path / "rec"
    gateway = _gateway(
        procs, tmp_path, _engines(procs, 2), "--record", str(record), "--catalog", str(catalog),
        replica_fields="gpu: a100-site",
    )  # fmt: skip
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY) as client:
        for i in range(4):
            _ask(client, i, stream=True)
    _wait(lambda: _metric(gateway, "isocost_requests_total") == 4)
    assert _admin(gateway, "POST", "/admin/recording/stop")["recorded"] == 4
    fleet = json.loads((record / "fleet.json").read_text())
    assert {r["gpu"] for r in fleet["pools"][0]["replicas"]} == {"a100-site"}
    recorded = Catalog().merged(fleet["catalog"], "fleet.json").gpu("a100-site")
    assert recorded == load_catalog([str(catalog)]).gpu("a100-site")  # its figures, all
    assert "a100-80g" not in fleet["catalog"]  # only what isocost does not ship

    run = subprocess.run(  # no --catalog: the recording's own
        [ISOCOST, "sim", "--from-record", str(record), "--jobs", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    gone = subprocess.run(  # what the recording would be without it: refused, one line
        [ISOCOST, "sim", "--cluster", str(_cluster_on(tmp_path, "a100-site")), "--jobs", "1",
         "--workload", "mix", "--max-requests", "5"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert gone.returncode == 2 and "unknown GPU 'a100-site'" in gone.stderr, gone.stderr


def _cluster_on(tmp: Path, gpu: str) -> Path:
    path = tmp / "cluster.yaml"
    path.write_text(f"served_model: {MODEL}\nreplicas:\n  - {{gpu: {gpu}, model: {MODEL}}}\n")
    return path


def test_an_unwritable_directory_is_refused_and_a_failing_one_stops_recording_not_requests(
    tmp_path: Path, procs: list[Proc]
) -> None:
    # every record past 200 bytes starts a segment: the next one finds the directory gone
    small = ("--record-segment-mb", "0.0002", "--record-max-mb", "1")
    gateway = _gateway(procs, tmp_path, _engines(procs, 1), *small)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY)
    assert _admin(gateway, "GET", "/admin/recording")["active"] is False
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for bad in (str(blocker / "rec"), str(tmp_path / "nul\x00byte")):
        start = json.dumps({"dir": bad}).encode()
        status, _, answer = http("POST", gateway.url + "/admin/recording/start", start, ADMIN)
        assert status == 400 and answer["error"]["param"] == "dir", answer
        assert "cannot record into" in answer["error"]["message"]
    assert _metric(gateway, "isocost_recording_errors") == 2
    assert _admin(gateway, "GET", "/admin/recording")["active"] is False
    good = tmp_path / "rec"
    _admin(gateway, "POST", "/admin/recording/start", {"dir": str(good)})
    _ask(client, 0, stream=True)
    _wait(lambda: _metric(gateway, "isocost_recording_recorded") == 1)
    shutil.rmtree(good)
    good.write_text("the recording directory, replaced by a file")
    _ask(client, 1, stream=False)
    _wait(lambda: _metric(gateway, "isocost_recording_errors") == 3)
    assert _metric(gateway, "isocost_recording_active") == 0
    _ask(client, 2, stream=True)  # served as ever
    status_now = _admin(gateway, "GET", "/admin/recording")
    assert status_now["active"] is False and status_now["error"]
    client.close()
    log = tmp_path / "gateway.log"
    # the writer thread counts the error, then logs it: the line may trail the count
    _wait(lambda: '"event": "recording_failed"' in log.read_text())
    assert log.read_text().count('"event": "recording_failed"') == 1


def test_bad_recordings_and_flags_are_one_line_errors(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("a file, where --record wants a directory")
    for args in (
        ["sim", "--from-record", str(tmp_path / "missing")],
        ["sim", "--from-record", str(tmp_path), "--trace", "t.jsonl"],
        ["sim", "--fail", "r0@10"],
        ["plan", "--from-record", str(tmp_path)],
        ["plan", "--from-record", str(tmp_path), "--ttft-slo-ms", "1", "--tpot-slo-ms", "1"],
        # refused before the gateway starts (nothing listens on port 9: it would say so)
        ["serve", "--replica", "http://127.0.0.1:9", "--record", str(tmp_path / "f" / "rec")],
    ):
        run = subprocess.run([ISOCOST, *args], capture_output=True, text=True, timeout=60)
        assert run.returncode != 0, args
        lines = [line for line in (run.stderr + run.stdout).splitlines() if line.strip()]
        assert len(lines) == 1, (args, lines)
        assert args[0] != "serve" or "--record: cannot record into" in lines[0], lines
