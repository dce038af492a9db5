"""``isocost demo`` end to end: a short run writes its report and leaves no process behind;
SIGINT or SIGTERM mid-run stops everything it started.

The demo runs as a real subprocess of the installed CLI. Its children (engines and
gateways) are found in ``/proc`` by parent pid while it runs, and identified by their start
time, so that "gone" means that very process is gone, not a reused pid.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from isocost_procs import free_port

from isocost.bench import load_summary
from isocost.demo._cluster import ClusterSettings, DemoReplica, engine_args, gateway_config
from isocost.engine.config import parse_replica_spec
from isocost.runtime.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
ISOCOST = str(ROOT / ".venv" / "bin" / "isocost")
Proc = tuple[int, int]  # pid, start time in clock ticks since boot


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state is [0], ppid [1])."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _children(parent: int) -> set[Proc]:
    found: set[Proc] = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and int(fields[1]) == parent:
                found.add((int(entry.name), int(fields[19])))
    return found


def _alive(proc: Proc) -> bool:
    fields = _stat(proc[0])
    return fields is not None and int(fields[19]) == proc[1] and fields[0] != "Z"


def _watch(
    popen: subprocess.Popen[str], timeout_s: float, until: Callable[[], bool] | None = None
) -> set[Proc]:
    """Children of ``popen`` seen until it exits (or ``until()`` holds); kills it and
    fails the test on timeout."""
    seen: set[Proc] = set()
    deadline = time.monotonic() + timeout_s
    while popen.poll() is None:
        seen |= _children(popen.pid)
        if until is not None and until():
            return seen
        if time.monotonic() > deadline:
            popen.kill()
            popen.wait()
            pytest.fail(f"isocost demo still running after {timeout_s} s")
        time.sleep(0.1)
    return seen


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def _stop(popen: subprocess.Popen[str], sig: signal.Signals) -> None:
    popen.send_signal(sig)
    try:
        popen.wait(timeout=60)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()
        pytest.fail(f"isocost demo did not stop within 60 s of {sig.name}")


def _demo(out: Path, *args: str) -> subprocess.Popen[str]:
    """The demo with stdout and stderr in files beside ``out`` (no pipe to fill up)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / "stdout").open("w") as stdout, (out.parent / "stderr").open("w") as stderr:
        return subprocess.Popen(
            [ISOCOST, "demo", "--out", str(out), *args], stdout=stdout, stderr=stderr, text=True
        )


def _output(out: Path) -> tuple[str, str]:
    return (out.parent / "stdout").read_text(), (out.parent / "stderr").read_text()


@pytest.mark.slow
def test_short_demo_runs_end_to_end_and_leaves_nothing_behind(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    popen = _demo(out, "--duration", "4", "--rate", "2", "--time-scale", "0.5")
    seen = _watch(popen, timeout_s=240)
    stdout, stderr = _output(out)
    assert popen.returncode == 0, stderr
    # One engine process and one gateway per policy, each started and stopped.
    assert len(seen) == 4
    assert not [proc for proc in seen if _alive(proc)]

    summaries = {
        policy: load_summary(str(out / f"{policy}.json"))
        for policy in ("round_robin", "equal_cost")
    }
    for policy, summary in summaries.items():
        assert summary.label == policy
        assert summary.requests > 0
        assert summary.completed + summary.errors == summary.requests
        records = (out / f"{policy}.records.jsonl").read_text().splitlines()
        assert len(records) == summary.requests
    # Same seed, same workload: both policies saw the very same requests.
    assert summaries["round_robin"].requests == summaries["equal_cost"].requests
    report = (out / "report.html").read_text()
    assert report.count('src="data:image/png;base64,') == 2
    assert "round_robin" in report and "equal_cost" in report
    assert (out / "latency.png").stat().st_size > 0
    assert f"report: {out / 'report.html'}" in stdout.replace("\n", "")
    assert "P99 TTFT" in stdout
    assert "/dashboard#token=" in stdout


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_run_stops_everything(tmp_path: Path, sig: signal.Signals) -> None:
    port = free_port()
    out = tmp_path / "demo"
    popen = _demo(out, "--duration", "120", "--port", str(port))
    metrics = f"http://127.0.0.1:{port}/metrics"

    def traffic_flows() -> bool:
        return b"isocost_requests_total{" in _get(metrics)[1]

    seen = _watch(popen, timeout_s=120, until=traffic_flows)
    assert popen.poll() is None, _output(out)
    assert len(seen) == 2  # the first policy's engines and gateway, under load
    _stop(popen, sig)
    assert popen.returncode == 130
    assert "interrupted" in _output(out)[1]
    assert not [proc for proc in seen if _alive(proc)]
    assert not (out / "report.html").exists()


@pytest.mark.slow
def test_keep_running_serves_the_dashboard_until_ctrl_c(tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "demo"
    args = ["--duration", "3", "--rate", "2", "--time-scale", "0.5", "--policies", "equal_cost"]
    popen = _demo(out, *args, "--port", str(port), "--keep-running")
    seen = _watch(popen, timeout_s=120, until=lambda: "cluster still up" in _output(out)[0])
    assert popen.poll() is None, _output(out)
    assert len(seen) == 2
    assert (out / "report.html").exists()

    stdout = _output(out)[0].replace("\n", "")
    found = re.search(rf"http://127\.0\.0\.1:{port}/dashboard#token=([\w-]+)", stdout)
    assert found is not None, stdout
    base = f"http://127.0.0.1:{port}"
    assert _get(f"{base}/dashboard")[0] == 200
    status, body = _get(f"{base}/admin/snapshot", {"Authorization": f"Bearer {found[1]}"})
    assert status == 200
    assert len(msgspec.json.decode(body)["replicas"]) == 8
    assert _get(f"{base}/admin/snapshot", {"Authorization": "Bearer wrong"})[0] == 401

    _stop(popen, signal.SIGINT)
    assert popen.returncode == 130
    assert not [proc for proc in seen if _alive(proc)]


def _settings() -> ClusterSettings:
    return ClusterSettings(
        model="llama-3.1-8b",
        layout=(DemoReplica("fast", "h100-80g"), DemoReplica("slow", "l20-48g", slowdown=3.5)),
        time_scale=2.0,
        stream_interval=1,
        gateway_host="127.0.0.1",
        gateway_port=0,
        admin_token="unused",
        seed=7,
    )


def test_engine_args_give_each_replica_its_gpu_and_slowdown() -> None:
    args = engine_args(_settings())
    specs = [parse_replica_spec(args[i + 1]) for i, a in enumerate(args) if a == "--replica-spec"]
    assert [(s.gpu, s.slowdown) for s in specs] == [("h100-80g", 1.0), ("l20-48g", 3.5)]
    assert args[args.index("--time-scale") + 1] == "2.0"


def test_gateway_config_is_what_isocost_serve_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ISOCOST_DEMO_ADMIN_TOKEN", "set")
    urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    text = msgspec.yaml.encode(gateway_config(_settings(), "round_robin", urls)).decode()
    config = parse_config(text, "demo")
    assert config.policy == "round_robin"
    (pool,) = config.pools
    assert [(r.name, r.gpu, r.url) for r in pool.replicas] == [
        ("fast", "h100-80g", urls[0]),
        ("slow", "l20-48g", urls[1]),
    ]
    # The gateway is told the GPUs, never the slowdown: that it must learn.
    assert "slowdown" not in text
