"""An endpoint picker that decides nothing: ``isocost picker``'s ext_proc server
(``picker.server.run_picker``, ``picker.extproc.Processor``) over a brain that names one
endpoint at once. ``gateway_overhead.py --envoy`` runs it beside the real picker, so that
what Python gRPC itself costs per request shows apart from what the brain costs.

    .venv/bin/python benchmarks/null_picker.py PORT IP:PORT
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from isocost.picker.server import run_picker


class _Granted:
    """The one endpoint, and nothing learnt from the response."""

    def __init__(self, endpoint: str) -> None:
        self.endpoints = (endpoint,)
        self.replica = endpoint
        self.prefill_endpoint = None
        self.key_headers: dict[str, str] = {}  # no API keys
        self.meter = None  # no token budgets, nothing metered

    def responded(self, status: int, served: str | None) -> None:
        pass

    def ended(self) -> None:
        pass


class _NullBrain:
    def __init__(self, endpoint: str) -> None:
        self.granted = _Granted(endpoint)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def ready(self) -> bool:
        return True

    def reload_requested(self) -> None:
        pass

    def check_body_size(self, size: int) -> None:
        pass

    def meter(self, shape: str, headers: Mapping[str, str]) -> None:
        return None  # it marks no pick for metering

    async def pick(
        self, path: str, headers: Mapping[str, str], body: bytes, subset: frozenset[str] | None
    ) -> _Granted:
        return self.granted


def main() -> None:
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    port, endpoint = int(sys.argv[1]), sys.argv[2]

    def ready(address: str) -> None:
        print(f"null picker: ready at {address}", flush=True)

    run_picker(_NullBrain(endpoint), "127.0.0.1", port, ready)


if __name__ == "__main__":
    main()
