"""gorgo: the lowest cost under the fleet's objective, every registered term in milliseconds.

With `objective: ttft` (the GORGO paper's) that is the predicted TTFT = w_rtt*RTT + w_queue*queue
wait + uncached prefill (+ the failure penalty); with `objective: e2e` the decode, interference
and reuse terms are added: the request's own decode time on the replica, the delay it adds to the
requests already decoding there, and the re-prefill the following turns repeat if it leaves the
replica that caches its prefix. Every term is in milliseconds so the weights stay near 1 and mean
something.

With `objective: slo` the request has targets: its trusted ``x-slo-ttft-ms`` / ``x-slo-tpot-ms``
headers, else the fleet's ``slo`` defaults (0: none). Among the replicas predicted to meet both
(predicted TTFT and predicted time per output token within target), the one with the lowest e2e
cost wins; when none is, the least violating one (the smallest largest ratio of prediction to
target), so a request is never refused for a target it cannot meet. This follows the Gateway API
Inference Extension's SLO-aware scheduling (headers and rule).
"""

from __future__ import annotations

import numpy as np

from gorgo.core.cost import cost_terms
from gorgo.core.decision import Decision
from gorgo.core.features import RequestFeatures
from gorgo.core.policies.base import PolicyBase
from gorgo.core.state import FleetState
from gorgo.core.terms import SLO, TTFT
from gorgo.core.terms.decode import expected_output, predicted_itl
from gorgo.core.terms.penalty import TERM as PENALTY


class Gorgo(PolicyBase):
    name = "gorgo"

    def choose(self, f: RequestFeatures, s: FleetState) -> Decision:
        terms = cost_terms(f, s)
        weights, objective = s.scoring()  # the request's model's, where the fleet sets them
        cost = terms.total(weights, objective)
        if objective == SLO:
            cost = self._slo_scores(f, s, terms.total(weights, TTFT, latency_only=True),
                                    terms[PENALTY.name] * weights.factor(PENALTY), cost)
        return self.pick_lowest(cost, s)

    def _slo_scores(self, f: RequestFeatures, s: FleetState, ttft: np.ndarray,
                    penalty: np.ndarray, cost: np.ndarray) -> np.ndarray:
        """The e2e cost where both targets are met; elsewhere above every such replica, ranked
        by violation, the failure penalty counted as TTFT (as in the e2e cost: a replica that
        fails fast must not look like the least violating one)."""
        target_ttft = f.slo_ttft_ms or s.spec.slo.ttft_ms
        target_tpot = f.slo_tpot_ms or s.spec.slo.tpot_ms
        violation = np.zeros(s.n)
        if target_ttft > 0:
            violation = np.maximum(violation, ttft / target_ttft)
        if target_tpot > 0:
            violation = np.maximum(violation, predicted_itl(f, s) / target_tpot)
        meets = violation <= 1.0
        if (meets & s.routable()).any():
            return np.where(meets, cost, np.inf)
        if target_ttft > 0:
            return np.maximum(violation, (ttft + penalty) / target_ttft)
        if target_tpot > 0:  # a TPOT target only: the penalty over the decode time it allows
            return violation + penalty / (target_tpot * np.maximum(expected_output(f, s), 1.0))
        return violation  # no target and nothing routable: refused by pick_lowest
