"""The tuner process in-process: config, publishing to real admin APIs, conflicts, outages,
status endpoint, persistence and resume."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import shutil
import subprocess
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

import tuner.main
from extproc.http_api import make_app
from extproc.telemetry import RouterMetrics
from gorgo.core.contract import WORKER_READ_TIMEOUT_S, WORKER_WRITE_TIMEOUT_S
from gorgo.core.fleet import parse_fleet
from gorgo.core.router import Router
from gorgo.core.weights import Weights
from gorgo.errors import UserError
from gorgo.harness.procs import free_port
from tests.tuner.conftest import fixed_order, ipv6_loopback
from tuner.main import ConfigError, TunerService, load_config
from tuner.optimizer import KEYS, OptimizerConfig, Proposal
from tuner.publisher import Publisher, RouterTarget
from tuner.receiver import ExportLimits
from tuner.state_store import StateError

TOKEN = "admin-tok"
OTLP_TOKEN = "otlp-tok"
AUTH = (("authorization", f"Bearer {OTLP_TOKEN}"),)


class RouterApp:
    """A router's admin/metrics app on a free port, in the test's event loop."""

    def __init__(self) -> None:
        self.router = Router(parse_fleet({
            "regions": {"local": {}},
            "replicas": [
                {"name": "r0", "engine": "sim", "region": "local", "address": "127.0.0.1:1"},
                {"name": "r1", "engine": "sim", "region": "local", "address": "127.0.0.1:2"},
            ],
        }))
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, port: int = 0) -> None:
        app = make_app(RouterMetrics(self.router.state, lambda: 0), self.router, TOKEN)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    @property
    def point(self) -> dict[str, float]:
        """The weights the tuner tunes (tuner.optimizer.KEYS), as the router holds them."""
        return {k: self.weights[k] for k in KEYS}

    @property
    def weights(self) -> Weights:
        return self.router.state.weights


def W(rtt: float, queue: float) -> dict[str, float]:
    return {"rtt": rtt, "queue": queue}


def write_config(tmp: Path, apps: list[RouterApp], **extra: Any) -> Path:
    (tmp / "admin-token").write_text(TOKEN + "\n")
    (tmp / "otlp-token").write_text(OTLP_TOKEN)
    doc = {
        "listen": "127.0.0.1:0",
        "token_file": "otlp-token",
        "status_listen": "127.0.0.1:0",
        "state_file": "state/tuner.json",
        "routers": [{"url": r.url, "token_file": "admin-token"} for r in apps],
        "seed": 1,
        "optimizer": {"window_samples": 5, "pairs": 1, "bootstrap": 200,
                      "model_step": False},
        **extra,
    }
    path = tmp / "tuner.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


@contextlib.asynccontextmanager
async def two_routers(tmp_path: Path) -> AsyncIterator[tuple[TunerService, RouterApp, RouterApp]]:
    """A started tuner publishing to two routers; the tuner and router a are stopped after (a test
    that stops b stops it itself)."""
    a, b = RouterApp(), RouterApp()
    await a.start()
    await b.start()
    svc = TunerService(load_config(write_config(tmp_path, [a, b])))
    await svc.start()
    fixed_order(svc.tuner)  # the incumbent's window first: these tests follow one evaluation
    try:
        yield svc, a, b
    finally:
        await svc.stop()
        await a.stop()


async def export_samples(port: int, version: int, n: int, ttft_us: int, span_builders) -> None:
    attrs, span, export = span_builders
    spans = [span(attrs(gorgo__weights_version=str(version), gorgo__decision_id=f"x{version}-{k}",
                        **{"gorgo.first_byte_us": str(ttft_us)}))
             for k in range(n)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = trace_service_pb2_grpc.TraceServiceStub(ch)
        for one in spans:  # an export each: no one export may fill a window on its own
            await stub.Export(export([one]), metadata=AUTH, timeout=5)


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, (await r.json() if r.content_type == "application/json"
                          else await r.text())


def test_publishes_to_every_router_and_resumes_after_restart(tmp_path: Path,
                                                             span_builders) -> None:
    async def body() -> None:
        a, b = RouterApp(), RouterApp()
        await a.start()
        await b.start()
        a.router.state.set_weights(Weights(W(1.5, 0.5), 10))  # an earlier tuner run left v10
        cfg = load_config(write_config(tmp_path, [a, b]))
        svc = TunerService(cfg)
        await svc.start()
        fixed_order(svc.tuner)  # the incumbent's window first
        try:
            # Fresh start: begins from the live weights, above the highest live version.
            assert svc.tuner.incumbent == W(1.5, 0.5)
            await svc.tick(0.0)
            assert a.weights == b.weights
            assert a.weights.version == 11 and a.point == W(1.5, 0.5)
            # Samples of the live version arrive over OTLP; the window closes; a candidate goes out.
            await export_samples(svc.otlp_port, 11, 5, 100_000, span_builders)
            await svc.tick(1.0)
            assert a.weights.version == b.weights.version == 12
            assert svc.tuner.active.arm == "candidate"
            assert a.point != W(1.5, 0.5)
            # Samples of other versions are ignored, and a foreign span is counted and dropped.
            await export_samples(svc.otlp_port, 3, 5, 100_000, span_builders)
            status, doc = await get_json(f"http://127.0.0.1:{svc.status_port}/status")
            assert status == 200
            assert doc["receiver"]["samples"] == 10
            assert doc["tuner"]["ignored_samples"] == 5
            assert doc["tuner"]["window"] == {"arm": "candidate", "version": 12, "samples": 0,
                                              "errors": 0, "routed": 0}
            assert [r["acked_version"] for r in doc["routers"]] == [12, 12]
            status, text = await get_json(f"http://127.0.0.1:{svc.status_port}/metrics")
            assert 'gorgo_tuner_spans_total{result="samples"} 10.0' in text
            assert "gorgo_tuner_active_version 12.0" in text
            for key in ("rtt", "queue"):
                assert f'gorgo_tuner_incumbent_weight{{term="{key}"}}' in text
            assert set(doc["tuner"]["incumbent"]) == {"rtt", "queue", "p95_ms"}
            assert set(doc["tuner"]["active"]) >= {"rtt", "queue", "version", "arm"}
            # A much better candidate wins the evaluation and becomes the incumbent.
            await export_samples(svc.otlp_port, 12, 5, 10_000, span_builders)
            await svc.tick(2.0)
            assert svc.tuner.accepted == 1
            winner = svc.tuner.incumbent
            assert a.weights.version == 13 and a.point == winner
        finally:
            await svc.stop()
        # Killed tuner: the routers keep the last weights they accepted.
        assert a.weights.version == 13
        saved = json.loads(cfg.state_file.read_text())
        assert saved["next_version"] == 14 and saved["incumbent"] == winner
        # Restart: resumes the incumbent and the version counter.
        svc2 = TunerService(cfg)
        await svc2.start()
        fixed_order(svc2.tuner)
        try:
            assert svc2.tuner.incumbent == winner and svc2.tuner.accepted == 1
            await svc2.tick(0.0)
            assert a.weights.version == b.weights.version == 14
            assert a.point == winner
        finally:
            await svc2.stop()
            await a.stop()
            await b.stop()

    run(body)


def test_conflicting_version_is_renumbered_and_an_outage_does_not_block_others(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        async with two_routers(tmp_path) as (svc, a, b):
            await svc.tick(0.0)
            assert a.weights.version == b.weights.version == 1
            # An operator pushed v50 to b by hand; the tuner's next version would be 2.
            b.router.state.set_weights(Weights(W(3.0, 3.0), 50))
            svc.tuner.renumber(1)  # force a republish of the same window as v2
            await svc.tick(0.1)
            assert a.weights.version == b.weights.version == 51
            assert svc.tuner.active.weights.version == 51
            assert b.point == W(1.0, 1.0)
            # Router b goes away: a keeps getting updates, b is retried with backoff.
            port_b = int(b.url.rsplit(":", 1)[1])
            await b.stop()
            svc.tuner.renumber(51)
            await svc.tick(0.2)
            assert a.weights.version == 52
            st = {r["url"]: r for r in svc.publisher.status()}
            assert st[b.url]["acked_version"] == 51 and st[b.url]["error"]
            # b comes back (a restarted router: default weights, version 0) and catches up.
            b2 = RouterApp()
            await b2.start(port_b)
            for _ in range(40):
                await svc.tick(0.3)
                if b2.weights.version == 52:
                    break
                await asyncio.sleep(0.1)
            assert b2.weights.version == 52
            await b2.stop()

    run(body)


class StuckRouter:
    """A router's admin API that refuses (503) until `stuck`, then answers nothing until
    `release` is set: a hung router, held for as long as the test needs, no clock involved."""

    def __init__(self) -> None:
        self.stuck = False
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, _: web.Request) -> web.Response:
        if self.stuck:
            self.arrived.set()
            await self.release.wait()
        return web.json_response({"error": {"message": "down"}}, status=503)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/admin/weights", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()


def test_a_hung_router_holds_neither_ticks_nor_status_nor_samples(tmp_path: Path,
                                                                   span_builders) -> None:
    """A hung router's requests stay out up to the publish timeout; the probes, the spans, the
    ticks and the other routers' weights must not wait with them (one hung router held every
    tick for the whole timeout, and the healthy routers got no weights meanwhile)."""
    async def body() -> None:
        a, hung = RouterApp(), StuckRouter()
        await a.start()
        await hung.start()
        svc = TunerService(load_config(write_config(tmp_path, [a, hung],
                                                    publish_timeout_s=3600)))
        await svc.start()
        svc.publisher.answer_wait_s = 0.05  # a tick's wait for the routers (1 s: 8 s a run)
        try:
            await svc.tick(0.0)
            v = svc.tuner.active.weights.version
            hung.stuck = True
            # (bounds only so that the code before fails rather than hangs: it never answered)
            tick = asyncio.create_task(svc.tick(1.0))
            await asyncio.wait_for(hung.arrived.wait(), 60)
            base = f"http://127.0.0.1:{svc.status_port}"
            status, doc = await asyncio.wait_for(get_json(f"{base}/status"), 60)
            assert status == 200 and doc["ticks"] == 2
            status, text = await asyncio.wait_for(get_json(f"{base}/metrics"), 60)
            assert status == 200 and "gorgo_tuner_active_version" in text
            await export_samples(svc.otlp_port, v, 2, 100_000, span_builders)
            assert svc.tuner.status()["window"]["samples"] == 2  # handed over, not held
            await asyncio.wait_for(tick, 60)  # the hung router's request is still out
            assert not hung.release.is_set()
            for k in range(3):  # ticks go on, and the healthy router is kept in step
                await asyncio.wait_for(svc.tick(2.0 + k), 60)
            acked = {r["url"]: r["acked_version"] for r in svc.publisher.status()}
            assert acked[a.url] == svc.tuner.active.weights.version
            assert acked[hung.url] < acked[a.url]
            hung.release.set()
        finally:
            await svc.stop()
            await a.stop()
            await hung.stop()

    run(body)


class LateGetRouter(RouterApp):
    """A router whose `GET /admin/weights` reads its state at once and answers only after the
    next PUT was answered: a slow GET overtaken by a PUT, without a clock."""

    async def start(self, port: int = 0) -> None:
        self.late, self.put_answered = False, asyncio.Event()

        @web.middleware
        async def late(request: web.Request, handler: Any) -> web.StreamResponse:
            resp = await handler(request)  # the state as of now
            if request.method == "PUT":
                self.put_answered.set()
            elif self.late:
                self.put_answered.clear()
                await self.put_answered.wait()
            return resp

        app = make_app(RouterMetrics(self.router.state, lambda: 0), self.router, TOKEN)
        app.middlewares.append(late)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"


def test_a_get_answered_after_a_later_put_is_not_a_restart(tmp_path: Path) -> None:
    """A tick no longer waits for a slow GET, so a PUT can be answered while a GET read before it
    is still out: its old version read as a router that lost the new one ("restarted?"), which
    was republished, refused (409) and renumbered, every time."""
    async def body() -> None:
        a = LateGetRouter()
        await a.start()
        svc = TunerService(load_config(write_config(tmp_path, [a])))
        await svc.start()
        svc.publisher.answer_wait_s = 0.05  # a tick's wait for the routers (1 s: 4 s a run)
        try:
            a.late = True
            for k in range(4):
                await svc.tick(float(k))
            (status,) = svc.publisher.status()
            assert status["failed"] == 0 and status["error"] == ""
            assert status["acked_version"] == a.weights.version == svc.tuner.active.weights.version
        finally:
            a.late = False
            a.put_answered.set()  # the GETs still held
            await svc.stop()
            await a.stop()

    run(body)


def test_publisher_reports_auth_failures_without_acking(tmp_path: Path) -> None:
    async def body() -> None:
        a = RouterApp()
        await a.start()
        try:
            async with Publisher([RouterTarget(a.url, "wrong")]) as pub:
                prop = Proposal(Weights(W(2.0, 2.0), 5), {}, "incumbent")
                assert await pub.sync(prop) is None
                assert await pub.fetch(RouterTarget(a.url, "wrong")) is None
                st = pub.status()[0]
                assert st["acked_version"] == -1 and "token" in st["error"]
                assert a.weights.version == 0
        finally:
            await a.stop()

    run(body)


@pytest.mark.parametrize(("status", "acked"), [(200, 5), (502, -1)])
def test_an_answer_that_is_not_a_json_object_is_read_as_no_body(status: int, acked: int) -> None:
    """A proxy in front of a router may answer a list or a string: the tick must go on."""
    async def body() -> None:
        async def put(request: web.Request) -> web.Response:
            return web.json_response(["ok"], status=status)

        app = web.Application()
        app.router.add_put("/admin/weights", put)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with Publisher([RouterTarget(f"http://127.0.0.1:{port}", "t")]) as pub:
                await pub.sync(Proposal(Weights(W(2.0, 2.0), 5), {}, "incumbent"))
                assert pub.status()[0]["acked_version"] == acked
        finally:
            await runner.cleanup()

    run(body)


def test_unreadable_state_file_is_not_overwritten(tmp_path: Path) -> None:
    async def body() -> None:
        a = RouterApp()
        await a.start()
        cfg = load_config(write_config(tmp_path, [a]))
        cfg.state_file.parent.mkdir(parents=True, exist_ok=True)
        cfg.state_file.write_text("{broken")
        svc = TunerService(cfg)
        with pytest.raises(StateError):
            await svc.start()
        await svc.stop()
        assert cfg.state_file.read_text() == "{broken"
        await a.stop()

    run(body)


@pytest.mark.parametrize(("extra", "match"), [
    ({"routers": []}, "routers"),
    ({"routers": [{"url": "ftp://x", "token_file": "admin-token"}]}, r"routers\[0\].url"),
    # accepted, then retried for ever
    ({"routers": [{"url": "http://127.0.0.1:99999", "token_file": "admin-token"}]},
     r"routers\[0\].url"),
    ({"routers": [{"url": "http://", "token_file": "admin-token"}]}, r"routers\[0\].url"),
    ({"routers": [{"url": "http://x:0", "token_file": "admin-token"}]}, r"routers\[0\].url"),
    ({"routers": [{"url": "http://[::1", "token_file": "admin-token"}]}, r"routers\[0\].url"),
    ({"routers": [{"url": "http://x", "token_file": "missing"}]}, r"routers\[0\].token_file"),
    ({"routers": [{"url": "http://x", "token": "inline"}]}, r"routers\[0\]"),
    ({"listen": "nowhere"}, "listen"),
    ({"bogus": 1}, "bogus"),
    ({"optimizer": {"fpr": 2}}, "fpr"),
    ({"optimizer": {"bounds": [0.01, 20]}}, r"optimizer\.bounds\.rtt"),
    ({"optimizer": {"bounds": {"queue": [0.05, 25]}}}, r"optimizer\.bounds\.queue"),
    ({"optimizer": {"bounds": {"warp": [1, 2]}}}, r"optimizer\.bounds\.warp"),
    ({"calibration": {"window": "big"}}, "calibration.window"),
    # .inf and .nan: an OverflowError or ValueError traceback, or no check at all
    ({"calibration": {"window": float("inf")}}, "calibration.window: expected an integer"),
    ({"calibration": {"min_samples": float("nan")}}, "calibration.min_samples"),
    ({"calibration": {"max_hint_factor": float("inf")}}, "calibration.max_hint_factor"),
    ({"calibration": {"max_queue_share": 10**400}}, "calibration.max_queue_share"),
    ({"tick_s": 10**400}, "tick_s"),
    ({"tls_cert_file": "cert.pem"}, "tls"),
    ({"tls_cert_file": "admin-token", "tls_key_file": "otlp-token"},
     "tls_cert_file: the certificate and key do not load"),
    ({"initial_weights": {"rtt": 1}}, "initial_weights"),
    ({"initial_weights": {"rtt": 1, "queue": 1, "warp": 1}}, "initial_weights"),
    ({"initial_weights": {"rtt": 1, "queue": -1}}, "queue"),
    ({"tick_s": 0}, "tick_s"),
    ({"token_file": None}, "token_file: required"),
    ({"token_file": "missing"}, "token_file"),
    ({"request_timeout_s": 0}, "request_timeout_s"),
    ({"max_export_spans": 0}, "max_export_spans"),
    ({"max_spans_per_s": "lots"}, "max_spans_per_s"),
    ({"request_timeout_s": float("inf")}, "request_timeout_s"),  # every range check off
    ({"tick_s": float("nan")}, "tick_s"),
    ({"seed": -1}, "seed"),  # numpy refused it at start, with a traceback
    ({"routers": [{"url": "http://x:1", "token_file": "admin-token"},
                  {"url": "http://x:1/", "token_file": "admin-token"}]},
     r"routers\[1\].url: .* listed twice"),  # renumbered its own versions without end
    ({"routers": [{"url": "http://Router:80", "token_file": "admin-token"},
                  {"url": "http://router", "token_file": "admin-token"}]},
     r"routers\[1\].url: .* listed twice"),  # the same router, written otherwise
])
def test_config_errors_name_the_field(tmp_path: Path, extra: dict, match: str) -> None:
    class Fake:
        url = "http://127.0.0.1:9"

    path = write_config(tmp_path, [Fake()], **extra)  # type: ignore[list-item]
    with pytest.raises(ConfigError, match=match):
        load_config(path)


@pytest.mark.parametrize("token", ["abc\ndef", "abc def", "ab\x7fc", "t\u00f6k\u00e9n"])
@pytest.mark.parametrize("field", ["routers[0].token_file", "token_file"])
def test_a_token_no_header_can_carry_is_refused_naming_its_field(tmp_path: Path, token: str,
                                                                  field: str) -> None:
    """A router token with a newline inside passed the start and crashed the first publish."""
    class Fake:
        url = "http://127.0.0.1:9"

    path = write_config(tmp_path, [Fake()])  # type: ignore[list-item]
    (tmp_path / "bad-token").write_text(token + "\n")
    doc = yaml.safe_load(path.read_text())
    if field == "token_file":
        doc["token_file"] = "bad-token"
    else:
        doc["routers"][0]["token_file"] = "bad-token"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)}: .*printable ASCII"):
        load_config(path)


def test_the_publish_timeout_outlasts_the_worker_supervisors(tmp_path: Path) -> None:
    """`gorgo extproc --workers` answers once it gives up on a hung worker (3 s for a read, 10 s
    for a change); a tuner that gave up first (at 2 s) lost that router's census."""
    class Fake:
        url = "http://127.0.0.1:9"

    cfg = load_config(write_config(tmp_path, [Fake()]))  # type: ignore[list-item]
    assert cfg.publish_timeout_s > WORKER_WRITE_TIMEOUT_S >= WORKER_READ_TIMEOUT_S
    assert TunerService(cfg).publisher.timeout_s == cfg.publish_timeout_s


def test_config_defaults(tmp_path: Path) -> None:
    class Fake:
        url = "http://127.0.0.1:9/"

    (tmp_path / "admin-token").write_text(TOKEN)
    (tmp_path / "otlp-token").write_text(OTLP_TOKEN + "\n")
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"token_file": "otlp-token",
                                    "routers": [{"url": Fake.url, "token_file": "admin-token"}]}))
    cfg = load_config(path)
    assert cfg.listen == "127.0.0.1:4317" and cfg.otlp_token == OTLP_TOKEN and cfg.tls is None
    assert cfg.limits == ExportLimits(max_ms=600_000.0, max_spans=5000, spans_per_s=2000.0)
    assert cfg.routers[0] == RouterTarget("http://127.0.0.1:9", TOKEN)
    assert cfg.state_file == tmp_path / "gorgo-tuner-state.json"
    assert cfg.optimizer == OptimizerConfig()


def test_counts_what_every_router_routed_under_the_scored_versions(tmp_path: Path) -> None:
    """A window is complete once every request it routed reported back; the routers say how
    many there were (summed over routers), and a router that stops answering keeps its count."""
    from gorgo.core.features import extract_features

    def route(app: RouterApp, n: int) -> None:
        for k in range(n):
            f = extract_features("/v1/completions", {}, json.dumps({"prompt": f"p{k}"}).encode(),
                                 app.router.state.tok)
            app.router.route(f, now=0.0)

    async def body() -> None:
        async with two_routers(tmp_path) as (svc, a, b):
            await svc.tick(0.0)
            v = svc.tuner.active.weights.version
            route(a, 3)
            route(b, 4)
            await svc.follow_routers()
            assert svc.tuner.window_for(v).routed == 7
            await b.stop()  # b's 4 stay counted
            route(a, 2)
            await svc.follow_routers()
            assert svc.tuner.window_for(v).routed == 9

    run(body)



def test_a_rate_hint_that_moves_on_any_router_runs_the_evaluation_again(tmp_path: Path) -> None:
    """The tuner took each hint from the first router that reported it: a fleet reload that
    reached the second router first moved the rate it prices r1 at (10,000 to 50,000 tokens/s)
    under the evaluation's open window unseen. A hint that moves on any router voids it."""
    async def body() -> None:
        async with two_routers(tmp_path) as (svc, a, b):
            try:
                await svc.tick(0.0)
                v = svc.tuner.active.weights.version
                spec = b.router.spec
                b.router.reload(dataclasses.replace(spec, replicas=tuple(
                    dataclasses.replace(r, prefill_rate=50_000.0) if r.name == "r1" else r
                    for r in spec.replicas)))
                await svc.tick(1.0)
                last = svc.tuner.history[-1] if svc.tuner.history else {}
                assert last.get("reason") == "rate_hint" and last["versions"] == [v]
                assert svc.tuner.window_for(v) is None
                assert a.weights.version == b.weights.version == svc.tuner.active.weights.version
                assert svc.tuner.active.weights.version > v
                await svc.tick(2.0)  # heard again, unchanged: nothing more
                assert svc.tuner.history[-1] is last
            finally:
                await b.stop()

    run(body)


def test_initial_weights_and_bounds_are_keyed_by_weight(tmp_path: Path) -> None:
    class Fake:
        url = "http://127.0.0.1:9"

    path = write_config(tmp_path, [Fake()],  # type: ignore[list-item]
                        initial_weights={"rtt": 2, "queue": 0.5},
                        optimizer={"bounds": {"queue": [0.1, 10]}})
    cfg = load_config(path)
    assert cfg.initial_weights == W(2.0, 0.5)
    assert cfg.optimizer.bounds == {"rtt": (0.05, 20.0), "queue": (0.1, 10.0)}


def test_the_fleet_file_sets_the_objective_target_and_timeout(tmp_path: Path) -> None:
    """Issue 18: the tuner optimises what the fleet's objective says, over its weights."""
    doc = yaml.safe_load((Path(__file__).parents[2] / "envoy" / "fleet.example.yaml").read_text())
    doc.update(objective="slo", slo={"ttft_ms": 800}, timeouts={"request_s": 90})
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(doc))
    router = RouterApp()
    router.url = "http://127.0.0.1:9"  # never started: the config is only parsed
    cfg = load_config(write_config(tmp_path, [router], fleet="fleet.yaml"))
    assert (cfg.optimizer.objective, cfg.optimizer.slo_ttft_ms) == ("slo", 800.0)
    assert "decode" in cfg.optimizer.keys and cfg.limits.max_ms == 90_000.0
    path = write_config(tmp_path, [router], fleet="fleet.yaml", optimizer={"objective": "ttft"})
    with pytest.raises(ConfigError, match="contradicts the fleet file"):
        load_config(path)
    # a shorter timeout than the fleet's silently dropped every slower request as out of range
    path = write_config(tmp_path, [router], fleet="fleet.yaml", request_timeout_s=5)
    with pytest.raises(ConfigError, match="request_timeout_s: 5 contradicts the fleet file"):
        load_config(path)
    cfg = load_config(write_config(tmp_path, [router], fleet="fleet.yaml", request_timeout_s=90))
    assert cfg.limits.max_ms == 90_000.0
    # an empty fleet: key names no fleet file, so nothing to contradict (it was refused)
    cfg = load_config(write_config(tmp_path, [router], fleet=None, request_timeout_s=90))
    assert cfg.limits.max_ms == 90_000.0


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_a_tls_pair_grpc_serves_is_accepted(tmp_path: Path) -> None:
    """An RSA-1024 pair was refused at OpenSSL's default security level, which gRPC does not
    apply (it serves the pair)."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:1024", "-nodes", "-keyout",
                    str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem"), "-days", "1",
                    "-subj", "/CN=localhost"], check=True, capture_output=True)

    class Fake:
        url = "http://127.0.0.1:9"

    cfg = load_config(write_config(tmp_path, [Fake()], tls_cert_file="cert.pem",  # type: ignore[list-item]
                                   tls_key_file="key.pem"))
    assert cfg.tls is not None


def test_spans_are_taken_while_a_verdict_computes_and_reach_the_tuner_after_it(
    tmp_path: Path, span_builders,
) -> None:
    """The verdict runs in a thread: the OTLP intake answers meanwhile, and what it took waits
    for the tuner to be free, then reaches it in order (the next tick acts on it)."""
    async def body() -> None:
        entered, release = threading.Event(), threading.Event()
        async with two_routers(tmp_path) as (svc, a, b):
            try:
                await svc.tick(0.0)
                assert a.weights.version == 1
                verdict = svc.tuner.next_weights

                def held_verdict(now: float) -> Proposal | None:
                    entered.set()
                    release.wait(60)
                    return verdict(now)

                svc.tuner.next_weights = held_verdict  # type: ignore[method-assign]
                tick = asyncio.create_task(svc.tick(1.0))
                assert await asyncio.to_thread(entered.wait, 60)
                await export_samples(svc.otlp_port, 1, 5, 100_000, span_builders)
                assert svc.receiver.counts["samples"] == 5
                assert len(svc._held) == 5  # taken, not yet given: the tuner is busy
                release.set()
                await tick
                assert svc._held == []
                assert a.weights.version == 1  # that verdict saw none of them
                await svc.tick(2.0)  # the next one has all five: the window closed
                assert a.weights.version == b.weights.version == 2
                assert svc.tuner.active.arm == "candidate"
            finally:
                release.set()
                await b.stop()

    run(body)


def test_a_fresh_start_waits_for_a_router_and_takes_its_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No state, no initial_weights: the tuner starts from the weights the routers run. With no
    router up yet it started from the defaults, saved them and published them everywhere."""
    monkeypatch.setattr(tuner.main, "ROUTER_RETRY_S", 0.1)  # asks again every 0.1 s, not 1 s

    async def body() -> None:
        a = RouterApp()
        port = free_port()
        a.url = f"http://127.0.0.1:{port}"
        cfg = load_config(write_config(tmp_path, [a]))
        svc = TunerService(cfg)
        starting = asyncio.ensure_future(svc.start())
        await asyncio.sleep(0.4)  # it has asked, and been refused, several times by now
        assert not starting.done() and not cfg.state_file.exists()
        a.router.state.set_weights(Weights(W(2.0, 0.5), 7))
        await a.start(port)
        try:
            await asyncio.wait_for(starting, 10)
            assert svc.tuner.incumbent == W(2.0, 0.5)
            assert svc.tuner.next_version > 7
        finally:
            await svc.stop()
            await a.stop()
    run(body)


def test_a_stop_while_waiting_for_a_router_saves_nothing(tmp_path: Path) -> None:
    async def body() -> None:
        a = RouterApp()
        a.url = f"http://127.0.0.1:{free_port()}"
        cfg = load_config(write_config(tmp_path, [a]))
        svc = TunerService(cfg)
        stop = asyncio.Event()
        starting = asyncio.ensure_future(svc.start(stop))
        await asyncio.sleep(0.5)
        stop.set()
        with pytest.raises(UserError, match="stopped before any router answered"):
            await asyncio.wait_for(starting, 10)
        await svc.stop()
        assert not cfg.state_file.exists()
    run(body)


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
def test_listen_and_status_listen_take_an_ipv6_address(tmp_path: Path, span_builders) -> None:
    """`listen: "[::1]:0"` failed to start: "Failed to bind to address ::1:0"."""
    async def body() -> None:
        a = RouterApp()
        await a.start()
        cfg = load_config(write_config(tmp_path, [a], listen="[::1]:0", status_listen="[::1]:0"))
        svc = TunerService(cfg)
        await svc.start()
        try:
            attrs, span, export = span_builders
            async with grpc.aio.insecure_channel(f"[::1]:{svc.otlp_port}") as ch:
                stub = trace_service_pb2_grpc.TraceServiceStub(ch)
                await stub.Export(export([span(attrs())]), metadata=AUTH, timeout=5)
            status, doc = await get_json(f"http://[::1]:{svc.status_port}/status")
            assert status == 200 and doc["receiver"]["spans"] == 1
        finally:
            await svc.stop()
            await a.stop()

    run(body)


def test_a_router_behind_shows_per_router_and_in_every_status_line(tmp_path: Path,
                                                                   caplog) -> None:
    """A router refusing every publish (a rotated token) was logged once, then never again, and
    /metrics had nothing per router."""
    async def body() -> None:
        a, b = RouterApp(), RouterApp()
        await a.start()
        await b.start()
        path = write_config(tmp_path, [a, b])
        (tmp_path / "stale-token").write_text("old-token\n")
        doc = yaml.safe_load(path.read_text())
        doc["routers"][1]["token_file"] = "stale-token"
        path.write_text(yaml.safe_dump(doc))
        svc = TunerService(load_config(path))
        await svc.start()
        try:
            await svc.tick(0.0)
            v = svc.tuner.active.weights.version
            assert a.weights.version == v and b.weights.version == 0
            _, text = await get_json(f"http://127.0.0.1:{svc.status_port}/metrics")
            for name, value_a, value_b in (
                ("gorgo_tuner_router_acked_version", v, -1),
                ("gorgo_tuner_router_behind", 0, 1),
                ("gorgo_tuner_publishes_total", 1, 0),
                ("gorgo_tuner_publish_failures_total", 0, 1),
            ):
                assert f'{name}{{router="{a.url}"}} {float(value_a)}' in text
                assert f'{name}{{router="{b.url}"}} {float(value_b)}' in text
            caplog.set_level(logging.INFO, logger="gorgo.tuner")
            for _ in range(2):  # every status line, not the first failure alone
                caplog.clear()
                svc.log_status()
                behind = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
                assert len(behind) == 1 and b.url in behind[0]
                assert f"acknowledged no version, not v{v}" in behind[0]
                assert "missing or wrong bearer token" in behind[0]
        finally:
            await svc.stop()
            await a.stop()
            await b.stop()

    run(body)


def test_a_final_save_that_fails_is_logged_not_raised(tmp_path: Path, caplog) -> None:
    """The stop's save raised a second traceback over the first (the stop runs in the start's
    error path); at SIGTERM the failure is a log line."""
    async def body() -> None:
        a = RouterApp()
        await a.start()
        cfg = load_config(write_config(tmp_path, [a]))
        svc = TunerService(cfg)
        await svc.start()
        await svc.tick(0.0)
        svc.tuner.renumber(svc.tuner.active.weights.version)  # a change to save
        state_dir = cfg.state_file.parent
        state_dir.rename(tmp_path / "moved")
        state_dir.write_text("a file where the state directory was")
        with caplog.at_level(logging.ERROR, logger="gorgo.tuner"):
            await svc.stop()
        assert [r.getMessage() for r in caplog.records] == [
            f"final save failed: {cfg.state_file}: cannot write the state file: File exists"]
        await a.stop()

    run(body)


def test_a_state_file_that_cannot_be_written_at_start_is_one_error(tmp_path: Path,
                                                                   monkeypatch, caplog) -> None:
    """The start's save failed, then the stop's save failed again inside the error handler:
    two tracebacks. Now one StateError naming the file, and the stop does not try again."""
    def full(path: Path, _: Any) -> None:
        raise StateError(f"{path}: cannot write the state file: No space left on device")

    async def body() -> None:
        a = RouterApp()
        await a.start()
        cfg = load_config(write_config(tmp_path, [a]))
        monkeypatch.setattr("tuner.main.save_state", full)
        svc = TunerService(cfg)
        with pytest.raises(StateError, match=re.escape(str(cfg.state_file))):
            await svc.start()
        with caplog.at_level(logging.ERROR, logger="gorgo.tuner"):
            await svc.stop()
        assert not caplog.records
        await a.stop()

    run(body)


@pytest.mark.parametrize("key", ["²", "9" * 5000])
def test_a_routed_count_under_a_key_that_is_no_version_is_ignored(tmp_path: Path,
                                                                  key: str) -> None:
    """A router's `routed` counts are keyed by version: '²' passes `isdigit` and 5,000 digits
    too, and `int` refused both, a ValueError out of every tick's poll of the routers."""
    async def body() -> None:
        async with two_routers(tmp_path) as (svc, a, b):
            try:
                doc = await svc.publisher.fetch(svc.cfg.routers[0])
                assert doc is not None
                svc._docs[a.url] = {**doc, "routed": {key: {"gorgo": 7}, **doc["routed"]}}
                svc._count_routed()
                assert all(key not in counts for by_router in svc._routed.values()
                           for counts in by_router.values())
            finally:
                await b.stop()

    run(body)


def test_a_restarted_routers_decisions_still_count_for_the_census(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """A restarted router counts a version's decisions from 0 again: the tuner kept the largest
    count it had heard, so a window closed with the new run's requests still out (scored without
    them). Counted per router process now, summed; a `--workers` supervisor names its processes."""
    async def body() -> None:
        async with two_routers(tmp_path) as (svc, a, b):
            try:
                heard: dict[int, int] = {}
                monkeypatch.setattr(svc.tuner, "counting", lambda: [5])
                monkeypatch.setattr(svc.tuner, "routed", heard.__setitem__)
                doc = {k: v for k, v in (await svc.publisher.fetch(svc.cfg.routers[0])).items()
                       if k not in ("routed", "router")}

                def heard_from(url: str, **counts: Any) -> int:
                    svc._docs[url] = {**doc, **counts}
                    svc._count_routed()
                    return heard[5]

                assert heard_from(b.url, routed={}) == 0
                assert heard_from(a.url, router="p1", routed={"5": {"gorgo": 7}}) == 7
                assert heard_from(a.url, router="p1", routed={"5": {"gorgo": 6}}) == 7
                assert heard_from(a.url, router="p2", routed={"5": {"gorgo": 3}}) == 10
                assert heard_from(a.url, router="p1", routed={"5": {"gorgo": 8}}) == 11
                assert heard_from(b.url, routed={"5": {"gorgo": 30}}, routed_by={
                    "w0": {"5": {"gorgo": 4}}, "w1": {"5": {"gorgo": 2}}}) == 17
                # Worker 0 restarted: the supervisor moved its run's 4 into `retired`; kept
                # under its id too, they were counted twice (22).
                assert heard_from(b.url, retired_ids=["w0"], routed_by={
                    "retired": {"5": {"gorgo": 4}}, "w0b": {"5": {"gorgo": 1}},
                    "w1": {"5": {"gorgo": 2}}}) == 18
                monkeypatch.setattr(svc.tuner, "counting", lambda: [6])
                svc._count_routed()  # version 5 no longer scored: forgotten, processes too
                assert svc._routed == {a.url: {}, b.url: {}}
            finally:
                await b.stop()

    run(body)
