"""The router's HTTP side: Prometheus /metrics and a readiness check (admin routes join here)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from extproc.telemetry import RouterMetrics


def make_app(metrics: RouterMetrics) -> web.Application:
    async def prometheus(_: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"content-type": CONTENT_TYPE_LATEST})

    async def ready(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/metrics", prometheus)
    app.router.add_get("/ready", ready)
    return app
