"""The simulated vLLM's KV events: vLLM's wire format and hashes, stores, evictions, replay,
/kv_event_sources and cache_config_info; and the engine model's event log on its own."""

from __future__ import annotations

import asyncio

import aiohttp
import msgpack
import numpy as np
import zmq
import zmq.asyncio

from extproc.engine_metrics import parse_engine_metrics
from gorgo.core.block_hashes import BlockHasher
from gorgo.core.features import prompt_text
from gorgo.core.kv_events import END_SEQ, REMOVED, STORED, decode_batch
from gorgo.core.prompt_tokens import SimTokenizer
from gorgo.core.tokens import Tokenization
from gorgo.sim.engine import Engine, EngineRequest
from gorgo.sim.engine_server import EngineServer
from gorgo.sim.kv_publish import HASH_ALGO, KVEventPublisher, SimHashing
from gorgo.sim.profiles import get_profile

TOK = Tokenization(4.0, 16)


def test_engine_logs_stores_with_parents_and_evictions() -> None:
    eng = Engine(get_profile("tiny-test"), TOK, kv_events=True)  # 2048 tokens of KV
    hashing = SimHashing(TOK)
    texts = ["a" * 4 * 600, "b" * 4 * 600, "c" * 4 * 600, "d" * 4 * 600]
    t = 0.0
    stored: set[int] = set()
    removed: list[int] = []
    for k, text in enumerate(texts):
        ids, hashes = hashing.blocks(text)
        eng.submit(EngineRequest(k, len(ids), hashes, 2, t, ids), t)
        while eng.has_work():
            t = eng.step(t).end
        for e in eng.take_kv_events():
            if e.kind == STORED:
                assert e.block_size == 16 and len(e.token_ids) == 16 * len(e.block_hashes)
                run = [int(h) for h in hashes]
                first = run.index(e.block_hashes[0])
                assert e.parent == (run[first - 1] if first else None)
                assert list(e.block_hashes) == run[first:first + len(e.block_hashes)]
                stored.update(e.block_hashes)
            else:
                assert e.kind == REMOVED
                removed.extend(e.block_hashes)
    assert removed and set(removed) <= stored  # the pool is smaller than the four prompts
    assert set(eng.cache._refs) == stored - set(removed)  # the events are the cache exactly
    assert eng.take_kv_events() == []


def test_server_publishes_vllm_events_and_replays_them(tmp_path) -> None:
    async def go() -> None:
        base = f"ipc://{tmp_path}/kv"
        pub = KVEventPublisher(f"{base}.pub", f"{base}.replay", topic="kv")
        server = EngineServer(Engine(get_profile("tiny-test"), TOK, kv_events=True), TOK, "m",
                              flavor="vllm", kv_events=pub)
        port = await server.start()
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(f"{base}.pub")
        await asyncio.sleep(0.2)
        body = {"model": "m", "messages": [{"role": "user", "content": "x y " * 100}],
                "max_tokens": 2}
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{server.url}/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                async with http.get(f"{server.url}/kv_event_sources") as r:
                    sources = await r.json()
                async with http.get(f"{server.url}/metrics") as r:
                    metrics = await r.text()
            assert sources["0"]["endpoint"] == f"{base}.pub" and sources["0"]["topic"] == "kv"
            cache = parse_engine_metrics(metrics, "vllm").cache
            assert cache is not None and (cache.block_size, cache.hash_algo) == (16, HASH_ALGO)
            assert cache.num_blocks == get_profile("tiny-test").kv_capacity_tokens // 16
            topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
            assert topic == b"kv" and int.from_bytes(seq, "big") == 0
            raw = msgpack.unpackb(payload)
            assert raw[2] == 0 and raw[1][0]["type"] == "BlockStored"
            batch = decode_batch(0, raw)
            ids = SimTokenizer(4.0).ids(prompt_text("chat", body)).tolist()
            want = BlockHasher(HASH_ALGO, 16).hashes(ids)
            assert list(batch.events[0].block_hashes) == want
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(f"{base}.replay")
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            first = await asyncio.wait_for(dealer.recv_multipart(), 5)
            end = await asyncio.wait_for(dealer.recv_multipart(), 5)
            assert first[1:] == [b"kv", seq, payload]
            assert int.from_bytes(end[2], "big", signed=True) == END_SEQ
            dealer.close(0)
            assert port
        finally:
            sub.close(0)
            ctx.term()
            await server.stop()

    asyncio.run(go())


def test_sim_hashing_is_vllms_over_the_sim_tokens() -> None:
    ids, hashes = SimHashing(TOK).blocks("hello world " * 20)
    assert len(ids) == 60 and hashes.dtype == np.uint64
    assert hashes.tolist() == BlockHasher(HASH_ALGO, 16).hashes(ids.tolist())
