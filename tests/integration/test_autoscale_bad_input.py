"""``isocost autoscale`` on bad input and at its end: a config file that is not text, a
``--scale-command`` a shell could not parse, a ``--gateway`` that is no URL are one line
and exit 2; SIGTERM leaves no engine it started listed in the gateway, dead."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from gateway_harness import admin_replicas, gateway_config, wait_for
from isocost_procs import ISOCOST, Proc, start_isocost

MODEL = "llama-3.1-8b"
ADMIN_TOKEN = "admin-autoscale-bad-51"
CONFIG = """
interval_s: 0.5
max_gpus: 4
scale_up_cooldown_s: 0
pools:
  - {gpu: a100-80g, min: 2, max: 2, cold_start_s: 2}
"""


def run_autoscale(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ISOCOST, "autoscale", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "ISOCOST_ADMIN_TOKEN": ADMIN_TOKEN},
        cwd=tmp_path,
    )


@pytest.mark.parametrize(
    ("config", "flags", "message"),
    [
        (b"\xff\xfe max_gpus: 4", [], "not UTF-8 text"),
        (CONFIG.encode(), ["--scale-command", "kubectl scale 'deploy"], "No closing quotation"),
        (CONFIG.encode(), ["--gateway", "127.0.0.1:8080"], "not an http(s):// URL"),
    ],
    ids=["config-not-utf8", "unparsable-command", "gateway-no-url"],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, config: bytes, flags: list[str], message: str
) -> None:
    path = tmp_path / "autoscale.yaml"
    path.write_bytes(config)
    args = ["--gateway", "http://127.0.0.1:9", "--config", str(path), "--actuator", "command"]
    args += ["--scale-command", "true"]
    done = run_autoscale(tmp_path, *args, *flags)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


def replicas(gateway: Proc) -> list[dict[str, Any]]:
    return admin_replicas(gateway.url, ADMIN_TOKEN)


def test_sigterm_takes_the_engines_it_started_out_of_the_gateway(
    tmp_path: Path, procs: list[Proc]
) -> None:
    """Pool min 2 over one engine: the autoscaler starts a second at once. SIGTERM stops
    that engine; it used to stay listed in the gateway, dead, taking requests."""
    engine = start_isocost(
        ["engine", "--port", "0", "--model", MODEL, "--gpu", "a100-80g"], "isocost engine"
    )
    procs.append(engine)
    gateway_yaml = tmp_path / "gateway.yaml"
    gateway_yaml.write_text(
        gateway_config([engine.url], model=MODEL, admin_token=ADMIN_TOKEN, api_key="sk-51")
    )
    with (tmp_path / "gateway.log").open("a") as log:
        gateway = start_isocost(
            ["serve", "--config", str(gateway_yaml), "--port", "0"], "isocost serve", stderr=log
        )
    procs.append(gateway)
    config = tmp_path / "autoscale.yaml"
    config.write_text(CONFIG)
    args = ["autoscale", "--gateway", gateway.url, "--config", str(config), "--actuator", "local"]
    out = tmp_path / "autoscale.out"
    with out.open("w") as stdout, (tmp_path / "autoscale.log").open("w") as stderr:
        autoscale = subprocess.Popen(
            [ISOCOST, *args, "--log-dir", str(tmp_path / "engines")],
            stdout=stdout,
            stderr=stderr,
            env={**os.environ, "ISOCOST_ADMIN_TOKEN": ADMIN_TOKEN},
        )
    try:
        wait_for(lambda: len(replicas(gateway)) == 2, 60, "a second replica", state=out.read_text)
        autoscale.send_signal(signal.SIGTERM)
        assert autoscale.wait(timeout=60) == 0
    finally:
        if autoscale.poll() is None:
            autoscale.kill()
            autoscale.wait()
    assert [row["url"] for row in replicas(gateway)] == [engine.url]
