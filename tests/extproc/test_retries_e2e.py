"""Retries on the next-best replica, with real Envoy, `gorgo extproc` and faulty upstreams.

Each upstream serves chat on one port and /health + /metrics on another (its fleet entry's
health_url and metrics_url), so its chat port can fail, even be closed, while the router still
sees it healthy and routes to it: the failure is met by Envoy's retry, not by the router's
ejection. Decisions use the round-robin policy, whose next-best replica is the next one in turn,
so 3k requests choose each replica exactly k times.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web

from gorgo.core.fleet import load_fleet
from gorgo.envoy_config import FLEET_CLUSTER, render_bootstrap
from gorgo.harness.envoy_proc import EnvoyProcess
from gorgo.harness.procs import GorgoProcess, LoopThread, free_port, wait_for
from tests.support.e2e import GorgoMetrics, chat
from tuner.receiver import ExportLimits, TraceReceiver
from tuner.samples import Sample

pytestmark = pytest.mark.envoy

RR = {"x-gorgo-policy": "round-robin"}
ERROR_503 = {"error": {"message": "The engine is overloaded.", "type": "server_error",
                       "code": "overloaded"}}


@dataclass
class FaultyUpstream:
    """An engine stand-in whose chat answers per ``mode``: ok, 503, slow-503 (after
    ``delay_s``), or midstream (headers and two SSE chunks, then a reset)."""

    name: str
    mode: str = "ok"
    delay_s: float = 0.0
    hits: int = 0  # chat attempts that reached this upstream
    port: int = 0
    side_port: int = 0
    runners: list[web.AppRunner] = field(default_factory=list)

    async def _serve(self, app: web.Application) -> int:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.runners.append(runner)
        return runner.addresses[0][1]

    async def start(self) -> None:
        async def chat_handler(req: web.Request) -> web.StreamResponse:
            await req.read()
            self.hits += 1
            hdrs = {"x-served-by": self.name}
            if self.mode == "503":
                await asyncio.sleep(self.delay_s)
                return web.json_response(ERROR_503, status=503, headers=hdrs)
            resp = web.StreamResponse(headers={"content-type": "text/event-stream", **hdrs})
            await resp.prepare(req)
            for k in range(3):
                chunk = {"choices": [{"index": 0, "delta": {"content": f"t{k} "}}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(0.05)
                if self.mode == "midstream" and k == 1:
                    req.transport.abort()  # headers and bytes are already downstream
                    return resp
            await resp.write(b"data: [DONE]\n\n")
            return resp

        async def health(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text='sglang:num_queue_reqs{model_name="m"} 0\n')

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat_handler)
        self.port = await self._serve(app)
        side = web.Application()
        side.router.add_get("/health", health)
        side.router.add_get("/metrics", metrics)
        self.side_port = await self._serve(side)

    async def close_chat_port(self) -> None:
        """Connections to the chat port are refused from now on."""
        await self.runners[0].cleanup()

    async def stop(self) -> None:
        for r in self.runners:
            await r.cleanup()


@dataclass
class RetryStack:
    ups: list[FaultyUpstream]
    extproc: GorgoProcess
    envoy: EnvoyProcess
    url: str
    lt: LoopThread

    def post_many(self, bodies: list[dict], concurrent: bool = False) -> list[tuple]:
        async def go():
            if concurrent:
                return await asyncio.gather(*(_post(self.url, b) for b in bodies))
            return [await _post(self.url, b) for b in bodies]
        return self.lt.run(go(), timeout=60)

    def retry_stats(self) -> dict[str, int]:
        prefix = f"cluster.{FLEET_CLUSTER}."
        stats = self.envoy.stats(prefix + "upstream_")
        return {k.removeprefix(prefix): v for k, v in stats.items()}


async def _post(url: str, body: dict) -> tuple[int, dict, bytes, str | None]:
    """(status, headers, body, error): error names a stream cut after the headers."""
    async with aiohttp.ClientSession() as s, s.post(
        url + "/v1/chat/completions", json=body, headers=RR
    ) as r:
        headers = {k.lower(): v for k, v in r.headers.items()}
        data, error = b"", None
        try:
            async for chunk in r.content.iter_any():
                data += chunk
        except aiohttp.ClientPayloadError as exc:
            error = type(exc).__name__
        return r.status, headers, data, error


def start_retry_stack(tmp: Path, n: int = 3, otlp: str | None = None, **retries) -> RetryStack:
    lt = LoopThread()
    ups = [FaultyUpstream(f"r{i}") for i in range(n)]
    for u in ups:
        lt.run(u.start())
    doc = {
        "regions": {"near": {"sim": {"rtt_ms": 1, "jitter_ms": 0}}},
        "replicas": [{"name": u.name, "region": "near", "address": f"127.0.0.1:{u.port}",
                      "health_url": f"http://127.0.0.1:{u.side_port}/health",
                      "metrics_url": f"http://127.0.0.1:{u.side_port}/metrics",
                      "engine": "sglang"} for u in ups],
        "allow_policy_override": True,
        # The tests pick a policy per request (x-gorgo-policy): trust the loopback client.
        "control_headers": {"trusted_peers": ["127.0.0.0/8"]},
        "signals": {"probe_interval_s": 0.2, "scrape_interval_s": 0.2},
        "limits": {"max_body_bytes": 65536},
        "retries": {"enabled": True, **retries},
    }
    fleet = tmp / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(doc))
    grpc_port, listen = free_port(), free_port()
    ext = GorgoProcess(["extproc", "--fleet", str(fleet), "--port", str(grpc_port),
                        "--metrics-port", "0"])
    boot = render_bootstrap(load_fleet(fleet), listen=f"127.0.0.1:{listen}",
                            extproc=f"127.0.0.1:{grpc_port}", admin=f"127.0.0.1:{free_port()}",
                            otlp=otlp)
    st = RetryStack(ups, ext, EnvoyProcess(boot).start(), f"http://127.0.0.1:{listen}", lt)
    assert wait_for(lambda: all(GorgoMetrics(st).rtt_known()), 10)
    return st


def stop_retry_stack(st: RetryStack) -> None:
    st.envoy.stop()
    st.extproc.stop()
    for u in st.ups:
        st.lt.run(u.stop())
    st.lt.close()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[RetryStack]:
    st = start_retry_stack(tmp_path)
    yield st
    stop_retry_stack(st)


def test_503_is_retried_once_on_the_next_best_replica(stack: RetryStack) -> None:
    stack.ups[0].mode = "503"
    # Near the 64 KiB body limit: the buffered body is replayed to the second replica.
    bodies = [chat(f"question {k} " * 4500) for k in range(6)]
    results = stack.post_many(bodies)
    for status, headers, body, error in results:
        assert status == 200 and error is None and body.endswith(b"data: [DONE]\n\n")
        assert headers["x-served-by"] != "r0"
        assert headers["x-gorgo-replica"] == headers["x-served-by"]  # the retry is attributed
    # Round robin chose r0 for 2 of the 6; each of those was retried exactly once, on r1.
    retried = [h for _, h, _, _ in results if h["x-envoy-attempt-count"] == "2"]
    assert len(retried) == stack.ups[0].hits == 2
    assert {h["x-served-by"] for h in retried} == {"r1"}
    assert sum(u.hits for u in stack.ups) == 6 + 2
    stats = stack.retry_stats()
    assert stats["upstream_rq_retry"] == 2 and stats["upstream_rq_retry_success"] == 2


def test_connect_failure_is_retried_on_the_next_best_replica(stack: RetryStack) -> None:
    stack.lt.run(stack.ups[1].close_chat_port())
    results = stack.post_many([chat(f"closed port {k} " * 30) for k in range(6)])
    for status, headers, _, error in results:
        assert status == 200 and error is None
        assert headers["x-served-by"] != "r1"
        assert headers["x-gorgo-replica"] == headers["x-served-by"]
    retried = [h for _, h, _, _ in results if h["x-envoy-attempt-count"] == "2"]
    assert len(retried) == 2 and {h["x-served-by"] for h in retried} == {"r2"}
    stats = stack.retry_stats()
    assert stats["upstream_cx_connect_fail"] >= 2
    assert stats["upstream_rq_retry"] == 2 and stats["upstream_rq_retry_success"] == 2


def test_every_port_closed_is_one_retry_then_a_json_503(stack: RetryStack) -> None:
    for u in stack.ups:
        stack.lt.run(u.close_chat_port())
    results = stack.post_many([chat(f"nobody home {k}") for k in range(3)])
    for status, headers, body, _ in results:
        assert status == 503 and headers["x-envoy-attempt-count"] == "2"
        assert json.loads(body)["error"]["code"] == "upstream_unavailable"
    stats = stack.retry_stats()
    assert stats["upstream_rq_retry"] == 3 and stats.get("upstream_rq_retry_success", 0) == 0


@pytest.mark.slow
def test_failure_after_response_bytes_is_not_retried(stack: RetryStack) -> None:
    for u in stack.ups:
        u.mode = "midstream"
    results = stack.post_many([chat(f"cut me off {k}") for k in range(3)])
    for status, headers, body, error in results:
        assert status == 200 and headers["x-gorgo-replica"] == headers["x-served-by"]
        assert error == "ClientPayloadError"  # the client sees the stream cut, not a retry
        assert body.count(b"data: ") == 2 and b"[DONE]" not in body
    assert sum(u.hits for u in stack.ups) == 3
    assert stack.retry_stats().get("upstream_rq_retry", 0) == 0


@pytest.mark.slow
def test_a_cut_or_retried_stream_reaches_the_tuner_as_such(tmp_path: Path) -> None:
    # Envoy's span still says 200 for a stream the replica reset mid-way: the tuner scored such
    # streams as fast successes under e2e. Envoy's response flags tell them apart.
    got: list[Sample] = []
    lt = LoopThread()
    rx = TraceReceiver(got.extend, None, ExportLimits(max_ms=600_000.0))
    port = lt.run(rx.start("127.0.0.1", 0))
    st = start_retry_stack(tmp_path, otlp=f"127.0.0.1:{port}")
    try:
        st.post_many([{**chat(f"whole {k} " * 30), "stream": True} for k in range(2)])
        for u in st.ups:
            u.mode = "midstream"
        cut = st.post_many([{**chat(f"cut {k} " * 30), "stream": True} for k in range(2)])
        assert all(error == "ClientPayloadError" for _, _, _, error in cut)
        assert wait_for(lambda: len([s for s in got if not s.early]) >= 4, 15)
        ends = {s.decision_id: s for s in got if not s.early}
        cut_ids = {h["x-gorgo-decision-id"] for _, h, _, _ in cut}
        assert all(s.status == 200 and s.ok for s in ends.values())
        assert {d for d, s in ends.items() if s.cut} == cut_ids
        # A request Envoy retried on the next-best replica: its span names the decision's
        # replica (r0, which failed), so the tuner keeps it out of calibration and the fit.
        for u in st.ups:
            u.mode = "ok"
        st.ups[0].mode = "503"
        got.clear()
        results = st.post_many([{**chat(f"retried {k} " * 30), "stream": True} for k in range(6)])
        assert wait_for(lambda: len([s for s in got if not s.early]) >= 6, 15)
        retried = {h["x-gorgo-decision-id"] for _, h, _, _ in results
                   if h["x-envoy-attempt-count"] == "2"}
        assert retried and {s.decision_id for s in got if s.retried} == retried
        assert {s.replica for s in got if s.retried} == {"r0"}
    finally:
        stop_retry_stack(st)
        lt.run(rx.stop())
        lt.close()


@pytest.mark.parametrize("budget_percent", [20, 100])
def test_fleet_wide_503_stays_within_the_retry_budget(
    tmp_path: Path, budget_percent: int
) -> None:
    n, min_conc = 40, 3
    st = start_retry_stack(tmp_path, budget_percent=budget_percent, min_retry_concurrency=min_conc)
    try:
        for u in st.ups:
            u.mode, u.delay_s = "503", 0.3  # slow enough that all 40 are in flight together
        results = st.post_many([chat(f"outage {k} " * 20) for k in range(n)], concurrent=True)
        for status, headers, body, _ in results:
            assert status == 503 and headers["content-type"].startswith("application/json")
            assert json.loads(body)["error"]["code"] == "overloaded"
        stats = st.retry_stats()
        retries = stats.get("upstream_rq_retry", 0)
        attempts = sum(u.hits for u in st.ups)
        print(f"\nbudget {budget_percent}%: {n} requests, {attempts} upstream attempts, "
              f"{retries} retries, {stats.get('upstream_rq_retry_overflow', 0)} over budget, "
              f"statuses {Counter(r[0] for r in results)}")
        assert attempts == n + retries  # never more than one retry per request
        assert stats.get("upstream_rq_retry_overflow", 0) == n - retries
        bound = n * 20 / 100 + min_conc
        if budget_percent == 20:
            assert 1 <= retries <= bound
        else:  # the same outage with a loose budget: the budget is what held retries down
            assert retries > bound
    finally:
        stop_retry_stack(st)
