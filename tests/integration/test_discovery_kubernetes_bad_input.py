"""Kubernetes discovery fed junk: by a hostile or broken API server, or a slice nobody
validated. The provider runs in-process (its own event loop in a thread, reporting to a
recording sink) with the official ``kubernetes_asyncio`` client against ``KubeApi`` made
hostile; the last test runs ``isocost serve`` routing to real engines. What must hold:
bad parts are skipped and the rest applied, the provider never dies, no traceback is
logged for expected bad data, discovery is down while the API is unusable and up again
once it answers.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from gateway_harness import wait_for
from isocost_procs import Proc
from kube_api import KubeApi
from test_discovery_kubernetes import (
    MODEL,
    NAMESPACE,
    SERVICE,
    discovery_up,
    healthy,
    port_of,
    start_engine,
    start_gateway,
)

from isocost.runtime.config import KubernetesDiscoveryConfig
from isocost.runtime.discovery import kubernetes
from isocost.runtime.discovery.kubernetes import KubernetesDiscovery, slice_records
from isocost.runtime.discovery.records import Malformed, Registration


class HostileKubeApi(KubeApi):
    """``KubeApi`` that can also answer lists or watches with a failure ``Status``, send
    raw lines at the start of the next watch (then end it), or hang every request."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.list_status: int | None = None
        self.watch_status: int | None = None
        self.watch_lines: list[bytes] = []
        self.hang = False
        self.list_times: list[float] = []

    def put_raw(self, name: str, body: dict[str, Any]) -> None:
        """Store ``body`` as slice ``name`` as it is (listed, and sent to watches)."""
        self._call(self._change(NAMESPACE, name, body))

    async def _collection(self, request: web.Request) -> web.StreamResponse:
        if self.hang:
            await asyncio.Event().wait()  # until the server shuts down
        watching = request.query.get("watch") in ("true", "True", "1")
        if not watching:
            self.list_times.append(time.monotonic())
        status = self.watch_status if watching else self.list_status
        if status is not None:
            (self.watches if watching else self.lists).append(dict(request.query))
            body = {
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": f"refused with {status}", "reason": "Refused", "code": status,
            }  # fmt: skip
            return web.json_response(body, status=status, headers={"X-Junk": "h" * 500})
        if watching and self.watch_lines:
            self.watches.append(dict(request.query))
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            lines, self.watch_lines = self.watch_lines, []
            for line in lines:
                await response.write(line)
            return response
        return await super()._collection(request)


class RecordingSink:
    """What the provider reported: its latest records and each reachability change."""

    def __init__(self) -> None:
        self.records: dict[str, Registration | Malformed] = {}
        self.ups: list[bool] = []

    def replace(self, provider: str, records: Mapping[str, Registration | Malformed]) -> None:
        self.records = dict(records)

    def set_up(self, provider: str, up: bool) -> None:
        self.ups.append(up)

    def registered(self) -> list[str]:
        return sorted(r.url for r in self.records.values() if isinstance(r, Registration))


class Provider:
    """A ``KubernetesDiscovery`` running on its own event loop in a thread."""

    def __init__(self, settings: KubernetesDiscoveryConfig) -> None:
        self.sink = RecordingSink()
        self.provider = KubernetesDiscovery(settings, self.sink)
        self.failure: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        self._task = self._loop.create_task(self.provider.run())
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        except BaseException as exc:  # what the test asserts never happens
            self.failure = exc

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(timeout=10)
        self._loop.close()


@pytest.fixture
def kube() -> Iterator[HostileKubeApi]:
    api = HostileKubeApi()
    api.start()
    yield api
    api.close()


@pytest.fixture
def start(tmp_path: Path, kube: HostileKubeApi) -> Iterator[Any]:
    started: list[Provider] = []
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", "kube-token-bad")

    def run() -> Provider:
        settings = KubernetesDiscoveryConfig(
            namespace=NAMESPACE, service="vllm", port_name="http",
            kubeconfig=str(kubeconfig), max_backoff_ms=300,
        )  # fmt: skip
        started.append(Provider(settings))
        return started[-1]

    yield run
    for provider in started:
        provider.stop()
        assert provider.failure is None, provider.failure


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """The provider's log records; none may carry a traceback."""
    caplog.set_level(logging.INFO, logger="isocost.discovery")
    yield caplog
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []


def good_slice(name: str, address: str, port: int = 8000, **fields: Any) -> dict[str, Any]:
    body = {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {
            "name": name, "namespace": NAMESPACE, "labels": dict(SERVICE),
            "annotations": {"isocost.io/model": MODEL},
        },
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": [address], "conditions": {"ready": True},
             "targetRef": {"kind": "Pod", "name": f"pod-{name}"}},
        ],
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
    }  # fmt: skip
    body.update(fields)
    return body


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# -- slices: whatever they hold refuses only the part that is wrong ----------------------

SETTINGS = KubernetesDiscoveryConfig(namespace=NAMESPACE, service="vllm", port_name="http")
_ENDPOINT = {"addresses": ["10.0.0.1"], "conditions": {"ready": True}}


@pytest.mark.parametrize(
    ("fields", "accepted"),
    [
        ({"metadata": ["not", "a", "map"]}, []),
        ({"metadata": {"name": "s", "annotations": "model=x"}}, []),
        ({"metadata": {"name": None, "namespace": 7}}, []),
        ({"metadata": {"name": "s", "annotations": {"isocost.io/model": {"a": 1}}}}, []),
        ({"ports": "http"}, []),
        ({"ports": [None, 5, {"name": "http", "port": 8000}]}, ["http://10.0.0.1:8000"]),
        ({"ports": [{"name": "http", "port": 0}]}, []),
        ({"ports": [{"name": "http", "port": 70000}]}, []),
        ({"ports": [{"name": "http", "port": "8000/x"}]}, []),
        ({"ports": [{"name": "http", "port": True}]}, []),
        ({"endpoints": {"addresses": ["10.0.0.1"]}}, []),
        ({"endpoints": [None, "x", 5, _ENDPOINT]}, ["http://10.0.0.1:8000"]),
        ({"endpoints": [{"addresses": ["10.0.0.2"], "conditions": "ready"}]}, []),
        ({"endpoints": [{"addresses": ["10.0.0.2"], "conditions": {"ready": "false"}}]}, []),
        ({"endpoints": [{"addresses": "10.0.0.2"}, _ENDPOINT]}, ["http://10.0.0.1:8000"]),
        ({"endpoints": [{"addresses": [5, None, ["x"], "10.0.0.3"]}]}, ["http://10.0.0.3:8000"]),
        ({"endpoints": [{"addresses": ["evil.example.com", "10.0.0.1/x", "a@10.0.0.1"]}]}, []),
        ({"endpoints": [{"addresses": ["a:b:c", "fd00::7"]}]}, ["http://[fd00::7]:8000"]),
        (
            {"endpoints": [{"addresses": ["10.0.0.1"], "targetRef": "pod"}]},
            ["http://10.0.0.1:8000"],
        ),
        ({"endpoints": [_ENDPOINT, _ENDPOINT, _ENDPOINT]}, ["http://10.0.0.1:8000"]),
        (
            {"addressType": "FQDN", "endpoints": [{"addresses": ["vllm-0.ns.svc", "x/y"]}]},
            ["http://vllm-0.ns.svc:8000"],
        ),
    ],
)
def test_junk_in_a_slice_is_a_malformed_record_never_an_error(
    fields: dict[str, Any], accepted: list[str]
) -> None:
    body = {**good_slice("s", "10.0.0.1"), **fields}
    records = slice_records(body, SETTINGS)
    urls = sorted(r.url for r in records.values() if isinstance(r, Registration))
    assert urls == accepted


# -- the API server: lists, watches, failures ---------------------------------------------


def test_slices_the_client_models_refuse_do_not_stop_the_others(
    kube: HostileKubeApi, start: Any, logs: pytest.LogCaptureFixture
) -> None:
    """The client's models refuse a whole list (or a watch) for one slice without
    ``addressType`` or with a port that is no number: discovery stopped for every replica."""
    kube.put_raw("good", good_slice("good", "10.0.0.1"))
    no_type = good_slice("no-type", "10.0.0.2")
    del no_type["addressType"]
    kube.put_raw("no-type", no_type)
    kube.put_raw(
        "bad-port", good_slice("bad-port", "10.0.0.3", ports=[{"name": "http", "port": "x"}])
    )
    provider = start()
    wait_for(
        lambda: provider.sink.registered() == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
        10,
        "the good slices listed",
        state=provider.sink.registered,
    )
    assert isinstance(provider.sink.records[f"{NAMESPACE}/bad-port"], Malformed)
    kube.put_raw("late", good_slice("late", "10.0.0.4", endpoints=[{"addresses": [None]}]))
    kube.put_raw("later", good_slice("later", "10.0.0.5"))
    wait_for(
        lambda: "http://10.0.0.5:8000" in provider.sink.registered(),
        10,
        "a slice watched after the bad ones",
    )
    assert provider.sink.ups == [True] and len(kube.lists) == 1
    assert warnings(logs) == []  # Membership reports each Malformed record, once


@pytest.mark.parametrize(
    "line",
    [
        b"not json {\n",
        b'{"type": "ADDED", "object": {"metadata": {"na',  # the connection cut mid-line
        b"[1, 2]\n",
        b"null\n",
        b'{"type": "ERROR", "object": {"code": 500}}\n',
        b'{"type": "ERROR", "object": "boom"}\n',
        b'{"type": "RESTARTED", "object": {"metadata": {"resourceVersion": "1"}}}\n',
        b'{"type": "MODIFIED", "object": {"metadata": {"resourceVersion": "9"}}}\n',
        b'{"type": "BOOKMARK", "object": {}}\n{"type": 7}\n',
        b'{"type": "ADDED", "object": {"metadata": {"name": "x"}, "junk": "' + b"j" * (5 << 20),
        b'{"type": "ADDED", "object": ' + b"[" * 100_000 + b"\n",
    ],
    ids=[
        "not-json", "cut-off", "array", "null", "error-no-reason", "error-not-status",
        "unknown-type", "no-name", "bookmark-then-junk", "line-over-4mib", "nested-too-deep",
    ],
)  # fmt: skip
def test_a_watch_line_that_cannot_be_applied_lists_again(
    kube: HostileKubeApi, start: Any, logs: pytest.LogCaptureFixture, line: bytes
) -> None:
    """Before: a TypeError, KeyError, bare Exception or LineTooLong out of the watch killed
    the provider (a traceback, and a restart by its supervisor)."""
    kube.put_raw("good", good_slice("good", "10.0.0.1"))
    provider = start()
    wait_for(lambda: len(kube.watches) == 1, 10, "the first watch")
    kube.watch_lines = [line]
    kube.cut_watches()
    wait_for(lambda: len(kube.lists) == 2, 10, "a list after the bad line")
    kube.put_raw("later", good_slice("later", "10.0.0.2"))
    wait_for(
        lambda: provider.sink.registered() == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
        10,
        "a change after the bad line applied",
        state=provider.sink.registered,
    )
    assert provider.sink.ups == [True]  # the API answered throughout
    (warning,) = warnings(logs)
    assert warning == "bad watch event, listing again"


@pytest.mark.parametrize("status", [401, 403, 500])
def test_a_server_that_lists_but_refuses_every_watch_is_down_once(
    kube: HostileKubeApi, start: Any, logs: pytest.LogCaptureFixture, status: int
) -> None:
    """Before: up after each list, down at each watch, a log line each way per retry, the
    backoff starting over at each list (a role allowed ``list`` but not ``watch``)."""
    kube.put_raw("good", good_slice("good", "10.0.0.1"))
    kube.watch_status = status
    provider = start()
    wait_for(lambda: len(kube.lists) >= 5, 10, "lists again and again")
    assert provider.sink.ups == [False]
    assert provider.sink.registered() == ["http://10.0.0.1:8000"]  # from the lists
    assert kube.list_times[4] - kube.list_times[0] >= 0.1 + 0.2 + 0.3  # it backed off
    (warning,) = [r for r in logs.records if r.levelno >= logging.WARNING]
    error: str = warning.__dict__["error"]
    assert error == f"ApiError: HTTP {status}: refused with {status}"  # one line, no headers
    kube.watch_status = None
    wait_for(lambda: provider.sink.ups == [False, True], 10, "up once a watch opens")


@pytest.mark.parametrize("status", [401, 410, 500])
def test_failed_lists_back_off_and_report_down_until_the_server_answers(
    kube: HostileKubeApi, start: Any, logs: pytest.LogCaptureFixture, status: int
) -> None:
    """Before: a list answered 410 was listed again at once, thousands of times a second,
    with discovery reported up."""
    kube.list_status = status
    provider = start()
    wait_for(lambda: len(kube.lists) >= 5, 10, "lists again")
    assert kube.list_times[4] - kube.list_times[0] >= 0.1 + 0.2 + 0.3
    assert provider.sink.ups == [False]
    kube.put_raw("good", good_slice("good", "10.0.0.1"))
    kube.list_status = None
    wait_for(lambda: provider.sink.ups == [False, True], 10, "up once the list answers")
    wait_for(lambda: provider.sink.registered() == ["http://10.0.0.1:8000"], 5, "listed")


def test_a_hung_api_server_is_down_and_followed_again_when_it_answers(
    kube: HostileKubeApi, start: Any, logs: pytest.LogCaptureFixture, monkeypatch: Any
) -> None:
    """Before: no request had a deadline; a server (or a connection) that went silent kept
    the provider waiting forever, reported up, with every later change missed."""
    monkeypatch.setattr(kubernetes, "_LIST_TIMEOUT_S", 0.5)
    monkeypatch.setattr(kubernetes, "_WATCH_TIMEOUT_S", 1)
    monkeypatch.setattr(kubernetes, "_WATCH_GRACE_S", 0.5)
    kube.put_raw("good", good_slice("good", "10.0.0.1"))
    provider = start()
    wait_for(lambda: provider.sink.ups == [True], 10, "following")
    kube.hang = True
    kube.cut_watches()
    wait_for(lambda: provider.sink.ups == [True, False], 10, "the hung server seen down")
    kube.put_raw("later", good_slice("later", "10.0.0.2"))
    kube.hang = False
    wait_for(
        lambda: provider.sink.registered() == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
        10,
        "the change made while it hung",
    )
    wait_for(lambda: provider.sink.ups == [True, False, True], 10, "up once a watch opens")


def test_thousands_of_endpoints_register(kube: HostileKubeApi, start: Any) -> None:
    addresses = [f"10.1.{i // 250}.{i % 250 + 1}" for i in range(5000)]
    for n in range(5):  # a Service of 5000 pods: five slices of 1000
        body = good_slice(f"big-{n}", "10.0.0.1")
        body["endpoints"] = [
            {"addresses": [a], "conditions": {"ready": True}}
            for a in addresses[n * 1000 : (n + 1) * 1000]
        ]
        kube.put_raw(f"big-{n}", body)
    provider = start()
    wait_for(lambda: len(provider.sink.registered()) == 5000, 20, "every endpoint")


# -- through the gateway ------------------------------------------------------------------


def test_the_gateway_routes_the_good_slices_whatever_else_the_api_sends(
    tmp_path: Path, kube: HostileKubeApi, procs: list[Proc]
) -> None:
    engine = start_engine(procs)
    kube.put_raw("a", good_slice("a", "127.0.0.1", port_of(engine)))
    no_type = good_slice("junk", "127.0.0.2", endpoints=[None, {"addresses": [5]}])
    del no_type["addressType"]
    kube.put_raw("junk", no_type)
    gateway = start_gateway(tmp_path, kube, procs)
    wait_for(lambda: healthy(gateway) == ["pod-a"], 10, "pod-a routable beside the junk")
    kube.watch_lines = [b"not json\n"]
    kube.cut_watches()
    wait_for(lambda: len(kube.lists) >= 2, 10, "a list after the junk line")
    assert healthy(gateway) == ["pod-a"] and discovery_up(gateway) == 1
    log = (tmp_path / "gateway.log").read_text()
    assert "Traceback" not in log and '"task_failed"' not in log
    assert '"discovery_bad_event"' in log and '"registration_skipped"' in log
