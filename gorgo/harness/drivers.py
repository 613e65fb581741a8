"""The two drivers of one router, side by side: the offline simulator and the live ext_proc server.

`record_offline` runs a trace through `gorgo.sim.offline.Simulation` and logs every call the
simulator makes into the router: routes, completions, ticks and the signal updates (RTT samples,
health, engine scrapes), each with its simulated time. `replay_live` feeds the same log to a fresh
`Router` through the live server's own code on a fake clock: each request is one ext_proc stream
through `ExtProcService.Process` (headers, then the body that the simulator parsed, kept open until
its completion), the signals through `Signals.apply_probe` / `apply_scrape`, the ticks through
`Signals.tick`. If both drivers drive the router alike, the decision sequences are identical.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from extproc.engine_metrics import EngineLoad
from extproc.service import ExtProcService
from extproc.signals import Signals
from extproc.telemetry import RouterMetrics
from gorgo._xds.envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from gorgo._xds.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from gorgo.core.decision import Decision
from gorgo.core.fleet import FleetSpec
from gorgo.core.router import Router
from gorgo.sim.offline import Simulation
from gorgo.sim.traces import TraceRequest
from gorgo.sim.workload import CHAT_PATH, MODEL, tokenization, workload_from_requests


@dataclass(frozen=True, slots=True)
class Event:
    t: float
    kind: str  # route | complete | tick | probe | scrape
    args: tuple[Any, ...] = ()


@dataclass
class Recording:
    spec: FleetSpec  # the router's spec (the simulator renames the policy into it)
    bodies: list[bytes]  # request k's body, as the simulator parsed it
    events: list[Event]
    replicas: list[str | None]  # request k's replica, None when refused


def record_offline(spec: FleetSpec, policy: str, reqs: Sequence[TraceRequest], scale: float,
                   seed: int = 0) -> Recording:
    """Run the trace offline and log every router call the simulator makes."""
    tok = tokenization(spec)
    wl = workload_from_requests("parity", reqs, tok)
    bodies = [json.dumps(r.chat_body(tok, MODEL)).encode() for r in reqs]
    sim = Simulation(spec, policy, seed=seed)
    router, state = sim.router, sim.router.state
    index = {id(f): k for k, f in enumerate(wl.features)}
    of_decision: dict[str, int] = {}
    events: list[Event] = []
    replicas: list[str | None] = [None] * wl.n

    def now() -> float:
        return sim.now

    route, complete, tick = router.route, router.complete, router.tick
    observe_rtt, record_success, observe_engine = (
        state.observe_rtt, state.record_success, state.observe_engine)

    def logged_route(f, t):
        k = index[id(f)]
        events.append(Event(t, "route", (k,)))
        d = route(f, t)
        if isinstance(d, Decision):
            of_decision[d.id] = k
            replicas[k] = state.names[d.replica]
        return d

    def logged_complete(decision_id):
        events.append(Event(now(), "complete", (of_decision[decision_id],)))
        return complete(decision_id)

    def logged_tick(t):
        events.append(Event(t, "tick"))
        return tick(t)

    pending_ok: set[int] = set()

    def logged_rtt(i, rtt_ms):
        # The simulator samples RTT then marks the replica healthy; live does both in one call.
        pending_ok.add(i)
        events.append(Event(now(), "probe", (i, rtt_ms)))
        return observe_rtt(i, rtt_ms)

    def logged_success(i):
        if i in pending_ok:
            pending_ok.discard(i)
        else:
            events.append(Event(now(), "probe", (i, None)))
        return record_success(i)

    def logged_engine(i, t, *load):
        events.append(Event(t, "scrape", (i, *load)))
        return observe_engine(i, t, *load)

    router.route, router.complete, router.tick = logged_route, logged_complete, logged_tick
    state.observe_rtt, state.record_success, state.observe_engine = (
        logged_rtt, logged_success, logged_engine)
    sim.run((wl.arrivals * scale).tolist(), wl.features, wl.output_tokens)
    return Recording(router.spec, bodies, events, replicas)


class _Stream:
    """The request side of one ext_proc stream: headers, body, then open until completed."""

    def __init__(self, body: bytes) -> None:
        headers = {":path": CHAT_PATH, ":method": "POST", "content-type": "application/json",
                   "content-length": str(len(body))}
        self.messages = [
            pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=HeaderMap(headers=[
                HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]))),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
        ]
        self.done = asyncio.Event()

    async def __aiter__(self) -> AsyncIterator[pb.ProcessingRequest]:
        for m in self.messages:
            yield m
        await self.done.wait()


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _replica_of(answer: pb.ProcessingResponse) -> str | None:
    if answer.HasField("immediate_response"):
        return None
    fields = answer.dynamic_metadata.fields
    return fields["gorgo"].struct_value.fields["replica"].string_value


async def _replay(rec: Recording) -> list[str | None]:
    router = Router(rec.spec)
    clock = _Clock()
    metrics = RouterMetrics(router.state, lambda: router.open_requests)
    service = ExtProcService(router, metrics, clock=clock)
    signals = Signals(router, metrics, clock=clock)
    replicas: list[str | None] = [None] * len(rec.bodies)
    open_streams: dict[int, tuple[_Stream, Any]] = {}
    for ev in rec.events:
        clock.t = ev.t
        if ev.kind == "route":
            (k,) = ev.args
            stream = _Stream(rec.bodies[k])
            answers = service.Process(stream.__aiter__(), None)
            await answers.__anext__()  # headers: continue
            replicas[k] = _replica_of(await answers.__anext__())
            open_streams[k] = (stream, answers)
        elif ev.kind == "complete":
            stream, answers = open_streams.pop(ev.args[0])
            stream.done.set()
            async for _ in answers:  # the stream ends: the service releases the request
                pass
        elif ev.kind == "tick":
            signals.tick()
        elif ev.kind == "probe":
            signals.apply_probe(*ev.args)
        elif ev.kind == "scrape":
            i, *load = ev.args
            signals.apply_scrape(i, EngineLoad(*load))
    for stream, answers in open_streams.values():
        stream.done.set()
        async for _ in answers:
            pass
    return replicas


def replay_live(rec: Recording) -> list[str | None]:
    """Request k's replica when the recorded calls go through the live server's code."""
    return asyncio.run(_replay(rec))
