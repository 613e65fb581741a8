"""The router's KV-event subscriptions over real ZMQ: history replayed on subscribe, live
batches, a gap filled by replay, an engine restart, a gap the replay cannot fill, and discovery
of a simulated vLLM through /kv_event_sources (its events then drive the router's lookup)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

import extproc.kv_events as kv_events_module
from extproc.kv_events import KVEventsClient, parse_sources, subscriber_endpoint
from extproc.telemetry import RouterMetrics
from gorgo.core.features import extract_features, prompt_text
from gorgo.core.fleet import parse_fleet
from gorgo.core.kv_events import END_SEQ, STORED, KVEvent, encode_batch
from gorgo.core.router import Router
from gorgo.harness.procs import free_ports
from gorgo.sim.fleet import SimFleet
from gorgo.sim.kv_publish import SimHashing

BT = 64
WAIT_S = 10.0


class FakePublisher:
    """vLLM's publisher, with knobs: drop a batch on the wire, restart, forget history."""

    def __init__(self, pub: str, replay: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.connect(pub)  # not a wildcard: the router binds, as with vLLM
        self.replay = self.ctx.socket(zmq.ROUTER)
        self.replay.bind(replay)
        self.buffer: deque[tuple[int, bytes]] = deque()
        self.seq = 0
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.replay.recv_multipart()
            for seq, payload in list(self.buffer):
                if seq >= int.from_bytes(start, "big"):
                    await self.replay.send_multipart(
                        [client, b"", b"kv", seq.to_bytes(8, "big"), payload])
            await self.replay.send_multipart(
                [client, b"", b"", END_SEQ.to_bytes(8, "big", signed=True), b""])

    async def publish(self, hashes: list[int], *, send: bool = True) -> None:
        payload = msgpack.packb(encode_batch(time.time(), [KVEvent(STORED, tuple(hashes), None,
                                                                   (), BT)]))
        self.buffer.append((self.seq, payload))
        if send:
            await self.pub.send_multipart([b"kv", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    async def send_stale(self, seq: int, ts: float, hashes: list[int]) -> None:
        """A batch of the process before a restart, still on the wire."""
        payload = msgpack.packb(encode_batch(ts, [KVEvent(STORED, tuple(hashes), None, (), BT)]))
        await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    def restart(self) -> None:
        self.buffer.clear()
        self.seq = 0

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.pub.close(0)
        self.replay.close(0)
        self.ctx.term()


async def until(pred, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def test_endpoint_rules() -> None:
    assert subscriber_endpoint("tcp://*:5557", "10.0.0.7") == ("tcp://10.0.0.7:5557", False)
    assert subscriber_endpoint("tcp://127.0.0.1:5557", "h") == ("tcp://127.0.0.1:5557", True)
    assert subscriber_endpoint("ipc:///tmp/x", "h") == ("ipc:///tmp/x", False)
    src = parse_sources({"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                               "endpoint": "tcp://*:1", "replay_endpoint": None, "topic": "t"}})
    assert (src.endpoint, src.replay_endpoint, src.topic) == ("tcp://*:1", None, "t")
    # vLLM's buffer_steps 0: its replay socket keeps nothing, so every answer would be empty
    kept = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:1",
            "replay_endpoint": "tcp://*:2", "topic": "t"}
    assert parse_sources({"0": {**kept, "buffer_steps": 10000}}).replay_endpoint == "tcp://*:2"
    assert parse_sources({"0": {**kept, "buffer_steps": 0}}).replay_endpoint is None
    with pytest.raises(ValueError, match="no KV event publisher"):
        parse_sources({})


def _precise_replica() -> tuple[Router, FakePublisher]:
    """A router of one precise vLLM replica "v" and its publisher (call on a running loop)."""
    pub_port, replay_port, http_port = free_ports(3)
    pub, replay = f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"
    spec = parse_fleet({"regions": {"a": None}, "block_tokens": BT, "replicas": [{
        "name": "v", "region": "a", "address": f"127.0.0.1:{http_port}", "engine": "vllm",
        "cache": "precise", "tokenizer": "sim",
        "kv_events": {"endpoint": pub, "replay_endpoint": replay, "topic": "kv"}}]})
    router = Router(spec)
    assert router.state.precise is not None
    router.state.observe_cache_config(0, BT, 10_000, "sha256_cbor")
    return router, FakePublisher(pub, replay)


def test_history_live_gap_restart_and_lost() -> None:
    async def go() -> None:
        router, fake = _precise_replica()
        s = router.state
        await fake.publish([1, 2])  # before the router subscribed: only the replay has it
        client = KVEventsClient(router, RouterMetrics(s, lambda: 0))
        await client.start()
        try:
            await until(lambda: s.precise.live(0) and s.precise.blocks_held(0) == 2, "history")
            await asyncio.sleep(0.3)  # the SUB connection is up by now (it joined late)
            await fake.publish([3])
            await until(lambda: s.precise.blocks_held(0) == 3, "a live batch")
            await fake.publish([4], send=False)  # lost on the wire
            await fake.publish([5])
            await until(lambda: s.precise.blocks_held(0) == 5, "the gap filled by replay")
            assert client.streams[0].gaps == 1 and s.precise.live(0)
            fake.restart()  # a new engine process: empty cache, seq from 0
            await fake.publish([10])
            await until(lambda: s.precise.blocks_held(0) == 1, "the restart's clear")
            assert client.streams[0].restarts == 1
            await fake.publish([11], send=False)
            fake.buffer.clear()  # ... and the replay buffer moved past it
            await fake.publish([12])
            await until(lambda: client.streams[0].lost == 1, "an unfillable gap")
            await until(lambda: s.precise.live(0) and s.precise.blocks_held(0) == 1,
                        "the rebuilt set")
            text = (await asyncio.to_thread(_metrics, client))
            assert 'gorgo_kv_event_gaps_total{kind="restart",region="a",replica="v"} 1.0' in text
        finally:
            await client.stop()
            await fake.close()

    asyncio.run(go())


async def _synced() -> tuple[Router, FakePublisher, KVEventsClient]:
    """A precise replica whose two stored blocks the router's subscription has synced, its SUB
    connection up (it joined late)."""
    router, fake = _precise_replica()
    s = router.state
    await fake.publish([1, 2])
    client = KVEventsClient(router, RouterMetrics(s, lambda: 0))
    await client.start()
    await until(lambda: s.precise.live(0) and s.precise.blocks_held(0) == 2, "history")
    await asyncio.sleep(0.3)
    return router, fake, client


def test_batches_of_the_process_before_a_restart_are_dropped_not_applied() -> None:
    async def go() -> None:
        router, fake, client = await _synced()  # blocks 1, 2 at seqs 0, 1
        s = router.state
        st = client.streams
        try:
            old_ts = time.time()
            await asyncio.sleep(0.01)
            fake.restart()
            await fake.publish([10], send=False)  # the new process's first batch, before we hear
            # A batch the old process published before it died: past the next seq, a gap. The
            # new process answers the replay from 2 with nothing; the set had been cleared and
            # the old batch applied.
            await fake.send_stale(5, old_ts, [99])
            await until(lambda: st[0].stale == 1 and st[0].restarts == 1 and s.precise.live(0),
                        "the resync")
            assert s.precise.blocks_held(0) == 1 and st[0].lost == 0
            # Another at the next seq (1): it had been applied as the new process's.
            await fake.send_stale(1, old_ts, [98])
            await until(lambda: st[0].stale == 2, "the live batch dropped")
            await fake.publish([11])
            await until(lambda: s.precise.blocks_held(0) == 2, "the new process's next batch")
            assert st[0].restarts == 1 and st[0].lost == 0 and s.precise.live(0)
            text = (await asyncio.to_thread(_metrics, client))
            assert 'gorgo_kv_event_gaps_total{kind="stale",region="a",replica="v"} 2.0' in text
        finally:
            await client.stop()
            await fake.close()

    asyncio.run(go())


def test_a_replay_socket_that_never_answers_is_given_up_after_a_few_tries(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # A replay port the router cannot reach (a firewall letting the PUB port through): the
    # replica stayed on its approximate view for good, its live batches unread, and nothing said
    # why. Now counted and warned, and after REPLAY_TRIES the stream is taken as it comes.
    monkeypatch.setattr(kv_events_module, "REPLAY_TIMEOUT_S", 0.2)
    monkeypatch.setattr(kv_events_module, "RETRY_S", 0.05)

    async def go() -> None:
        router, fake = _precise_replica()
        s = router.state
        fake.task.cancel()  # its replay socket stays bound and never answers
        client = KVEventsClient(router, RouterMetrics(s, lambda: 0))
        await client.start()
        try:
            await until(lambda: client.errors[0]["replay"] == kv_events_module.REPLAY_TRIES,
                        "the unanswered replays")
            await until(lambda: s.precise.live(0), "the stream taken as it comes")
            await asyncio.sleep(0.3)  # the SUB connection is up by now (it joined late)
            await fake.publish([1, 2])
            await until(lambda: s.precise.blocks_held(0) == 2, "a live batch")
            # The first batch after an empty history is checked against the replay: the silent
            # socket is asked REPLAY_TRIES times more before that batch is taken as it comes.
            text = (await asyncio.to_thread(_metrics, client))
            assert 'gorgo_kv_event_errors_total{kind="replay",region="a",replica="v"} 6.0' in text
        finally:
            await client.stop()
            await fake.close()

    warned = _warnings_of(go, caplog)
    assert any("event=kv_events_failed" in m and "kind=replay" in m for m in warned), warned


@pytest.mark.slow
def test_an_unreadable_batch_is_counted_and_warned_and_the_view_comes_back(
        caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        router, fake, client = await _synced()
        s = router.state
        try:
            bad = msgpack.packb([1.0, [{"type": STORED, "block_hashes": [3], "token_ids": 5,
                                        "block_size": BT}], 0])
            await fake.pub.send_multipart([b"kv", fake.seq.to_bytes(8, "big"), bad])
            await until(lambda: client.errors[0]["format"] == 1, "the failure counted")
            # the next subscription replays the engine's (good) history: live again
            await until(lambda: s.precise.live(0) and s.precise.blocks_held(0) == 2, "resync")
            text = (await asyncio.to_thread(_metrics, client))
            assert 'gorgo_kv_event_errors_total{kind="format",region="a",replica="v"} 1.0' in text
        finally:
            await client.stop()
            await fake.close()

    warned = _warnings_of(go, caplog)
    assert any("event=kv_events_failed replica=v kind=format" in m and "token_ids" in m
               for m in warned), warned


@pytest.mark.slow
def test_a_message_over_the_size_limit_is_refused_unread(monkeypatch: pytest.MonkeyPatch) -> None:
    # Anything reaching the port the router binds could push a 400 MB frame, received whole.
    monkeypatch.setattr(kv_events_module, "MAX_EVENT_MESSAGE_BYTES", 4096)

    async def go() -> None:
        router, fake, client = await _synced()
        s = router.state
        big = zmq.asyncio.Context()
        sender = big.socket(zmq.PUB)
        sender.connect(router.spec.replicas[0].precise.kv_events.endpoint)
        try:
            await asyncio.sleep(0.3)  # its connection is up by now
            payload = msgpack.packb(encode_batch(time.time(), [KVEvent(
                STORED, tuple(range(1 << 40, (1 << 40) + 600)), None, (), BT)]))
            assert len(payload) > 4096
            await sender.send_multipart([b"kv", fake.seq.to_bytes(8, "big"), payload])
            await asyncio.sleep(0.5)
            assert s.precise.blocks_held(0) == 2 and client.batches[0] == 0
            await fake.publish([3])  # the engine's own batches still come through
            await until(lambda: s.precise.blocks_held(0) == 3, "a live batch")
        finally:
            sender.close(0)
            big.term()
            await client.stop()
            await fake.close()

    asyncio.run(go())


async def _chat(port: int, text: str) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    async with aiohttp.ClientSession() as http, http.post(
            f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        await resp.read()
    return body


def _warnings_of(go: Callable[[], Coroutine[Any, Any, None]],
                 caplog: pytest.LogCaptureFixture) -> list[str]:
    """``go()`` run with the KV client's warnings captured: their messages."""
    with caplog.at_level("WARNING", logger="gorgo.kv_events"):
        asyncio.run(go())
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def _metrics(client: KVEventsClient) -> str:
    from prometheus_client import generate_latest

    return generate_latest(client.metrics.registry).decode()


def test_router_follows_a_simulated_vllm_found_through_kv_event_sources() -> None:
    async def go() -> None:
        (port,) = free_ports(1)
        spec = parse_fleet({"regions": {"a": {"sim": {"rtt_ms": 1, "jitter_ms": 0}}},
                            "block_tokens": BT, "replicas": [{
                                "name": "v", "region": "a", "address": f"127.0.0.1:{port}",
                                "engine": "sim", "sim": {"profile": "tiny-test", "flavor": "vllm"},
                                "cache": "precise", "tokenizer": "sim"}]})
        fleet = SimFleet(spec)
        await fleet.start()
        router = Router(spec)
        s = router.state
        s.observe_cache_config(0, BT, 100_000, "sha256_cbor")
        client = KVEventsClient(router, RouterMetrics(s, lambda: 0))
        await client.start()
        try:
            await until(lambda: s.precise.live(0), "the first sync")
            body = await _chat(port, "token " * 600)
            _, hashes = SimHashing(s.tok).blocks(prompt_text("chat", body))
            await until(lambda: s.precise.blocks_held(0) >= len(hashes), "the engine's stores")
            f = extract_features("/v1/chat/completions", {}, json.dumps(body).encode(), s.tok)
            assert s.matched_blocks(f)[0] == len(hashes) == f.n_blocks
            await fleet.kill("v")  # an engine restart: its cache is gone, its seq starts over
            await fleet.revive("v")
            other = await _chat(port, "other " * 300)
            _, fresh = SimHashing(s.tok).blocks(prompt_text("chat", other))
            await until(lambda: client.streams[0].restarts == 1
                        and s.precise.blocks_held(0) == len(fresh), "the restart seen")
            assert s.matched_blocks(f)[0] == 0
        finally:
            await client.stop()
            await fleet.stop()

    asyncio.run(go())
