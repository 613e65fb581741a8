"""Real Envoy + `gorgo extproc` + streaming upstreams + an OTLP receiver, all on dynamic ports."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import pytest
import yaml
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from gorgo.core.fleet import load_fleet
from gorgo.envoy_config import DECISION_FIELDS, TTFT_TAG, render_bootstrap
from gorgo.envoy_proc import EnvoyProcess
from gorgo.procs import GorgoProcess, LoopThread, free_port, wait_for

pytestmark = pytest.mark.envoy
CHUNKS = 5
CHUNK_GAP_S = 0.08


@dataclass
class Upstream:
    name: str
    port: int = 0
    healthy: bool = True
    served: list[str] = field(default_factory=list)
    runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def chat(req: web.Request) -> web.StreamResponse:
            body = await req.json()
            self.served.append(req.path)
            resp = web.StreamResponse(headers={"content-type": "text/event-stream",
                                               "x-served-by": self.name})
            await resp.prepare(req)
            if not body.get("stream"):
                resp.content_type = "application/json"
            for k in range(CHUNKS):
                chunk = {"choices": [{"index": 0, "delta": {"content": f"t{k} "}}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(CHUNK_GAP_S)
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
    """A minimal OTLP/gRPC trace receiver keeping every span's attributes."""

    def __init__(self) -> None:
        self.spans: list[dict[str, str]] = []
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def Export(self, request, context):
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
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
        return self.lt.run(_post(self.url + path, body, headers or {}))


async def _post(url, body, headers):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=headers) as r:
        arrivals, chunks = [], []
        t0 = time.perf_counter()
        async for chunk in r.content.iter_any():
            arrivals.append(time.perf_counter() - t0)
            chunks.append(chunk)
        return r.status, {k.lower(): v for k, v in r.headers.items()}, b"".join(chunks), arrivals


def _fleet(tmp: Path, ports: list[int], **extra) -> Path:
    doc = {
        "regions": {"near": {"rtt_ms": 1, "jitter_ms": 0}, "far": {"rtt_ms": 1, "jitter_ms": 0}},
        "replicas": [{"name": f"r{i}", "region": "near" if i < 2 else "far",
                      "address": f"127.0.0.1:{p}", "engine": "sglang", "prefill_rate": 10000}
                     for i, p in enumerate(ports)],
        "policy": "gorgo",
        "allow_policy_override": True,
        "signals": {"probe_interval_s": 0.2, "scrape_interval_s": 0.2},
        "limits": {"max_body_bytes": 65536},
        **extra,
    }
    path = tmp / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _start_stack(tmp: Path, n: int = 3, **extra) -> Stack:
    lt = LoopThread()
    ups = [Upstream(f"r{i}") for i in range(n)]
    for u in ups:
        lt.run(u.start())
    sink = SpanSink()
    lt.run(sink.start())
    fleet_path = _fleet(tmp, [u.port for u in ups], **extra)
    grpc_port = free_port()
    ext = GorgoProcess(["extproc", "--fleet", str(fleet_path), "--port", str(grpc_port),
                        "--metrics-port", "0"])
    listen = free_port()
    boot = render_bootstrap(load_fleet(fleet_path), listen=f"127.0.0.1:{listen}",
                            extproc=f"127.0.0.1:{grpc_port}", otlp=f"127.0.0.1:{sink.port}",
                            admin=f"127.0.0.1:{free_port()}")
    envoy = EnvoyProcess(boot).start()
    stack = Stack(ups, sink, ext, envoy, f"http://127.0.0.1:{listen}", fleet_path, lt)
    # Wait until the router has probed every replica (RTT known), so decisions are informed.
    assert wait_for(lambda: all(GorgoMetrics(stack).rtt_known()), 10)
    return stack


def _stop_stack(st: Stack) -> None:
    st.envoy.stop()
    st.extproc.stop()
    for u in st.upstreams:
        st.lt.run(u.stop())
    st.lt.run(st.sink.stop())
    st.lt.close()


class GorgoMetrics:
    def __init__(self, st: Stack) -> None:
        import urllib.request
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

    def rtt_known(self) -> list[bool]:
        vals = self.values("gorgo_rtt_ms")
        return [v == v for v in vals.values()] if vals else [False]


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    st = _start_stack(tmp_path_factory.mktemp("stack"))
    yield st
    _stop_stack(st)


def chat(content: str, **kw) -> dict:
    return {"model": "m", "stream": True, "messages": [{"role": "user", "content": content}], **kw}


def test_request_lands_on_the_replica_the_policy_chose(stack: Stack) -> None:
    for k in range(6):
        status, headers, _, _ = stack.post(chat(f"question {k} " * 50),
                                           {"x-gorgo-policy": "round-robin"})
        assert status == 200
        assert headers["x-gorgo-replica"] == headers["x-served-by"]
    # A repeated long prompt goes back to the replica that has its prefix cached.
    prompt = "shared long context " * 2000
    first = stack.post(chat(prompt))[1]["x-gorgo-replica"]
    for _ in range(3):
        assert stack.post(chat(prompt + " and a follow-up"))[1]["x-gorgo-replica"] == first


def test_sse_chunks_stream_through_one_by_one(stack: Stack) -> None:
    status, _, body, arrivals = stack.post(chat("stream me"))
    assert status == 200
    assert body.count(b"data: ") == CHUNKS + 1
    assert len(arrivals) >= CHUNKS  # not buffered into one piece
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert sum(g >= CHUNK_GAP_S * 0.6 for g in gaps) >= CHUNKS - 2


def test_spans_carry_ttft_and_every_decision_field(stack: Stack) -> None:
    did = stack.post(chat("traced request " * 100))[1]["x-gorgo-decision-id"]
    assert wait_for(lambda: any(s.get("gorgo.decision_id") == did for s in stack.sink.spans), 15)
    span = next(s for s in stack.sink.spans if s.get("gorgo.decision_id") == did)
    ttft_us = int(span[TTFT_TAG])
    assert 0 < ttft_us < 5_000_000
    for key in DECISION_FIELDS:
        assert span.get(f"gorgo.{key}") not in (None, ""), key
    assert span["gorgo.policy"] == "gorgo"
    assert float(span["gorgo.predicted_ttft_ms"]) > 0
    assert int(span["gorgo.prompt_tokens"]) >= 350


def test_bad_inputs_get_openai_errors(stack: Stack) -> None:
    status, _, body, _ = stack.post(b"{not json")
    assert status == 400
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]

    status, _, body, _ = stack.post({"model": "m", "messages": "nope"})
    assert status == 400 and json.loads(body)["error"]["param"] == "messages"

    status, headers, body, _ = stack.post(chat("x" * 70000))
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert headers["content-type"].startswith("application/json")

    status, headers, body, _ = stack.lt.run(_get(stack.url + "/v1/models"))
    assert status == 200 and headers["x-gorgo-replica"] == headers["x-served-by"]


async def _get(url):
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read(), []


def test_chunked_body_over_limit_is_413_json(stack: Stack) -> None:
    async def gen():
        for _ in range(20):
            yield b"x" * 8192

    async def go():
        async with aiohttp.ClientSession() as s, s.post(
            stack.url + "/v1/chat/completions", data=gen()
        ) as r:
            return r.status, await r.read()

    status, body = stack.lt.run(go())
    assert status == 413
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_in_flight_returns_to_zero(stack: Stack) -> None:
    assert wait_for(lambda: sum(GorgoMetrics(stack).values("gorgo_inflight_requests").values())
                    == 0, 5)


def test_no_healthy_replica_is_503_with_retry_after(tmp_path: Path) -> None:
    st = _start_stack(tmp_path, n=2)
    try:
        for u in st.upstreams:
            u.healthy = False
        assert wait_for(lambda: sum(GorgoMetrics(st).values("gorgo_replica_healthy").values())
                        == 0, 10)
        status, headers, body, _ = st.post(chat("anyone there?"))
        assert status == 503
        assert int(headers["retry-after"]) >= 1
        assert json.loads(body)["error"]["code"] == "no_healthy_replica"
        for u in st.upstreams:
            u.healthy = True
        assert wait_for(lambda: st.post(chat("back?"))[0] == 200, 10)
    finally:
        _stop_stack(st)


def test_killing_extproc_fails_open_to_default_cluster(tmp_path: Path) -> None:
    st = _start_stack(tmp_path, n=3)
    try:
        assert st.post(chat("before"))[0] == 200
        st.extproc.kill()
        statuses = [st.post(chat(f"after {k}")) for k in range(5)]
        assert all(s[0] == 200 for s in statuses)
        assert {s[1]["x-served-by"] for s in statuses} == {"r0"}  # the default cluster
        assert "x-gorgo-replica" not in statuses[0][1]
    finally:
        _stop_stack(st)
