"""Offline discrete-event simulation: the live router's own code against modelled engines and links.

The router side is the very `Router`, `FleetState` and policy code `gorgo extproc` runs. It gets
the signals it would see live: an RTT EWMA from jittered probe samples every probe interval,
engine metrics scraped every scrape interval (read at the engine one way-delay after the scrape
starts and known to the router one way-delay later, so they are as stale as in reality), and
in-flight accounting released when the response's last byte is back. The replicas are
`sim.engine.Engine` on a virtual clock. There is no asyncio and no socket: one heap of timed events.

Network model: each one-way trip takes ``rtt/2`` plus normal jitter with sd ``jitter/sqrt(2)``, so
an RTT sample has the region's mean and sd, as `sim.link` does; never negative. A response stream
keeps one return delay for all its bytes (TCP keeps order), so TTFT = the engine's first token plus
the return delay, measured from the request's arrival at the router.

Hooks, for a controller that lives inside the simulation (the tuner bench): ``on_first_token`` is
called when a routed request's first token is back at the router (when Envoy's periodic access log
would first carry its TTFT; ``rec.ttft`` is set, ``rec.e2e`` not yet) and ``on_complete`` when its
last byte is back (when its span would end), each with the record and the decision that routed it,
in simulated time order (a request's first token before its end, also at the same instant);
``call_at`` runs a function at a simulated time, after everything else due at that instant. None
draws from the simulation's RNG, and first-token events are queued only when the hook is set, so a
run without hooks is exactly the run it always was, and a run with them is as deterministic.

Several routers (``routers=K``, `sim.routers`): K independent `Router`s, each with its own state,
links, intake, probe and scrape timers and share of the arrivals, all in front of the same
engines. Router 0 is the single router of K = 1, whose run is exactly the one-router run; it is
also ``self.router``, for the callers that read one router's state.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from gorgo.core.decision import Decision, Rejection, next_best
from gorgo.core.features import RequestFeatures, prompt_text
from gorgo.core.fleet import FleetSpec
from gorgo.core.peers import Booking
from gorgo.core.policies.base import Policy
from gorgo.core.router import TICK_INTERVAL_S, Router
from gorgo.sim.engine import Engine, EngineRejected, EngineRequest, StepResult
from gorgo.sim.kv_publish import HASH_ALGO, SimHashing
from gorgo.sim.profiles import replica_profile
from gorgo.sim.routers import (
    SAME,
    assign_routers,
    client_legs,
    link_from,
    router_regions,
    view_from,
)

# `Simulation.engine_hashes` keeps this many (request, replica) lookups: held whole, a trace's
# token ids and hashes per replica grew with the run (22 MiB for 300 requests on 3 replicas).
HASHES_KEPT = 4096
# Event kinds, in tie-break order at equal times (completions before new arrivals, an answer's
# headers before its end; hooks last; a held decision after the peers' bookings of its moment).
(STEP_END, FIRST_TOKEN, HEADERS, CLOSE, PROBE_DONE, SCRAPE_DONE, KV_EVENTS, SCRAPE_AT, SUBMIT,
 ARRIVE, PROBE, TICK, CALL, PEER, DECIDE) = range(15)
# Shared bookings (fleet `sharing:`): between routers of one region, this one-way delay (a message
# bus in the same data centre); between regions, half the RTT of their link (`link_from`).
PEER_LOCAL_S = 1e-3

# Router intake (added after bench/crosscheck.py compared this simulation with the live stack,
# see docs/results.md "Live cross-check"): the live router takes requests one at a time, and each
# costs about INTAKE_BASE_S + INTAKE_PER_TOKEN_S * prompt tokens before it leaves for its replica
# (Envoy buffering the body, the gRPC hop, JSON parsing and prefix hashing; the router's own part
# measures 0.3 ms at 1k tokens and 1.7 ms at 40k on the 2-core dev machine). Milliseconds, but
# decisive for the bursts of simultaneous requests in Mooncake: they are decided and booked in
# their arrival order, a millisecond or two apart; each one-way delay is drawn on its own, so on a
# jittery link they still reach an engine in any order (docs/results.md, "Where the Mooncake
# predictions go wrong"). Simultaneous requests arrive shortest prompt first (`arrival_order`), a
# tie the trace leaves open, broken the same way by the live load generator (`replay.replay`).
INTAKE_BASE_S = 0.5e-3
INTAKE_PER_TOKEN_S = 0.05e-6
# Envoy's default retry back-off (the rendered route sets none): the first retry waits a uniform
# random time below this base interval.
ENVOY_RETRY_BACK_OFF_S = 0.025


@dataclass(slots=True)
class RequestRecord:
    index: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    replica: int = -1
    status: int = 0  # 200 served, 503 no replica / engine queue full, 429 shed, 400 too large
    ttft: float = math.nan  # seconds, from arrival at the router; inf when refused
    e2e: float = math.nan
    itl: float = math.nan  # mean inter-token gap
    cached_tokens: int = 0  # engine's real prefix-cache hit
    predicted_ms: float = math.nan
    back_delay: float = 0.0
    first_at: float = math.nan
    client_ms: float = 0.0  # the client's way to its router and back (`sim.routers.client_legs`)


@dataclass
class SimResult:
    policy: str
    seed: int
    records: list[RequestRecord]
    regions: list[str]
    replica_region: list[int]
    sim_time_s: float
    events: int
    leaked_inflight: int
    extra: dict = field(default_factory=dict)

    def served(self) -> list[RequestRecord]:
        return [r for r in self.records if r.status == 200]



def _leaked(router: Router) -> int:
    """What a router still books at the end beyond its peers' open bookings (the last closes may
    still be on their way), counted as requests or as decode sequences, whichever is off more:
    a request of n choices released as one leaves n - 1 sequences booked."""
    s, peers = router.state, router.peers
    return max(abs(int(s.inflight_reqs.sum()) - len(peers)),
               abs(int(s.inflight_seqs.sum()) - peers.seqs))

class Network:
    """Jittered one-way delays per replica, from its region's link."""

    def __init__(self, spec: FleetSpec, rng: np.random.Generator) -> None:
        regions = {r.name: r for r in spec.regions}
        self.half = np.array([regions[r.region].rtt_ms / 2000.0 for r in spec.replicas])
        # One-way sd is the RTT sd / sqrt(2), so two legs add up to the region RTT sd.
        sd = [regions[r.region].jitter_ms / 1000.0 / math.sqrt(2) for r in spec.replicas]
        self.sd = np.array(sd)
        self.rng = rng

    def one_way(self, i: int) -> float:
        return max(0.0, self.half[i] + self.sd[i] * self.rng.standard_normal())

    def rtt_ms(self) -> np.ndarray:
        return self.half * 2000.0


@dataclass
class RouterSide:
    """One simulated router process and what the simulation keeps for it: its region and links,
    its open decisions, when its intake is next free, and when its latest KV-event batch from
    each replica lands."""

    region: str
    router: Router
    net: Network
    kv_at: list[float]
    decisions: dict[int, Decision] = field(default_factory=dict)
    free_at: float = 0.0  # when it has taken every request that arrived so far (see INTAKE_*)
    retrying: set[int] = field(default_factory=set)  # its Envoy's retries still open


def build_engines(spec: FleetSpec, speed: float = 1.0) -> list[Engine]:
    from gorgo.core.tokens import Tokenization

    tok = Tokenization(spec.chars_per_token, spec.block_tokens)
    engines = []
    for r in spec.replicas:
        sim = r.sim
        if sim is None:
            raise ValueError(f"replica {r.name}: the offline simulation needs engine: sim")
        engines.append(Engine(replica_profile(sim), tok, speed=speed * sim.speed,
                              kv_events=r.precise is not None))
    return engines


def arrival_order(arrivals: Sequence[float], features: Sequence[RequestFeatures]) -> list[int]:
    """The order requests reach the router: by arrival, simultaneous ones shortest body first,
    as `gorgo replay` sends them (see `Simulation.run`)."""
    return sorted(range(len(arrivals)), key=lambda k: (arrivals[k], features[k].prompt_tokens))


def _first_token_at(rec: RequestRecord, first_at: float, cached_tokens: int) -> None:
    rec.first_at = first_at
    rec.ttft = first_at + rec.back_delay - rec.arrival
    rec.cached_tokens = cached_tokens


class Simulation:
    """One run: a fleet, a policy, a trace (as prebuilt features), a seed and K routers."""

    def __init__(
        self,
        spec: FleetSpec,
        policy: str,
        *,
        seed: int = 0,
        speed: float = 1.0,
        fold: int = 64,
        policy_factory: Callable[[Simulation], Policy] | None = None,
        on_complete: Callable[[RequestRecord, Decision], None] | None = None,
        on_first_token: Callable[[RequestRecord, Decision], None] | None = None,
        intake: tuple[float, float] = (INTAKE_BASE_S, INTAKE_PER_TOKEN_S),
        routers: int = 1,
        placement: str = SAME,
    ) -> None:
        self.spec = spec
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.placement = placement
        regions = router_regions(spec, routers, placement)
        if policy_factory is not None and routers > 1:
            raise ValueError("a policy factory (the oracle) sees the whole fleet: one router only")
        self.net = Network(spec, self.rng)
        self.engines = build_engines(spec, speed)
        extra = {policy: policy_factory(self)} if policy_factory else None
        self.router = Router(replace(spec, policy=policy), id_prefix=f"s{seed}",
                             extra_policies=extra)
        self.sides = [RouterSide(regions[0], self.router, self.net, [0.0] * len(self.engines))]
        for j, region in enumerate(regions[1:], 1):
            # Its own name too: policies seed their generators from it, and peers draw apart.
            view = replace(view_from(spec, region), name=f"{spec.name}/router{j}", policy=policy)
            self.sides.append(RouterSide(region, Router(view, id_prefix=f"s{seed}r{j}"),
                                         Network(view, self.rng), [0.0] * len(self.engines)))
        self.policy = self.router.policies[policy]
        # A fleet with `sharing:`: every router publishes its bookings, each other router applies
        # them one delay later (`_publish`).
        self._peer_delay = [[0.0 if a == b else PEER_LOCAL_S if ra == rb
                             else link_from(spec, ra, rb)[0] / 2000.0
                             for b, rb in enumerate(regions)] for a, ra in enumerate(regions)]
        if spec.sharing is not None and routers > 1:
            for side in self.sides:
                side.router.share()
        self.fold = fold
        self._heap: list[tuple[float, int, int, object]] = []
        # Requests Envoy retried, each with the replica that refused its first attempt, until
        # the answer's headers tell the router (`_headers`).
        self._retried: dict[int, int] = {}
        self._followers: dict[int, list[int]] = {}  # request -> the turns waiting on its answer
        # Times of future arrivals and submissions: the only events that can change an engine's
        # batch, so they bound how far an engine may fold decode steps ahead.
        self._inputs: list[float] = []
        # Per engine, the times its state will be read (scrapes): a fold stops there too, so a
        # scrape reads what single steps would show, not the end of a folded block.
        self._reads: list[list[float]] = [[] for _ in self.engines]
        self._seq = itertools.count()
        self.now = 0.0
        self._busy = [False] * len(self.engines)
        self.on_complete = on_complete
        self.on_first_token = on_first_token
        self.intake = intake  # (seconds per request, seconds per prompt token); see INTAKE_*
        # `cache: precise` replicas: the simulated vLLM's hashing; each KV-event batch reaches
        # every router one way-delay later (in order as over TCP; no draw from the RNG).
        tok = self.router.state.tok
        # (features, hashes) by (id of the features, replica), the latest HASHES_KEPT
        self._engine_hashes_of: dict[tuple[int, int], tuple[RequestFeatures, np.ndarray]] = {}
        self._vllm = [r.metrics_flavor == "vllm" for r in spec.replicas]
        self._hashing = {i: SimHashing(tok, r.precise.hash_seed)
                         for i, r in enumerate(spec.replicas) if r.precise is not None}
        for side in self.sides:
            state = side.router.state
            for i, r in enumerate(spec.replicas):
                if r.sim is not None and r.sim.flavor == "vllm":  # its cache_config_info, scraped
                    bt = spec.block_tokens
                    state.observe_cache_config(
                        i, bt, self.engines[i].cache.capacity_tokens // bt, HASH_ALGO)
                if r.precise is not None:  # subscribed; the replay of an empty history answered
                    state.set_kv_synced(i, True)

    def call_at(self, t: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` at simulated time ``t`` (not before now); the run still ends with its last
        request, so a callback that reschedules itself does not keep it going."""
        self._push(max(t, self.now), CALL, fn)

    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self._heap, (t, kind, next(self._seq), payload))
        if kind in (ARRIVE, SUBMIT, DECIDE):
            heapq.heappush(self._inputs, t)
        elif kind == SCRAPE_AT:
            heapq.heappush(self._reads[payload[1]], t)  # type: ignore[index]

    def run(
        self,
        arrivals: Sequence[float],
        features: Sequence[RequestFeatures],
        output_tokens: Sequence[int],
        progress: Callable[[int], None] | None = None,
        follows: Sequence[int | None] | None = None,
    ) -> SimResult:
        """Replay the requests; with ``follows`` (the request each one continues, or None), a
        turn is sent at its time or once the answer it continues has ended, whichever is later
        (its record's arrival is when it was sent)."""
        n = len(arrivals)
        self.records = [
            RequestRecord(k, arrivals[k], features[k].prompt_tokens, output_tokens[k])
            for k in range(n)
        ]
        self._followers = {}
        for k, before in enumerate(follows or ()):
            if before is not None:
                if not 0 <= before < k:  # a later or missing turn would hold k for ever
                    raise ValueError(f"request {k} follows {before}, not an earlier request")
                self._followers.setdefault(before, []).append(k)
        if self._followers:
            # A turn sent when an answer ends is an input no fold could foresee: one reaching an
            # engine inside a folded block would join it late.
            self.fold = 1
        waiting = {k for ks in self._followers.values() for k in ks}
        self.features = features
        regions = [s.region for s in self.sides]
        self.home = assign_routers(features, self.spec, regions, self.placement,
                                   self.seed)  # the router each request arrives at
        for rec, leg in zip(self.records,
                            client_legs(features, self.spec, regions, self.home, self.seed),
                            strict=True):
            rec.client_ms = float(leg)
        # Requests that arrive at the same instant (Mooncake quantises its timestamps to ~3 s, up
        # to 28 per value) reach the router shortest body first, the order `gorgo replay` sends
        # them in: a tie the trace leaves open, broken alike by both drivers (bench/crosscheck.py
        # checks the live decision order; docs/results.md, Live cross-check).
        for k in arrival_order(arrivals, features):
            if k not in waiting:
                self._push(arrivals[k], ARRIVE, k)
        sig = self.spec.signals
        for j, side in enumerate(self.sides):
            state, net = side.router.state, side.net
            for i in range(len(self.engines)):
                # The router has been up a while: one RTT sample is known; timers are staggered.
                state.observe_rtt(i, (net.one_way(i) + net.one_way(i)) * 1000.0)
                self._push(self.rng.uniform(0, sig.probe_interval_s), PROBE, (j, i))
                self._push(self.rng.uniform(0, sig.scrape_interval_s), SCRAPE_AT, (j, i))
        for j in range(len(self.sides)):
            self._push(0.0, TICK, j)
        self._progress = progress
        events = 0
        heap = self._heap
        handlers = {
            ARRIVE: self._arrive, SUBMIT: self._submit, STEP_END: self._step_end,
            CLOSE: self._close, HEADERS: self._headers, PROBE: self._probe,
            PROBE_DONE: self._probe_done,
            SCRAPE_AT: self._scrape_at, SCRAPE_DONE: self._scrape_done, TICK: self._tick,
            CALL: self._call, KV_EVENTS: self._kv_events, FIRST_TOKEN: self._first_token,
            PEER: self._peer, DECIDE: self._decide,
        }
        self._open = n
        while heap and self._open > 0:
            t, kind, _, payload = heapq.heappop(heap)
            self.now = t
            events += 1
            handlers[kind](payload)
        s = self.router.state
        routers = [side.router for side in self.sides]
        return SimResult(
            policy=self.policy.name, seed=self.seed, records=self.records,
            regions=s.regions, replica_region=s.region_idx.tolist(), sim_time_s=self.now,
            events=events, leaked_inflight=sum(map(_leaked, routers)),
            extra={"shed": sum(r.shed_count for r in routers)},
        )

    # --- request path --------------------------------------------------------------------------

    def _arrive(self, k: int) -> None:
        """A request at its router, held there for the router's turn among its peers
        (`Router.stagger_s`: 0 without shared bookings), then decided."""
        hold = self.sides[self.home[k]].router.stagger_s(self.now)
        if hold > 0.0:
            self._push(self.now + hold, DECIDE, k)
        else:
            self._decide(k)

    def _decide(self, k: int) -> None:
        rec = self.records[k]
        side = self.sides[self.home[k]]
        d = side.router.route(self.features[k], self.now)
        if isinstance(d, Rejection):
            # Refused by the router (no replica, or shed): a failed request, as live.
            rec.status = d.status
            rec.ttft = rec.e2e = math.inf
            self._done(k)
            return
        rec.replica = d.replica
        rec.predicted_ms = d.predicted_ms
        side.decisions[k] = d
        if side.router.state.precise is not None:  # what extproc's warmer thread does next
            side.router.state.precise.warm(self.features[k])
        self._publish(self.home[k])
        base, per_token = self.intake
        sent = max(self.now, side.free_at) + base + per_token * self.features[k].prompt_tokens
        side.free_at = sent
        self._push(sent + side.net.one_way(d.replica), SUBMIT, k)

    def _done(self, k: int) -> None:
        """Request ``k`` ended (answered, failed or refused): the turns that waited for it go."""
        self._open -= 1
        for f in self._followers.pop(k, ()):
            rec = self.records[f]
            rec.arrival = max(rec.arrival, self.now)
            self._push(rec.arrival, ARRIVE, f)
        if self._progress is not None and self._open % 250 == 0:
            self._progress(len(self.records) - self._open)

    def _submit(self, k: int) -> None:
        rec = self.records[k]
        i = rec.replica
        side = self.sides[self.home[k]]
        rec.back_delay = side.net.one_way(i)
        back = self.now + rec.back_delay
        try:
            self.engines[i].submit(self.engine_request(k, i, self.now), self.now)
        except EngineRejected as exc:
            self._push(back, HEADERS, (k, i, exc.status))  # the refusal, back at the proxy
            return
        self._push(back, HEADERS, (k, i, 200))  # a stream's headers leave at once
        if not self._busy[i]:
            self._start_step(i)

    def _retry_to(self, k: int, side: RouterSide, status: int) -> int | None:
        """Where Envoy retries a refused attempt, as the rendered route does (fleet `retries`):
        a 503 before any byte, once, on the decision's next-best replica, while the proxy's
        retries in flight (from the retry's start to its attempt's headers) stay within
        ``budget_percent`` of its open requests (at least ``min_retry_concurrency``); None: the
        refusal is the answer."""
        r = self.spec.retries
        if status != 503 or not r.enabled or k in self._retried or k not in side.decisions:
            return None
        # Envoy's RetryBudget: max(min_retry_concurrency, floor(budget_percent % of open requests))
        if len(side.retrying) >= max(r.min_retry_concurrency,
                                     int(r.budget_percent / 100.0 * len(side.decisions))):
            return None
        return next_best(side.decisions[k])

    def _headers(self, payload: tuple[int, int, int]) -> None:
        """An answer's headers at the proxy. A 503 Envoy retries goes on to the next-best
        replica after its back-off, unseen by the router; any other answer reaches the router,
        which reads it as `extproc.service` does: a retry's first replica failed and the request
        moved; the replica that answered failed (5xx) or did not. A refusal is the end."""
        k, i, status = payload
        side = self.sides[self.home[k]]
        rec = self.records[k]
        if status != 200:
            fallback = self._retry_to(k, side, status)
            if fallback is not None:
                self._retried[k] = i
                side.retrying.add(k)
                rec.replica = fallback
                wait = float(self.rng.uniform(0.0, ENVOY_RETRY_BACK_OFF_S))
                self._push(self.now + wait + side.net.one_way(fallback), SUBMIT, k)
                return
        side.retrying.discard(k)  # the retry's attempt answered: its budget slot is free
        s = side.router.state
        first = self._retried.get(k)
        if first is not None and first != i:
            s.record_failed_response(first, self.now)
            side.router.reassign(side.decisions[k].id, i)
            self._publish(self.home[k])
        if status >= 500:
            s.record_failed_response(i, self.now)
        else:
            s.record_good_response(i)
        if status != 200:
            rec.status = status
            self._close(k)

    def engine_request(self, k: int, i: int, now: float) -> EngineRequest:
        """Request ``k`` as engine ``i`` receives it at ``now`` (a `cache: precise` replica hashes
        the prompt its own way)."""
        f = self.features[k]
        out = self.records[k].output_tokens
        own = self._own_blocks(f, i)
        if own is None:
            return EngineRequest(k, f.prompt_tokens, f.block_hashes, out, now)
        ids, hashes = own
        return EngineRequest(k, f.prompt_tokens, hashes, out, now, ids)

    def engine_hashes(self, f: RequestFeatures, i: int) -> np.ndarray:
        """The block hashes engine ``i`` keys its cache on for ``f``: for a bound that reads
        the engines' caches (`sim.oracle`, `sim.lookahead`), which found nothing cached on a
        `cache: precise` replica with the router's hashes. The bounds ask again for the same
        requests (those in transit, a rollout's horizon): the latest few are kept."""
        if i not in self._hashing:
            return f.block_hashes
        key = (id(f), i)
        hit = self._engine_hashes_of.get(key)
        if hit is None or hit[0] is not f:
            own = self._own_blocks(f, i)
            hit = (f, f.block_hashes if own is None else own[1])
            self._engine_hashes_of[key] = hit
            if len(self._engine_hashes_of) > HASHES_KEPT:
                del self._engine_hashes_of[next(iter(self._engine_hashes_of))]
        return hit[1]

    def _own_blocks(self, f: RequestFeatures, i: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(token ids, block hashes) of ``f``'s prompt as replica ``i``'s engine hashes it, where
        it hashes its own way (`cache: precise`); else None (the router's hashes are its)."""
        hashing = self._hashing.get(i)
        if hashing is None or f.endpoint is None or f.body is None:
            return None
        return hashing.blocks(prompt_text(f.endpoint, f.body))

    def pending(self, kind: int) -> list[tuple[float, object]]:
        """The queued events of one kind, as (time, payload), in no order: for a bound that sees
        the whole simulation (`sim.lookahead`)."""
        return [(t, p) for t, k, _, p in self._heap if k == kind]

    def _start_step(self, i: int) -> None:
        inputs, reads = self._inputs, self._reads[i]
        while inputs and inputs[0] < self.now:
            heapq.heappop(inputs)
        while reads and reads[0] < self.now:
            heapq.heappop(reads)
        horizon = min(inputs[0] if inputs else math.inf, reads[0] if reads else math.inf)
        res = self.engines[i].step(self.now, self.fold, horizon)
        if res.steps == 0:
            self._busy[i] = False
            return
        self._busy[i] = True
        self._push(res.end, STEP_END, (i, res))
        if self.on_first_token is not None:
            # A folded step ends after its first tokens are back: queue them from its start.
            for ft in res.first_tokens:
                back = res.first_end + self.records[ft.rid].back_delay
                self._push(back, FIRST_TOKEN, (ft.rid, res.first_end, ft.cached_tokens))

    def _step_end(self, payload: tuple[int, StepResult]) -> None:
        i, res = payload
        recs = self.records
        for ft in res.first_tokens:
            _first_token_at(recs[ft.rid], res.first_end, ft.cached_tokens)
        for fin in res.finished:
            rec = recs[fin.rid]
            rec.status = 200
            end = res.end + rec.back_delay
            rec.e2e = end - rec.arrival
            if fin.completion_tokens > 1:
                rec.itl = (res.end - rec.first_at) / (fin.completion_tokens - 1)
            self._push(end, CLOSE, fin.rid)
        if i in self._hashing:
            events = self.engines[i].take_kv_events()
            if events:
                for j, side in enumerate(self.sides):  # every router subscribes
                    side.kv_at[i] = max(self.now + side.net.half[i], side.kv_at[i])
                    self._push(side.kv_at[i], KV_EVENTS, (j, i, events))
        if self.engines[i].has_work():
            self._start_step(i)
        else:
            self._busy[i] = False

    def _close(self, k: int) -> None:
        side = self.sides[self.home[k]]
        d = side.decisions.pop(k)
        side.router.complete(d.id)
        self._publish(self.home[k])
        if self.on_complete is not None:
            self.on_complete(self.records[k], d)
        self._done(k)

    def _publish(self, j: int) -> None:
        """Router j's new bookings, on their way to every other router (sharing on)."""
        outbox = self.sides[j].router.outbox
        if not outbox:
            return
        for b in outbox:
            for j2, delay in enumerate(self._peer_delay[j]):
                if j2 != j:
                    self._push(self.now + delay, PEER, (j2, b))
        outbox.clear()

    def _peer(self, payload: tuple[int, Booking]) -> None:
        j, booking = payload
        self.sides[j].router.apply_peer(booking, self.now)

    def _first_token(self, payload: tuple[int, float, int]) -> None:
        k, first_at, cached = payload
        rec = self.records[k]
        _first_token_at(rec, first_at, cached)  # `_step_end` may come later (a folded step)
        if self.on_first_token is not None:
            self.on_first_token(rec, self.sides[self.home[k]].decisions[k])

    def _call(self, fn: Callable[[], None]) -> None:
        fn()

    # --- signals -------------------------------------------------------------------------------

    # Each carries (router, replica, ...): router j's own probe, scrape and subscription.

    def _probe(self, payload: tuple[int, int]) -> None:
        """Router j's probe of replica i, when due (`FleetState.probe_due`) as the live shell
        probes: an ejected replica was probed every interval and came back before its backoff
        ended (ejections lasted 0-2 s offline, 1-3 s live)."""
        j, i = payload
        if self.sides[j].router.state.probe_due(self.now)[i]:
            net = self.sides[j].net
            rtt = net.one_way(i) + net.one_way(i)
            self._push(self.now + rtt, PROBE_DONE, (j, i, rtt * 1000.0))
        self._push(self.now + self.spec.signals.probe_interval_s, PROBE, payload)

    def _probe_done(self, payload: tuple[int, int, float]) -> None:
        j, i, rtt_ms = payload
        state = self.sides[j].router.state
        state.observe_rtt(i, rtt_ms)
        state.record_success(i)

    def _scrape_at(self, payload: tuple[int, int]) -> None:
        j, i = payload
        m = self.engines[i].metrics()
        back = self.sides[j].net.one_way(i)
        # What the live scrape reads (`extproc.engine_metrics`): a vLLM's histogram of the
        # finished requests' tokens, else the counter of every token generated (offline read
        # the counter for every flavour: a vLLM's typical output learnt 2.9x high at 10 s).
        generated = (m.finished_generated_total if self._vllm[i] else m.generated_tokens_total)
        self._push(self.now + back, SCRAPE_DONE,
                   (j, i, m.num_waiting, m.num_running, m.kv_usage, generated,
                    m.requests_finished))
        self._push(self.now + self.spec.signals.scrape_interval_s, SCRAPE_AT, payload)

    def _scrape_done(self, payload: tuple) -> None:
        j, i, *load = payload
        self.sides[j].router.state.observe_engine(i, self.now, *load)

    def _kv_events(self, payload: tuple[int, int, list]) -> None:
        j, i, events = payload
        self.sides[j].router.state.apply_kv_events(i, events)

    def _tick(self, j: int) -> None:
        self.sides[j].router.tick(self.now)
        self._push(self.now + TICK_INTERVAL_S, TICK, j)

