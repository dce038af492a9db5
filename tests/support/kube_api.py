"""A small Kubernetes API server: EndpointSlices, InferencePools and Pods (list, watch),
and Deployments' scale.

No kube-apiserver can run here, so the Kubernetes provider is tested against this: the
``discovery.k8s.io/v1`` EndpointSlice, ``inference.networking.k8s.io/v1`` InferencePool and
``v1`` Pod collections of a namespace, with ``labelSelector`` and ``fieldSelector``
(equality terms; ``metadata.name`` and ``metadata.namespace`` fields), one
``resourceVersion`` sequence for every object and list, watches that replay the history
after the requested version, then stream changes (an object that starts or stops matching
the selectors is ``ADDED`` or ``DELETED``, as the API server's watch cache sends it),
``BOOKMARK`` events carrying the current version (``allowWatchBookmarks``), an end after
``timeoutSeconds``, and the ``410 Gone`` ``Status`` event (reason ``Expired``) for a version
older than the kept history. The ``autoscaling/v1`` ``scale`` subresource of Deployments
(GET and merge or strategic-merge PATCH, ``Status`` failures) and merge patches of a
Pod's annotations and labels serve the autoscaler's actuator. It runs in a thread with its
own event loop; the test changes its state through the thread-safe methods and reads what
clients asked (``lists`` and ``watches`` of slices, ``queries`` of every collection,
``scale_patches``, ``pod_patches``).
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

_SCALE_PATH = "/apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale"
_POD_PATH = "/api/v1/namespaces/{namespace}/pods/{name}"
_MERGE_PATCHES = {"application/merge-patch+json", "application/strategic-merge-patch+json"}


@dataclass(frozen=True)
class Resource:
    """A collection the server lists and watches."""

    plural: str
    kind: str
    api_version: str
    path: str


SLICES = Resource(
    "endpointslices",
    "EndpointSlice",
    "discovery.k8s.io/v1",
    "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
)
POOLS = Resource(
    "inferencepools",
    "InferencePool",
    "inference.networking.k8s.io/v1",
    "/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools",
)
PODS = Resource("pods", "Pod", "v1", "/api/v1/namespaces/{namespace}/pods")


@dataclass
class _Event:
    version: int
    kind: str  # ADDED | MODIFIED | DELETED
    resource: str  # its plural
    obj: dict[str, Any]
    before: dict[str, Any] | None  # the object as it was (a MODIFIED may stop matching)


@dataclass
class KubeApi:
    bookmark_s: float = 0.2
    version: int = 1000
    oldest: int = 1000  # a watch from before this version gets 410 Gone
    # plural -> (namespace, name) -> the object
    objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = field(default_factory=dict)
    history: list[_Event] = field(default_factory=list)
    lists: list[dict[str, str]] = field(default_factory=list)  # query of each slice list
    watches: list[dict[str, str]] = field(default_factory=list)  # query of each slice watch
    # (plural, "list" or "watch", query) of every collection's requests
    queries: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    bookmarks_sent: list[int] = field(default_factory=list)
    authorization: set[str] = field(default_factory=set)
    # Deployments' scale subresource: (namespace, name) -> spec.replicas; the patches asked
    # (name, content type, body); ``refuse_scale`` patches answered 409 Conflict first.
    deployments: dict[tuple[str, str], int] = field(default_factory=dict)
    scale_patches: list[tuple[str, str, Any]] = field(default_factory=list)
    refuse_scale: int = 0
    # Pods' metadata merge-patched (annotations and labels): (name, content type, body)
    pod_patches: list[tuple[str, str, Any]] = field(default_factory=list)

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

    def write_kubeconfig(self, path: Path, token: str) -> Path:
        """A kubeconfig at ``path`` naming this server, with ``token`` as its bearer token."""
        path.write_text(f"""
apiVersion: v1
kind: Config
clusters: [{{name: test, cluster: {{server: 'http://127.0.0.1:{self.port}'}}}}]
users: [{{name: test, user: {{token: {token}}}}}]
contexts: [{{name: test, context: {{cluster: test, user: test}}}}]
current-context: test
""")
        return path

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

    def put_pool(
        self, namespace: str, name: str, *, match_labels: dict[str, str], ports: list[int]
    ) -> None:
        """An ``inference.networking.k8s.io/v1`` InferencePool selecting those pods."""
        body = {
            "kind": POOLS.kind,
            "apiVersion": POOLS.api_version,
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "selector": {"matchLabels": match_labels},
                "targetPorts": [{"number": port} for port in ports],
                "endpointPickerRef": {"name": "isocost-picker", "port": {"number": 9002}},
            },
        }
        self.put_raw(POOLS, namespace, name, body)

    def put_pod(
        self,
        namespace: str,
        name: str,
        *,
        ip: str | None,
        labels: dict[str, str],
        ready: bool = True,
        phase: str = "Running",
        annotations: dict[str, str] | None = None,
        deleting: bool = False,
    ) -> None:
        """A Pod as the kubelet reports it: its phase, IP and ``Ready`` condition."""
        metadata: dict[str, Any] = {
            "name": name,
            "namespace": namespace,
            "labels": labels,
            "annotations": annotations or {},
        }
        if deleting:
            metadata["deletionTimestamp"] = "2025-01-01T00:00:00Z"
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True" if ready else "False"},
            ],
        }
        if ip is not None:
            status["podIP"] = ip
            status["podIPs"] = [{"ip": ip}]
        body = {
            "kind": PODS.kind,
            "apiVersion": PODS.api_version,
            "metadata": metadata,
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
            "status": status,
        }
        self.put_raw(PODS, namespace, name, body)

    def put_raw(self, resource: Resource, namespace: str, name: str, body: dict[str, Any]) -> None:
        """Store ``body`` as it is (listed, and sent to watches)."""
        self._call(self._change(namespace, name, body, resource))

    def delete(self, resource: Resource, namespace: str, name: str) -> None:
        self._call(self._change(namespace, name, None, resource))

    def queried(self, resource: Resource, verb: str) -> list[dict[str, str]]:
        """The queries of each ``verb`` ("list" or "watch") of ``resource``."""
        return [
            query for plural, v, query in self.queries if (plural, v) == (resource.plural, verb)
        ]

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
        app.router.add_get(SLICES.path, self._collection)
        app.router.add_get(POOLS.path, self._pools)
        app.router.add_get(PODS.path, self._pods)
        app.router.add_get(_SCALE_PATH, self._scale)
        app.router.add_patch(_SCALE_PATH, self._scale)
        app.router.add_patch(_POD_PATH, self._patch_pod)
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

    async def _change(
        self,
        namespace: str,
        name: str,
        body: dict[str, Any] | None,
        resource: Resource = SLICES,
    ) -> None:
        self.version += 1
        key = (namespace, name)
        stored = self.objects.setdefault(resource.plural, {})
        before = copy.deepcopy(stored.get(key))
        if body is None:
            obj = copy.deepcopy(stored.pop(key))
            kind = "DELETED"
        else:
            kind = "MODIFIED" if key in stored else "ADDED"
            obj = body
            stored[key] = obj
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.history.append(_Event(self.version, kind, resource.plural, copy.deepcopy(obj), before))
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

    async def _patch_pod(self, request: web.Request) -> web.StreamResponse:
        """A merge patch of a Pod's ``metadata.annotations`` / ``labels`` (null removes a
        key), seen by watches as a ``MODIFIED``; the Pod as it now is."""
        self.authorization.add(request.headers.get("Authorization", ""))
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        body = await request.json()
        self.pod_patches.append((name, request.content_type, body))
        if request.content_type not in _MERGE_PATCHES:
            return _status(415, "UnsupportedMediaType", request.content_type)
        stored = self.objects.get(PODS.plural, {}).get((namespace, name))
        if stored is None:
            return _status(404, "NotFound", f'pods "{name}" not found')
        pod = copy.deepcopy(stored)
        for part in ("annotations", "labels"):
            for key, value in (body.get("metadata", {}).get(part) or {}).items():
                values = pod["metadata"].setdefault(part, {})
                if value is None:
                    values.pop(key, None)
                else:
                    values[key] = value
        await self._change(namespace, name, pod, PODS)
        return web.json_response(pod)

    async def _collection(self, request: web.Request) -> web.StreamResponse:
        return await self._list_or_watch(request, SLICES)

    async def _pools(self, request: web.Request) -> web.StreamResponse:
        return await self._list_or_watch(request, POOLS)

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        return await self._list_or_watch(request, PODS)

    async def _list_or_watch(self, request: web.Request, resource: Resource) -> web.StreamResponse:
        self.authorization.add(request.headers.get("Authorization", ""))
        namespace = request.match_info["namespace"]
        query = dict(request.query)
        labels_wanted = _selector(query.get("labelSelector", ""))
        fields_wanted = _selector(query.get("fieldSelector", ""))

        def matches(obj: dict[str, Any] | None) -> bool:
            if obj is None:
                return False
            meta = obj["metadata"]
            labels = meta.get("labels") or {}
            fields = {"metadata.name": meta.get("name"), "metadata.namespace": meta["namespace"]}
            return (
                meta["namespace"] == namespace
                and all(labels.get(k) == v for k, v in labels_wanted.items())
                and all(fields.get(k) == v for k, v in fields_wanted.items())
            )

        watching = query.get("watch") in ("true", "True", "1")
        self.queries.append((resource.plural, "watch" if watching else "list", query))
        if not watching:
            if resource is SLICES:
                self.lists.append(query)
            stored = self.objects.get(resource.plural, {})
            items = [obj for obj in stored.values() if matches(obj)]
            return web.json_response(
                {
                    "kind": f"{resource.kind}List",
                    "apiVersion": resource.api_version,
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": items,
                }
            )
        if resource is SLICES:
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
                if event.resource == resource.plural:
                    kind = _seen_as(event.kind, matches(event.before), matches(event.obj))
                    if kind is not None:
                        await send(kind, event.obj)
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
                            "kind": resource.kind,
                            "apiVersion": resource.api_version,
                            "metadata": {"resourceVersion": str(self.version)},
                        },
                    )
                    since = max(since, self.version)
        return response


def _seen_as(kind: str, matched_before: bool, matches_now: bool) -> str | None:
    """What a watch with selectors sees of a change: a MODIFIED object that starts matching
    is ADDED, one that stops is DELETED; a change it never matched, nothing."""
    if kind == "MODIFIED" and matched_before != matches_now:
        return "ADDED" if matches_now else "DELETED"
    if kind == "DELETED":
        return kind if matched_before else None
    return kind if matches_now else None


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
