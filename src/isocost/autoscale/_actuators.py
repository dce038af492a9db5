"""Actuators: what starts and stops replicas. They only apply decisions (DESIGN §7).

* ``LocalActuator``: one ``isocost engine`` process per replica on a free 127.0.0.1 port,
  added to the gateway once it answers, stopped (process group) after the gateway
  drained it. ``runtime.processes.Services`` owns the processes.
* ``CommandActuator``: ``--scale-command`` run with the desired count of the GPU type as
  its last argument and in ``ISOCOST_DESIRED_REPLICAS`` (``ISOCOST_GPU`` names the type);
  the platform starts and stops replicas and they join the gateway through discovery.
* ``KubernetesActuator``: patches the ``scale`` subresource of one Deployment per GPU type
  (``<deployment>`` or ``<deployment>-<gpu>`` with several) to the desired count.

A failure is an ``ActuatorError``; the loop retries it with backoff.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
from pathlib import Path
from typing import Protocol

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from isocost.autoscale._admin import AdminClient
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


class ActuatorError(IsocostError):
    """The actuator could not apply a change (a command failed, an API refused)."""


class Actuator(Protocol):
    async def start(self, gpu: str, desired: int) -> None:
        """Start one more replica of ``gpu`` (``desired`` of them in all, once started)."""
        ...

    async def stop(self, name: str, gpu: str, desired: int) -> None:
        """Stop the drained, idle replica ``name`` (``desired`` of ``gpu`` remain)."""
        ...

    async def close(self) -> None: ...


class LocalActuator:
    def __init__(
        self,
        admin: AdminClient,
        model: str,
        log_dir: Path,
        engine_args: list[str],
        ready_timeout_s: float = 120.0,
    ) -> None:
        self.admin = admin
        self.model = model
        self.engine_args = engine_args
        self.ready_timeout_s = ready_timeout_s
        self.services = Services(log_dir, grace_s=10.0)
        self.running: dict[str, Service] = {}

    async def start(self, gpu: str, desired: int) -> None:
        port = free_port(_HOST)
        name = f"autoscale-{gpu}-{port}"
        args = ["engine", "--host", _HOST, "--port", str(port), "--model", self.model]
        service = self.services.start(name, [*args, "--gpu", gpu, *self.engine_args])
        try:
            (url,) = await asyncio.to_thread(service.wait_ready, 1, self.ready_timeout_s)
            await self.admin.add(self.model, {"url": url, "name": name, "gpu": gpu})
        except (ServiceError, IsocostError) as exc:
            self.services.stop(service)
            raise ActuatorError(f"engine {name} did not start: {exc}") from None
        except asyncio.CancelledError:
            self.services.stop(service)
            raise
        self.running[name] = service

    async def stop(self, name: str, gpu: str, desired: int) -> None:
        service = self.running.pop(name, None)
        if service is not None:
            await asyncio.to_thread(self.services.stop, service)

    async def close(self) -> None:
        await asyncio.to_thread(self.services.stop_all)


class CommandActuator:
    def __init__(self, command: str, timeout_s: float = 120.0) -> None:
        self.argv = shlex.split(command)
        if not self.argv:
            raise ActuatorError("--scale-command is empty")
        self.timeout_s = timeout_s

    async def _run(self, gpu: str, desired: int) -> None:
        env = {**os.environ, "ISOCOST_DESIRED_REPLICAS": str(desired), "ISOCOST_GPU": gpu}
        try:
            process = await asyncio.create_subprocess_exec(
                *self.argv,
                str(desired),
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
        except OSError as exc:
            raise ActuatorError(f"cannot run {self.argv[0]}: {exc.strerror}") from None
        try:
            output, _ = await asyncio.wait_for(process.communicate(), self.timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            process.kill()
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

    async def stop(self, name: str, gpu: str, desired: int) -> None:
        await self._run(gpu, desired)

    async def close(self) -> None:
        """Nothing to release: each run is its own process."""


class KubernetesActuator:
    def __init__(
        self,
        deployments: dict[str, str],
        namespace: str,
        kubeconfig: str | None = None,
    ) -> None:
        self.deployments = deployments  # GPU type -> Deployment name
        self.namespace = namespace
        self.kubeconfig = kubeconfig
        self._api: client.ApiClient | None = None

    async def _apps(self) -> client.AppsV1Api:
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
        return client.AppsV1Api(self._api)

    async def _scale(self, gpu: str, desired: int) -> None:
        name = self.deployments[gpu]
        try:
            apps = await self._apps()
            await apps.patch_namespaced_deployment_scale(
                name, self.namespace, {"spec": {"replicas": desired}}
            )
        except ApiException as exc:
            raise ActuatorError(
                f"scale of deployment {self.namespace}/{name}: HTTP {exc.status} {exc.reason}"
            ) from None
        except (OSError, config.ConfigException) as exc:
            raise ActuatorError(f"scale of deployment {self.namespace}/{name}: {exc}") from None

    async def start(self, gpu: str, desired: int) -> None:
        await self._scale(gpu, desired)

    async def stop(self, name: str, gpu: str, desired: int) -> None:
        await self._scale(gpu, desired)

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
