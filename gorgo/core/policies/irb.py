"""irb: a control plane solves routing weights, a data plane hashes requests by weight.

Source: the inference load balancer design in OpenAI's talk "Routing LLM Inference in
Production: From Engine Signals to Policy" (Qianru Lao, Lu Zhang; AI Engineer World's Fair 2026):
a controller turns demand, capacity/performance profiles, replica state and geography cost into
per-engine weights; a low-latency proxy applies them. Only the architecture is public; the
linear program below is ours.

Control plane (``refresh``, every ``refresh_interval_s``): demand is the request rate and mean
prompt tokens this router observes (``s.demand()``); a fleet of several models gets a plan per
model, over its replicas and the demand booked on them. Replica i prefills ``mu_i = prefill_rate_i /
mean_tokens`` requests/s and may be loaded to ``UTILISATION_CAP * mu_i``. Expected latency of
sending it ``x_i`` requests/s is RTT plus an M/M/1 sojourn, ``x_i * (rtt_i + 1/(mu_i - x_i))``;
that is convex, so it is cut into ``SEGMENTS`` equal slices of capacity, each priced at the
marginal latency at its midpoint, ``rtt_i + 1/(mu_i * (1 - rho)^2)`` (the first slice costs about
RTT plus the request's own prefill time, the TTFT profile). ``scipy.optimize.linprog`` (HiGHS)
minimises total latency subject to serving all demand within the slices; weights are each
replica's share. If demand exceeds the capped capacity of the routable replicas no assignment is
feasible: weights become proportional to capacity and ``plan.overloaded`` says so. TBOT does not
enter: the fleet file has no decode profile and the objective is TTFT.

Data plane (``choose``): weighted rendezvous hashing on the session key, ``score = -ln(u) / w``
with ``u`` from the key/replica hash, lowest wins; a request without a session gets a fresh key
from a seeded generator, so the weights split sessionless traffic by request, as the plan means.
A session keeps its replica while that replica's weight holds; an ejected replica's keys spread
over the others in proportion to their weights. ``choose`` only reads the last plan (it solves
one itself only if none exists yet); if no routable replica has weight (the weighted ones were
all ejected since the last solve) it hashes over routable replicas by capacity until the next
refresh. Scores: the rendezvous scores (inf where the weight is 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gorgo.core.decision import Decision
from gorgo.core.features import RequestFeatures
from gorgo.core.fleet import FleetSpec
from gorgo.core.policies.base import PolicyBase
from gorgo.core.policies.rendezvous import rendezvous_scores, replica_salts, request_key
from gorgo.core.state import FleetState

UTILISATION_CAP = 0.85
SEGMENTS = 8
REFRESH_INTERVAL_S = 1.0
MIN_DEMAND_RPS = 1e-3  # before any traffic, solve for a trickle: all weight on the best replica


@dataclass(frozen=True, slots=True)
class Plan:
    """One solve: weights per replica (shares of demand) and what they were solved for."""

    weights: np.ndarray
    rate_rps: float
    mean_tokens: float
    overloaded: bool
    expected_ms: float  # mean predicted latency under the plan (NaN when overloaded)
    solved_at: float


def solve_weights(
    rate_rps: float,
    mean_tokens: float,
    prefill_rate: np.ndarray,
    rtt_ms: np.ndarray,
    routable: np.ndarray,
    cap: float = UTILISATION_CAP,
    segments: int = SEGMENTS,
) -> tuple[np.ndarray, bool, float]:
    """(weights, overloaded, expected ms) minimising mean latency for the given demand."""
    weights = np.zeros(len(prefill_rate))
    idx = np.flatnonzero(routable)
    if idx.size == 0:
        return weights, False, float("nan")
    mu = prefill_rate[idx] / max(mean_tokens, 1.0)
    capacity = cap * mu
    lam = max(rate_rps, MIN_DEMAND_RPS)
    if lam >= capacity.sum():
        weights[idx] = capacity / capacity.sum()
        return weights, True, float("nan")
    from scipy.optimize import linprog  # only irb needs scipy: keep it off every router's import

    rho = (np.arange(segments) + 0.5) / segments * cap
    cost = rtt_ms[idx, None] + 1000.0 / (mu[:, None] * (1.0 - rho[None, :]) ** 2)
    upper = np.repeat(capacity / segments, segments)
    bounds = np.column_stack([np.zeros_like(upper), upper])
    res = linprog(cost.ravel(), A_eq=np.ones((1, upper.size)), b_eq=[lam], bounds=bounds,
                  method="highs")
    if not res.success:
        weights[idx] = capacity / capacity.sum()
        return weights, False, float("nan")
    weights[idx] = np.asarray(res.x).reshape(idx.size, segments).sum(axis=1) / lam
    return weights, False, float(res.fun) / lam


class Irb(PolicyBase):
    name = "irb"
    carried = ("rng",)
    seed_prefix = "irb:"
    refresh_interval_s = REFRESH_INTERVAL_S
    utilisation_cap = UTILISATION_CAP

    def __init__(self, spec: FleetSpec) -> None:
        super().__init__(spec)
        self.salts = replica_salts(spec)
        self.plan: Plan | None = None  # the whole fleet's
        self.plans: dict[str, Plan] = {}  # each model's, over its replicas and its own demand
        self.rng = self.generator()

    def refresh(self, s: FleetState) -> None:
        """Solve the fleet's plan and, in a fleet of several models, one per model: a model's
        requests may only go to its replicas, so one fleet-wide plan put all of a model's weight
        on another model's nearer replica and split its traffic by capacity, RTT unseen."""
        was = s.candidates
        try:
            s.candidates = None
            self.plan = self._solve(s)
            solved: dict[bytes, Plan] = {}
            plans = {}
            for model, mask in s.model_masks.items():
                key = mask.tobytes()
                if key not in solved:
                    s.candidates = mask
                    solved[key] = self._solve(s)
                plans[model] = solved[key]
            self.plans = plans
        finally:
            s.candidates = was

    def _solve(self, s: FleetState) -> Plan:
        """A plan over the routable replicas for the demand they are sent (`FleetState.demand`,
        both narrowed to ``s.candidates``)."""
        rate, tokens = s.demand()
        weights, overloaded, expected = solve_weights(
            rate, tokens, s.prefill_rate, s.rtt_or_default(), s.routable(),
            cap=self.utilisation_cap,
        )
        return Plan(weights, rate, tokens, overloaded, expected, s.now)

    def plan_for(self, f: RequestFeatures, s: FleetState) -> Plan:
        """The plan of the request's model (the fleet's one model when it names none, as
        `Router.candidates` resolves it), else the fleet's."""
        if self.plan is None:
            self.refresh(s)
        assert self.plan is not None
        if s.candidates is None:
            return self.plan
        model = self.spec.model_asked(f.model)
        return self.plans.get(model, self.plan) if model is not None else self.plan

    def choose(self, f: RequestFeatures, s: FleetState) -> Decision:
        w = self.plan_for(f, s).weights
        ok = s.routable()
        if not (ok & (w > 0)).any():
            w = np.where(ok, s.prefill_rate, 0.0)
        key = request_key(f) if f.session_key else int(self.rng.integers(0, 2**63))
        return self.pick_lowest(rendezvous_scores(key, self.salts, w), s)
