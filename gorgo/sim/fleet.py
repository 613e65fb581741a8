"""`gorgo sim fleet`: every simulated replica of a fleet, behind its emulated link, in one process.

Each replica with ``engine: sim`` gets an engine server on a private port and a link emulator on
the replica's ``address`` (what Envoy and the router's probes connect to) that delays both
directions by the region's RTT. One asyncio loop runs them all, so the whole fleet fits beside
Envoy and the router on two cores. A small control API (chaos tests, the demo) can stop and restart
an engine, slow it down, make it fail, and partition or re-time a region's links.

In a container deployment each region runs in its own process (``--region``), and the links listen
on ``--bind`` (e.g. 0.0.0.0) because the fleet address is the service name peers dial, not a local
interface.

A proxy per region (``views``): the fleet file's links model the RTT from one proxy region only.
Each other proxy's view of the same fleet is a fleet file with the same replica names, its own
addresses and its regions' RTTs as seen from its region (`gorgo.sim.routers.view_from`); every
replica then gets one more link per view, on that view's address, to the same engine, so each
proxy's probes, scrapes and requests pay its own RTTs while all of them load the same engines.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import tempfile
from collections.abc import Collection, Sequence
from typing import Any

from aiohttp import web

from gorgo import shutdown
from gorgo.core.fleet import FleetSpec, ReplicaSpec, finite_number, load_fleet
from gorgo.core.tokens import Tokenization
from gorgo.errors import (
    LOG_LEVELS,
    UserError,
    bind_error,
    check_port,
    port_or_off,
    positive_number,
)
from gorgo.sim.engine import Engine
from gorgo.sim.engine_server import EngineServer
from gorgo.sim.kv_publish import KVEventPublisher
from gorgo.sim.link import Link
from gorgo.sim.profiles import replica_profile

log = logging.getLogger("gorgo.sim.fleet")


class SimFleet:
    def __init__(
        self, spec: FleetSpec, *, speed: float = 1.0, stream_interval: int = 8, seed: int = 0,
        model: str | None = None, regions: Collection[str] | None = None,
        bind: str | None = None, views: Sequence[FleetSpec] = (),
    ) -> None:
        """``regions`` limits the fleet to those regions' replicas; ``bind`` is the links' listen
        host (default: each replica's address host); ``views`` are other proxies' views of the
        fleet (module docstring)."""
        unknown = sorted(set(regions or ()) - set(spec.region_names))
        if unknown:
            raise ValueError(f"unknown region {unknown[0]!r} (fleet regions: {spec.region_names})")
        self.spec = spec
        self.speed = speed
        self.stream_interval = stream_interval
        self.seed = seed
        self.model = model
        self.bind = bind
        self.tok = Tokenization(spec.chars_per_token, spec.block_tokens)
        self.replicas = [r for r in spec.replicas
                         if r.engine == "sim" and (regions is None or r.region in regions)]
        self.servers: dict[str, EngineServer] = {}
        self.links: dict[str, Link] = {}
        self._regions = {r.name: r for r in spec.regions}
        names = {r.name for r in self.replicas}
        for view in views:
            missing = sorted(names - {r.name for r in view.replicas})
            if missing:
                raise ValueError(f"the view {view.name!r} lacks replica {missing[0]!r} (a view "
                                 "lists every replica of the fleet, under the same names)")
        self.views = tuple(views)
        self.view_links: list[tuple[str, Link]] = []  # (replica, link) of every view
        self._ipc_dir: str | None = None  # sockets of the KV events nobody declared

    def _events(self, r: ReplicaSpec) -> KVEventPublisher | None:
        """A `cache: precise` replica's publisher: at its declared endpoints, else on ipc
        sockets that the router finds through /kv_event_sources (engine restarts keep them)."""
        if r.precise is None:
            return None
        declared = r.precise.kv_events
        if declared is not None:
            return KVEventPublisher(declared.endpoint, declared.replay_endpoint, declared.topic)
        if self._ipc_dir is None:
            self._ipc_dir = tempfile.mkdtemp(prefix="gorgo-kv-")
        base = f"ipc://{self._ipc_dir}/{r.name}"
        return KVEventPublisher(f"{base}.pub", f"{base}.replay")

    def _server(self, r: ReplicaSpec) -> EngineServer:
        assert r.sim is not None
        profile = replica_profile(r.sim)
        events = self._events(r)
        engine = Engine(profile, self.tok, speed=self.speed * r.sim.speed,
                        kv_events=events is not None)
        # The fleet's models when it lists them (the engine then refuses any other name).
        model = r.models[0] if r.models else self.model or profile.name
        return EngineServer(engine, self.tok, model, flavor=r.sim.flavor,
                            stream_interval=self.stream_interval, name=r.name, kv_events=events,
                            served=r.model_names)

    async def start(self) -> None:
        # Links first: their addresses are fixed by the fleet file, while the engines take any
        # free port, which could otherwise be one of those addresses.
        for k, r in enumerate(self.replicas):
            region = self._regions[r.region]
            link = Link(self.bind or r.host, r.port, "127.0.0.1", 0, region.rtt_ms,
                        region.jitter_ms, seed=self.seed * 1000 + k)
            await link.start()
            self.links[r.name] = link
        for v, view in enumerate(self.views, start=1):
            regions = {g.name: g for g in view.regions}
            of_name = {r.name: r for r in view.replicas}
            for k, r in enumerate(self.replicas):
                vr, region = of_name[r.name], regions[of_name[r.name].region]
                link = Link(self.bind or vr.host, vr.port, "127.0.0.1", 0, region.rtt_ms,
                            region.jitter_ms, seed=(self.seed * 1000 + k) * 100 + v)
                await link.start()
                self.view_links.append((r.name, link))
        for r in self.replicas:
            server = self._server(r)
            self.links[r.name].backend_port = await server.start(
                "127.0.0.1", r.sim.port if r.sim else 0)
            self.servers[r.name] = server
        for name, link in self.view_links:
            link.backend_port = self.links[name].backend_port

    async def stop(self) -> None:
        for link in [*self.links.values(), *(link for _, link in self.view_links)]:
            await link.stop()
        for server in self.servers.values():
            await server.stop()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    # --- chaos controls ----------------------------------------------------------------------

    def _act(self, name: str, action: str, body: dict[str, Any]) -> str | None:
        """Apply a control action that needs no await, or check that kill/revive can run;
        returns why it conflicts with the replica's state (409), raises ValueError on a bad
        value (400)."""
        server, link = self.servers[name], self.links[name]
        up = server._runner is not None
        if action == "kill":
            return None if up else f"{name} is not running"
        if action == "revive":
            return f"{name} is running" if up else None
        if action == "slowdown":
            server.slowdown = _number(body.get("factor", 1.0), "factor")
        elif action == "fail":
            server.fail_mode = body.get("mode")
        elif action == "partition":  # cut off from every proxy, the views' too (only the
            for each in self._links_of(name):  # main proxy's link was: the others still served)
                each.set_partition(body.get("mode"))
        elif action == "rtt":
            rtt = _number(body["rtt_ms"], "rtt_ms", 0.0)
            link.set_rtt(rtt, _number(body.get("jitter_ms", 0.0), "jitter_ms", 0.0))
        else:
            raise ValueError("unknown action (known: kill, revive, slowdown, fail, partition, "
                             "rtt)")
        return None

    def _links_of(self, name: str) -> list[Link]:
        """Every link to replica ``name``: the main proxy's, then each view's."""
        return [self.links[name], *(link for n, link in self.view_links if n == name)]

    async def kill(self, name: str) -> None:
        """Stop an engine (connections reset, port closed) until `revive`."""
        await self.servers[name].stop()

    async def revive(self, name: str) -> None:
        r = next(r for r in self.replicas if r.name == name)
        backend = self.links[name].backend_port
        server = self._server(r)
        await server.start("127.0.0.1", backend)
        self.servers[name] = server

    def status(self) -> dict[str, Any]:
        out = {}
        for name, server in self.servers.items():
            m = server.engine.metrics()
            link = self.links[name]
            out[name] = {
                "up": server.port is not None and server._runner is not None,
                "link_port": link.port, "engine_port": server.port, "rtt_ms": link.rtt_ms,
                "partition": link.partition, "slowdown": server.slowdown,
                "fail_mode": server.fail_mode, "waiting": m.num_waiting,
                "running": m.num_running, "finished": m.requests_finished,
            }
        return out

    def control_app(self) -> web.Application:
        async def status(_: web.Request) -> web.Response:
            return web.json_response(self.status())

        async def act(req: web.Request) -> web.Response:
            name, action = req.match_info["name"], req.match_info["action"]
            if name not in self.servers:
                return web.json_response({"error": f"unknown replica {name!r}"}, status=404)
            try:
                body = await req.json() if req.can_read_body else {}
                if not isinstance(body, dict):
                    raise ValueError("the body must be a JSON object")
                conflict = self._act(name, action, body)
                if conflict:
                    return web.json_response({"error": conflict}, status=409)
                if action == "kill":
                    await self.kill(name)
                elif action == "revive":
                    await self.revive(name)
            except (ValueError, TypeError, KeyError) as exc:  # json's errors are ValueErrors
                what = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
                return web.json_response({"error": f"{action}: {what}"}, status=400)
            return web.json_response(self.status()[name])

        app = web.Application()
        app.router.add_get("/status", status)
        app.router.add_post("/replicas/{name}/{action}", act)
        return app


def _number(value: Any, field: str, least: float | None = None) -> float:
    """A finite number (above 0, or at least ``least``), or a ValueError naming ``field``."""
    x = finite_number(value)
    if x is None:
        raise ValueError(f"{field} must be a finite number, got {repr(value)[:40]}")
    if (x < least) if least is not None else (x <= 0):
        raise ValueError(f"{field} must be {'>= ' + str(least) if least is not None else '> 0'}"
                         f", got {value!r}")
    return x


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("fleet", help="fleet YAML file (replicas with engine: sim are started)")
    p.add_argument("--speed", type=positive_number, default=1.0,
                   help="engine speed factor for all replicas")
    p.add_argument("--stream-interval", type=int, default=8, help="tokens per streamed chunk")
    p.add_argument("--seed", type=int, default=0, help="seed of the links' jitter")
    p.add_argument("--model", default=None, help="served model name (default: profile name)")
    p.add_argument("--region", action="append", default=None, metavar="NAME",
                   help="start only this region's replicas (repeatable; default: all regions)")
    p.add_argument("--bind", default=None, metavar="HOST",
                   help="listen host of the links (default: the host of each replica's address; "
                        "0.0.0.0 in a container whose address is its service name)")
    p.add_argument("--view", action="append", default=[], metavar="FLEET",
                   help="another proxy's view of this fleet (same replica names, its own "
                        "addresses and RTTs): one more link per replica (repeatable)")
    p.add_argument("--control-port", type=port_or_off, default=-1,
                   help="loopback port of the chaos control API (0 = any, -1 = off)")
    p.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS)


async def _serve(args: argparse.Namespace, fleet: SimFleet) -> int:
    stop = asyncio.Event()
    shutdown.on_stop(stop.set)  # first: a signal during the start still stops in order
    runner = None
    control = -1
    hint = f"free it or change the replica's address (or sim.port) in {args.fleet}"
    for r in fleet.replicas:  # name the replica; the bind error itself would not
        host = args.bind or r.host
        check_port(host, r.port, f"replica {r.name} on {host}:{r.port}", hint)
    started = {r.name for r in fleet.replicas}
    for view, path in zip(fleet.views, args.view, strict=True):
        for r in (r for r in view.replicas if r.name in started):
            host = args.bind or r.host
            check_port(host, r.port, f"replica {r.name} of the view {path} on {host}:{r.port}",
                       f"free it or change the replica's address in {path}")
    try:
        try:
            await fleet.start()
        except OSError as exc:
            raise bind_error(exc, "a replica", hint) from None
        except ValueError as exc:  # e.g. an unknown sim.profile
            raise UserError(f"{args.fleet}: {exc}") from None
        if args.control_port >= 0:
            runner = web.AppRunner(fleet.control_app(), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", args.control_port)
            try:
                await site.start()
            except OSError as exc:
                raise bind_error(exc, f"the control API on 127.0.0.1:{args.control_port}",
                                 "free it or pick another --control-port (0 = any)") from None
            control = runner.addresses[-1][1]
    except BaseException:
        if runner is not None:
            await runner.cleanup()
        await fleet.stop()
        raise
    print(f"READY replicas={len(fleet.servers)} control={control}", flush=True)
    for name, link in fleet.links.items():
        server = fleet.servers[name]
        print(f"  {name}: {link.front_host}:{link.port} -> engine :{server.port} "
              f"(rtt {link.rtt_ms:.0f} ms, {server.engine.profile.name})", flush=True)
    await stop.wait()
    if runner is not None:
        await runner.cleanup()
    await fleet.stop()
    return 0


def main(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT (0); a bad fleet file, region or port is a UserError."""
    logging.basicConfig(level=args.log_level)
    spec = load_fleet(args.fleet)
    views = [load_fleet(v) for v in args.view]
    try:
        fleet = SimFleet(spec, speed=args.speed, stream_interval=args.stream_interval,
                         seed=args.seed, model=args.model, regions=args.region, bind=args.bind,
                         views=views)
    except ValueError as exc:
        hint = "; give --region one of those" if str(exc).startswith("unknown region") else ""
        raise UserError(f"{exc}{hint}") from None
    return asyncio.run(_serve(args, fleet))
