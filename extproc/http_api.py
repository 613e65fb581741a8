"""The router's HTTP side: Prometheus /metrics, a readiness check and, given the router, the admin
API (extproc/admin.py) on the same loopback-by-default port."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from extproc.admin import add_admin_routes
from extproc.telemetry import RouterMetrics
from gorgo.core.router import Router


def make_app(
    metrics: RouterMetrics, router: Router | None = None, admin_token: str | None = None
) -> web.Application:
    async def prometheus(_: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"content-type": CONTENT_TYPE_LATEST})

    async def ready(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/metrics", prometheus)
    app.router.add_get("/ready", ready)
    if router is not None:
        add_admin_routes(app, router, admin_token, metrics.registry)
    return app
