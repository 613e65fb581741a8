"""The runners: decision latency in-process and over gRPC, the process stack they share (upstream
Envoy, `gorgo extproc`, the no-op ext_proc, one front Envoy per path), and the added latency at
concurrency 1."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import http.client
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import yaml

from extproc import messages
from extproc.service import ExtProcService, _Stream
from extproc.telemetry import RouterMetrics
from gorgo._xds.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from gorgo._xds.envoy.service.ext_proc.v3.external_processor_pb2_grpc import (
    ExternalProcessorServicer,
    ExternalProcessorStub,
    add_ExternalProcessorServicer_to_server,
)
from gorgo.core.contract import REPLICA_HEADER
from gorgo.core.fleet import LINK_PRESETS, FleetSpec, load_fleet
from gorgo.core.router import Router
from gorgo.core.state import FleetState
from gorgo.envoy_config import EXTPROC_CLUSTER, render_bootstrap
from gorgo.harness.envoy_proc import EnvoyProcess
from gorgo.harness.procs import (
    GorgoProcess,
    free_port,
    spawn,
    stop_group,
    stopped_on_failure,
    wait_for,
)

from . import ROOT
from .stats import Dist, metric_values
from .workload import (
    CHAT_PATH,
    EXTPROC_MODES,
    KB,
    N_REPLICAS,
    NOOP_PATHS,
    PATHS,
    RESPONSE_HEADERS,
    ROUTED_PATHS,
    SIZES,
    WORKERS,
    Workload,
    bench_fleet,
    body_msg,
    cached_share,
    headers_msg,
)

EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
FRONT_CONCURRENCY = 2  # Envoy worker threads in front: one per core of the bench machine
UPSTREAM_CONCURRENCY = 1
CHAT_REPLY = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 2048, "completion_tokens": 1, "total_tokens": 2049},
}, separators=(",", ":"))
ENGINE_METRICS = (
    'sglang:num_queue_reqs{model_name="m"} 0\n'
    'sglang:num_running_reqs{model_name="m"} 1\n'
    'sglang:token_usage{model_name="m"} 0.2\n'
)
NOOP_ANSWERS = {
    "request_headers": messages.CONTINUE_REQUEST_HEADERS,
    "request_body": messages.CONTINUE_REQUEST_BODY,
    "response_headers": messages.CONTINUE_RESPONSE_HEADERS,
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
}


# --- 1a. in-process decision latency ------------------------------------------------------------


@dataclass
class InProcess:
    handler: dict[int, Dist]
    wire: dict[int, Dist]
    cpu: dict[int, Dist]
    cached: dict[int, float]
    apart: dict[int, Dist]  # the handler with IDLE_GAP_S between decisions


# At concurrency 1 the router idles between decisions while Envoy and the client run: its caches
# and core go cold, and a decision costs 2-3x what it costs back to back (docs/benchmarks.md).
IDLE_GAP_S = 0.003


def _route_and_release(svc: ExtProcService, body: bytes) -> pb.ProcessingResponse:
    st = _Stream()
    svc._on_request_headers(st, headers_msg(body).request_headers)
    answer = svc._on_request_body(st, body_msg(body))
    if st.decision is not None:
        svc.router.complete(st.decision.id)
    return answer


def scrape(s: FleetState, now: float) -> None:
    """Every engine's scrape as of ``now``: a few requests queued on some, four running on each."""
    for i in range(s.n):
        s.observe_engine(i, now, queue_reqs=float(i % 3), running_reqs=4.0, kv_usage=0.3)


def primed_service(spec: FleetSpec, clock: Callable[[], float] = time.monotonic,
                   **router_kw: Any) -> ExtProcService:
    """A servicer over a new router on ``spec`` whose replicas are all probed (their regions'
    link RTTs) and scraped, so every one is routable and scored from the first request."""
    router = Router(spec, **router_kw)
    s = router.state
    for i in range(s.n):
        s.observe_rtt(i, LINK_PRESETS[spec.replicas[i].region][0])
    scrape(s, clock())
    return ExtProcService(router, RouterMetrics(s, lambda: router.open_requests), clock=clock)


def run_in_process(spec: FleetSpec, wl: Workload, iterations: int) -> InProcess:
    """Time `ExtProcService`'s body handler with a prebuilt request, releasing each decision."""
    svc = primed_service(spec, id_prefix="bench")
    router = svc.router
    for body in wl.warm:
        _route_and_release(svc, body)
    out = InProcess({}, {}, {}, {}, {})
    for size, bodies in wl.measured.items():
        hdr_msgs = [headers_msg(b).request_headers for b in bodies]
        body_reqs = [body_msg(b) for b in bodies]
        raw_reqs = [r.SerializeToString() for r in body_reqs]
        handler_ns: list[int] = []
        wire_ns: list[int] = []
        cpu_ns: list[int] = []  # CPU time of the wire variant: what preemption cannot inflate
        cached: list[float] = []
        for k in range(iterations):
            j = k % len(bodies)
            st = _Stream()
            svc._on_request_headers(st, hdr_msgs[j])
            if k % 2 == 0:  # the handler alone, on the request gRPC already decoded
                t0 = time.perf_counter_ns()
                answer = svc._on_request_body(st, body_reqs[j])
                handler_ns.append(time.perf_counter_ns() - t0)
            else:  # plus what gRPC does around it: decode the message, encode the answer
                c0 = time.thread_time_ns()
                t0 = time.perf_counter_ns()
                req = pb.ProcessingRequest.FromString(raw_reqs[j])
                answer = svc._on_request_body(st, req)
                answer.SerializeToString()
                wire_ns.append(time.perf_counter_ns() - t0)
                cpu_ns.append(time.thread_time_ns() - c0)
            if st.decision is None:
                raise RuntimeError(f"no decision for a {size}-byte body: {answer}")
            cached.append(cached_share(answer))
            router.complete(st.decision.id)
        apart_ns: list[int] = []
        for k in range(max(iterations // 8, 1)):
            j = k % len(bodies)
            st = _Stream()
            svc._on_request_headers(st, hdr_msgs[j])
            time.sleep(IDLE_GAP_S)
            t0 = time.perf_counter_ns()
            svc._on_request_body(st, body_reqs[j])
            apart_ns.append(time.perf_counter_ns() - t0)
            if st.decision is not None:
                router.complete(st.decision.id)
        out.apart[size] = Dist.of(np.array(apart_ns) / 1e6)
        out.handler[size] = Dist.of(np.array(handler_ns) / 1e6)
        out.wire[size] = Dist.of(np.array(wire_ns) / 1e6)
        out.cpu[size] = Dist.of(np.array(cpu_ns) / 1e6)
        out.cached[size] = float(np.mean(cached))
    if router.open_requests:
        raise RuntimeError(f"{router.open_requests} decisions left open")
    return out


# --- processes ----------------------------------------------------------------------------------


def upstream_bootstrap(ports: list[int], admin_port: int) -> dict[str, Any]:
    """One Envoy playing every replica: /health, sglang /metrics, and a tiny chat completion."""
    t = "type.googleapis.com/envoy.extensions."

    def direct(prefix: str, body: str, ctype: str) -> dict[str, Any]:
        return {"match": {"prefix": prefix},
                "direct_response": {"status": 200, "body": {"inline_string": body}},
                "response_headers_to_add": [{"header": {"key": "content-type", "value": ctype}}]}

    hcm = {
        "@type": t + "filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "engine",
        "codec_type": "AUTO",
        "route_config": {"name": "engine", "virtual_hosts": [{
            "name": "engine", "domains": ["*"], "routes": [
                direct("/health", "ok", "text/plain"),
                direct("/metrics", ENGINE_METRICS, "text/plain; version=0.0.4"),
                direct("/", CHAT_REPLY, "application/json"),
            ]}]},
        "http_filters": [
            {"name": "envoy.filters.http.buffer",  # read the whole body first, as an engine does
             "typed_config": {"@type": t + "filters.http.buffer.v3.Buffer",
                              "max_request_bytes": 1024 * KB}},
            {"name": "envoy.filters.http.router",
             "typed_config": {"@type": t + "filters.http.router.v3.Router"}},
        ],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                 "port_value": admin_port}}},
        "static_resources": {"listeners": [{
            "name": f"engine{k}",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
        } for k, port in enumerate(ports)]},
    }


def without_ext_proc(bootstrap: dict[str, Any]) -> dict[str, Any]:
    """The same bootstrap minus the ext_proc filter and its cluster: plain Envoy routing."""
    boot = copy.deepcopy(bootstrap)
    res = boot["static_resources"]
    for chain in res["listeners"][0]["filter_chains"]:  # trusted peers' chain too
        hcm = chain["filters"][0]["typed_config"]
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != EXT_PROC_FILTER]
    res["clusters"] = [c for c in res["clusters"] if c["name"] != EXTPROC_CLUSTER]
    return boot


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM until the block ends, then raise KeyboardInterrupt if one came."""
    got: list[int] = []
    sigs = (signal.SIGINT, signal.SIGTERM)
    old = {s: signal.signal(s, lambda signum, _f: got.append(signum)) for s in sigs}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if got:
            raise KeyboardInterrupt(f"signal {got[0]}")


class NoopExtProc(ExternalProcessorServicer):
    """Answers every message with 'continue': what a Python gRPC ext_proc costs doing nothing."""

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        async for req in request_iterator:
            yield NOOP_ANSWERS[req.WhichOneof("request")]


async def serve_noop(port: int) -> None:
    """The no-op server, configured as `gorgo extproc` configures its gRPC server."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 2 * max(SIZES)),
                                      ("grpc.max_concurrent_streams", 10000)])
    add_ExternalProcessorServicer_to_server(NoopExtProc(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("READY", flush=True)
    await server.wait_for_termination()


class NoopProcess:
    """This bench re-run (`python -m bench.dataplane --serve-noop PORT`) as the no-op ext_proc
    server, in its own process group."""

    def __init__(self, port: int) -> None:
        self.p = spawn([sys.executable, "-m", "bench.dataplane", "--serve-noop", str(port)],
                       cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        with stopped_on_failure(self.stop):
            line = self.p.stdout.readline()
            if not line.startswith("READY"):
                raise RuntimeError(f"no-op ext_proc did not start: {line}{self.p.stdout.read()}")

    def stop(self) -> None:
        stop_group(self.p)


@dataclass
class Stack:
    """Upstream Envoy, the routers (`gorgo extproc` per routed path), the no-op ext_proc, and one
    front Envoy per path."""

    upstream: EnvoyProcess
    extprocs: dict[str, GorgoProcess]  # routed path -> its router (a supervisor with workers)
    noop: NoopProcess
    fronts: dict[str, EnvoyProcess]
    ports: dict[str, int]
    grpc_port: int  # the one-worker router's, for the gRPC decision bench
    metrics_ports: dict[str, int]

    def processor_pids(self, path: str) -> list[int]:
        """The processes that serve ``path``'s ext_proc: a router and its workers, or the no-op."""
        if path in NOOP_PATHS:
            return [self.noop.p.pid]
        if path not in self.extprocs:
            return []
        pid = self.extprocs[path].p.pid
        children = Path(f"/proc/{pid}/task/{pid}/children")
        return [pid, *(int(c) for c in children.read_text().split())]


def start_stack(stack: contextlib.ExitStack, tmp: Path) -> Stack:
    engine_ports = [free_port() for _ in range(N_REPLICAS)]
    upstream = EnvoyProcess(upstream_bootstrap(engine_ports, free_port()),
                            concurrency=UPSTREAM_CONCURRENCY)
    stack.callback(upstream.stop)
    upstream.start()
    addresses = [f"127.0.0.1:{p}" for p in engine_ports]
    ports = {path: free_port() for path in PATHS}
    admins = {path: free_port() for path in PATHS}
    noop_port = free_port()
    extprocs: dict[str, GorgoProcess] = {}
    fleets: dict[str, Path] = {}
    for path in (*ROUTED_PATHS, *NOOP_PATHS):
        fleets[path] = tmp / f"fleet-{path}.yaml"
        fleets[path].write_text(yaml.safe_dump(
            bench_fleet(addresses, probe_s=1.0, extproc=EXTPROC_MODES.get(path))))
    with _signals_deferred():  # the processes exist before their handles: register them first
        for path in ROUTED_PATHS:
            args = ["extproc", "--fleet", str(fleets[path]), "--port", "0",
                    "--metrics-port", "0", "--log-level", "WARNING",
                    "--workers", str(WORKERS[path])]
            if path in EXTPROC_MODES:  # response headers skipped: errors from Envoy's admin API
                args += ["--envoy-admin", f"127.0.0.1:{admins[path]}"]
            extprocs[path] = GorgoProcess(args, timeout=60)
            stack.callback(extprocs[path].stop)
        noop = NoopProcess(noop_port)
        stack.callback(noop.stop)
    metrics_ports = {path: int(p.field("metrics")) for path, p in extprocs.items()}
    grpc = {path: p.field("grpc") for path, p in extprocs.items()}
    fronts = {}
    for path, port in ports.items():
        spec = load_fleet(fleets.get(path, fleets["routed"]))
        workers = grpc[path].split(",") if path in grpc else [str(noop_port)]
        boot = render_bootstrap(
            spec, listen=f"127.0.0.1:{port}", admin=f"127.0.0.1:{admins[path]}",
            extproc=",".join(f"127.0.0.1:{w}" for w in workers))
        fronts[path] = EnvoyProcess(boot if path != "alone" else without_ext_proc(boot),
                                    concurrency=FRONT_CONCURRENCY)
        stack.callback(fronts[path].stop)
        fronts[path].start()

    def rtt_known() -> bool:
        for path, port in metrics_ports.items():
            vals = metric_values(port, "gorgo_rtt_seconds")
            if len(vals) != N_REPLICAS * WORKERS[path] or not all(v == v for v in vals):
                return False
        return True

    if not wait_for(rtt_known, 30):
        raise RuntimeError("a gorgo extproc never measured every replica's RTT")
    return Stack(upstream, extprocs, noop, fronts, ports, int(grpc["routed"]), metrics_ports)


# --- 1b. decision latency over gRPC -------------------------------------------------------------


@dataclass
class OverGrpc:
    rtt: dict[int, Dist]  # body message -> answer, per body size
    cached: dict[int, float]
    request_headers: Dist  # opening a stream with the headers message -> CONTINUE
    response_headers: Dist  # response headers -> tagging answer


async def _one_stream(
    stub: ExternalProcessorStub, hdr: pb.ProcessingRequest, body: pb.ProcessingRequest
) -> tuple[tuple[float, float, float], pb.ProcessingResponse]:
    """One request as Envoy sends it: request headers, the buffered body, response headers.

    Returns the ms from writing each message to reading its answer, and the body's answer.
    """
    call = stub.Process()
    times = []
    answer = None
    for msg in (hdr, body, RESPONSE_HEADERS):
        t0 = time.perf_counter()
        await call.write(msg)
        got = await call.read()
        times.append((time.perf_counter() - t0) * 1000)
        if msg is body:
            answer = got
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:  # stream end releases the decision
        pass
    return (times[0], times[1], times[2]), answer


async def _grpc_bench(port: int, wl: Workload, iterations: int) -> OverGrpc:
    limit = 2 * max(SIZES) + 65536
    opts = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) as channel:
        stub = ExternalProcessorStub(channel)
        for body in wl.warm:
            await _one_stream(stub, headers_msg(body), body_msg(body))
        out = OverGrpc({}, {}, Dist(0, 0, 0, 0), Dist(0, 0, 0, 0))
        first: list[float] = []
        last: list[float] = []
        for size, bodies in wl.measured.items():
            msgs = [(headers_msg(b), body_msg(b)) for b in bodies]
            times, cached = [], []
            for k in range(iterations):
                (t_hdr, t_body, t_resp), answer = await _one_stream(stub, *msgs[k % len(msgs)])
                if answer is None or not answer.HasField("request_body"):
                    raise RuntimeError(f"unexpected answer to a {size}-byte body: {answer}")
                times.append(t_body)
                first.append(t_hdr)
                last.append(t_resp)
                cached.append(cached_share(answer))
            out.rtt[size] = Dist.of(times)
            out.cached[size] = float(np.mean(cached))
        out.request_headers = Dist.of(first)
        out.response_headers = Dist.of(last)
        return out


def run_over_grpc(st: Stack, wl: Workload, iterations: int) -> OverGrpc:
    return asyncio.run(_grpc_bench(st.grpc_port, wl, iterations))


# --- 2. added end-to-end latency at concurrency 1 -----------------------------------------------


@dataclass
class Added:
    dists: dict[str, Dist]
    unrouted: int  # routed-paths' answers without the router's replica header (fail-open)

    def added(self, path: str, pct: str) -> float:
        return getattr(self.dists[path], pct) - getattr(self.dists["alone"], pct)


def run_added(st: Stack, bodies: list[bytes], rounds: int) -> Added:
    """Sequential requests on keep-alive connections, rotating over the paths and their order."""
    conns = {path: http.client.HTTPConnection("127.0.0.1", port, timeout=10)
             for path, port in st.ports.items()}
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    unrouted = 0
    headers = {"content-type": "application/json"}
    warmup = 50
    try:
        for k in range(rounds + warmup):
            body = bodies[k % len(bodies)]
            order = PATHS[k % len(PATHS):] + PATHS[:k % len(PATHS)]
            for path in order:
                c = conns[path]
                t0 = time.perf_counter()
                c.request("POST", CHAT_PATH, body, headers)
                resp = c.getresponse()
                resp.read()
                dt = (time.perf_counter() - t0) * 1000
                if resp.status != 200:
                    raise RuntimeError(f"{path}: HTTP {resp.status}")
                if k < warmup:  # connections, pools, caches
                    continue
                times[path].append(dt)
                if path in ROUTED_PATHS and resp.getheader(REPLICA_HEADER) is None:
                    unrouted += 1
    finally:
        for c in conns.values():
            c.close()
    return Added({path: Dist.of(t) for path, t in times.items()}, unrouted)
