"""Actuators: what starts and stops replicas. They only apply decisions (DESIGN §7).

* ``LocalActuator``: one ``isocost engine`` process per replica on a free 127.0.0.1 port,
  added to the gateway once it answers, stopped (process group) after the gateway
  drained it; on close, removed from the gateway before it is stopped.
  ``runtime.processes.Services`` owns the processes. Each engine's pid (and the
  autoscaler's) is kept in ``<log-dir>/<name>.pid``: engines run in sessions of their own
  and outlive an autoscaler that was SIGKILLed, and the next one started with the same
  ``--log-dir`` inherits them (``inherited``) and can stop them, instead of leaving them
  running unseen; an autoscaler still running keeps its own.
* ``CommandActuator``: ``--scale-command`` run with the desired count of the GPU type as
  its last argument and in ``ISOCOST_DESIRED_REPLICAS`` (``ISOCOST_GPU`` names the type;
  on a stop, ``ISOCOST_STOP_REPLICA`` the drained, idle replica to stop, by its gateway
  name, so that a platform that can stop one machine, as a cloud's instance groups can,
  stops that one and not one serving streams); the platform starts and stops replicas
  and they join the gateway through discovery.
* ``KubernetesActuator``: patches the ``scale`` subresource of one Deployment per GPU type
  (``<deployment>`` or ``<deployment>-<gpu>`` with several) to the desired count. Before a
  drain it marks the victim's Pod (the one of the Deployment's Pods whose IP is the
  replica URL's host) with the lowest ``controller.kubernetes.io/pod-deletion-cost`` and
  takes that mark off the Pods whose replicas the gateway shows serving again (an earlier
  victim undrained since; one drained keeps it, another scale-in's), so that the
  ReplicaSet controller deletes the drained, idle Pod rather than one serving streams
  when the count is lowered. The mark outlives the autoscaler: a successor finds a
  drained replica whose Pod carries it to be an earlier autoscaler's drain to finish
  (``inherited``), where one without it may be an operator's. A Pod it cannot find (a
  replica not named by its Pod IP, a gateway it cannot read) is one warning and the
  count is lowered as before.

A failure is an ``ActuatorError``; the loop retries it with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shlex
import signal
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from isocost.autoscale._admin import FleetGateway, GatewayError, ReplicaRow, read_snapshot
from isocost.core.errors import IsocostError
from isocost.runtime.processes import Service, ServiceError, Services, free_port

__all__ = [
    "Actuator",
    "ActuatorError",
    "CommandActuator",
    "KubernetesActuator",
    "LocalActuator",
]

log = logging.getLogger("isocost.autoscale")

_HOST = "127.0.0.1"
_CLOSE_POLL_S = 0.25
_OUTPUT_TAIL = 4096  # bytes of a scale command's output kept for its error message
_STOP_VARIABLE = "ISOCOST_STOP_REPLICA"  # a scale command's victim, on a stop
_PID_SUFFIX = ".pid"  # <log-dir>/<engine>.pid: the engines a LocalActuator started
# The ReplicaSet controller deletes the Pods of lowest cost first when a count drops.
_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
_LOWEST_COST = str(-(2**31))  # an int32, as the annotation must be
_STOPPING_STATES = frozenset({"drained", "removing"})  # a gateway replica on its way out


class ActuatorError(IsocostError):
    """The actuator could not apply a change (a command failed, an API refused)."""


class Actuator(Protocol):
    async def start(self, gpu: str, desired: int) -> None:
        """Start one more replica of ``gpu`` (``desired`` of them in all, once started)."""
        ...

    async def draining(self, name: str, gpu: str) -> None:
        """``name`` is about to be drained to be stopped: where the actuator can, leave a
        record of it that a successor finds (``inherited``) if this autoscaler dies."""
        ...

    async def stop(self, name: str, gpu: str, desired: int) -> None:
        """Stop the drained, idle replica ``name`` (``desired`` of ``gpu`` remain)."""
        ...

    async def inherited(self, rows: Sequence[ReplicaRow]) -> set[str]:
        """Replicas an earlier autoscaler started or drained through this actuator that
        still run and that ``stop`` can stop: a drained one is that autoscaler's drain to
        finish. ``rows``: the gateway's replicas now."""
        ...

    async def close(self) -> None: ...


class LocalActuator:
    def __init__(
        self,
        admin: FleetGateway,
        model: str,
        log_dir: Path,
        engine_args: list[str],
        ready_timeout_s: float = 120.0,
        close_wait_s: float = 30.0,
    ) -> None:
        self.admin = admin
        self.model = model
        self.engine_args = engine_args
        self.ready_timeout_s = ready_timeout_s
        self.close_wait_s = close_wait_s
        self.services = Services(log_dir, grace_s=10.0)
        self.running: dict[str, Service] = {}

    async def start(self, gpu: str, desired: int) -> None:
        port = free_port(_HOST)
        name = f"autoscale-{gpu}-{port}"
        args = ["engine", "--host", _HOST, "--port", str(port), "--model", self.model]
        try:
            service = self.services.start(name, [*args, "--gpu", gpu, *self.engine_args])
        except (ServiceError, OSError) as exc:  # no isocost command, a log dir not writable
            raise ActuatorError(f"engine {name} could not be run: {exc}") from None
        try:
            self._pid_file(name).write_text(f"{service.popen.pid} {os.getpid()}\n")
            (url,) = await asyncio.to_thread(service.wait_ready, 1, self.ready_timeout_s)
            await self.admin.add(self.model, {"url": url, "name": name, "gpu": gpu})
        except (ServiceError, IsocostError, OSError) as exc:
            self._stop_started(service)
            raise ActuatorError(f"engine {name} did not start: {exc}") from None
        except asyncio.CancelledError:
            self._stop_started(service)
            raise
        self.running[name] = service

    async def draining(self, name: str, gpu: str) -> None:
        """Nothing to record: the pid files already name the engines it started."""

    async def stop(self, name: str, gpu: str, desired: int) -> None:
        service = self.running.pop(name, None)
        if service is not None:
            await asyncio.to_thread(self._stop_started, service)
        elif (pid := self._inherited_pid(name)) is not None:
            await self._stop_inherited(name, pid)

    async def inherited(self, rows: Sequence[ReplicaRow]) -> set[str]:
        names = {path.name.removesuffix(_PID_SUFFIX) for path in self._pid_files()}
        return {n for n in names - self.running.keys() if self._inherited_pid(n) is not None}

    def _pid_files(self) -> list[Path]:
        try:
            return list(self.services.log_dir.glob(f"*{_PID_SUFFIX}"))
        except OSError:
            return []

    def _pid_file(self, name: str) -> Path:
        return self.services.log_dir / f"{name}{_PID_SUFFIX}"

    def _stop_started(self, service: Service) -> None:
        self.services.stop(service)
        self._pid_file(service.name).unlink(missing_ok=True)

    def _inherited_pid(self, name: str) -> int | None:
        """The pid of an engine a predecessor started as ``name``, if it still runs as that
        engine (a pid reused by another process is not it: its file is stale) and the
        autoscaler that started it is gone (one still running, sharing ``--log-dir`` by
        mistake, keeps its own)."""
        try:
            pid, owner = map(int, self._pid_file(name).read_text().split())
        except (OSError, ValueError):
            return None
        port = name.rsplit("-", 1)[-1].encode()
        args = _command_line(pid)
        ours = b"engine" in args and any(
            flag == b"--port" and value == port for flag, value in itertools.pairwise(args)
        )
        return pid if ours and b"autoscale" not in _command_line(owner) else None

    async def _stop_inherited(self, name: str, pid: int) -> None:
        """SIGTERM the engine's process group (its session: started with one of its own),
        SIGKILL after the grace; it is not this process's child, so it is polled, not
        waited for."""
        for sig, wait_s in ((signal.SIGTERM, self.services.grace_s), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)
            deadline = time.monotonic() + wait_s
            while self._inherited_pid(name) == pid and time.monotonic() < deadline:
                await asyncio.sleep(_CLOSE_POLL_S)
            if self._inherited_pid(name) != pid:
                break
        else:
            raise ActuatorError(f"engine {name} (pid {pid}) still runs after SIGKILL")
        log.info(
            "engine started by an earlier autoscaler stopped",
            extra={"event": "autoscale_inherited_stop", "replica": name, "pid": pid},
        )
        self._pid_file(name).unlink(missing_ok=True)

    async def close(self) -> None:
        """Take the engines it started out of the gateway before stopping them: removed,
        they get no new work and leave once idle (waited up to ``close_wait_s``), so none
        stays listed there, dead, and no answer in flight is cut short."""
        names = set(self.running)
        for name in sorted(names):
            try:
                await self.admin.remove(name)
            except GatewayError as exc:
                log.warning(
                    "engine not removed from the gateway",
                    extra={"event": "autoscale_failure", "action": "remove", "error": str(exc)},
                )
        deadline = time.monotonic() + self.close_wait_s
        while names and time.monotonic() < deadline:
            try:
                names &= {row.name for row in read_snapshot(await self.admin.snapshot()).replicas}
            except GatewayError:
                break  # nothing to wait on: stopped now
            if names:
                await asyncio.sleep(_CLOSE_POLL_S)
        await asyncio.to_thread(self.services.stop_all)
        for name in self.running:
            self._pid_file(name).unlink(missing_ok=True)


def _command_line(pid: int) -> list[bytes]:
    """A running process's arguments (none: no such process, or a zombie)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


class CommandActuator:
    """Each run is a process group of its own: one that outlives ``timeout_s`` is killed
    with whatever it started (a child left holding its output would otherwise keep the
    run waiting for good), and only the tail of its output is kept (a chatty command must
    not fill the autoscaler's memory)."""

    def __init__(self, command: str, timeout_s: float = 120.0) -> None:
        try:
            self.argv = shlex.split(command)
        except ValueError as exc:
            raise ActuatorError(f"--scale-command: {exc}") from None
        if not self.argv:
            raise ActuatorError("--scale-command is empty")
        self.timeout_s = timeout_s

    async def _run(self, gpu: str, desired: int, stopping: str | None = None) -> None:
        env = {**os.environ, "ISOCOST_DESIRED_REPLICAS": str(desired), "ISOCOST_GPU": gpu}
        env.pop(_STOP_VARIABLE, None)  # one of the caller's own would name a wrong victim
        if stopping is not None:
            env[_STOP_VARIABLE] = stopping
        try:
            process = await asyncio.create_subprocess_exec(
                *self.argv,
                str(desired),
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            raise ActuatorError(f"cannot run {self.argv[0]}: {exc.strerror}") from None
        try:
            output = await asyncio.wait_for(_output_tail(process), self.timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise ActuatorError(
                f"{self.argv[0]} {desired}: no exit in {self.timeout_s:g} s"
            ) from None
        if process.returncode != 0:
            tail = " ".join(output.decode(errors="replace").split())[-200:]
            raise ActuatorError(f"{self.argv[0]} {desired} exited {process.returncode}: {tail}")

    async def start(self, gpu: str, desired: int) -> None:
        await self._run(gpu, desired)

    async def draining(self, name: str, gpu: str) -> None:
        """Nothing to record: the platform picks which replica a lower count stops."""

    async def stop(self, name: str, gpu: str, desired: int) -> None:
        await self._run(gpu, desired, stopping=name)

    async def inherited(self, rows: Sequence[ReplicaRow]) -> set[str]:
        """None: the platform picks which replica a lower count stops."""
        return set()

    async def close(self) -> None:
        """Nothing to release: each run is its own process."""


def _serving_hosts(rows: Sequence[ReplicaRow]) -> set[str]:
    """The hosts whose replicas in the gateway all serve (none drained or leaving): a Pod
    still marked there was undrained since; one drained may be another scale-in's."""
    serving: set[str] = set()
    leaving: set[str] = set()
    for row in rows:
        if (host := urlsplit(row.url).hostname) is not None:
            (leaving if row.state in _STOPPING_STATES else serving).add(host)
    return serving - leaving


def _pod_ip(pod: Any) -> str | None:
    return None if pod.status is None else pod.status.pod_ip


def _is_marked(pod: Any) -> bool:
    """Whether the Pod carries the autoscaler's mark (an operator's costs are left alone)."""
    return (pod.metadata.annotations or {}).get(_DELETION_COST) == _LOWEST_COST


async def _output_tail(process: asyncio.subprocess.Process) -> bytes:
    """The last ``_OUTPUT_TAIL`` bytes of ``process``'s output, once it ended and closed it."""
    assert process.stdout is not None
    tail = b""
    while chunk := await process.stdout.read(1 << 16):
        tail = (tail + chunk)[-_OUTPUT_TAIL:]
    await process.wait()
    return tail


class KubernetesActuator:
    def __init__(
        self,
        admin: FleetGateway,
        deployments: dict[str, str],
        namespace: str,
        kubeconfig: str | None = None,
    ) -> None:
        self.admin = admin  # where a replica's URL, so its Pod's IP, is read
        self.deployments = deployments  # GPU type -> Deployment name
        self.namespace = namespace
        self.kubeconfig = kubeconfig
        self._api: client.ApiClient | None = None
        self._victims_marked: set[str] = set()  # their Pods marked as their drains began
        self._inheritance_read = False  # ``inherited`` answered once

    async def _client(self) -> client.ApiClient:
        if self._api is None:
            configuration = client.Configuration()
            if self.kubeconfig is None:
                config.load_incluster_config(  # type: ignore[no-untyped-call]
                    client_configuration=configuration
                )
            else:
                await config.load_kube_config(
                    config_file=self.kubeconfig, client_configuration=configuration
                )
            self._api = client.ApiClient(configuration)
        return self._api

    @contextlib.asynccontextmanager
    async def _calling(self, what: str) -> AsyncIterator[client.ApiClient]:
        """The API client, with whatever the call under it fails of as an ActuatorError."""
        try:
            yield await self._client()
        except ApiException as exc:
            raise ActuatorError(f"{what}: HTTP {exc.status} {exc.reason}") from None
        except (OSError, config.ConfigException) as exc:
            raise ActuatorError(f"{what}: {exc}") from None

    async def _scale(self, gpu: str, desired: int) -> None:
        name = self.deployments[gpu]
        async with self._calling(f"scale of deployment {self.namespace}/{name}") as api:
            await client.AppsV1Api(api).patch_namespaced_deployment_scale(
                name, self.namespace, {"spec": {"replicas": desired}}
            )

    async def start(self, gpu: str, desired: int) -> None:
        await self._scale(gpu, desired)

    async def draining(self, name: str, gpu: str) -> None:
        if await self._mark_for_deletion(name, gpu):
            self._victims_marked.add(name)

    async def stop(self, name: str, gpu: str, desired: int) -> None:
        if name not in self._victims_marked:  # marking as its drain began failed
            await self._mark_for_deletion(name, gpu)
        await self._scale(gpu, desired)
        self._victims_marked.discard(name)

    async def inherited(self, rows: Sequence[ReplicaRow]) -> set[str]:
        """The drained replicas whose Pods carry the mark: an earlier autoscaler's drains
        (``draining`` marked them). A mark on a Pod whose replicas serve is stale (its
        victim was undrained) and is taken off, so an operator's later drain of that Pod
        is not taken for the autoscaler's. Read until it once succeeds: later marks are
        this autoscaler's own."""
        if self._inheritance_read:
            return set()
        serving = _serving_hosts(rows)
        drained: dict[str, set[str]] = {}
        for row in rows:
            if row.state == "drained" and (host := urlsplit(row.url).hostname) is not None:
                drained.setdefault(host, set()).add(row.name)
        names: set[str] = set()
        for deployment in self.deployments.values():
            async with self._calling(f"pods of deployment {self.namespace}/{deployment}") as api:
                for pod in await self._pods(api, deployment):
                    if not _is_marked(pod):
                        continue
                    ip = _pod_ip(pod)
                    if ip in serving:
                        await self._patch_mark(api, pod.metadata.name, None)
                    elif ip is not None:
                        names |= drained.get(ip, set())
        self._inheritance_read = True
        return names

    async def _pods(self, api: client.ApiClient, deployment: str) -> list[Any]:
        """The Deployment's Pods (by its ``scale`` subresource's selector) not yet leaving."""
        scale = await client.AppsV1Api(api).read_namespaced_deployment_scale(
            deployment, self.namespace
        )
        pods = await client.CoreV1Api(api).list_namespaced_pod(
            self.namespace, label_selector=scale.status.selector or ""
        )
        return [pod for pod in pods.items if pod.metadata.deletion_timestamp is None]

    async def _patch_mark(self, api: client.ApiClient, pod: str, value: str | None) -> None:
        await client.CoreV1Api(api).patch_namespaced_pod(
            pod, self.namespace, {"metadata": {"annotations": {_DELETION_COST: value}}}
        )

    async def _mark_for_deletion(self, name: str, gpu: str) -> bool:
        """Give the Pod of replica ``name`` the lowest deletion cost, and take the mark an
        earlier scale-in left off the Pods whose replicas serve again (module docstring).
        False: no Pod of the Deployment is that replica's (warned)."""
        deployment = self.deployments[gpu]
        try:
            rows = read_snapshot(await self.admin.snapshot()).replicas
        except GatewayError:
            rows = []
        victim_host = next((urlsplit(r.url).hostname for r in rows if r.name == name), None)
        serving = _serving_hosts(rows)
        victim = None
        async with self._calling(f"pods of deployment {self.namespace}/{deployment}") as api:
            for pod in await self._pods(api, deployment):
                ip = _pod_ip(pod)
                if ip is not None and ip == victim_host:
                    victim = pod.metadata.name
                    if not _is_marked(pod):
                        await self._patch_mark(api, victim, _LOWEST_COST)
                elif _is_marked(pod) and ip in serving:  # an earlier victim, undrained since
                    await self._patch_mark(api, pod.metadata.name, None)
        if victim is None:
            log.warning(
                "the scale-in victim's pod was not found: the controller picks the pod to delete",
                extra={"event": "autoscale_pod_unknown", "replica": name, "host": victim_host},
            )
        return victim is not None

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
