"""A small Kubernetes API server: EndpointSlices (list, watch) and Deployments' scale.

No kube-apiserver can run here, so the Kubernetes provider is tested against this: the
``discovery.k8s.io/v1`` EndpointSlice collection of a namespace, with ``labelSelector``
(equality terms), ``resourceVersion`` on every object and list, watches that replay the
history after the requested version, then stream changes, ``BOOKMARK`` events carrying the
current version (``allowWatchBookmarks``), an end after ``timeoutSeconds``, and the
``410 Gone`` ``Status`` event (reason ``Expired``) for a version older than the kept
history. The ``autoscaling/v1`` ``scale`` subresource of Deployments (GET and merge or
strategic-merge PATCH, ``Status`` failures) serves the autoscaler's actuator. It runs in a
thread with its own event loop; the test changes its state through the thread-safe methods
and reads what clients asked (``lists``, ``watches``, ``scale_patches``).
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
_SCALE_PATH = "/apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale"
_MERGE_PATCHES = {"application/merge-patch+json", "application/strategic-merge-patch+json"}


@dataclass
class _Event:
    version: int
    kind: str  # ADDED | MODIFIED | DELETED
    obj: dict[str, Any]


@dataclass
class KubeApi:
    bookmark_s: float = 0.2
    version: int = 1000
    oldest: int = 1000  # a watch from before this version gets 410 Gone
    slices: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    history: list[_Event] = field(default_factory=list)
    lists: list[dict[str, str]] = field(default_factory=list)  # query of each list
    watches: list[dict[str, str]] = field(default_factory=list)  # query of each watch
    bookmarks_sent: list[int] = field(default_factory=list)
    authorization: set[str] = field(default_factory=set)
    # Deployments' scale subresource: (namespace, name) -> spec.replicas; the patches asked
    # (name, content type, body); ``refuse_scale`` patches answered 409 Conflict first.
    deployments: dict[tuple[str, str], int] = field(default_factory=dict)
    scale_patches: list[tuple[str, str, Any]] = field(default_factory=list)
    refuse_scale: int = 0

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._changed = asyncio.Event()
        self._cut = asyncio.Event()  # set: every open watch ends
        self._runner: web.AppRunner | None = None
        self._serving = False  # False: every watch ends, also one opened while going down
        self.port = 0

    # -- control, from the test's thread ------------------------------------------------

    def start(self) -> str:
        self._thread.start()
        self._call(self._serve())
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._call(self._down())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def go_down(self) -> None:
        """Stop answering: open watches end, the port refuses connections."""
        self._call(self._down())

    def come_up(self) -> None:
        self._call(self._serve())

    def put_slice(
        self,
        namespace: str,
        name: str,
        *,
        port: int,
        endpoints: list[tuple[str, str, bool]],  # (address, pod name, ready)
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
    ) -> None:
        body = {
            "kind": "EndpointSlice",
            "apiVersion": "discovery.k8s.io/v1",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": labels or {},
                "annotations": annotations or {},
            },
            "addressType": "IPv4",
            "endpoints": [
                {
                    "addresses": [address],
                    "conditions": {"ready": ready, "serving": ready, "terminating": False},
                    "targetRef": {"kind": "Pod", "namespace": namespace, "name": pod},
                }
                for address, pod, ready in endpoints
            ],
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        }
        self._call(self._change(namespace, name, body))

    def delete_slice(self, namespace: str, name: str) -> None:
        self._call(self._change(namespace, name, None))

    def bump(self) -> int:
        """A change elsewhere in the cluster: the version moves, no watched object does."""
        return int(self._call(self._bump()))

    def compact(self) -> None:
        """Forget the history and end open watches: a watch from any version before now
        gets 410 Gone (a list, then a watch from its version, works)."""
        self._call(self._compact())

    def cut_watches(self) -> None:
        """End every open watch, as the server's own timeout does."""
        self._call(self._cut_all())

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    # -- the server, on its own loop -----------------------------------------------------

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_get(_PATH, self._collection)
        app.router.add_get(_SCALE_PATH, self._scale)
        app.router.add_patch(_SCALE_PATH, self._scale)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        server = site._server
        assert server is not None and server.sockets
        self.port = server.sockets[0].getsockname()[1]
        self._serving = True

    async def _down(self) -> None:
        # A client may reconnect between the cut and the cleanup: with the flag down its
        # watch ends at once too, so the cleanup never waits on a live stream.
        self._serving = False
        await self._cut_all()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _cut_all(self) -> None:
        self._cut.set()
        self._notify()  # wakes every watch, to see the cut and end
        await asyncio.sleep(0.05)
        self._cut = asyncio.Event()

    async def _change(self, namespace: str, name: str, body: dict[str, Any] | None) -> None:
        self.version += 1
        key = (namespace, name)
        if body is None:
            obj = copy.deepcopy(self.slices.pop(key))
            kind = "DELETED"
        else:
            kind = "MODIFIED" if key in self.slices else "ADDED"
            obj = body
            self.slices[key] = obj
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.history.append(_Event(self.version, kind, copy.deepcopy(obj)))
        self._notify()

    async def _bump(self) -> int:
        self.version += 1
        return self.version

    async def _compact(self) -> None:
        await self._cut_all()
        self.history.clear()
        self.version += 1
        self.oldest = self.version

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _scale(self, request: web.Request) -> web.StreamResponse:
        """``autoscaling/v1`` ``Scale`` of a Deployment, read or merge-patched."""
        self.authorization.add(request.headers.get("Authorization", ""))
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        key = (namespace, name)
        if key not in self.deployments:
            return _status(404, "NotFound", f'deployments.apps "{name}" not found')
        if request.method == "PATCH":
            body = await request.json()
            self.scale_patches.append((name, request.content_type, body))
            if request.content_type not in _MERGE_PATCHES:
                return _status(415, "UnsupportedMediaType", request.content_type)
            if self.refuse_scale > 0:
                self.refuse_scale -= 1
                return _status(409, "Conflict", "the object has been modified")
            self.deployments[key] = int(body["spec"]["replicas"])
            self.version += 1
        replicas = self.deployments[key]
        return web.json_response(
            {
                "kind": "Scale",
                "apiVersion": "autoscaling/v1",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "resourceVersion": str(self.version),
                },
                "spec": {"replicas": replicas},
                "status": {"replicas": replicas, "selector": f"app={name}"},
            }
        )

    async def _collection(self, request: web.Request) -> web.StreamResponse:
        self.authorization.add(request.headers.get("Authorization", ""))
        namespace = request.match_info["namespace"]
        query = dict(request.query)
        wanted = _selector(query.get("labelSelector", ""))

        def matches(obj: dict[str, Any]) -> bool:
            meta = obj["metadata"]
            labels = meta.get("labels") or {}
            return meta["namespace"] == namespace and all(
                labels.get(k) == v for k, v in wanted.items()
            )

        if query.get("watch") not in ("true", "True", "1"):
            self.lists.append(query)
            items = [obj for obj in self.slices.values() if matches(obj)]
            return web.json_response(
                {
                    "kind": "EndpointSliceList",
                    "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": items,
                }
            )
        self.watches.append(query)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)

        async def send(kind: str, obj: dict[str, Any]) -> None:
            await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        since = int(query.get("resourceVersion") or self.version)
        if since < self.oldest:
            await send(
                "ERROR",  # what the API server sends for a version no longer kept
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Failure",
                    "message": f"too old resource version: {since} ({self.oldest})",
                    "reason": "Expired",
                    "code": 410,
                },
            )
            return response
        loop = asyncio.get_running_loop()
        ends_at = loop.time() + float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "True", "1")
        cut = self._cut
        while self._serving and not cut.is_set() and loop.time() < ends_at:
            for event in [e for e in self.history if e.version > since]:
                if matches(event.obj):
                    await send(event.kind, event.obj)
                since = event.version
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), self.bookmark_s)
            except TimeoutError:
                if bookmarks and not cut.is_set():
                    self.bookmarks_sent.append(self.version)
                    await send(
                        "BOOKMARK",
                        {
                            "kind": "EndpointSlice",
                            "apiVersion": "discovery.k8s.io/v1",
                            "metadata": {"resourceVersion": str(self.version)},
                        },
                    )
                    since = max(since, self.version)
        return response


def _status(code: int, reason: str, message: str) -> web.Response:
    """A ``Status`` failure, as the API server answers one."""
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    return web.json_response(body, status=code)


def _selector(text: str) -> dict[str, str]:
    terms = [term.split("=", 1) for term in text.split(",") if "=" in term]
    return {key.strip(): value.strip() for key, value in terms}
