"""Config hot reload and the admin API: a reload is all or nothing, a bad file never stops
the watcher, and no reload switches the gateway off.

Real processes: fake upstreams (``fake_upstream``) as replicas, one ``isocost serve`` per
test watching a config file in ``tmp_path``. Every rejected file must leave the running
config in place, be logged in one line naming the file and counted as
``isocost_config_reloads_total{result="rejected"}``; the next valid edit must be applied.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cluster import ADMIN, ADMIN_TOKEN, API_KEY, AUTH, MODEL, replica_rows
from fake_upstream import DEFAULT_MODE, set_mode, start_fake_upstream
from gateway_harness import http, log_events, wait_for
from isocost_procs import Proc, start_isocost

FAST_HEALTH = "  interval_ms: 100\n  timeout_ms: 500\n  open_ms: 300\n"
AUTH_SECTION = (
    f"auth:\n  admin_token: {ADMIN_TOKEN}\n  api_keys:\n    - {{name: team-a, key: {API_KEY}}}\n"
)
STALL_S = 4.0  # a stalled stream holds its replica this long (reloads land within 1 s)


def entry(url: str, name: str, extra: str = "") -> str:
    """One replica line; the cost model is the pool's (a catalog model)."""
    return f"{{url: '{url}', name: {name}{', ' + extra if extra else ''}}}"


def config_text(
    entries: list[str],
    *,
    policy: str = "round_robin",
    health: str = FAST_HEALTH,
    auth: str = AUTH_SECTION,
    top: str = "",
) -> str:
    replicas = "".join(f"      - {e}\n" for e in entries)
    pools = f"pools:\n  - model: {MODEL}\n    replicas:\n{replicas}" if entries else ""
    return (
        f"policy: {policy}\nscrape_interval_ms: 100\n{top}{pools}"
        f"limits:\n  idle_timeout_ms: 20000\nhealth:\n{health}{auth}"
    )


@dataclass
class Gateway:
    proc: Proc
    config: Path
    log: Path

    @property
    def url(self) -> str:
        return self.proc.url

    def write(self, text: str) -> None:
        self.config.write_text(text)

    def reloads(self, result: str) -> int:
        """``isocost_config_reloads_total{result=...}`` as ``/metrics`` shows it now."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        found = re.search(
            rf'^isocost_config_reloads_total{{result="{result}"}} (\S+)$', text, re.MULTILINE
        )
        return int(float(found.group(1))) if found else 0

    def log_events(self, event: str) -> list[dict[str, Any]]:
        return log_events(self.log, event)

    def rows(self) -> dict[str, dict[str, Any]]:
        return replica_rows(self.proc)

    def names(self) -> dict[str, str]:
        return {url: row["name"] for url, row in self.rows().items()}


@pytest.fixture(scope="module")
def upstreams() -> Iterator[list[str]]:
    procs: list[Proc] = []
    try:
        procs = [start_fake_upstream() for _ in range(3)]
        yield [p.url for p in procs]
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(autouse=True)
def fresh_modes(upstreams: list[str]) -> None:
    for url in upstreams:
        set_mode(url, **DEFAULT_MODE)


@pytest.fixture
def start_gateway(tmp_path: Path) -> Iterator[Callable[[str], Gateway]]:
    started: list[Gateway] = []

    def start(text: str) -> Gateway:
        config, log = tmp_path / "gateway.yaml", tmp_path / "gateway.log"
        config.write_text(text)
        with log.open("a") as sink:
            proc = start_isocost(["serve", "--config", str(config), "--port", "0"], stderr=sink)
        gateway = Gateway(proc, config, log)
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        gateway.proc.stop()


def completion(
    gateway: Gateway, *, stream: bool = False, headers: dict[str, str] | None = None
) -> int:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": stream})
    return http("POST", gateway.url + "/v1/completions", body.encode(), headers or AUTH)[0]


def assert_still_running(gateway: Gateway, urls: list[str]) -> None:
    """The gateway serves the config it had: its replicas, its model, admin and key auth."""
    assert set(gateway.rows()) == set(urls)
    _, _, models = http("GET", gateway.url + "/v1/models", headers=AUTH)
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert completion(gateway, headers={"Content-Type": "application/json"}) == 401
    assert completion(gateway) == 200


def wait_rejected(gateway: Gateway, count: int = 1) -> dict[str, Any]:
    """Wait for the ``count``-th rejection; its log line."""
    wait_for(
        lambda: gateway.reloads("rejected") >= count,
        what=f"{count} rejected reload(s)",
        state=lambda: gateway.log.read_text()[-2000:],
    )
    lines = gateway.log_events("reload_failed")
    assert len(lines) == count, lines
    assert lines[-1]["file"] == str(gateway.config) and lines[-1]["error"]
    return lines[-1]


# -- a bad file is rejected whole; the watcher lives on ------------------------------------


BAD_FILES: dict[str, Callable[[list[str]], str]] = {
    "duplicate-name": lambda u: config_text([entry(u[0], "a"), entry(u[1], "a")]),
    "unknown-key": lambda u: config_text([entry(u[0], "a"), entry(u[1], "b", "gpuu: h100")]),
    "unknown-policy": lambda u: config_text([entry(u[0], "a")], policy="fastest"),
    "unknown-gpu": lambda u: config_text([entry(u[0], "a"), entry(u[1], "b", "gpu: a101")]),
    "unset-key-env": lambda u: config_text(
        [entry(u[0], "a", "api_key_env: ISOCOST_RELOAD_UNSET_VAR")]
    ),
    "yaml-syntax": lambda u: "pools: [{model: " + MODEL + ", replicas: [{{{\n",
    "empty": lambda u: "",
    "comment-only": lambda u: "# everything commented out\n# pools: []\n",
    "no-pools": lambda u: config_text([]),
    "no-replicas": lambda u: f"pools:\n  - model: {MODEL}\n{AUTH_SECTION}",
    "no-admin-token": lambda u: config_text(
        [entry(u[0], "a"), entry(u[1], "b")],
        auth=f"auth:\n  api_keys:\n    - {{name: team-a, key: {API_KEY}}}\n",
    ),
    "no-api-keys": lambda u: config_text(
        [entry(u[0], "a"), entry(u[1], "b")], auth=f"auth:\n  admin_token: {ADMIN_TOKEN}\n"
    ),
}


@pytest.mark.parametrize("bad", list(BAD_FILES))
def test_a_rejected_reload_keeps_the_running_config(
    bad: str, upstreams: list[str], start_gateway: Callable[[str], Gateway]
) -> None:
    first, second, third = upstreams
    gateway = start_gateway(config_text([entry(first, "a"), entry(second, "b")]))
    gateway.write(BAD_FILES[bad](upstreams))
    wait_rejected(gateway)
    assert_still_running(gateway, [first, second])
    # the watcher lives on: the next valid edit is applied
    gateway.write(config_text([entry(first, "a"), entry(second, "b"), entry(third, "c")]))
    wait_for(lambda: set(gateway.rows()) == {first, second, third}, what="the valid edit")
    assert gateway.reloads("ok") == 1 and gateway.reloads("rejected") == 1


def test_a_deleted_file_is_rejected_and_its_restoration_applied(
    upstreams: list[str], start_gateway: Callable[[str], Gateway]
) -> None:
    first, second, third = upstreams
    gateway = start_gateway(config_text([entry(first, "a"), entry(second, "b")]))
    gateway.config.unlink()
    assert "no such file" in wait_rejected(gateway)["error"]
    assert_still_running(gateway, [first, second])
    gateway.write(config_text([entry(first, "a"), entry(third, "c")]))
    wait_for(lambda: set(gateway.rows()) == {first, third}, what="the restored file")


# -- files that pass the checks but used to fail half-way through applying ------------------


def stream_in_background(gateway: Gateway) -> threading.Thread:
    """One streamed completion, read to its end in a thread (the stream is not JSON; a
    stalled upstream's empty stream may end in a 502, which is not what is tested)."""

    def run() -> None:
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True})
        request = urllib.request.Request(
            gateway.url + "/v1/completions", data=body.encode(), headers=AUTH, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            exc.read()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def wait_in_flight(gateway: Gateway, url: str, count: int) -> None:
    wait_for(
        lambda: url in gateway.rows() and gateway.rows()[url]["in_flight"] == count,
        what=f"{count} request(s) in flight on {url}",
        state=gateway.rows,
    )


def test_a_name_given_up_by_a_draining_replica_is_taken_whole(
    upstreams: list[str], start_gateway: Callable[[str], Gateway]
) -> None:
    """``a`` leaves while a stream runs there, and the same file gives its name to a new
    replica: applied whole (the draining one leaves at once), and the watcher lives on."""
    first, second, third = upstreams
    gateway = start_gateway(config_text([entry(first, "a"), entry(second, "b")]))
    assert http("POST", gateway.url + "/admin/replicas/b/drain", headers=ADMIN)[0] == 200
    set_mode(first, completion="stall", stall_s=STALL_S)
    stream = stream_in_background(gateway)
    try:
        wait_in_flight(gateway, first, 1)
        gateway.write(config_text([entry(third, "a"), entry(second, "b")]))
        wait_for(lambda: gateway.reloads("ok") + gateway.reloads("rejected") == 1, what="a reload")
        assert gateway.reloads("ok") == 1
        assert gateway.names() == {third: "a", second: "b"}
        gateway.write(config_text([entry(third, "a"), entry(second, "b", "weight: 2.0")]))
        wait_for(lambda: gateway.rows()[second]["weight"] == 2.0, what="the next edit")
    finally:
        stream.join()


def test_profiles_dropped_under_an_admin_switched_policy_apply_whole(
    upstreams: list[str], start_gateway: Callable[[str], Gateway]
) -> None:
    """The admin API switched the pool to a profile of the file; the next file drops the
    profile (and so names the pool's policy anew): applied whole, the watcher lives on."""
    first, second, third = upstreams
    profile = (
        "scheduling:\n  policies:\n    - name: mine\n"
        "      scorers: [{plugin: equal-cost-scorer, weight: 1.0}]\n"
    )
    gateway = start_gateway(config_text([entry(first, "a")], top=profile))
    answer = http(
        "POST", gateway.url + "/admin/policy", json.dumps({"policy": "mine"}).encode(), ADMIN
    )
    assert answer[0] == 200, answer
    gateway.write(config_text([entry(first, "a"), entry(second, "b")]))
    wait_for(lambda: set(gateway.rows()) == {first, second}, what="the file applied")
    _, _, snap = http("GET", gateway.url + "/admin/snapshot", headers=ADMIN)
    assert snap["pools"][0]["policy"] == "round_robin"
    gateway.write(config_text([entry(first, "a"), entry(second, "b"), entry(third, "c")]))
    wait_for(lambda: set(gateway.rows()) == {first, second, third}, what="the next edit")


def _shadowed(text: str, shadow: str) -> str:
    """``text`` with the pool's ``shadow`` set to ``shadow``."""
    return text.replace(f"  - model: {MODEL}\n", f"  - model: {MODEL}\n    shadow: {shadow}\n")


def test_reloads_add_change_and_drop_a_pools_shadow_candidates(
    upstreams: list[str], start_gateway: Callable[[str], Gateway]
) -> None:
    """Candidates come, change and go with the file; a bad ``shadow`` (the running policy
    as a candidate) is rejected whole, the candidates running kept."""
    first = upstreams[0]
    plain = config_text([entry(first, "a")])
    gateway = start_gateway(plain)

    def candidates() -> dict[str, int]:
        _, _, snap = http("GET", gateway.url + "/admin/snapshot", headers=ADMIN)
        found = snap["shadow"].get(MODEL)
        return {} if found is None else {c["policy"]: c["decisions"] for c in found["candidates"]}

    assert candidates() == {}
    gateway.write(_shadowed(plain, "{policies: [least_request], interval_s: 3600}"))
    wait_for(lambda: candidates() == {"least_request": 0}, what="the candidate added")
    assert completion(gateway) == 200
    assert candidates() == {"least_request": 1}
    gateway.write(_shadowed(plain, "{policies: [least_request, round_robin]}"))
    wait_rejected(gateway)  # round_robin is the pool's running policy
    assert candidates() == {"least_request": 1}
    gateway.write(_shadowed(plain, "{policies: [least_request, random], interval_s: 3600}"))
    wait_for(lambda: set(candidates()) == {"least_request", "random"}, what="one more")
    assert completion(gateway) == 200
    assert candidates() == {"least_request": 2, "random": 1}  # counted on
    gateway.write(plain + "\n")
    wait_for(lambda: candidates() == {}, what="the candidates dropped")
    assert completion(gateway) == 200


# -- edits reach the replicas that are already there --------------------------------------


@pytest.mark.parametrize(
    ("before", "after"),
    [
        # a failing /health never reaches a threshold of 1000, then reaches one of 2
        (
            FAST_HEALTH + "  failure_threshold: 1000\n  min_success_rate: 0.0\n",
            FAST_HEALTH + "  failure_threshold: 2\n",
        ),
        # probed once at start, then every 100 ms
        ("  interval_ms: 600000\n  timeout_ms: 500\n  open_ms: 300\n", FAST_HEALTH),
    ],
    ids=["failure-threshold", "probe-interval"],
)
def test_reloaded_health_settings_reach_existing_replicas(
    before: str, after: str, upstreams: list[str], start_gateway: Callable[[str], Gateway]
) -> None:
    first, second, _ = upstreams
    entries = [entry(first, "a"), entry(second, "b")]
    gateway = start_gateway(config_text(entries, health=before))
    set_mode(first, health=500)
    if "failure_threshold: 1000" in before:  # probes do fail, and the breaker holds
        wait_for(lambda: gateway.rows()[first]["last_error"] == "probe status 500", what="probes")
    assert gateway.rows()[first]["state"] == "healthy"
    gateway.write(config_text(entries, health=after))
    wait_for(lambda: gateway.reloads("ok") == 1, what="the reload")
    wait_for(
        lambda: gateway.rows()[first]["state"] == "ejected",
        what="the failing replica ejected under the new settings",
        state=gateway.rows,
    )
    assert gateway.rows()[second]["state"] == "healthy"


@pytest.mark.parametrize(
    "edit",
    ["weight: 2.0", "usd_per_hour: 0.5", "groups: [fast]"],
    ids=["weight", "price", "groups"],
)
def test_an_edited_replica_keeps_its_in_flight_requests(
    edit: str, upstreams: list[str], start_gateway: Callable[[str], Gateway]
) -> None:
    first = upstreams[0]
    gateway = start_gateway(config_text([entry(first, "a")]))
    set_mode(first, completion="stall", stall_s=STALL_S)
    stream = stream_in_background(gateway)
    try:
        wait_in_flight(gateway, first, 1)
        gateway.write(config_text([entry(first, "a", edit)]))
        wait_for(lambda: gateway.reloads("ok") == 1, what="the edit")
        row = gateway.rows()[first]
        assert row["in_flight"] == 1, row
        key, value = edit.split(": ")
        if key != "groups":
            assert row[key] == float(value)
    finally:
        set_mode(first, completion="ok")  # its retries (an empty stream fails) end at once
        stream.join()
    wait_in_flight(gateway, first, 0)  # released once, on the replica it was counted on


def test_a_renamed_replica_keeps_its_in_flight_requests(
    upstreams: list[str], start_gateway: Callable[[str], Gateway]
) -> None:
    first = upstreams[0]
    gateway = start_gateway(config_text([entry(first, "a")]))
    set_mode(first, completion="stall", stall_s=STALL_S)
    stream = stream_in_background(gateway)
    try:
        wait_in_flight(gateway, first, 1)
        gateway.write(config_text([entry(first, "renamed")]))
        wait_for(lambda: gateway.names() == {first: "renamed"}, what="the rename")
        assert gateway.rows()[first]["in_flight"] == 1
    finally:
        set_mode(first, completion="ok")  # its retries (an empty stream fails) end at once
        stream.join()
    wait_in_flight(gateway, first, 0)
    # the empty stream counted against it: wait it out
    wait_for(lambda: gateway.rows()[first]["state"] == "healthy", what="the replica back")
    status, headers, _ = http(
        "POST",
        gateway.url + "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode(),
        AUTH,
    )
    assert status == 200 and headers["x-isocost-replica"] == "renamed"


# -- the admin API's add goes through the file's checks -----------------------------------


BAD_ADDS: dict[str, tuple[dict[str, Any], str]] = {
    "unset-key-env": ({"api_key_env": "ISOCOST_RELOAD_UNSET_VAR"}, "replica.api_key_env"),
    "negative-price": ({"usd_per_hour": -1.0}, "replica.usd_per_hour"),
    "bad-url": ({"url": "ftp://127.0.0.1:1"}, "replica.url"),
    "url-with-path": ({"url": "http://127.0.0.1:1/v1"}, "replica.url"),
    "unknown-gpu": ({"gpu": "a101"}, "replica.gpu"),
    "unknown-cost-model": ({"cost_model": "no-such-model"}, "replica.cost_model"),
    "zero-tp": ({"tp": 0}, "replica.tp"),
    "zero-weight": ({"weight": 0}, "replica.weight"),
    "negative-max-queue": ({"max_queue": -1}, "replica.max_queue"),
    "taken-name": ({"name": "a"}, "replica.name"),
    "taken-url": ({"url": "FIRST"}, "replica.url"),
}


@pytest.fixture(scope="module")
def admin_gateway(
    upstreams: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    path = tmp_path_factory.mktemp("admin")
    config, log = path / "gateway.yaml", path / "gateway.log"
    config.write_text(config_text([entry(upstreams[0], "a")]))
    with log.open("a") as sink:
        proc = start_isocost(["serve", "--config", str(config), "--port", "0"], stderr=sink)
    try:
        yield Gateway(proc, config, log)
    finally:
        proc.stop()


@pytest.mark.parametrize("bad", list(BAD_ADDS))
def test_admin_add_gets_the_config_files_checks(
    bad: str, upstreams: list[str], admin_gateway: Gateway
) -> None:
    fields, param = BAD_ADDS[bad]
    replica = {"url": upstreams[1], "name": "new", "cost_model": MODEL, **fields}
    if replica["url"] == "FIRST":
        replica["url"] = upstreams[0]
    for model in ("other-model", MODEL):  # a new pool, and the existing one
        body = json.dumps({"model": model, "replica": replica}).encode()
        status, _, answer = http("POST", admin_gateway.url + "/admin/replicas", body, ADMIN)
        assert status == 400, answer
        assert set(answer["error"]) == {"message", "type", "param", "code"}
        assert answer["error"]["param"] == param, answer
        assert answer["error"]["code"] == "invalid_replica"
        _, _, models = http("GET", admin_gateway.url + "/v1/models", headers=AUTH)
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert set(admin_gateway.rows()) == {upstreams[0]}
