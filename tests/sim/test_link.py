"""The link emulator: measured RTT, byte order under jitter, partitions and shutdown."""

from __future__ import annotations

import asyncio
import itertools
import random
import socket
import statistics
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from gorgo.sim.link import LINK_PRESETS, Link

HOST = "127.0.0.1"


@asynccontextmanager
async def http_server() -> AsyncIterator[int]:
    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, HOST, 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


@asynccontextmanager
async def echo_server() -> AsyncIterator[int]:
    writers: list[asyncio.StreamWriter] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(echo, HOST, 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for w in writers:
            w.close()
        await server.wait_closed()


@asynccontextmanager
async def echo_link(rtt_ms: float, sd_ms: float, dist: str = "normal") -> AsyncIterator[Link]:
    async with echo_server() as port:
        link = Link(HOST, 0, HOST, port, rtt_ms=rtt_ms, jitter_sd_ms=sd_ms, dist=dist)
        await link.start()
        try:
            yield link
        finally:
            await link.stop()


async def _timed_get(session: aiohttp.ClientSession, url: str) -> float:
    t0 = time.perf_counter()
    async with session.get(url) as resp:
        assert resp.status == 200
        await resp.read()
    return time.perf_counter() - t0


async def _echo_roundtrip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> float:
    t0 = time.perf_counter()
    writer.write(b"ping")
    await writer.drain()
    assert await reader.readexactly(4) == b"ping"
    return time.perf_counter() - t0


def test_presets_cover_the_paper_regions() -> None:
    assert LINK_PRESETS["us-east"] == (37.0, 8.0)
    assert LINK_PRESETS["eu-frankfurt"] == (279.0, 80.0)
    assert LINK_PRESETS["ap-seoul"] == (456.0, 138.0)
    assert LINK_PRESETS["local"][0] <= 2.0
    link = Link.from_preset("ap-seoul", HOST, 0, HOST, 1)
    assert (link.rtt_ms, link.jitter_sd_ms) == LINK_PRESETS["ap-seoul"]
    with pytest.raises(ValueError):
        Link.from_preset("mars", HOST, 0, HOST, 1)
    with pytest.raises(ValueError):
        Link(HOST, 0, HOST, 1, 10, 1, dist="uniform")


@pytest.mark.parametrize("dist", ["normal", "lognormal"])
def test_one_way_samples_match_the_configured_rtt(dist: str) -> None:
    link = Link(HOST, 0, HOST, 1, rtt_ms=100.0, jitter_sd_ms=40.0, dist=dist, seed=3)
    samples = [link.one_way_s() for _ in range(20000)]
    assert min(samples) >= 0.0
    # Two independent one-way delays add up to the configured RTT mean and sd.
    assert statistics.fmean(samples) * 2 == pytest.approx(0.100, abs=0.003)
    assert statistics.pstdev(samples) * 2**0.5 == pytest.approx(0.040, abs=0.004)


# Timing bounds on real sockets: a loaded machine only ever adds time, so absolute bounds are
# lower bounds (the emulator never delivers a chunk more than _TIMER_LEAD_S = 0.5 ms early per
# direction), and upper bounds are taken relative to a baseline measured the same way, by medians
# so that a scheduling hiccup on one sample does not count.


@pytest.mark.slow
def test_measured_keepalive_rtt_matches_configuration() -> None:
    async def run() -> tuple[list[float], list[float], float]:
        async with http_server() as port:
            link = Link(HOST, 0, HOST, port, rtt_ms=60.0, jitter_sd_ms=5.0, seed=1)
            front = await link.start()
            try:
                async with aiohttp.ClientSession() as session:
                    direct_url, link_url = f"http://{HOST}:{port}/", f"http://{HOST}:{front}/"
                    await _timed_get(session, direct_url)
                    direct = [await _timed_get(session, direct_url) for _ in range(10)]
                    first = await _timed_get(session, link_url)  # opens the connection
                    probes = [await _timed_get(session, link_url) for _ in range(25)]
            finally:
                await link.stop()
        return [d * 1000 for d in direct], [p * 1000 for p in probes], first * 1000

    direct, probes, first_ms = asyncio.run(run())
    # Never faster than the link: 25 keep-alive round trips of mean 60 ms, sd 5 (sd of the mean
    # 1 ms), so their mean is above 55 ms whatever else the machine does.
    assert statistics.fmean(probes) > 55.0, probes
    # Not slower than the link by more than a generous margin over the direct baseline.
    excess_ms = statistics.median(probes) - statistics.median(direct)
    assert excess_ms < 60.0 * 1.5, (probes, direct)
    # A new connection pays a handshake RTT on top of the request's: two round trips (mean 120 ms,
    # sd 7) from below, and about one more than a keep-alive request.
    assert first_ms > 95.0, first_ms
    assert first_ms - statistics.median(probes) > 30.0, (first_ms, probes)


@pytest.mark.parametrize("dist", ["normal", "lognormal"])
def test_large_transfer_keeps_byte_order_under_jitter(dist: str) -> None:
    payload = random.Random(7).randbytes(2 * 1024 * 1024)

    async def run() -> bytes:
        async with echo_link(10.0, 20.0, dist) as link:
            reader, writer = await asyncio.open_connection(HOST, link.port)

            async def send() -> None:
                for k in range(0, len(payload), 16384):
                    writer.write(payload[k : k + 16384])
                    await writer.drain()

            sender = asyncio.create_task(send())
            got = await asyncio.wait_for(reader.readexactly(len(payload)), 20)
            await sender
            writer.close()
            return got

    assert asyncio.run(run()) == payload


def test_set_rtt_applies_at_run_time() -> None:
    async def run() -> tuple[list[float], list[float]]:
        async with echo_link(0.0, 0.0) as link:
            reader, writer = await asyncio.open_connection(HOST, link.port)
            await _echo_roundtrip(reader, writer)
            fast = [await _echo_roundtrip(reader, writer) for _ in range(5)]
            link.set_rtt(80.0, 0.0)
            slow = [await _echo_roundtrip(reader, writer) for _ in range(3)]
            writer.close()
            return fast, slow

    fast, slow = asyncio.run(run())
    # Every round trip after the change takes the new 80 ms (no jitter) at least...
    assert min(slow) >= 0.080 - 2 * 5e-4, slow
    # ... and adds about 80 ms to the 0 ms link's round trip, within a generous factor.
    added = statistics.median(slow) - statistics.median(fast)
    assert 0.080 * 0.5 < added < 0.080 * 2.5, (fast, slow)


def test_drop_partition_resets_live_and_new_connections() -> None:
    async def run() -> None:
        async with echo_link(2.0, 0.0) as link:
            reader, writer = await asyncio.open_connection(HOST, link.port)
            await _echo_roundtrip(reader, writer)
            link.set_partition("drop")
            assert link.connections == 0
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                await asyncio.wait_for(_echo_roundtrip(reader, writer), 2)
            writer.close()

            reader, writer = await asyncio.open_connection(HOST, link.port)
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                await asyncio.wait_for(_echo_roundtrip(reader, writer), 2)
            writer.close()

            link.set_partition(None)
            reader, writer = await asyncio.open_connection(HOST, link.port)
            assert await asyncio.wait_for(_echo_roundtrip(reader, writer), 2) < 1
            writer.close()

    asyncio.run(run())


def test_stall_partition_holds_bytes_until_healed() -> None:
    async def run() -> None:
        async with echo_link(2.0, 0.0) as link:
            reader, writer = await asyncio.open_connection(HOST, link.port)
            await _echo_roundtrip(reader, writer)
            link.set_partition("stall")
            writer.write(b"held")
            await writer.drain()
            pending = asyncio.create_task(reader.readexactly(4))
            done, _ = await asyncio.wait({pending}, timeout=0.3)
            assert not done
            link.set_partition(None)
            assert await asyncio.wait_for(pending, 2) == b"held"
            assert link.connections == 1
            writer.close()

    asyncio.run(run())


def test_stop_closes_listener_and_live_connections() -> None:
    async def run() -> None:
        async with echo_server() as port:
            link = Link(HOST, 0, HOST, port, rtt_ms=2.0, jitter_sd_ms=0.0)
            front = await link.start()
            reader, writer = await asyncio.open_connection(HOST, front)
            await _echo_roundtrip(reader, writer)
            await link.stop()
            assert link.connections == 0
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                await asyncio.wait_for(_echo_roundtrip(reader, writer), 2)
            writer.close()
            with pytest.raises(OSError):
                await asyncio.open_connection(HOST, front)

    asyncio.run(run())


@pytest.mark.slow  # a second or more: out of test-fast
def test_a_stream_keeps_its_spacing_through_jitter() -> None:
    """Chunks sent while one is in flight share its delay: each drawing its own, a chunk waited
    for the latest of several draws (FIFO), so a stream's later chunks came later and later and
    bunched, and a far region's streamed first token came 13 % over its RTT."""
    async def run() -> list[float]:
        async with echo_link(100.0, 0.0) as link:
            # Draws alternating 50 and 150 ms: a chunk behind a 150 ms one waited for it.
            draws = itertools.cycle((0.05, 0.15))
            link.one_way_s = lambda: next(draws)  # type: ignore[method-assign]
            reader, writer = await asyncio.open_connection(HOST, link.port)
            await _echo_roundtrip(reader, writer)  # the handshake paid
            await asyncio.sleep(0.3)  # idle: the next chunk draws afresh
            sent: list[float] = []
            lags: list[float] = []

            async def receive() -> None:
                got = b""
                while len(got) < 40:
                    got += await reader.read(2)
                    now = time.perf_counter()
                    lags.extend(now - sent[k] for k in range(len(lags), len(got) // 2))

            receiving = asyncio.create_task(receive())
            for k in range(20):
                sent.append(time.perf_counter())
                writer.write(b"%02d" % k)
                await writer.drain()
                await asyncio.sleep(0.005)
            await asyncio.wait_for(receiving, 5)
            writer.close()
            return lags

    lags = asyncio.run(run())
    # Each chunk's own draw: lags of 200 and 300 ms, later chunks waiting for the earlier ones.
    assert max(lags) - min(lags) < 0.075, lags


async def _raw_backend(on_accept: str) -> tuple[asyncio.Server, int]:
    """A backend that closes ("close") or resets ("reset") each connection once it has read."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        if on_accept == "reset":  # SO_LINGER 0: a reset (abort alone sends a FIN)
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        else:
            writer.close()

    server = await asyncio.start_server(handle, HOST, 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("end", ["close", "reset", "refused"])
def test_an_end_crosses_the_link_as_it_happened_one_delay_later(end: str) -> None:
    """A backend's close came through at once, its reset as a clean close, and a refused
    connection was seen in milliseconds however far the replica."""
    async def run() -> tuple[float, BaseException | bytes]:
        if end == "refused":
            server, port = await _raw_backend("close")
            server.close()
            await server.wait_closed()  # nothing listens there now
        else:
            server, port = await _raw_backend(end)
        link = Link(HOST, 0, HOST, port, rtt_ms=200.0, jitter_sd_ms=0.0)
        await link.start()
        try:
            reader, writer = await asyncio.open_connection(HOST, link.port)
            t0 = time.perf_counter()
            writer.write(b"x")
            try:
                result: BaseException | bytes = await asyncio.wait_for(reader.read(10), 5)
            except ConnectionError as exc:
                result = exc
            elapsed = time.perf_counter() - t0
            writer.close()
            return elapsed, result
        finally:
            await link.stop()
            server.close()

    elapsed, result = asyncio.run(run())
    if end == "close":
        assert result == b""  # a FIN ...
    else:
        assert isinstance(result, ConnectionResetError), result  # ... or a reset, as sent
    # The byte went up after the handshake (200 ms) and 100 ms; the end came back 100 ms later.
    want = 0.2 if end == "refused" else 0.4
    assert elapsed > want - 0.02, elapsed
