"""The stop drain (`ExtProcServer.drain`): the router closes its port only once Envoy's streams
have ended and none opened for a while, at most `--drain-s`, and a second signal cuts it short."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest
from grpc_health.v1 import health_pb2

from extproc.main import DRAIN_QUIET_S, ExtProcServer
from extproc.service import ExtProcService
from extproc.telemetry import RouterMetrics
from gorgo._xds.envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from gorgo._xds.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
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


@pytest.mark.slow
def test_a_drain_waits_for_pending_streams_then_for_quiet() -> None:
    async def run() -> tuple[float, int]:
        server = _server()
        svc = server.service
        svc.pending_streams, svc.last_opened = 1, time.monotonic()
        await server.health.set(LIVE_SERVICE, health_pb2.HealthCheckResponse.SERVING)

        async def stream_ends() -> None:
            await asyncio.sleep(0.3)
            svc.pending_streams = 0

        t0 = time.monotonic()
        ender = asyncio.create_task(stream_ends())
        await server.drain(10.0)
        await ender
        return time.monotonic() - t0, await _status(server)

    took, status = asyncio.run(run())
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING  # Envoy stops opening streams
    assert DRAIN_QUIET_S <= took < 10.0  # quiet counted from the last stream's opening


@pytest.mark.slow
def test_an_idle_router_stays_up_long_enough_for_envoy_to_see_it_draining() -> None:
    # Quiet counted from the last stream alone: a router idle for 1.5 s closed its port 30 ms
    # after SIGTERM, before Envoy's 1 s health check could see NOT_SERVING.
    async def run() -> float:
        server = _server()
        server.service.last_opened = time.monotonic() - 60.0
        t0 = time.monotonic()
        await server.drain(10.0)
        return time.monotonic() - t0

    assert asyncio.run(run()) >= DRAIN_QUIET_S


def test_a_drain_limit_under_the_quiet_time_cuts_nothing_and_says_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    # It warned drain_cut with no stream open (--drain-s 1: the quiet time never came).
    async def run() -> None:
        server = _server()
        server.service.last_opened = time.monotonic() - 60.0
        await server.drain(0.2)

    asyncio.run(run())
    assert "drain_cut" not in caplog.text


@pytest.mark.parametrize("cut_by", ["limit", "second signal"])
def test_a_drain_ends_at_its_limit_or_a_second_signal(cut_by: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> float:
        server = _server()
        server.service.pending_streams = 2  # never end
        cut = asyncio.Event()
        if cut_by == "second signal":
            asyncio.get_running_loop().call_later(0.2, cut.set)
        t0 = time.monotonic()
        await server.drain(0.5 if cut_by == "limit" else 30.0, cut)
        return time.monotonic() - t0

    took = asyncio.run(run())
    assert took < 5.0
    assert "event=drain_cut pending_streams=2" in caplog.text


def _headers(path: str, end: bool) -> pb.HttpHeaders:
    return pb.HttpHeaders(end_of_stream=end, headers=HeaderMap(headers=[
        HeaderValue(key=":path", raw_value=path.encode()),
        HeaderValue(key=":method", raw_value=b"GET" if end else b"POST")]))


@pytest.mark.parametrize("skip", [False, True])
def test_a_stream_is_pending_until_its_last_message_is_answered(skip: bool) -> None:
    """Envoy keeps a stream open until the response ends (minutes for a long answer) though it
    sends nothing more after the response headers (or, with those skipped, after the request):
    such a stream held every drain to its limit and was reported cut."""
    spec = parse_fleet({"regions": {"local": {}},
                        "extproc": {"response_headers": "skip" if skip else "send"},
                        "replicas": [{"name": "a", "engine": "sim", "region": "local",
                                      "address": "127.0.0.1:1"}]})
    router = Router(spec)
    svc = ExtProcService(router, RouterMetrics(router.state, lambda: router.open_requests))
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    messages = [pb.ProcessingRequest(request_headers=_headers("/v1/chat/completions", False)),
                pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]
    if not skip:
        messages.append(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))

    async def run() -> tuple[int, int, int]:
        ended = asyncio.Event()

        async def envoy():
            for m in messages:
                yield m
            await ended.wait()  # the response is still streaming: the stream stays open

        stream = svc.Process(envoy(), None)
        await stream.__anext__()
        first = svc.pending_streams
        for _ in messages[1:]:
            await stream.__anext__()
        # as gRPC does after writing an answer: ask for the next one, which waits on Envoy
        rest = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        open_after_last = svc.pending_streams
        assert not rest.done()  # the stream is still open
        ended.set()
        with contextlib.suppress(StopAsyncIteration):
            await rest
        return first, open_after_last, svc.pending_streams

    first, after_last, closed = asyncio.run(run())
    assert (first, after_last, closed) == (1, 0, 0)
    assert router.open_requests == 0  # the booking ended with the stream
