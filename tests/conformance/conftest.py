"""Session fixtures: one ``isocost engine`` replica and, under ``make test-real``, two real
vLLM CPU replicas, each started once and shared by every conformance test.

``endpoint`` parametrises a test over both engines; its ``vllm`` case is marked
``real_vllm`` and skips with a reason unless ``make test-real`` enabled it and the tiny
model is present (a fresh clone without ``../shared`` runs the simulator cases only).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from processes import SERVED_NAME, Endpoint, IsocostProcess, VllmFleet, unavailable_reason

SIM_KV_BLOCKS = 64  # x 16 tokens: the same 1,024-token context as the vLLM replicas


@pytest.fixture(scope="session")
def sim_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IsocostProcess]:
    log = tmp_path_factory.mktemp("sim") / "engine.log"
    engine = IsocostProcess(
        [
            "engine", "--port", "0", "--served-model-name", SERVED_NAME,
            "--num-gpu-blocks-override", str(SIM_KV_BLOCKS), "--seed", "3",
        ],
        "isocost engine",
        log,
    )  # fmt: skip
    try:
        yield engine
    finally:
        assert engine.stop() == 0


@pytest.fixture(scope="session")
def vllm_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    """Two real vLLM replicas for the whole session; a killed one is restarted on demand."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    fleet = VllmFleet(tmp_path_factory.mktemp("vllm"), size=2)
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture
def vllm(vllm_fleet: VllmFleet) -> VllmFleet:
    """The fleet with every replica alive (a previous test may have killed one)."""
    vllm_fleet.revive()
    return vllm_fleet


@pytest.fixture(params=["isocost-engine", pytest.param("vllm", marks=pytest.mark.real_vllm)])
def endpoint(request: pytest.FixtureRequest) -> Endpoint:
    if request.param == "vllm":
        fleet: VllmFleet = request.getfixturevalue("vllm")
        return Endpoint("vllm", fleet.urls[0])
    sim: IsocostProcess = request.getfixturevalue("sim_engine")
    return Endpoint("isocost-engine", sim.url)
