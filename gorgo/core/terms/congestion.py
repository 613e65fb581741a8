"""congestion: the wait this request's prefill adds to the requests that arrive behind it.

Each request that reaches replica i while this one's prefill is still ahead of it waits that
prefill, ``p_i = u_i / rate_i`` (``u_i`` the prompt tokens i does not cache), longer. Requests
reach i at ``lambda_i = lambda * rate_i / R``: this router's arrival rate ``lambda``, shared in
proportion to prefill rate among the routable replicas (``R`` the sum of their rates); and they
keep queueing behind it until i's queue, this request included, drains: a busy period of
``(w_i + p_i) / (1 - rho)`` at the fleet's prefill load ``rho = lambda * u_mean / R`` (``w_i``
the queue wait, ``u_mean`` the uncached tokens of a typical request; ``rho`` at most 0.9). So

    congestion_i = p_i * lambda_i * (w_i + p_i) / (1 - rho)
                 = (u_i * lambda / R) * (w_i + p_i) / (1 - rho)

Why: a choice greedy on its own time to first token loads the nearest replicas until their
queues cost as much as the far ones' round trips, so every request routed there waits about that
long; on the Azure trace the `ttft` objective's median TTFT was 0.4-0.6 s against 0.1-0.2 s
under `e2e`. Priced in, the objective minimises every request's first token, not just this one's:
measured over 4 traces x 3 fleets (docs/results.md, "What a request's prefill costs the requests
behind it"), gorgo@ttft's E2E p95 fell by up to 42 % with its p95 TTFT within 2 %.

Counted by the `ttft` objective only. Under `e2e` the same term traded TTFT for E2E (p95 TTFT
-1 to -21 %, E2E p95 -1 to +16 %): that objective's `interference` term already charges this
request's prefill to the requests decoding there, and its `decode` term spreads the load.
Not a latency of this request (fit EXCLUDED): left out of the predicted TTFT and of the weight
fit. ``lambda`` is the arrivals this router sees: routers that do not share bookings each see
their share of the traffic, so each prices the term at that share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gorgo.core.terms.base import EXCLUDED, TTFT, CostTerm

if TYPE_CHECKING:
    from gorgo.core.features import RequestFeatures
    from gorgo.core.state import FleetState

RHO_MAX = 0.9  # the busy period's factor is at most 1 / (1 - 0.9): the load estimate is rough


def _congestion(f: RequestFeatures, s: FleetState) -> np.ndarray:
    rate, _ = s.demand()  # requests/s
    ok = s.routable()
    if rate <= 0.0 or not ok.any():
        return np.zeros(s.n)
    rates = s.prefill_rate * ok
    fleet_rate = float(rates.sum())  # tokens/s
    typical = float(s.mean_uncached @ rates) / fleet_rate  # tokens/request
    rho = min(rate * typical / fleet_rate, RHO_MAX)
    uncached = s.uncached_tokens(f)
    ahead = (s.waiting_tokens() + uncached) * (1000.0 / s.prefill_rate)  # w_i + p_i, ms
    return uncached * (rate / fleet_rate / (1.0 - rho)) * ahead


TERM = CostTerm(
    name="congestion", doc="wait this request's prefill adds to the requests arriving behind it",
    compute=_congestion, fit=EXCLUDED, objectives=frozenset({TTFT}),
)
