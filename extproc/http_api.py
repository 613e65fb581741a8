"""The router's HTTP side: Prometheus /metrics, /healthz (the process answers) and /readyz (it
can route), and, given the router, the admin API (extproc/admin.py) on the same
loopback-by-default port."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from extproc.admin import add_admin_routes
from extproc.reload import FleetReloader
from extproc.signals import Signals
from extproc.telemetry import RouterMetrics
from gorgo.core.router import Router

Readiness = Callable[[], dict[str, bool]]


def readiness(router: Router, signals: Signals) -> dict[str, bool]:
    """What /readyz and the gRPC health service check: the fleet is loaded, at least one replica is
    routable, and the signal loop (probes, scrapes, the tick) is alive."""
    return {"fleet_loaded": router.state.n > 0,
            "routable_replica": bool(router.state.routable().any()),
            "signal_loop": signals.alive()}


def make_app(
    metrics: RouterMetrics, router: Router | None = None, admin_token: str | None = None,
    ready: Readiness | None = None, reloader: FleetReloader | None = None,
) -> web.Application:
    """``ready`` gives /readyz its checks; without it /readyz answers as /healthz does."""
    async def prometheus(_: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"content-type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(_: web.Request) -> web.Response:
        checks = ready() if ready is not None else {}
        ok = all(checks.values())
        return web.json_response({"ready": ok, "checks": checks}, status=200 if ok else 503)

    app = web.Application()
    app.router.add_get("/metrics", prometheus)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    if router is not None:
        add_admin_routes(app, router, admin_token, metrics.registry, reloader)
    return app
