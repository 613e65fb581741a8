"""Per-request CPU cost of the router's ext_proc hot path, in process: no Envoy, no network.

Why: at concurrency 1 the router's own CPU work is a large share of the latency it adds over a
no-op Python ext_proc (docs/benchmarks.md, "Data plane"). This isolates that work so changes to
it can be measured in microseconds, not in noisy end-to-end milliseconds.

What it drives: `ExtProcService.Process`, the servicer gRPC calls, on one stream per request, fed
the messages Envoy sends (request headers, the buffered body, and unless skipped the response
headers), each decoded from its wire bytes with `read_request` and each answer encoded with
`SerializeToString`, as grpc.aio does around the servicer. What grpc.aio itself costs per message
(its Cython stream code) is not here: the no-op ext_proc of bench.dataplane measures that.

Fleet: `envoy/fleet.example.yaml` (3 regions x 2 replicas, policy gorgo); RTTs from the link
presets, engine scrapes every simulated second. Bodies: OpenAI chat completions of 2-8k
characters, multi-turn chats over shared system prompts, each the next turn of a conversation
whose previous turn was routed during warm-up. The clock is simulated (3 ms per request, as at
concurrency 1), so a run is deterministic: ``--digest`` prints a hash of every answer's bytes,
for checking that a change leaves every decision, header and metadata field as it was.

Reported: thread CPU time per request in microseconds, median and p90 over the requests, split
by phase (headers, body, response headers, the stream's close), with all three messages and with
the response headers skipped (fleet ``extproc: {response_headers: skip}``).

Usage:
    python -m bench.hotpath                       # both modes, 4000 requests each
    python -m bench.hotpath --requests 10000 --repeats 3
    python -m bench.hotpath --profile body        # cProfile of 4000 requests, top functions
    python -m bench.hotpath --digest              # answers' sha256 per mode (no timing)
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import hashlib
import json
import pstats
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from extproc.service import ExtProcService, read_request
from extproc.telemetry import RouterMetrics
from gorgo._xds.envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from gorgo._xds.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from gorgo.core.fleet import LINK_PRESETS, parse_fleet
from gorgo.core.router import Router

FLEET = Path(__file__).resolve().parent.parent / "envoy" / "fleet.example.yaml"
STEP_S = 0.003  # simulated time between requests (concurrency 1: Envoy and the client run)
SCRAPE_S = 1.0  # simulated engine scrape interval (the example fleet's)
PHASES = ("headers", "body", "response_headers", "close")
MODES = {"send": {}, "skip": {"response_headers": "skip"}}
_PROSE = ("the router sends each request to the replica with the lowest predicted time to first "
          "token which adds network round trip queue wait and prefill of the uncached prompt "
          "prefix a long conversation keeps its earlier turns cached")
_WORDS = _PROSE.split()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n // 6 + 1))[:n]


def _body(messages: list[dict[str, str]], model: str) -> bytes:
    return json.dumps({"model": model, "messages": messages, "max_tokens": 256,
                       "temperature": 0.7, "stream": True}).encode()


def make_bodies(n: int, seed: int = 11) -> tuple[list[bytes], list[bytes]]:
    """(previous turns, measured bodies): ``n`` chats of 2-8k characters over 8 system prompts."""
    rng = random.Random(seed)
    systems = [_text(rng, rng.randint(800, 2500)) for _ in range(8)]
    previous, measured = [], []
    for _ in range(n):
        target = rng.randint(2000, 8000)
        msgs = [{"role": "system", "content": rng.choice(systems)}]
        while len(_body(msgs, "m")) < target - 600:
            msgs += [{"role": "user", "content": _text(rng, rng.randint(150, 600))},
                     {"role": "assistant", "content": _text(rng, rng.randint(150, 600))}]
        previous.append(_body(msgs[:-1], "m"))
        room = max(50, target - len(_body(msgs, "m")) - 40)
        measured.append(_body([*msgs, {"role": "user", "content": _text(rng, room)}], "m"))
    return previous, measured


def _headers(body: bytes) -> bytes:
    # What Envoy forwards to the router: only the headers it reads (contract.ROUTER_READS).
    hdrs = {":path": "/v1/chat/completions", ":method": "POST", "content-length": str(len(body))}
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode())
                                   for k, v in hdrs.items()]))).SerializeToString()


RESPONSE_HEADERS = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=HeaderMap(
    headers=[HeaderValue(key=":status", raw_value=b"200"),
             HeaderValue(key="x-envoy-attempt-count", raw_value=b"1")]))).SerializeToString()


class _Feed:
    """The request iterator gRPC hands the servicer: one message at a time, set by the driver."""

    def __init__(self) -> None:
        self.next: pb.ProcessingRequest | None = None

    def __aiter__(self) -> _Feed:
        return self

    async def __anext__(self) -> Any:
        msg, self.next = self.next, None
        if msg is None:
            raise StopAsyncIteration
        return msg


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Bench:
    """One router and servicer on the example fleet, in one of the `MODES`."""

    def __init__(self, mode: str, n_bodies: int = 64) -> None:
        doc = yaml.safe_load(FLEET.read_text())
        if MODES[mode]:
            doc["extproc"] = MODES[mode]
        spec = parse_fleet(doc, str(FLEET))
        self.clock = Clock()
        self.router = Router(spec, id_prefix="hot", salt="hot", unbounded_prefix=False)
        s = self.router.state
        for i in range(s.n):
            s.observe_rtt(i, LINK_PRESETS[spec.replicas[i].region][0])
        self._scrape()
        self.svc = ExtProcService(self.router, RouterMetrics(s, lambda: self.router.open_requests),
                                  clock=self.clock)
        self.send_response = not spec.extproc.skip_response_headers
        previous, bodies = make_bodies(n_bodies)
        self.requests = [(_headers(b), pb.ProcessingRequest(request_body=pb.HttpBody(
            body=b, end_of_stream=True)).SerializeToString()) for b in bodies]
        self.answers: list[bytes] = []
        self.keep = False
        asyncio.run(self._warm(previous))

    def _scrape(self) -> None:
        s = self.router.state
        now = self.clock.now
        for i in range(s.n):
            s.observe_engine(i, now, queue_reqs=float(i % 3), running_reqs=4.0, kv_usage=0.3)
        self._scraped = now

    async def _warm(self, previous: list[bytes]) -> None:
        for b in previous:
            await self.one((_headers(b), pb.ProcessingRequest(request_body=pb.HttpBody(
                body=b, end_of_stream=True)).SerializeToString()))

    async def one(self, req: tuple[bytes, bytes], cpu: list[list[int]] | None = None) -> None:
        """One request's stream, as gRPC runs it; ``cpu``: append each phase's thread CPU ns."""
        self.clock.now += STEP_S
        if self.clock.now - self._scraped >= SCRAPE_S:
            self._scrape()
        feed = _Feed()
        stream = self.svc.Process(feed, None)
        raws = [req[0], req[1], *([RESPONSE_HEADERS] if self.send_response else [])]
        for k, raw in enumerate(raws):
            t0 = time.thread_time_ns()
            feed.next = read_request(raw)
            out = (await anext(stream)).SerializeToString()
            if cpu is not None:
                cpu[k].append(time.thread_time_ns() - t0)
            if self.keep:  # map fields (the metadata Struct) serialise in no fixed order
                self.answers.append(pb.ProcessingResponse.FromString(out).SerializeToString(
                    deterministic=True))
        t0 = time.thread_time_ns()
        async for _ in stream:  # the stream ends: the finally releases the booking
            raise RuntimeError("an answer past the last message")
        if cpu is not None:
            cpu[3].append(time.thread_time_ns() - t0)

    async def run(self, n: int) -> dict[str, np.ndarray]:
        cpu: list[list[int]] = [[], [], [], []]
        for k in range(n):
            await self.one(self.requests[k % len(self.requests)], cpu)
        if self.router.open_requests:
            raise RuntimeError(f"{self.router.open_requests} decisions left open")
        out = {p: np.array(v) / 1e3 for p, v in zip(PHASES, cpu, strict=True) if v}
        out["total"] = sum(out.values())
        return out


def _report(mode: str, rounds: list[dict[str, np.ndarray]]) -> None:
    print(f"mode {mode} ({'response headers skipped' if mode == 'skip' else 'all three messages'})"
          f": thread CPU per request, us; median of {len(rounds)} rounds' p50 / p90")
    for phase in (*PHASES, "total"):
        if phase not in rounds[0]:
            continue
        p50 = float(np.median([np.percentile(r[phase], 50) for r in rounds]))
        p90 = float(np.median([np.percentile(r[phase], 90) for r in rounds]))
        print(f"  {phase:17s} p50 {p50:8.1f}  p90 {p90:8.1f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4000, help="timed requests per round")
    ap.add_argument("--repeats", type=int, default=3, help="rounds per mode (interleaved)")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--profile", action="store_true", help="cProfile one round per mode")
    ap.add_argument("--digest", action="store_true", help="hash of every answer, no timing")
    args = ap.parse_args(argv)
    benches = {m: Bench(m) for m in args.modes}
    if args.digest:
        for m, b in benches.items():
            b.keep = True
            asyncio.run(b.run(args.requests))
            print(m, hashlib.sha256(b"".join(b.answers)).hexdigest(), len(b.answers))
        return
    if args.profile:
        for m, b in benches.items():
            prof = cProfile.Profile()
            prof.enable()
            asyncio.run(b.run(args.requests))
            prof.disable()
            print(f"--- {m}: {args.requests} requests")
            pstats.Stats(prof).sort_stats("tottime").print_stats(35)
        return
    rounds: dict[str, list[dict[str, np.ndarray]]] = {m: [] for m in benches}
    for _ in range(args.repeats):
        for m, b in benches.items():
            asyncio.run(b.run(args.requests // 4))  # warm the round's caches
            rounds[m].append(asyncio.run(b.run(args.requests)))
    for m in benches:
        _report(m, rounds[m])


if __name__ == "__main__":
    main()
