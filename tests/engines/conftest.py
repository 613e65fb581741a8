"""Two real vLLM engines behind real Envoy and `gorgo extproc` (`make test-engines`).

Engine ``a`` publishes KV events to an endpoint the router binds (declared in the fleet file:
vLLM connects to it); engine ``b`` binds ipc sockets that the router finds through
``/kv_event_sources``, and that the tests' own subscribers can join too. Both have a KV pool of
``POOL_BLOCKS`` blocks of 128 tokens, smaller than what the tests send, so they evict. Each runs
on its own core. Everything listens on loopback ports picked at run time, and every process is
stopped by its own id at the end of the session.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import yaml

from gorgo.core.fleet import load_fleet
from gorgo.envoy_config import render_bootstrap
from gorgo.harness import vllm_proc
from gorgo.harness.envoy_proc import EnvoyProcess
from gorgo.harness.procs import GorgoProcess, LoopThread, free_ports, wait_for
from gorgo.harness.vllm_proc import KVEvents, VLLMProcess
from tests.support.e2e import GorgoMetrics, SpanSink

POOL_BLOCKS = 96  # 12,288 tokens: a few of the tests' prompts fill it
MAX_MODEL_LEN = 8192


@dataclass
class EngineStack:
    engines: dict[str, VLLMProcess]
    extproc: GorgoProcess
    envoy: EnvoyProcess
    sink: SpanSink
    lt: LoopThread
    url: str
    fleet_path: Path
    b_events: KVEvents

    def metrics(self) -> GorgoMetrics:
        return GorgoMetrics(self)  # type: ignore[arg-type]

    def chat(self, content: str, max_tokens: int = 4, stream: bool = True,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes, float]:
        """(status, headers, body, seconds to the first body byte) of one chat through Envoy."""
        body = {"model": vllm_proc.SERVED_NAME, "stream": stream, "max_tokens": max_tokens,
                "ignore_eos": True, "messages": [{"role": "user", "content": content}]}
        return self.lt.run(_post(f"{self.url}/v1/chat/completions", body, headers or {}), 120)


async def _post(url: str, body: dict, headers: dict[str, str]) -> tuple[int, dict, bytes, float]:
    t0 = time.perf_counter()
    first = None
    chunks = []
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        async for chunk in r.content.iter_any():
            first = first if first is not None else time.perf_counter() - t0
            chunks.append(chunk)
        return (r.status, {k.lower(): v for k, v in r.headers.items()}, b"".join(chunks),
                first if first is not None else time.perf_counter() - t0)


def _fleet(tmp: Path, ports: dict[str, int], a_events: KVEvents) -> Path:
    model = str(vllm_proc.MODEL)
    doc = {
        "regions": {"local": None},
        "replicas": [
            {"name": "a", "region": "local", "address": f"127.0.0.1:{ports['a']}",
             "engine": "vllm", "cache": "precise", "tokenizer": model, "prefill_rate": 3000,
             "kv_events": {"endpoint": a_events.endpoint,
                           "replay_endpoint": a_events.replay_endpoint, "topic": "kv"}},
            {"name": "b", "region": "local", "address": f"127.0.0.1:{ports['b']}",
             "engine": "vllm", "cache": "precise", "tokenizer": model, "prefill_rate": 3000},
        ],
        "policy": "gorgo",
        "signals": {"probe_interval_s": 0.5, "scrape_interval_s": 0.5},
        "timeouts": {"request_s": 120},
    }
    path = tmp / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineStack]:
    if not vllm_proc.available():
        pytest.skip("no engine venv/model: run `make test-engines`")
    tmp = tmp_path_factory.mktemp("engines")
    port_a, port_b, pub_a, replay_a, grpc, listen, admin = free_ports(7)
    a_events = KVEvents(f"tcp://127.0.0.1:{pub_a}", f"tcp://127.0.0.1:{replay_a}")
    b_events = KVEvents(f"ipc://{tmp}/b.pub", f"ipc://{tmp}/b.replay")
    engines = {
        "a": VLLMProcess("a", port_a, 0, tmp, num_blocks=POOL_BLOCKS, events=a_events,
                         max_model_len=MAX_MODEL_LEN),
        "b": VLLMProcess("b", port_b, 1, tmp, num_blocks=POOL_BLOCKS, events=b_events,
                         max_model_len=MAX_MODEL_LEN),
    }
    lt = LoopThread()
    sink = SpanSink()
    started: list[object] = []
    try:
        for e in engines.values():
            e.start()
        for e in engines.values():
            e.wait_ready()
        lt.run(sink.start())
        fleet_path = _fleet(tmp, {"a": port_a, "b": port_b}, a_events)
        extproc = GorgoProcess(["extproc", "--fleet", str(fleet_path), "--port", str(grpc),
                                "--metrics-port", "0"], timeout=60)
        started.append(extproc)
        boot = render_bootstrap(load_fleet(fleet_path), listen=f"127.0.0.1:{listen}",
                                extproc=f"127.0.0.1:{grpc}", otlp=f"127.0.0.1:{sink.port}",
                                admin=f"127.0.0.1:{admin}")
        envoy = EnvoyProcess(boot).start()
        started.append(envoy)
        st = EngineStack(engines, extproc, envoy, sink, lt, f"http://127.0.0.1:{listen}",
                         fleet_path, b_events)
        assert wait_for(lambda: all(st.metrics().rtt_known()), 30)
        assert wait_for(lambda: set(st.metrics().values("gorgo_kv_events_synced").values())
                        == {1.0}, 60), st.metrics().text
        yield st
    finally:
        for proc in reversed(started):
            proc.stop()  # type: ignore[attr-defined]
        for e in engines.values():
            e.stop()
        lt.run(sink.stop())
        lt.close()


def get_json(url: str) -> object:
    async def go() -> object:
        async with aiohttp.ClientSession() as s, s.get(url) as r:
            return json.loads(await r.read() or b"null")

    return asyncio.run(go())
