"""Background tasks: RTT/health probes, engine metric scrapes and the router's tick, never on the
request path.

The tick (`Router.tick`, every ``TICK_INTERVAL_S``) runs the policies' periodic duties, such as
`irb`'s re-solve; the offline simulator calls the same method on its virtual clock.

Probes and scrapes run on their own thread and event loop, so they keep their schedule while
decisions are slow (a large body being parsed); what they learn is applied to the router's state
on the router's loop (`apply_probe`, `apply_scrape`, `apply_failed_probe`), where every other
writer runs, so the state needs no lock. Each loop measures its own lag: a probe that timed out
while the signal loop itself was late by a good part of the timeout proves nothing about the
replica and is not counted against it, and a probe answered during such a stall is no RTT sample.

Each tick probes every due replica concurrently, so one slow region never delays the others. Probes
run over keep-alive connections: a probe that had to open a new connection paid a handshake too,
so it proves health but is not an RTT sample. A kept-alive probe costs one round trip, what a
request pays on Envoy's pooled upstream connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import Any

import aiohttp
import numpy as np
from prometheus_client import Counter

from extproc.bodies import TooLarge, read_capped
from extproc.engine_metrics import EngineLoad, parse_engine_metrics
from extproc.loop_thread import LoopThread
from extproc.telemetry import RouterMetrics, log_event
from gorgo.core.router import TICK_INTERVAL_S, Router

log = logging.getLogger("gorgo.signals")
# The signal loop counts as alive (/readyz, the gRPC health service) while its last tick is no
# older than this: forty missed ticks, which no loaded machine explains.
TICK_STALE_S = 40 * TICK_INTERVAL_S
# Loop lag: a beat every LAG_BEAT_S, each beat's lateness kept LAG_WINDOW_S (longer than a probe).
LAG_BEAT_S = 0.05
LAG_WINDOW_S = 60.0
# A probe timeout is not counted while its loop was late by this share of the timeout: a stall of
# L can turn only answers slower than timeout - L into timeouts.
LATE_SHARE_OF_TIMEOUT = 0.25
# An answered probe is no RTT sample when its loop was late by more than this, or this share of it.
RTT_LATE_S = 0.02
RTT_LATE_SHARE = 0.25
# A metrics page is read up to this size (a vLLM page is tens of kilobytes); past it the scrape
# is an error: the page would be held in memory whole, on every replica, every interval.
MAX_METRICS_BYTES = 16 * 1024 * 1024
# A health answer is read up to this size (engines answer an empty or tiny body); past it the
# probe fails: a 100 MB body once took the router to 476 MB, an endless one to 1.4 GB per probe.
MAX_HEALTH_BYTES = 64 * 1024



class LoopLag:
    """How late the event loop it runs on is: every LAG_BEAT_S a beat records how much later than
    asked its timer fired, that is, how long the loop was busy with something else."""

    def __init__(self) -> None:
        self._beats: deque[tuple[float, float]] = deque()  # (when, how late), seconds
        self._last = time.monotonic()

    async def run(self, observe: Callable[[float], None]) -> None:
        while True:
            due = time.monotonic() + LAG_BEAT_S
            await asyncio.sleep(LAG_BEAT_S)
            now = self._last = time.monotonic()
            late = max(0.0, now - due)
            self._beats.append((now, late))
            while self._beats[0][0] < now - LAG_WINDOW_S:
                self._beats.popleft()
            observe(late)

    def worst_since(self, t0: float) -> float:
        """The longest the loop was busy since ``t0`` (time.monotonic), counting a beat that is
        overdue right now: a stall that ends with the caller's own callback has no beat yet."""
        overdue = time.monotonic() - self._last - LAG_BEAT_S
        return max([late for t, late in self._beats if t >= t0] + [overdue, 0.0])


class Signals:
    def __init__(self, router: Router, metrics: RouterMetrics, clock=time.monotonic) -> None:
        self.router = router
        self.metrics = metrics
        self.clock = clock
        self._tasks: list[asyncio.Task] = []  # on the router's loop: the tick, its lag
        self._session: aiohttp.ClientSession | None = None
        self.last_tick: float | None = None
        self._healthy = router.state.healthy.copy()
        self._loop: asyncio.AbstractEventLoop | None = None  # the router's
        self._thread = LoopThread("gorgo-signals")
        self._thread_tasks: list[asyncio.Task] = []  # on the signal thread: probes, scrapes, lag
        self.lag = LoopLag()  # of the signal thread's loop

    @property
    def spec(self):
        return self.router.spec

    def reloaded(self) -> None:
        """The router took on a new fleet: health changes are logged against it from now on."""
        self._healthy = self.router.state.healthy.copy()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.tick()  # before the first request: policies plan on the fleet as it starts
        lag = self.metrics.loop_lag
        self._tasks = [
            asyncio.create_task(self._every(TICK_INTERVAL_S, self._tick)),
            asyncio.create_task(LoopLag().run(lag.labels("router").observe)),
        ]
        self._thread.start()
        await self._on_thread(self._start_thread())

    async def _start_thread(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.spec.timeouts.probe_ms / 1000)
        conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        trace = aiohttp.TraceConfig()
        trace.on_connection_create_end.append(_mark_new_connection)
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=conn, trace_configs=[trace])
        sig = self.spec.signals
        self._thread_tasks = [
            asyncio.create_task(self._every(sig.probe_interval_s, self._probe_all)),
            asyncio.create_task(self._every(sig.scrape_interval_s, self._scrape_all)),
            asyncio.create_task(self.lag.run(self.metrics.loop_lag.labels("signals").observe)),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._thread.running:
            await self._on_thread(self._stop_thread())
            await self._thread.stop()

    async def _stop_thread(self) -> None:
        for t in self._thread_tasks:
            t.cancel()
        await asyncio.gather(*self._thread_tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _on_thread(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` on the signal thread's loop and wait for it on the router's."""
        await self._thread.run(coro)

    def _apply(self, generation: int, fn: Callable[..., None], *args: Any) -> None:
        """Run a state update on the router's loop, after what it is doing now, unless the fleet
        was reloaded since it was measured (replica indices are then another fleet's)."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._if_current, generation, fn, *args)

    def _if_current(self, generation: int, fn: Callable[..., None], *args: Any) -> None:
        if generation == self.router.generation:
            fn(*args)

    async def _every(self, interval: float, fn) -> None:
        while True:
            started = time.monotonic()
            try:
                await fn()
            except Exception:  # a signal bug must not stop the signal loop
                log.exception("signal tick failed")
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    def tick(self) -> None:
        now = self.clock()
        self.router.tick(now)
        self._log_health_changes(now)
        self.last_tick = now

    def alive(self) -> bool:
        """Started, every signal task running, and ticked within TICK_STALE_S."""
        tasks = (*self._tasks, *self._thread_tasks)
        return (self.last_tick is not None and bool(self._thread_tasks)
                and not any(t.done() for t in tasks)
                and self.clock() - self.last_tick <= TICK_STALE_S)

    def _log_health_changes(self, now: float) -> None:
        """One structured line per ejection and re-admission, whichever path decided it (a probe,
        or a failed response on the request path): compared once a tick."""
        s = self.router.state
        if s.healthy.shape != self._healthy.shape:  # reloaded by a caller that did not say
            self.reloaded()
        changed = np.flatnonzero(s.healthy != self._healthy)
        if not changed.size:
            return
        for i in changed:
            replica, region = self.metrics.replica(int(i))
            if s.healthy[i]:
                log_event(log, "replica_readmitted", replica=replica, region=region)
            else:
                log_event(log, "replica_ejected", logging.WARNING, replica=replica,
                          region=region, failures=int(s.failures[i]),
                          retry_in_s=round(max(0.0, float(s.retry_at[i]) - now), 3))
        self._healthy = s.healthy.copy()

    async def _tick(self) -> None:
        self.tick()

    async def probe_all(self) -> None:
        """Probe every due replica once (on the signal thread); the results are applied when it
        returns."""
        await self._on_thread(self._probe_all())

    async def _probe_all(self) -> None:
        generation = self.router.generation
        s = self.router.state
        due = s.probe_due(self.clock())
        await asyncio.gather(*(self.probe(i, generation=generation) for i in range(s.n)
                               if due[i]))

    async def probe(self, i: int, warm: bool = False, generation: int | None = None) -> None:
        """Probe replica ``i`` of the fleet of ``generation`` (read before the state and spec it
        indexes; default: the current one)."""
        if generation is None:
            generation = self.router.generation
        s = self.router.state
        if generation != self.router.generation:
            return  # reloaded since this round began: the index names another fleet's replica
        replica = self.spec.replicas[i]
        ctx = SimpleNamespace(new_connection=False)
        started = time.monotonic()
        t0 = time.perf_counter()
        timed_out = False
        try:
            async with self._session.get(replica.health_url, trace_request_ctx=ctx) as resp:
                await read_capped(resp.content, MAX_HEALTH_BYTES, "health answer")
                ok = resp.status == 200
        except TimeoutError:
            ok, timed_out = False, True
        except (aiohttp.ClientError, OSError, TooLarge):
            ok = False
        rtt_ms = (time.perf_counter() - t0) * 1000
        late = self.lag.worst_since(started)
        if ok:
            stalled = late > max(RTT_LATE_S, RTT_LATE_SHARE * rtt_ms / 1000)
            self._apply(generation, self.apply_probe, i,
                        None if ctx.new_connection or stalled else rtt_ms)
            if ctx.new_connection and not warm and s.rtt_samples[i] == 0:
                await self.probe(i, warm=True, generation=generation)  # sample at once
        elif timed_out and late > LATE_SHARE_OF_TIMEOUT * self.spec.timeouts.probe_ms / 1000:
            self._count(self.metrics.probe_inconclusive, generation, i)
            log.debug("probe of %s timed out while the signal loop was %.3f s late: not counted",
                      replica.name, late)
        else:
            self._count(self.metrics.probe_errors, generation, i)
            self._apply(generation, self.apply_failed_probe, i)

    def _count(self, counter: Counter, generation: int, i: int) -> None:
        """One more on replica ``i``'s series, unless a reload renumbered the replicas while its
        probe or scrape was out (``i`` would name another replica, or none)."""
        if generation != self.router.generation:
            return
        with contextlib.suppress(IndexError):  # a reload on the router's loop at this instant
            counter.labels(*self.metrics.replica(i)).inc()

    def apply_probe(self, i: int, rtt_ms: float | None) -> None:
        """A probe answered: the replica is healthy, and ``rtt_ms`` (if a sample) updates its RTT.

        The simulator applies the same two state calls when its probe returns."""
        self.router.state.record_success(i)
        if rtt_ms is not None:
            self.router.state.observe_rtt(i, rtt_ms)

    def apply_failed_probe(self, i: int) -> None:
        """A probe failed: priced at once (the penalty), ejected after repeated failures."""
        self.router.state.record_failed_probe(i, self.clock())

    def apply_scrape(self, i: int, load: EngineLoad) -> None:
        self.router.state.observe_engine(
            i, self.clock(), load.queue_reqs, load.running_reqs, load.kv_usage, load.generated,
            load.finished)
        if load.cache is not None:
            c = load.cache
            self.router.state.observe_cache_config(i, c.block_size, c.num_blocks, c.hash_algo)

    async def scrape_all(self) -> None:
        """Scrape every replica's engine once (on the signal thread); applied when it returns."""
        await self._on_thread(self._scrape_all())

    async def _scrape_all(self) -> None:
        generation = self.router.generation
        await asyncio.gather(*(self.scrape(i, generation) for i in range(self.router.state.n)))

    async def scrape(self, i: int, generation: int | None = None) -> None:
        if generation is None:
            generation = self.router.generation
        elif generation != self.router.generation:
            return
        replica = self.spec.replicas[i]
        try:
            async with self._session.get(replica.metrics_url) as resp:
                if resp.status != 200:
                    raise ValueError(f"status {resp.status}")
                page = await read_capped(resp.content, MAX_METRICS_BYTES, "metrics page")
            load = parse_engine_metrics(page.decode(), replica.metrics_flavor)
        except Exception as exc:  # stale values age out on their own
            self._count(self.metrics.scrape_errors, generation, i)
            log.debug("scrape of %s failed: %s", replica.name, exc)
            return
        self._apply(generation, self.apply_scrape, i, load)


async def _mark_new_connection(session, trace_ctx, params) -> None:
    # Only probes pass a context; a scrape that opens a connection must not fail on its absence.
    if trace_ctx.trace_request_ctx is not None:
        trace_ctx.trace_request_ctx.new_connection = True
