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
presets, engines scraped at the fleet's interval, 1 s (`bench.dataplane.run.primed_service`).
Bodies: the data-plane bench's 8 KB multi-turn chats over shared system prompts
(`bench.dataplane.workload`), each the next turn of a conversation whose previous turn was routed
during warm-up; the headers are those Envoy forwards to the router. The clock is simulated (3 ms
per request, as at concurrency 1), so a run is deterministic: ``--digest`` prints a hash of every
answer's bytes, for checking that a change leaves every decision, header and metadata field as it
was.

Reported: thread CPU time per request in microseconds, median and p90 over the requests, split
by phase (headers, body, response headers, the stream's close), with all three messages and with
the response headers skipped (fleet ``extproc: {response_headers: skip}``).

Usage:
    python -m bench.hotpath                       # both modes, 4000 requests each
    python -m bench.hotpath --requests 10000 --repeats 3
    python -m bench.hotpath --profile             # cProfile of 4000 requests per mode
    python -m bench.hotpath --digest              # answers' sha256 per mode (no timing)
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import hashlib
import pstats
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench.dataplane.run import primed_service, scrape
from bench.dataplane.workload import (
    E2E_SIZE,
    RESPONSE_HEADERS,
    body_msg,
    headers_msg,
    make_workload,
)
from extproc.service import read_request
from gorgo._xds.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from gorgo.core.fleet import parse_fleet

FLEET = Path(__file__).resolve().parent.parent / "envoy" / "fleet.example.yaml"
STEP_S = 0.003  # simulated time between requests (concurrency 1: Envoy and the client run)
PHASES = ("headers", "body", "response_headers", "close")
MODES = {"send": {}, "skip": {"response_headers": "skip"}}


def _request(body: bytes) -> tuple[bytes, bytes]:
    """A request's two messages as gRPC receives them: headers, then the buffered body."""
    return headers_msg(body).SerializeToString(), body_msg(body).SerializeToString()


RESPONSE = RESPONSE_HEADERS.SerializeToString()


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
        self.svc = primed_service(spec, self.clock, id_prefix="hot", salt="hot",
                                  unbounded_prefix=False)
        self.router = self.svc.router
        self._scraped = self.clock.now
        self.scrape_s = spec.signals.scrape_interval_s  # the engines scraped as the fleet says
        self.send_response = not spec.extproc.skip_response_headers
        wl = make_workload(0, per_size=n_bodies, sizes=(E2E_SIZE,))
        self.requests = [_request(b) for b in wl.measured[E2E_SIZE]]
        self.answers: list[bytes] = []
        self.keep = False
        asyncio.run(self._warm(wl.warm))  # the previous turn of every measured conversation

    async def _warm(self, previous: list[bytes]) -> None:
        for b in previous:
            await self.one(_request(b))

    async def one(self, req: tuple[bytes, bytes], cpu: list[list[int]] | None = None) -> None:
        """One request's stream, as gRPC runs it; ``cpu``: append each phase's thread CPU ns."""
        self.clock.now += STEP_S
        if self.clock.now - self._scraped >= self.scrape_s:
            scrape(self.router.state, self.clock.now)
            self._scraped = self.clock.now
        feed = _Feed()
        stream = self.svc.Process(feed, None)
        raws = [*req, *([RESPONSE] if self.send_response else [])]
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
