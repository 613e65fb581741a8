"""Probes and scrapes against live simulated engines of both flavors, behind emulated links."""

from __future__ import annotations

import asyncio

import numpy as np

from extproc.signals import Signals
from extproc.telemetry import RouterMetrics
from gorgo.core.fleet import parse_fleet
from gorgo.core.router import Router
from gorgo.harness.procs import free_port
from gorgo.sim.fleet import SimFleet


def test_router_probes_rtt_and_scrapes_sglang_and_vllm_metrics() -> None:
    async def go() -> None:
        ports = [free_port(), free_port()]
        spec = parse_fleet({
            "regions": {"near": {"rtt_ms": 2, "jitter_ms": 0},
                        "far": {"rtt_ms": 60, "jitter_ms": 0}},
            "replicas": [
                {"name": "sg", "region": "near", "address": f"127.0.0.1:{ports[0]}",
                 "sim": {"profile": "tiny-test", "flavor": "sglang"}},
                {"name": "vl", "region": "far", "address": f"127.0.0.1:{ports[1]}",
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
            for _ in range(3):
                await signals.probe_all()
                await signals.scrape_all()
            assert s.rtt_samples.min() >= 3  # the first probe only opened the connection
            assert 50 < s.rtt_ms[1] < 90 and s.rtt_ms[0] < 20
            assert np.all(np.isfinite(s.eng_scraped_at))
            assert list(s.eng_queue_reqs) == [0.0, 0.0]
            assert list(s.eng_running_reqs) == [0.0, 0.0]
            assert np.all((s.eng_kv_usage >= 0) & (s.eng_kv_usage <= 1))
            assert s.healthy.all()
            await fleet.kill("vl")
            for _ in range(3):
                await signals.probe_all()
            assert not s.healthy[1] and s.healthy[0]
        finally:
            await signals.stop()
            await fleet.stop()

    asyncio.run(asyncio.wait_for(go(), 60))
