"""The GORGO cost model: predicted TTFT per replica = RTT + queue wait + uncached prefill, in ms.

A replica that misbehaves also carries an anomaly penalty (ms, decaying): it is part of the cost
the `gorgo` policy minimises, so a replica that fails fast never looks cheap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gorgo.core.features import RequestFeatures
from gorgo.core.fleet import Weights
from gorgo.core.state import FleetState


@dataclass(frozen=True, slots=True)
class CostTerms:
    """Each term per replica, unweighted, in milliseconds."""

    rtt_ms: np.ndarray
    queue_ms: np.ndarray
    prefill_ms: np.ndarray
    uncached_tokens: np.ndarray
    penalty_ms: np.ndarray

    def total(self, w: Weights) -> np.ndarray:
        return w.rtt * self.rtt_ms + w.queue * self.queue_ms + self.prefill_ms + self.penalty_ms


def cost_terms(f: RequestFeatures, s: FleetState) -> CostTerms:
    """All three terms for every replica at ``s.now``, vectorised; memoised per request."""
    key = (f, s.now, s.version)
    if s.terms_memo is not None and s.terms_memo[0] == key:
        return s.terms_memo[1]
    ms_per_token = 1000.0 / s.prefill_rate
    uncached = s.uncached_tokens(f)
    terms = CostTerms(
        rtt_ms=s.rtt_or_default(),
        queue_ms=s.waiting_tokens() * ms_per_token,
        prefill_ms=uncached * ms_per_token,
        uncached_tokens=uncached,
        penalty_ms=s.penalty(),
    )
    s.terms_memo = (key, terms)
    return terms
