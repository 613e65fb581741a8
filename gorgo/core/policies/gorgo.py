"""gorgo: the lowest cost under the fleet's objective, every registered term in milliseconds.

With `objective: ttft` (the GORGO paper's) that is the predicted TTFT = w_rtt*RTT + w_queue*queue
wait + uncached prefill (+ the failure penalty); with `objective: e2e` the decode term is added:
the request's own decode time on the replica and the delay it adds to the requests already
decoding there. Every term is in milliseconds so the weights stay near 1 and mean something.
"""

from __future__ import annotations

from gorgo.core.cost import cost_terms
from gorgo.core.decision import Decision
from gorgo.core.features import RequestFeatures
from gorgo.core.policies.base import PolicyBase
from gorgo.core.state import FleetState


class Gorgo(PolicyBase):
    name = "gorgo"

    def choose(self, f: RequestFeatures, s: FleetState) -> Decision:
        return self.pick_lowest(cost_terms(f, s).total(s.weights, s.spec.objective), s)
