"""gorgo: lowest predicted TTFT = w_rtt*RTT + w_queue*queue wait + uncached prefill, all in ms.

Every term is in milliseconds so the weights stay near 1 and mean something: queue wait is the
prompt tokens waiting for prefill on the replica divided by its prefill rate, and the prefill term
is the uncached part of this prompt divided by the same rate.
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
        return self.pick_lowest(cost_terms(f, s).total(s.weights), s)
