"""Open-loop load through Envoy for the tests that replay an attack beside normal traffic.

Every request is sent at its scheduled time whatever happened to the earlier ones (one task per
request, no connection cap), so a router that slows down shows up as latency and errors instead of
a lower offered load. Each answer is recorded with its send time, status, latency and the replica
the router named; a request that got no HTTP answer has status None.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.error
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from gorgo.core.contract import REPLICA_HEADER
from gorgo.harness.stack import LiveStack

CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class Planned:
    at_s: float  # after the start of the run
    kind: str  # "normal", "attack", ...
    body: bytes


@dataclass(frozen=True, slots=True)
class Answer:
    kind: str
    sent: float  # time.monotonic()
    status: int | None
    latency_s: float
    replica: str | None
    body: bytes


def chat_body(text: str, max_tokens: int = 4) -> bytes:
    return json.dumps({"model": "m", "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": text}]}).encode()


def normal_traffic(rate: float, duration_s: float, start_s: float = 0.0,
                   words: int = 40) -> list[Planned]:
    """``rate`` short chat requests a second for ``duration_s``, each with its own random text
    (no shared prefix, so no replica is preferred for its cache)."""
    n = round(rate * duration_s)
    return [Planned(start_s + k / rate, "normal",
                    chat_body(f"{os.urandom(8).hex()} " + "word " * words)) for k in range(n)]


def run(url: str, plan: Sequence[Planned], timeout_s: float = 30.0) -> list[Answer]:
    """Send ``plan`` open loop to ``url`` (Envoy's listener) and wait for every answer."""

    async def one(s: aiohttp.ClientSession, p: Planned, t0: float) -> Answer:
        await asyncio.sleep(max(0.0, t0 + p.at_s - time.monotonic()))
        sent = time.monotonic()
        try:
            async with s.post(url + CHAT_PATH, data=p.body,
                              headers={"content-type": "application/json"}) as r:
                body = await r.read()
                return Answer(p.kind, sent, r.status, time.monotonic() - sent,
                              r.headers.get(REPLICA_HEADER), body)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return Answer(p.kind, sent, None, time.monotonic() - sent, None, repr(exc).encode())

    async def go() -> list[Answer]:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=conn) as s:
            t0 = time.monotonic() + 0.2
            return list(await asyncio.gather(*(one(s, p, t0) for p in plan)))

    return asyncio.run(go())


def p50_ms(answers: Sequence[Answer]) -> float:
    return float(np.median([a.latency_s for a in answers if a.status == 200])) * 1000


def shares(answers: Sequence[Answer], replicas: Sequence[str]) -> np.ndarray:
    """Fraction of the routed answers each replica served."""
    counts = np.array([sum(a.replica == r for a in answers) for r in replicas], dtype=float)
    return counts / max(counts.sum(), 1.0)


def per_replica(stack: LiveStack, name: str) -> dict[str, float]:
    """A router gauge by replica name."""
    out = {}
    for labels, value in stack.metric_values(name).items():
        replica = labels.split('replica="', 1)[1].split('"', 1)[0]
        out[replica] = value
    return out


class Sampler:
    """Reads ``fn()`` every ``period_s`` in a thread: a timeline of (monotonic time, value)."""

    def __init__(self, fn: Callable[[], Any], period_s: float = 0.1) -> None:
        self.fn = fn
        self.period_s = period_s
        self.samples: list[tuple[float, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with suppress(OSError, urllib.error.URLError):  # a restarting router
                self.samples.append((time.monotonic(), self.fn()))
            self._stop.wait(self.period_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def first(self, pred: Callable[[Any], bool], after: float) -> float | None:
        """The first sample time at or after ``after`` whose value satisfies ``pred``."""
        return next((t for t, v in self.samples if t >= after and pred(v)), None)
