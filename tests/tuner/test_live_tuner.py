"""Live: Envoy exports its spans straight to `gorgo tuner` (OTLP/gRPC with a bearer token); the
tuner publishes weights to `gorgo extproc`'s admin API; later decisions carry the new version.
Simulated engines serve the traffic. Killing the tuner leaves routing and weights untouched, and
a restarted tuner resumes its version counter."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gorgo.core.fleet import load_fleet
from gorgo.core.tokens import Tokenization
from gorgo.envoy_config import render_bootstrap
from gorgo.harness.envoy_proc import EnvoyProcess
from gorgo.harness.procs import GorgoProcess, LoopThread, free_port, wait_for
from gorgo.sim.engine import Engine
from gorgo.sim.engine_server import EngineServer
from gorgo.sim.profiles import get_profile

pytestmark = pytest.mark.envoy
ADMIN_TOKEN = "live-admin-token"
OTLP_TOKEN = "live-otlp-token"
WORKERS = 6


def http(method: str, url: str, body: Any = None, token: str | None = ADMIN_TOKEN
         ) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if token:
        req.add_header("authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=3) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


@dataclass
class Load:
    """Closed-loop clients in the test's event loop; counts what came back."""

    url: str
    statuses: list[int] = field(default_factory=list)
    routed: int = 0
    running: bool = False
    tasks: list[asyncio.Task] = field(default_factory=list)

    async def _worker(self, seed: int) -> None:
        rng = random.Random(seed)
        async with aiohttp.ClientSession() as s:
            while self.running:
                text = f"user {rng.randrange(10**6)} asks " + "lorem ipsum " * rng.randrange(5, 300)
                body = {"model": "m", "stream": True, "max_tokens": 4,
                        "messages": [{"role": "user", "content": text}]}
                try:
                    async with s.post(self.url + "/v1/chat/completions", json=body) as r:
                        await r.read()
                        self.statuses.append(r.status)
                        self.routed += "x-gorgo-replica" in r.headers
                except aiohttp.ClientError:
                    self.statuses.append(0)

    async def start(self) -> None:
        self.running = True
        self.tasks = [asyncio.create_task(self._worker(k)) for k in range(WORKERS)]

    async def stop(self) -> None:
        self.running = False
        await asyncio.gather(*self.tasks, return_exceptions=True)


@dataclass
class Live:
    lt: LoopThread
    extproc: GorgoProcess
    tuner_config: Path
    load: Load | None = None
    tuner: GorgoProcess | None = None

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.extproc.field('metrics')}/admin/weights"

    def start_tuner(self) -> GorgoProcess:
        self.tuner = GorgoProcess(["tuner", "--config", str(self.tuner_config)])
        return self.tuner

    def stop_tuner(self) -> None:
        if self.tuner is not None:
            self.tuner.stop()

    def tuner_status(self) -> dict:
        assert self.tuner is not None
        url = f"http://127.0.0.1:{self.tuner.field('status')}/status"
        # A client timeout, not a bound on the tuner: its one event loop also runs the verdicts'
        # bootstraps, and on a loaded machine (the suite on every core) /status waited over 3 s.
        with urllib.request.urlopen(url, timeout=30) as r:
            return json.loads(r.read())

    def weights(self) -> dict:
        status, doc = http("GET", self.admin)
        assert status == 200, doc
        return doc


def _write_configs(tmp: Path, engines: list[EngineServer]) -> Path:
    fleet = tmp / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({
        "regions": {"near": {"sim": {"rtt_ms": 1, "jitter_ms": 0}},
                    "far": {"sim": {"rtt_ms": 1, "jitter_ms": 0}}},
        "replicas": [{"name": f"r{i}", "region": "near" if i < 2 else "far",
                      "address": f"127.0.0.1:{e.port}", "engine": "sglang",
                      "prefill_rate": 20000} for i, e in enumerate(engines)],
        "signals": {"probe_interval_s": 0.2, "scrape_interval_s": 0.2},
    }))
    (tmp / "admin-token").write_text(ADMIN_TOKEN)
    (tmp / "otlp-token").write_text(OTLP_TOKEN)
    return fleet


def _tuner_config(tmp: Path, metrics_port: str) -> Path:
    """A fixed OTLP port, so that Envoy finds a restarted tuner where it left the old one."""
    path = tmp / "tuner.yaml"
    path.write_text(yaml.safe_dump({
        "listen": f"127.0.0.1:{free_port()}",
        "token_file": "otlp-token",
        "status_listen": "127.0.0.1:0",
        "state_file": "tuner-state.json",
        "routers": [{"url": f"http://127.0.0.1:{metrics_port}", "token_file": "admin-token"}],
        "tick_s": 0.1,
        "log_every_s": 2,
        "optimizer": {"window_samples": 8, "pairs": 1, "bootstrap": 200},
        "calibration": {"min_samples": 20},
    }))
    return path


def _bootstrap(fleet: Path, listen: int, grpc_port: int, otlp_port: str) -> dict:
    # Envoy authenticates to the tuner's OTLP receiver and flushes spans promptly.
    boot = render_bootstrap(load_fleet(fleet), listen=f"127.0.0.1:{listen}",
                            extproc=f"127.0.0.1:{grpc_port}", otlp=f"127.0.0.1:{otlp_port}",
                            otlp_token=OTLP_TOKEN, admin=f"127.0.0.1:{free_port()}")
    boot["layered_runtime"] = {"layers": [{"name": "static", "static_layer": {
        "tracing.opentelemetry.min_flush_spans": 1,
        "tracing.opentelemetry.flush_interval_ms": 200}}]}
    return boot


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("live-tuner")
    with contextlib.ExitStack() as stack:
        lt = LoopThread()
        stack.callback(lt.close)
        tok = Tokenization()
        engines = [EngineServer(Engine(get_profile("h100-llama3-8b"), tok), tok, "m",
                                name=f"r{i}") for i in range(3)]
        for e in engines:
            lt.run(e.start())
            stack.callback(lt.run, e.stop())
        fleet = _write_configs(tmp, engines)
        grpc_port = free_port()
        extproc = GorgoProcess(["extproc", "--fleet", str(fleet), "--port", str(grpc_port),
                                "--metrics-port", "0", "--admin-token-file",
                                str(tmp / "admin-token")])
        stack.callback(extproc.stop)
        live = Live(lt, extproc, _tuner_config(tmp, extproc.field("metrics")))
        stack.callback(live.stop_tuner)
        tuner = live.start_tuner()
        listen = free_port()
        envoy = EnvoyProcess(_bootstrap(fleet, listen, grpc_port, tuner.field("otlp"))).start()
        stack.callback(envoy.stop)
        live.load = Load(f"http://127.0.0.1:{listen}")
        lt.run(live.load.start())
        stack.callback(lt.run, live.load.stop())
        yield live


def test_tuner_receives_spans_and_later_decisions_carry_its_version(live: Live) -> None:
    # The tuner publishes its first window at start, and a new one each time a window fills.
    assert wait_for(lambda: live.weights()["version"] >= 3, 20, 0.2), live.tuner_status()
    published = live.weights()["version"]
    # Spans of requests routed under that version reach the tuner (Envoy -> OTLP -> tuner).
    assert wait_for(lambda: live.tuner_status()["receiver"]["max_version_seen"] >= published,
                    10, 0.2), live.tuner_status()
    st = live.tuner_status()
    rx = st["receiver"]
    assert rx["samples"] >= 16 and rx.get("unauthenticated", 0) == 0
    assert rx.get("malformed", 0) == 0
    assert st["routers"][0]["acked_version"] >= published
    # An evaluation is scored once every request its windows routed has reported back: the
    # tuner learns how many there were from the router (GET /admin/weights "routed").
    assert wait_for(lambda: live.tuner_status()["tuner"]["evaluations"] >= 1, 20, 0.2), (
        live.tuner_status())
    last = live.tuner_status()["tuner"]["last"]
    assert last["event"] != "evaluation" or last["n_incumbent"] + last["n_candidate"] > 0
    w = live.weights()
    assert 0.05 <= w["rtt"] <= 20 and 0.05 <= w["queue"] <= 20
    assert live.load.routed > 0 and set(live.load.statuses) == {200}


def test_admin_refuses_unauthenticated_out_of_bounds_and_stale_updates(live: Live) -> None:
    before = live.weights()
    v = before["version"] + 1000
    status, doc = http("PUT", live.admin, {"rtt": 2, "queue": 2, "version": v}, token=None)
    assert status == 401
    status, doc = http("PUT", live.admin, {"rtt": 2, "queue": 2, "version": v}, token="guess")
    assert status == 401
    status, doc = http("PUT", live.admin, {"rtt": 100, "queue": 2, "version": v})
    assert status == 400 and doc["error"]["field"] == "rtt"
    status, doc = http("PUT", live.admin, {"rtt": 2, "queue": 2, "version": v,
                                           "prefill_rate": {"nope": 1000}})
    assert status == 400 and doc["error"]["field"] == "prefill_rate.nope"
    status, doc = http("PUT", live.admin, {"rtt": 2, "queue": 2, "version": 0})
    assert status == 409 and doc["error"]["active_version"] >= before["version"]
    after = live.weights()
    assert after["version"] >= before["version"]
    assert after["version"] < v  # none of the refused updates was applied


def test_killing_the_tuner_leaves_routing_unaffected_and_restart_resumes(live: Live) -> None:
    assert live.tuner is not None
    live.tuner.kill()  # SIGKILL: no goodbye, no cleanup
    frozen = live.weights()
    sent = len(live.load.statuses)
    routed = live.load.routed
    assert wait_for(lambda: len(live.load.statuses) >= sent + 60, 15, 0.1)
    assert set(live.load.statuses[sent:]) == {200}
    assert live.load.routed - routed >= 60  # still routed by the router, not failed open
    now = live.weights()
    assert now.pop("routed")[str(frozen["version"])]["gorgo"] >= 60  # counted for the tuner
    assert now == {k: v for k, v in frozen.items() if k != "routed"}
    state = json.loads((live.tuner_config.parent / "tuner-state.json").read_text())
    assert state["next_version"] > frozen["version"]
    # A restarted tuner picks up its state, keeps counting versions upwards, and Envoy's spans
    # find it again.
    live.start_tuner()
    assert wait_for(lambda: live.weights()["version"] > frozen["version"], 10, 0.2)
    resumed = live.weights()["version"]
    assert resumed >= state["next_version"]
    assert wait_for(lambda: live.tuner_status()["receiver"]["max_version_seen"] >= resumed,
                    10, 0.2), live.tuner_status()
    st = live.tuner_status()
    assert st["tuner"]["evaluations"] >= state["evaluations"]
    assert st["routers"][0]["acked_version"] >= resumed
