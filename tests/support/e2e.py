"""A real stack for end-to-end tests: Envoy + `gorgo extproc` + streaming upstreams + OTLP sink.

Everything listens on dynamic loopback ports and `stop_stack` stops every process and server.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import yaml
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from gorgo.core.fleet import load_fleet
from gorgo.envoy_config import render_bootstrap
from gorgo.harness.envoy_proc import EnvoyProcess
from gorgo.harness.procs import GorgoProcess, LoopThread, free_port, wait_for

CHUNKS = 5
CHUNK_GAP_S = 0.08


@dataclass
class Upstream:
    name: str
    port: int = 0
    healthy: bool = True
    failing: bool = False  # answer every chat completion with a 500
    served: list[str] = field(default_factory=list)
    runner: web.AppRunner | None = None
    # When set, every answer holds its last chunk until the event is set (on the stack's loop).
    hold: asyncio.Event | None = None
    # Every chat completion waits this long before its first byte (a long queue or prefill).
    delay_s: float = 0.0

    async def start(self) -> None:
        async def chat(req: web.Request) -> web.StreamResponse:
            raw = await req.read()
            body = json.loads(raw)
            self.served.append(req.path)
            if self.failing:
                return web.json_response({"error": {"message": "down"}}, status=500)
            await asyncio.sleep(self.delay_s)
            # The body as it arrived, so tests can check that the proxy path kept it intact.
            resp = web.StreamResponse(headers={"content-type": "text/event-stream",
                                               "x-served-by": self.name,
                                               "x-body-bytes": str(len(raw)),
                                               "x-body-sha256": hashlib.sha256(raw).hexdigest()})
            await resp.prepare(req)
            if not body.get("stream"):
                resp.content_type = "application/json"
            for k in range(CHUNKS):
                chunk = {"choices": [{"index": 0, "delta": {"content": f"t{k} "}}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(CHUNK_GAP_S)
            if self.hold is not None:
                await self.hold.wait()
            await resp.write(b"data: [DONE]\n\n")
            return resp

        async def health(_: web.Request) -> web.Response:
            return web.Response(text="ok", status=200 if self.healthy else 503)

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=(
                'sglang:num_queue_reqs{model_name="m"} 0\n'
                'sglang:num_running_reqs{model_name="m"} 1\n'
                'sglang:token_usage{model_name="m"} 0.1\n'))

        async def models(_: web.Request) -> web.Response:
            self.served.append("/v1/models")
            return web.json_response({"object": "list", "data": [{"id": "m"}]},
                                     headers={"x-served-by": self.name})

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/v1/models", models)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


class SpanSink(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC trace receiver keeping every span's attributes (as strings, in
    ``spans``) and every span as sent, with its resource's service.name (in ``raw``)."""

    def __init__(self) -> None:
        self.spans: list[dict[str, str]] = []
        self.raw: list[tuple[str, Span]] = []
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def Export(self, request, context):
        for rs in request.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes
                            if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                self.raw += [(service, span) for span in ss.spans]
                for span in ss.spans:
                    attrs = {a.key: a.value.string_value for a in span.attributes}
                    attrs["_duration_ns"] = str(span.end_time_unix_nano - span.start_time_unix_nano)
                    self.spans.append(attrs)
        return trace_service_pb2.ExportTraceServiceResponse()

    async def start(self) -> None:
        self.server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)


@dataclass
class Stack:
    upstreams: list[Upstream]
    sink: SpanSink
    extproc: GorgoProcess
    envoy: EnvoyProcess
    url: str
    fleet_path: Path
    lt: LoopThread

    def post(self, body: bytes | dict, headers: dict | None = None,
             path: str = "/v1/chat/completions") -> tuple[int, dict, bytes, list[float]]:
        return self.lt.run(post(self.url + path, body, headers or {}))


async def post(url, body, headers):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=headers) as r:
        arrivals, chunks = [], []
        t0 = time.perf_counter()
        async for chunk in r.content.iter_any():
            arrivals.append(time.perf_counter() - t0)
            chunks.append(chunk)
        return r.status, {k.lower(): v for k, v in r.headers.items()}, b"".join(chunks), arrivals


def write_fleet(tmp: Path, ports: list[int], **extra) -> Path:
    doc = {
        "regions": {"near": {"sim": {"rtt_ms": 1, "jitter_ms": 0}},
                    "far": {"sim": {"rtt_ms": 1, "jitter_ms": 0}}},
        "replicas": [{"name": f"r{i}", "region": "near" if i < 2 else "far",
                      "address": f"127.0.0.1:{p}", "engine": "sglang", "prefill_rate": 10000}
                     for i, p in enumerate(ports)],
        "policy": "gorgo",
        "allow_policy_override": True,
        # The tests pick a policy per request (x-gorgo-policy): trust the loopback client.
        "control_headers": {"trusted_peers": ["127.0.0.0/8"]},
        "signals": {"probe_interval_s": 0.2, "scrape_interval_s": 0.2},
        "limits": {"max_body_bytes": 65536},
        **extra,
    }
    path = tmp / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def start_stack(tmp: Path, n: int = 3, body_mode: str = "buffered", router_spans: bool = False,
                workers: int = 1, extproc_args: tuple[str, ...] = (), **extra) -> Stack:
    """``router_spans``: the router exports its decision spans to the same sink as Envoy;
    ``workers``: `gorgo extproc --workers`, every worker an endpoint of Envoy's ext_proc cluster;
    a fleet that skips the response headers gets the router reading Envoy's admin API."""
    lt = LoopThread()
    ups = [Upstream(f"r{i}") for i in range(n)]
    for u in ups:
        lt.run(u.start())
    sink = SpanSink()
    lt.run(sink.start())
    fleet_path = write_fleet(tmp, [u.port for u in ups], **extra)
    spec = load_fleet(fleet_path)
    admin = free_port()
    ext = GorgoProcess(["extproc", "--fleet", str(fleet_path), "--port", "0",
                        "--metrics-port", "0", "--workers", str(workers), *extproc_args,
                        *(["--envoy-admin", f"127.0.0.1:{admin}"]
                          if spec.extproc.skip_response_headers else []),
                        *(["--otlp", f"127.0.0.1:{sink.port}"] if router_spans else [])],
                       timeout=60)
    listen = free_port()
    boot = render_bootstrap(spec, listen=f"127.0.0.1:{listen}",
                            extproc=",".join(f"127.0.0.1:{p}"
                                             for p in ext.field("grpc").split(",")),
                            otlp=f"127.0.0.1:{sink.port}",
                            admin=f"127.0.0.1:{admin}", body_mode=body_mode)
    envoy = EnvoyProcess(boot).start()
    stack = Stack(ups, sink, ext, envoy, f"http://127.0.0.1:{listen}", fleet_path, lt)
    # Wait until the router has probed every replica (RTT known), so decisions are informed.
    assert wait_for(lambda: all(GorgoMetrics(stack).rtt_known()), 10)
    return stack


def stop_stack(st: Stack) -> None:
    st.envoy.stop()
    st.extproc.stop()
    for u in st.upstreams:
        st.lt.run(u.stop())
    st.lt.run(st.sink.stop())
    st.lt.close()


class GorgoMetrics:
    def __init__(self, st: Stack) -> None:
        port = st.extproc.field("metrics")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            self.text = r.read().decode()

    def values(self, name: str) -> dict[str, float]:
        out = {}
        for line in self.text.splitlines():
            if line.startswith(name + "{"):
                labels, _, value = line.rpartition(" ")
                out[labels[len(name):]] = float(value)
        return out

    def total(self, name: str) -> float:
        """The sum of every sample of ``name``, labelled or not."""
        return sum(float(line.rpartition(" ")[2]) for line in self.text.splitlines()
                   if line.startswith((name + "{", name + " ")))

    def rtt_known(self) -> list[bool]:
        vals = self.values("gorgo_rtt_seconds")
        return [v == v for v in vals.values()] if vals else [False]




def http_call(url: str, method: str = "GET", body: object = None,
              headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One blocking HTTP request (``body`` sent as JSON), read to the end, an error status
    included: (status, lower-cased headers, raw body)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


def chat(content: str, **kw) -> dict:
    return {"model": "m", "stream": True, "messages": [{"role": "user", "content": content}], **kw}


async def get(url):
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read(), []
