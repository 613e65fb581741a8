"""`gorgo extproc`: the ext_proc gRPC server (with the standard gRPC health service), its signal
tasks, its metrics endpoint and, with --otlp, its decision spans."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc.admin import load_admin_token
from extproc.discovery import DnsDiscovery
from extproc.envoy_admin import EnvoyOutcomes
from extproc.http_api import make_app, readiness
from extproc.kv_events import KVEventsClient
from extproc.peers import PeerLink
from extproc.reload import POLL_INTERVAL_S, FleetReloader
from extproc.service import ExtProcService, register
from extproc.signals import Signals
from extproc.telemetry import RouterMetrics, log_event
from extproc.workers import parse_rendered, supervise
from gorgo import shutdown
from gorgo._xds.envoy.service.ext_proc.v3 import external_processor_pb2
from gorgo.core.contract import LIVE_SERVICE
from gorgo.core.discovery import dns_sources, refuse_clusters_file
from gorgo.core.fleet import (
    FleetError,
    FleetSpec,
    host_port,
    load_fleet,
    parse_fleet,
    read_fleet,
)
from gorgo.core.membership import EnvoyView, FleetDiff
from gorgo.core.router import Router
from gorgo.envoy_config import stage_cds, write_cds
from gorgo.errors import (
    LOG_LEVELS,
    UserError,
    address_arg,
    at_least,
    bind_error,
    check_port,
    port_number,
    port_or_off,
)

log = logging.getLogger("gorgo.extproc")
GRPC_HINT = "free it or pick another --port (0 = any free port)"
METRICS_HINT = "free it or pick another --metrics-port (0 = any free port, -1 = off)"
# Next to the gRPC port, and outside Prometheus' exporter range (9100-9999: 9100 is node_exporter).
METRICS_PORT = 50052
# The gRPC health service answers for the server ("") and for the ext_proc service by name, as the
# endpoint-picker protocol's gateways check it; its status follows /readyz, rechecked this often.
EXTPROC_SERVICE = external_processor_pb2.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
HEALTH_INTERVAL_S = 1.0
# A drain ends once no stream has been open for this long: longer than Envoy's health check
# interval (EXTPROC_HEALTH_INTERVAL), so an Envoy that checks has seen NOT_SERVING and sends its
# new streams elsewhere before the port closes.
DRAIN_QUIET_S = 1.5
DRAIN_S = 20.0  # default --drain-s: under Kubernetes' default 30 s termination grace
# --workers at most this many per core: a router is one busy core at most (100,000 started 256
# processes, the machine's load at 84, before any stop could end them)
MAX_WORKERS_PER_CORE = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fleet", required=True, help="fleet YAML file")
    p.add_argument("--host", default="127.0.0.1", help="gRPC bind address (default loopback)")
    p.add_argument("--port", type=port_number, default=50051, help="gRPC port for Envoy (0 = any)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="HTTP bind address")
    p.add_argument("--metrics-port", type=port_or_off, default=METRICS_PORT,
                   help="HTTP port for /metrics and /admin (0 = any, -1 = off)")
    p.add_argument("--admin-token-file", default=None,
                   help="file holding the bearer token of /admin/weights (else $GORGO_ADMIN_TOKEN;"
                        " neither: the admin API answers 403)")
    p.add_argument("--otlp", type=address_arg, default=None,
                   help="OTLP/gRPC collector HOST:PORT for the router's decision spans "
                        "(default: none exported)")
    p.add_argument("--envoy-admin", type=address_arg, default=None,
                   help="Envoy admin HOST:PORT, read for each replica's errors and ejections "
                        "when the fleet skips the response-headers round trip "
                        "(extproc.response_headers: skip): required then, refused otherwise")
    p.add_argument("--workers", type=int, default=1,
                   help="router processes, each on its own gRPC port (PORT and up, skipping "
                        "the metrics port; the start prints them all: list them in `gorgo "
                        "envoy-config --extproc`), under one supervisor that owns the "
                        "metrics/admin port (default 1; 0 = one per core)")
    p.add_argument("--cds-file", default=None,
                   help="cluster mode with membership changes: the clusters file Envoy watches "
                        "(`gorgo envoy-config --cds-file`), rewritten atomically on each reload")
    # a worker of `--workers N` other than worker 0: it keeps the clusters file's rules (what
    # it refuses to remove) but leaves the writing to worker 0, so one writer orders the file
    p.add_argument("--cds-read-only", action="store_true", help=argparse.SUPPRESS)
    # worker 0 started again: its first write waits for the fleet its peers run (the file alone
    # would drop, for a moment or for good, the clusters of the replicas added through the API)
    p.add_argument("--cds-defer", action="store_true", help=argparse.SUPPRESS)
    # a worker of `--workers N`: the fleet document the supervisor started with, which Envoy
    # was rendered from, on stdin (a restarted worker's file may say otherwise by then)
    p.add_argument("--rendered-fleet-stdin", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--drain-s", type=at_least(0.0, float), default=DRAIN_S,
                   help="on SIGTERM/SIGINT, keep serving the streams Envoy has open (and new "
                        "ones, until its health check sees the drain) for at most this long "
                        f"(default {DRAIN_S:g}; 0 = stop at once; a second signal cuts it short; "
                        "with --workers, each worker's)")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)


class ExtProcServer:
    """Everything one router process runs; usable in-process by tests and the demo."""

    def __init__(
        self, router: Router, admin_token: str | None = None, otlp: str | None = None,
        envoy_admin: str | None = None, fleet_path: str | None = None,
        cds_file: str | None = None, discovery: DnsDiscovery | None = None,
        cds_write: bool = True, rendered: FleetSpec | None = None,
    ) -> None:
        """``fleet_path``: the fleet file, reloaded on SIGHUP, on change and through the admin
        API; ``cds_file``: the clusters file Envoy watches, rewritten on every reload (by this
        process unless ``cds_write`` is off: with ``--workers``, worker 0 writes it and every
        worker keeps its rules); ``rendered``: the fleet Envoy was rendered from (default: the
        router's start fleet), whose fail-open cluster the clusters file keeps, whose static
        clusters are all there is without one, and whose ext_proc mode Envoy runs;
        ``discovery``: the file's DNS names as resolved for ``router`` (default: resolved here),
        whose changed answers are applied as reloads."""
        self.router = router
        self.admin_token = admin_token
        self.metrics = RouterMetrics(router.state, lambda: router.open_requests, otlp)
        self.service = ExtProcService(router, self.metrics)
        self.signals = Signals(router, self.metrics)
        self.kv_events = (KVEventsClient(router, self.metrics)
                          if router.state.precise is not None else None)
        self.outcomes = EnvoyOutcomes(router, envoy_admin) if envoy_admin else None
        self.peers = PeerLink(router, self.metrics) if router.spec.sharing is not None else None
        self.cds_file = cds_file
        self.cds_write = cds_write
        self._cds_behind = False  # the last write failed: the file is tried again each poll
        # What a reload is checked against (`check_reloadable`): Envoy's fail-open cluster, its
        # static clusters and its modes stay what its bootstrap was rendered with.
        router.envoy = EnvoyView(rendered or router.spec, clusters_file=cds_file is not None)
        if discovery is None and fleet_path is not None:
            discovery = DnsDiscovery(fleet_path)
        self.discovery = discovery
        if discovery is None:
            self.reloader = FleetReloader(router, self.metrics, self.apply_fleet, None, parse_fleet)
        else:
            discovery.on_change = self._dns_changed
            self.reloader = FleetReloader(router, self.metrics, self.apply_fleet, discovery.path,
                                          self._parse_discovered, discovery.follow,
                                          start=(discovery.raw, discovery.stamp))
        self._watch_task: asyncio.Task | None = None
        self.health = health.aio.HealthServicer()
        self._health_task: asyncio.Task | None = None
        self.grpc_port = 0
        self.metrics_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None

    async def start(
        self, host: str, port: int, metrics_host: str = "127.0.0.1", metrics_port: int = 0
    ) -> None:
        """Listen on both ports (a port in use is a UserError); `stop` undoes a failed start."""
        grpc_what = f"the ext_proc gRPC server on {host}:{port}"
        metrics_what = f"the metrics endpoint on {metrics_host}:{metrics_port}"
        check_port(host, port, grpc_what, GRPC_HINT)
        if metrics_port > 0:
            check_port(metrics_host, metrics_port, metrics_what, METRICS_HINT)
        self._grpc = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", self.router.spec.limits.max_body_bytes + 65536),
            ("grpc.max_concurrent_streams", 10000),
            ("grpc.so_reuseport", 0),  # else a second router would silently share the port
        ])
        register(self.service, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        try:
            # an IPv6 host in brackets, as gRPC reads it (`--host ::` failed to bind)
            self.grpc_port = self._grpc.add_insecure_port(host_port(host, port))
        except RuntimeError:  # "Failed to bind": the port was taken since check_port
            self.grpc_port = 0
        if not self.grpc_port:
            raise UserError(f"cannot listen for {grpc_what}; {GRPC_HINT}")
        await self._grpc.start()
        await self.health.set(LIVE_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        if metrics_port >= 0:
            self._http = web.AppRunner(make_app(self.metrics, self.router, self.admin_token,
                                                 self.ready, self.reloader), access_log=None)
            await self._http.setup()
            site = web.TCPSite(self._http, metrics_host, metrics_port)
            try:
                await site.start()
            except OSError as exc:
                raise bind_error(exc, metrics_what, METRICS_HINT) from None
            self.metrics_port = self._http.addresses[-1][1]
        await self.signals.start()
        if self.kv_events is not None:
            await self.kv_events.start()
        if self.outcomes is not None:
            await self.outcomes.start()
        if self.peers is not None:
            await self.peers.start()
        await self.metrics.spans.start()
        self._health_task = asyncio.create_task(self._serve_health())
        if self.reloader.path is not None:
            self._watch_task = asyncio.create_task(self._watch_fleet())
        if self.discovery is not None:
            self.discovery.start()  # re-resolves the fleet's discover: names

    def _parse_discovered(self, doc: Any, source: str) -> FleetSpec:
        """`DnsDiscovery.parse`, refusing ``discover:`` entries under a clusters file."""
        if self.cds_file is not None:
            refuse_clusters_file(dns_sources(doc, source), source)
        assert self.discovery is not None
        return self.discovery.parse(doc, source)

    def _dns_changed(self, spec: FleetSpec, added: list[str], removed: list[str]) -> None:
        """A DNS answer changed: the running document with the new answers, as a reload (an
        added replica routable after its first probe, every other one keeping its state)."""
        self.reloader.apply_spec(self.reloader.doc, spec, "dns")

    def apply_fleet(self, spec: FleetSpec) -> FleetDiff:
        """Take on a new fleet (FleetError: nothing changed): the router first, then what reads
        its state, then the CDS file, so Envoy learns an added cluster while the new replica
        still waits for its first probe, and drops a removed one once nothing routes there."""
        self.router.check_reload(spec)  # refused before the clusters file is touched
        staged = None
        if self.cds_file is not None and self.cds_write:
            # Written before the router takes the fleet on, renamed over the file after: a file
            # that cannot be written refuses the change (it was taken on and answered 200, and
            # Envoy never learnt of an added replica).
            try:
                staged = stage_cds(spec, self.cds_file)
            except OSError as exc:
                raise FleetError(f"clusters file: cannot write {self.cds_file}: "
                                 f"{exc.strerror}; the fleet is unchanged") from None
        try:
            diff = self.router.reload(spec)
        except BaseException:
            if staged is not None:
                staged.unlink(missing_ok=True)
            raise
        try:
            self.service.reloaded()
            self.signals.reloaded()
            self.metrics.rebind(self.router.state, list(diff.removed))
        finally:  # the router runs the new fleet: Envoy's clusters follow it whatever else fails
            if staged is not None:
                self._replace_cds(staged)
        return diff

    def _replace_cds(self, staged: Path | None = None) -> None:
        """Put the clusters file for the running fleet in place (``staged``: already written);
        a failure is counted and logged, and tried again at the next poll of the fleet file."""
        assert self.cds_file is not None
        try:
            if staged is None:
                write_cds(self.router.spec, self.cds_file)
            else:
                os.replace(staged, self.cds_file)
            self._cds_behind = False
        except OSError as exc:
            if staged is not None:
                staged.unlink(missing_ok=True)
            self._cds_behind = True
            self.metrics.fleet_reloads.labels("cds_error").inc()
            log_event(log, "cds_write_failed", logging.ERROR, path=self.cds_file,
                      error=exc.strerror)

    async def _watch_fleet(self) -> None:
        while True:
            await asyncio.sleep(POLL_INTERVAL_S)
            if self._cds_behind:
                self._replace_cds()
            self.reloader.poll()

    def ready(self) -> dict[str, bool]:
        return readiness(self.router, self.signals)

    async def _serve_health(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        while True:
            status = serving if all(self.ready().values()) else not_serving
            for service in ("", EXTPROC_SERVICE):
                await self.health.set(service, status)
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def drain(self, limit_s: float, cut: asyncio.Event | None = None) -> None:
        """Stop as Envoy's streams allow: NOT_SERVING at once (an Envoy health-checking its
        ext_proc cluster stops opening streams here within a second), every other part still
        running, until no stream awaits an answer of the router and none has opened for
        DRAIN_QUIET_S, or ``limit_s`` has passed (a stream whose last message was answered only
        waits for its response to end, which a stop does not cut). A
        stream cut by the stop fails its request in full-duplex mode (Envoy cannot fail open
        once the body went to the router), so a rolling restart must not cut them. ``cut``
        set (a second stop signal: Ctrl-C twice) ends the drain at once."""
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            self._health_task = None
        await self.health.enter_graceful_shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        svc = self.service
        # Quiet counts from the drain's start at the earliest: an idle router closed its port
        # 30 ms after the signal, before Envoy's health check could see NOT_SERVING.
        began = time.monotonic()
        while loop.time() < deadline and not (cut is not None and cut.is_set()):
            quiet = time.monotonic() - max(svc.last_opened, began)
            if svc.pending_streams == 0 and quiet >= DRAIN_QUIET_S:
                return
            await asyncio.sleep(min(0.05, max(deadline - loop.time(), 0.0)))
        if svc.pending_streams:  # a limit under DRAIN_QUIET_S with none open cuts nothing
            log_event(log, "drain_cut", logging.WARNING, pending_streams=svc.pending_streams,
                      after_s=round(limit_s - max(deadline - loop.time(), 0.0), 3))

    async def stop(self, grace: float = 1.0) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        if self._watch_task is not None:
            self._watch_task.cancel()
            await asyncio.gather(self._watch_task, return_exceptions=True)
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            await self.health.enter_graceful_shutdown()
        if self.kv_events is not None:
            await self.kv_events.stop()
        if self.outcomes is not None:
            await self.outcomes.stop()
        await self.signals.stop()
        await self.metrics.spans.stop()
        if self._http is not None:
            await self._http.cleanup()
        if self._grpc is not None:
            # gRPC prints a bare traceback for each stream the stop cancels (those open past
            # the drain, counted by `drain_cut`); logging keeps its own handle on stderr.
            with contextlib.redirect_stderr(io.StringIO()):
                await self._grpc.stop(grace)
                await asyncio.sleep(0)
        if self.peers is not None:
            # Every request still open (cut streams, bookings held past their stream) is closed
            # for the peers: stopped first, the link lost those closes, and every rolling
            # restart left the peers counting the answers then streaming for the request timeout.
            self.router.complete_all()
            await self.peers.flush()
            await self.peers.stop()


async def serve(args: argparse.Namespace, spec: FleetSpec, token: str | None,
                discovery: DnsDiscovery | None = None,
                rendered: FleetSpec | None = None) -> int:
    stop, again = asyncio.Event(), asyncio.Event()

    def on_stop() -> None:  # the first signal drains, a second one cuts the drain short
        (again if stop.is_set() else stop).set()

    shutdown.on_stop(on_stop)  # first: a signal during the start still stops in order
    # bounded whatever the policy models: an unbounded prefix index grows with every prompt
    router_id = os.urandom(3).hex()  # also this process's random draws (`random`, `irb`)
    router = Router(spec, id_prefix=router_id, salt=router_id, unbounded_prefix=False)
    server = ExtProcServer(router, admin_token=token, otlp=args.otlp,
                           envoy_admin=args.envoy_admin, fleet_path=args.fleet,
                           cds_file=args.cds_file, discovery=discovery,
                           cds_write=not args.cds_read_only, rendered=rendered)
    if args.cds_file and not (args.cds_read_only or args.cds_defer):
        write_cds(spec, args.cds_file)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, _reload_on_hup, server)
    try:
        await server.start(args.host, args.port, args.metrics_host, args.metrics_port)
    except BaseException:
        await server.stop(0)
        raise
    log_event(log, "router_started", fleet=spec.name, replicas=len(spec.replicas),
              policy=spec.policy, grpc=f"{args.host}:{server.grpc_port}",
              metrics=f"{args.metrics_host}:{server.metrics_port}",
              admin_api="enabled" if token else "disabled", spans=args.otlp or "off")
    if token and args.metrics_host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("admin API reachable on %s: keep its token secret and the port firewalled",
                    args.metrics_host)
    print(f"READY grpc={server.grpc_port} metrics={server.metrics_port}", flush=True)
    await stop.wait()
    # SIGHUP still reloads while the streams drain, then does nothing (its default action
    # would end the process before it stopped in order)
    await server.drain(args.drain_s, again)
    loop.add_signal_handler(signal.SIGHUP, lambda: None)
    await server.stop()
    return 0


def _reload_on_hup(server: ExtProcServer) -> None:
    with contextlib.suppress(FleetError):  # logged and counted; the old fleet routes on
        server.reloader.reload_file("SIGHUP")


class _StreamsCut(logging.Filter):
    """gRPC logs a traceback for each stream a stop cancels (those still open past --drain-s):
    the drain already said how many (`drain_cut`), and gorgo.shutdown lets no traceback of a
    stop reach the terminal."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


def main(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT (0); a bad fleet, token file or port is a UserError."""
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("grpc._cython.cygrpc").addFilter(_StreamsCut())
    # Everything but the DNS answers is checked before a wait for them (a bad flag waited with
    # the router until the pods came up, then crash-looped): the file in its unresolved form.
    unresolved = load_fleet(args.fleet)
    rendered = None
    if args.rendered_fleet_stdin:  # from the supervisor, which parsed it already
        rendered = parse_rendered(sys.stdin.read(), "rendered fleet")
    if args.cds_file:
        source = Path(args.fleet).name
        refuse_clusters_file(dns_sources(read_fleet(args.fleet), source), source)
    token = load_admin_token(args.admin_token_file)
    if unresolved.extproc.skip_response_headers and not args.envoy_admin:
        raise UserError("the fleet skips the response-headers round trip "
                        "(extproc.response_headers: skip): pass --envoy-admin HOST:PORT so the "
                        "router still learns each replica's errors")
    if args.envoy_admin and not unresolved.extproc.skip_response_headers:
        # The router reads every answer's status itself: Envoy's counters of the same answers
        # counted each failure twice (a replica ejected after two 503s, not three).
        raise UserError("--envoy-admin is for a fleet that skips the response-headers round "
                        "trip (extproc.response_headers: skip); this one sends them, and the "
                        "router reads each answer's status from them: drop --envoy-admin")
    workers = args.workers if args.workers > 0 else (os.cpu_count() or 1)
    most = MAX_WORKERS_PER_CORE * (os.cpu_count() or 1)
    if not 0 <= args.workers <= most:
        raise UserError(f"--workers must be 0 (one per core) to {most} ({MAX_WORKERS_PER_CORE} "
                        f"per core), got {args.workers}")
    # The fleet file, its discover: names resolved (waiting, not ready, until one answers; the
    # file is read again on each try, which a SIGHUP would ask for: ignored until serving).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    discovery = DnsDiscovery(args.fleet, wait=time.sleep)
    if workers > 1:
        return asyncio.run(supervise(args, workers, token))
    return asyncio.run(serve(args, discovery.spec, token, discovery, rendered))
