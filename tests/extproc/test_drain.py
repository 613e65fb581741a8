"""The stop drain (`ExtProcServer.drain`): the router closes its port only once Envoy's streams
have ended and none opened for a while, at most `--drain-s`, and a second signal cuts it short."""

from __future__ import annotations

import asyncio
import time

import pytest
from grpc_health.v1 import health_pb2

from extproc.main import DRAIN_QUIET_S, ExtProcServer
from gorgo.core.contract import LIVE_SERVICE
from gorgo.core.fleet import parse_fleet
from gorgo.core.router import Router


def _server() -> ExtProcServer:
    spec = parse_fleet({"regions": {"local": {}}, "replicas": [
        {"name": "a", "engine": "sim", "region": "local", "address": "127.0.0.1:1"}]})
    return ExtProcServer(Router(spec))


async def _status(server: ExtProcServer) -> int:
    answer = await server.health.Check(health_pb2.HealthCheckRequest(service=LIVE_SERVICE), None)
    return answer.status


def test_a_drain_waits_for_open_streams_then_for_quiet() -> None:
    async def run() -> tuple[float, int]:
        server = _server()
        svc = server.service
        svc.open_streams, svc.last_opened = 1, time.monotonic()
        await server.health.set(LIVE_SERVICE, health_pb2.HealthCheckResponse.SERVING)

        async def stream_ends() -> None:
            await asyncio.sleep(0.3)
            svc.open_streams = 0

        t0 = time.monotonic()
        ender = asyncio.create_task(stream_ends())
        await server.drain(10.0)
        await ender
        return time.monotonic() - t0, await _status(server)

    took, status = asyncio.run(run())
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING  # Envoy stops opening streams
    assert DRAIN_QUIET_S <= took < 10.0  # quiet counted from the last stream's opening


@pytest.mark.parametrize("cut_by", ["limit", "second signal"])
def test_a_drain_ends_at_its_limit_or_a_second_signal(cut_by: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> float:
        server = _server()
        server.service.open_streams = 2  # never end
        cut = asyncio.Event()
        if cut_by == "second signal":
            asyncio.get_running_loop().call_later(0.2, cut.set)
        t0 = time.monotonic()
        await server.drain(0.5 if cut_by == "limit" else 30.0, cut)
        return time.monotonic() - t0

    took = asyncio.run(run())
    assert took < 5.0
    assert "event=drain_cut open_streams=2" in caplog.text
