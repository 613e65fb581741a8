"""Background tasks: RTT/health probes, engine metric scrapes and the router's tick, never on the
request path.

The tick (`Router.tick`, every ``TICK_INTERVAL_S``) runs the policies' periodic duties, such as
`irb`'s re-solve; the offline simulator calls the same method on its virtual clock.

Each tick probes every due replica concurrently, so one slow region never delays the others. Probes
run over keep-alive connections: a probe that had to open a new connection paid a handshake too,
so it proves health but is not an RTT sample. A kept-alive probe costs one round trip, what a
request pays on Envoy's pooled upstream connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import aiohttp

from extproc.engine_metrics import EngineLoad, parse_engine_metrics
from extproc.telemetry import RouterMetrics
from gorgo.core.router import TICK_INTERVAL_S, Router

log = logging.getLogger("gorgo.signals")


class Signals:
    def __init__(self, router: Router, metrics: RouterMetrics, clock=time.monotonic) -> None:
        self.router = router
        self.metrics = metrics
        self.clock = clock
        self.spec = router.spec
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.spec.timeouts.probe_ms / 1000)
        conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        trace = aiohttp.TraceConfig()
        trace.on_connection_create_end.append(_mark_new_connection)
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=conn, trace_configs=[trace])
        sig = self.spec.signals
        self.tick()  # before the first request: policies plan on the fleet as it starts
        self._tasks = [
            asyncio.create_task(self._every(TICK_INTERVAL_S, self._tick)),
            asyncio.create_task(self._every(sig.probe_interval_s, self.probe_all)),
            asyncio.create_task(self._every(sig.scrape_interval_s, self.scrape_all)),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _every(self, interval: float, fn) -> None:
        while True:
            started = time.monotonic()
            try:
                await fn()
            except Exception:  # a signal bug must not stop the signal loop
                log.exception("signal tick failed")
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    def tick(self) -> None:
        self.router.tick(self.clock())

    async def _tick(self) -> None:
        self.tick()

    async def probe_all(self) -> None:
        due = self.router.state.probe_due(self.clock())
        await asyncio.gather(*(self.probe(i) for i in range(self.router.state.n) if due[i]))

    async def probe(self, i: int, warm: bool = False) -> None:
        s = self.router.state
        replica = self.spec.replicas[i]
        ctx = SimpleNamespace(new_connection=False)
        t0 = time.perf_counter()
        try:
            async with self._session.get(replica.health_url, trace_request_ctx=ctx) as resp:
                await resp.read()
                ok = resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            ok = False
        rtt_ms = (time.perf_counter() - t0) * 1000
        if ok:
            self.apply_probe(i, None if ctx.new_connection else rtt_ms)
            if ctx.new_connection and not warm and s.rtt_samples[i] == 0:
                await self.probe(i, warm=True)  # the connection is open now: sample at once
        else:
            # Priced at once (the penalty), ejected after repeated failures.
            self.metrics.probe_errors.labels(replica.name).inc()
            s.record_failed_probe(i, self.clock())

    def apply_probe(self, i: int, rtt_ms: float | None) -> None:
        """A probe answered: the replica is healthy, and ``rtt_ms`` (if a sample) updates its RTT.

        The simulator applies the same two state calls when its probe returns."""
        self.router.state.record_success(i)
        if rtt_ms is not None:
            self.router.state.observe_rtt(i, rtt_ms)

    def apply_scrape(self, i: int, load: EngineLoad) -> None:
        self.router.state.observe_engine(
            i, self.clock(), load.queue_reqs, load.running_reqs, load.kv_usage)

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(i) for i in range(self.router.state.n)))

    async def scrape(self, i: int) -> None:
        replica = self.spec.replicas[i]
        try:
            async with self._session.get(replica.metrics_url) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise ValueError(f"status {resp.status}")
            load = parse_engine_metrics(text, replica.metrics_flavor)
        except Exception as exc:  # stale values age out on their own
            self.metrics.scrape_errors.labels(replica.name).inc()
            log.debug("scrape of %s failed: %s", replica.name, exc)
            return
        self.apply_scrape(i, load)


async def _mark_new_connection(session, trace_ctx, params) -> None:
    # Only probes pass a context; a scrape that opens a connection must not fail on its absence.
    if trace_ctx.trace_request_ctx is not None:
        trace_ctx.trace_request_ctx.new_connection = True
