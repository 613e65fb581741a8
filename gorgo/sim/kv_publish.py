"""The simulated engine's KV events, as vLLM publishes them: same hashes, same wire, same replay.

A simulated vLLM that publishes events tokenizes prompts with `SimTokenizer` and keys its cache on
the block hashes vLLM would compute for those tokens (`SimHashing`, ``sha256_cbor``), so a router
with ``tokenizer: sim`` reproduces them exactly as it would a real vLLM's with the served model's
tokenizer. `KVEventPublisher` is vLLM's ``ZmqEventPublisher`` behaviour: a PUB socket sending
``[topic, seq, msgpack([ts, events, 0])]`` with seq counting batches from 0, bound when the
endpoint has a wildcard (``*``, ``::``) or is ipc/inproc and connected otherwise, and a ROUTER
replay socket that answers ``["", start_seq]`` with the buffered batches from there and an end
marker (seq -1).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any

import msgpack
import numpy as np
import zmq
import zmq.asyncio

from gorgo.core.block_hashes import DEFAULT_SEED, BlockHasher
from gorgo.core.kv_events import END_SEQ, KVEvent, encode_batch, publisher_binds
from gorgo.core.prompt_tokens import SimTokenizer
from gorgo.core.tokens import Tokenization

HASH_ALGO = "sha256_cbor"  # what the simulated vLLM runs with (and the docs recommend)
BUFFER_STEPS = 10_000  # vLLM's default replay buffer
_END = END_SEQ.to_bytes(8, "big", signed=True)


class SimHashing:
    """The simulated vLLM's tokens and block hashes of a prompt."""

    def __init__(self, tok: Tokenization, seed: str = DEFAULT_SEED) -> None:
        self.tokenizer = SimTokenizer(tok.chars_per_token)
        self.hasher = BlockHasher(HASH_ALGO, tok.block_tokens, seed)

    def blocks(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, the engine's hash of each full block) of a prompt's text."""
        ids = self.tokenizer.ids(text)
        return ids, np.array(self.hasher.hashes(ids.tolist()), dtype=np.uint64)


class KVEventPublisher:
    """One engine's event publisher (see module docstring); asyncio, on the engine's loop."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = BUFFER_STEPS) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._task: asyncio.Task[None] | None = None

    def config(self) -> dict[str, Any]:
        """What vLLM's /kv_event_sources answers: the resolved config per data-parallel rank."""
        return {"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                      "buffer_steps": self._buffer.maxlen, "topic": self.topic}}

    async def start(self) -> None:
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        if publisher_binds(self.endpoint):
            self._pub.bind(self.endpoint)
        else:
            self._pub.connect(self.endpoint)
        if self.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.replay_endpoint)
            self._task = asyncio.create_task(self._serve_replay())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        self._ctx.term()

    def publish(self, events: list[KVEvent]) -> None:
        """Send one batch (an engine step's events); nothing for an empty step."""
        if not events or self._pub is None:
            return
        payload = msgpack.packb(encode_batch(time.time(), events))
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):  # PUB never blocks; a slow subscriber loses it
            self._pub.send_multipart((self.topic.encode(), seq.to_bytes(8, "big"), payload),
                                     flags=zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            topic = self.topic.encode()
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart(
                        (client, b"", topic, seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", b"", _END, b""))
