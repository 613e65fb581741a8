"""`gorgo sim fleet`: replicas answer through their links, and the chaos controls work."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from gorgo.core.fleet import parse_fleet
from gorgo.harness.procs import free_port
from gorgo.sim.fleet import SimFleet


def _spec(ports: list[int], near_ms: float = 2, far_ms: float = 80, name: str = "fleet"):
    """Replica r0 in region near, the others in far, at these RTTs from the proxy."""
    return parse_fleet({
        "name": name,
        "regions": {"near": {"sim": {"rtt_ms": near_ms, "jitter_ms": 0}},
                    "far": {"sim": {"rtt_ms": far_ms, "jitter_ms": 0}}},
        "replicas": [
            {"name": f"r{i}", "engine": "sim", "region": "near" if i == 0 else "far",
             "address": f"127.0.0.1:{p}", "sim": {"profile": "tiny-test"}}
            for i, p in enumerate(ports)
        ],
    })


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, float]:
    t0 = time.perf_counter()
    async with session.get(url) as r:
        await r.read()
        return r.status, (time.perf_counter() - t0) * 1000


@contextlib.asynccontextmanager
async def _controlled(fleet: SimFleet) -> AsyncIterator[str]:
    """``fleet`` started with its chaos control API; yields the API's base URL, stops both."""
    await fleet.start()
    runner = aiohttp.web.AppRunner(fleet.control_app())
    try:
        await runner.setup()
        await aiohttp.web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[-1][1]}"
    finally:
        await runner.cleanup()
        await fleet.stop()


def test_fleet_serves_through_links_and_obeys_controls() -> None:
    async def go() -> None:
        ports = [free_port(), free_port()]
        fleet = SimFleet(_spec(ports), stream_interval=2)
        async with _controlled(fleet) as ctl, aiohttp.ClientSession() as s:
            await _get(s, f"http://127.0.0.1:{ports[1]}/health")  # open the connection
            status, far_ms = await _get(s, f"http://127.0.0.1:{ports[1]}/health")
            # Never faster than the 80 ms link (no jitter; the emulator's timers lead by at
            # most 0.5 ms a direction); the near one (2 ms, a new connection: two round trips)
            # is the baseline for the upper bound, since load slows both alike.
            assert status == 200 and far_ms >= 80.0 - 1.0, far_ms
            status, near_ms = await _get(s, f"http://127.0.0.1:{ports[0]}/health")
            assert status == 200 and near_ms >= 4.0 - 2.0, near_ms
            assert 80.0 * 0.5 < far_ms - near_ms < 80.0 * 2.5, (far_ms, near_ms)
            body = {"model": "m", "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hello " * 20}]}
            async with s.post(f"http://127.0.0.1:{ports[0]}/v1/chat/completions",
                              json=body) as r:
                assert r.status == 200
                assert r.headers["x-gorgo-served-by"] == "r0"
                assert (await r.json())["usage"]["completion_tokens"] == 4
            async with s.post(f"{ctl}/replicas/r0/fail", json={"mode": "503"}) as r:
                assert (await r.json())["fail_mode"] == "503"
            async with s.post(f"http://127.0.0.1:{ports[0]}/v1/chat/completions",
                              json=body) as r:
                assert r.status == 503
            async with s.post(f"{ctl}/replicas/r0/fail", json={"mode": None}) as r:
                assert r.status == 200
            async with s.post(f"{ctl}/replicas/r1/kill") as r:
                assert (await r.json())["up"] is False
            async with aiohttp.ClientSession() as fresh:
                try:
                    status, _ = await _get(fresh, f"http://127.0.0.1:{ports[1]}/health")
                except aiohttp.ClientError:
                    status = 0
                assert status != 200
            async with s.post(f"{ctl}/replicas/r1/revive") as r:
                assert (await r.json())["up"] is True
            async with aiohttp.ClientSession() as fresh:
                status, _ = await _get(fresh, f"http://127.0.0.1:{ports[1]}/health")
                assert status == 200
            async with s.post(f"{ctl}/replicas/nope/kill") as r:
                assert r.status == 404

    asyncio.run(asyncio.wait_for(go(), 30))


@pytest.mark.parametrize(("action", "body", "status", "says"), [
    ("slowdown", {"factor": "x"}, 400, "factor must be a finite number"),
    ("slowdown", {"factor": float("inf")}, 400, "factor must be a finite number"),
    ("slowdown", {"factor": 0}, 400, "factor must be > 0"),
    ("slowdown", {"factor": 10**400}, 400, "factor must be a finite number"),  # was a 500
    ("fail", {"mode": "500"}, 400, "fail mode must be one of"),
    ("partition", {"mode": "nope"}, 400, "partition mode must be one of"),
    ("rtt", {"rtt_ms": -1}, 400, "rtt_ms must be >= 0"),
    ("rtt", {}, 400, "missing 'rtt_ms'"),
    ("slowdown", "not json", 400, "slowdown:"),
    ("slowdown", [1], 400, "a JSON object"),
    ("revive", {}, 409, "r0 is running"),
    ("reboot", {}, 400, "unknown action"),
])
def test_chaos_controls_refuse_what_they_cannot_do(action: str, body: object, status: int,
                                                    says: str) -> None:
    """A bad value is a 400 naming it (they were bare 500s, or accepted and ignored: a fail mode
    of "500" showed in /status and changed nothing; a factor of inf froze the replica for
    good); reviving a running replica a 409. The replica is left as it was."""
    async def go() -> tuple[int, str, dict]:
        fleet = SimFleet(_spec([free_port()]))
        async with _controlled(fleet) as ctl, aiohttp.ClientSession() as s:
            data = body if isinstance(body, str) else json.dumps(body)
            async with s.post(f"{ctl}/replicas/r0/{action}", data=data) as r:
                return r.status, (await r.json())["error"], fleet.status()["r0"]

    got, error, after = asyncio.run(asyncio.wait_for(go(), 30))
    assert got == status and says in error
    assert (after["up"], after["slowdown"], after["fail_mode"], after["partition"]) == (
        True, 1.0, None, None)


def test_fleet_runs_one_region_on_a_bind_host() -> None:
    """A per-region container: only its region's replicas start, and the links listen on the bind
    host even though the fleet address names a host (here `localhost`) that peers dial."""

    async def go() -> None:
        ports = [free_port(), free_port(), free_port()]
        spec = parse_fleet({
            "regions": {"near": {"sim": {"rtt_ms": 2, "jitter_ms": 0}},
                        "far": {"sim": {"rtt_ms": 2, "jitter_ms": 0}}},
            "replicas": [
                {"name": f"r{i}", "engine": "sim", "region": "near" if i == 0 else "far",
                 "address": f"localhost:{p}", "sim": {"profile": "tiny-test"}}
                for i, p in enumerate(ports)
            ],
        })
        fleet = SimFleet(spec, regions=["far"], bind="127.0.0.1")
        await fleet.start()
        try:
            assert sorted(fleet.servers) == ["r1", "r2"]
            assert {link.front_host for link in fleet.links.values()} == {"127.0.0.1"}
            async with aiohttp.ClientSession() as s:
                for p in ports[1:]:
                    status, _ = await _get(s, f"http://127.0.0.1:{p}/health")
                    assert status == 200
                try:
                    status, _ = await _get(s, f"http://127.0.0.1:{ports[0]}/health")
                except aiohttp.ClientError:
                    status = 0
                assert status == 0  # the other region's replica is not served here
        finally:
            await fleet.stop()

    asyncio.run(asyncio.wait_for(go(), 30))


def test_fleet_rejects_an_unknown_region() -> None:
    with pytest.raises(ValueError, match="unknown region 'mars'"):
        SimFleet(_spec([free_port()]), regions=["near", "mars"])


def test_fleet_view_adds_a_link_per_replica_to_the_same_engine() -> None:
    """A proxy per region: the view's addresses reach the same engines over links with the view's
    RTTs, so requests through either proxy's links load one engine."""

    async def go() -> None:
        ports, view_ports = [free_port(), free_port()], [free_port(), free_port()]
        view = _spec(view_ports, near_ms=80, far_ms=2, name="from-far")
        fleet = SimFleet(_spec(ports), stream_interval=2, views=[view])
        await fleet.start()
        try:
            seen = {(name, link.port, link.rtt_ms) for name, link in fleet.view_links}
            assert seen == {("r0", view_ports[0], 80.0), ("r1", view_ports[1], 2.0)}
            body = {"model": "m", "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hello " * 10}]}
            async with aiohttp.ClientSession() as s:
                for port in (ports[0], view_ports[0]):
                    async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                      json=body) as r:
                        assert r.status == 200
                        await r.read()
            assert fleet.status()["r0"]["finished"] == 2
            # A partition cuts the replica off from every proxy (the views' links still served)
            assert fleet._act("r0", "partition", {"mode": "drop"}) is None
            async with aiohttp.ClientSession() as s:
                for port in (ports[0], view_ports[0]):
                    with pytest.raises(aiohttp.ClientError):
                        async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                          json=body) as r:
                            await r.read()
        finally:
            await fleet.stop()

    asyncio.run(asyncio.wait_for(go(), 30))


def test_fleet_rejects_a_view_without_every_replica() -> None:
    ports = [free_port(), free_port()]
    partial = parse_fleet({"regions": {"near": {}}, "replicas": [
        {"name": "r0", "engine": "sim", "region": "near", "address": f"127.0.0.1:{free_port()}",
         "sim": {"profile": "tiny-test"}}]})
    with pytest.raises(ValueError, match="lacks replica 'r1'"):
        SimFleet(_spec(ports), views=[partial])
