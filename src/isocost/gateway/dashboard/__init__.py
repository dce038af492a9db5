"""``GET /dashboard``: the gateway's live page, plain HTML + JS + CSS shipped as package
data (no build step, no CDN, works offline).

The page itself is public and holds no data; it polls ``GET /admin/snapshot`` once a
second with the admin token, which it takes from the URL fragment (``#token=...``, never
sent to the server or logged), the ``?token=`` query, or a form, and keeps in the tab's
``sessionStorage``. A Content-Security-Policy limits it to this origin.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

__all__ = ["add_dashboard_routes"]

_ASSETS = {
    "index.html": "text/html",
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}
_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def _asset(name: str) -> web.Response:
    body = resources.files(__name__).joinpath(name).read_bytes()
    return web.Response(body=body, content_type=_ASSETS[name], charset="utf-8", headers=_HEADERS)


async def _index(request: web.Request) -> web.StreamResponse:
    return _asset("index.html")


async def _file(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    if name not in _ASSETS:
        raise web.HTTPNotFound()
    return _asset(name)


def add_dashboard_routes(app: web.Application) -> None:
    """Serve the dashboard under ``/dashboard`` on ``app``."""
    app.router.add_get("/dashboard", _index)
    app.router.add_get("/dashboard/", _index)
    app.router.add_get("/dashboard/{name}", _file)
