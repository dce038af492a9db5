"""`isocost drill` bad input: one line on stderr and exit code 2, before any load is sent."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

ISOCOST = str(Path(__file__).resolve().parents[2] / ".venv" / "bin" / "isocost")


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize(
    ("args", "env", "fragment"),
    [
        (["--fault", "explode"], {"ISOCOST_ADMIN_TOKEN": "t"}, "unknown fault 'explode'"),
        (["--fault", "kill"], {}, "ISOCOST_ADMIN_TOKEN"),
        (["--fault", "kill", "--api-key-env", "NOPE"], {"ISOCOST_ADMIN_TOKEN": "t"}, "NOPE"),
        (["--fault", "kill", "--rate", "0"], {"ISOCOST_ADMIN_TOKEN": "t"}, "--rate 0: must be > 0"),
        (["--fault", "kill"], {"ISOCOST_ADMIN_TOKEN": "t"}, "failed"),  # nothing listens
        (["--fault", "restart"], {"ISOCOST_ADMIN_TOKEN": "t"}, "--restart-command"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], env: dict[str, str], fragment: str
) -> None:
    url = _closed_port_url()
    result = subprocess.run(
        [ISOCOST, "drill", "--gateway", url, "--replica-admin", url, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "", "COLUMNS": "200", **env},
        check=False,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert fragment in lines[0]
    assert result.stdout == ""
