"""Bad input to `isocost` as a user gives it: one line on stderr and exit 2, before any work.

Every case is a real subprocess of the installed command. None may print a traceback, hang,
end with 0, or leave an output file behind. Where a check could also pass by luck (a run
that fails later for another reason), the line must name the flag or key at fault.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from isocost.bench import summarize_bench
from isocost.runtime.recording import FLEET_FILE, FleetFile, FleetPool, FleetReplica

ISOCOST = Path(sys.executable).with_name("isocost")
TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
TRACE = TRACES / "mooncake_conversation_head.jsonl"
NOWHERE = "http://127.0.0.1:9"  # the discard port: nothing answers there
GPU = "gpus:\n  - {id: x, memory_gib: 80, hbm_bandwidth_gb_s: 2000, bf16_tflops: 300,"
AUTOSCALE = "max_gpus: 8\npools: [{gpu: a100-80g, min: 1, max: 2}]\n"


def run(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``isocost *args``; a refusal is due at once, a run that hangs fails the test."""
    full_env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", **(env or {})}
    return subprocess.run(
        [str(ISOCOST), *args], capture_output=True, text=True, timeout=60, env=full_env,
        cwd=cwd, check=False,
    )  # fmt: skip


def refused(done: subprocess.CompletedProcess[str], *words: str) -> str:
    """The one error line of a refusal, holding each of ``words``."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


# -- 1. output paths, checked before the run -----------------------------------------


BENCH = ("bench", "--url", NOWHERE, "--workload", "mix", "--rate", "1", "--max-requests", "1")


@pytest.mark.parametrize(
    ("outputs", "words"),
    [
        (("--json", "adir"), ("--json adir", "is a folder")),
        (("--json", "/nonexistent/x.json"), ("--json /nonexistent/x.json", "no folder")),
        (("--json", "/proc/x.json"), ("--json /proc/x.json",)),
        (("--records", "r1.jsonl", "--json", "/nonexistent/x.json"), ("--json",)),
        (("--records", "same.json", "--json", "same.json"), ("--records and --json",)),
    ],
)
def test_bench_outputs_are_checked_before_the_run(
    tmp_path: Path, outputs: tuple[str, ...], words: tuple[str, ...]
) -> None:
    (tmp_path / "adir").mkdir()
    refused(run(*BENCH, *outputs, cwd=tmp_path), *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"]


@pytest.mark.parametrize(
    ("plot", "words"),
    [
        ("x.txt", ("--plot x.txt", ".png")),
        ("/nonexistent/x.png", ("--plot /nonexistent/x.png", "no folder")),
    ],
)
def test_bench_compare_checks_its_plot_first(
    tmp_path: Path, plot: str, words: tuple[str, ...]
) -> None:
    summary = summarize_bench([], label="a", url=NOWHERE, model="m")
    (tmp_path / "a.json").write_bytes(msgspec.json.encode(summary))
    refused(run("bench", "compare", "a.json", "a.json", "--plot", plot, cwd=tmp_path), *words)
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


SIM = ("sim", "--trace", str(TRACE), "--replicas", "2", "--max-requests", "20", "--jobs", "1")


@pytest.mark.parametrize(
    ("outputs", "words"),
    [
        (("--json", "/nonexistent/x.json"), ("--json /nonexistent/x.json", "no folder")),
        (("--json", "ok.json", "--plot", "/nonexistent/x.png"), ("--plot",)),
        (("--plot", "x.txt"), ("--plot x.txt", ".png")),
        (("--plot", "adir"), ("--plot adir", "is a folder")),  # it wrote adir.png
    ],
)
def test_sim_outputs_are_checked_before_the_simulation(
    tmp_path: Path, outputs: tuple[str, ...], words: tuple[str, ...]
) -> None:
    (tmp_path / "adir").mkdir()
    refused(run(*SIM, *outputs, cwd=tmp_path), *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"]


@pytest.mark.parametrize(("out", "words"), [("afile", ("--out afile", "not a folder")),
                                            ("/proc/x", ("--out /proc/x",))])  # fmt: skip
def test_demo_out_must_be_a_folder_it_can_make(
    tmp_path: Path, out: str, words: tuple[str, ...]
) -> None:
    (tmp_path / "afile").write_text("mine")
    refused(run("demo", "--out", out, "--duration", "1", cwd=tmp_path), *words)
    assert (tmp_path / "afile").read_text() == "mine"


def test_profile_checks_out_before_measuring() -> None:
    done = run("profile", NOWHERE, "--id", "x", "--cost-model", "llama-3.1-8b",
               "--out", "/nonexistent/x.yaml")  # fmt: skip
    refused(done, "--out /nonexistent/x.yaml", "no folder")


# -- 2-5, 9-10: numbers of flags and files ----------------------------------------------

SHARED = ("sim", "--workload", "shared-prefix")
ONE = "replicas: [{gpu: a100-80g, model: llama-3.1-8b"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("plan", "-m", "llama-3.1-8b", "-g", "a100-80g", "--qps", "nan"), ("--qps nan", "finite")),
        (("plan", "-m", "llama-3.1-8b", "-g", "a100-80g", "--qps", "inf"), ("--qps inf",)),
        ((*SHARED, "--groups", "0"), ("--groups 0", ">= 1")),
        ((*SHARED, "--prompts-per-group", "0"), ("--prompts-per-group",)),
        (("sim", "--workload", "multi-turn", "--sessions", "0"), ("--sessions 0",)),
        (("sim", "--workload", "multi-turn", "--turns", "-2"), ("--turns -2",)),
        ((*SHARED, "--system-tokens", "-1"), ("--system-tokens -1",)),
        ((*SHARED, "--question-tokens", "0"), ("--question-tokens 0",)),
        ((*SHARED, "--output-tokens", "-5"), ("--output-tokens -5",)),
        (("sim", "--workload", "mix", "--max-prompt-tokens", "0"), ("--max-prompt-tokens 0",)),
        (("bench", "--url", NOWHERE, "--workload", "shared-prefix", "--rate", "1", "--groups", "0"),
         ("--groups 0", ">= 1")),
        (("bench", "--url", NOWHERE, "--duration", "nan"), ("--duration nan",)),
        (("bench", "--url", NOWHERE, "--burstiness", "nan"), ("--burstiness nan",)),
        (("bench", "--url", NOWHERE, "--rate", "0"), ("--rate 0", "> 0")),
        (("bench", "--url", NOWHERE, "--rate", "inf"), ("--rate inf",)),
        (("drill", "--gateway", NOWHERE, "--replica-admin", NOWHERE, "--fault", "kill",
          "--rate", "nan"), ("--rate nan",)),
        (("drill", "--gateway", NOWHERE, "--replica-admin", NOWHERE, "--fault", "kill",
          "--warmup", "nan"), ("--warmup nan",)),
        (("serve", "--replica", NOWHERE, "--discover-timeout", "nan"), ("--discover-timeout nan",)),
        (("sim", "--network-delay-ms", "inf"), ("--network-delay-ms inf",)),
        (("sim", "--speedup", "nan"), ("--speedup nan",)),
        (("sim", "--rate", "nan"), ("--rate nan",)),
        (("sim", "--slo-ttft-ms", "nan"), ("--slo-ttft-ms nan",)),
        (("sim", "--sweep-rate", "1,nan"), ("--sweep-rate 1,nan", "finite")),
        (("sim", "--max-requests", "-1"), ("--max-requests -1",)),
        (("engine", "--max-num-seqs", "0"), ("--max-num-seqs", ">= 1")),
        (("engine", "--max-num-seqs", "-5"), ("--max-num-seqs",)),
        (("engine", "--max-num-batched-tokens", "0"), ("--max-num-batched-tokens",)),
        (("engine", "--gpu-memory-utilization", "1.5"), ("--gpu-memory-utilization", "(0, 1]")),
        (("engine", "--gpu-memory-utilization", "nan"), ("--gpu-memory-utilization", "finite")),
        (("engine", "--num-gpu-blocks-override", "0"), ("--num-gpu-blocks-override",)),
        (("engine", "--time-scale", "inf"), ("--time-scale", "finite")),
        (("serve", "--replica", NOWHERE, "--tp", "0"), ("--tp 0",)),
        (("serve", "--replica", NOWHERE, "--replica", NOWHERE + "/"), ("--replica", "twice")),
        (("agent", "--engine", NOWHERE, "--etcd", NOWHERE, "--min-success-rate", "nan"),
         ("--min-success-rate nan", "finite")),
        (("agent", "--engine", NOWHERE, "--etcd", NOWHERE, "--drain-timeout", "-1"),
         ("--drain-timeout -1",)),
        (("plan", "-m", "llama-3.1-8b", "-g", "a100-80g", "--context", "99999999999"),
         ("--context", "10,000,000")),
    ],
)  # fmt: skip
def test_a_number_out_of_range_is_one_line(args: tuple[str, ...], words: tuple[str, ...]) -> None:
    refused(run(*args), *words)


@pytest.mark.parametrize(
    ("entry", "key"),
    [
        ("usd_per_hour: 3, mbu_decode: 0}", "gpus[0].mbu_decode"),  # divided by zero
        ("usd_per_hour: 3, mfu_prefill: 2.0}", "gpus[0].mfu_prefill"),
        ("usd_per_hour: .nan}", "gpus[0].usd_per_hour"),
    ],
)
@pytest.mark.parametrize("command", ["plan", "sim"])
def test_catalog_numbers_are_checked_when_it_is_read(
    tmp_path: Path, entry: str, key: str, command: str
) -> None:
    catalog = tmp_path / "cat.yaml"
    catalog.write_text(f"{GPU} {entry}\n")
    args = ("-m", "llama-3.1-8b", "-g", "x", "--catalog", str(catalog))
    extra = ("--workload", "mix", "--max-requests", "5") if command == "sim" else ()
    refused(run(command, *args, *extra), f"{catalog}: {key}")


def test_cluster_files_with_an_endless_number_are_refused(tmp_path: Path) -> None:
    for text, key in (
        (f"network_delay_ms: .inf\n{ONE}}}]", "network_delay_ms"),
        (f"{ONE}, slowdown: .inf}}]", "replicas[0].slowdown"),
    ):  # fmt: skip
        cluster = tmp_path / "cluster.yaml"
        cluster.write_text(text)
        refused(run("sim", "--workload", "mix", "--cluster", str(cluster)), f"{cluster}: {key}")


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ("guard_window_s: 0", ("guard_window_s: must be > 0",)),  # was an IndexError
        ("guard_window_s: -1", ("guard_window_s",)),
        ("guard_window_s: .nan", ("guard_window_s", "finite")),
        ("interval_s: .inf", ("interval_s", "finite")),
        ("interval_s: 0.0001", ("interval_s: must be >= 0.1",)),
    ],
)
def test_autoscale_numbers_are_finite_and_in_range(
    tmp_path: Path, setting: str, words: tuple[str, ...]
) -> None:
    config = tmp_path / "autoscale.yaml"
    config.write_text(f"{setting}\n{AUTOSCALE}")
    done = run("sim", "--workload", "mix", "--max-requests", "50", "--rate", "2",
               "--replicas", "1", "--autoscale", str(config))  # fmt: skip
    refused(done, str(config), *words)


# -- 6. a recording's fleet.json --------------------------------------------------------


def _recording(directory: Path, itl_factor: float = 1.0) -> Path:
    directory.mkdir()
    rows = [json.loads(line) for line in TRACE.read_text().splitlines()[:20]]
    outcome = {"model": "llama-3.1-8b", "status": 200, "e2e_ms": 1}
    lines = [json.dumps({**r, **outcome, "output_tokens": r["output_length"]}) for r in rows]
    (directory / "trace-000000.jsonl").write_text("\n".join(lines) + "\n")
    member = FleetReplica("10.0.0.1:8000", "a100-80g", "llama-3.1-8b", itl_factor=itl_factor)
    fleet = FleetFile(pools=[FleetPool("llama-3.1-8b", "round_robin", [member])])
    (directory / FLEET_FILE).write_bytes(msgspec.json.encode(fleet))
    return directory


@pytest.mark.parametrize(
    "command",
    [("sim", "--jobs", "1"), ("plan", "--ttft-slo-ms", "2000", "--tpot-slo-ms", "100")],
)
def test_a_fleet_with_a_negative_factor_is_refused_when_read(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    record = _recording(tmp_path / "rec", itl_factor=-1.0)  # was: math domain error
    done = run(command[0], "--from-record", str(record), *command[1:])
    refused(done, f"{record / FLEET_FILE}: pools[0].replicas[0].itl_factor: must be > 0")


def test_a_fleet_with_an_unknown_key_is_refused(tmp_path: Path) -> None:
    record = _recording(tmp_path / "rec")
    fleet = json.loads((record / FLEET_FILE).read_text())
    (record / FLEET_FILE).write_text(json.dumps({**fleet, "bogus": 1}))
    refused(run("sim", "--from-record", str(record)), "unknown field `bogus`")


# -- 7-8. servers that cannot start -----------------------------------------------------


def test_a_taken_port_is_one_line_for_engine_serve_and_autoscale(
    tmp_path: Path, busy_port: int
) -> None:
    port = str(busy_port)
    where = f"cannot listen on 127.0.0.1:{port}"
    refused(run("engine", "--port", port), where)
    refused(run("serve", "--port", port, "--replica", NOWHERE), where)  # before discovery
    (tmp_path / "autoscale.yaml").write_text(AUTOSCALE)
    done = run("autoscale", "--gateway", NOWHERE, "--config", "autoscale.yaml",
               "--actuator", "command", "--scale-command", "true", "--dry-run",
               "--metrics-port", port, cwd=tmp_path, env={"ISOCOST_ADMIN_TOKEN": "t"})  # fmt: skip
    refused(done, where)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("engine", "--host", "999.1.1.1", "--port", "0"), ("cannot listen on 999.1.1.1:0",)),
        (("serve", "--host", "999.1.1.1", "--replica", NOWHERE), ("cannot listen on 999.1.1.1",)),
        (("serve", "--port", "-1", "--replica", NOWHERE), ("--port -1",)),
        (("serve", "--replica", NOWHERE, "--admin-token-env", "ISOCOST_TEST_UNSET"),
         ("--admin-token-env", "ISOCOST_TEST_UNSET")),
    ],
)  # fmt: skip
def test_a_server_that_cannot_start_says_why_in_one_line(
    args: tuple[str, ...], words: tuple[str, ...]
) -> None:
    refused(run(*args, env={"ISOCOST_TEST_UNSET": ""}), *words)


@pytest.mark.parametrize(
    "args",
    [
        ("serve", "--replica", NOWHERE),
        ("picker", "--config", "gateway.yaml"),
        ("agent", "--engine", NOWHERE, "--etcd", NOWHERE),
        ("autoscale", "--gateway", NOWHERE, "--config", "autoscale.yaml"),
    ],
)
def test_an_unknown_log_level_is_one_line(args: tuple[str, ...]) -> None:
    refused(run(*args, "--log-level", "nope"), "--log-level", "'nope'", "debug, info")


# -- 11. runs that would never end ------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--workload", "shared-prefix", "--rate", "1e-300"), ("604,800 s",)),
        (("--trace", str(TRACE), "--speedup", "1e-300"), ("604,800 s",)),
        (("--trace", str(TRACE), "--scrape-interval-ms", "1e-9"), ("5,000,000",)),
        (("--replicas", "100000"), ("--replicas", "10000")),
        (("--workload", "shared-prefix", "--groups", "100000000", "--max-requests", "5"),
         ("--groups x --prompts-per-group", "1,000,000")),
    ],
)  # fmt: skip
def test_a_simulation_beyond_its_limits_is_refused_at_once(
    args: tuple[str, ...], words: tuple[str, ...]
) -> None:
    refused(run("sim", *args), *words)


@pytest.mark.parametrize("last_ms", ["1e9", "1e300"])
def test_a_trace_spanning_more_than_a_week_is_refused(tmp_path: Path, last_ms: str) -> None:
    trace = tmp_path / "t.jsonl"
    row = '{{"timestamp": {}, "input_length": 5, "output_length": 10, "hash_ids": [1]}}\n'
    trace.write_text(row.format(0) + row.format(last_ms))
    refused(run("sim", "--trace", str(trace)), "604,800 s (7 days)")


# -- severity 3 -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("sim", "--policies", ","), ("--policies", "at least one")),
        (("sim", "--policies", "round_robin,round_robin"), ("round_robin named more than once",)),
        (("sim", "--trace", str(TRACES / "vidur_arxiv_head.csv")),
         ("the trace has no arrival times; pass --rate",)),
    ],
)  # fmt: skip
def test_sim_refuses_what_bench_and_demo_refuse(
    args: tuple[str, ...], words: tuple[str, ...]
) -> None:
    refused(run(*args), *words)


def test_malformed_yaml_is_one_line(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("replicas: [ {name: a\n")
    refused(run("sim", "--workload", "mix", "--cluster", str(cluster)), "not valid YAML")


def test_version_alone_prints_it() -> None:
    done = run("--version")
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
