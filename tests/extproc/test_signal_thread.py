"""The signal path cannot starve (issue 12, finding 2).

Probes and scrapes run on their own thread and event loop: a decision that holds the router's loop
does not delay them, and a probe that timed out only because its own loop was late is not counted
against the replica (the attack ejected all four healthy replicas that way).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from aiohttp import web

from extproc.signals import LAG_BEAT_S, LoopLag, Signals
from extproc.telemetry import RouterMetrics
from gorgo.core.fleet import parse_fleet
from gorgo.core.router import Router
from gorgo.core.state import FAILURES_TO_EJECT
from gorgo.harness.procs import LoopThread

PROBE_INTERVAL_S = 0.05
PROBE_MS = 300


class Health:
    """A /health and /metrics endpoint on its own loop thread, counting probes; it can hang."""

    def __init__(self, lt: LoopThread) -> None:
        self.lt = lt
        self.probes: list[float] = []
        self.hang = False
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        async def health(_: web.Request) -> web.Response:
            self.probes.append(time.monotonic())
            if self.hang:
                await asyncio.sleep(2 * PROBE_MS / 1000)
            return web.Response(text="ok")

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text="sglang:num_queue_reqs 0\nsglang:num_running_reqs 0\n")

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]


@pytest.fixture
def upstream(loop_thread: LoopThread) -> Iterator[Health]:
    h = Health(loop_thread)
    loop_thread.run(h.start())
    yield h
    loop_thread.run(h.runner.cleanup())


def _router(port: int) -> Router:
    return Router(parse_fleet({
        "regions": {"local": {}},
        "signals": {"probe_interval_s": PROBE_INTERVAL_S, "scrape_interval_s": PROBE_INTERVAL_S},
        "timeouts": {"probe_ms": PROBE_MS},
        "replicas": [{"name": "r", "engine": "sglang", "region": "local",
                      "address": f"127.0.0.1:{port}"}],
    }))


def test_loop_lag_sees_a_stall() -> None:
    async def go() -> tuple[float, float]:
        lag = LoopLag()
        task = asyncio.create_task(lag.run(lambda _: None))
        await asyncio.sleep(3 * LAG_BEAT_S)
        t0 = time.monotonic()
        quiet = lag.worst_since(t0)
        time.sleep(0.3)  # the loop is busy: no timer fires
        stalled = lag.worst_since(t0)  # seen before any beat ran: the overdue beat
        await asyncio.sleep(2 * LAG_BEAT_S)
        after = lag.worst_since(t0)  # the late beat recorded it
        task.cancel()
        return quiet, min(stalled, after)

    quiet, stalled = asyncio.run(go())
    assert stalled >= 0.2 > quiet


@pytest.mark.slow
def test_probes_keep_their_schedule_while_a_decision_holds_the_router_loop(
    upstream: Health,
) -> None:
    async def go() -> tuple[int, int]:
        router = _router(upstream.port)
        signals = Signals(router, RouterMetrics(router.state, lambda: 0))
        await signals.start()
        try:
            await asyncio.sleep(0.3)
            before = len(upstream.probes)
            t0 = time.monotonic()
            time.sleep(1.0)  # a slow decision: the router's loop runs nothing else meanwhile
            during = sum(1 for t in upstream.probes if t0 <= t <= t0 + 1.0)
            await asyncio.sleep(0.2)  # the updates queued for the router's loop now apply
            assert router.state.healthy.all() and router.state.failures[0] == 0
            assert router.state.rtt_samples[0] > 0
        finally:
            await signals.stop()
        return before, during

    before, during = asyncio.run(asyncio.wait_for(go(), 30))
    assert before >= 1
    # 20 probe intervals of 50 ms: on one loop there were none; a loaded machine may lose some.
    assert during >= 5, during


def _probe_once(port: int, worst_lag_s: float, hang: Health) -> tuple[Router, RouterMetrics]:
    async def go() -> tuple[Router, RouterMetrics]:
        router = _router(port)
        metrics = RouterMetrics(router.state, lambda: 0)
        signals = Signals(router, metrics)
        await signals.start()
        try:
            signals.lag.worst_since = lambda t0: worst_lag_s  # as if the signal loop had stalled
            for _ in range(FAILURES_TO_EJECT):
                await signals.probe_all()
        finally:
            await signals.stop()
        return router, metrics

    hang.hang = True
    return asyncio.run(asyncio.wait_for(go(), 30))


def _count(metrics: RouterMetrics, name: str) -> float:
    return sum(s.value for m in metrics.registry.collect() if m.name == name for s in m.samples
               if s.name.endswith("_total"))


def test_a_timeout_while_the_signal_loop_was_late_is_not_counted(upstream: Health) -> None:
    router, metrics = _probe_once(upstream.port, worst_lag_s=PROBE_MS / 1000, hang=upstream)
    assert router.state.healthy[0] and router.state.failures[0] == 0
    assert _count(metrics, "gorgo_probe_inconclusive") >= FAILURES_TO_EJECT


def test_a_timeout_on_a_punctual_loop_counts(upstream: Health) -> None:
    router, metrics = _probe_once(upstream.port, worst_lag_s=0.0, hang=upstream)
    assert not router.state.healthy[0]  # three real timeouts eject, as before
    assert _count(metrics, "gorgo_probe_inconclusive") == 0
