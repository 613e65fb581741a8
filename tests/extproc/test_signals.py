"""Probes and scrapes against live simulated engines of both flavors, behind emulated links."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from aiohttp import web

import extproc.signals as signals_module
from extproc.main import ExtProcServer
from extproc.signals import Signals
from extproc.telemetry import RouterMetrics
from gorgo.core.fleet import FleetSpec, parse_fleet
from gorgo.core.router import Router
from gorgo.harness.procs import free_port
from gorgo.sim.fleet import SimFleet
from tests.extproc.test_engine_metrics import VLLM


def test_router_probes_rtt_and_scrapes_sglang_and_vllm_metrics() -> None:
    async def go() -> None:
        ports = [free_port(), free_port()]
        spec = parse_fleet({
            "regions": {"near": {"sim": {"rtt_ms": 2, "jitter_ms": 0}},
                        "far": {"sim": {"rtt_ms": 60, "jitter_ms": 0}}},
            "replicas": [
                {"name": "sg", "engine": "sim", "region": "near",
                 "address": f"127.0.0.1:{ports[0]}",
                 "sim": {"profile": "tiny-test", "flavor": "sglang"}},
                {"name": "vl", "engine": "sim", "region": "far", "address": f"127.0.0.1:{ports[1]}",
                 "sim": {"profile": "tiny-test", "flavor": "vllm"}},
            ],
        })
        fleet = SimFleet(spec)
        await fleet.start()
        router = Router(spec)
        signals = Signals(router, RouterMetrics(router.state, lambda: 0))
        try:
            await signals.start()
            s = router.state
            # The first probe only opens the connection, and a probe the signal loop was late
            # for is not a sample (a loaded machine stalls it): probe until three samples each.
            for _ in range(30):
                await signals.probe_all()
                await signals.scrape_all()
                if s.rtt_samples.min() >= 3:
                    break
            assert s.rtt_samples.min() >= 3
            # Each RTT is at least its link's (less the emulator's 0.5 ms timer lead each way);
            # a loaded machine only adds to both, so the upper bound is on the difference: far
            # is near plus the far link's extra 58 ms, within a generous factor.
            near, far = s.rtt_ms
            assert near >= 2.0 - 1.0 and far >= 60.0 - 1.0, (near, far)
            assert 58.0 * 0.5 < far - near < 58.0 * 2.5, (near, far)
            assert np.all(np.isfinite(s.eng_scraped_at))
            assert list(s.eng_queue_reqs) == [0.0, 0.0]
            assert list(s.eng_running_reqs) == [0.0, 0.0]
            assert np.all((s.eng_kv_usage >= 0) & (s.eng_kv_usage <= 1))
            # both flavors' output counters reach the state (nothing served yet)
            assert list(s.eng_generated) == [0.0, 0.0] and list(s.eng_finished) == [0.0, 0.0]
            assert s.healthy.all()
            await fleet.kill("vl")
            for _ in range(3):
                await signals.probe_all()
            assert not s.healthy[1] and s.healthy[0]
        finally:
            await signals.stop()
            await fleet.stop()

    asyncio.run(asyncio.wait_for(go(), 60))


async def _fake_engine(path: str, handler: Any) -> tuple[web.AppRunner, Router, RouterMetrics,
                                                         Signals]:
    """One vLLM replica whose ``path`` ``handler`` answers, and a router's signals for it."""
    app = web.Application()
    app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    router = Router(parse_fleet({
        "regions": {"a": None}, "signals": {"scrape_interval_s": 3600},
        "replicas": [{"name": "v", "region": "a", "address": f"127.0.0.1:{port}",
                      "engine": "vllm"}]}))
    m = RouterMetrics(router.state, lambda: 0)
    return runner, router, m, Signals(router, m)


def test_a_page_over_the_size_limit_is_a_scrape_error_and_the_next_one_applies(
        monkeypatch: pytest.MonkeyPatch) -> None:
    page = VLLM + "".join(f'vllm:iteration_tokens_total_bucket{{le="{k}"}} 1\n' for k in range(20))

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/plain")

    async def go() -> None:
        runner, router, m, signals = await _fake_engine("/metrics", metrics)
        errors = m.scrape_errors.labels(*m.replica(0))
        monkeypatch.setattr(signals_module, "MAX_METRICS_BYTES", len(page) - 1)
        try:
            await signals.start()
            await signals.scrape_all()
            assert router.state.eng_scraped_at[0] == -np.inf  # never applied
            assert errors._value.get() >= 1
            monkeypatch.setattr(signals_module, "MAX_METRICS_BYTES", len(page))
            await signals.scrape_all()
            assert router.state.eng_queue_reqs[0] == 5.0 and router.state.eng_running_reqs[0] == 17
        finally:
            await signals.stop()
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_health_answer_over_its_size_limit_is_a_failed_probe_not_read_whole() -> None:
    # An engine answered /health with 100 MB (the router grew by 412 MB and counted it healthy)
    # or an endless body (1.4 GB in one probe): it is read up to MAX_HEALTH_BYTES.
    body = {"size": signals_module.MAX_HEALTH_BYTES + 1}

    async def health(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * body["size"])

    async def go() -> None:
        runner, router, m, signals = await _fake_engine("/health", health)
        errors = m.probe_errors.labels(*m.replica(0))
        try:
            await signals.start()  # its first probes fail too
            for _ in range(3):
                await signals.probe_all()
            failed = errors._value.get()
            assert failed >= 3 and not router.state.healthy[0]
            body["size"] = 2
            await signals.probe_all()
            assert errors._value.get() == failed and router.state.healthy[0]
        finally:
            await signals.stop()
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_probe_out_when_a_reload_renumbers_the_replicas_is_charged_to_no_one() -> None:
    """Its index named the removed replica; after the reload it named another (or none)."""
    async def go() -> None:
        async def slow_fail(_: web.Request) -> web.Response:
            await asyncio.sleep(0.5)
            return web.Response(status=503)

        async def ok(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        ports, runners = {}, []
        for name, health in (("old", slow_fail), ("b", ok)):
            app = web.Application()
            app.router.add_get("/health", health)
            runner = web.AppRunner(app)
            await runner.setup()
            ports[name] = free_port()
            await web.TCPSite(runner, "127.0.0.1", ports[name]).start()
            runners.append(runner)

        def fleet(names: list[str]) -> FleetSpec:
            return parse_fleet({
                "regions": {"a": None},
                "signals": {"probe_interval_s": 3600, "scrape_interval_s": 3600},
                "replicas": [{"name": n, "region": "a", "address": f"127.0.0.1:{ports[n]}",
                              "engine": "vllm"} for n in names]})

        server = ExtProcServer(Router(fleet(["old", "b"])))
        errors = server.metrics.probe_errors
        try:
            await server.signals.start()
            probe = asyncio.create_task(server.signals._on_thread(server.signals.probe(0)))
            await asyncio.sleep(0.1)
            server.apply_fleet(fleet(["b"]))  # "old" removed while its probe is out
            await probe
            charged = {s.labels["replica"]: s.value for m in errors.collect()
                       for s in m.samples if s.name.endswith("_total")}
            assert charged.get("b", 0) == 0, charged
        finally:
            await server.signals.stop()
            for runner in runners:
                await runner.cleanup()

    asyncio.run(asyncio.wait_for(go(), 60))
