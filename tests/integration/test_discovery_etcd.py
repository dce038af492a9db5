"""Membership through etcd, end to end: real etcd, real `isocost engine`, `isocost agent`
and `isocost serve` processes on 127.0.0.1, traffic through the official openai client.

Leases are 2 s here (10 s by default) so that expiry takes seconds. The deadlines checked
are the issue's: an engine routable within 1 s of its registration; a SIGKILLed agent's
replica gone within TTL + 1 s with every request that had not started streaming answered
elsewhere; a SIGTERMed agent's replica leaving only once idle, nothing lost; etcd
SIGKILLed under load with no request failing, and after its restart the gateway in step
again within 2 x TTL, with no ghost and no duplicate; 200 registrations within a second all
routable within 5 s. Every wait polls against a deadline.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from etcd_server import ETCD, EtcdServer
from gateway_harness import admin_replicas, http, wait_for
from isocost_procs import ISOCOST, Proc, free_port, ready_urls, start_gateway_with, start_isocost

from isocost.runtime.discovery.records import Registration
from isocost.runtime.etcd import Compacted, EtcdClient

pytestmark = pytest.mark.skipif(ETCD is None, reason="no etcd binary (make test installs it)")

MODEL = "llama-3.1-8b"
ADMIN_TOKEN = "admin-discovery-51c2"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
TTL_S = 2
PREFIX = "/isocost-test"
OUTAGE_S = float(os.environ.get("ISOCOST_ETCD_OUTAGE_S", "4"))


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def client_of() -> Iterator[Callable[[Proc], openai.OpenAI]]:
    """An openai client for a gateway, closed at the end of the test."""
    made: list[openai.OpenAI] = []

    def make(gateway: Proc) -> openai.OpenAI:
        made.append(openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0))
        return made[-1]

    yield make
    for client in made:
        client.close()


def gateway_yaml(etcd_url: str, *, scrape_ms: int = 100, health_ms: int = 100) -> str:
    return f"""
scrape_interval_ms: {scrape_ms}
discovery:
  etcd: {{endpoints: ['{etcd_url}'], prefix: {PREFIX}, probe_interval_ms: 200,
          max_backoff_ms: 500, timeout_ms: 500}}
limits: {{retry_backoff_ms: 5, max_retries: 3, idle_timeout_ms: 3000}}
health: {{interval_ms: {health_ms}, timeout_ms: 300, open_ms: 300}}
auth: {{admin_token: {ADMIN["Authorization"].split()[1]}}}
"""


def start_gateway(tmp: Path, etcd: EtcdServer, procs: list[Proc], **fields: int) -> Proc:
    return start_gateway_with(gateway_yaml(etcd.url, **fields), tmp, procs)


def start_engine(procs: list[Proc], *extra: str, port: int = 0) -> Proc:
    args = ["engine", "--port", str(port), "--model", MODEL, "--gpu", "a100-80g"]
    engine = start_isocost([*args, "--output-dist", "max", *extra], "isocost engine")
    procs.append(engine)
    return engine


def start_agent(tmp: Path, etcd: EtcdServer, engine: Proc, name: str, procs: list[Proc]) -> Proc:
    args = ["agent", "--engine", engine.url, "--etcd", etcd.url, "--name", name]
    args += ["--ttl", str(TTL_S), "--prefix", PREFIX, "--drain-timeout", "20"]
    with (tmp / f"agent-{name}.log").open("a") as log:
        agent = start_isocost(args, "isocost agent", stderr=log)
    procs.append(agent)
    return agent


def replicas(gateway: Proc) -> list[dict[str, Any]]:
    return admin_replicas(gateway.url, ADMIN_TOKEN)


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def metric(gateway: Proc, name: str) -> float | None:
    for line in get_text(gateway.url + "/metrics").splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_until(
    check: Callable[[], bool], timeout_s: float, what: str, step_s: float = 0.02
) -> float:
    """``wait_for`` ``check``; the seconds it took."""
    started = time.monotonic()
    wait_for(check, timeout_s, what, interval_s=step_s)
    return time.monotonic() - started


def healthy_names(gateway: Proc) -> list[str]:
    return sorted(row["name"] for row in replicas(gateway) if row["state"] == "healthy")


@dataclass
class Outcome:
    replica: str | None
    chunks: int
    error: str | None


@dataclass
class Load:
    """Streaming completions through the gateway from a few threads, until stopped."""

    gateway: Proc
    workers: int = 4
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Load:
        for _ in range(self.workers):
            thread = threading.Thread(target=self._work, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def _work(self) -> None:
        with openai.OpenAI(
            base_url=self.gateway.url + "/v1", api_key="unused", max_retries=0, timeout=15
        ) as client:
            while not self._stop.is_set():
                self._one(client)

    def _one(self, client: openai.OpenAI) -> None:
        replica, chunks = None, 0
        try:
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt="Tell me about leases.", max_tokens=24, stream=True
            )
            replica = raw.headers.get("x-isocost-replica")
            for _ in raw.parse():
                chunks += 1
            self.outcomes.append(Outcome(replica, chunks, None))
        except openai.APIError as exc:
            self.outcomes.append(Outcome(replica, chunks, f"{type(exc).__name__}: {exc}"))

    def count(self) -> int:
        return len(self.outcomes)

    def wait_for(self, more: int, timeout_s: float = 30) -> None:
        target = self.count() + more
        wait_until(lambda: self.count() >= target, timeout_s, f"{more} more answers", 0.05)


def test_registered_engine_is_routable_within_a_second(
    tmp_path: Path,
    etcd: EtcdServer,
    procs: list[Proc],
    client_of: Callable[[Proc], openai.OpenAI],
) -> None:
    gateway = start_gateway(tmp_path, etcd, procs)
    wait_until(lambda: metric(gateway, "isocost_discovery_up") == 1, 10, "etcd listed")
    engine = start_engine(procs)
    start_agent(tmp_path, etcd, engine, "e1", procs)  # returns once the key is written
    registered_at = time.monotonic()
    client = client_of(gateway)

    def answered_by_e1() -> bool:
        try:
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt="hello", max_tokens=2
            )
        except openai.APIError:
            return False
        return raw.headers.get("x-isocost-replica") == "e1"

    wait_until(answered_by_e1, 5, "a completion served by e1")
    routable_s = time.monotonic() - registered_at
    print(f"registered -> routable: {routable_s * 1000:.0f} ms")
    assert routable_s < 1.0
    (row,) = replicas(gateway)
    assert (row["url"], row["pool"], row["gpu"]) == (engine.url, MODEL, "a100-80g")


def test_malformed_registrations_are_skipped_once_and_counted(
    tmp_path: Path, etcd: EtcdServer, procs: list[Proc]
) -> None:
    gateway = start_gateway(tmp_path, etcd, procs)
    engines = [start_engine(procs) for _ in range(2)]
    good = Registration(name="good", url=engines[0].url, models=[MODEL]).encode()
    bad = {
        "not-json": b"{nope",
        "no-url": b'{"name": "no-url", "models": ["m"]}',
        "bad-gpu": Registration(name="bad-gpu", url="http://127.0.0.1:9", models=[MODEL],
                                gpu="abacus-1").encode(),
        "same-url": Registration(name="same-url", url=engines[0].url, models=[MODEL]).encode(),
        # past the file system's name limit: it stopped every later change from applying
        "long-model": Registration(name="long-model", url="http://127.0.0.1:10",
                                   models=["M" * 300_000]).encode(),
        # priced as nearly free, it took all the traffic
        "huge-tp": Registration(name="huge-tp", url="http://127.0.0.1:11", models=[MODEL],
                                tp=2**70).encode(),
    }  # fmt: skip
    later = Registration(name="later", url=engines[1].url, models=[MODEL]).encode()

    async def write() -> None:
        client = EtcdClient([etcd.url])
        await client.put(f"{PREFIX}/replicas/good", good)
        for key, value in bad.items():
            await client.put(f"{PREFIX}/replicas/{key}", value)
        await client.put(f"{PREFIX}/replicas/good", good)  # again: no second log line
        await client.put(f"{PREFIX}/replicas/later", later)  # applied after all of them
        await client.close()

    asyncio.run(write())
    wait_until(lambda: metric(gateway, "isocost_discovery_rejected_total") == 6, 5, "6 refused")
    wait_until(lambda: healthy_names(gateway) == ["good", "later"], 5, "the good ones routable")
    assert metric(gateway, "isocost_discovery_up") == 1
    log = (tmp_path / "gateway.log").read_text()
    skipped = [line for line in log.splitlines() if '"registration_skipped"' in line]
    assert len(skipped) == 6, skipped
    assert any("abacus-1" in line for line in skipped)
    assert any("must be <= 64" in line for line in skipped)
    assert "Traceback" not in log
    assert gateway.popen.poll() is None


def test_a_key_that_is_not_utf8_is_skipped_and_discovery_stays_up(
    tmp_path: Path, etcd: EtcdServer, procs: list[Proc]
) -> None:
    def put_raw(key: bytes, value: bytes) -> None:
        etcd.call(
            "/v3/kv/put",
            {"key": base64.b64encode(key).decode(), "value": base64.b64encode(value).decode()},
        )

    replicas_key = f"{PREFIX}/replicas/".encode()
    record = Registration(name="x", url="http://127.0.0.1:12", models=[MODEL]).encode()
    put_raw(replicas_key + b"listed-\xff", record)  # met by the gateway's first list
    gateway = start_gateway(tmp_path, etcd, procs)
    wait_until(lambda: metric(gateway, "isocost_discovery_rejected_total") == 1, 10, "listed")
    put_raw(replicas_key + b"watched-\xfe\xff", record)  # met by its watch
    fine = Registration(name="fine", url="http://127.0.0.1:13", models=[MODEL]).encode()
    put_raw(replicas_key + b"fine", fine)
    wait_until(lambda: [r["name"] for r in replicas(gateway)] == ["fine"], 5, "fine applied")
    assert metric(gateway, "isocost_discovery_rejected_total") == 2
    assert metric(gateway, "isocost_discovery_up") == 1
    log = (tmp_path / "gateway.log").read_text()
    assert '"discovery_down"' not in log
    skipped = [line for line in log.splitlines() if '"registration_skipped"' in line]
    assert len(skipped) == 2 and all("not UTF-8" in line for line in skipped), skipped


def test_a_duplicate_never_pushes_out_the_replica_that_registered_first(
    tmp_path: Path, etcd: EtcdServer, procs: list[Proc]
) -> None:
    def register(key: str, name: str, port: int) -> None:
        async def put() -> None:
            client = EtcdClient([etcd.url])
            value = Registration(name=name, url=f"http://127.0.0.1:{port}", models=[MODEL])
            await client.put(f"{PREFIX}/replicas/{key}", value.encode())
            await client.close()

        asyncio.run(put())

    def listed() -> list[tuple[str, str]]:
        return sorted((r["name"], r["url"]) for r in replicas(gateway))

    register("z-first", "first", 14)  # listed together, the later key sorting first:
    register("a-second", "second", 14)  # the first registered wins
    gateway = start_gateway(tmp_path, etcd, procs)
    wait_until(lambda: listed() == [("first", "http://127.0.0.1:14")], 10, "first listed")
    register("0-same-url", "dupurl", 14)  # the incumbent keeps its URL
    register("0-same-name", "first", 15)  # and its name
    wait_until(lambda: metric(gateway, "isocost_discovery_rejected_total") == 3, 5, "3 refused")
    assert listed() == [("first", "http://127.0.0.1:14")]


def test_agent_sigkill_under_load_leaves_within_ttl_and_loses_no_unstarted_request(
    tmp_path: Path, etcd: EtcdServer, procs: list[Proc]
) -> None:
    gateway = start_gateway(tmp_path, etcd, procs)
    engines = [start_engine(procs) for _ in range(2)]
    agents = [start_agent(tmp_path, etcd, e, f"r{i}", procs) for i, e in enumerate(engines)]
    wait_until(lambda: healthy_names(gateway) == ["r0", "r1"], 5, "both routable")
    with Load(gateway) as load:
        load.wait_for(20)
        killed_at = time.monotonic()
        for proc in (agents[0], engines[0]):
            proc.popen.send_signal(signal.SIGKILL)
        gone_s = wait_until(
            lambda: [r["name"] for r in replicas(gateway)] == ["r1"], TTL_S + 3, "r0 removed"
        )
        load.wait_for(20)
    print(f"SIGKILL -> removed: {gone_s:.2f} s (TTL {TTL_S} s), {load.count()} requests")
    assert gone_s <= TTL_S + 1, gone_s
    lost = [o for o in load.outcomes if o.error is not None and o.chunks == 0]
    assert not lost, lost[:3]
    after = [o for o in load.outcomes[-10:] if o.error is None]
    assert after and all(o.replica == "r1" for o in after)
    assert time.monotonic() - killed_at < 30


def test_agent_sigterm_under_load_drains_first_and_loses_nothing(
    tmp_path: Path, etcd: EtcdServer, procs: list[Proc]
) -> None:
    gateway = start_gateway(tmp_path, etcd, procs)
    engines = [start_engine(procs) for _ in range(2)]
    agents = [start_agent(tmp_path, etcd, e, f"r{i}", procs) for i, e in enumerate(engines)]
    wait_until(lambda: healthy_names(gateway) == ["r0", "r1"], 5, "both routable")
    with Load(gateway, workers=6) as load:
        load.wait_for(30)
        assert {o.replica for o in load.outcomes} == {"r0", "r1"}
        agents[0].popen.send_signal(signal.SIGTERM)
        assert agents[0].popen.wait(timeout=30) == 0
        busy = [
            line
            for line in get_text(engines[0].url + "/metrics").splitlines()
            if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
        ]
        assert busy and all(float(line.rsplit(" ", 1)[1]) == 0 for line in busy), busy
        engines[0].popen.send_signal(signal.SIGKILL)  # idle: killing it loses nothing
        wait_until(lambda: [r["name"] for r in replicas(gateway)] == ["r1"], 5, "r0 removed")
        load.wait_for(20)
    errors = [o for o in load.outcomes if o.error is not None]
    print(f"SIGTERM under load: {load.count()} requests, {len(errors)} errors")
    assert not errors, errors[:3]


def test_etcd_killed_under_load_then_restarted_resyncs_without_ghosts(
    tmp_path: Path, etcd: EtcdServer, procs: list[Proc]
) -> None:
    gateway = start_gateway(tmp_path, etcd, procs)
    engines = [start_engine(procs) for _ in range(2)]
    agents = [start_agent(tmp_path, etcd, e, f"r{i}", procs) for i, e in enumerate(engines)]
    wait_until(lambda: healthy_names(gateway) == ["r0", "r1"], 5, "both routable")
    with Load(gateway) as load:
        load.wait_for(10)
        etcd.kill()
        wait_until(lambda: metric(gateway, "isocost_discovery_up") == 0, 5, "etcd seen down")
        agents[1].popen.send_signal(signal.SIGKILL)  # its lease must expire after the restart
        outage_ends = time.monotonic() + OUTAGE_S
        served_during = load.count()
        wait_until(lambda: time.monotonic() >= outage_ends, OUTAGE_S + 1, "outage", 0.1)
        assert healthy_names(gateway) == ["r0", "r1"]  # last known membership kept
        assert load.count() > served_during
        etcd.start()
        restarted_at = time.monotonic()
        wait_until(lambda: metric(gateway, "isocost_discovery_up") == 1, 2 * TTL_S, "etcd up")
        resync_s = wait_until(
            lambda: [r["name"] for r in replicas(gateway)] == ["r0"],
            2 * TTL_S + 2,
            "r1's expired lease removed, r0 kept once",
        )
        load.wait_for(10)
    assert time.monotonic() - restarted_at >= resync_s
    assert resync_s <= 2 * TTL_S, resync_s
    errors = [o for o in load.outcomes if o.error is not None]
    print(f"etcd down {OUTAGE_S:g} s: {load.count()} requests, {len(errors)} errors;"
          f" restart -> in step: {resync_s:.2f} s (TTL {TTL_S} s)")  # fmt: skip
    assert not errors, errors[:3]
    assert agents[0].popen.poll() is None  # the surviving agent rode the outage out

    async def keys() -> list[str]:
        client = EtcdClient([etcd.url])
        _, kvs = await client.range_prefix(PREFIX + "/replicas/")
        await client.close()
        return [kv.key for kv in kvs]

    assert asyncio.run(keys()) == [f"{PREFIX}/replicas/r0"]


def test_200_registrations_in_a_second_are_routable_within_5_s(
    tmp_path: Path,
    etcd: EtcdServer,
    procs: list[Proc],
    client_of: Callable[[Proc], openai.OpenAI],
) -> None:
    gateway = start_gateway(tmp_path, etcd, procs, scrape_ms=2000, health_ms=2000)
    popen = subprocess.Popen(
        [ISOCOST, "engine", "--port", "0", "--replicas", "200", "--model", MODEL],
        stdout=subprocess.PIPE,
        text=True,
    )
    procs.append(Proc(popen, ""))
    urls = ready_urls(popen, "isocost engine", count=200, timeout_s=60)

    async def register() -> float:
        client = EtcdClient([etcd.url])
        lease = await client.grant(30)
        started = time.monotonic()
        await asyncio.gather(
            *(
                client.put(
                    f"{PREFIX}/replicas/n{i:03d}",
                    Registration(name=f"n{i:03d}", url=url, models=[MODEL]).encode(),
                    lease,
                )
                for i, url in enumerate(urls)
            )
        )
        took = time.monotonic() - started
        await client.close()
        return took

    registered_in_s = asyncio.run(register())
    done = time.monotonic()
    assert registered_in_s < 1.0
    wait_until(lambda: len(healthy_names(gateway)) == 200, 10, "200 healthy", 0.05)
    all_routable_s = time.monotonic() - done
    print(f"200 registered in {registered_in_s:.2f} s, all routable {all_routable_s:.2f} s later")
    assert all_routable_s < 5.0
    client = client_of(gateway)
    served = {
        client.completions.with_raw_response.create(
            model=MODEL, prompt=f"q{i}", max_tokens=1
        ).headers["x-isocost-replica"]
        for i in range(20)
    }
    assert served <= {f"n{i:03d}" for i in range(200)}


def test_agent_refuses_bad_input_in_one_line() -> None:
    result = subprocess.run(
        [ISOCOST, "agent", "--engine", "ftp://x", "--etcd", "http://127.0.0.1:2379"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "ftp://x" in result.stderr
    result = subprocess.run(
        [ISOCOST, "agent", "--engine", "http://127.0.0.1:1", "--etcd", "http://e:1", "--ttl", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (result.returncode, result.stderr.strip()) == (2, "error: --ttl must be >= 1")


def test_an_agent_that_etcd_refuses_says_so_and_exits_2(
    tmp_path: Path, etcd: EtcdServer, procs: list[Proc]
) -> None:
    etcd.call("/v3/auth/user/add", {"name": "root", "password": "pw"})
    etcd.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
    etcd.call("/v3/auth/enable", {})  # a put without credentials: HTTP 400, every time
    engine = start_engine(procs)
    args = ["agent", "--engine", engine.url, "--etcd", etcd.url, "--prefix", PREFIX]
    result = subprocess.run([ISOCOST, *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "etcd refused" in error and "user name is empty" in error
    assert '"etcd_down"' not in result.stderr  # not an outage to wait out


def test_engine_death_revokes_at_once_and_a_restart_registers_again(
    tmp_path: Path, etcd: EtcdServer, procs: list[Proc]
) -> None:
    gateway = start_gateway(tmp_path, etcd, procs)
    port = free_port()
    engine = start_engine(procs, port=port)
    args = ["agent", "--engine", engine.url, "--etcd", etcd.url, "--name", "e1"]
    args += ["--ttl", "10", "--prefix", PREFIX, "--warmup-prompt", "warm up"]
    with (tmp_path / "agent.log").open("a") as log:
        agent = start_isocost(args, "isocost agent", stderr=log)
    procs.append(agent)
    wait_until(lambda: healthy_names(gateway) == ["e1"], 5, "e1 routable")
    engine.popen.send_signal(signal.SIGKILL)
    gone_s = wait_until(lambda: replicas(gateway) == [], 10, "e1 removed")
    assert gone_s < 10 / 2  # revoked, not left to its 10 s lease
    assert agent.popen.poll() is None
    start_engine(procs, port=port)
    wait_until(lambda: healthy_names(gateway) == ["e1"], 10, "e1 registered again")
    log_text = (tmp_path / "agent.log").read_text()
    assert log_text.count('"event": "registered"') == 2
    assert '"event": "engine_down"' in log_text


def test_a_watching_gateway_stops_on_sigterm_even_as_etcd_dies(
    tmp_path: Path, etcd: EtcdServer, procs: list[Proc]
) -> None:
    gateway = start_gateway(tmp_path, etcd, procs)
    wait_until(lambda: metric(gateway, "isocost_discovery_up") == 1, 10, "etcd listed")
    etcd.kill()  # the watch breaks as the stop begins
    gateway.popen.send_signal(signal.SIGTERM)
    assert gateway.popen.wait(timeout=15) == 0


def test_admin_added_replicas_stay_while_discovered_ones_come_and_go(
    tmp_path: Path, etcd: EtcdServer, procs: list[Proc]
) -> None:
    gateway = start_gateway(tmp_path, etcd, procs)
    engines = [start_engine(procs) for _ in range(2)]
    body = json.dumps({"model": MODEL, "replica": {"url": engines[0].url, "name": "manual"}})
    status, _, answer = http("POST", gateway.url + "/admin/replicas", body.encode(), ADMIN)
    assert status == 201, answer
    key = f"{PREFIX}/replicas/auto"

    async def put(value: bytes | None) -> None:
        client = EtcdClient([etcd.url])
        await (client.delete(key) if value is None else client.put(key, value))
        await client.close()

    asyncio.run(put(Registration(name="auto", url=engines[1].url, models=[MODEL]).encode()))
    wait_for(lambda: healthy_names(gateway) == ["auto", "manual"], 5, "both routable")
    asyncio.run(put(None))
    wait_for(lambda: healthy_names(gateway) == ["manual"], 5, "auto gone, manual kept")


def test_an_agent_waits_out_an_absent_etcd_and_stops_cleanly_without_it(
    tmp_path: Path, procs: list[Proc]
) -> None:
    etcd = EtcdServer(tmp_path / "late-etcd")  # its ports are chosen, nothing listens yet
    engine = start_engine(procs)
    log = tmp_path / "agent.log"
    args = [ISOCOST, "agent", "--engine", engine.url, "--etcd", etcd.url, "--name", "early"]
    with log.open("a") as sink:
        popen = subprocess.Popen(
            [*args, "--ttl", str(TTL_S), "--prefix", PREFIX],
            stdout=subprocess.PIPE,
            stderr=sink,
            text=True,
        )
    procs.append(Proc(popen, ""))
    try:
        wait_for(lambda: '"etcd_down"' in log.read_text(), 10, "the agent to find no etcd")
        etcd.start()
        (url,) = ready_urls(popen, "isocost agent", timeout_s=10)
        assert url == engine.url
        assert log.read_text().count('"etcd_down"') == 1  # logged once, not per retry
        etcd.kill()
        popen.send_signal(signal.SIGTERM)
        assert popen.wait(timeout=15) == 0
    finally:
        etcd.stop()


def test_a_watch_from_a_compacted_revision_says_so(etcd: EtcdServer) -> None:
    async def run() -> tuple[int, int]:
        client = EtcdClient([etcd.url])
        first = await client.put(f"{PREFIX}/replicas/a", b"{}")
        latest = await client.put(f"{PREFIX}/replicas/a", b'{"v": 2}')
        await client.call("/v3/kv/compaction", {"revision": str(latest)})
        try:
            async for _ in client.watch(PREFIX + "/replicas/", first):
                raise AssertionError("events from a compacted revision")
        except Compacted as exc:
            return exc.compact_revision, latest
        finally:
            await client.close()
        raise AssertionError("the watch ended without a compaction error")

    compacted, latest = asyncio.run(run())
    assert compacted == latest  # the provider lists again from there


def test_a_sustained_bad_success_rate_marks_the_replica_draining(
    tmp_path: Path, etcd: EtcdServer, procs: list[Proc]
) -> None:
    gateway = start_gateway(tmp_path, etcd, procs)
    engine = start_engine(procs, "--error-rate", "0.8", "--seed", "3")
    args = ["agent", "--engine", engine.url, "--etcd", etcd.url, "--name", "flaky"]
    args += ["--ttl", str(TTL_S), "--prefix", PREFIX, "--health-window", "1.5"]
    with (tmp_path / "agent.log").open("a") as log:
        procs.append(start_isocost(args, "isocost agent", stderr=log))
    wait_until(lambda: healthy_names(gateway) == ["flaky"], 5, "flaky routable")
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json"}
    statuses: list[int] = []

    def drained() -> bool:  # real requests, straight to the engine, until the agent acts
        statuses.append(http("POST", engine.url + "/v1/completions", body, headers)[0])
        return replicas(gateway)[0]["state"] == "drained"

    took_s = wait_until(drained, 15, "the replica drained by its agent", 0.05)
    assert statuses.count(500) > statuses.count(200)
    assert took_s >= 1.5  # bad for a whole window first, not on the first failures
    assert '"state": "draining"' in (tmp_path / "agent.log").read_text()
