"""The GORGO cost: per replica, the weighted sum of the registered terms, in milliseconds.

With the shipped terms that is predicted TTFT = w_rtt * RTT + w_queue * queue wait + uncached
prefill, plus a decaying anomaly penalty so a replica that fails fast never looks cheap. The terms
themselves live in `gorgo.core.terms`; this module only evaluates and sums them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from gorgo.core.features import RequestFeatures
from gorgo.core.state import FleetState
from gorgo.core.terms import EXCLUDED, OBJECTIVES, TERMS, TTFT, CostTerm
from gorgo.core.weights import Weights


@dataclass(frozen=True, slots=True)
class CostTerms:
    """Each registered term per replica, unweighted, keyed by term name (ms)."""

    values: Mapping[str, np.ndarray]
    uncached_tokens: np.ndarray

    def __getitem__(self, name: str) -> np.ndarray:
        return self.values[name]

    def total(
        self, w: Weights, objective: str = TTFT, *, latency_only: bool = False
    ) -> np.ndarray:
        """The weighted sum per replica of the terms ``objective`` counts: the one place the terms
        are added up. The TTFT total is the predicted time to first token. ``latency_only`` leaves
        out the terms that are no latency prediction (fit EXCLUDED, such as the failure penalty):
        what admission control compares with the SLO."""
        out = np.zeros(len(self.uncached_tokens))
        for t in _COUNTED[objective, latency_only]:
            factor = w.factor(t)
            out += self.values[t.name] if factor == 1.0 else factor * self.values[t.name]
        return out

    def at(self, i: int) -> dict[str, float]:
        """Replica i's terms as plain floats (a decision's breakdown)."""
        return {t.name: float(self.values[t.name][i]) for t in TERMS}


# The terms each objective's total counts, with and without the ones that are no latency.
_COUNTED: dict[tuple[str, bool], tuple[CostTerm, ...]] = {
    (objective, latency_only): tuple(
        t for t in TERMS
        if objective in t.objectives and not (latency_only and t.fit == EXCLUDED))
    for objective in OBJECTIVES for latency_only in (False, True)}


def cost_terms(f: RequestFeatures, s: FleetState) -> CostTerms:
    """All terms for every replica at ``s.now``, vectorised; memoised per request and state."""
    key = (f, s.now, s.version)
    if s.terms_memo is not None and s.terms_memo[0] == key:
        return s.terms_memo[1]
    terms = CostTerms(
        values={t.name: t.compute(f, s) for t in TERMS},
        uncached_tokens=s.uncached_tokens(f),
    )
    s.terms_memo = (key, terms)
    return terms
