"""oracle-lookahead (simulation only): the oracle's true view plus the trace's known future.

The greedy `oracle` sends each request where its own TTFT is lowest, blind to what that does to
the requests behind it. This bound also knows the arrivals to come. At each decision it takes the
``candidates`` replicas a greedy base policy ranks cheapest and, for each, rolls the whole fleet
forward on copies of the engines (`Engine.clone`, then the engine model's own step loop): this
request sent there, the next ``horizon`` arrivals of the trace routed by the base policy, and
every request already in the system carried on. The base policy is the greedy oracle (TTFT on the
true state); for ``e2e`` it adds the request's decode time and what it costs the requests
decoding there (`OracleLookahead._base_costs`): with the TTFT-greedy base, the rollouts' future
arrivals crowded the near replicas and the e2e bound lost to the peers on E2E (docs/results.md).
It keeps the candidate whose rollout has the lowest objective summed over every request the
rollout follows:

- ``ttft``: first-token times of the requests without a first token yet (queued, prefilling, on
  the link), this one and the ``horizon`` next;
- ``e2e``: completion times of every request in the system, this one and the ``horizon`` next
  (decoding rolled forward to the end, so a prefill that slows a replica's decoding batch counts).

The fleet's ``objective`` chooses (``slo`` is not supported). The rollout is the simulation's own
engine model, but its links take each one-way trip at the mean delay instead of a jittered draw,
and it draws nothing from the simulation's RNG, so a run differs from another policy's only by
its choices. This is a rollout policy over its base policy: on its own model and window it does
at least as well as the base policy's choice (which is always a candidate), but it is not the
optimal assignment, so it is a tighter reference than `oracle`, not a proven lower bound.

Parameters (`OracleLookahead`): ``horizon`` H future arrivals (default 16), ``candidates`` C
(default 3). A decision costs C rollouts, each ``len(engines)`` engine clones plus the steps until
every followed request is done; ``stats`` counts them.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time

import numpy as np

from gorgo.core.decision import Decision
from gorgo.core.features import RequestFeatures
from gorgo.core.policies.base import PolicyBase
from gorgo.core.state import FleetState
from gorgo.core.terms.base import E2E, TTFT
from gorgo.sim.engine import Engine, EngineRejected, StepResult
from gorgo.sim.offline import STEP_END, Simulation, arrival_order
from gorgo.sim.oracle import greedy_costs, in_transit, prefill_ms_per_token, uncached_tokens

LOOKAHEAD = "oracle-lookahead"
DEFAULT_HORIZON = 16
DEFAULT_CANDIDATES = 3
LOOKAHEAD_OBJECTIVES = (TTFT, E2E)
# A request an engine refuses in a rollout counts as done this long after its refusal.
REJECTED_PENALTY_S = 600.0
# Rollout event kinds, in the simulation's tie-break order (steps end before inputs land).
_STEP_END, _SUBMIT, _ARRIVE = range(3)


class OracleLookahead(PolicyBase):
    name = LOOKAHEAD

    def __init__(self, sim: Simulation, horizon: int = DEFAULT_HORIZON,
                 candidates: int = DEFAULT_CANDIDATES, objective: str | None = None) -> None:
        super().__init__(sim.spec)
        objective = objective or sim.spec.objective
        if objective not in LOOKAHEAD_OBJECTIVES:
            raise ValueError(f"{LOOKAHEAD}: objective {objective!r} is not supported "
                             f"({', '.join(LOOKAHEAD_OBJECTIVES)})")
        if horizon < 0 or candidates < 1:
            raise ValueError(f"{LOOKAHEAD}: need horizon >= 0 and candidates >= 1")
        self.sim = sim
        self.horizon = horizon
        self.candidates = candidates
        self.objective = objective
        self.rtt_ms = sim.net.rtt_ms()
        self.half_s = sim.net.half
        self.ms_per_token = prefill_ms_per_token(sim.engines)
        self._order: list[int] | None = None
        self._next = 0
        # Cost of the bound: decisions, those that left the greedy choice, rollouts, engine steps
        # and clones in them, and seconds spent cloning and rolling out.
        self.stats = {"decisions": 0, "non_greedy": 0, "rollouts": 0, "steps": 0, "clones": 0,
                      "clone_s": 0.0, "rollout_s": 0.0}

    # -- the real decision ------------------------------------------------------------------
    def choose(self, f: RequestFeatures, s: FleetState) -> Decision:
        sim = self.sim
        k = self._index(f)
        step_end: list[float | None] = [None] * len(sim.engines)
        for t, (i, _) in sim.pending(STEP_END):  # type: ignore[misc]
            step_end[i] = t
        submits, transit = in_transit(sim)
        greedy = self._base_costs(sim.engines, transit, f, sim.records[k].output_tokens)
        masked = np.where(s.routable(), greedy, np.inf)
        order = [int(i) for i in np.argsort(masked, kind="stable") if np.isfinite(masked[i])]
        cands = order[: self.candidates]
        self.stats["decisions"] += 1
        if len(cands) <= 1:
            return self.pick_lowest(greedy, s)  # raises NoReplicaAvailable when none is routable
        nxt = self._order[self._next: self._next + self.horizon]  # type: ignore[index]
        scores = np.full(len(sim.engines), np.inf)
        for c in cands:  # greedy-cheapest first: a tie keeps the greedier choice
            scores[c] = self._rollout(k, c, step_end, submits, nxt)
        best = min(cands, key=lambda c: scores[c])
        self.stats["non_greedy"] += best != cands[0]
        return Decision(replica=best, policy=self.name, scores=scores)

    def _index(self, f: RequestFeatures) -> int:
        """The trace index of the request being routed: requests reach the router in
        `arrival_order`; one the router refused before asking the policy is skipped."""
        sim = self.sim
        if self._order is None:
            self._order = arrival_order([r.arrival for r in sim.records], sim.features)
        while sim.features[self._order[self._next]] is not f:
            self._next += 1
        self._next += 1
        return self._order[self._next - 1]

    def _base_costs(self, engines: list[Engine], transit: list[int], f: RequestFeatures,
                    output_tokens: int) -> np.ndarray:
        """The base policy's cost (ms) per engine, which ranks the candidates and routes the
        rollouts' future arrivals: the greedy oracle's TTFT; for ``e2e`` plus the decode time
        at the engine's step time with one more request running, and what this request's
        prefill and decoding add to the requests decoding there (`EngineProfile.step_time_s`
        terms, on the true state)."""
        uncached = [uncached_tokens(self.sim, e, i, f) for i, e in enumerate(engines)]
        cost = greedy_costs(engines, self.rtt_ms, self.ms_per_token, transit, uncached)
        if self.objective != E2E:
            return cost
        for i, e in enumerate(engines):
            m = e.metrics()
            p = e.profile
            ctx = m.kv_usage * e.cache.capacity_tokens + f.prompt_tokens
            itl_ms = p.step_time_s(0, m.num_running + 1, ctx) * 1000.0 / e.speed
            per_step_ms = (p.c_decode_ms_per_seq + p.c_attn_ms_per_ktoken * (
                f.prompt_tokens + output_tokens / 2) / 1000.0) / e.speed
            others = m.num_decoding * (output_tokens * per_step_ms
                                       + uncached[i] * self.ms_per_token[i])
            cost[i] += output_tokens * itl_ms + others
        return cost

    # -- one rollout ------------------------------------------------------------------------
    def _rollout(self, k: int, choice: int, step_end: list[float | None],
                 submits: list[tuple[float, int, int]], future: list[int]) -> float:
        """The objective summed over the followed requests with request ``k`` sent to
        ``choice``: the whole fleet rolled forward on clones of the engines."""
        sim = self.sim
        feats, recs = sim.features, sim.records
        e2e = self.objective == E2E
        t0 = time.perf_counter()
        # An engine with nothing followed on it (ttft: all its requests decoding; e2e: idle)
        # stays the real one, only read, until the rollout sends it a request: until then its
        # queue and its cached blocks cannot change, only its decoding advances, which `wake`
        # replays exactly. The rest are cloned now.
        real = sim.engines
        n = len(real)
        metrics = [e.metrics() for e in real]
        lazy = [m.num_waiting == 0 and m.num_running == (0 if e2e else m.num_decoding)
                for m in metrics]
        engines = [e if quiet else e.clone() for e, quiet in zip(real, lazy, strict=True)]
        clones = n - sum(lazy)
        clone_s = time.perf_counter() - t0
        heap: list[tuple[float, int, int, object]] = []
        inputs: list[float] = []  # times of the pending submissions and arrivals (fold horizon)
        seq = itertools.count()
        busy = [False] * n
        transit = [0] * n
        back: dict[int, float] = {}  # return delay of the requests the rollout routes

        def push(t: float, kind: int, payload: object) -> None:
            heapq.heappush(heap, (t, kind, next(seq), payload))
            if kind != _STEP_END:
                heapq.heappush(inputs, t)

        def send(j: int, i: int, at: float) -> float:
            """Request ``j`` leaves the router for engine ``i`` after its intake; returns when
            the intake is next free."""
            base, per_token = sim.intake
            sent = max(at, free) + base + per_token * feats[j].prompt_tokens
            tokens = uncached_tokens(sim, engines[i], i, feats[j])
            transit[i] += tokens
            back[j] = self.half_s[i]
            push(sent + self.half_s[i], _SUBMIT, (j, i, tokens))
            return sent

        def start(i: int, now: float) -> None:
            while inputs and inputs[0] < now:
                heapq.heappop(inputs)
            res = engines[i].step(now, sim.fold, inputs[0] if inputs else math.inf)
            self.stats["steps"] += 1
            busy[i] = res.steps > 0
            if busy[i]:
                push(res.end, _STEP_END, (i, res))

        def wake(i: int, now: float) -> None:
            """Clone a lazy engine and replay its decoding up to ``now``, where the rollout
            first sends it a request: the steps the full rollout would have run (the fold
            horizon changes how steps are grouped, not their state or times)."""
            nonlocal clones, clone_s
            c0 = time.perf_counter()
            e = engines[i] = real[i].clone()
            clone_s += time.perf_counter() - c0
            lazy[i] = False
            clones += 1
            t = step_end[i]
            if t is None:  # idle
                return
            while e.has_work() and t <= now:  # a step due at ``now`` starts before the input
                t = e.step(t, sim.fold, now).end
                self.stats["steps"] += 1
            busy[i] = t > now
            if busy[i]:
                push(t, _STEP_END, (i, None))

        # What is followed: requests without a first token (ttft) or unfinished (e2e), already
        # in the engines or on the link, plus this one and the future ones.
        left = len(submits) + 1 + len(future)
        for m in metrics:
            left += m.num_waiting + m.num_running - (0 if e2e else m.num_decoding)
        for i, t in enumerate(step_end):
            if t is not None and not lazy[i]:  # mid-step: its state is the step's end, due at t
                busy[i] = True
                push(t, _STEP_END, (i, None))
        for t, j, i in submits:
            tokens = uncached_tokens(sim, engines[i], i, feats[j])
            transit[i] += tokens
            push(t, _SUBMIT, (j, i, tokens))
        free = sim.sides[0].free_at  # one router: a bound sees the whole fleet
        free = send(k, choice, sim.now)
        for j in future:
            push(recs[j].arrival, _ARRIVE, j)

        total = 0.0
        now = sim.now
        while heap and left > 0:
            now, kind, _, payload = heapq.heappop(heap)
            if kind == _STEP_END:
                i, res = payload  # type: ignore[misc]
                if isinstance(res, StepResult):
                    done = res.finished if e2e else res.first_tokens
                    at = res.end if e2e else res.first_end
                    for r in done:
                        total += at + back.get(r.rid, 0.0)
                    left -= len(done)
                if engines[i].has_work():
                    start(i, now)
                else:
                    busy[i] = False
            elif kind == _SUBMIT:
                j, i, tokens = payload  # type: ignore[misc]
                transit[i] -= tokens
                if lazy[i]:
                    wake(i, now)
                try:
                    engines[i].submit(sim.engine_request(j, i, now), now)
                except EngineRejected:
                    total += now + REJECTED_PENALTY_S
                    left -= 1
                    continue
                if not busy[i]:
                    start(i, now)
            else:
                j = payload  # type: ignore[assignment]
                cost = self._base_costs(engines, transit, feats[j], recs[j].output_tokens)
                free = send(j, int(np.argmin(cost)), now)
        total += left * (now + REJECTED_PENALTY_S)  # stuck (nothing left to run): as refused
        st = self.stats
        st["rollouts"] += 1
        st["clones"] += clones
        st["clone_s"] += clone_s
        st["rollout_s"] += time.perf_counter() - t0
        return total


def lookahead_factory(sim: Simulation) -> OracleLookahead:
    """For `Simulation(policy_factory=...)`: the lookahead bound on that run's engines, links and
    trace, with the default horizon and candidates and the fleet's objective."""
    return OracleLookahead(sim)
